"""Undoing a failed forward: put a sequence back as it was before its reserves and writes; or
the whole cache back as it was at a checkpoint.

A model's forward reserves slots for every sequence of the batch, then writes K/V layer by
layer. If it fails half way (an error in a layer, pages running out for a later sequence), the
session puts every sequence back with `rewind`, using the `mark` it took before the step:

- each shared page that a private copy replaced (copy-on-write) is shared again,
- the pages taken since (new pages, private copies) go back to the pool,
- the slots written since in the pages it kept are zeroed and no longer offered for prefix reuse.

Rewind a batch in the reverse of the order it was reserved in: a page one sequence copied away
may have been written in place by a later one, which must give it back first. Returned pages
that kept a prefix for reuse and were handed out since stay forgotten: their K/V were
overwritten. `PagedKVCache._mark` and `PagedKVCache._rewind` call these with one of the
cache's own sequences; they work on the cache's internals (its pool, prefix index and tensors).

A serving step does more than one forward's reserves and writes: it preempts (pages freed or
swapped out), admits (prefix pages shared or revived), runs eviction hooks (pages dropped,
sequences compacted) and may fail in any of them. `Checkpoint` undoes all of that: it copies
the cache's small bookkeeping (every sequence's block table and length, the pool's reference
counts and free lists, the prefix index) and, while it is open, the cache hands it the old
contents of every K/V slot before changing it (`Checkpoint.save`); `Checkpoint.restore` writes
those back, newest first, and puts the bookkeeping back. Its cost is the slots changed, not the
pool: a decode step saves the one slot per sequence and layer it writes.
"""

from __future__ import annotations

import torch

__all__ = ["Checkpoint", "mark", "rewind"]


def mark(seq) -> tuple:
    """``seq`` as it is now (valid while it only reserves and writes): its pages, its length and
    its prefix-key lists with their lengths (reserve only appends to those lists, or replaces them)."""
    known = None if seq.token_ids is None else len(seq.token_ids)
    return list(seq.pages), seq.length, (seq.token_ids, known), (seq.page_hashes, len(seq.page_hashes))


def rewind(cache, seq, saved: tuple) -> None:
    """Put ``seq`` back as `mark` saw it, undoing the reserves and writes made since."""
    pages, length, (token_ids, known), (page_hashes, hashed) = saved
    ps, before, now = cache.page_size, set(pages), set(seq.pages)
    cache.allocator.share([p for p in pages if p not in now])  # raises, changing nothing, if one is gone
    # tokens written since into pages held before (the partial last page, pages reserved ahead)
    written = [t for t in range(length, min(seq.length, len(pages) * ps)) if seq.pages[t // ps] == pages[t // ps]]
    if written:
        for page in {pages[t // ps] for t in written}:
            cache._prefix.forget(page)  # no longer full with those tokens
        cache._zero_slots(torch.tensor([pages[t // ps] * ps + t % ps for t in written], device=cache.device))
    taken = [p for p in seq.pages if p not in before]  # new pages and private copies
    for page in taken:
        cache._prefix.forget(page)  # filled by the failed step: never offered for reuse
    cache._release(taken)
    if token_ids is not None:
        del token_ids[known:]
    del page_hashes[hashed:]
    seq.pages, seq.length, seq.token_ids, seq.page_hashes = pages, length, token_ids, page_hashes


class Checkpoint:
    """The whole cache as it was when made, and the old contents of every slot changed since."""

    def __init__(self, cache):
        self.seqs = {seq_id: (seq, mark(seq)) for seq_id, seq in cache._seqs.items()}
        self.next_id, self.prefix_hits = cache._next_id, cache.prefix_hits
        self.pool = cache.allocator.snapshot()
        self.prefix = cache._prefix.snapshot()
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
        for seq, saved in self.seqs.values():
            pages, length, (token_ids, known), (page_hashes, hashed) = saved
            if token_ids is not None:
                del token_ids[known:]
            del page_hashes[hashed:]
            seq.pages, seq.length, seq.token_ids, seq.page_hashes = list(pages), length, token_ids, page_hashes
        cache._seqs = {seq_id: seq for seq_id, (seq, _) in self.seqs.items()}
        cache._next_id, cache.prefix_hits = self.next_id, self.prefix_hits
        cache.allocator.restore(self.pool)
        cache._prefix.restore(self.prefix)
