"""Eviction policies that keep a paged cache sequence within a token budget.

``page_size`` is the paper's B (tokens per page), ``budget`` its C (tokens a sequence may hold
after an eviction step). `make_policy(name, budget, **options)` builds one:

``"full"`` (never evicts), ``"paged_eviction"`` (`PagedEviction`; ``"paged_eviction_literal"``
is the paper's text, the score names such as ``"value_norm"`` its ablations), ``"streaming_llm"``
and ``"token_topk"`` (the token-level baseline).

Every policy holds at most ``ceil(budget / page_size) + 1`` pages per sequence; evicted pages go
back to the allocator at once. The base class and its hooks are in `paged_ref.eviction.base`.

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
from .base import EvictionPolicy, Reserved
from .scores import SCORE_METHODS, page_scores

__all__ = ["POLICY_NAMES", "FullCache", "PagedEviction", "StreamingLLM", "TokenTopK", "make_policy", "resolve_policy"]

# a score name other than the paper's: PagedEviction with that score (an ablation)
POLICY_NAMES = ("full", "paged_eviction", "paged_eviction_literal", "streaming_llm", "token_topk", *SCORE_METHODS[1:])


class FullCache(EvictionPolicy):
    """No eviction (the reference every other policy is measured against)."""

    name = "full"
    needs_budget = False

    def __init__(self, budget: int | None = None, **kwargs):
        if budget is not None:
            raise ValueError(f"the 'full' policy takes no budget, got budget={budget!r}")
        super().__init__(None, **kwargs)


class _PagedDecode(EvictionPolicy):
    """The decode rule of page eviction: when the newest page fills over budget, one page goes.

    Subclasses say which pages are reserved (`_reserved`) and which candidate goes (`_choose_pages`).
    """

    def _room(self, page_size: int, held: int) -> int:
        return page_size - held % page_size

    def _decode_evict(self, cache, seq_id) -> None:
        ps = cache.page_size
        candidates = self._reserved(ps).candidate_pages
        while cache.seq_len(seq_id) > self.budget and cache.seq_len(seq_id) % ps == 0:
            pages = self._choose_pages(cache, seq_id, candidates(cache.seq_len(seq_id) // ps))
            self._drop_page(cache, seq_id, pages)


class PagedEviction(_PagedDecode):
    """PagedEviction (arXiv 2509.04377) as its authors run it, and its ablations.

    Args:
        budget: C, tokens kept; must be >= page_size (x2 with protect_first_page).
        method: token score (`SCORE_METHODS`); ``"value_key_ratio"`` is the paper's.
        reduce: page score from token scores, ``"mean"`` (the paper) or ``"sum"``; they differ on
            partial pages only, so never at a decode eviction (every held page is full then).
        protect_first_page: never evict the first page (the attention sink). The authors' code
            does so, the paper's text does not (``make_policy("paged_eviction_literal", C)``).
        protect_last_page: never evict the newest page (at a decode eviction: the one that just filled).
        decision: ``"shared"`` (one decision from the layer-mean score, on a `PagedKVCache`) or
            ``"per_layer"`` (each layer its own, on a `LayeredKVCache`).
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
        self.reserved = Reserved.from_flags(protect_first_page, protect_last_page)
        super().__init__(budget, method=method, seed=seed, decision=decision)
        self.reduce = check_choice("reduce", reduce, {"mean", "sum"})

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

    Prefill keeps the first ``sink_tokens`` and the last ``budget - sink_tokens`` tokens; in
    decode the oldest page after those holding the sinks goes. The pages holding the sinks stay
    whole (with page_size=16 and 4 sinks, 12 early tokens stay beside them).

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

    Prefill is PagedEviction's; after each append over budget the lowest-scoring unprotected
    token goes and the survivors are packed (`PagedKVCache.compact`), copying the tokens behind
    the hole (`EvictionStats.tokens_moved`; uncompacted, `EvictionStats.max_holes_per_page`).
    ``method="inverse_key_norm"`` is the paper's baseline. The arguments are `PagedEviction`'s.
    """

    name = "token_topk"
    evicts = "token"

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
        self.reserved = Reserved.from_flags(protect_first_page, protect_last_page)
        super().__init__(budget, method=method, seed=seed, decision=decision)

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


def make_policy(name: str, budget: int | None = None, **options) -> EvictionPolicy:
    """A policy by name (one of ``POLICY_NAMES``) with ``budget`` C in tokens (None for ``"full"``)
    and the keyword ``options`` of its class. A score name (``"value_norm"``, ...) is PagedEviction
    with that score; ``"paged_eviction_literal"`` is PagedEviction with ``protect_first_page=False``.

    Example:
        >>> make_policy("value_norm", 256)
        PagedEviction(budget=256, method='value_norm', reduce='mean', protect_first_page=True, protect_last_page=True)
    """
    check_choice("name", name, POLICY_NAMES)
    by_name = {"full": FullCache, "streaming_llm": StreamingLLM, "token_topk": TokenTopK}
    if name in by_name:
        return by_name[name](budget, **options)
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
