"""Plain-PyTorch paged attention: the oracle every faster path is checked against.

K and V live in fixed-size pages, ``k_cache, v_cache: [num_pages, page_size, num_kv_heads,
head_dim]`` (vLLM's and FlashAttention's layout). Logical token ``t`` of sequence ``b`` sits on
physical page ``block_table[b, t // page_size]`` at offset ``t % page_size``; entries past a
sequence's ``ceil(seq_lens[b] / page_size)`` pages are padding.

The algorithm, in full: gather each sequence's pages into a contiguous tensor
(:func:`gather_sequence`), then softmax attention one sequence at a time (:func:`attend`). 8-bit
pages (`paged_ref.quant`) come with ``k_scale``, ``v_scale`` ``[num_pages, num_kv_heads]``: the gather
multiplies each page's bytes by its scales in float32, and attention runs on those values.
Arguments are checked at the door by `_checks`, as in every backend.
"""

from __future__ import annotations

import torch

from .._arith import cdiv
from ._checks import check_paged_inputs, check_prefill_inputs


def gather_sequence(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, page_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``[seq_len, num_kv_heads, head_dim]``: one sequence's tokens copied out of the pages of
    ``cache`` (``[num_pages, page_size, num_kv_heads, head_dim]``) listed in ``block_table_row``;
    8-bit pages times their ``page_scale`` (``[num_pages, num_kv_heads]``), in float32.

    Example:
        >>> kc = torch.arange(12.).view(3, 2, 1, 2)      # 3 pages of 2 tokens
        >>> gather_sequence(kc, torch.tensor([2, 0]), 3)[:, 0, 0].tolist()
        [8.0, 10.0, 0.0]
        >>> q8 = kc.to(torch.float8_e4m3fn)             # the same values, one byte each
        >>> gather_sequence(q8, torch.tensor([2, 0]), 3, torch.full((3, 1), 0.5))[:, 0, 0].tolist()
        [4.0, 5.0, 0.0]
    """
    num_used = cdiv(seq_len, cache.shape[1])  # ceil(seq_len / page_size)
    used = block_table_row[:num_used].long()  # [num_used]
    pages = cache[used]  # [num_used, page_size, H, D]
    if page_scale is not None:
        pages = pages.float() * page_scale[used][:, None, :, None]  # float32 [num_used, page_size, H, D]
    return pages.flatten(0, 1)[:seq_len]  # [seq_len, H, D]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention of one sequence with GQA: q ``[num_q_heads, q_len, D]``; k, v
    ``[kv_len, num_kv_heads, D]``; mask bool ``[q_len, kv_len]`` (True = may attend) or None.
    Returns float32 (float64 for float64 ``q``) ``[num_q_heads, q_len, D]``."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[0] // k.shape[1]  # query heads per KV head
    k = k.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, kv_len, D]
    v = v.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, kv_len, D]
    scores = (q.to(compute) @ k.transpose(1, 2)) * scale  # [Hq, q_len, kv_len]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # [Hq, q_len, D]


def reference_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    check_values: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache: query ``b`` attends to the first ``seq_lens[b]``
    tokens of sequence ``b`` (its own K/V already cached, so no causal mask). Every backend takes
    these arguments.

    Args:
        q: ``[batch, num_q_heads, head_dim]``; returns the same shape and dtype.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``; query head ``h``
            reads KV head ``h // (num_q_heads // num_kv_heads)`` (GQA).
        block_table: int32 ``[batch, max_pages]``; seq_lens: int32 ``[batch]``, each ``>= 1``.
        scale: softmax scale, default ``head_dim ** -0.5``.
        check_values: also check ``seq_lens`` and the used block-table entries (a host read).
        k_scale, v_scale: with 8-bit pages, float32 ``[num_pages, num_kv_heads]``: page ``p``'s KV head
            ``h`` holds ``byte.float() * scale[p, h]`` (`~paged_ref.quant`); None with floating pages.

    Example:
        >>> kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
        >>> q = torch.randn(2, 8, 64)
        >>> bt = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)   # 7: unused padding
        >>> out = reference_paged_decode(q, kc, vc, bt, torch.tensor([20, 5]))
        >>> out.shape
        torch.Size([2, 8, 64])
    """
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_paged_inputs(
        q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values, **scales
    )
    out = torch.empty_like(q)  # [batch, Hq, D]
    for b, n in enumerate(seq_lens.tolist()):
        k = gather_sequence(k_cache, block_table[b], n, k_scale)  # [n, Hkv, D]
        v = gather_sequence(v_cache, block_table[b], n, v_scale)  # [n, Hkv, D]
        out[b] = attend(q[b].unsqueeze(1), k, v, None, scale).squeeze(1).to(q.dtype)
    return out


def reference_paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    *,
    scale: float | None = None,
    check_values: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (chunked) prefill over a paged KV cache: the last ``q_lens[b]`` of the ``seq_lens[b]``
    cached tokens (K/V already written) are new, and new token ``i`` at position ``p = seq_lens[b]
    - q_lens[b] + i`` attends to tokens ``0..p``. ``q`` is ``[batch, num_q_heads, max_q_len,
    head_dim]`` as Hugging Face attention receives it, right-padded: rows ``i >= q_lens[b]``
    come back as zeros. ``q_lens``: int32 ``[batch]``, ``0 <= q_lens[b] <= seq_lens[b]``; the
    other arguments as in :func:`reference_paged_decode`.

    Example:
        >>> kc, vc = torch.randn(4, 8, 1, 32), torch.randn(4, 8, 1, 32)
        >>> q = torch.randn(2, 2, 5, 32)           # up to 5 new tokens per sequence
        >>> bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        >>> out = reference_paged_prefill(q, kc, vc, bt, torch.tensor([12, 3]),
        ...                               torch.tensor([5, 3]))
        >>> out.shape, bool(out[1, :, 3:].eq(0).all())
        (torch.Size([2, 2, 5, 32]), True)
    """
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_prefill_inputs(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=check_values, **scales
    )
    out = torch.zeros_like(q)  # [batch, Hq, max_q_len, D]: padding rows stay 0
    for b, (n, m) in enumerate(zip(seq_lens.tolist(), q_lens.tolist())):
        if m == 0:
            continue
        k = gather_sequence(k_cache, block_table[b], n, k_scale)  # [n, Hkv, D]
        v = gather_sequence(v_cache, block_table[b], n, v_scale)  # [n, Hkv, D]
        q_pos = torch.arange(n - m, n, device=q.device)  # [m] logical positions of the queries
        causal = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]  # [m, n]
        out[b, :, :m] = attend(q[b, :, :m], k, v, causal, scale).to(q.dtype)
    return out


__all__ = ["attend", "gather_sequence", "reference_paged_decode", "reference_paged_prefill"]
