"""Eviction policies that keep a paged cache sequence within a token budget.

Notation (kept apart on purpose; the paper writes B and C): ``page_size`` = B, tokens per page;
``budget`` = C, tokens a sequence may hold after an eviction step.

Shared or per-layer decisions (``decision=``). On a `PagedKVCache` a physical page id indexes
the same page in every layer and a sequence has ONE block table for all layers (as in vLLM), so
evicting page ``j`` removes it from every layer at once: ``decision="shared"`` (the default).
Each layer still contributes its own evidence: token scores are computed per layer from that
layer's cached K/V and averaged over layers (`sequence_scores`). Raw scores are averaged, so a
layer whose ||V||/||K|| runs larger weighs more; averaging ranks instead would weigh layers
equally. ``decision="per_layer"`` (what the authors' code does) lets every layer keep its own
tokens: each layer ranks by its own scores and drops its own page, which needs a block table per
layer, i.e. a `paged_ref.layered_cache.LayeredKVCache` (every layer holds as many tokens, so the
page bound is the same per layer). Internally a policy keeps one row of positions per decision
("lane"): one row when shared, one per layer otherwise.

Two consequences of the decode rule worth knowing: (1) at the moment a decode eviction happens
every held page is full (the newest just filled), so ``reduce="mean"`` and ``"sum"`` choose
the same page; they differ only on partial pages. (2) The prompt is held whole between its
prefill and `after_prefill`, so the page bound applies from `after_prefill` on.

The hooks a generation loop calls (`paged_ref.hf` does):

    policy.after_prefill(cache, seq_id)   # once, after the prompt's K/V are written
    policy.after_append(cache, seq_id)    # after every decode step's K/V are written
    policy.release(seq_id)                # when the sequence is freed

The caller tracks RoPE positions (a cached K already carries its rotation, so evicting tokens
never changes the positions of the tokens that stay or of the tokens to come).
`tokens_until_action` says how many tokens may be appended before the next hook call, so a
teacher-forced evaluation can feed a chunk at once and get exactly the token-by-token result.

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

import math
import sys
from dataclasses import dataclass

import torch

from .._arith import cdiv
from .._validate import check_choice, check_int
from ..block_table import pages_needed
from ..cache import PagedKVCache
from ..layered_cache import LayeredKVCache
from .scores import SCORE_METHODS, page_scores, token_scores

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
DECISIONS = ("shared", "per_layer")  # one eviction decision for all layers, or one per layer
NO_LIMIT = sys.maxsize  # tokens_until_action of a policy that never acts


def max_pages_held(budget: int, page_size: int) -> int:
    """The bound every policy keeps: ``ceil(budget / page_size) + 1`` pages per sequence."""
    return cdiv(check_int("budget", budget, min_value=1), check_int("page_size", page_size, min_value=1)) + 1


def sequence_scores(
    cache: PagedKVCache, seq_id: int, method: str, *, generator: torch.Generator | None = None, layers=None
) -> torch.Tensor:
    """One score per held token of ``seq_id``: `token_scores` of each layer, averaged over layers.

    Args:
        cache, seq_id: the sequence to score.
        method: a `SCORE_METHODS` name; ``"random"`` draws once (not per layer) from ``generator``.
        layers: layer indices to average over (default: all).

    Returns:
        float32 ``[seq_len]`` in the sequence's logical order.
    """
    check_choice("method", method, SCORE_METHODS)
    n = cache.seq_len(seq_id)
    if method == "random":
        return torch.rand(n, generator=generator)  # [seq_len]
    if layers is None:
        layers = range(cache.num_layers)
    else:
        if isinstance(layers, (int, str)) or not hasattr(layers, "__iter__"):
            raise TypeError(f"layers must be None or a list of layer indices, got {layers!r}")
        layers = [check_int("layers[i]", i, min_value=0) for i in layers]
        if not layers or max(layers) >= cache.num_layers:
            raise ValueError(f"layers must list at least one layer index in [0, {cache.num_layers}), got {layers}")
    total = torch.zeros(n, dtype=torch.float32, device=cache.device)  # [seq_len]
    for layer in layers:
        k, v = cache.gather(layer, seq_id)  # each [seq_len, num_kv_heads, head_dim]
        total += token_scores(k, v, method)
    return (total / len(layers)).cpu()


@dataclass(frozen=True)
class Reserved:
    """Pages a policy never evicts: the first ``first_pages`` pages and, if ``last_page``, the newest.

    PagedEviction's authors keep the first and the last block at prefill and never evict page 0
    or the newest page during decode; StreamingLLM reserves the pages that hold its sink tokens.
    One helper serves every policy, so "protected" means the same thing in all of them.

    Example:
        >>> r = Reserved(first_pages=1, last_page=True)
        >>> r.tokens(10, page_size=4).int().tolist(), r.candidate_pages(5), r.min_budget(4)
        ([1, 1, 1, 1, 0, 0, 1, 1, 1, 1], [1, 2, 3], 8)
    """

    first_pages: int
    last_page: bool

    def tokens(self, n: int, page_size: int) -> torch.Tensor:
        """bool ``[n]``: the tokens of a ``n``-token sequence that must stay (prefill eviction)."""
        protected = torch.zeros(n, dtype=torch.bool)  # [n]
        protected[: self.first_pages * page_size] = True
        if self.last_page:
            protected[max(0, n - page_size) :] = True
        return protected

    def candidate_pages(self, num_pages: int) -> list[int]:
        """Logical pages a decode eviction may drop from a sequence of ``num_pages`` full pages."""
        return list(range(self.first_pages, num_pages - int(self.last_page)))

    def min_budget(self, page_size: int) -> int:
        """The smallest budget that leaves one page to evict besides the reserved ones."""
        return (self.first_pages + 1) * page_size


@dataclass
class EvictionStats:
    """What a policy did to one sequence (all counts cumulative).

    Attributes:
        tokens_seen: tokens ever appended to the sequence (prompt + decode).
        tokens_evicted: tokens removed (by compaction or with their page).
        pages_dropped: whole pages removed by decode-time page eviction.
        compactions: calls to ``PagedKVCache.compact`` (prefill eviction, token eviction).
        tokens_moved: tokens copied to a new slot by those compactions (each copy is one
            token's K and V in every layer; per-layer decisions move each layer's tokens apart
            and count the mean over layers); tokens already in place are not counted.
        max_pages_held: the most pages the sequence held from `after_prefill` on, counting the
            tokens appended before each `after_append` evicts (the prompt, held whole until
            `after_prefill`, is not counted).
        max_holes_per_page: token_topk only: the most evicted slots per held page the same
            evictions would leave if the cache were never compacted (tokens stay where they
            were written; a page is held while any of its tokens survives).
    """

    tokens_seen: int = 0
    tokens_evicted: int = 0
    pages_dropped: int = 0
    compactions: int = 0
    tokens_moved: int = 0
    max_pages_held: int = 0
    max_holes_per_page: float = 0.0


class EvictionPolicy:
    """Base class: tracks each sequence's token positions and stats; subclasses evict.

    Args:
        budget: C, the tokens a sequence may hold (None only for `FullCache`).
        method: score method (see `paged_ref.eviction.scores`).
        seed: seed of the generator used by ``method="random"``.
        decision: ``"shared"`` (one decision for all layers, on a `PagedKVCache`) or
            ``"per_layer"`` (on a `LayeredKVCache`); subclasses that support it take it.
    """

    name = "base"

    def __init__(self, budget: int | None, *, method: str = "value_key_ratio", seed: int = 0, decision: str = "shared"):
        self.budget = None if budget is None else check_int("budget", budget, min_value=1)
        self.method = check_choice("method", method, SCORE_METHODS)
        self.seed = check_int("seed", seed, min_value=0)
        self.decision = check_choice("decision", decision, DECISIONS)
        self._generator = torch.Generator().manual_seed(self.seed)
        # seq -> int64 [lanes, seq_len]: original index of each held token, one row per decision
        # (one row when shared; one per layer with decision="per_layer")
        self._positions: dict[int, torch.Tensor] = {}
        self._stats: dict[int, EvictionStats] = {}

    # ------------------------------------------------------------------ hooks
    def after_prefill(self, cache: PagedKVCache, seq_id: int) -> None:
        """Call once the prompt's K/V are written: evicts down to the budget (token level)."""
        self._check_cache(cache)
        self._sync(cache, seq_id)
        if self.budget is not None and cache.seq_len(seq_id) > self.budget:
            self._prefill_evict(cache, seq_id)
        self._record(cache, seq_id)

    def after_append(self, cache: PagedKVCache, seq_id: int) -> None:
        """Call after each decode step's K/V are written (or a chunk of `tokens_until_action`).

        The first hook call for a sequence is always a prefill: on a sequence this policy has
        not seen yet (e.g. a one-token prompt), this runs `after_prefill`.
        """
        self._check_cache(cache)
        if seq_id not in self._positions:
            self.after_prefill(cache, seq_id)
            return
        before = self._held(seq_id)
        limit = before + self.tokens_until_action(cache, seq_id, _length=before)
        if cache.seq_len(seq_id) > limit:
            raise ValueError(
                f"sequence {seq_id} grew from {before} to {cache.seq_len(seq_id)} tokens since the last hook call, "
                f"past {limit} where {self.name} must act; append at most tokens_until_action() tokens between calls"
            )
        self._sync(cache, seq_id)
        self._record(cache, seq_id)  # the peak: the appended tokens held, before this eviction
        self._decode_evict(cache, seq_id)

    def release(self, seq_id: int) -> None:
        """Forget a sequence (call when it is freed from the cache)."""
        self._positions.pop(seq_id, None)
        self._stats.pop(seq_id, None)

    def tokens_until_action(self, cache: PagedKVCache, seq_id: int, *, _length: int | None = None) -> int:
        """How many tokens may be appended to ``seq_id`` before `after_append` must be called."""
        return NO_LIMIT

    # ------------------------------------------------------------------ inspection
    def positions(self, seq_id: int) -> torch.Tensor:
        """int64 ``[seq_len]``: index (0 = first prompt token) of each token the sequence holds;
        ``[num_layers, seq_len]`` (each layer's own) with ``decision="per_layer"``."""
        pos = self._positions_of(seq_id)
        return (pos[0] if self.decision == "shared" else pos).clone()

    def stats(self, seq_id: int) -> EvictionStats:
        self._positions_of(seq_id)
        return self._stats[seq_id]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(budget={self.budget}, method={self.method!r})"

    # ------------------------------------------------------------------ subclass interface
    def _prefill_evict(self, cache, seq_id) -> None:
        raise NotImplementedError

    def _decode_evict(self, cache, seq_id) -> None:
        pass

    # ------------------------------------------------------------------ shared machinery
    def _check_cache(self, cache) -> None:
        want = PagedKVCache if self.decision == "shared" else LayeredKVCache
        if not isinstance(cache, want):
            raise TypeError(
                f"decision={self.decision!r} needs a paged_ref.{want.__name__} "
                f"(per-layer decisions need a block table per layer), got {type(cache).__name__}"
            )

    def _positions_of(self, seq_id) -> torch.Tensor:
        if seq_id not in self._positions:
            raise ValueError(f"seq_id {seq_id!r} has not been seen by this policy (call after_prefill first)")
        return self._positions[seq_id]

    def _held(self, seq_id) -> int:
        return int(self._positions_of(seq_id).shape[1])

    def _sync(self, cache, seq_id) -> None:
        """Extend the position record by the tokens appended since the last hook call."""
        n = cache.seq_len(seq_id)  # raises for an unknown sequence
        pos = self._positions.get(seq_id)
        if pos is None:
            lanes = 1 if self.decision == "shared" else cache.num_layers
            pos, stats = torch.empty(lanes, 0, dtype=torch.int64), EvictionStats()
        else:
            stats = self._stats[seq_id]
        if n < pos.shape[1]:
            raise ValueError(
                f"sequence {seq_id} holds {n} tokens, fewer than the {pos.shape[1]} this policy left; "
                "it was changed outside the policy"
            )
        new = torch.arange(stats.tokens_seen, stats.tokens_seen + n - pos.shape[1])  # [new]
        stats.tokens_seen += new.numel()
        self._positions[seq_id] = torch.cat([pos, new.expand(pos.shape[0], -1)], dim=1)  # [lanes, n]
        self._stats[seq_id] = stats

    def _record(self, cache, seq_id) -> None:
        stats = self._stats[seq_id]
        stats.max_pages_held = max(stats.max_pages_held, pages_needed(cache.seq_len(seq_id), cache.page_size))

    def _scores(self, cache, seq_id) -> torch.Tensor:
        """float32 ``[lanes, seq_len]``: the layer mean (shared) or each layer's own scores."""
        if self.decision == "shared":
            return sequence_scores(cache, seq_id, self.method, generator=self._generator)[None]
        if self.method == "random":
            return torch.rand(cache.num_layers, cache.seq_len(seq_id), generator=self._generator)
        per_layer = [token_scores(*cache.gather(layer, seq_id), self.method) for layer in range(cache.num_layers)]
        return torch.stack(per_layer).cpu()

    def _compact(self, cache, seq_id, keep: torch.Tensor) -> None:
        """Token-level eviction: keep ``keep: bool [lanes, seq_len]`` in order, count the copies.

        Counts are in tokens of one lane; a per-layer decision moves each layer's tokens apart,
        so its ``tokens_moved`` is the mean over layers (one token moved in every layer = 1).
        """
        stats = self._stats[seq_id]
        if bool(keep.all()):
            return
        cache.compact(seq_id, keep[0] if self.decision == "shared" else keep)  # first: it may raise
        moved = 0
        for row in keep:
            holes = (~row).nonzero()
            if holes.numel():
                moved += int(row[int(holes[0]) :].sum())  # kept tokens behind the first hole shift
        stats.tokens_moved += moved if keep.shape[0] == 1 else moved / keep.shape[0]
        stats.tokens_evicted += int((~keep[0]).sum())
        stats.compactions += 1
        pos = self._positions[seq_id]
        self._positions[seq_id] = torch.stack([p[k] for p, k in zip(pos, keep)])

    def _drop_page(self, cache, seq_id, pages: list[int]) -> None:
        """Page-level eviction of logical page ``pages[i]`` from lane ``i`` (the page goes back to the pool)."""
        ps = cache.page_size
        n = cache.seq_len(seq_id)
        stats = self._stats[seq_id]
        cache.drop_pages(seq_id, pages if self.decision == "per_layer" else pages[:1])
        pos = self._positions[seq_id]
        self._positions[seq_id] = torch.stack(
            [torch.cat([p[: page * ps], p[min(n, (page + 1) * ps) :]]) for p, page in zip(pos, pages)]
        )
        stats.tokens_evicted += min(n, (pages[0] + 1) * ps) - pages[0] * ps
        stats.pages_dropped += 1

    def _keep_top(self, cache, seq_id, reserved: Reserved) -> None:
        """Token-level eviction to the budget: the reserved tokens plus the best-scoring others."""
        n = cache.seq_len(seq_id)
        scores = self._scores(cache, seq_id)  # [lanes, n]
        protected = reserved.tokens(n, cache.page_size)  # bool [n]
        free_slots = self.budget - int(protected.sum())
        assert free_slots >= 0, "budget checks guarantee room for the protected tokens"
        ranked = scores.masked_fill(protected, -math.inf)
        # stable sort: among equal scores the older token goes first
        order = torch.sort(ranked, dim=1, descending=True, stable=True).indices  # [lanes, n]
        keep = protected.expand_as(scores).clone()  # bool [lanes, n]
        keep.scatter_(1, order[:, :free_slots], True)
        assert bool((keep.sum(1) == min(self.budget, n)).all())
        self._compact(cache, seq_id, keep)


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

    def tokens_until_action(self, cache, seq_id, *, _length=None) -> int:
        n = cache.seq_len(seq_id) if _length is None else _length
        return cache.page_size - n % cache.page_size

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

    def __repr__(self) -> str:
        return (
            f"PagedEviction(budget={self.budget}, method={self.method!r}, reduce={self.reduce!r}, "
            f"protect_first_page={bool(self.reserved.first_pages)}, protect_last_page={self.reserved.last_page}"
            + (", decision='per_layer')" if self.decision == "per_layer" else ")")
        )


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

    def __repr__(self) -> str:
        return f"StreamingLLM(budget={self.budget}, sink_tokens={self.sink_tokens})"


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
        need = (self.reserved.first_pages + int(self.reserved.last_page)) * cache.page_size
        if self.budget < need:
            raise ValueError(
                f"budget must be >= {need} with page_size={cache.page_size} and the protected pages, "
                f"got budget={self.budget}"
            )

    def tokens_until_action(self, cache, seq_id, *, _length=None) -> int:
        n = cache.seq_len(seq_id) if _length is None else _length
        return max(1, self.budget + 1 - n)

    def _prefill_evict(self, cache, seq_id) -> None:
        self._keep_top(cache, seq_id, self.reserved)
        self._record_holes(cache.page_size, seq_id)

    def _decode_evict(self, cache, seq_id) -> None:
        if cache.seq_len(seq_id) > self.budget:
            self._prefill_evict(cache, seq_id)  # the same top-C rule, now over one token too many

    def __repr__(self) -> str:
        return (
            f"TokenTopK(budget={self.budget}, method={self.method!r}, "
            f"protect_first_page={bool(self.reserved.first_pages)}, protect_last_page={self.reserved.last_page}"
            + (", decision='per_layer')" if self.decision == "per_layer" else ")")
        )

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
