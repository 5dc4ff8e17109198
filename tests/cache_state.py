"""The whole state of a paged cache, to check that a failed call changed nothing.

`snapshot` copies everything a cache operation may touch: every sequence's pages, length and
prefix keys, the allocator's reference counts, free lists (in order) and bump pointer, the
prefix index and the pages waiting for their K/V, and the K/V tensors themselves. Two
snapshots compare equal with ``==`` exactly when the caches are in the same state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_ref.cache import PagedKVCache
from paged_ref.layered_cache import LayeredKVCache


@dataclass
class Snapshot:
    meta: tuple
    tensors: tuple[torch.Tensor, ...]

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Snapshot)
            and self.meta == other.meta
            and len(self.tensors) == len(other.tensors)
            and all(torch.equal(a, b) for a, b in zip(self.tensors, other.tensors))
        )

    __hash__ = None

    def __repr__(self) -> str:
        return f"Snapshot({len(self.meta)} fields, {len(self.tensors)} tensors)"

    def diff(self, other: Snapshot) -> str:
        """Where two snapshots differ (for an assertion message)."""
        lines = []
        for i, (a, b) in enumerate(zip(self.meta, other.meta)):
            if a != b and isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
                lines += [f"meta[{i}][{j}]: {x!r} != {y!r}" for j, (x, y) in enumerate(zip(a, b)) if x != y]
            elif a != b:
                lines.append(f"meta[{i}]: {a!r} != {b!r}")
        lines += [
            f"tensor {i} differs" for i, (a, b) in enumerate(zip(self.tensors, other.tensors)) if not torch.equal(a, b)
        ]
        return "; ".join(lines) or "equal"


def snapshot(cache, *, tensors: bool = True, exact: bool = True) -> Snapshot:
    """The state of a `PagedKVCache` or a `LayeredKVCache` (``tensors=False``: metadata only).

    ``exact=False`` leaves out what an operation that takes pages or ids and gives them back (a
    forward rolled back, a fork undone) may change: the order in which free pages will be handed
    out (free lists, bump pointer) and the next sequence id.
    """
    if isinstance(cache, LayeredKVCache):
        inner = snapshot(cache.pool, tensors=tensors, exact=exact)
        lanes = tuple((s, tuple(lanes)) for s, lanes in cache._lanes.items())
        return Snapshot((lanes, cache._next_id if exact else None, *inner.meta), inner.tensors)
    assert isinstance(cache, PagedKVCache)
    alloc = cache.allocator
    seqs = tuple(
        (
            s,
            seq.length,
            tuple(seq.pages),
            None if seq.token_ids is None else tuple(seq.token_ids),
            tuple(seq.page_hashes),
            seq.root,
        )
        for s, seq in cache._seqs.items()
    )
    meta = (
        seqs,
        cache._next_id if exact else None,
        tuple(alloc._refcount),
        tuple(alloc._free) if exact else (),
        tuple(alloc._cached) if exact else tuple(sorted(alloc._cached)),
        alloc._next_fresh if exact else None,
        tuple(cache._prefix_index.items()),
        tuple(sorted(cache._page_hash.items())),
        tuple(sorted(cache._page_tokens.items())),
        tuple(sorted((p, k, t, tuple(sorted(layers))) for p, (k, t, layers) in cache._pending.items())),
        cache.prefix_hits,
    )
    return Snapshot(meta, tuple(t.clone() for t in (*cache.k_cache, *cache.v_cache)) if tensors else ())
