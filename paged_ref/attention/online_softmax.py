"""The Triton decode kernel's math in plain PyTorch, step by step: a spec to read, print and check.

:mod:`.triton_decode` computes softmax attention without ever holding a whole row of scores;
this module does the same computation in the same order, so each intermediate value can be
printed (notebook 05) and the whole checked against the reference:

* :func:`online_update`: one tile of the **online softmax**, the kernel's loop body. State per
  query row: running max ``m``, running sum ``l = sum 2^(s - m)``, unnormalised output
  ``acc = sum 2^(s - m) v``. Scores are in **base 2** (``log2(e)`` folded into the scale), so
  ``2^s`` is ``e^(q.k * scale)``. (`paged_ref.lab.softmax_steps` keeps every tile's state.)
* :func:`split_ranges` cuts a sequence into **split-K** chunks; :func:`merge_partials` is the
  **log-sum-exp reduction** of their ``(m, l, acc)``.
* :func:`paged_decode_spec`: the whole kernel, per (sequence, KV head, split), the **GQA** group's
  query heads together, each token's K/V found through the **block table** (:func:`token_slots`).

Example:
    >>> import torch
    >>> m, l, acc = torch.tensor([3.0]), torch.tensor([1.25]), torch.tensor([[1.0]])  # after scores 1, 3 (v = 0, 1)
    >>> m, l, acc, alpha = online_update(m, l, acc, torch.tensor([[2.0, 5.0]]), torch.tensor([[2.0], [3.0]]))
    >>> m.item(), alpha.item(), l.item()                      # the max rose from 3 to 5: alpha = 2^(3 - 5)
    (5.0, 0.25, 1.4375)
    >>> split_ranges(100, 3, block_n=16)
    [(0, 48), (48, 96), (96, 100)]
"""

from __future__ import annotations

import torch

from .._arith import cdiv
from .._validate import check_int
from ._checks import check_paged_inputs

__all__ = ["LOG2E", "merge_partials", "online_update", "paged_decode_spec", "split_ranges", "token_slots"]

LOG2E = 1.4426950408889634  # log2(e): e^x = 2^(x * log2(e))


def online_update(
    m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile into the state, the kernel's loop body line for line: raise the running max,
    rescale what was summed under the old max by ``alpha = 2^(m_old - m_new)`` (0 on the first
    tile, where ``m = -inf``), add the tile. Returns ``(m_new, l_new, acc_new, alpha)``.

    Args:
        m, l: ``[rows]``; acc: ``[rows, d]``; v: ``[n, d]`` this tile's values.
        scores: ``[rows, n]`` this tile's scores in base 2 (``-inf`` = masked), one finite per row.
    """
    m_new = torch.maximum(m, scores.amax(dim=1))  # [rows]
    alpha = torch.exp2(m - m_new)  # [rows]
    p = torch.exp2(scores - m_new[:, None])  # [rows, n]
    l_new = l * alpha + p.sum(dim=1)  # [rows]
    acc_new = acc * alpha[:, None] + p @ v  # [rows, d]
    return m_new, l_new, acc_new, alpha


def split_ranges(seq_len: int, num_splits: int, *, block_n: int) -> list[tuple[int, int]]:
    """The token range ``[start, end)`` of each split, as the kernel computes it: whole tiles of
    ``block_n`` each, the last non-empty split cut at ``seq_len``, trailing ones possibly empty.

    Example:
        >>> split_ranges(40, 4, block_n=16)        # 10 tokens a split, rounded up to 16
        [(0, 16), (16, 32), (32, 40), (40, 40)]
    """
    seq_len = check_int("seq_len", seq_len, min_value=1)
    num_splits = check_int("num_splits", num_splits, min_value=1)
    block_n = check_int("block_n", block_n, min_value=1)
    per_split = cdiv(cdiv(seq_len, num_splits), block_n) * block_n
    return [(min(s * per_split, seq_len), min((s + 1) * per_split, seq_len)) for s in range(num_splits)]


def merge_partials(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """The reduction kernel: per-split states ``m, l [num_splits, rows]``, ``acc [num_splits, rows,
    d]`` combined into the output ``[rows, d]``. Split ``s`` summed relative to its own max; with
    the global max ``M``, ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``. Empty splits
    (``m_s = -inf``) weigh 0; every row needs one non-empty split."""
    if m.dim() != 2 or l.shape != m.shape or acc.shape[:2] != m.shape:
        raise ValueError(
            f"m, l must be [num_splits, rows] and acc [num_splits, rows, d], got "
            f"{tuple(m.shape)}, {tuple(l.shape)}, {tuple(acc.shape)}"
        )
    m_global = m.amax(dim=0)  # [rows]
    if not torch.isfinite(m_global).all():
        raise ValueError("every row needs at least one non-empty split (finite m)")
    w = torch.exp2(m - m_global)  # [num_splits, rows]
    return (w[:, :, None] * acc).sum(dim=0) / (w * l).sum(dim=0)[:, None]


def token_slots(
    block_table_row: torch.Tensor, tokens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-table lookup, as the kernel does it per token: token ``t`` of ``tokens: int [n]``
    is on page ``block_table_row[t // page_size]`` at offset ``t % page_size``; int64 ``(pages,
    offsets)``.

    Example:
        >>> token_slots(torch.tensor([7, 2, 5]), torch.arange(1, 6), page_size=2)
        (tensor([7, 2, 2, 5, 5]), tensor([1, 0, 1, 0, 1]))
    """
    page_size = check_int("page_size", page_size, min_value=1)
    tokens = tokens.long()  # [n]
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < (block_table_row.shape[0] * page_size):
        raise ValueError(
            f"tokens must lie in [0, {block_table_row.shape[0] * page_size}) "
            f"(the block table row's pages), got {tokens.min()}..{tokens.max()}"
        )
    return block_table_row[tokens // page_size].long(), tokens % page_size


def _rows(cache, page_scale, pages, offsets, h) -> torch.Tensor:
    """KV head ``h`` of the tokens at ``(pages, offsets)`` (int64 ``[n]``) -> ``[n, D]``; 8-bit pages times their
    ``page_scale [num_pages, Hkv]``, in float32."""
    rows = cache[pages, offsets, h]  # [n, D]
    return rows if page_scale is None else rows.float() * page_scale[pages, h][:, None]


def paged_decode_spec(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int = 1,
    block_n: int = 32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """What :func:`~.triton_decode.triton_paged_decode` computes, program by program: the contract
    of :func:`~.reference.reference_paged_decode`, in ``num_splits`` chunks and tiles of ``block_n``.

    For every (sequence, KV head, split) one "program": the group's query heads as the rows of one
    tile, the split's tokens tile by tile through the block table (8-bit pages: each token's bytes times its
    page's scale, in float32), the online softmax in float32 (float64 for float64 inputs); then
    :func:`merge_partials`. The recipe, not a fast path.

    Example:
        >>> kc, vc = torch.randn(4, 8, 1, 16), torch.randn(4, 8, 1, 16)
        >>> q = torch.randn(1, 4, 16)                              # MQA: 4 query heads
        >>> bt, lens = torch.tensor([[2, 0, 3]]), torch.tensor([20])
        >>> from paged_ref.attention.reference import reference_paged_decode
        >>> ref = reference_paged_decode(q, kc, vc, bt, lens)
        >>> torch.allclose(paged_decode_spec(q, kc, vc, bt, lens, num_splits=3, block_n=4), ref,
        ...                atol=1e-5)
        True
    """
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, scale=scale, **scales)  # + split_ranges
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale_log2 = scale * LOG2E
    out = torch.empty_like(q)  # [batch, Hq, D]
    for b, seq_len in enumerate(seq_lens.tolist()):
        for h in range(num_kv_heads):
            heads = slice(h * group, (h + 1) * group)
            q_rows = q[b, heads].to(compute)  # [group, D]
            parts = []  # (m, l, acc) per split
            for start, end in split_ranges(seq_len, num_splits, block_n=block_n):
                m = torch.full((group,), float("-inf"), dtype=compute, device=q.device)  # [group]
                l = torch.zeros(group, dtype=compute, device=q.device)  # [group]
                acc = torch.zeros(group, head_dim, dtype=compute, device=q.device)  # [group, D]
                for t0 in range(start, end, block_n):
                    tokens = torch.arange(t0, min(t0 + block_n, end), device=q.device)  # [n]
                    pages, offsets = token_slots(block_table[b], tokens, page_size)
                    k = _rows(k_cache, k_scale, pages, offsets, h).to(compute)  # [n, D]
                    v = _rows(v_cache, v_scale, pages, offsets, h).to(compute)  # [n, D]
                    scores = (q_rows @ k.T) * scale_log2  # [group, n], base 2
                    m, l, acc, _ = online_update(m, l, acc, scores, v)
                parts.append((m, l, acc))
            m_all, l_all, acc_all = (torch.stack(x) for x in zip(*parts))  # [S, group(, D)]
            out[b, heads] = merge_partials(m_all, l_all, acc_all).to(q.dtype)
    return out
