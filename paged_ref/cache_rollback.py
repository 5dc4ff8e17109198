"""Undoing a failed forward: put a sequence back as it was before its reserves and writes.

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
"""

from __future__ import annotations

import torch


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
