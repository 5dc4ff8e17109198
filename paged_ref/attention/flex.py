"""FlexAttention straight over the paged cache: a logical BlockMask translated to physical pages.

FlexAttention computes ``softmax(q @ k.T * scale + mask) @ v`` for a mask given as a
``mask_mod(b, h, q_idx, kv_idx) -> bool`` and skips work with a *BlockMask* (per query block, the
KV blocks of ``kv_block_size`` tokens worth visiting). We hand it the cache itself as one long
physical sequence, ``k_cache [num_pages, page_size, Hkv, D] -> [1, Hkv, num_pages * page_size, D]``
(a view), and translate the mask from logical to physical positions, for any page size:

1. **The block lists.** Each logical KV block is cut into units of ``gcd(page_size,
   kv_block_size)`` tokens; a unit lies inside one page and one physical block, and each
   physical block that receives a used unit is visited once. A full block stays full only when
   blocks lie inside pages (``page_size % kv_block_size == 0``).
2. **The mask_mod.** A physical position goes back to its logical one through ``p2l[b, page]``
   (the page's logical index in sequence ``b``, or -1), rebuilt from the given block table on
   every call so it never goes stale; positions past ``seq_lens[b]`` and, in prefill, after the
   query or on padding rows are masked.

A masked element of a visited block still adds ``0 * v``, and ``0 * nan`` is NaN, so the default
KV block is page aligned (:func:`default_kv_block_size`): no other page is ever read. Eager flex
(the CPU default) evaluates the mask_mod everywhere and reads every slot, which `PagedKVCache`
keeps finite; compiled flex (the CUDA default) is set up in `._flex_compiled`. Notebook 04 walks
through all of it, against torch's own ``PagedAttention``.

8-bit pages (``k_scale``, ``v_scale``): FlexAttention takes K and V in q's dtype only, so these backends
do not read 8-bit pages in place. Each call first dequantizes the pages the batch uses (bytes times their
scale, in float32) into a float32 copy of the whole cache (float64 for float64 q; the other pages 0),
then attends in that dtype: a copy per call, the size of the cache, that the other 8-bit backends avoid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from .._arith import cdiv
from ._checks import (
    check_block_mask,
    check_block_size,
    check_contiguous,
    check_mask_arguments,
    check_paged_inputs,
    check_prefill_inputs,
    check_table_pages,
    mask_source,
)
from ._flex_compiled import run_flex

__all__ = ["PagedBlockMasks", "default_kv_block_size", "flex_paged_decode", "flex_paged_prefill"]
__all__ += ["logical_block_mask", "paged_block_masks", "physical_to_logical", "to_physical_block_mask"]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DEFAULT_KV_BLOCK_SIZE = 128  # FlexAttention's own default tile
DEFAULT_Q_BLOCK_SIZE = 128
MIN_CUDA_KV_BLOCK_SIZE = 16  # Triton's smallest tile


def default_kv_block_size(page_size: int, device=None) -> int:
    """The default KV block: the largest power of two dividing ``page_size`` (page aligned: a block
    never mixes pages), at most 128; on CUDA at least 16 (smaller pages then share a block).

    Example:
        >>> [default_kv_block_size(p) for p in (1, 12, 16, 48, 256)]
        [1, 4, 16, 16, 128]
    """
    block = min(DEFAULT_KV_BLOCK_SIZE, page_size & -page_size)
    if device is not None and torch.device(device).type == "cuda":
        block = max(block, MIN_CUDA_KV_BLOCK_SIZE)
    return block


# --- Logical side: what each query may see, in the sequence's own token positions -------------


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
    """The BlockMask over *logical* positions ``[0, max_kv_len)`` of each sequence
    (``seq_lens: int [batch]``; ``q_lens: int [batch]`` for causal prefill of ``q_len`` rows, or None).

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


# --- Logical -> physical --------------------------------------------------------------------


def physical_to_logical(
    block_table: torch.Tensor, seq_lens: torch.Tensor, num_cols: int, page_size: int
) -> torch.Tensor:
    """The inverted block table, int64 ``[batch, num_cols]``: ``p2l[b, page]`` is the logical index
    of physical ``page`` in sequence ``b``, or -1 if ``b`` does not own it. Built from the used
    entries only (padding ignored); ``num_cols >= num_pages``.

    Example:
        >>> physical_to_logical(torch.tensor([[2, 0, 9]]), torch.tensor([4]), 4, 2).tolist()
        [[1, -1, 0, -1]]
    """
    batch, max_pages = block_table.shape
    logical = torch.arange(max_pages, device=block_table.device)  # [max_pages]
    used = logical[None, :] < cdiv(seq_lens.long(), page_size)[:, None]  # [batch, max_pages]
    # Unused entries are sent to a spare column `num_cols` that is cut off afterwards.
    cols = torch.where(used, block_table.long(), num_cols)  # [batch, max_pages]
    p2l = torch.full((batch, num_cols + 1), -1, dtype=torch.long, device=block_table.device)
    p2l.scatter_(1, cols, logical.expand(batch, max_pages).clone())
    return p2l[:, :num_cols]  # [batch, num_cols]


def _physical_mask_mod(logical_mod: MaskMod, p2l: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> MaskMod:
    """Wrap a logical mask_mod so it takes physical KV positions."""

    def physical_mask(b, h, q_idx, kv_idx):
        logical_page = p2l[b, kv_idx // page_size]  # -1: not sequence b's page
        logical_kv = logical_page * page_size + kv_idx % page_size
        owned = (logical_page >= 0) & (logical_kv < seq_lens[b])
        return owned & logical_mod(b, h, q_idx, logical_kv)

    return physical_mask


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
    """Translate a logical BlockMask (:func:`logical_block_mask`, ``[max_q_len, max_pages *
    page_size]``) to one over the cache's ``num_pages * page_size`` physical positions, same block
    sizes, each physical block listed at most once per query block."""
    q_block, kv_block = logical.BLOCK_SIZE
    n_physical_blocks = cdiv(num_pages * page_size, kv_block)
    partial, full = _physical_blocks(logical, block_table, seq_lens, n_physical_blocks, page_size)
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
    physical.paged_ref_source = mask_source(block_table, seq_lens, q_lens)
    return physical


def _physical_blocks(logical: BlockMask, block_table, seq_lens, n_physical_blocks: int, page_size: int):
    """``logical``'s partial and full block lists as ``bool [batch, heads, q_blocks, n_physical_blocks]``
    over the physical blocks its pages land in (full: None when no block is wholly one page's)."""
    kv_block = logical.BLOCK_SIZE[1]
    device = block_table.device
    max_pages = block_table.shape[1]
    n_logical_blocks = logical.kv_indices.shape[-1]
    unit = math.gcd(page_size, kv_block)  # aligned run inside one page and one block

    # Where each logical unit of each sequence lands in the physical cache.
    unit_start = torch.arange(n_logical_blocks * kv_block // unit, device=device) * unit  # [U]
    logical_page = (unit_start // page_size).clamp(max=max_pages - 1)  # [U]
    valid = unit_start[None, :] < seq_lens.long()[:, None]  # [batch, U]
    page = torch.where(valid, block_table.long()[:, logical_page], 0)  # [batch, U]
    physical_block = (page * page_size + unit_start % page_size) // kv_block  # [batch, U]
    owner_block = unit_start // kv_block  # [U] logical

    def translate(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Logical block list (``num [b, H, QB]`` entries of ``idx [b, H, QB, k]``) -> bool [b, H, QB, n_physical]."""
        listed = torch.arange(idx.shape[-1], device=device) < num[..., None]  # [b, H, QB, k]
        dense = torch.zeros(*idx.shape[:-1], n_logical_blocks + 1, dtype=torch.bool, device=device)
        dense.scatter_(-1, torch.where(listed, idx.long(), n_logical_blocks), True)  # unlisted: a spare last column
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
    return partial, full


class PagedBlockMasks(NamedTuple):
    """Both views of one paged attention pattern (for drawing and for checking)."""

    logical: BlockMask  # over [q_len, max_pages * page_size]
    physical: BlockMask  # over [q_len, num_pages * page_size]


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
    """The logical BlockMask and its physical translation.

    Args:
        block_table: int ``[batch, max_pages]``; seq_lens: int ``[batch]``.
        q_len, q_lens: query rows and int ``[batch]`` new tokens for causal prefill; decode: 1, None.
        kv_block_size, q_block_size: powers of two; None: :func:`default_kv_block_size`.

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


# --- The attention calls --------------------------------------------------------------------


def _flex_paged(
    q4, k_cache, v_cache, block_table, seq_lens, q_lens, scale, kv_block_size, block_mask, compiled, check_values
):
    """q4: [batch, Hq, q_len, D] -> [batch, Hq, q_len, D] over the physical cache, after the common
    checks: flex's own (without ``check_values``, the page ids the mask reads too), then flex."""
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    if kv_block_size is None:
        kv_block_size = default_kv_block_size(page_size, k_cache.device)
    check_block_size(kv_block_size)
    check_contiguous("it is viewed as one long physical sequence", k_cache=k_cache, v_cache=v_cache)
    q_len = q4.shape[2]
    if q_len == 0:  # nothing to attend from (max_q_len 0)
        return q4.new_zeros(q4.shape)
    if block_mask is None:
        if not check_values:
            check_table_pages(block_table, seq_lens, num_pages, page_size)
        block_mask = _block_masks(
            block_table, seq_lens, num_pages, page_size, q_len, q_lens, kv_block_size, DEFAULT_Q_BLOCK_SIZE
        ).physical
    else:
        check_block_mask(block_mask, block_table, seq_lens, q_lens, q_len, num_pages, page_size)
    # [num_pages, page_size, Hkv, D] -> [1, Hkv, num_pages * page_size, D]: a view, broadcast over
    # the batch (the BlockMask carries the batch dimension).
    k = k_cache.view(1, num_pages * page_size, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.view(1, num_pages * page_size, num_kv_heads, head_dim).transpose(1, 2)
    return run_flex(q4, k, v, block_mask, scale, compiled)


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention with FlexAttention reading K/V in place from the paged cache: the contract
    of :func:`~paged_ref.attention.reference.reference_paged_decode` (``k_cache``, ``v_cache``
    contiguous), plus:

    Args:
        kv_block_size: KV tile, a power of two independent of ``page_size`` (>= 16 on CUDA);
            None: :func:`default_kv_block_size`.
        block_mask: ``paged_block_masks(block_table, seq_lens, num_pages, page_size).physical``
            built once per step and reused by every layer (checked against the tables); None
            builds it here.
        compiled: ``torch.compile``'d flex (block sparse) or eager (dense, then masked); None:
            compiled on CUDA, eager on CPU.
    """
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_paged_inputs(
        q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values, **scales
    )
    qc, k_cache, v_cache = _dequantized(q, k_cache, v_cache, block_table, seq_lens, **scales)
    args = (block_table, seq_lens, None, scale, kv_block_size, block_mask, compiled, check_values)
    return _flex_paged(qc.unsqueeze(2), k_cache, v_cache, *args).squeeze(2).to(q.dtype)  # through [batch, Hq, 1, D]


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal prefill with FlexAttention over the paged cache: the contract of
    :func:`~paged_ref.attention.reference.reference_paged_prefill`, the keywords of
    :func:`flex_paged_decode` (``block_mask`` from ``paged_block_masks(..., q_len=max_q_len, q_lens=q_lens)``).
    """
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_prefill_inputs(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=check_values, **scales
    )
    qc, k_cache, v_cache = _dequantized(q, k_cache, v_cache, block_table, seq_lens, **scales)
    args = (block_table, seq_lens, q_lens, scale, kv_block_size, block_mask, compiled, check_values)
    return _flex_paged(qc, k_cache, v_cache, *args).to(q.dtype)


def _dequantized(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale):
    """``(q, k_cache, v_cache)`` as flex takes them: as given with floating pages; with 8-bit pages in float32
    (float64 for float64 q), the pages the sequences use dequantized (bytes times their scale in float32), the
    other pages 0 (the module docstring)."""
    if k_scale is None:
        return q, k_cache, v_cache
    compute = torch.promote_types(q.dtype, torch.float32)
    page_size = k_cache.shape[1]
    used = torch.arange(block_table.shape[1], device=q.device)[None, :] < cdiv(seq_lens.long(), page_size)[:, None]
    ids = block_table[used].long().unique()  # [n_used] the pages read (in range: checked, or IndexError)
    out = []
    for cache, page_scale in ((k_cache, k_scale), (v_cache, v_scale)):
        full = torch.zeros(cache.shape, dtype=compute, device=q.device)  # [num_pages, page_size, Hkv, D]
        full[ids] = (cache[ids].float() * page_scale[ids][:, None, :, None]).to(compute)
        out.append(full)
    return q.to(compute), *out
