"""Quest: each decode step reads only the pages whose keys may score highest for this query.

Eviction deletes pages for ever; Quest (Tang et al., 2024) keeps them all and chooses, per query,
which to read, from each page's key summary (`paged_ref.page_summaries`: elementwise ``k_min``,
``k_max``). Every key of the page lies between them coordinate by coordinate, so

    q . k  <=  sum_i max(q_i * k_min_i, q_i * k_max_i)        (:func:`page_bounds`)

A step takes the ``budget`` pages with the largest bound (:func:`select_pages`; one choice per KV
head, by its query heads' largest bound), always the last page, and attends over those only
(:func:`quest_paged_decode`). The next step may choose other pages.

Example:
    >>> import torch
    >>> k = torch.randn(5, 3)                                  # 5 keys of one page
    >>> q = torch.randn(3)
    >>> bound = page_bounds(q[None, None], k.amin(0)[None, None], k.amax(0)[None, None])
    >>> bool((k @ q <= bound + 1e-6).all())
    True
"""

from __future__ import annotations

import torch

from .._arith import cdiv
from .._validate import check_int
from ._checks import check_quest_inputs

__all__ = ["page_bounds", "quest_paged_decode", "select_pages"]


def page_bounds(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor) -> torch.Tensor:
    """The Quest bound ``[...]`` of ``q . k`` over the keys a summary covers (``q``, ``k_min``,
    ``k_max``: ``[..., head_dim]``, broadcast); +inf for an empty summary (NaN where a ``q_i`` is 0)."""
    return torch.maximum(q * k_min, q * k_max).sum(-1)


def select_pages(bounds: torch.Tensor, budget: int) -> torch.Tensor:
    """The ``budget`` largest of ``bounds [rows, num_pages]`` per row as int64 column indices
    ``[rows, budget]`` in increasing order, always the last page (the newest tokens).

    Example:
        >>> select_pages(torch.tensor([[0.5, 3.0, -1.0, 2.0, 0.0]]), 3).tolist()
        [[1, 3, 4]]
    """
    budget = check_int("budget", budget, min_value=1)
    num_pages = bounds.shape[-1]
    if budget > num_pages:
        raise ValueError(f"budget must be at most the pages held ({num_pages}), got {budget}")
    bounds = bounds.clone()
    bounds[:, -1] = float("inf")
    return bounds.topk(budget, dim=-1).indices.sort(dim=-1).values


def _pages(cache, page_scale, pages, heads) -> torch.Tensor:
    """``[Hkv, n, page_size, D]``: KV head ``h``'s slice of pages ``pages[h]`` (``[Hkv, n]``, ``heads [Hkv, 1]``);
    8-bit pages times their ``page_scale [num_pages, Hkv]``, in float32."""
    rows = cache[pages, :, heads]  # [Hkv, n, page_size, D]
    return rows if page_scale is None else rows.float() * page_scale[pages, heads][..., None, None]


def quest_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    k_min: torch.Tensor,
    k_max: torch.Tensor,
    *,
    budget: int,
    scale: float | None = None,
    check_values: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~.reference.reference_paged_decode` over at most ``budget`` (in ``[1, max_pages]``)
    pages per sequence and KV head, chosen by Quest's bound from ``k_min, k_max: [num_pages,
    num_kv_heads, head_dim]`` (`paged_ref.page_summaries`); exact when a sequence holds fewer. 8-bit pages
    (``k_scale``, ``v_scale``) are read as the reference reads them (the summaries: of what they hold).

    Example:
        >>> kc, vc = torch.randn(6, 4, 1, 8), torch.randn(6, 4, 1, 8)
        >>> k_min, k_max = kc.amin(1), kc.amax(1)                  # [6, 1, 8]: full pages
        >>> q, bt, lens = torch.randn(1, 2, 8), torch.tensor([[3, 0, 5, 1]]), torch.tensor([16])
        >>> quest_paged_decode(q, kc, vc, bt, lens, k_min, k_max, budget=2).shape
        torch.Size([1, 2, 8])
    """
    args = (q, k_cache, v_cache, block_table, seq_lens, k_min, k_max, budget)
    scale, budget = check_quest_inputs(*args, scale=scale, check_values=check_values, k_scale=k_scale, v_scale=v_scale)
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)  # [batch, Hq, D]
    for b, n in enumerate(seq_lens.tolist()):
        held = cdiv(n, page_size)
        table = block_table[b, :held].long()  # [held] physical pages, logical order
        qb = q[b].to(compute).view(num_kv_heads, group, head_dim)  # [Hkv, group, D]
        if held <= budget:
            chosen = torch.arange(held, device=q.device).expand(num_kv_heads, held)  # [Hkv, held]: every page
        else:
            lo, hi = k_min[table].to(compute), k_max[table].to(compute)  # [held, Hkv, D]: every page's summary
            bounds = page_bounds(qb[:, :, None], lo.transpose(0, 1)[:, None], hi.transpose(0, 1)[:, None])
            chosen = select_pages(bounds.amax(1), budget)  # [Hkv, budget]: by the group's largest bound
        heads = torch.arange(num_kv_heads, device=q.device)[:, None]  # [Hkv, 1]
        k = _pages(k_cache, k_scale, table[chosen], heads).to(compute)  # [Hkv, pages, page_size, D]: only those
        positions = chosen[:, :, None] * page_size + torch.arange(page_size, device=q.device)  # [Hkv, pages, page_size]
        valid = (positions < n).flatten(1)  # [Hkv, tokens]: the last page's unwritten tail is not a token
        v = _pages(v_cache, v_scale, table[chosen], heads).to(compute).flatten(1, 2).masked_fill(~valid[..., None], 0)
        scores = (qb @ k.flatten(1, 2).transpose(1, 2)) * scale  # [Hkv, group, tokens]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        out[b] = (torch.softmax(scores, -1) @ v).reshape(num_q_heads, head_dim).to(q.dtype)  # v: [Hkv, tokens, D]
    return out
