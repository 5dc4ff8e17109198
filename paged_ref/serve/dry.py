"""A dry session: the page pool and the calls the engine makes, with no model behind them.

`DrySession` answers the engine's calls of a `paged_ref.hf.PagedSession` (``add``, ``position``,
``extend``, ``finish``, ``kv``, ``plan_seconds``) over a real
`PagedKVCache` of one number per token: pages are taken, shared and freed exactly as in a real run,
nothing is written, and every row samples token 0. ``Engine(None, ...)`` is such a dry run: what
notebooks 03 and 09 use to play thousands of steps in seconds. Eviction needs real K/V: refused.

Example:
    >>> dry = DrySession(num_pages=4, page_size=2)
    >>> s = dry.add()
    >>> dry.extend([s], [[7, 8, 9]]).shape, dry.kv.pages(s), dry.position(s)
    (torch.Size([1, 1]), [0, 1], 3)
"""

from __future__ import annotations

import torch

from .._cache_checks import check_reserved
from ..cache import PagedKVCache

__all__ = ["DrySession"]


class DrySession:
    """The engine's view of a `PagedSession`, over a pool of ``num_pages`` pages and no model."""

    evicts = False  # no K/V to score: the engine refuses eviction policies at the door

    def __init__(self, *, num_pages: int, page_size: int, prefix_caching: bool = False):
        one = dict(num_layers=1, num_kv_heads=1, head_dim=1)  # one number per token
        self.kv = PagedKVCache(num_pages=num_pages, page_size=page_size, prefix_caching=prefix_caching, **one)
        self._positions: dict[int, int] = {}
        self.plan_seconds = 0.0

    def close(self) -> None:
        for seq_id in list(self._positions):
            self.finish(seq_id)

    def add(self, token_ids=None, *, eviction=None) -> int:
        if eviction is not None:
            raise ValueError("a dry run has no K/V to score: eviction policies need a model (Engine(model, ...))")
        seq_id = self.kv.add_sequence(token_ids=token_ids)
        self._positions[seq_id] = self.kv.seq_len(seq_id)
        return seq_id

    def position(self, seq_id: int) -> int:
        return self._positions[seq_id]

    def finish(self, seq_id: int) -> None:
        del self._positions[seq_id]
        self.kv.free(seq_id)

    def extend(self, seq_ids: list[int], tokens: list, *, packed: bool = False, reserved: bool = False) -> torch.Tensor:
        """Feed every row's new tokens (lists or 1-D tensors of ids), reserving their slots unless
        ``reserved``; returns logits ``[batch, 1]`` (every row samples token 0). ``packed`` changes nothing here."""
        if reserved:  # as `PagedSession.extend` checks it; no eviction here: a sequence held what it was fed
            check_reserved(seq_ids, [len(t) for t in tokens], self._positions, self.kv)
        for s, t in zip(seq_ids, tokens):
            if not reserved:
                ids = (t.tolist() if isinstance(t, torch.Tensor) else list(t)) if self.kv.prefix_caching else None
                self.kv.reserve(s, len(t), token_ids=ids)
            self.kv.written(s)  # what a forward writes: its full pages stay cached when freed
            self._positions[s] += len(t)
        return torch.zeros(len(seq_ids), 1)
