"""The whole state of a paged cache, to check that a failed call changed nothing.

`snapshot` copies everything a cache operation may touch: every sequence's pages, length and
prefix keys, the allocator's reference counts, free lists (in order) and bump pointer, the
prefix index and the pages waiting for their K/V, and the K/V tensors themselves (8-bit pages: their
bytes and scales). Two
snapshots compare equal with ``==`` exactly when the caches are in the same state; ``diff``
names the fields that differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_ref.cache import PagedKVCache
from paged_ref.kv_pages import raw
from paged_ref.layered_cache import LayeredKVCache


@dataclass
class Snapshot:
    fields: dict
    tensors: tuple[torch.Tensor, ...]

    __hash__ = None

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Snapshot)
            and self.fields == other.fields
            and len(self.tensors) == len(other.tensors)
            and all(torch.equal(a, b) for a, b in zip(self.tensors, other.tensors))
        )

    def __repr__(self) -> str:
        return f"Snapshot({len(self.fields)} fields, {len(self.tensors)} tensors)"

    def diff(self, other: Snapshot) -> str:
        """Where two snapshots differ (for an assertion message)."""
        lines = []
        for name, a in self.fields.items():
            b = other.fields.get(name)
            if a != b and isinstance(a, dict) and isinstance(b, dict):
                keys = sorted(set(a) | set(b), key=repr)
                lines += [f"{name}[{k!r}]: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
            elif a != b:
                lines.append(f"{name}: {a!r} != {b!r}")
        for i, (a, b) in enumerate(zip(self.tensors, other.tensors)):
            if not torch.equal(a, b):
                pages = sorted({int(p) for p in (a != b).flatten(1).any(1).nonzero().flatten()})
                lines.append(f"tensor {i} differs in pages {pages}")
        return "; ".join(lines) or "equal"

    def without_prefix_pages(self, pages) -> Snapshot:
        """This state with ``pages``, free pages kept for prefix reuse, handed out and returned:
        no longer in the prefix index, plain free pages, zero. (A failed step that needed pages
        may take those; their K/V are overwritten, so no rollback can revive them.)"""
        pages = set(pages)
        fields = dict(self.fields)
        index = {k: tuple(p for p in held if p not in pages) for k, held in fields["prefix_index"].items()}
        fields["prefix_index"] = {k: held for k, held in index.items() if held}
        for name in ("page_hash", "page_tokens"):
            fields[name] = {p: v for p, v in fields[name].items() if p not in pages}
        fields["cached"] = tuple(p for p in fields["cached"] if p not in pages)
        fields["unwritten"] = tuple(p for p in fields["unwritten"] if p not in pages)
        index = torch.tensor(sorted(pages), dtype=torch.long)
        tensors = tuple(t.index_fill(0, index, 0) if pages else t for t in self.tensors)
        return Snapshot(fields, tensors)


def snapshot(cache, *, tensors: bool = True, exact: bool = True) -> Snapshot:
    """The state of a `PagedKVCache` or a `LayeredKVCache` (``tensors=False``: metadata only).

    ``exact=False`` leaves out what an operation that takes pages or ids and gives them back (a
    forward rolled back, a fork undone) may change: the order in which free pages will be handed
    out (free lists, bump pointer) and the next sequence id.
    """
    if isinstance(cache, LayeredKVCache):
        inner = snapshot(cache.pool, tensors=tensors, exact=exact)
        lanes = {s: tuple(lanes) for s, lanes in cache._lanes.items()}
        return Snapshot(
            {"lanes": lanes, "layered_next_id": cache._next_id if exact else None, **inner.fields}, inner.tensors
        )
    assert isinstance(cache, PagedKVCache)
    alloc = cache.allocator
    fields = {
        "sequences": {
            s: (
                seq.length,
                tuple(seq.pages),
                None if seq.token_ids is None else tuple(seq.token_ids),
                tuple(seq.page_hashes),
                seq.root,
            )
            for s, seq in cache._seqs.items()
        },
        "next_id": cache._next_id if exact else None,
        "refcount": dict(enumerate(alloc._refcount)),
        "free": tuple(alloc._free) if exact else (),
        "cached": tuple(alloc._cached) if exact else tuple(sorted(alloc._cached)),
        "next_fresh": alloc._next_fresh if exact else None,
        "prefix_index": {k: tuple(held) if exact else tuple(sorted(held)) for k, held in cache._prefix.page_of.items()},
        "page_hash": dict(cache._prefix.key_of),
        "page_tokens": dict(cache._prefix.tokens_of),
        "unwritten": tuple(sorted(cache._prefix.unwritten)),
        "prefix_hits": cache.prefix_hits,
    }
    # the K/V bytes (8-bit pages: as uint8), and 8-bit pages' scales when they are per page
    scales = (*cache.quant.k_scales, *cache.quant.v_scales) if cache.quant is not None and cache.quant.per_page else ()
    kv = tuple(raw(t).clone() for t in (*cache.k_cache, *cache.v_cache, *scales))
    return Snapshot(fields, kv if tensors else ())
