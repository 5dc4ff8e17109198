"""Eviction under chunked prefill: a request's policy first acts once its whole prompt is held.

`paged_ref.hf.PagedSession` calls a sequence's eviction hooks after every forward that feeds it
(``after_prefill`` after the first, ``after_append`` after the others), so a prompt fed in chunks
would be evicted after its first chunk, which `paged_ref.hf.generate` never does. `AfterPrompt`
holds the request's policy back until the sequence holds the whole prompt (the scheduler ends an
evicting request's chunks there): ``after_prefill`` then runs on all of it, later forwards go to
``after_append``. One policy object may serve many requests; each gets its own `AfterPrompt`, whose
``failed`` tells the engine whose hook raised in the step.

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

from ..eviction.base import NO_LIMIT, EvictionPolicy

__all__ = ["AfterPrompt"]


class AfterPrompt(EvictionPolicy):
    """``inner`` (the request's policy) held back until the sequence holds ``prompt_len`` tokens."""

    def __init__(self, inner: EvictionPolicy, prompt_len: int):
        self.inner = inner
        self.prompt_len = prompt_len
        self.budget = inner.budget
        self.name = inner.name
        self._started: set[int] = set()  # sequences whose prompt `inner` has seen
        self.failed = False  # its last hook call raised

    def after_append(self, kv_cache, seq_id: int) -> None:
        """Either hook: ``inner.after_prefill`` once the whole prompt is in, ``inner.after_append`` after."""
        self.failed = True
        if seq_id in self._started:
            self.inner.after_append(kv_cache, seq_id)
        elif kv_cache.seq_len(seq_id) >= self.prompt_len:  # the whole prompt is in: evict it as generate would
            self._started.add(seq_id)
            self.inner.after_prefill(kv_cache, seq_id)
        self.failed = False

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
