"""Eviction under chunked prefill: a request's policy first acts once its whole prompt is held, and
the pages its action may copy are counted before the step takes any.

`paged_ref.hf.PagedSession` calls a sequence's eviction hooks after every forward that feeds it
(``after_prefill`` after the first, ``after_append`` after the others), so a prompt fed in chunks
would be evicted after its first chunk, which `paged_ref.hf.generate` never does. `AfterPrompt`
holds the request's policy back until the sequence holds the whole prompt (the scheduler ends an
evicting request's chunks there): ``after_prefill`` then runs on all of it, later forwards go to
``after_append``. One policy object may serve many requests; each gets its own `AfterPrompt`.

`Evictions` is the scheduler's side: a row of an evicting request ends where its policy acts next
(`Evictions.limit`), and when it acts it may pack the kept tokens into the first pages, copying
those another sequence shares (a prefix hit): `Evictions.copies` counts them for the row's
planning, `Evictions.admission` for a request admitted beside it. A hook that raises adds its
request to ``Evictions.raised`` before the error goes on: the engine's undo reads it there
(`paged_ref.serve.undo`), and putting the step back empties it.

Example:
    >>> import torch
    >>> from paged_ref.cache import PagedKVCache
    >>> from paged_ref.eviction import make_policy
    >>> kv = PagedKVCache(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=4)
    >>> s = kv.add_sequence(); policy = AfterPrompt(make_policy("streaming_llm", 8), prompt_len=20)
    >>> for chunk in (12, 8):                     # the prompt in two chunks
    ...     slots = kv.reserve(s, chunk); kv.write(0, slots, torch.randn(chunk, 1, 4), torch.randn(chunk, 1, 4))
    ...     policy.after_append(kv, s) if chunk == 8 else policy.after_prefill(kv, s)
    ...     print(kv.seq_len(s))
    12
    8
"""

from __future__ import annotations

from ..block_table import pages_needed
from ..eviction.base import NO_LIMIT, EvictionPolicy, max_pages_held

__all__ = ["AfterPrompt", "Evictions"]


class AfterPrompt(EvictionPolicy):
    """``inner`` (the request's policy) held back until the sequence holds ``prompt_len`` tokens;
    ``request_id``, ``owner``: the request, and the `Evictions` whose ``raised`` names it if a hook raises."""

    def __init__(self, inner: EvictionPolicy, prompt_len: int, request_id: int | None = None, owner=None):
        self.inner = inner
        self.prompt_len = prompt_len
        self.budget = inner.budget
        self.name = inner.name
        self._check_cache = inner._check_cache  # the cache and page size it needs are its inner policy's
        self.request_id, self.owner = request_id, owner
        self._started: set[int] = set()  # sequences whose prompt `inner` has seen

    def after_append(self, kv_cache, seq_id: int) -> None:
        """Either hook: ``inner.after_prefill`` once the whole prompt is in, ``inner.after_append`` after."""
        try:
            if seq_id in self._started:
                self.inner.after_append(kv_cache, seq_id)
            elif kv_cache.seq_len(seq_id) >= self.prompt_len:  # the whole prompt is in: evict it as generate would
                self._started.add(seq_id)
                self.inner.after_prefill(kv_cache, seq_id)
        except BaseException:
            if self.owner is not None:
                self.owner.raised.append(self.request_id)
            raise

    after_prefill = after_append

    def snapshot(self):
        return set(self._started), self.inner.snapshot()

    def restore(self, snapshot) -> None:
        started, inner = snapshot
        self._started = set(started)
        self.inner.restore(inner)

    def tokens_until_action(self, kv_cache, seq_id: int) -> int:
        return self.inner.tokens_until_action(kv_cache, seq_id) if seq_id in self._started else NO_LIMIT

    def release(self, seq_id: int) -> None:
        self._started.discard(seq_id)
        self.inner.release(seq_id)

    def positions(self, seq_id: int):
        return self.inner.positions(seq_id)

    def stats(self, seq_id: int):
        return self.inner.stats(seq_id)

    def __repr__(self) -> str:
        return f"AfterPrompt({self.inner!r}, prompt_len={self.prompt_len})"


class Evictions:
    """A scheduler's evicting requests over ``kv``: each one's `AfterPrompt` (``hooks``, by request id) and
    what its policy's next action may copy (see the module docstring)."""

    def __init__(self, kv):
        self.kv = kv
        self.hooks: dict[int, AfterPrompt] = {}  # request_id -> its policy, as the session runs it
        self.compacting: set[int] = set()  # pages a policy packs kept tokens into after this step's forward
        self.raised: list[int] = []  # requests whose hook raised in the step being run

    def start(self, r) -> AfterPrompt | None:
        """The hooks ``r``'s sequence runs (None without a policy); `track` them once it holds a sequence."""
        return None if r.eviction is None else AfterPrompt(r.eviction, len(r.prompt_ids), r.request_id, self)

    def track(self, r, hooks: AfterPrompt | None) -> None:
        if hooks is not None:
            self.hooks[r.request_id] = hooks

    def release(self, r) -> None:
        """``r`` gave its sequence back: its policy forgot it."""
        self.hooks.pop(r.request_id, None)

    def peak_pages(self, r) -> int:
        """The most pages ``r`` can hold at once: its whole K/V, or its eviction policy's bound
        (the prompt is held whole until the policy first acts)."""
        ps = self.kv.page_size
        whole = pages_needed(r.peak_tokens, ps)
        budget = None if r.eviction is None else r.eviction.budget
        if budget is None:
            return whole
        return min(whole, max(pages_needed(len(r.prompt_ids), ps), max_pages_held(budget, ps)))

    def limit(self, r) -> int:
        """Most tokens ``r`` may feed in one forward: all it has left, except that an evicting request's
        chunks end at its prompt's last token and then at its policy's next action."""
        if r.eviction is None:
            return r.remaining
        prompt = len(r.prompt_ids)
        if r.num_computed < prompt:
            return prompt - r.num_computed
        return min(r.remaining, self.hooks[r.request_id].tokens_until_action(self.kv, r.seq_id))

    def acts(self, r, n: int) -> bool:
        """Whether ``r``'s policy acts after its row of ``n`` tokens."""
        return r.eviction is not None and n == self.limit(r)

    def kept_pages(self, r) -> int:
        """The pages an eviction packs ``r``'s kept tokens into (none without a budget: nothing is evicted)."""
        return 0 if r.eviction.budget is None else pages_needed(r.eviction.budget, self.kv.page_size)

    def copies(self, r, n: int) -> int:
        """Pages ``r``'s policy may copy if it acts after ``n`` more tokens: the kept pages another shares."""
        if r.eviction is None or n < self.limit(r):
            return 0
        return sum(self.kv.allocator.refcount(p) > 1 for p in self.kv.pages(r.seq_id)[: self.kept_pages(r)])

    def planned(self, r, acts: bool) -> None:
        """``r``'s row is planned: a sequence admitted later that shares the pages it packs into adds copies."""
        if acts:
            self.compacting.update(self.kv.pages(r.seq_id)[: self.kept_pages(r)])

    def admission(self, r, reused: list[int], acts: bool) -> tuple[int, int]:
        """Pages admitting ``r`` onto the cached pages ``reused`` adds to its own: ``(copies, shares)``, the
        kept pages its policy copies if it ``acts`` after the first chunk, the pages of ``reused`` that
        another row's policy packs into (it then copies them)."""
        evicts = acts and r.eviction is not None
        copies = sum(self.kv.allocator.refcount(p) > 0 for p in reused[: self.kept_pages(r)]) if evicts else 0
        return copies, sum(p in self.compacting for p in reused)

    def raised_by(self, requests) -> list:
        """Those of ``requests`` whose hook raised in the step being run."""
        return [r for r in requests if r.request_id in self.raised]
