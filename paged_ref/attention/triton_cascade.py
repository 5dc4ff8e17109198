"""Cascade decode attention in Triton: a prefix kernel per group, the decode kernel per request.

The plan of :mod:`.cascade` on the GPU (or in Triton's interpreter for CPU tensors, float32): the
prefix kernel runs one program per (group, KV head, block of ``BLOCK_M`` query rows: that KV head's
query heads of *every* request of the group), so each K/V tile of the prefix serves them all; each
request's own pages go through :func:`~.triton_decode.triton_paged_decode` (``return_lse=True``);
:func:`~.cascade.merge_states` merges the two.

Example:
    >>> import torch
    >>> from paged_ref.attention.reference import reference_paged_decode
    >>> kc, vc = torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
    >>> bt = torch.tensor([[5, 1, 2], [5, 1, 3], [0, 4, 6]], dtype=torch.int32)
    >>> q, lens = torch.randn(3, 4, 16), torch.tensor([9, 11, 12], dtype=torch.int32)
    >>> indptr, prefix = torch.tensor([0, 2, 3]), torch.tensor([8, 0])   # requests 0, 1 share 2 pages
    >>> out = triton_cascade_decode(q, kc, vc, bt, lens, indptr, prefix)
    >>> torch.allclose(out, reference_paged_decode(q, kc, vc, bt, lens), atol=1e-5)
    True
"""

import torch

from .._arith import cdiv, next_pow2
from ._checks import check_cascade_inputs, check_floating_pages, check_triton_inputs
from ._triton_interpreter import HAVE_TRITON, interpreted, interpreter, runnable, tl, triton
from .cascade import merge_states, request_prefixes, suffix_table
from .online_softmax import LOG2E
from .triton_decode import triton_paged_decode

__all__ = ["prefix_tile_config", "triton_cascade_decode", "triton_prefix_attention"]


@triton.jit
def _prefix_kernel(
    q_ptr,  # [batch, num_q_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same shape and strides as k_cache
    block_table_ptr,  # int [batch, max_pages]: the group's prefix pages are its first request's row
    group_indptr_ptr,  # int [num_groups + 1]: group g is requests indptr[g] .. indptr[g + 1] - 1
    prefix_lens_ptr,  # int [num_groups]: tokens each group shares
    out_ptr,  # fp32 [batch, num_q_heads, head_dim]: the prefix's normalised output
    lse_ptr,  # fp32 [batch, num_q_heads]: log2-sum-exp2 of the prefix scores (-inf: no prefix)
    scale_log2,  # softmax scale * log2(e)
    stride_q_batch,
    stride_q_head,
    stride_cache_page,
    stride_cache_token,
    stride_cache_head,
    stride_bt_batch,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # query rows (request, head) per program
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # prefix tokens per tile
    DOT_PRECISION: tl.constexpr,
):
    group = tl.program_id(0)
    kv_head = tl.program_id(1)
    row_block = tl.program_id(2)
    first = tl.load(group_indptr_ptr + group)
    last = tl.load(group_indptr_ptr + group + 1)
    prefix_len = tl.load(prefix_lens_ptr + group)

    # This program's rows: request first + row // GROUP, query head kv_head * GROUP + row % GROUP.
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    request = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    mask_m = request < last
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + request[:, None] * stride_q_batch + head[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # A program whose rows are all past the group's last request has nothing to read.
    end = tl.where(first + (row_block * BLOCK_M) // GROUP < last, prefix_len, 0)
    table_row = block_table_ptr + first * stride_bt_batch
    kv_head_offset = kv_head * stride_cache_head
    for tile_start in range(0, end, BLOCK_N):
        tokens = tile_start + offs_n  # [BLOCK_N] prefix positions
        mask_n = tokens < end
        page = tl.load(table_row + tokens // PAGE_SIZE, mask=mask_n, other=0)  # [BLOCK_N]
        base = page.to(tl.int64) * stride_cache_page + kv_head_offset  # [BLOCK_N]
        offsets = base[:, None] + (tokens % PAGE_SIZE)[:, None] * stride_cache_token + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # No prefix (l = 0): output 0 and lse = -inf, a state that weighs nothing in the merge.
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    row_id = request * (tl.num_programs(1) * GROUP) + head  # [BLOCK_M] row of [batch, num_q_heads]
    tl.store(out_ptr + row_id[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_m[:, None] & mask_d[None, :])
    tl.store(lse_ptr + row_id, lse, mask=mask_m)


def prefix_tile_config(dtype: torch.dtype, head_dim: int, max_rows: int, *, interpret: bool) -> dict:
    """Tiles of the prefix kernel: ``BLOCK_M`` query rows (at most 64) against ``BLOCK_N`` tokens."""
    block_d = max(16, next_pow2(head_dim))
    if interpret:
        return dict(BLOCK_M=min(64, next_pow2(max_rows)), BLOCK_D=block_d, BLOCK_N=32, num_warps=1, num_stages=1)
    block_n = min(64, max(16, 16384 // (block_d * dtype.itemsize)))
    return dict(
        BLOCK_M=min(64, max(16, next_pow2(max_rows))), BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4, num_stages=2
    )


def triton_prefix_attention(
    q, k_cache, v_cache, block_table, group_indptr, prefix_lens, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix kernel on checked inputs: ``(o fp32 [batch, Hq, D], lse fp32 [batch, Hq])``."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, group = k_cache.shape[2], num_q_heads // k_cache.shape[2]
    interpret = interpreted(q.device)
    max_rows = int((group_indptr[1:] - group_indptr[:-1]).max()) * group
    cfg = prefix_tile_config(q.dtype, head_dim, max_rows, interpret=interpret)
    o = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float32, device=q.device)  # [batch, Hq, D]
    lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=q.device)  # [batch, Hq]
    kernel = runnable(_prefix_kernel, interpret)
    with interpreter() if interpret else torch.cuda.device(q.device):
        # Grid: one program per (group, KV head, block of query rows).
        kernel[(group_indptr.numel() - 1, num_kv_heads, cdiv(max_rows, cfg["BLOCK_M"]))](
            *(q, k_cache, v_cache, block_table, group_indptr, prefix_lens, o, lse),
            scale * LOG2E,
            *q.stride()[:2],
            *k_cache.stride()[:3],
            block_table.stride(0),
            HEAD_DIM=head_dim,
            GROUP=group,
            PAGE_SIZE=k_cache.shape[1],
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            **cfg,
        )
    return o, lse


def triton_cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    group_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    scale: float | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """:func:`~.cascade.reference_cascade_decode` with Triton kernels (the inputs
    :func:`~.triton_decode.triton_paged_decode` takes).

    ``check_values=False`` (a GPU's timed loops): the types and shapes are still checked, the values
    (page ids, lengths, ``group_indptr``, ``prefix_lens``) not: out of range, they read out of bounds.
    In Triton's interpreter (CPU tensors) they are checked whatever it says. 8-bit pages are refused (the prefix
    kernel reads floating pages only)."""
    if not HAVE_TRITON:
        raise ImportError("triton_cascade_decode needs the `triton` package (Linux only)")
    check_floating_pages("triton_cascade_decode", k_cache)
    interpret = isinstance(q, torch.Tensor) and interpreted(q.device)
    scale = check_cascade_inputs(
        *(q, k_cache, v_cache, block_table, seq_lens, group_indptr, prefix_lens),
        scale=scale,
        check_values=check_values or interpret,  # the interpreter reads host memory: never unchecked there
    )
    check_triton_inputs(q, k_cache, v_cache, block_table, seq_lens, None, None, interpret=interpret)
    o_prefix, lse_prefix = triton_prefix_attention(
        q, k_cache, v_cache, block_table, group_indptr.contiguous(), prefix_lens.contiguous(), scale
    )  # [batch, Hq, D], [batch, Hq]
    prefix_tokens, suffix_lens = request_prefixes(seq_lens, group_indptr, prefix_lens)  # [batch] each
    o_suffix = torch.zeros_like(o_prefix)  # [batch, Hq, D]
    lse_suffix = torch.full_like(lse_prefix, float("-inf"))  # [batch, Hq]: an empty suffix weighs nothing
    own = (suffix_lens > 0).nonzero()[:, 0]  # [n] requests with tokens of their own
    if own.numel():
        table = suffix_table(block_table, prefix_tokens // k_cache.shape[1])  # [batch, max_pages]
        o, lse = triton_paged_decode(
            q[own].contiguous(),
            k_cache,
            v_cache,
            table[own].contiguous(),
            suffix_lens[own].to(seq_lens.dtype).contiguous(),
            scale=scale,
            check_values=False,
            return_lse=True,
        )  # [n, Hq, D], [n, Hq]
        o_suffix[own], lse_suffix[own] = o.float(), lse
    out, _ = merge_states(o_prefix, lse_prefix, o_suffix, lse_suffix)  # [batch, Hq, D]
    return out.to(q.dtype)
