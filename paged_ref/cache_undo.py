"""Undoing a cache change: one sequence's failed forward (`rewind_sequence`), or a whole serving step (`Checkpoint`).

Both start from a `SequenceMark`, a sequence's pages, length and prefix keys as they were.

- **Rewind** (`PagedKVCache.mark` / `rewind`): a failed forward only reserved and wrote, so the
  mark alone is enough: shared pages a private copy replaced are shared again, pages taken since go
  back, and the slots written since (zero before: a slot past a sequence's end holds no token) are
  zeroed again.
- **Checkpoint** (`PagedKVCache.checkpoint` / `rollback`): a step also evicts, compacts, frees and
  adds sequences, overwriting K/V that was not zero. The checkpoint holds every sequence's mark, the
  pool, the prefix index and what watches the pages (`paged_ref.page_summaries`), and keeps the old
  contents of each K/V slot before the cache changes it; `rollback` writes those back, newest first.

Example:
    >>> from paged_ref.cache import PagedKVCache
    >>> kv = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
    >>> a = kv.add_sequence(); _ = kv.reserve(a, 2)
    >>> kv.checkpoint(); kv.free(a); _ = kv.add_sequence(); kv.rollback()
    >>> kv.seq_ids, kv.seq_len(a), kv.allocator.num_free
    ([0], 2, 3)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._validate import describe

__all__ = ["Checkpoint", "SequenceMark", "rewind_plan", "rewind_sequence"]


@dataclass(frozen=True)
class SequenceMark:
    """A sequence as `PagedKVCache.mark` saw it, for `PagedKVCache.rewind`: pages, length, and its prefix-key
    lists with their lengths then (``reserve`` only appends to those lists, or replaces them)."""

    seq_id: int
    pages: tuple[int, ...]
    length: int
    token_ids: list[int] | None
    known: int
    page_hashes: list[bytes]
    hashed: int

    @classmethod
    def of(cls, seq_id: int, seq) -> SequenceMark:
        known = None if seq.token_ids is None else len(seq.token_ids)
        return cls(seq_id, tuple(seq.pages), seq.length, seq.token_ids, known, seq.page_hashes, len(seq.page_hashes))

    def apply(self, seq) -> None:
        """Put ``seq``'s pages, length and prefix keys back as they were."""
        if self.token_ids is not None:
            del self.token_ids[self.known :]
        del self.page_hashes[self.hashed :]
        seq.pages, seq.length = list(self.pages), self.length
        seq.token_ids, seq.page_hashes = self.token_ids, self.page_hashes


def rewind_plan(saved: list[int], saved_len: int, pages: list[int], length: int, *, page_size: int):
    """Rewinding a sequence from ``pages`` and ``length`` now to ``saved`` and ``saved_len``: the
    shared pages its private copies replaced (to share again), the slots written since in pages
    it held before (to zero), and the pages taken since (to release).

    Example:
        >>> rewind_plan([0], 2, [3, 4], 6, page_size=4)  # page 0 was copied to 3, then page 4 added
        ([0], [], [3, 4])
        >>> rewind_plan([0], 2, [0, 4], 6, page_size=4)  # written in place: slots 2 and 3 of page 0
        ([], [2, 3], [4])
    """
    before, now = set(saved), set(pages)
    kept = range(saved_len, min(length, len(saved) * page_size))  # tokens since, in pages held before
    written = [
        saved[t // page_size] * page_size + t % page_size
        for t in kept
        if pages[t // page_size] == saved[t // page_size]
    ]
    return [p for p in saved if p not in now], written, [p for p in pages if p not in before]


def rewind_sequence(cache, seq_id: int, mark: SequenceMark) -> None:
    """`PagedKVCache.rewind`: the sequence back as ``mark`` saw it (it has only reserved and written since).

    Example:
        >>> from paged_ref.cache import PagedKVCache
        >>> kv = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
        >>> a = kv.add_sequence(); _ = kv.reserve(a, 2); b = kv.fork(a)
        >>> m = kv.mark(b)
        >>> _ = kv.reserve(b, 3)                 # copies shared page 0 to page 2, adds page 1
        >>> kv.rewind(b, m)                      # as if that reserve never happened
        >>> kv.pages(b), kv.seq_len(b), kv.allocator.refcount(0), kv.allocator.num_free
        ([0], 2, 2, 3)
    """
    seq = cache._seq(seq_id)
    if not isinstance(mark, SequenceMark) or mark.seq_id != seq_id:
        raise ValueError(f"mark must be a SequenceMark of sequence {seq_id}, got {describe(mark)}")
    ps = cache.page_size
    share, written, taken = rewind_plan(list(mark.pages), mark.length, seq.pages, seq.length, page_size=ps)
    cache.allocator.share(share)  # raises, changing nothing, if one went back to the pool since
    for page in {slot // ps for slot in written} | set(taken):
        cache._prefix.forget(page)  # its tokens changed, or were written by the failed step
    if written:
        cache._zero_slots(torch.tensor(written, device=cache.device))
    cache._release(taken)
    mark.apply(seq)
    cache.last_copies = ()


class Checkpoint:
    """The cache's bookkeeping as it was (every `SequenceMark`, the pool, the prefix index, the page
    watchers) and the old contents of every K/V slot changed since (`save`); `restore` writes them back."""

    def __init__(self, cache):
        self.seqs = {seq_id: (seq, SequenceMark.of(seq_id, seq)) for seq_id, seq in cache._seqs.items()}
        self.next_id, self.prefix_hits, self.last_copies = cache._next_id, cache.prefix_hits, cache.last_copies
        self.pool = cache.allocator.snapshot()
        self.prefix = cache._prefix.snapshot()
        self.watchers = [(w, w.snapshot()) for w in cache.watchers]
        self.undo: list[tuple] = []  # (layers, slots int64 [n], k and v: per layer [n, Hkv, D]): oldest first

    def save(self, cache, layers, slots: torch.Tensor) -> None:
        """Keep the contents of ``slots`` (flat, int64 [n]) in ``layers`` before the cache changes them."""
        flat = (-1, cache.num_kv_heads, cache.head_dim)
        k = [cache.k_cache[i].view(flat)[slots] for i in layers]  # each [n, Hkv, D], a copy
        v = [cache.v_cache[i].view(flat)[slots] for i in layers]
        self.undo.append((layers, slots, k, v))

    def restore(self, cache) -> None:
        """Put the cache back as it was when this checkpoint was made."""
        flat = (-1, cache.num_kv_heads, cache.head_dim)
        for layers, slots, k, v in reversed(self.undo):
            for j, i in enumerate(layers):
                cache.k_cache[i].view(flat).index_copy_(0, slots, k[j])
                cache.v_cache[i].view(flat).index_copy_(0, slots, v[j])
        for seq, mark in self.seqs.values():
            mark.apply(seq)
        cache._seqs = {seq_id: seq for seq_id, (seq, _) in self.seqs.items()}
        cache._next_id, cache.prefix_hits, cache.last_copies = self.next_id, self.prefix_hits, self.last_copies
        cache.allocator.restore(self.pool)
        cache._prefix.restore(self.prefix)
        for watcher, snapshot in self.watchers:
            watcher.restore(snapshot)
