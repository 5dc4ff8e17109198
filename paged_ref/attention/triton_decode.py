"""A Triton paged decode kernel: one new query token per sequence, K/V read through the pages.

Decode attention is memory bound: every step reads the whole K and V of every sequence once
and does only 2 FLOPs per K or V element for each query head that reads it (GQA 4 in bf16:
4 FLOPs per byte, where an H100/H200 needs ~200 to be compute bound). The job of the kernel
is therefore to stream K and V from the paged cache at close to copy bandwidth:

* **No gather.** The kernel looks up each token's physical page in the block table itself and
  loads K/V rows straight from ``k_cache[page, offset]``: no contiguous copy is ever made.
* **GQA.** One program handles *all* query heads that share a KV head (a tile of
  ``BLOCK_H`` rows), so each K/V byte is read from memory once, not once per query head.
* **Two ways to find a tile, chosen at compile time.** The kernel walks a sequence in tiles of
  ``BLOCK_N`` tokens. When ``page_size >= BLOCK_N`` a tile lies inside one page: one
  block-table entry gives one 64-bit page base, and the tile is a contiguous 2-D block of that
  page addressed with 32-bit offsets. With smaller pages every token of the tile looks up its
  own page (a gather): 64-bit page bases per token, 32-bit offsets within the page. Any
  power-of-two page size from 1 to 256 works with the same tile size.
* **Online softmax** in float32 (running max ``m``, running sum ``l``, unnormalised
  accumulator ``acc``), in base 2 (``exp2``) with ``log2(e)`` folded into the scale.
* **Split-K / flash-decoding.** With few sequences (batch 1 with 8 KV heads is 8 programs on
  a GPU with 132 SMs) each sequence is cut into ``num_splits`` chunks handled by separate
  programs; each writes a partial ``(m, l, acc)`` and a second, tiny kernel merges them.
  ``num_splits=None`` picks the count from batch, heads, length, the SM count and the programs
  an SM holds (a small occupancy model, :mod:`.occupancy`).

What the compiler makes of it is measured, not assumed: ``python -m paged_ref.lab.bench kernels``
compiles every configuration the launcher can choose for sm_90, sm_80 and sm_75 without a GPU
and records registers, spills, shared memory, asynchronous copies and MMA instructions in
``figures/data/kernels.json`` (notebook 05, "what the compiler made of the kernel").

On CPU tensors the very same kernel functions run through Triton's interpreter (float32 only),
chosen per call (:mod:`paged_ref.attention._triton_interpreter`): nothing is set for the
process. Without Triton at all (macOS, Windows) the module still imports and
:func:`triton_paged_decode` raises ``ImportError``.

Example:
    >>> import torch
    >>> from paged_ref.attention.triton_decode import triton_paged_decode
    >>> k_cache = torch.randn(6, 16, 2, 64)          # [num_pages, page_size, num_kv_heads, head_dim]
    >>> v_cache = torch.randn(6, 16, 2, 64)
    >>> q = torch.randn(2, 8, 64)                    # [batch, num_q_heads, head_dim]: GQA 4
    >>> block_table = torch.tensor([[4, 1, 0], [5, 2, 0]], dtype=torch.int32)
    >>> seq_lens = torch.tensor([40, 17], dtype=torch.int32)
    >>> triton_paged_decode(q, k_cache, v_cache, block_table, seq_lens).shape
    torch.Size([2, 8, 64])
"""

import functools
import types

import torch

from .._arith import next_pow2
from ._checks import check_paged_inputs, check_triton_inputs
from ._triton_interpreter import interpreted, interpreter, runnable
from .occupancy import SM_LIMITS, programs_per_sm, split_cost
from .online_softmax import LOG2E

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # no Triton wheel for this platform: the module imports, calls fail clearly
    triton = types.SimpleNamespace(jit=lambda fn: fn)  # the kernels stay plain functions
    tl = types.SimpleNamespace(constexpr=None)  # only for the `tl.constexpr` annotations below
    _HAVE_TRITON = False

__all__ = ["choose_num_splits", "compiled_kernels", "interpreted", "native_half", "triton_paged_decode"]

_MAX_SPLITS = 256  # upper bound for the heuristic (partials stay a few MB)
_MIN_TILES_PER_SPLIT = 4  # below this a split's fixed cost (pipeline fill, its partial) outweighs the parallelism
_SPLIT_TOLERANCE = 1.03  # take the fewest splits whose modelled cost is within 3% of the cheapest
_INTERPRETER_SMS = 8  # a pretend SM count so the split path is exercised on CPU too
#: (registers, shared bytes, warps) of the 16-bit head_dim-128 tile per compute capability, as
#: ``python -m paged_ref.lab.bench kernels`` compiled it (figures/data/kernels.json: the most
#: registers and shared memory over its page sizes, split or not).
_TILE_RESOURCES = {75: (128, 18432, 4), 80: (160, 71680, 4), 90: (160, 71680, 4)}
_PROGRAMS_PER_SM = 3  # sm_90's count for that tile (tests/test_occupancy.py derives it)


# --- Kernel 1: attention over one chunk of one sequence, all query heads of one KV head ------
@triton.jit
def _paged_decode_split_kernel(
    q_ptr,  # [batch, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same shape and strides as k_cache
    block_table_ptr,  # int [batch, max_pages]: logical page -> physical page
    seq_lens_ptr,  # int [batch]: tokens each query attends to
    out_ptr,  # [batch, num_q_heads, head_dim]: written when WRITE_PARTIALS is False
    part_m_ptr,  # fp32 [batch, num_q_heads, num_splits]: running max per split
    part_l_ptr,  # fp32 [batch, num_q_heads, num_splits]: running sum per split
    part_acc_ptr,  # fp32 [batch, num_q_heads, num_splits, head_dim]: unnormalised output
    scale_log2,  # softmax scale * log2(e): scores come out in base 2
    num_splits,  # chunks each sequence is cut into (grid axis 2)
    stride_q_batch,
    stride_q_head,
    stride_cache_page,
    stride_cache_token,
    stride_cache_head,
    stride_bt_batch,
    stride_o_batch,
    stride_o_head,
    HEAD_DIM: tl.constexpr,  # real head dim
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two (>= 16 for tl.dot)
    GROUP: tl.constexpr,  # query heads per KV head (GQA ratio)
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two (>= 16 on GPU for tl.dot)
    PAGE_SIZE: tl.constexpr,  # tokens per page, a power of two
    BLOCK_N: tl.constexpr,  # tokens per tile, independent of PAGE_SIZE
    WRITE_PARTIALS: tl.constexpr,  # num_splits > 1: write (m, l, acc) for the reduction kernel
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no tf32); ignored for 16-bit
):
    # Each program owns one (sequence, KV head, split). Program ids along the three grid axes:
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Which tokens this split covers. Chunks are rounded up to whole tiles so that tiles start
    # at multiples of BLOCK_N: when PAGE_SIZE >= BLOCK_N a tile then never straddles a page
    # boundary (all its rows come from one page). Trailing splits of a
    # short sequence may be empty; they still write a neutral partial (m=-inf, l=0, acc=0).
    seq_len = tl.load(seq_lens_ptr + batch)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    # GQA: query heads kv_head*GROUP .. kv_head*GROUP + GROUP-1 all read this KV head, so they
    # are processed together as the rows of one tile; rows >= GROUP are padding (q = 0).
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    head = kv_head * GROUP + offs_h  # [BLOCK_H] query head ids
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + batch * stride_q_batch + head[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]

    # Online softmax state, float32 whatever the input dtype.
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores (base 2)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)  # running sum of exp2(...) * v

    block_table_row = block_table_ptr + batch * stride_bt_batch
    kv_head_offset = kv_head * stride_cache_head
    tile_d = offs_d[None, :]  # [1, BLOCK_D] columns of a K/V row
    # Block-table lookup: logical token t lives on physical page block_table[t // PAGE_SIZE] at
    # offset t % PAGE_SIZE (a shift and a mask: PAGE_SIZE is a power of two). Only the page
    # base needs 64 bits (caches over 2**31 elements); offsets within a page are int32.
    # The page ids of the *next* tile are fetched one iteration ahead, so the K/V addresses of
    # a tile depend on no load of the same iteration: the software pipeliner can then give K
    # and V a ring of buffers (what it actually did is in figures/data/kernels.json).
    if PAGE_SIZE >= BLOCK_N:
        # A tile lies inside one page (tiles start at multiples of BLOCK_N, pages at multiples
        # of PAGE_SIZE): one block-table entry per tile, a scalar.
        page = tl.load(block_table_row + start // PAGE_SIZE, mask=start < end, other=0)
    else:
        # Small pages: every token of the tile looks up its own page (a gather).
        tokens = start + offs_n
        page = tl.load(block_table_row + tokens // PAGE_SIZE, mask=tokens < end, other=0)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + offs_n  # [BLOCK_N] logical token positions
        mask_n = tokens < end
        within = (tokens % PAGE_SIZE) * stride_cache_token  # int32 [BLOCK_N]
        base = page.to(tl.int64) * stride_cache_page + kv_head_offset  # int64: scalar or [BLOCK_N]
        if PAGE_SIZE >= BLOCK_N:
            # one base address, and the tile is a contiguous 2-D block [BLOCK_N, BLOCK_D]
            k_ptrs = k_cache_ptr + base + (within[:, None] + tile_d)
            v_ptrs = v_cache_ptr + base + (within[:, None] + tile_d)
            nxt = tile_start + BLOCK_N
            page = tl.load(block_table_row + nxt // PAGE_SIZE, mask=nxt < end, other=0)
        else:
            k_ptrs = k_cache_ptr + base[:, None] + (within[:, None] + tile_d)  # [BLOCK_N, BLOCK_D]
            v_ptrs = v_cache_ptr + base[:, None] + (within[:, None] + tile_d)
            nxt = tokens + BLOCK_N
            page = tl.load(block_table_row + nxt // PAGE_SIZE, mask=nxt < end, other=0)
        if BLOCK_D == HEAD_DIM:
            kv_mask = mask_n[:, None]  # keep the mask constant along d
        else:
            kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]

        # Scores of every query head of the group against the tile, in base 2.
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(mask_n[None, :], scores, float("-inf"))  # [BLOCK_H, BLOCK_N]

        # Online softmax: raise the running max, rescale what was accumulated under the old max
        # by alpha = 2^(m_old - m_new), then add this tile. Every tile holds at least one valid
        # token, so m_new is finite and alpha is 0 (not NaN) on the first tile.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BLOCK_H]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_H]
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        # p is rounded to V's dtype for the tensor-core product (as FlashAttention does);
        # the product itself accumulates in float32.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = mask_h[:, None] & mask_d[None, :]
    if WRITE_PARTIALS:
        # Split-K: leave (m, l, acc) for the reduction kernel, which needs all splits' maxima
        # before it can weight them. Layout [batch, num_q_heads, num_splits(, head_dim)].
        row = (batch * (tl.num_programs(1) * GROUP) + head) * num_splits + split  # [BLOCK_H]
        tl.store(part_m_ptr + row, m_i, mask=mask_h)
        tl.store(part_l_ptr + row, l_i, mask=mask_h)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
    else:
        # One split covers the whole sequence: normalise and write the output directly.
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + batch * stride_o_batch + head[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


# --- Kernel 2: merge the splits of one (sequence, query head) --------------------------------
@triton.jit
def _reduce_splits_kernel(
    part_m_ptr,  # fp32 [batch, num_q_heads, num_splits]
    part_l_ptr,  # fp32 [batch, num_q_heads, num_splits]
    part_acc_ptr,  # fp32 [batch, num_q_heads, num_splits, head_dim]
    out_ptr,  # [batch, num_q_heads, head_dim]
    num_splits,
    stride_o_batch,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits read per step
):
    # Split s computed its softmax relative to its own max m_s. Relative to the global max M:
    #   out = sum_s 2^(m_s - M) * acc_s  /  sum_s 2^(m_s - M) * l_s
    # Empty splits have m_s = -inf and weigh 2^(-inf) = 0. Split 0 is never empty
    # (seq_len >= 1), so M is finite.
    batch = tl.program_id(0)
    head = tl.program_id(1)
    first = (batch * tl.num_programs(1) + head) * num_splits  # row of split 0
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    # Pass 1: the global max over all splits.
    m_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        mask_s = s0 + offs_s < num_splits
        m = tl.load(part_m_ptr + first + s0 + offs_s, mask=mask_s, other=float("-inf"))
        m_max = tl.maximum(m_max, m)
    m_global = tl.max(m_max, axis=0)

    # Pass 2: weighted sums of the accumulators and of the normalisers.
    numer = tl.zeros([BLOCK_D], tl.float32)
    denom = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        mask_s = s0 + offs_s < num_splits
        m = tl.load(part_m_ptr + first + s0 + offs_s, mask=mask_s, other=float("-inf"))
        l = tl.load(part_l_ptr + first + s0 + offs_s, mask=mask_s, other=0.0)
        acc = tl.load(
            part_acc_ptr + (first + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask_s[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_S, BLOCK_D]
        w = tl.exp2(m - m_global)  # [BLOCK_S]
        numer += tl.sum(w[:, None] * acc, axis=0)
        denom += w * l
    out = numer / tl.sum(denom, axis=0)
    tl.store(
        out_ptr + batch * stride_o_batch + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d
    )


# --- Which kernel object a call runs ----------------------------------------------------------
_kernel = runnable  # (kernel, interpret) -> the kernel as compiled JITFunction or interpreted


def compiled_kernels() -> dict[str, object]:
    """The two kernels as compiled-mode JITFunctions, for ahead-of-time compilation
    (``triton.compile(ASTSource(fn=...), target=...)``: see ``paged_ref.lab.bench.kernels``)."""
    if not _HAVE_TRITON:
        raise ImportError("compiling the kernels needs the `triton` package")
    return {k.fn.__name__: _kernel(k, interpret=False) for k in (_paged_decode_split_kernel, _reduce_splits_kernel)}


# --- Launcher --------------------------------------------------------------------------------
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


@functools.cache
def _resident_programs(capability: int) -> int:
    """Programs of the 16-bit head_dim-128 tile one SM holds on a GPU of this compute capability:
    the occupancy model (:mod:`.occupancy`) applied to what the compile report measured for that
    tile (registers, shared memory, warps: ``figures/data/kernels.json``, checked by
    tests/test_occupancy.py). Targets the report does not cover use the nearest older one."""
    known = max((c for c in _TILE_RESOURCES if c <= capability), default=min(_TILE_RESOURCES))
    registers, shared, warps = _TILE_RESOURCES[known]
    return programs_per_sm(registers, shared, warps, SM_LIMITS[known])["programs_per_sm"]


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    *,
    programs_per_sm: int = _PROGRAMS_PER_SM,
    block_n: int = 64,
    min_tiles_per_split: int = _MIN_TILES_PER_SPLIT,
) -> int:
    """How many chunks to cut each sequence into so that the GPU is kept full.

    The grid has ``batch * num_kv_heads * s`` programs for ``s`` splits, and
    ``num_sms * programs_per_sm`` of them run at once (the bf16 head_dim-128 tile compiles to
    ~160 registers and 71,680 B of shared memory for sm_90: 3 per SM, which keep 3 x 32 KB of
    K/V loading, 2.7x the Little's-law figure; :mod:`.occupancy`). A memory-bound kernel
    streams at full rate only while its slots are full, so the cost of ``s`` splits is
    :func:`~paged_ref.attention.occupancy.split_cost`: every wave holds every slot for one
    program's tiles plus its pipeline fill, and splitting adds the merge kernel. We take the
    fewest splits within 3% of the cheapest:

    * one long sequence is cut until its programs fill one wave (48 x 8 = 384 of 396 slots);
    * a grid with a nearly empty last wave is cut further (64 x 8 = 512 programs on 396 slots
      leave the second wave 29% full; 3 splits make 4 waves 97% full);
    * a full grid is not split; a split never gets fewer than ``min_tiles_per_split`` tiles.

    The cost depends on the length only through its tile count, so the answer is cached per
    (batch, heads, tiles, SMs): a growing sequence pays for the search once per ``block_n`` tokens.

    Args:
        batch: number of sequences.
        num_kv_heads: KV heads (one program per KV head per split).
        max_seq_len: the longest sequence (or an upper bound on it).
        num_sms: streaming multiprocessors of the GPU.
        programs_per_sm: programs resident per SM at once.
        block_n: tokens per tile of the kernel.
        min_tiles_per_split: fewest tiles a split may stream.

    Returns:
        An int in ``[1, 256]``.

    Example:
        >>> choose_num_splits(1, 8, 131072, 132)     # one long sequence: 8 -> 384 programs
        48
        >>> choose_num_splits(8, 8, 32768, 132)      # 64 programs: 6 splits fill one wave
        6
        >>> choose_num_splits(64, 8, 4096, 132)      # 512 programs: 3 splits, 4 waves 97% full
        3
        >>> choose_num_splits(256, 8, 2048, 132)     # 2048 programs already fill the GPU
        1
    """
    if min(batch, num_kv_heads, max_seq_len, num_sms, programs_per_sm, block_n, min_tiles_per_split) < 1:
        given = dict(batch=batch, num_kv_heads=num_kv_heads, max_seq_len=max_seq_len, num_sms=num_sms)
        given.update(programs_per_sm=programs_per_sm, block_n=block_n, min_tiles_per_split=min_tiles_per_split)
        raise ValueError(f"every argument of choose_num_splits must be >= 1, got {given}")
    tiles = -(-max_seq_len // block_n)
    return _cheapest_split(batch, num_kv_heads, tiles, num_sms, programs_per_sm, min_tiles_per_split)


@functools.lru_cache(maxsize=4096)
def _cheapest_split(batch: int, num_kv_heads: int, tiles: int, num_sms: int, per_sm: int, min_tiles: int) -> int:
    """`choose_num_splits` on a length of ``tiles`` whole tiles (the cost sees nothing finer)."""
    max_splits = max(1, min(_MAX_SPLITS, tiles // min_tiles))
    cost = {s: split_cost(batch, num_kv_heads, tiles, s, num_sms, per_sm, 1) for s in range(1, max_splits + 1)}
    good_enough = _SPLIT_TOLERANCE * min(cost.values())  # prefer fewer splits: less to merge
    return min(s for s, c in cost.items() if c <= good_enough)


def _default_num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device, cfg: dict) -> int:
    """The split count `triton_paged_decode(num_splits=None)` uses for this device and tile."""
    capability = 90 if device.type != "cuda" else _capability(device)
    return choose_num_splits(
        batch,
        num_kv_heads,
        max_len,
        _num_sms(device),
        programs_per_sm=_resident_programs(capability),
        block_n=cfg["BLOCK_N"],
    )


def _tile_config(dtype: torch.dtype, head_dim: int, group: int, *, interpret: bool, capability: int = 90) -> dict:
    """Tile sizes and launch options for one call (a fixed choice per target;
    `python -m paged_ref.lab.bench kernels` reports what each compiles to).

    Args:
        capability: the GPU's compute capability as ``10 * major + minor`` (90 for H100/H200,
            80 for A100, 75 for T4); ignored by the interpreter.
    """
    block_d = max(16, next_pow2(head_dim))
    if interpret:
        # The interpreter runs each program in numpy: small tiles keep tests quick, and tl.dot
        # has no minimum shape there.
        return dict(BLOCK_H=next_pow2(group), BLOCK_D=block_d, BLOCK_N=32, num_warps=1, num_stages=1)
    if capability < 80:
        # Turing (T4): Triton computes tl.dot with FMAs there (no MMA instructions were
        # emitted for sm_75) and has no asynchronous copies, so small tiles and no pipeline:
        # with 64-token tiles the compile for sm_75 spilled ~200 registers.
        block_h = next_pow2(group)
        return dict(BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=32 if block_h <= 8 else 16, num_warps=4, num_stages=1)
    # Ampere and Hopper: K/V tiles of up to 16 KB and 64 tokens (BLOCK_N = 64 for 16-bit
    # head_dim 128, 32 for head_dim 256); num_stages=3 asks the pipeliner for a ring of two K
    # and two V buffers in shared memory. maxnreg=160: left alone, ptxas gave some sm_90
    # configurations 64 registers and a few spills; 128-token tiles (16-bit head_dim 64)
    # spilled under that cap, 64-token ones do not (figures/data/kernels.json).
    block_n = min(64, max(16, 16384 // (block_d * dtype.itemsize)))
    return dict(
        BLOCK_H=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4, num_stages=3, maxnreg=160
    )


def _capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def native_half(device) -> torch.dtype:
    """The 16-bit dtype a GPU computes natively: bfloat16 from sm_80 (A100, H100) on, float16
    before it (a T4 in a free hosted notebook is sm_75: no bfloat16 arithmetic)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return torch.bfloat16 if _capability(device) >= 80 else torch.float16


def triton_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    check_values: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a paged KV cache with a Triton kernel (split-K, GQA).

    Query ``b`` attends to the first ``seq_lens[b]`` tokens of sequence ``b``, whose pages are
    listed in ``block_table[b]``; the same function as
    :func:`paged_ref.attention.reference.reference_paged_decode`.

    Args:
        q: ``[batch, num_q_heads, head_dim]``, float16/bfloat16/float32 on CUDA
            (float32 on CPU, where the kernel runs in Triton's interpreter).
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``, dtype of ``q``;
            ``page_size`` a power of two up to 256, ``head_dim`` up to 256,
            ``num_q_heads`` a multiple of ``num_kv_heads``.
        block_table: int32 (or int64) ``[batch, max_pages]``; the first
            ``ceil(seq_lens[b] / page_size)`` entries of row ``b`` must be page ids in
            ``[0, num_pages)``, the rest are ignored.
        seq_lens: int32 (or int64) ``[batch]``, each in ``[1, max_pages * page_size]``.
        scale: softmax scale, default ``head_dim ** -0.5``.
        num_splits: chunks per sequence (split-K); ``None`` picks one with
            :func:`choose_num_splits`. Any value gives the same result up to rounding.
        out: optional ``[batch, num_q_heads, head_dim]`` tensor to write into (contiguous,
            dtype and device of ``q``); every element is written.
        check_values: check ``seq_lens`` and the used block-table entries (reads them on the
            host: a device sync). Turn off in timed loops once the inputs are known good; an
            out-of-range page id then reads out of bounds.
        return_lse: also return each row's log-sum-exp of its scores (base 2), the second half
            of the state that :func:`paged_ref.attention.cascade.merge_states` merges. The
            split partials are then always written (even for one split) and the lse is read off
            them: ``lse = M + log2(sum_s 2^(m_s - M) l_s)``.

    Returns:
        ``[batch, num_q_heads, head_dim]``, dtype of ``q`` (``out`` if given); with
        ``return_lse``, ``(out, lse)`` with ``lse: float32 [batch, num_q_heads]``.

    Example:
        >>> kc, vc = torch.randn(4, 8, 1, 64), torch.randn(4, 8, 1, 64)
        >>> q = torch.randn(1, 4, 64)                            # MQA: 4 query heads, 1 KV head
        >>> bt = torch.tensor([[2, 0, 3]], dtype=torch.int32)
        >>> o1 = triton_paged_decode(q, kc, vc, bt, torch.tensor([20], dtype=torch.int32), num_splits=1)
        >>> o3 = triton_paged_decode(q, kc, vc, bt, torch.tensor([20], dtype=torch.int32), num_splits=3)
        >>> torch.allclose(o1, o3, atol=1e-5)
        True
    """
    if not _HAVE_TRITON:
        raise ImportError(
            "triton_paged_decode needs the `triton` package (Linux only): "
            "pip install triton, or use reference_paged_decode instead"
        )
    scale = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values)
    interpret = interpreted(q.device)
    check_triton_inputs(q, k_cache, v_cache, block_table, seq_lens, num_splits, out, interpret=interpret)

    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    cfg = _tile_config(
        q.dtype, head_dim, group, interpret=interpret, capability=90 if interpret else _capability(q.device)
    )
    if num_splits is None:
        # With values checked, seq_lens is already known on the host; otherwise use the block
        # table's capacity as the bound rather than force a device sync.
        max_len = int(seq_lens.max()) if check_values else block_table.shape[1] * page_size
        num_splits = _default_num_splits(batch, num_kv_heads, max_len, q.device, cfg)
    if out is None:
        out = torch.empty_like(q)  # [batch, num_q_heads, head_dim]
    parts = _launch(q, k_cache, v_cache, block_table, seq_lens, out, scale, num_splits, return_lse, **cfg)
    if not return_lse:
        return out
    part_m, part_l = parts  # [batch, Hq, splits] each
    top = part_m.amax(-1, keepdim=True)  # [batch, Hq, 1]: split 0 is never empty, so finite
    return out, top[..., 0] + torch.log2((torch.exp2(part_m - top) * part_l).sum(-1))


def _launch(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    out,
    scale,
    num_splits,
    keep_partials=False,
    *,
    BLOCK_H,
    BLOCK_D,
    BLOCK_N,
    num_warps,
    num_stages,
    **options,
):
    """Launch both kernels on checked inputs; returns the partials ``(m, l)`` when written."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    write_partials = num_splits > 1 or keep_partials
    if write_partials:
        part_m = torch.empty(
            batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device
        )  # [batch, Hq, splits]
        part_l = torch.empty_like(part_m)  # [batch, Hq, splits]
        part_acc = torch.empty(
            batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )  # [batch, Hq, splits, head_dim]
    else:
        part_m = part_l = part_acc = out  # unused by the kernel
    interpret = interpreted(q.device)
    split_kernel = _kernel(_paged_decode_split_kernel, interpret)
    reduce_kernel = _kernel(_reduce_splits_kernel, interpret)
    # Triton launches on the current CUDA device: make it the inputs' device. The interpreter
    # is switched on for this call only.
    scope = interpreter() if interpret else torch.cuda.device(q.device)
    with scope:
        # Grid: one program per (sequence, KV head, split).
        split_kernel[(batch, num_kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            out,
            part_m,
            part_l,
            part_acc,
            scale * LOG2E,
            num_splits,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_table.stride(0),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=BLOCK_D,
            GROUP=num_q_heads // num_kv_heads,
            BLOCK_H=BLOCK_H,
            PAGE_SIZE=k_cache.shape[1],
            BLOCK_N=BLOCK_N,
            WRITE_PARTIALS=write_partials,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=num_warps,
            num_stages=num_stages,
            **({} if interpret else options),
        )
        if write_partials:
            # Grid: one program per (sequence, query head).
            reduce_kernel[(batch, num_q_heads)](
                part_m,
                part_l,
                part_acc,
                out,
                num_splits,
                out.stride(0),
                out.stride(1),
                HEAD_DIM=head_dim,
                BLOCK_D=BLOCK_D,
                BLOCK_S=min(16, next_pow2(num_splits)),
                num_warps=1 if interpret else 4,
            )
    return (part_m, part_l) if write_partials else None
