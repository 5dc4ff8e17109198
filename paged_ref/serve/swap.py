"""Swap space: a preempted sequence's K/V copied to host memory and back into fresh pages.

Preemption by swapping (``Engine(preemption="swap")``) frees a sequence's pages without losing its
work: `SwapSpace.swap_out` copies the pages holding its tokens, in every layer, into host tensors
(`paged_ref.kv_pages.read_pages`: the bytes as stored, and 8-bit pages' scales) and truncates it to
zero tokens (it stays live in the session, its eviction record intact); `SwapSpace.swap_in` takes new
pages (``reserve``) and writes the same bytes and scales into them (`paged_ref.kv_pages.write_pages`).
The pages differ on the way back, which costs nothing: attention reads through the block table.

Example:
    >>> import torch
    >>> from paged_ref.cache import PagedKVCache
    >>> kv = PagedKVCache(num_layers=2, num_pages=4, page_size=2, num_kv_heads=1, head_dim=1)
    >>> s = kv.add_sequence(); slots = kv.reserve(s, 3)
    >>> for layer in range(2): kv.write(layer, slots, torch.ones(3, 1, 1) * layer, torch.ones(3, 1, 1))
    >>> space = SwapSpace()
    >>> space.swap_out(kv, s); kv.seq_len(s), kv.allocator.num_free, space.tokens(s)
    (0, 4, 3)
    >>> space.swap_in(kv, s); kv.seq_len(s), kv.gather(1, s)[0].flatten().tolist()
    (3, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

from ..cache import PagedKVCache
from ..kv_pages import read_pages, write_pages

__all__ = ["SwapSpace"]


class SwapSpace:
    """Host copies of swapped-out sequences' K/V, keyed by seq_id, and the tokens copied each way so far."""

    def __init__(self):
        self._held: dict[int, tuple[int, tuple]] = {}  # seq -> (tokens, `read_pages`' (k, v, scale rows))
        self.swapped_out_tokens = 0
        self.swapped_in_tokens = 0

    def tokens(self, seq_id: int) -> int:
        """Tokens held for ``seq_id`` (what `swap_in` will write back)."""
        return self._held[seq_id][0]

    @property
    def bytes(self) -> int:
        """Host bytes held: the pages' K and V (and their scales)."""
        tensors = [t for _, (k, v, rows) in self._held.values() for t in (k, v, *sum(rows or [], ()))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def swap_out(self, kv_cache: PagedKVCache, seq_id: int) -> None:
        """Copy ``seq_id``'s K/V to host memory and give its pages back (it keeps 0 tokens)."""
        k, v, rows = read_pages(kv_cache, seq_id)  # [layers, pages, page_size, Hkv, D] each, scale rows
        n = kv_cache.seq_len(seq_id)
        kv_cache.truncate(seq_id, n)
        self._held[seq_id] = n, (k.cpu(), v.cpu(), None if rows is None else [(a.cpu(), b.cpu()) for a, b in rows])
        self.swapped_out_tokens += n

    def swap_in(self, kv_cache: PagedKVCache, seq_id: int, token_ids: list[int] | None = None) -> None:
        """Write ``seq_id``'s K/V back into fresh pages (raises `OutOfPagesError`, keeping the copy, if short);
        ``token_ids``: the held tokens' ids, so that a prefix-caching cache offers the pages again."""
        n, stored = self._held[seq_id]
        if n:  # none when swapped out before it held a token
            kv_cache.reserve(seq_id, n, token_ids=token_ids)
            write_pages(kv_cache, seq_id, stored)
        del self._held[seq_id]
        self.swapped_in_tokens += n

    def drop(self, seq_id: int) -> None:
        """Forget ``seq_id``'s copy (its request was aborted)."""
        self._held.pop(seq_id, None)
