"""Undoing a cache change: one sequence's failed forward (`rewind_sequence`), or a whole serving step (`Checkpoint`).

Both start from a `SequenceMark`, a sequence's pages, length and prefix keys as they were.

- **Rewind** (`PagedKVCache.mark` / `rewind`): a failed forward only reserved and wrote, so the
  mark alone is enough: shared pages a private copy replaced are shared again, pages taken since go
  back, and the slots written since (zero before: a slot past a sequence's end holds no token) are
  zeroed again. With 8-bit pages scaled per page (`paged_ref.kv_pages`) a write may also have re-quantized
  the tokens already in the sequence's last page: the mark keeps that page (bytes and scales, every layer).
- **Checkpoint** (`PagedKVCache.checkpoint` / `rollback`): a step also evicts, compacts, frees and
  adds sequences, overwriting K/V that was not zero. The checkpoint holds every sequence's mark, the
  pool, the prefix index and what watches the pages (`paged_ref.page_summaries`), and keeps the old
  contents of each K/V slot (and of its page's scales) before the cache changes it; `rollback` writes
  those back, newest first.

`Undo` gives the cache these as its methods ``mark``, ``rewind``, ``checkpoint``, ``commit`` and ``rollback``.

Example:
    >>> from paged_ref.cache import PagedKVCache
    >>> kv = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
    >>> a = kv.add_sequence(); _ = kv.reserve(a, 2)
    >>> kv.checkpoint(); kv.free(a); _ = kv.add_sequence(); kv.rollback()
    >>> kv.seq_ids, kv.seq_len(a), kv.allocator.num_free
    ([0], 2, 3)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._validate import describe
from .block_table import flat_slots
from .kv_pages import raw

__all__ = ["Checkpoint", "SequenceMark", "Undo", "marked_sequence", "rewind_plan", "rewind_sequence"]


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
    tail: tuple | None = None  # 8-bit pages scaled per page: (page, its bytes and scales), see `last_page`
    held: list | None = field(default=None, repr=False, compare=False)  # the page list itself (`marked_sequence`)

    @classmethod
    def of(cls, seq_id: int, seq, tail=None) -> SequenceMark:
        known = None if seq.token_ids is None else len(seq.token_ids)
        hashes = seq.page_hashes
        return cls(seq_id, tuple(seq.pages), seq.length, seq.token_ids, known, hashes, len(hashes), tail, seq.pages)

    def apply(self, seq) -> None:
        """Put ``seq``'s pages, length and prefix keys back as they were."""
        seq.pages, seq.length = list(self.pages), self.length  # copies: a checkpoint's mark may hold these lists too
        seq.token_ids = None if self.token_ids is None else self.token_ids[: self.known]
        seq.page_hashes = self.page_hashes[: self.hashed]


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


def last_page(cache, seq) -> tuple | None:
    """``(page, bytes, scales)``: the sequence's partly filled last page in every layer, when a write into it
    may re-quantize its tokens (8-bit pages scaled per page); else None."""
    if cache.quant is None or not cache.quant.per_page or not seq.length % cache.page_size:
        return None
    page = seq.pages[seq.length // cache.page_size]
    index = torch.tensor([page], device=cache.device)
    return page, [raw(t)[page].clone() for t in (*cache.k_cache, *cache.v_cache)], cache.quant.rows(index)


def marked_sequence(cache, seq_id: int, mark, shown: str | None = None):
    """``cache``'s ``seq_id``, if ``mark`` is its `SequenceMark` and it only reserved (its page list grown in place) and
    wrote since (truncate, compact, drop_pages, rewind, rollback: a new list); ``shown`` names it in the error."""
    seq = cache._seq(seq_id)
    if not isinstance(mark, SequenceMark) or mark.seq_id != seq_id:
        raise ValueError(f"mark must be a SequenceMark of sequence {seq_id}, got {describe(mark)}")
    if mark.held is not seq.pages:
        raise ValueError(
            f"mark is stale: {shown or f'sequence {seq_id}'} was truncated, compacted, had pages dropped or was "
            "rewound since mark() (a mark undoes reserves and writes, once), or the mark is another cache's"
        )
    return seq


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
    seq = marked_sequence(cache, seq_id, mark)
    ps = cache.page_size
    share, written, taken = rewind_plan(list(mark.pages), mark.length, seq.pages, seq.length, page_size=ps)
    cache.allocator.share(share)  # raises, changing nothing, if one went back to the pool since
    touched = {slot // ps for slot in written}  # pages held then that took tokens since (not copied away)
    for page in touched | set(taken):
        cache._prefix.forget(page)  # its tokens changed, or were written by the failed step
    cache._zero_slots(torch.tensor(written, dtype=torch.long, device=cache.device))
    cache._zero_pages(list(mark.pages[-(-mark.length // ps) :]))  # reserved ahead, no token: 8-bit scales 0 too
    if mark.tail is not None and mark.tail[0] in touched:  # the last page as it was, re-quantized tokens included
        page, bytes_, rows = mark.tail
        cache._saving(range(cache.num_layers), flat_slots([page], 0, ps, ps).to(cache.device))
        for data, saved in zip((*cache.k_cache, *cache.v_cache), bytes_):
            raw(data)[page] = saved
        cache.quant.set_rows(torch.tensor([page], device=cache.device), rows)
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
        # (layers, slots int64 [n], k and v: per layer [n, Hkv, D], the pages' scale rows or None): oldest first
        self.undo: list[tuple] = []

    def save(self, cache, layers, slots: torch.Tensor) -> None:
        """Keep the contents of ``slots`` (flat, int64 [n]) in ``layers`` before the cache changes them."""
        flat = (-1, cache.num_kv_heads, cache.head_dim)
        k = [raw(cache.k_cache[i]).view(flat).index_select(0, slots) for i in layers]  # [n, Hkv, D] copies
        v = [raw(cache.v_cache[i]).view(flat).index_select(0, slots) for i in layers]
        rows = None if cache.quant is None else cache.quant.rows(torch.unique(slots // cache.page_size))
        self.undo.append((layers, slots, k, v, rows))

    def restore(self, cache) -> None:
        """Put the cache back as it was when this checkpoint was made."""
        flat = (-1, cache.num_kv_heads, cache.head_dim)
        for layers, slots, k, v, rows in reversed(self.undo):
            for j, i in enumerate(layers):
                raw(cache.k_cache[i]).view(flat).index_copy_(0, slots, k[j])
                raw(cache.v_cache[i]).view(flat).index_copy_(0, slots, v[j])
            if rows is not None:
                cache.quant.set_rows(torch.unique(slots // cache.page_size), rows)
        for seq, mark in self.seqs.values():
            mark.apply(seq)
        cache._seqs = {seq_id: seq for seq_id, (seq, _) in self.seqs.items()}
        cache._next_id, cache.prefix_hits, cache.last_copies = self.next_id, self.prefix_hits, self.last_copies
        cache.allocator.restore(self.pool)
        cache._prefix.restore(self.prefix)
        for watcher, snapshot in self.watchers:
            watcher.restore(snapshot)


class Undo:
    """The cache's undo methods (`paged_ref.cache.PagedKVCache` inherits them; see the module docstring)."""

    def mark(self, seq_id: int) -> SequenceMark:
        """The sequence as it is now, for one `rewind`; valid while the sequence only reserves and writes."""
        seq = self._seq(seq_id)
        return SequenceMark.of(seq_id, seq, last_page(self, seq))

    def rewind(self, seq_id: int, mark: SequenceMark) -> None:
        """Put the sequence back as `mark` saw it, undoing a failed forward's reserves and writes: shared
        pages a private copy replaced are shared again, pages taken since go back, slots written since are
        zeroed and withdrawn from the prefix cache (`rewind_sequence`, with an example).
        Rewind a batch in reverse reservation order."""
        rewind_sequence(self, seq_id, mark)

    def checkpoint(self) -> None:
        """Start a change that `rollback` undoes whole (sequences, pool, prefix index, K/V); one at a time."""
        if self._checkpoint is not None:
            raise RuntimeError("PagedKVCache.checkpoint: one is already open (commit or roll it back first)")
        self._checkpoint = Checkpoint(self)

    def commit(self) -> None:
        """Keep every change since `checkpoint` (and stop recording)."""
        self._checkpoint = None

    def rollback(self) -> None:
        """Undo every change since `checkpoint`: the cache is exactly as it was then."""
        checkpoint, self._checkpoint = self._checkpoint, None
        if checkpoint is None:
            raise RuntimeError("PagedKVCache.rollback: no checkpoint is open")
        checkpoint.restore(self)

    def _saving(self, layers, slots: torch.Tensor) -> None:
        """Before ``slots`` of ``layers`` change: an open checkpoint keeps their contents."""
        if self._checkpoint is not None and slots.numel():
            self._checkpoint.save(self, tuple(layers), slots.to(device=self.device, dtype=torch.int64))
