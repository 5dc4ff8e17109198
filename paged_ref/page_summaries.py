"""Page key summaries for Quest (`paged_ref.attention.quest`): the elementwise min and max of
every page's keys, per layer ``k_min[layer], k_max[layer]: [num_pages, num_kv_heads, head_dim]``.

A `PagedKVCache(page_summaries=True)` keeps one (``cache.summaries``) among its ``watchers``, told
of every change to a page's keys (`PagedKVCache._tell`): ``write`` folds new keys in, a page handed
out again starts empty (``+inf`` / ``-inf``), a copy-on-write copies it, ``compact`` recomputes;
``truncate`` and ``rewind`` leave a looser bound; a checkpoint's rollback puts it back.

Example:
    >>> import torch
    >>> s = PageSummaries(num_layers=1, num_pages=2, num_kv_heads=1, head_dim=2, page_size=4)
    >>> s.update(0, torch.tensor([4, 5]), torch.tensor([[[1.0, -2.0]], [[3.0, 0.5]]]))   # page 1
    >>> s.k_min[0][1, 0].tolist(), s.k_max[0][1, 0].tolist()
    ([1.0, -2.0], [3.0, 0.5])
    >>> bool(s.k_min[0][0].isinf().all())                                              # page 0: empty
    True
"""

from __future__ import annotations

import torch

__all__ = ["PageSummaries"]


class PageSummaries:
    """Per layer ``k_min, k_max: [num_pages, num_kv_heads, head_dim]`` of the keys on each page."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype=torch.float32,
        device="cpu",
    ):
        self.page_size = page_size
        shape = (num_pages, num_kv_heads, head_dim)
        self.k_min = [torch.full(shape, float("inf"), dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_max = [torch.full(shape, float("-inf"), dtype=dtype, device=device) for _ in range(num_layers)]

    def update(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Fold keys ``k: [n, num_kv_heads, head_dim]`` written at flat ``slots: int [n]`` into their pages."""
        pages = (slots.long() // self.page_size)[:, None, None].expand_as(k)  # [n, Hkv, D]
        self.k_min[layer].scatter_reduce_(0, pages, k.to(self.k_min[layer].dtype), "amin")
        self.k_max[layer].scatter_reduce_(0, pages, k.to(self.k_max[layer].dtype), "amax")

    def clear(self, pages: list[int]) -> None:
        """Pages that hold no key any more (handed out again, or about to be recomputed)."""
        if pages:
            index = torch.tensor(pages, device=self.k_min[0].device)  # int64 [n]
            for k_min, k_max in zip(self.k_min, self.k_max):
                k_min.index_fill_(0, index, float("inf"))
                k_max.index_fill_(0, index, float("-inf"))

    def copy(self, src: int, dst: int) -> None:
        """Page ``dst`` became a copy of page ``src``."""
        for t in (*self.k_min, *self.k_max):
            t[dst].copy_(t[src])

    def snapshot(self):
        return [m.clone() for m in self.k_min], [m.clone() for m in self.k_max]

    def restore(self, snapshot) -> None:
        self.k_min, self.k_max = snapshot
