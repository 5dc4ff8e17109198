"""FlexAttention straight over the paged cache: a logical BlockMask translated to physical pages.

FlexAttention computes ``softmax(q @ k.T * scale + mask) @ v`` for any mask given as a
``mask_mod(b, h, q_idx, kv_idx) -> bool``, and skips work with a *BlockMask*: for every
``(batch, head, query block)`` a list of the KV blocks (``kv_block_size`` tokens each) worth
visiting. To run it on a paged cache without gathering pages, we hand it the cache itself as
one long physical K/V sequence and translate the mask from logical to physical coordinates::

    k_cache: [num_pages, page_size, num_kv_heads, head_dim]
      -> view  [1, num_kv_heads, num_pages * page_size, head_dim]    (no copy)

    physical position x  <->  page x // page_size, offset x % page_size

Two things must be translated, and both must stay correct for any page size:

1. **Which blocks to visit** (the BlockMask's ``kv_indices``). The logical BlockMask lists
   logical KV blocks. Each is cut into *units* of ``gcd(page_size, kv_block_size)`` tokens; a
   unit lies inside one logical page, so the page table sends it to one physical place, and
   being aligned it lies inside one physical block. The physical BlockMask visits each physical
   block that receives a used unit, **once**. When pages are smaller than a flex block (say
   ``page_size=16``, blocks of 128) one physical block holds pieces of up to eight pages, some
   of them other sequences'; when pages are larger, one page spans several blocks. Torch's
   experimental ``PagedAttention`` only accepts ``kv_block_size == page_size``; here page size
   and block size are independent (page sizes 1..128 and beyond with one block size).
   Logical blocks whose mask is all-True ("full") stay full only when a block sits inside one
   page (``page_size % kv_block_size == 0``); otherwise a physical block may hold foreign
   tokens and must be masked element by element.

2. **Which elements to keep** (the ``mask_mod``). A physical position is mapped back to its
   logical position through a physical->logical table ``p2l[b, page]`` (the logical page index
   of ``page`` in sequence ``b``, or ``-1`` when sequence ``b`` does not own it), then the
   logical mask is applied. This function masks:
     * pages sequence ``b`` does not own (another sequence's, free, or padding) - ``p2l == -1``;
     * positions past ``seq_lens[b]`` on its last page (torch's version skips this unless a
       ``kv_len`` is passed, and then attends to the unwritten tail of the page);
     * for prefill, the causal bound and the padding query rows.
   ``p2l`` is rebuilt on every call from the block table that is passed in, so it cannot go
   stale when a sequence is freed and its pages reused (torch's ``erase`` writes ``-1`` into a
   copy of its map and leaves the old owner's entries in place), and it is indexed by the same
   batch index ``b`` as the block table rows (torch's ``get_mask_mod`` indexes its map with the
   BlockMask's batch index even when a ``batch_idx`` remap was given).

A caveat shared by every block-sparse kernel: masked elements of a visited block still enter
the sum as ``0 * v``, and ``0 * nan`` is NaN. So the default KV block is *page aligned*
(:func:`default_kv_block_size`: the largest power of two dividing ``page_size``, at most 128):
a visited block then lies inside one of the sequence's own pages, and no other sequence's slot,
free page or stale page is ever read, whatever it holds. What remains is the unwritten tail of
a sequence's last page, which `PagedKVCache` keeps at zero (pages are zeroed when handed out).
A larger ``kv_block_size`` (say 128 with pages of 16, for bigger GPU tiles) visits blocks that
mix pages: then every slot of the cache must hold finite numbers.

On CUDA, ``flex_attention`` is compiled once per process (``torch.compile``) and reused; on
CPU it runs eagerly unless ``compiled=True`` (inductor's C++ template, block sparse like the
GPU kernel; seconds to compile per new shape). torch's CUDA kernels walk a BlockMask block in
tiles of ``BLOCK_M`` queries by ``BLOCK_N`` keys, which must divide the block sizes: its
default tiles (64 or 128 keys) do not divide a 16-token KV block, so every CUDA call passes
the tile of :func:`cuda_kernel_options`. Eager FlexAttention evaluates the ``mask_mod``
on every element and ignores the BlockMask's sparsity, so :func:`block_mask_visits` replays the
BlockMask the way a block-sparse kernel reads it; the tests use it to check the physical
BlockMask on CPU. Being dense, eager flex also reads every slot of the cache: it stays finite
only if the whole cache is (`PagedKVCache` keeps every slot that holds no token at zero; only
K/V a model wrote as NaN or Inf for some other sequence would leak).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    flex_attention,
)

from .._arith import cdiv, next_pow2
from ._checks import (
    check_block_size,
    check_contiguous,
    check_mask_arguments,
    check_mask_source,
    check_paged_inputs,
    check_prefill_inputs,
    check_table_pages,
    version,
)
from .flex_inspect import block_mask_visits

__all__ = [
    "PagedBlockMasks",
    "block_mask_visits",
    "cuda_kernel_options",
    "default_kv_block_size",
    "flex_paged_decode",
    "flex_paged_prefill",
    "logical_block_mask",
    "paged_block_masks",
    "physical_to_logical",
    "to_physical_block_mask",
]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DEFAULT_KV_BLOCK_SIZE = 128  # FlexAttention's own default tile
DEFAULT_Q_BLOCK_SIZE = 128
MIN_CUDA_KV_BLOCK_SIZE = 16  # Triton's smallest tile


def default_kv_block_size(page_size: int, device=None) -> int:
    """The KV block paged flex uses unless told otherwise: page aligned, so a block never mixes
    pages (see the module docstring). The largest power of two dividing ``page_size``, at most
    128; on CUDA at least 16 (smaller pages then share a block, and every slot must be finite).

    Example:
        >>> [default_kv_block_size(p) for p in (1, 12, 16, 48, 256)]
        [1, 4, 16, 16, 128]
    """
    block = min(DEFAULT_KV_BLOCK_SIZE, page_size & -page_size)
    if device is not None and torch.device(device).type == "cuda":
        block = max(block, MIN_CUDA_KV_BLOCK_SIZE)
    return block


# --------------------------------------------------------------------------------------------
# Logical side: what each query may see, in the sequence's own token positions.
# --------------------------------------------------------------------------------------------


def _logical_mask_mod(seq_lens: torch.Tensor, q_lens: torch.Tensor | None) -> MaskMod:
    """Logical mask: decode (``q_lens=None``) sees ``kv < seq_lens[b]``; prefill query row ``q``
    sits at position ``seq_lens[b] - q_lens[b] + q`` and sees keys up to it (rows past
    ``q_lens[b]`` see nothing)."""
    if q_lens is None:

        def decode_mask(b, h, q_idx, kv_idx):
            return kv_idx < seq_lens[b]

        return decode_mask

    def causal_prefill_mask(b, h, q_idx, kv_idx):
        q_pos = seq_lens[b] - q_lens[b] + q_idx  # logical position of this query
        return (q_idx < q_lens[b]) & (kv_idx <= q_pos) & (kv_idx < seq_lens[b])

    return causal_prefill_mask


def logical_block_mask(
    seq_lens: torch.Tensor,
    max_kv_len: int,
    *,
    q_len: int = 1,
    q_lens: torch.Tensor | None = None,
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE,
    q_block_size: int = DEFAULT_Q_BLOCK_SIZE,
) -> BlockMask:
    """The BlockMask over *logical* positions ``[0, max_kv_len)`` of each sequence.

    Args:
        seq_lens: int ``[batch]``.
        max_kv_len: logical KV length, ``max_pages * page_size``.
        q_len: query rows per sequence (1 for decode, ``max_q_len`` for prefill).
        q_lens: int ``[batch]`` new tokens per sequence (prefill, causal), or None (decode).

    Example:
        >>> bm = logical_block_mask(torch.tensor([5, 130]), 256, kv_block_size=64)
        >>> bm.kv_num_blocks.flatten().tolist()      # blocks of 64 that hold real tokens
        [1, 3]
    """
    return create_block_mask(
        _logical_mask_mod(seq_lens, q_lens),
        seq_lens.shape[0],
        None,
        q_len,
        max_kv_len,
        device=seq_lens.device,
        BLOCK_SIZE=(q_block_size, kv_block_size),
    )


# --------------------------------------------------------------------------------------------
# Logical -> physical.
# --------------------------------------------------------------------------------------------


def _used_pages(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return cdiv(seq_lens.long(), page_size)  # [batch]


def physical_to_logical(
    block_table: torch.Tensor, seq_lens: torch.Tensor, num_cols: int, page_size: int
) -> torch.Tensor:
    """Invert the block table: ``p2l[b, page]`` = logical page index of physical ``page`` in
    sequence ``b``, or ``-1`` if sequence ``b`` does not own it.

    Built only from the used entries of the given table (padding entries are ignored, whatever
    they hold), so it is never stale. ``num_cols >= num_pages`` (extra columns stay ``-1``).

    Args:
        block_table: int ``[batch, max_pages]``; seq_lens: int ``[batch]``.

    Returns:
        int64 ``[batch, num_cols]``.

    Example:
        >>> physical_to_logical(torch.tensor([[2, 0, 9]]), torch.tensor([4]), 4, 2).tolist()
        [[1, -1, 0, -1]]
    """
    batch, max_pages = block_table.shape
    logical = torch.arange(max_pages, device=block_table.device)  # [max_pages]
    used = logical[None, :] < _used_pages(seq_lens, page_size)[:, None]  # [batch, max_pages]
    # Unused entries are sent to a spare column `num_cols` that is cut off afterwards.
    cols = torch.where(used, block_table.long(), num_cols)  # [batch, max_pages]
    p2l = torch.full((batch, num_cols + 1), -1, dtype=torch.long, device=block_table.device)
    p2l.scatter_(1, cols, logical.expand(batch, max_pages).clone())
    return p2l[:, :num_cols]  # [batch, num_cols]


def _physical_mask_mod(logical_mod: MaskMod, p2l: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> MaskMod:
    """Wrap a logical mask_mod so it takes physical KV positions (see the module docstring)."""

    def physical_mask(b, h, q_idx, kv_idx):
        logical_page = p2l[b, kv_idx // page_size]  # -1: not sequence b's page
        logical_kv = logical_page * page_size + kv_idx % page_size
        owned = (logical_page >= 0) & (logical_kv < seq_lens[b])
        return owned & logical_mod(b, h, q_idx, logical_kv)

    return physical_mask


def _dense_blocks(num: torch.Tensor, idx: torch.Tensor, num_cols: int) -> torch.Tensor:
    """(kv_num_blocks [..., rows], kv_indices [..., rows, k]) -> bool [..., rows, num_cols]."""
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]  # [..., rows, k]
    dense = torch.zeros(*idx.shape[:-1], num_cols + 1, dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, torch.where(listed, idx.long(), num_cols), True)
    return dense[..., :num_cols]


def _ordered_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [..., rows, cols] -> (kv_num_blocks int32 [..., rows], kv_indices int32
    [..., rows, cols]) listing the True columns first, in increasing order."""
    num = dense.sum(-1, dtype=torch.int32)
    order = torch.sort(dense.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return num, order.to(torch.int32)


def to_physical_block_mask(
    logical: BlockMask,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_pages: int,
    page_size: int,
    *,
    q_lens: torch.Tensor | None = None,
) -> BlockMask:
    """Translate a logical BlockMask (from :func:`logical_block_mask`) to one over the physical
    cache ``[num_pages * page_size]`` positions, with the same block sizes.

    Args:
        logical: BlockMask over ``[max_q_len, max_pages * page_size]``, batch = block_table rows.
        block_table: int ``[batch, max_pages]``; seq_lens, q_lens: int ``[batch]`` (as given to
            :func:`logical_block_mask`).
        num_pages, page_size: of the cache.

    Returns:
        BlockMask over ``[max_q_len, num_pages * page_size]`` whose mask_mod takes physical
        positions. Each physical block is listed at most once per query block.
    """
    q_block, kv_block = logical.BLOCK_SIZE
    device = block_table.device
    batch, max_pages = block_table.shape
    n_logical_blocks = logical.kv_indices.shape[-1]
    n_physical_blocks = cdiv(num_pages * page_size, kv_block)
    unit = math.gcd(page_size, kv_block)  # aligned run inside one page and one block

    # Where each logical unit of each sequence lands in the physical cache.
    unit_start = torch.arange(n_logical_blocks * kv_block // unit, device=device) * unit  # [U]
    logical_page = (unit_start // page_size).clamp(max=max_pages - 1)  # [U]
    valid = unit_start[None, :] < seq_lens.long()[:, None]  # [batch, U]
    page = torch.where(valid, block_table.long()[:, logical_page], 0)  # [batch, U]
    physical_block = (page * page_size + unit_start % page_size) // kv_block  # [batch, U]
    owner_block = unit_start // kv_block  # [U] logical

    def translate(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Logical block list -> bool [batch, H, q_blocks, n_physical_blocks]."""
        dense = _dense_blocks(num, idx, n_logical_blocks)  # [batch, H, QB, n_logical]
        per_unit = dense[..., owner_block] & valid[:, None, None, :]  # [b, H, QB, U]
        target = physical_block[:, None, None, :].expand_as(per_unit)
        hits = torch.zeros(*per_unit.shape[:-1], n_physical_blocks, dtype=torch.int32, device=device)
        hits.scatter_add_(-1, target, per_unit.to(torch.int32))
        return hits > 0  # visit each block once

    partial = translate(logical.kv_num_blocks, logical.kv_indices)
    full = None
    if logical.full_kv_num_blocks is not None:
        logical_full = translate(logical.full_kv_num_blocks, logical.full_kv_indices)
        if page_size % kv_block == 0:
            full = logical_full  # a block lies inside one page: stays fully visible
        else:
            partial = partial | logical_full  # may share the block with foreign tokens

    p2l_cols = cdiv(n_physical_blocks * kv_block, page_size)  # covers padded blocks too
    p2l = physical_to_logical(block_table, seq_lens, p2l_cols, page_size)
    mask_mod = _physical_mask_mod(_logical_mask_mod(seq_lens, q_lens), p2l, seq_lens, page_size)
    num, idx = _ordered_blocks(partial)
    # Always hand over full-block lists (empty ones when nothing is fully visible): inductor's
    # CPU template for compiled flex_attention does not build without them (torch 2.13).
    full_num, full_idx = _ordered_blocks(full if full is not None else torch.zeros_like(partial))
    physical = BlockMask.from_kv_blocks(
        num,
        idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(q_block, kv_block),
        mask_mod=mask_mod,
        seq_lengths=(logical.seq_lengths[0], num_pages * page_size),
        compute_q_blocks=False,
    )  # forward only: no transposed lists needed
    physical.paged_ref_source = _table_source(block_table, seq_lens, q_lens)
    return physical


class PagedBlockMasks(NamedTuple):
    """Both views of one paged attention pattern (for drawing and for checking)."""

    logical: BlockMask  # over [q_len, max_pages * page_size]
    physical: BlockMask  # over [q_len, num_pages * page_size]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-level pictures, as a block-sparse kernel sees them: bool
        ``[batch, q_len, max_pages * page_size]`` (logical) and
        ``[batch, q_len, num_pages * page_size]`` (physical)."""
        return (block_mask_visits(self.logical)[:, 0] > 0, block_mask_visits(self.physical)[:, 0] > 0)


def paged_block_masks(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_pages: int,
    page_size: int,
    *,
    q_len: int = 1,
    q_lens: torch.Tensor | None = None,
    kv_block_size: int | None = None,
    q_block_size: int = DEFAULT_Q_BLOCK_SIZE,
) -> PagedBlockMasks:
    """Build the logical BlockMask and its physical translation.

    Args:
        block_table: int ``[batch, max_pages]``; seq_lens: int ``[batch]``.
        num_pages, page_size: of the cache.
        q_len: query rows (1 for decode, ``max_q_len`` for prefill).
        q_lens: int ``[batch]`` for causal prefill, None for decode.
        kv_block_size, q_block_size: FlexAttention tile sizes (powers of two); None:
            :func:`default_kv_block_size` (page aligned).

    ``masks.dense()`` gives the token-level pictures side by side (what a block-sparse kernel
    adds into each query's softmax), ready for ``imshow``.

    Example:
        >>> bt = torch.tensor([[3, 1], [0, 2]])
        >>> m = paged_block_masks(bt, torch.tensor([6, 3]), num_pages=4, page_size=4,
        ...                       kv_block_size=4)
        >>> [row[:n].tolist() for row, n in zip(m.physical.kv_indices[:, 0, 0],
        ...                                      m.physical.kv_num_blocks[:, 0, 0])]
        [[1, 3], [0]]
    """
    check_mask_arguments(block_table, seq_lens, q_lens, num_pages, page_size, q_len)
    if kv_block_size is None:
        kv_block_size = default_kv_block_size(page_size, block_table.device)
    check_block_size(kv_block_size)
    check_block_size(q_block_size, "q_block_size")
    check_table_pages(block_table, seq_lens, num_pages, page_size)
    return _block_masks(block_table, seq_lens, num_pages, page_size, q_len, q_lens, kv_block_size, q_block_size)


def _block_masks(block_table, seq_lens, num_pages, page_size, q_len, q_lens, kv_block_size, q_block_size):
    """`paged_block_masks` on arguments already checked."""
    logical = logical_block_mask(
        seq_lens,
        block_table.shape[1] * page_size,
        q_len=q_len,
        q_lens=q_lens,
        kv_block_size=kv_block_size,
        q_block_size=q_block_size,
    )
    physical = to_physical_block_mask(logical, block_table, seq_lens, num_pages, page_size, q_lens=q_lens)
    return PagedBlockMasks(logical, physical)


def _table_source(block_table, seq_lens, q_lens) -> tuple:
    """What a physical BlockMask was built from: the tensors, their in-place version counters
    and cheap copies of their values (checked on reuse, see `check_mask_source`)."""
    tensors = (block_table, seq_lens, q_lens)
    return (
        tensors,
        tuple(version(t) for t in tensors),
        tuple(None if t is None else t.detach().clone() for t in tensors),
    )


# --------------------------------------------------------------------------------------------
# The attention calls.
# --------------------------------------------------------------------------------------------

_COMPILED_FLEX = {}  # device type (and CPU thread count) -> torch.compile(flex_attention), built on first use
COMPILE_LIMIT = 256  # distinct shapes one process may compile flex_attention for


def _compile_key(device: torch.device) -> tuple:
    """What one compiled flex_attention is built for: the device type, and on CPU the thread count.

    Inductor's CPU flex kernel allocates its scratch buffers for the thread count it was compiled
    under and runs on however many threads the process has. torch 2.11 leaves that count out of
    the key of inductor's on-disk FX graph cache (2.13 has it), so there a kernel compiled by a
    one-thread process (the tests run with ``OMP_NUM_THREADS=1``) and loaded from the cache by a
    two-thread one writes past its buffers (heap corruption: ``double free or corruption``).
    Compiling with ``cpp.threads`` set to the current count puts the count into the cache key on
    any version, and a process that changes its count gets a callable compiled for the new one.
    """
    return (device.type, torch.get_num_threads()) if device.type == "cpu" else (device.type,)


def _flex_for(device: torch.device, compiled: bool | None = None):
    """The flex_attention to call: compiled on CUDA (and on CPU when ``compiled=True``), eager
    on CPU by default (a CPU compile costs seconds per new shape)."""
    if compiled is None:
        compiled = device.type == "cuda"
    if not compiled:
        return _eager_flex
    key = _compile_key(device)
    if key not in _COMPILED_FLEX:
        # static shapes: the CPU template's dynamic-shape code does not build (torch 2.13), and a
        # decode step keeps its shapes, so each (batch, cache) shape compiles once
        if device.type == "cpu":
            compiled_flex = torch.compile(flex_attention, dynamic=False, options={"cpp.threads": key[1]})
        else:
            compiled_flex = torch.compile(flex_attention, dynamic=True)
        # Past torch's default of 8 compiles per function, dynamo silently falls back to eager
        # flex, which is dense (reads every slot). Allow more shapes, and fail loudly rather
        # than fall back: a caller asking for the compiled path gets it or an error. The patch
        # is built once per thread and entered on every call (building one per call leaves
        # objects behind in torch's config machinery; one object may not be entered twice at
        # once in torch 2.11, hence one per thread).
        limits = threading.local()

        def call(*args, **kwargs):
            patch = getattr(limits, "patch", None)
            if patch is None:
                patch = limits.patch = torch._dynamo.config.patch(
                    recompile_limit=COMPILE_LIMIT, fail_on_recompile_limit_hit=True
                )
            with patch:
                return compiled_flex(*args, **kwargs)

        _COMPILED_FLEX[key] = call
    return _COMPILED_FLEX[key]


def cuda_kernel_options(
    dtype: torch.dtype, head_dim: int, q_len: int, group: int, block_size: tuple[int, int]
) -> dict[str, int]:
    """The query x key tile (``BLOCK_M`` x ``BLOCK_N``) compiled flex uses on CUDA.

    torch compiles flex into one of two kernels: a decoding kernel (fewer than 128 query rows,
    static batch and heads, a power-of-two GQA group) that packs ``q_len * group`` query rows
    of one KV head into a tile, and a general one (everything else, e.g. a prefill chunk or a
    batch that dynamo made symbolic). Both read a BlockMask block ``(q_block, kv_block)`` in
    whole tiles, so ``BLOCK_M`` must divide ``q_block`` and ``BLOCK_N`` divide ``kv_block``;
    the general kernel raises otherwise, and torch's default tiles for sm_80/sm_90 (64 or 128
    keys) do not divide a 16-token KV block. The tile chosen here divides both block sizes and
    is never larger than torch's own defaults for 16-bit and float32 inputs up to head_dim 128
    (so it fits the shared memory theirs fits): ``BLOCK_N`` at most 64 keys (32 for float32,
    half that past head_dim 128); ``BLOCK_M`` the query rows of one KV head rounded up to a
    power of two (the decoding kernel's own choice, a multiple of the group), at most 128 (32
    for float32 or past head_dim 128). ``tests/test_flex_cuda_tiles.py`` checks this against
    torch's CUDA heuristics for every shape the GPU run uses.

    Args:
        dtype, head_dim: of the queries.
        q_len: query rows per sequence (1 for decode).
        group: query heads per KV head.
        block_size: the BlockMask's ``(q_block, kv_block)``.

    Example:
        >>> cuda_kernel_options(torch.bfloat16, 128, 1, 4, (128, 16))
        {'BLOCK_M': 16, 'BLOCK_N': 16}
        >>> cuda_kernel_options(torch.bfloat16, 64, 1024, 4, (128, 128))
        {'BLOCK_M': 128, 'BLOCK_N': 64}
    """
    q_block, kv_block = block_size
    wide = dtype.itemsize <= 2 and head_dim <= 128  # torch's defaults: 128-row tiles here
    cap_m = 128 if wide else 32
    cap_n = (64 if dtype.itemsize <= 2 else 32) // (2 if head_dim > 128 else 1)
    rows = min(next_pow2(q_len * group), cap_m)  # the query rows of one KV head, capped
    block_m = max(16, next_pow2(group), rows)  # 16: tl.dot's smallest; whole groups for decoding
    return {"BLOCK_M": min(q_block, block_m), "BLOCK_N": min(kv_block, cap_n)}


def _eager_flex(*args, **kwargs):
    """flex_attention run eagerly on purpose (CPU), without its "use torch.compile" warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def _kv_block(kv_block_size, k_cache: torch.Tensor) -> int:
    if kv_block_size is None:
        return default_kv_block_size(k_cache.shape[1], k_cache.device)
    return check_block_size(kv_block_size)


def _flex_paged(
    q4, k_cache, v_cache, block_table, seq_lens, q_lens, scale, kv_block_size, block_mask, compiled, check_values
):
    """q4: [batch, Hq, q_len, D] -> [batch, Hq, q_len, D] over the physical cache, on inputs
    `check_paged_inputs` has checked (with ``check_values`` it has read the used block-table
    entries already; without, the mask checks the page ids it reads)."""
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, _, q_len, _ = q4.shape
    if q_len == 0:  # nothing to attend from (max_q_len 0)
        return q4.new_zeros(q4.shape)
    if block_mask is None:
        if not check_values:
            check_table_pages(block_table, seq_lens, num_pages, page_size)
        block_mask = _block_masks(
            block_table, seq_lens, num_pages, page_size, q_len, q_lens, kv_block_size, DEFAULT_Q_BLOCK_SIZE
        ).physical
    elif not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be None or the .physical BlockMask of "
            f"paged_block_masks(...), got {type(block_mask).__name__}"
        )
    elif block_mask.kv_num_blocks.shape[0] != batch or tuple(block_mask.seq_lengths) != (q_len, num_pages * page_size):
        raise ValueError(
            "block_mask must be the .physical BlockMask of paged_block_masks(...) for this "
            f"batch ({batch}), q_len ({q_len}) and cache ({num_pages} pages x {page_size}); got "
            f"batch {block_mask.kv_num_blocks.shape[0]}, seq_lengths {block_mask.seq_lengths}"
        )
    else:
        check_mask_source(block_mask, block_table, seq_lens, q_lens)
    # [num_pages, page_size, Hkv, D] -> [1, Hkv, num_pages * page_size, D]: a strided view,
    # broadcast over the batch (the BlockMask carries the batch dimension).
    k = k_cache.view(1, num_pages * page_size, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.view(1, num_pages * page_size, num_kv_heads, head_dim).transpose(1, 2)
    flex = _flex_for(q4.device, compiled)
    options = {}
    if flex is not _eager_flex and q4.device.type == "cuda":
        group = q4.shape[1] // num_kv_heads
        options["kernel_options"] = cuda_kernel_options(q4.dtype, head_dim, q_len, group, block_mask.BLOCK_SIZE)
    return flex(q4, k, v, block_mask=block_mask, scale=scale, enable_gqa=q4.shape[1] != num_kv_heads, **options)


def flex_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    kv_block_size: int | None = None,
    block_mask: BlockMask | None = None,
    check_values: bool = True,
    compiled: bool | None = None,
) -> torch.Tensor:
    """Decode attention with FlexAttention reading K/V in place from the paged cache.

    Same contract as :func:`paged_ref.attention.reference.reference_paged_decode`.

    Args:
        q: ``[batch, num_q_heads, head_dim]``.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``, contiguous,
            unwritten slots finite.
        block_table: int32 ``[batch, max_pages]``; seq_lens: int32 ``[batch]`` (>= 1).
        scale: default ``head_dim ** -0.5``.
        kv_block_size: FlexAttention's KV tile (power of two), independent of ``page_size``;
            None: :func:`default_kv_block_size` (page aligned: no other page is read). On CUDA
            keep it >= 16 (Triton's smallest tile).
        block_mask: ``paged_block_masks(block_table, seq_lens, num_pages, page_size).physical``
            built once and reused, e.g. by every layer of one decode step; None builds it here.
            It must describe the same block_table and seq_lens (checked: see `check_mask_source`).
        check_values: check values too (copies ``seq_lens`` and ``block_table`` to the host).
        compiled: run ``torch.compile(flex_attention)`` (block sparse: only listed blocks are
            read) or eager flex (every block evaluated, then masked); None: compiled on CUDA,
            eager on CPU.

    Returns:
        ``[batch, num_q_heads, head_dim]``, dtype of ``q``.

    Example:
        >>> kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
        >>> bt = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)   # 7: unused padding
        >>> out = flex_paged_decode(torch.randn(2, 8, 64), kc, vc, bt, torch.tensor([20, 5]))
        >>> out.shape
        torch.Size([2, 8, 64])
    """
    scale = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values)
    kv_block_size = _kv_block(kv_block_size, k_cache)
    check_contiguous(k_cache, v_cache)
    out = _flex_paged(
        q.unsqueeze(2),
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        None,
        scale,
        kv_block_size,
        block_mask,
        compiled,
        check_values,
    )  # [batch, Hq, 1, D]
    return out.squeeze(2)


def flex_paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    *,
    scale: float | None = None,
    kv_block_size: int | None = None,
    block_mask: BlockMask | None = None,
    check_values: bool = True,
    compiled: bool | None = None,
) -> torch.Tensor:
    """Causal prefill attention with FlexAttention over the paged cache.

    Same contract as :func:`paged_ref.attention.reference.reference_paged_prefill`: the last
    ``q_lens[b]`` of the ``seq_lens[b]`` cached tokens are the new ones whose queries are in
    ``q``; padding query rows come back as zeros.

    Args:
        q: ``[batch, num_q_heads, max_q_len, head_dim]``.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``.
        block_table: int32 ``[batch, max_pages]``; seq_lens, q_lens: int32 ``[batch]``.
        scale, kv_block_size, check_values, compiled: as in :func:`flex_paged_decode`.
        block_mask: ``paged_block_masks(..., q_len=max_q_len, q_lens=q_lens).physical``, or None.

    Returns:
        ``[batch, num_q_heads, max_q_len, head_dim]``, dtype of ``q``.

    Example:
        >>> kc, vc = torch.randn(4, 8, 1, 32), torch.randn(4, 8, 1, 32)
        >>> bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        >>> out = flex_paged_prefill(torch.randn(2, 2, 5, 32), kc, vc, bt,
        ...                          torch.tensor([12, 3]), torch.tensor([5, 3]))
        >>> out.shape, bool(out[1, :, 3:].eq(0).all())
        (torch.Size([2, 2, 5, 32]), True)
    """
    scale = check_prefill_inputs(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=check_values
    )
    kv_block_size = _kv_block(kv_block_size, k_cache)
    check_contiguous(k_cache, v_cache)
    return _flex_paged(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale, kv_block_size, block_mask, compiled, check_values
    )
