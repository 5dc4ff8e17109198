"""Plain-PyTorch paged attention: the oracle every faster path is checked against.

K and V live in fixed-size pages, ``k_cache, v_cache: [num_pages, page_size, num_kv_heads,
head_dim]`` (vLLM's and FlashAttention's layout). Logical token ``t`` of sequence ``b`` sits on
physical page ``block_table[b, t // page_size]`` at offset ``t % page_size``; only the first
``ceil(seq_lens[b] / page_size)`` entries of a row are read, the rest is padding.

The algorithm, in full: gather each sequence's pages into a contiguous ``[seq_len,
num_kv_heads, head_dim]`` tensor (:func:`gather_sequence`), then compute softmax attention one
sequence at a time (:func:`attend`). Clarity over speed: this is the reference, not a fast path.
:func:`reference_paged_decode` takes one new query token per sequence;
:func:`reference_paged_prefill` many, causal over the cached prefix plus the new tokens. Their
arguments are checked at the door by `paged_ref.attention._checks`, the same checks every
other backend runs, so all of them reject bad input with the same message.
"""

from __future__ import annotations

import torch

from .._arith import cdiv
from ._checks import check_paged_inputs, check_prefill_inputs


def gather_sequence(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len, num_kv_heads, head_dim]``: one sequence's tokens copied out of the pages of
    ``cache`` (``[num_pages, page_size, num_kv_heads, head_dim]``) listed in ``block_table_row``.

    Example:
        >>> kc = torch.arange(12.).view(3, 2, 1, 2)      # 3 pages of 2 tokens
        >>> gather_sequence(kc, torch.tensor([2, 0]), 3)[:, 0, 0].tolist()
        [8.0, 10.0, 0.0]
    """
    page_size = cache.shape[1]
    num_used = cdiv(seq_len, page_size)  # ceil
    pages = cache[block_table_row[:num_used].long()]  # [num_used, page_size, H, D]
    return pages.flatten(0, 1)[:seq_len]  # [seq_len, H, D]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention of one sequence with GQA: q ``[num_q_heads, q_len, D]``; k, v
    ``[kv_len, num_kv_heads, D]``; mask bool ``[q_len, kv_len]`` (True = may attend) or None.
    Returns ``[num_q_heads, q_len, D]`` in float32 (float64 for float64 ``q``)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[0] // k.shape[1]  # query heads per KV head
    k = k.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, kv_len, D]
    v = v.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, kv_len, D]
    scores = (q.to(compute) @ k.transpose(1, 2)) * scale  # [Hq, q_len, kv_len]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # [Hq, q_len, D]


def _decode(q, k_cache, v_cache, block_table, seq_lens, scale: float) -> torch.Tensor:
    """Decode on checked inputs: each query attends to all its sequence's tokens."""
    out = torch.empty_like(q)  # [batch, Hq, D]
    for b, n in enumerate(seq_lens.tolist()):
        k = gather_sequence(k_cache, block_table[b], n)  # [n, Hkv, D]
        v = gather_sequence(v_cache, block_table[b], n)  # [n, Hkv, D]
        out[b] = attend(q[b].unsqueeze(1), k, v, None, scale).squeeze(1).to(q.dtype)
    return out


def _prefill(q, k_cache, v_cache, block_table, seq_lens, q_lens, scale: float) -> torch.Tensor:
    """Causal prefill on checked inputs: new token ``i`` of sequence ``b`` sits at position
    ``seq_lens[b] - q_lens[b] + i`` and attends to the cached tokens up to itself."""
    out = torch.zeros_like(q)  # [batch, Hq, max_q_len, D]: padding rows stay 0
    for b, (n, m) in enumerate(zip(seq_lens.tolist(), q_lens.tolist())):
        if m == 0:
            continue
        k = gather_sequence(k_cache, block_table[b], n)  # [n, Hkv, D]
        v = gather_sequence(v_cache, block_table[b], n)  # [n, Hkv, D]
        q_pos = torch.arange(n - m, n, device=q.device)  # [m] logical positions of queries
        kv_pos = torch.arange(n, device=q.device)  # [n]
        causal = kv_pos[None, :] <= q_pos[:, None]  # [m, n]
        out[b, :, :m] = attend(q[b, :, :m], k, v, causal, scale).to(q.dtype)
    return out


def reference_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Decode attention over a paged KV cache, by gathering each sequence's pages.

    Query ``b`` attends to the first ``seq_lens[b]`` tokens of sequence ``b`` (no causal mask:
    the query is the newest token and its own K/V is already in the cache).
    Arithmetic is float32 (float64 when ``q`` is float64).

    Args:
        q: ``[batch, num_q_heads, head_dim]``.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``;
            ``num_q_heads % num_kv_heads == 0`` (query head ``h`` reads KV head
            ``h // (num_q_heads // num_kv_heads)``).
        block_table: int32 ``[batch, max_pages]``; entries past a sequence's pages are ignored.
        seq_lens: int32 ``[batch]``, each ``>= 1``.
        scale: softmax scale, default ``head_dim ** -0.5``.
        check_values: also check the values of ``seq_lens`` and the used block-table entries
            (reads them on the host); every backend takes this keyword.

    Returns:
        ``[batch, num_q_heads, head_dim]``, dtype of ``q``.

    Example:
        >>> kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
        >>> q = torch.randn(2, 8, 64)
        >>> bt = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)   # 7: unused padding
        >>> out = reference_paged_decode(q, kc, vc, bt, torch.tensor([20, 5]))
        >>> out.shape
        torch.Size([2, 8, 64])
    """
    scale = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values)
    return _decode(q, k_cache, v_cache, block_table, seq_lens, scale)


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
) -> torch.Tensor:
    """Prefill (or chunked prefill) attention over a paged KV cache, causal.

    Sequence ``b`` has ``seq_lens[b]`` tokens in the cache, of which the last ``q_lens[b]`` are
    the new tokens whose queries are in ``q`` (their K/V must already be written). New token
    ``i`` sits at logical position ``p = seq_lens[b] - q_lens[b] + i`` and attends to the
    cached tokens ``0..p`` (the prefix and the new tokens up to itself). A plain prefill has
    ``q_lens == seq_lens``; a decode step is ``q_lens == 1``.

    The layout of ``q`` is the one Hugging Face attention functions receive
    (``[batch, heads, q_len, head_dim]``), right-padded to ``max_q_len``; rows
    ``i >= q_lens[b]`` are padding and come back as zeros.

    Args:
        q: ``[batch, num_q_heads, max_q_len, head_dim]``.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``.
        block_table: int32 ``[batch, max_pages]``.
        seq_lens: int32 ``[batch]``, cached tokens per sequence including the new ones, ``>= 1``.
        q_lens: int32 ``[batch]``, new tokens per sequence, ``0 <= q_lens[b] <= seq_lens[b]``.
        scale: softmax scale, default ``head_dim ** -0.5``.
        check_values: also check the values of ``seq_lens``, ``q_lens`` and the used block-table
            entries (reads them on the host), as `reference_paged_decode` does.

    Returns:
        ``[batch, num_q_heads, max_q_len, head_dim]``, dtype of ``q``; padding rows are 0.

    Example:
        >>> kc, vc = torch.randn(4, 8, 1, 32), torch.randn(4, 8, 1, 32)
        >>> q = torch.randn(2, 2, 5, 32)           # up to 5 new tokens per sequence
        >>> bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        >>> out = reference_paged_prefill(q, kc, vc, bt, torch.tensor([12, 3]),
        ...                               torch.tensor([5, 3]))
        >>> out.shape, bool(out[1, :, 3:].eq(0).all())
        (torch.Size([2, 2, 5, 32]), True)
    """
    scale = check_prefill_inputs(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=check_values
    )
    return _prefill(q, k_cache, v_cache, block_table, seq_lens, q_lens, scale)


__all__ = [
    "attend",
    "check_paged_inputs",
    "check_prefill_inputs",
    "gather_sequence",
    "reference_paged_decode",
    "reference_paged_prefill",
]
