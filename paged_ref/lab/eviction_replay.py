"""Which tokens a policy evicts, and when: a policy run over given K/V in a real `PagedKVCache`.

`replay` prefills, then appends one token at a time (or the longest chunk the policy allows)
and records when each token left; `layout_stats` counts the holes token-level eviction would
leave in pages it could not free.

Example:
    >>> import torch
    >>> ks = [torch.randn(64, 2, 8) for _ in range(3)]; vs = [torch.randn(64, 2, 8) for _ in range(3)]
    >>> r = replay(ks, vs, "paged_eviction", budget=16, page_size=8, prompt_len=32)
    >>> int(r.kept.sum()), r.stats.pages_dropped        # 16 after prefill, then 32 more, 4 pages dropped
    (16, 4)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._arith import cdiv
from .._validate import check_int
from ..cache import PagedKVCache
from ..eviction.base import EvictionPolicy, EvictionStats
from ..eviction.policies import make_policy
from .eviction_analysis import check_kv_lists

__all__ = ["Replay", "replay", "layout_stats"]


@dataclass
class Replay:
    """One policy run over given K/V (see `replay`).

    Attributes:
        policy: the policy object (its repr names every option).
        page_size: B; budget: C (None for the full cache); prompt_len: tokens prefilled.
        evicted_at: int64 ``[num_tokens]``: -1 still held at the end, 0 evicted at prefill, t >= 1
            evicted by the hook after decode token t (t = 1 is the first token after the prompt).
        stats: the policy's `EvictionStats` for the sequence.
        max_pages: most pages the sequence held after the prefill eviction (the whole prompt is
            held once, before it), counting a newly added page before the hook runs.
    """

    policy: EvictionPolicy
    page_size: int
    budget: int | None
    prompt_len: int
    evicted_at: torch.Tensor
    stats: EvictionStats
    max_pages: int

    @property
    def kept(self) -> torch.Tensor:
        """bool ``[num_tokens]``: held at the end."""
        return self.evicted_at < 0


def replay(
    ks, vs, policy, *, budget: int | None = None, page_size: int, prompt_len: int, chunk: int | None = None
) -> Replay:
    """Run an eviction policy over precomputed K/V in a real `PagedKVCache`.

    The first ``prompt_len`` tokens are prefilled, then ``after_prefill`` runs; the rest are
    appended one token at a time (or in chunks no longer than the policy's
    `tokens_until_action`, which gives the same result) with ``after_append`` after each.
    The K/V of the later tokens are the ones given, i.e. computed with the full cache (under
    eviction a real decode would compute slightly different K/V in layers >= 1; the
    evaluation in `paged_ref.lab.bench.eviction` decodes for real). The allocator is checked to be
    all free again at the end. It runs with one torch thread (restored afterwards): every
    step is a handful of small tensor ops, which extra threads slow down on a busy machine
    (measured on 2 shared cores: 119 s with the default threads vs about 6 s with one, for the
    six policies of notebook 07 on 512 tokens).

    Args:
        ks, vs: per-layer ``[num_tokens, num_kv_heads, head_dim]``.
        policy: a policy name (``make_policy(policy, budget)``) or an `EvictionPolicy`.
        budget: C, for a policy name.
        page_size: B.
        prompt_len: tokens in the prefill (1 <= prompt_len <= num_tokens).
        chunk: largest chunk appended between hook calls (default: whatever the policy allows).
    """
    check_kv_lists(ks, vs)
    page_size = check_int("page_size", page_size, min_value=1)
    n = ks[0].shape[0]
    prompt_len = check_int("prompt_len", prompt_len, min_value=1)
    if prompt_len > n:
        raise ValueError(f"prompt_len must be <= num_tokens={n}, got {prompt_len}")
    if isinstance(policy, str):
        policy = make_policy(policy, budget)
    elif not isinstance(policy, EvictionPolicy):
        raise TypeError(f"policy must be a policy name or an EvictionPolicy, got {type(policy).__name__}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small per-token ops: extra threads only wait on a busy core
    try:
        return _replay(ks, vs, policy, page_size, prompt_len, chunk)
    finally:
        torch.set_num_threads(threads)


def _replay(ks, vs, policy, page_size, prompt_len, chunk) -> Replay:
    n = ks[0].shape[0]
    num_layers, (_, hkv, d) = len(ks), ks[0].shape
    cache = PagedKVCache(
        num_layers=num_layers,
        num_pages=cdiv(n, page_size) + 2,
        page_size=page_size,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=ks[0].dtype,
    )
    seq = cache.add_sequence()
    evicted_at = torch.full((n,), -1, dtype=torch.int64)  # [num_tokens]

    def append(lo, hi):
        slots = cache.reserve(seq, hi - lo)  # int64 [hi - lo]
        for layer in range(num_layers):
            cache.write(layer, slots, ks[layer][lo:hi], vs[layer][lo:hi])

    def mark(before: torch.Tensor, step: int):
        gone = before[~torch.isin(before, policy.positions(seq))]
        evicted_at[gone] = step

    append(0, prompt_len)
    policy.after_prefill(cache, seq)
    max_pages = len(cache.pages(seq))
    mark(torch.arange(prompt_len), 0)
    pos = prompt_len
    while pos < n:
        m = min(n - pos, policy.tokens_until_action(cache, seq), chunk or n)
        before = torch.cat([policy.positions(seq), torch.arange(pos, pos + m)])
        append(pos, pos + m)
        max_pages = max(max_pages, len(cache.pages(seq)))
        policy.after_append(cache, seq)
        pos += m
        mark(before, pos - prompt_len)
    stats = policy.stats(seq)
    cache.free(seq)
    policy.release(seq)
    assert cache.allocator.num_free == cache.num_pages, "every page goes back to the allocator"
    return Replay(
        policy=policy,
        page_size=page_size,
        budget=policy.budget,
        prompt_len=prompt_len,
        evicted_at=evicted_at,
        stats=stats,
        max_pages=max_pages,
    )


def layout_stats(kept: torch.Tensor, page_size: int, lo: int = 0, hi: int | None = None) -> dict:
    """Pages the surviving tokens need if no token ever moves, for positions ``lo:hi``.

    Each token stays in the slot it was written to (token ``p`` on page ``p // page_size``),
    as a paged cache without compaction keeps it; a page is held while any of its tokens
    survives. Page eviction frees whole pages and leaves no hole; unstructured token eviction
    leaves holes that hold memory until a compaction copies the survivors.

    Returns:
        dict ``kept`` (tokens), ``dense_pages`` (ceil(kept / B): the least possible),
        ``pages_held`` (pages with a survivor), ``holes`` (evicted slots inside held pages),
        ``hole_fraction`` (holes / slots of held pages).

    Example:
        >>> layout_stats(torch.tensor([1, 0, 1, 0, 0, 0, 1, 1], dtype=torch.bool), 4)
        {'kept': 4, 'dense_pages': 1, 'pages_held': 2, 'holes': 4, 'hole_fraction': 0.5}
    """
    page_size = check_int("page_size", page_size, min_value=1)
    if kept.dtype != torch.bool or kept.dim() != 1:
        raise ValueError(f"kept must be a 1-D bool tensor, got {kept.dtype} {list(kept.shape)}")
    hi = kept.shape[0] if hi is None else hi
    pos = torch.arange(lo, hi)[kept[lo:hi]]
    pages = torch.unique(pos // page_size)
    slots = sum(min(hi, (int(p) + 1) * page_size) - max(lo, int(p) * page_size) for p in pages)
    holes = slots - pos.numel()
    return dict(
        kept=int(pos.numel()),
        dense_pages=cdiv(int(pos.numel()), page_size),
        pages_held=int(pages.numel()),
        holes=int(holes),
        hole_fraction=round(holes / slots, 4) if slots else 0.0,
    )
