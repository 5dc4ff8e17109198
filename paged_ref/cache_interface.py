"""`KVCache`: what the model glue (`paged_ref.hf`), eviction and serving ask of a paged KV cache.

`PagedKVCache` (one block table per sequence for every layer) and `LayeredKVCache` (one per layer,
``tables_per_layer``) implement it; the per-layer questions are methods (``layer_slots``, ...).

Example:
    >>> from paged_ref import LayeredKVCache, PagedKVCache
    >>> shape = dict(num_layers=2, num_pages=4, page_size=2, num_kv_heads=1, head_dim=2)
    >>> for kv in (PagedKVCache(**shape), LayeredKVCache(**shape)):
    ...     s = kv.add_sequence()
    ...     slots = kv.reserve(s, 3)
    ...     print(isinstance(kv, KVCache), kv.tables_per_layer, kv.layer_slots(slots, 1).tolist())
    True False [0, 1, 2]
    True True [4, 5, 6]
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .allocator import PageAllocator
from .cache import PageCopy
from .memory import KVGeometry

__all__ = ["KVCache"]


@runtime_checkable
class KVCache(Protocol):
    """The paged KV cache interface (see the module docstring); all-or-nothing operations."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    allocator: PageAllocator
    prefix_caching: bool
    tables_per_layer: bool

    @property
    def k_cache(self) -> list[torch.Tensor]:
        """Layer ``i``'s K pages ``[pages, page_size, num_kv_heads, head_dim]`` (``v_cache`` alike)."""

    @property
    def v_cache(self) -> list[torch.Tensor]: ...

    @property
    def geometry(self) -> KVGeometry: ...

    @property
    def seq_ids(self) -> list[int]: ...

    def seq_len(self, seq_id: int) -> int: ...

    def block_table(self, seq_ids=None, device=None, *, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(block_table int32 [batch, max_pages], seq_lens int32 [batch])``."""

    def layer_slots(self, slots: torch.Tensor, layer: int) -> torch.Tensor:
        """The ``int64 [num_new]`` slots layer ``layer`` writes, out of a step's reserved slots."""

    def add_sequence(self, token_ids=None, *, namespace: dict | None = None) -> int: ...

    def fork(self, seq_id: int) -> int: ...

    def reserve(self, seq_id: int, num_tokens: int) -> torch.Tensor: ...

    def reserve_batch(self, seq_ids, num_tokens, token_ids=None) -> list[torch.Tensor]: ...

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> None: ...

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def kv_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """8-bit pages' float32 ``[pages, num_kv_heads]`` K and V scales of layer ``layer``; ``(None, None)`` else."""

    def truncate(self, seq_id: int, num_tokens: int) -> None: ...

    def compact(self, seq_id: int, keep: torch.Tensor) -> None: ...

    def drop_pages(self, seq_id: int, logical_pages) -> None: ...

    def free(self, seq_id: int) -> None: ...

    last_copies: tuple[PageCopy, ...]
    """The copies-on-write (`~paged_ref.cache.PageCopy`) of the latest reserve, reserve_batch, truncate or compact."""

    def mark(self, seq_id: int):
        """The sequence as it is now, for `rewind` (what a forward that may fail takes first)."""

    def rewind(self, seq_id: int, mark) -> None:
        """Undo the reserves and writes made since `mark` (rewind a batch last sequence first)."""
