"""A Triton paged decode kernel: one new query token per sequence, K/V read through the pages.

Decode is memory bound (2 FLOPs per K or V element for each query head that reads it), so the
kernel's job is to stream K and V from the paged cache at close to copy bandwidth:

* **No gather.** Each tile looks its pages up in the block table and loads K/V rows straight
  from ``k_cache[page, offset]``. With ``page_size >= BLOCK_N`` a tile lies inside one page (one
  page base, a contiguous 2-D block); smaller pages look up a page per token.
* **GQA.** One program takes all the query heads of one KV head (``BLOCK_H`` rows), so each K/V
  byte is read once, not once per query head.
* **Online softmax** in float32 and base 2 (``exp2``, ``log2(e)`` folded into the scale):
  :mod:`.online_softmax` is the same computation in PyTorch.
* **Split-K (flash-decoding).** With few sequences each is cut into ``num_splits`` chunks whose
  partial ``(m, l, acc)`` a second kernel merges; ``num_splits=None`` asks the occupancy model
  (:func:`.occupancy.choose_num_splits`).
* **8-bit pages** (``k_scale``, ``v_scale``): a tile is loaded as bytes (half or a quarter of the
  traffic), converted to float32 and multiplied by its page's scale for the KV head (read through the
  scales' strides) in registers: the reference's values. A float32 ``q`` attends to them as they are;
  a 16-bit ``q`` to them rounded to its dtype (the tensor cores' product, as ``p`` already is). Before
  sm_89 Triton cannot load or convert float8 (``cvt`` from e4m3 and e5m2 needs sm_89): there the kernel
  reads float8 bytes as uint8 and decodes the bits (``FP8_BITS``: e4m3 into float32 bits, e5m2 as the
  high byte of a float16; checked bit for bit against the native load in the interpreter).

``python -m paged_ref.lab.bench kernels`` records what the compiler made of it (notebook 05). On
CPU tensors the same kernels run in Triton's interpreter (float32), chosen per call
(:mod:`._triton_interpreter`); without Triton the module imports and the call raises ImportError.
The interpreter loads all three 8-bit formats and reads every finite byte exactly; a float8 NaN or
Inf byte it reads as a finite number (`paged_ref.quant` saturates: it never writes one).
"""

import torch

from .._arith import next_pow2
from ._checks import check_paged_inputs, check_triton_inputs
from ._triton_interpreter import HAVE_TRITON, interpreted, interpreter, runnable, tl, triton
from .occupancy import _resident_programs, choose_num_splits
from .online_softmax import LOG2E

__all__ = ["compiled_kernels", "interpreted", "native_half", "triton_paged_decode"]

_INTERPRETER_SMS = 8  # a pretend SM count so the split path is exercised on CPU too


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
    k_scale_ptr,  # fp32 [num_pages, num_kv_heads] with 8-bit pages (SCALED), any strides; else unused
    v_scale_ptr,  # the same for V
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
    stride_ks_page,  # k_scale's strides (0 for a per-layer scale)
    stride_ks_head,
    stride_vs_page,
    stride_vs_head,
    HEAD_DIM: tl.constexpr,  # real head dim
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two (>= 16 for tl.dot)
    GROUP: tl.constexpr,  # query heads per KV head (GQA ratio)
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two (>= 16 on GPU for tl.dot)
    PAGE_SIZE: tl.constexpr,  # tokens per page, a power of two
    BLOCK_N: tl.constexpr,  # tokens per tile, independent of PAGE_SIZE
    WRITE_PARTIALS: tl.constexpr,  # num_splits > 1: write (m, l, acc) for the reduction kernel
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no tf32); ignored for 16-bit
    SCALED: tl.constexpr,  # 8-bit pages: a tile's bytes times its page's scale, in float32, then q's dtype
    FP8_BITS: tl.constexpr,  # before sm_89: 1 = float8_e4m3fn, 2 = float8_e5m2 pages read as uint8, decoded here
):
    # Each program owns one (sequence, KV head, split).
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The split's tokens, rounded up to whole tiles so tiles start at multiples of BLOCK_N (with
    # PAGE_SIZE >= BLOCK_N a tile then never straddles a page). A short sequence's trailing splits
    # may be empty; they still write a neutral partial (m=-inf, l=0, acc=0).
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
    # offset t % PAGE_SIZE. Only the page base needs 64 bits (caches over 2**31 elements). The
    # next tile's page ids are loaded one iteration ahead, so a tile's K/V addresses depend on no
    # load of the same iteration and the pipeliner can give K and V a ring of buffers.
    if PAGE_SIZE >= BLOCK_N:
        # A tile lies inside one page: one block-table entry per tile, a scalar.
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
            if SCALED:  # one scale per tile (its page's, for this KV head)
                ks_ptrs = k_scale_ptr + page * stride_ks_page + kv_head * stride_ks_head
                vs_ptrs = v_scale_ptr + page * stride_vs_page + kv_head * stride_vs_head
            nxt = tile_start + BLOCK_N
            page = tl.load(block_table_row + nxt // PAGE_SIZE, mask=nxt < end, other=0)
        else:
            k_ptrs = k_cache_ptr + base[:, None] + (within[:, None] + tile_d)  # [BLOCK_N, BLOCK_D]
            v_ptrs = v_cache_ptr + base[:, None] + (within[:, None] + tile_d)
            if SCALED:  # one scale per token (its page's; masked tokens read page 0's)
                ks_ptrs = (k_scale_ptr + page * stride_ks_page + kv_head * stride_ks_head)[:, None]  # [BLOCK_N, 1]
                vs_ptrs = (v_scale_ptr + page * stride_vs_page + kv_head * stride_vs_head)[:, None]
            nxt = tokens + BLOCK_N
            page = tl.load(block_table_row + nxt // PAGE_SIZE, mask=nxt < end, other=0)
        if BLOCK_D == HEAD_DIM:
            kv_mask = mask_n[:, None]  # keep the mask constant along d
        else:
            kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if FP8_BITS == 2:  # an e5m2 byte is the high byte of the float16 of the same value
            k = (k.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
        if FP8_BITS == 1:  # sign, 4 exponent bits (bias 7), 3 mantissa bits -> float32 bits; exponent 0: m * 2^-9
            x = k.to(tl.uint32)
            e = (x >> 3) & 15
            small = (x & 7).to(tl.float32) * tl.where(x >= 128, -0.001953125, 0.001953125)
            k = tl.where(
                e == 0, small, (((x & 128) << 24) | ((e + 120) << 23) | ((x & 7) << 20)).to(tl.float32, bitcast=True)
            )
        if SCALED:  # the reference's product in float32, then q's dtype for the dot (float32: exact)
            k = (k.to(tl.float32) * tl.load(ks_ptrs)).to(q.dtype)

        # Scores of every query head of the group against the tile, in base 2.
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(mask_n[None, :], scores, float("-inf"))  # [BLOCK_H, BLOCK_N]

        # Online softmax (online_softmax.online_update): raise the running max, rescale by
        # alpha = 2^(m_old - m_new), add the tile. Every tile holds a valid token: alpha is 0 (not
        # NaN) on the first tile.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BLOCK_H]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_H]
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if FP8_BITS == 2:  # as K's
            v = (v.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
        if FP8_BITS == 1:  # as K's
            x = v.to(tl.uint32)
            e = (x >> 3) & 15
            small = (x & 7).to(tl.float32) * tl.where(x >= 128, -0.001953125, 0.001953125)
            v = tl.where(
                e == 0, small, (((x & 128) << 24) | ((e + 120) << 23) | ((x & 7) << 20)).to(tl.float32, bitcast=True)
            )
        if SCALED:
            v = (v.to(tl.float32) * tl.load(vs_ptrs)).to(q.dtype)
        # p is rounded to V's dtype for the tensor-core product, which accumulates in float32.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = mask_h[:, None] & mask_d[None, :]
    if WRITE_PARTIALS:
        # Split-K: leave (m, l, acc) [batch, num_q_heads, num_splits(, head_dim)] for the reduction.
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
    # online_softmax.merge_partials: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M
    # the global max; empty splits (m_s = -inf) weigh 0, and split 0 is never empty.
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


_kernel = runnable  # (kernel, interpret) -> the kernel as compiled JITFunction or interpreted


def compiled_kernels() -> dict[str, object]:
    """The two kernels as compiled-mode JITFunctions, for ahead-of-time compilation (lab.bench.kernels)."""
    if not HAVE_TRITON:
        raise ImportError("compiling the kernels needs the `triton` package")
    return {k.fn.__name__: _kernel(k, interpret=False) for k in (_paged_decode_split_kernel, _reduce_splits_kernel)}


# --- Launcher --------------------------------------------------------------------------------
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


def _capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _default_num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device, cfg: dict) -> int:
    """The split count `triton_paged_decode(num_splits=None)` uses for this device and tile."""
    per_sm = _resident_programs(90 if device.type != "cuda" else _capability(device))
    return choose_num_splits(
        batch, num_kv_heads, max_len, _num_sms(device), programs_per_sm=per_sm, block_n=cfg["BLOCK_N"]
    )


def _tile_config(
    dtype: torch.dtype, head_dim: int, group: int, *, interpret: bool, capability: int = 90, eight_bit: bool = False
) -> dict:
    """Tile sizes and launch options for one call on a GPU of compute capability ``capability``
    (``10 * major + minor``), ``eight_bit`` pages or not; `python -m paged_ref.lab.bench kernels` reports what
    each compiles to."""
    block_d = max(16, next_pow2(head_dim))
    if interpret:  # numpy runs each program: small tiles keep tests quick (tl.dot has no minimum shape)
        return dict(BLOCK_H=next_pow2(group), BLOCK_D=block_d, BLOCK_N=32, num_warps=1, num_stages=1)
    if capability < 80:
        # Turing (T4): no MMA instructions for tl.dot and no asynchronous copies, so small tiles and
        # no pipeline (64-token tiles spilled ~200 registers for sm_75).
        block_h = next_pow2(group)
        return dict(BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=32 if block_h <= 8 else 16, num_warps=4, num_stages=1)
    # Ampere and Hopper: K/V tiles of up to 16 KB and 64 tokens; num_stages=3 gives a ring of two K and
    # two V buffers. maxnreg=160: left alone, ptxas gave some sm_90 configurations 64 registers and
    # spills (figures/data/kernels.json).
    block_n, stages = min(64, max(16, 16384 // (block_d * dtype.itemsize))), 3
    if eight_bit:  # dequantized 64-token tiles spilled (sm_90, bf16 q, head_dim 128): 32 tokens, a ring of three
        block_n, stages = min(block_n, 32), 4
    return dict(
        BLOCK_H=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4, num_stages=stages, maxnreg=160
    )


#: ``FP8_BITS`` of float8 pages decoded from their bits (before sm_89)
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def _fp8_native(device: torch.device, interpret: bool) -> bool:
    """Whether Triton loads and converts float8 pages here: in the interpreter and from sm_89 on; before, the
    kernel reads the bytes as uint8 and decodes them (``FP8_BITS``)."""
    return interpret or _capability(device) >= 89


def native_half(device) -> torch.dtype:
    """The 16-bit dtype a CUDA device computes natively: bfloat16 from sm_80 on, float16 before (T4)."""
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a paged KV cache with a Triton kernel (split-K, GQA): the contract of
    :func:`~paged_ref.attention.reference.reference_paged_decode` (8-bit pages with ``k_scale``,
    ``v_scale`` included), with ``q`` float16, bfloat16 or float32 on CUDA (float32 on CPU), contiguous
    pages and tables, ``page_size`` a power of two up to 256 and ``head_dim`` up to 256.

    Args:
        num_splits: chunks per sequence; None: :func:`~.occupancy.choose_num_splits`. Any value
            gives the same result up to rounding.
        out: ``[batch, num_q_heads, head_dim]`` to write into (contiguous, dtype and device of ``q``).
        check_values: off in timed loops on a GPU once the inputs are known good (no host sync):
            the types, shapes and layouts are still checked, the values not: an out-of-range page id
            or sequence length then reads out of bounds. In Triton's interpreter (CPU tensors) the
            values are checked whatever it says (a host read there costs no sync, and an
            out-of-range read would crash the process).
        return_lse: also return each row's log-sum-exp in base 2, float32 ``[batch, num_q_heads]``
            (the state :func:`~.cascade.merge_states` merges): ``M + log2(sum_s 2^(m_s - M) l_s)``.

    Example:
        >>> kc, vc = torch.randn(4, 8, 1, 64), torch.randn(4, 8, 1, 64)
        >>> q = torch.randn(1, 4, 64)                            # MQA: 4 query heads, 1 KV head
        >>> bt, lens = torch.tensor([[2, 0, 3]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
        >>> o1 = triton_paged_decode(q, kc, vc, bt, lens, num_splits=1)
        >>> torch.allclose(o1, triton_paged_decode(q, kc, vc, bt, lens, num_splits=3), atol=1e-5)
        True
    """
    if not HAVE_TRITON:
        raise ImportError(
            "triton_paged_decode needs the `triton` package (Linux only): "
            "pip install triton, or use reference_paged_decode instead"
        )
    interpret = isinstance(q, torch.Tensor) and interpreted(q.device)
    check_values = check_values or interpret  # the interpreter reads host memory: never unchecked there
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_paged_inputs(
        q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values, **scales
    )
    check_triton_inputs(q, k_cache, v_cache, block_table, seq_lens, num_splits, out, interpret=interpret)
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    capability = 90 if interpret else _capability(q.device)
    group, eight_bit = num_q_heads // num_kv_heads, k_scale is not None
    cfg = _tile_config(q.dtype, head_dim, group, interpret=interpret, capability=capability, eight_bit=eight_bit)
    if num_splits is None:
        # checked values are on the host already; otherwise bound by the table's capacity (no sync)
        max_len = int(seq_lens.max()) if check_values else block_table.shape[1] * page_size
        num_splits = _default_num_splits(batch, num_kv_heads, max_len, q.device, cfg)
    if out is None:
        out = torch.empty_like(q)  # [batch, num_q_heads, head_dim]
    parts = _launch(
        q, k_cache, v_cache, block_table, seq_lens, out, scale, num_splits, return_lse, scales=scales, **cfg
    )
    if not return_lse:
        return out
    part_m, part_l = parts  # [batch, Hq, splits] each
    top = part_m.amax(-1, keepdim=True)  # [batch, Hq, 1]: split 0 is never empty, so finite
    return out, top[..., 0] + torch.log2((torch.exp2(part_m - top) * part_l).sum(-1))


def _pages(q, k_cache, v_cache, scales, interpret: bool):
    """The pages and page scales as the split kernel takes them: ``(k_cache, v_cache, (k_scale, v_scale), their
    4 strides, FP8_BITS)``; without 8-bit pages ``q`` stands in for the scales (strides 0, never read)."""
    if scales is None or scales["k_scale"] is None:
        return k_cache, v_cache, (q, q), (0, 0, 0, 0), 0
    fp8_bits = 0 if _fp8_native(q.device, interpret) else FP8_CODES.get(k_cache.dtype, 0)
    if fp8_bits:  # the same bytes as uint8
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_scale, v_scale = scales["k_scale"], scales["v_scale"]
    return k_cache, v_cache, (k_scale, v_scale), (*k_scale.stride(), *v_scale.stride()), fp8_bits


def _launch(
    q, k_cache, v_cache, block_table, seq_lens, out, scale, num_splits, keep_partials=False, scales=None, **cfg
):
    """Launch both kernels on checked inputs with `_tile_config`'s tiles and options (``scales``: the
    page scales ``k_scale``, ``v_scale`` of 8-bit pages, or None); returns the partials ``(m, l)`` when written."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    write_partials = num_splits > 1 or keep_partials
    if write_partials:
        part_m = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)  # [B, Hq, S]
        part_l = torch.empty_like(part_m)  # [batch, Hq, splits]
        part_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused by the kernel
    interpret = interpreted(q.device)
    k_cache, v_cache, page_scales, scale_strides, fp8_bits = _pages(q, k_cache, v_cache, scales, interpret)
    tensors = (q, k_cache, v_cache, block_table, seq_lens, out, part_m, part_l, part_acc, *page_scales)
    strides = (*q.stride()[:2], *k_cache.stride()[:3], block_table.stride(0), *out.stride()[:2], *scale_strides)
    # Triton launches on the current CUDA device: make it the inputs'. The interpreter is on for this call only.
    with interpreter() if interpret else torch.cuda.device(q.device):
        _kernel(_paged_decode_split_kernel, interpret)[(batch, num_kv_heads, num_splits)](
            *tensors,
            scale * LOG2E,
            num_splits,
            *strides,
            HEAD_DIM=head_dim,
            GROUP=num_q_heads // num_kv_heads,
            PAGE_SIZE=k_cache.shape[1],
            WRITE_PARTIALS=write_partials,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            SCALED=scales is not None and scales["k_scale"] is not None,
            FP8_BITS=fp8_bits,
            **cfg,
        )
        if write_partials:  # grid: one program per (sequence, query head)
            _kernel(_reduce_splits_kernel, interpret)[(batch, num_q_heads)](
                part_m,
                part_l,
                part_acc,
                out,
                num_splits,
                *out.stride()[:2],
                HEAD_DIM=head_dim,
                BLOCK_D=cfg["BLOCK_D"],
                BLOCK_S=min(16, next_pow2(num_splits)),
                num_warps=1 if interpret else 4,
            )
    return (part_m, part_l) if write_partials else None
