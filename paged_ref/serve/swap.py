"""Swap space: a preempted sequence's K/V copied to host memory and back into fresh pages.

Preemption by swapping (``Engine(preemption="swap")``) frees a sequence's pages without losing its
work: `SwapSpace.swap_out` reads its K/V of every layer (``gather``) into host tensors and truncates
it to zero tokens (it stays live in the session, its eviction record intact); `SwapSpace.swap_in`
takes new pages (``reserve``) and writes the same K/V into them. The pages differ on the way back,
which costs nothing: attention reads through the block table. Only the cache's public methods are used.

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

import torch

from ..cache import PagedKVCache

__all__ = ["SwapSpace"]


class SwapSpace:
    """Host copies of swapped-out sequences' K/V, keyed by seq_id, and the tokens copied each way so far."""

    def __init__(self):
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq -> (k, v) [layers, n, Hkv, D]
        self.swapped_out_tokens = 0
        self.swapped_in_tokens = 0

    def tokens(self, seq_id: int) -> int:
        """Tokens held for ``seq_id`` (what `swap_in` will write back)."""
        return self._held[seq_id][0].shape[1]

    @property
    def bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self._held.values())

    def swap_out(self, kv_cache: PagedKVCache, seq_id: int) -> None:
        """Copy ``seq_id``'s K/V to host memory and give its pages back (it keeps 0 tokens)."""
        layers = [kv_cache.gather(layer, seq_id) for layer in range(kv_cache.num_layers)]  # each ([n, Hkv, D]) * 2
        k = torch.stack([k for k, _ in layers]).cpu()  # [layers, n, Hkv, D]
        v = torch.stack([v for _, v in layers]).cpu()
        kv_cache.truncate(seq_id, kv_cache.seq_len(seq_id))
        self._held[seq_id] = (k, v)
        self.swapped_out_tokens += k.shape[1]

    def swap_in(self, kv_cache: PagedKVCache, seq_id: int, token_ids: list[int] | None = None) -> None:
        """Write ``seq_id``'s K/V back into fresh pages (raises `OutOfPagesError`, keeping the copy, if short);
        ``token_ids``: the held tokens' ids, so that a prefix-caching cache offers the pages again."""
        k, v = self._held[seq_id]
        if k.shape[1]:  # none when swapped out before it held a token
            slots = kv_cache.reserve(seq_id, k.shape[1], token_ids=token_ids)  # [n]
            k, v = k.to(kv_cache.device), v.to(kv_cache.device)
            for layer in range(kv_cache.num_layers):
                kv_cache.write(layer, slots, k[layer], v[layer], check_values=layer == 0)
        del self._held[seq_id]
        self.swapped_in_tokens += k.shape[1]

    def drop(self, seq_id: int) -> None:
        """Forget ``seq_id``'s copy (its request was aborted)."""
        self._held.pop(seq_id, None)
