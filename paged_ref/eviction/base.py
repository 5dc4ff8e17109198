"""The eviction policy base class: the hooks a generation loop calls, and what every policy shares.

Per sequence: ``after_prefill(cache, seq_id)`` once the prompt's K/V are written,
``after_append(cache, seq_id)`` after each decode step's (at most `tokens_until_action` tokens
apart), ``release(seq_id)`` when it is freed. Cached K carries its RoPE rotation, so evicting
never moves the others' positions. ``decision="shared"``: one block table for all layers (a
`PagedKVCache`, as in vLLM), pages ranked by layer-averaged scores (`sequence_scores`);
``"per_layer"`` (the authors' code): each layer ranks by its own, on a `LayeredKVCache`. A policy
keeps one row of positions per decision, a "lane".
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import torch

from .._arith import cdiv
from .._validate import check_bool, check_choice, check_int, is_int
from ..block_table import pages_needed
from ..cache_interface import KVCache
from .scores import SCORE_METHODS, token_scores

__all__ = ["DECISIONS", "NO_LIMIT", "EvictionPolicy", "EvictionStats", "Reserved", "max_pages_held"]
__all__ += ["check_policy", "sequence_scores"]

DECISIONS = ("shared", "per_layer")  # one eviction decision for all layers, or one per layer
NO_LIMIT = sys.maxsize  # tokens_until_action of a policy that never acts


def max_pages_held(budget: int, page_size: int) -> int:
    """The bound every policy keeps: ``ceil(budget / page_size) + 1`` pages per sequence."""
    return cdiv(check_int("budget", budget, min_value=1), check_int("page_size", page_size, min_value=1)) + 1


def sequence_scores(cache: KVCache, seq_id: int, method: str, *, generator: torch.Generator | None = None):
    """float32 ``[seq_len]``: one score per held token of ``seq_id`` in logical order, `token_scores`
    averaged over layers (raw scores: a layer whose scores run larger weighs more).
    ``method="random"`` draws once (not per layer) from ``generator``.
    """
    check_choice("method", method, SCORE_METHODS)
    n = cache.seq_len(seq_id)
    if method == "random":
        return torch.rand(n, generator=generator)  # [seq_len]
    total = torch.zeros(n, dtype=torch.float32, device=cache.device)  # [seq_len]
    for layer in range(cache.num_layers):
        k, v = cache.gather(layer, seq_id)  # each [seq_len, num_kv_heads, head_dim]
        total += token_scores(k, v, method)
    return (total / cache.num_layers).cpu()


@dataclass(frozen=True)
class Reserved:
    """Pages a policy never evicts: the first ``first_pages`` pages and, if ``last_page``, the newest.

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

    @classmethod
    def from_flags(cls, protect_first_page, protect_last_page) -> Reserved:
        """The pages a policy's ``protect_first_page`` / ``protect_last_page`` arguments reserve."""
        check_bool("protect_first_page", protect_first_page)
        return cls(int(protect_first_page), check_bool("protect_last_page", protect_last_page))

    def flags(self) -> dict[str, bool]:
        """The ``protect_first_page`` / ``protect_last_page`` arguments these reserved pages come from."""
        return {"protect_first_page": bool(self.first_pages), "protect_last_page": self.last_page}

    def min_budget(self, page_size: int, *, unit: str = "page") -> int:
        """The smallest budget of a policy evicting a ``unit`` at a time: the reserved first pages and
        one page to evict (``"page"``), or the reserved pages (``"token"``)."""
        if unit == "token":
            return (self.first_pages + int(self.last_page)) * page_size
        return (self.first_pages + 1) * page_size


@dataclass
class EvictionStats:
    """What a policy did to one sequence (all counts cumulative)."""

    tokens_seen: int = 0  # tokens ever appended (prompt + decode)
    tokens_evicted: int = 0  # removed by compaction or with their page
    pages_dropped: int = 0  # whole pages removed by decode-time page eviction
    compactions: int = 0  # calls to `PagedKVCache.compact`
    # tokens those compactions copied (the mean over layers with per-layer decisions)
    tokens_moved: int = 0
    # the most pages held from `after_prefill` on, with the tokens appended before each eviction
    max_pages_held: int = 0
    # token_topk: the most evicted slots per held page had the cache never been compacted
    max_holes_per_page: float = 0.0


class EvictionPolicy:
    """Base class: tracks each sequence's token positions and stats; subclasses evict. ``budget``:
    the tokens a sequence may hold; ``method``: a `SCORE_METHODS` name (``seed`` for ``"random"``)."""

    name = "base"
    needs_budget = True  # False for a policy that never evicts

    def __init__(self, budget: int | None, *, method: str = "value_key_ratio", seed: int = 0, decision: str = "shared"):
        if budget is None and self.needs_budget:
            raise ValueError(f"{self.name} needs budget=<tokens>, got None")
        self.budget = None if budget is None else check_int("budget", budget, min_value=1)
        self.method = check_choice("method", method, SCORE_METHODS)
        self.seed = check_int("seed", seed, min_value=0)
        self.decision = check_choice("decision", decision, DECISIONS)
        self._generator = torch.Generator().manual_seed(self.seed)
        # seq -> int64 [lanes, seq_len]: original index of each held token, one row per decision (a lane)
        self._positions: dict[int, torch.Tensor] = {}
        self._stats: dict[int, EvictionStats] = {}

    # ------------------------------------------------------------------ hooks
    def after_prefill(self, kv_cache: KVCache, seq_id: int) -> None:
        """Call once the prompt's K/V are written: evicts down to the budget (token level)."""
        self._check_cache(kv_cache)
        self._sync(kv_cache, seq_id)
        if self.budget is not None and kv_cache.seq_len(seq_id) > self.budget:
            self._prefill_evict(kv_cache, seq_id)
        self._record(kv_cache, seq_id)

    def after_append(self, kv_cache: KVCache, seq_id: int) -> None:
        """Call after each decode step's K/V are written (or a chunk of `tokens_until_action`); on a
        sequence not seen yet (e.g. a one-token prompt) it runs `after_prefill`."""
        self._check_cache(kv_cache)
        if seq_id not in self._positions:
            self.after_prefill(kv_cache, seq_id)
            return
        before = self._held(seq_id)
        limit = before + self._room(kv_cache.page_size, before)
        if kv_cache.seq_len(seq_id) > limit:
            raise ValueError(
                f"sequence {seq_id} grew from {before} to {kv_cache.seq_len(seq_id)} tokens since the last hook call, "
                f"past {limit} where {self.name} must act; append at most tokens_until_action() tokens between calls"
            )
        self._sync(kv_cache, seq_id)
        self._record(kv_cache, seq_id)  # the peak: the appended tokens held, before this eviction
        self._decode_evict(kv_cache, seq_id)

    def release(self, seq_id: int) -> None:
        """Forget a sequence (call when it is freed from the cache)."""
        if not is_int(seq_id):  # True and 1.0 would name sequence 1
            raise TypeError(f"seq_id must be an int, got {seq_id!r}")
        self._positions.pop(seq_id, None)
        self._stats.pop(seq_id, None)

    def snapshot(self):
        """Everything the hooks may change (every sequence's record, the random generator), for `restore`."""
        stats = {seq_id: replace(s) for seq_id, s in self._stats.items()}
        return dict(self._positions), stats, self._generator.get_state()

    def restore(self, snapshot) -> None:
        """Put the policy back as `snapshot` saw it (a serving step undone)."""
        positions, stats, generator = snapshot
        self._positions, self._stats = dict(positions), {seq_id: replace(s) for seq_id, s in stats.items()}
        self._generator.set_state(generator)

    def tokens_until_action(self, kv_cache: KVCache, seq_id: int) -> int:
        """How many tokens may be appended to ``seq_id`` before `after_append` must be called."""
        return self._room(kv_cache.page_size, kv_cache.seq_len(seq_id))

    def _room(self, page_size: int, held: int) -> int:
        """`tokens_until_action` for a sequence holding ``held`` tokens (what subclasses define)."""
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
        fields = self._repr_fields()
        if self.decision != "shared":
            fields["decision"] = self.decision
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    def _repr_fields(self) -> dict:
        """The constructor arguments `__repr__` shows (a subclass adds or replaces its own)."""
        return {"budget": self.budget, "method": self.method}

    # ------------------------------------------------------------------ subclass interface
    evicts = "page"  # what one decode eviction removes, "page" or "token": sets the smallest budget

    def _reserved(self, page_size: int) -> Reserved:
        """The pages this policy never evicts (its ``reserved`` pages, unless they depend on the page size)."""
        return self.reserved

    def _prefill_evict(self, cache, seq_id) -> None:
        raise NotImplementedError

    def _decode_evict(self, cache, seq_id) -> None:
        pass

    # ------------------------------------------------------------------ shared machinery
    def _check_cache(self, cache) -> None:
        per_layer = self.decision == "per_layer"
        if getattr(cache, "tables_per_layer", None) is not per_layer:  # not a KVCache, or the other kind
            want = "LayeredKVCache" if per_layer else "PagedKVCache"
            raise TypeError(
                f"decision={self.decision!r} needs a paged_ref.{want} "
                f"(per-layer decisions need a block table per layer), got {type(cache).__name__}"
            )
        if self.budget is None:
            return
        reserved = self._reserved(cache.page_size)
        need = reserved.min_budget(cache.page_size, unit=self.evicts)
        if self.budget < need:
            raise ValueError(
                f"budget must be >= {need} tokens with page_size={cache.page_size} and {reserved.first_pages} "
                f"reserved first page(s), so that a {self.evicts} can always be evicted; got budget={self.budget}"
            )

    def _positions_of(self, seq_id) -> torch.Tensor:
        if not is_int(seq_id) or seq_id not in self._positions:
            raise ValueError(f"seq_id {seq_id!r} has not been seen by this policy (call after_prefill first)")
        return self._positions[seq_id]

    def _held(self, seq_id) -> int:
        return int(self._positions_of(seq_id).shape[1])

    def _sync(self, cache, seq_id) -> None:
        """Extend the position record by the tokens appended since the last hook call."""
        n = cache.seq_len(seq_id)  # raises for an unknown sequence
        lanes = 1 if self.decision == "shared" else cache.num_layers
        pos = self._positions.get(seq_id, torch.empty(lanes, 0, dtype=torch.int64))  # [lanes, held]
        stats = self._stats.setdefault(seq_id, EvictionStats())
        if n < pos.shape[1]:
            raise ValueError(
                f"sequence {seq_id} holds {n} tokens, fewer than the {pos.shape[1]} this policy left; "
                "it was changed outside the policy"
            )
        new = torch.arange(stats.tokens_seen, stats.tokens_seen + n - pos.shape[1])  # [new]
        stats.tokens_seen += new.numel()
        self._positions[seq_id] = torch.cat([pos, new.expand(pos.shape[0], -1)], dim=1)  # [lanes, n]

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
        """Token-level eviction: keep ``keep: bool [lanes, seq_len]`` in order, count the copies
        (in tokens of one lane: the mean over lanes with per-layer decisions)."""
        stats = self._stats[seq_id]
        if bool(keep.all()):
            return
        cache.compact(seq_id, keep[0] if self.decision == "shared" else keep)  # first: it may raise
        # the kept tokens behind a lane's first hole shift: all it keeps but its leading run of kept tokens
        moved = int((keep.sum(1) - keep.int().cumprod(1).sum(1)).sum())
        stats.tokens_moved += moved if keep.shape[0] == 1 else moved / keep.shape[0]
        stats.tokens_evicted += int((~keep[0]).sum())
        stats.compactions += 1
        self._positions[seq_id] = torch.stack([p[k] for p, k in zip(self._positions[seq_id], keep)])

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

    def _record_holes(self, page_size: int, seq_id: int) -> None:
        """Holes per page had no token ever moved: a page is held while any of its tokens
        survives, its holes are its written slots whose token is gone."""
        stats = self._stats[seq_id]
        for pos in self._positions[seq_id]:  # int64 [seq_len] per lane, original index of each survivor
            held = torch.unique(pos // page_size)  # pages an uncompacted layout would hold
            written = held.numel() * page_size
            newest = (stats.tokens_seen - 1) // page_size
            if int(held[-1]) == newest:  # the newest page is written only up to tokens_seen
                written -= (newest + 1) * page_size - stats.tokens_seen
            stats.max_holes_per_page = max(stats.max_holes_per_page, (written - pos.numel()) / held.numel())

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


def check_policy(eviction, default, kv=None):
    """A sequence's eviction policy: ``eviction``, an `EvictionPolicy`, or ``default`` for None; checked on ``kv``."""
    if eviction is None:
        eviction = default
    elif not isinstance(eviction, EvictionPolicy):
        raise TypeError(f"eviction must be an EvictionPolicy (from make_policy) or None, got {type(eviction).__name__}")
    if eviction is not None and kv is not None:  # its budget for the page size, its decisions for the tables
        eviction._check_cache(kv)
    return eviction
