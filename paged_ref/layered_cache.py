"""A paged KV cache in which every layer keeps its own block table, for per-layer eviction
(PagedEviction's authors' code keeps different tokens in different layers).

`LayeredKVCache` is one single-layer `PagedKVCache` whose pool holds ``num_layers * num_pages``
*layer pages*: layer ``i`` of a sequence is one inner sequence (a *lane*), and attention for
layer ``i`` reads the shared pool with that lane's block table. The lanes of a sequence grow and
shrink together: every layer holds ``seq_len`` tokens, which tokens differs.

Example:
    >>> import torch
    >>> cache = LayeredKVCache(num_layers=2, num_pages=4, page_size=2, num_kv_heads=1, head_dim=3)
    >>> s = cache.add_sequence()
    >>> slots = cache.reserve(s, 3)                     # int64 [num_layers, 3]: a slot per layer
    >>> for layer in range(2): cache.write(layer, slots[layer], torch.ones(3, 1, 3), torch.ones(3, 1, 3))
    >>> cache.compact(s, torch.tensor([[True, False, True], [False, True, True]]))   # a keep mask per layer
    >>> cache.seq_len(s), [len(cache.pages(s, layer)) for layer in range(2)], cache.allocator.num_free
    (2, [1, 1], 6)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ._cache_checks import batch_lists, check_layer
from ._validate import INT32_MAX, check_int, check_list, describe, is_int
from .allocator import OutOfPagesError
from .block_table import pages_needed
from .cache import PageCopy, PagedKVCache
from .cache_undo import SequenceMark, marked_sequence
from .memory import KVGeometry, model_geometry
from .page_plan import compact_copies, truncate_cost
from .quant import kv_format as as_kv_format

__all__ = ["LayeredKVCache"]


class LayeredKVCache:
    """Per-layer block tables over one allocator; the arguments are `PagedKVCache`'s."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        kv_format=None,
    ):
        self.num_layers = check_int("num_layers", num_layers, min_value=1, max_value=INT32_MAX + 1)
        self.num_pages = check_int("num_pages", num_pages, min_value=1, max_value=(INT32_MAX + 1) // self.num_layers)
        kv_format = as_kv_format(kv_format)
        if kv_format is not None and tuple in (type(kv_format.k_scale), type(kv_format.v_scale)):
            raise ValueError(
                "kv_format: a LayeredKVCache's layers share one pool of pages; give one k_scale and "
                f"one v_scale for every layer, or scales='page', got {kv_format}"
            )
        self.pool = PagedKVCache(
            num_layers=1,
            num_pages=num_layers * num_pages,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            kv_format=kv_format,
        )
        self._lanes: dict[int, list[int]] = {}  # sequence -> the inner sequence of each layer
        self._next_id = 0
        self.last_copies: tuple[PageCopy, ...] = ()  # as `PagedKVCache.last_copies`, with each copy's layer

    @classmethod
    def for_model(cls, model, *, num_pages: int, page_size: int, kv_format=None) -> LayeredKVCache:
        """A cache shaped for a transformers model, like `PagedKVCache.for_model`."""
        return cls(num_pages=num_pages, page_size=page_size, kv_format=kv_format, **model_geometry(model).cache_kwargs)

    prefix_caching = False  # full pages are not shared by token ids here (forks share pages)

    # ----------------------------------------------------------------- geometry
    page_size = property(lambda self: self.pool.page_size)
    num_kv_heads = property(lambda self: self.pool.num_kv_heads)
    head_dim = property(lambda self: self.pool.head_dim)
    dtype = property(lambda self: self.pool.dtype)
    device = property(lambda self: self.pool.device)
    allocator = property(lambda self: self.pool.allocator)
    kv_format = property(lambda self: self.pool.kv_format)

    def kv_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pool's 8-bit page scales, which every layer reads (`PagedKVCache.kv_scales`), or ``(None, None)``."""
        check_layer(layer, self.num_layers)
        return self.pool.kv_scales(0)

    @property
    def k_cache(self) -> list[torch.Tensor]:
        """Layer ``i``'s K pool: the one shared ``[num_layers * num_pages, page_size, Hkv, D]`` tensor."""
        return self.pool.k_cache * self.num_layers

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return self.pool.v_cache * self.num_layers

    @property
    def geometry(self) -> KVGeometry:
        """The geometry of the layers this cache serves: the pool's, with ``num_layers`` layers."""
        return replace(self.pool.geometry, num_layers=self.num_layers)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in every layer (a sequence holds ``len(pages(s))`` of them)."""
        return self.pool.page_bytes * self.num_layers

    # ----------------------------------------------------------------- inspection
    @property
    def seq_ids(self) -> list[int]:
        return list(self._lanes)

    def seq_len(self, seq_id: int) -> int:
        """Tokens each layer of the sequence holds (the same number in every layer)."""
        return self.pool.seq_len(self._lane(seq_id, 0))

    def pages(self, seq_id: int, layer: int = 0) -> list[int]:
        """Layer ``layer``'s layer pages, in logical order (every layer holds as many)."""
        return self.pool.pages(self._lane(seq_id, layer))

    def block_table(self, seq_ids=None, device=None, *, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(block_table int32 [batch, max_pages], seq_lens int32 [batch])``."""
        seq_ids = self.seq_ids if seq_ids is None else check_list("seq_ids", seq_ids, "sequence ids")
        layer = check_layer(layer, self.num_layers)
        return self.pool.block_table([self._lane(s, layer) for s in seq_ids], device=device)

    tables_per_layer = True  # each layer reads its own block table (`paged_ref.cache_interface`)

    def layer_slots(self, slots: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer``'s row of ``reserve``'s ``[num_layers, num_new]`` slots."""
        return slots[layer]

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V of the sequence, each ``[seq_len, num_kv_heads, head_dim]``."""
        return self.pool.gather(0, self._lane(seq_id, layer))

    # ----------------------------------------------------------------- growth and eviction
    def add_sequence(self, token_ids=None, *, namespace: dict | None = None) -> int:
        """Start a new, empty sequence (``token_ids`` and ``namespace`` are checked as
        `PagedKVCache.add_sequence` checks them, and unused: no prefix caching here)."""
        first = self.pool.add_sequence(token_ids, namespace=namespace)  # raises, creating nothing, on bad input
        return self._new([first] + [self.pool.add_sequence() for _ in range(self.num_layers - 1)])

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every layer's pages of ``seq_id`` (copy-on-write later)."""
        return self._new([self.pool.fork(lane) for lane in self._lanes_of(seq_id)])

    def _new(self, lanes: list[int]) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self._lanes[seq_id] = lanes
        return seq_id

    def reserve(self, seq_id: int, num_tokens: int) -> torch.Tensor:
        """Grow every layer by ``num_tokens``; returns ``int64 [num_layers, num_tokens]`` slots. All
        or nothing (OutOfPagesError, nothing changed, when the pool is short)."""
        return self.reserve_batch([seq_id], [check_int("num_tokens", num_tokens, min_value=1)])[0]

    def reserve_batch(self, seq_ids, num_tokens, token_ids=None) -> list[torch.Tensor]:
        """`reserve` for several sequences at once, all or nothing (`PagedKVCache.reserve_batch`);
        returns each one's ``int64 [num_layers, num_tokens[i]]`` slots. ``token_ids`` is unused."""
        seq_ids, num_tokens, _ = batch_lists(seq_ids, num_tokens, None)
        lanes = [lane for s in seq_ids for lane in self._lanes_of(s)]
        counts = [
            check_int(f"num_tokens[{i}]", n, min_value=1)
            for i, n in enumerate(num_tokens)
            for _ in range(self.num_layers)
        ]
        slots = self.pool.reserve_batch(lanes, counts)
        self.last_copies = self._layer_copies(self.pool.last_copies)
        return [torch.stack(slots[i : i + self.num_layers]) for i in range(0, len(slots), self.num_layers)]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Remove the last ``num_tokens`` tokens from every layer, the inverse of `reserve`: all or
        nothing when a layer's shared last kept page must be copied."""
        lanes = self._lanes_of(seq_id)
        num_tokens = check_int("num_tokens", num_tokens, min_value=0)
        if num_tokens > self.seq_len(seq_id):
            raise ValueError(
                f"num_tokens must be <= seq_len={self.seq_len(seq_id)} for sequence {seq_id}, got {num_tokens}"
            )
        if num_tokens == 0:
            self.last_copies = ()
            return
        # Layers that only give pages back go first, then the copying ones, those giving back most
        # first: each then finds its copy's page free whenever the totals allow.
        refcount, ps = self.allocator.refcount, self.page_size
        cost = {
            lane: truncate_cost(self.pool.pages(lane), self.pool.seq_len(lane), num_tokens, refcount, page_size=ps)
            for lane in lanes
        }
        copies, released = sum(c for c, _ in cost.values()), sum(r for _, r in cost.values())
        if copies > self.allocator.num_free + released:
            raise OutOfPagesError(copies - released, self.allocator.num_free)
        copied = []
        for lane in sorted(lanes, key=lambda lane: (cost[lane][0], -cost[lane][1])):
            self.pool.truncate(lane, num_tokens)
            copied += self.pool.last_copies
        self.last_copies = self._layer_copies(copied)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> None:
        """Store layer ``layer``'s ``k, v: [num_tokens, Hkv, D]`` at its ``slots`` (a row of `reserve`'s)."""
        check_layer(layer, self.num_layers)
        self.pool.write(0, slots, k, v, **options)

    def compact(self, seq_id: int, keep: torch.Tensor) -> None:
        """Keep, in each layer ``i``, the tokens where ``keep[i]`` is True (``bool [num_layers, seq_len]``),
        as many in every layer."""
        lanes = self._lanes_of(seq_id)
        n = self.seq_len(seq_id)
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or tuple(keep.shape) != (len(lanes), n):
            raise ValueError(
                f"keep must be a bool tensor of shape [num_layers, seq_len] = [{len(lanes)}, {n}], got {describe(keep)}"
            )
        counts = keep.sum(1)
        if not bool((counts == counts[0]).all()):
            raise ValueError(f"every layer must keep the same number of tokens, got {counts.tolist()}")
        # every layer copies its shared pages before giving any page back: count all copies first
        n_keep, refcount = int(counts[0]), self.allocator.refcount
        copies = sum(
            len(compact_copies(self.pool.pages(lane), n_keep, refcount, page_size=self.page_size)) for lane in lanes
        )
        if copies > self.allocator.num_free:
            raise OutOfPagesError(copies, self.allocator.num_free)
        copied = []
        for lane, row in zip(lanes, keep):
            self.pool.compact(lane, row)
            copied += self.pool.last_copies
        self.last_copies = self._layer_copies(copied)

    def drop_pages(self, seq_id: int, logical_pages) -> None:
        """Drop logical page ``logical_pages[i]`` from layer ``i``: all full pages, or all the same page."""
        lanes = self._lanes_of(seq_id)
        logical_pages = check_list("logical_pages", logical_pages, "logical page indices")
        pages = [check_int("logical_pages[i]", p, min_value=0) for p in logical_pages]
        if len(pages) != len(lanes):
            raise ValueError(f"logical_pages must name one page per layer ({len(lanes)}), got {len(pages)}")
        n, ps = self.seq_len(seq_id), self.page_size
        partial = n // ps  # the one logical page that may hold fewer than page_size tokens
        if n % ps and any(p == partial for p in pages) and len(set(pages)) > 1:
            raise ValueError(f"dropping the partial page {partial} in some layers only would make the layers differ")
        held = pages_needed(n, ps)
        if max(pages) >= held:
            raise ValueError(f"logical_pages must be in [0, {held}) for sequence {seq_id}, got {max(pages)}")
        for lane, page in zip(lanes, pages):
            self.pool.drop_pages(lane, [page])

    def free(self, seq_id: int) -> None:
        for lane in self._lanes_of(seq_id):
            self.pool.free(lane)
        del self._lanes[seq_id]

    # ----------------------------------------------------------------- rewind after a failed forward
    def mark(self, seq_id: int) -> tuple[SequenceMark, ...]:
        """Every layer of the sequence as it is now, for `rewind` (`PagedKVCache.mark`)."""
        return tuple(self.pool.mark(lane) for lane in self._lanes_of(seq_id))

    def rewind(self, seq_id: int, mark: tuple[SequenceMark, ...]) -> None:
        """Put every layer of the sequence back as `mark` saw it, last layer first
        (`PagedKVCache.rewind`). Clears ``last_copies``."""
        lanes = self._lanes_of(seq_id)
        if not isinstance(mark, tuple) or [m.seq_id if isinstance(m, SequenceMark) else None for m in mark] != lanes:
            raise ValueError(f"mark must be the tuple mark({seq_id}) returned, got {type(mark).__name__}")
        for layer, (lane, lane_mark) in enumerate(zip(lanes, mark)):  # every layer's checked before any is rewound
            marked_sequence(self.pool, lane, lane_mark, f"sequence {seq_id} (layer {layer})")
        for lane, lane_mark in reversed(list(zip(lanes, mark))):
            self.pool.rewind(lane, lane_mark)
        self.last_copies = ()

    # ----------------------------------------------------------------- internals
    def _layer_copies(self, copies) -> tuple[PageCopy, ...]:
        """The pool's copies (one per lane) as this cache's: the sequence and the layer of each lane."""
        owner = {lane: (s, layer) for s, lanes in self._lanes.items() for layer, lane in enumerate(lanes)}
        return tuple(replace(c, seq_id=owner[c.seq_id][0], layer=owner[c.seq_id][1]) for c in copies)

    def _lanes_of(self, seq_id) -> list[int]:
        if not is_int(seq_id) or seq_id not in self._lanes:
            raise ValueError(f"seq_id {seq_id!r} is not a live sequence of this cache (live: {self.seq_ids})")
        return self._lanes[seq_id]

    def _lane(self, seq_id, layer) -> int:
        return self._lanes_of(seq_id)[check_layer(layer, self.num_layers)]
