"""Eviction policies that keep a paged cache sequence within a token budget.

Notation (kept apart on purpose; the paper writes B and C): ``page_size`` = B, tokens per page;
``budget`` = C, tokens a sequence may hold after an eviction step.

The policy base class, its hooks and the shared or per-layer decision are in
`paged_ref.eviction.base`.

Policies (``make_policy(name, budget, **options)``):

- ``"full"``: never evicts.
- ``"paged_eviction"`` (PagedEviction, as its authors run it): prefill keeps the top-``budget``
  tokens by score (in their original order, via `PagedKVCache.compact`), the first and the last
  page_size tokens always among them; during decode, each time the newest page fills
  (``seq_len % page_size == 0``) while ``seq_len > budget``, drops the whole page with the
  lowest page score (`PagedKVCache.drop_pages`), never page 0 and never the newest page
  (`Reserved`). ``method`` picks the score, so the ablations are
  ``make_policy("paged_eviction", C, method="value_norm")`` etc. (short names
  ``"inverse_key_norm"``, ``"value_norm"``, ``"key_norm"``, ``"key_value_ratio"``, ``"random"``
  do the same).
- ``"paged_eviction_literal"``: the paper's text as written, page 0 not reserved. Its score
  ranks the first token (the attention sink) low, and losing it costs a lot: the evaluation
  keeps it as a named ablation.
- ``"streaming_llm"``: the first ``sink_tokens`` plus the most recent tokens; at page
  granularity during decode (the oldest page after the sink pages goes).
- ``"token_topk"``: unstructured token eviction: after every append beyond the budget, the
  lowest-scoring token goes and the sequence is compacted (with ``method="inverse_key_norm"``
  the paper's token-level baseline). Its stats record the copies that
  compaction makes and the holes per page the same evictions would leave without compaction.

Each policy holds at most ``ceil(budget / page_size) + 1`` pages per sequence, and evicted
pages go back to the allocator at once (``PagedKVCache.drop_pages`` / ``compact`` free them).

Example:
    >>> import torch
    >>> from paged_ref.cache import PagedKVCache
    >>> cache = PagedKVCache(num_layers=2, num_pages=16, page_size=4, num_kv_heads=1, head_dim=8)
    >>> s = cache.add_sequence()
    >>> slots = cache.reserve(s, 20)                          # a 20-token prompt
    >>> for layer in range(2): cache.write(layer, slots, torch.randn(20, 1, 8), torch.randn(20, 1, 8))
    >>> policy = make_policy("paged_eviction", budget=8)
    >>> policy.after_prefill(cache, s); cache.seq_len(s), len(cache.pages(s))
    (8, 2)
    >>> for step in range(4):                                 # decode one token at a time
    ...     slots = cache.reserve(s, 1)
    ...     for layer in range(2): cache.write(layer, slots, torch.randn(1, 1, 8), torch.randn(1, 1, 8))
    ...     policy.after_append(cache, s)
    >>> cache.seq_len(s), policy.stats(s).pages_dropped      # 12 tokens = 3 full pages -> one dropped
    (8, 1)
"""

from __future__ import annotations

import torch

from .._validate import check_choice, check_int
from ..block_table import pages_needed
from .base import EvictionPolicy, EvictionStats, Reserved, max_pages_held, sequence_scores
from .scores import page_scores

__all__ = [
    "POLICY_NAMES",
    "Reserved",
    "EvictionStats",
    "EvictionPolicy",
    "FullCache",
    "PagedEviction",
    "StreamingLLM",
    "TokenTopK",
    "make_policy",
    "resolve_policy",
    "sequence_scores",
    "max_pages_held",
    "ABLATIONS",
    "policy_order",
]

POLICY_NAMES = (
    "full",
    "paged_eviction",
    "paged_eviction_literal",
    "streaming_llm",
    "token_topk",
    "inverse_key_norm",
    "value_norm",
    "key_norm",
    "key_value_ratio",
    "random",
)

#: The reviewers' ablation: the ratio against V only, K only (inverse norm), its opposite, the
#: swapped ratio ||K||/||V|| (what the authors' vLLM code computes) and random.
ABLATIONS = ("value_norm", "inverse_key_norm", "key_norm", "key_value_ratio", "random")


def policy_order(policy: str) -> int:
    """Where ``policy`` goes in tables and legends: the full cache, PagedEviction's variants, the
    ablations, then the token-level baselines; names not listed last."""
    known = [
        "full",
        "paged_eviction",
        "paged_eviction_literal",
        "paged_eviction_per_layer",
        "paged_eviction_literal_per_layer",
        *ABLATIONS,
        "streaming_llm",
        "token_topk",
        "token_inverse_key_norm",
    ]
    return known.index(policy) if policy in known else len(known)


class FullCache(EvictionPolicy):
    """No eviction (the reference every other policy is measured against)."""

    name = "full"

    def __init__(self, budget: int | None = None, **kwargs):
        if budget is not None:
            raise ValueError(f"the 'full' policy takes no budget, got budget={budget!r}")
        super().__init__(None, **kwargs)


class _PagedDecode(EvictionPolicy):
    """Shared decode rule: when the newest page fills and the sequence is over budget, drop a page.

    Subclasses say which pages are reserved (`_reserved`) and which candidates go (`_choose_pages`).
    """

    def __init__(self, budget: int, **kwargs):
        if budget is None:
            raise ValueError(f"{self.name} needs budget=<tokens>, got None")
        super().__init__(budget, **kwargs)

    def _reserved(self, page_size: int) -> Reserved:
        raise NotImplementedError

    def _check_cache(self, cache) -> None:
        super()._check_cache(cache)
        reserved = self._reserved(cache.page_size)
        need = reserved.min_budget(cache.page_size)
        if self.budget < need:
            raise ValueError(
                f"budget must be >= {need} tokens with page_size={cache.page_size} and {reserved.first_pages} "
                f"reserved first page(s), so that a page can always be evicted; got budget={self.budget}"
            )

    def _room(self, page_size: int, held: int) -> int:
        return page_size - held % page_size

    def _decode_evict(self, cache, seq_id) -> None:
        ps = cache.page_size
        candidates = self._reserved(ps).candidate_pages
        while cache.seq_len(seq_id) > self.budget and cache.seq_len(seq_id) % ps == 0:
            pages = self._choose_pages(cache, seq_id, candidates(cache.seq_len(seq_id) // ps))
            self._drop_page(cache, seq_id, pages)


def _check_flags(**flags) -> None:
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")


class PagedEviction(_PagedDecode):
    """PagedEviction (arXiv 2509.04377) as its authors run it, and its ablations.

    Args:
        budget: C, tokens kept; must be >= page_size (x2 with protect_first_page).
        method: token score (`SCORE_METHODS`); ``"value_key_ratio"`` is the paper's.
        reduce: page score from token scores, ``"mean"`` (the paper) or ``"sum"``.
        protect_first_page: never evict the first page_size tokens (the attention sink). Default
            True: every public version of the authors' code keeps the first block at prefill
            and never evicts page 0 in decode, although the paper's text does not say so.
            ``make_policy("paged_eviction_literal", C)`` is the text without it.
        protect_last_page: never evict the newest page_size tokens; at a decode eviction they are
            exactly the page that just filled. Default True (the authors' code keeps the last
            block too).
        decision: ``"shared"`` (one decision for all layers from the layer-mean score, on a
            `PagedKVCache`) or ``"per_layer"`` (each layer keeps its own top-C and drops its own
            lowest page, from its own scores; needs a `LayeredKVCache`, one block table per layer).
        seed: generator seed for ``method="random"``.
    """

    name = "paged_eviction"

    def __init__(
        self,
        budget: int,
        *,
        method: str = "value_key_ratio",
        reduce: str = "mean",
        protect_first_page: bool = True,
        protect_last_page: bool = True,
        decision: str = "shared",
        seed: int = 0,
    ):
        _check_flags(protect_first_page=protect_first_page, protect_last_page=protect_last_page)
        super().__init__(budget, method=method, seed=seed, decision=decision)
        self.reduce = check_choice("reduce", reduce, {"mean", "sum"})
        self.reserved = Reserved(int(protect_first_page), protect_last_page)

    def _reserved(self, page_size: int) -> Reserved:
        return self.reserved

    def _prefill_evict(self, cache, seq_id) -> None:
        self._keep_top(cache, seq_id, self.reserved)

    def _choose_pages(self, cache, seq_id, candidates: list[int]) -> list[int]:
        """The lowest-scoring candidate page of each lane."""
        candidates = torch.tensor(candidates)
        pages = []
        for lane in self._scores(cache, seq_id):  # [seq_len] each
            scores = page_scores(lane, cache.page_size, self.reduce)  # [num_pages]
            # argmin returns the first minimum: ties go to the oldest page
            pages.append(int(candidates[torch.argmin(scores[candidates])]))
        return pages

    def _repr_fields(self) -> dict:
        return {**super()._repr_fields(), "reduce": self.reduce, **self.reserved.flags()}


class StreamingLLM(_PagedDecode):
    """Attention sinks + a recent window (StreamingLLM), evicting at page granularity.

    Prefill keeps the first ``sink_tokens`` and the last ``budget - sink_tokens`` tokens. During
    decode, when the newest page fills over budget, the oldest page after the pages that hold
    the sinks goes. Pages are whole, so the page holding the sinks is kept whole (with
    page_size=16 and 4 sinks, 12 early window tokens stay beside them).

    Args:
        budget: C, tokens kept; >= (pages holding the sinks + 1) * page_size.
        sink_tokens: the first tokens always kept (StreamingLLM uses 4).
    """

    name = "streaming_llm"

    def __init__(self, budget: int, *, sink_tokens: int = 4):
        self.sink_tokens = check_int("sink_tokens", sink_tokens, min_value=0)
        super().__init__(budget)
        if self.sink_tokens >= self.budget:
            raise ValueError(f"sink_tokens must be < budget={self.budget}, got {self.sink_tokens}")

    def _reserved(self, page_size: int) -> Reserved:
        return Reserved(pages_needed(self.sink_tokens, page_size), last_page=True)

    def _prefill_evict(self, cache, seq_id) -> None:
        n = cache.seq_len(seq_id)
        keep = torch.zeros(1, n, dtype=torch.bool)  # [lanes=1, n]
        keep[:, : self.sink_tokens] = True
        keep[:, n - (self.budget - self.sink_tokens) :] = True
        self._compact(cache, seq_id, keep)

    def _choose_pages(self, cache, seq_id, candidates: list[int]) -> list[int]:
        return candidates[:1]  # the oldest page that holds no sink

    def _repr_fields(self) -> dict:
        return {"budget": self.budget, "sink_tokens": self.sink_tokens}


class TokenTopK(EvictionPolicy):
    """Unstructured token-level eviction by score, compacting after every eviction.

    Prefill is the same as PagedEviction's (top-``budget`` tokens). After each append that
    takes the sequence over budget, the lowest-scoring tokens (excluding the protected ones) go
    and the survivors are packed (`PagedKVCache.compact`), so pages stay dense but every
    eviction copies the tokens behind the hole (`EvictionStats.tokens_moved`). Without
    compaction the holes would stay in their pages (`EvictionStats.max_holes_per_page`).
    With ``method="inverse_key_norm"`` this is the paper's token-level baseline (1/||K||).

    Args:
        budget: C, tokens kept.
        method: token score (`SCORE_METHODS`).
        protect_first_page, protect_last_page: never evict the first / newest ``page_size``
            tokens (defaults as in `PagedEviction`: both reserved).
        decision: ``"shared"`` or ``"per_layer"``, as in `PagedEviction`.
    """

    name = "token_topk"

    def __init__(
        self,
        budget: int,
        *,
        method: str = "value_key_ratio",
        protect_first_page: bool = True,
        protect_last_page: bool = True,
        decision: str = "shared",
        seed: int = 0,
    ):
        if budget is None:
            raise ValueError("token_topk needs budget=<tokens>, got None")
        _check_flags(protect_first_page=protect_first_page, protect_last_page=protect_last_page)
        super().__init__(budget, method=method, seed=seed, decision=decision)
        self.reserved = Reserved(int(protect_first_page), protect_last_page)

    def _check_cache(self, cache) -> None:
        super()._check_cache(cache)
        need = self.reserved.min_budget(cache.page_size, unit="token")
        if self.budget < need:
            raise ValueError(
                f"budget must be >= {need} with page_size={cache.page_size} and the protected pages, "
                f"got budget={self.budget}"
            )

    def _room(self, page_size: int, held: int) -> int:
        return max(1, self.budget + 1 - held)

    def _prefill_evict(self, cache, seq_id) -> None:
        self._keep_top(cache, seq_id, self.reserved)
        self._record_holes(cache.page_size, seq_id)

    def _decode_evict(self, cache, seq_id) -> None:
        if cache.seq_len(seq_id) > self.budget:
            self._prefill_evict(cache, seq_id)  # the same top-C rule, now over one token too many

    def _repr_fields(self) -> dict:
        return {**super()._repr_fields(), **self.reserved.flags()}

    def _record_holes(self, page_size: int, seq_id: int) -> None:
        """Holes per page if every token had stayed at its original slot (never compacted).

        Token ``p`` (0 = first prompt token) would sit on page ``p // page_size``; a page is held
        while any of its tokens survives; its holes are its written slots whose token is gone.
        """
        stats = self._stats[seq_id]
        for pos in self._positions[seq_id]:  # int64 [seq_len] per lane, original index of each survivor
            held = torch.unique(pos // page_size)  # pages an uncompacted layout would hold
            written = held.numel() * page_size
            newest = (stats.tokens_seen - 1) // page_size
            if int(held[-1]) == newest:  # the newest page is written only up to tokens_seen
                written -= (newest + 1) * page_size - stats.tokens_seen
            holes = written - pos.numel()
            stats.max_holes_per_page = max(stats.max_holes_per_page, holes / held.numel())


def make_policy(name: str, budget: int | None = None, **options) -> EvictionPolicy:
    """A policy by name.

    Args:
        name: one of ``POLICY_NAMES``. ``"inverse_key_norm"``, ``"value_norm"``, ``"key_norm"``,
            ``"key_value_ratio"`` and ``"random"`` are PagedEviction (page eviction, pages
            reserved as the authors do) with that score, i.e. the ablations.
            ``"paged_eviction_literal"`` is the paper's text as written: nothing reserved but the
            newest page (``protect_first_page=False``).
        budget: C in tokens (required except for ``"full"``).
        **options: keyword options of the policy class.

    Example:
        >>> make_policy("value_norm", 256)
        PagedEviction(budget=256, method='value_norm', reduce='mean', protect_first_page=True, protect_last_page=True)
    """
    check_choice("name", name, set(POLICY_NAMES))
    if name == "full":
        return FullCache(budget, **options)
    if name == "streaming_llm":
        return StreamingLLM(budget, **options)
    if name == "token_topk":
        return TokenTopK(budget, **options)
    if name == "paged_eviction_literal":
        if "protect_first_page" in options:
            raise ValueError("'paged_eviction_literal' fixes protect_first_page=False; use 'paged_eviction' instead")
        return PagedEviction(budget, protect_first_page=False, **options)
    if name != "paged_eviction":
        if "method" in options:
            raise ValueError(f"policy {name!r} fixes method={name!r}; use 'paged_eviction' with method= instead")
        options["method"] = name
    return PagedEviction(budget, **options)


def resolve_policy(eviction, budget: int | None) -> EvictionPolicy | None:
    """What ``generate(..., eviction=, budget=)`` means: None, a policy name, or a policy object.

    A name needs ``budget`` (except ``"full"``); an object carries its own budget, so ``budget``
    must then be None or equal to it.
    """
    if eviction is None:
        if budget is not None:
            raise ValueError(
                f"budget={budget!r} was given without eviction=; pass eviction='paged_eviction' (or another policy)"
            )
        return None
    if isinstance(eviction, EvictionPolicy):
        if budget is not None and budget != eviction.budget:
            raise ValueError(f"budget={budget!r} disagrees with the policy's own budget={eviction.budget!r}")
        return eviction
    if isinstance(eviction, str):
        return make_policy(eviction, budget)
    raise TypeError(
        f"eviction must be None, a policy name {POLICY_NAMES} or an EvictionPolicy, got {type(eviction).__name__}"
    )
