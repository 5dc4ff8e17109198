"""PagedKVCache: per-layer K/V page tensors plus per-sequence block tables.

``k_cache[layer], v_cache[layer]: [num_pages, page_size, num_kv_heads, head_dim]`` (vLLM's and
FlashAttention's layout); a page id names the same page in every layer, so one block table per
sequence serves them all. ``slots = reserve(seq_id, n)`` grows a sequence and returns each new
token's flat slot ``page * page_size + offset``; ``write(layer, slots, k, v)`` stores a layer there.

Every operation counts the pages it needs first and raises `OutOfPagesError` with the cache as it
was. ``fork`` shares pages (reference counts); the first write into a shared page copies it, in
``reserve``, which lists the copies in ``last_copies``. With ``prefix_caching=True``,
``add_sequence(token_ids=prompt)`` reuses cached full pages (`paged_ref.prefix_cache`). A slot that
holds no token is zero, so a kernel reading past a sequence's end adds ``0 * v``, never stale ``nan``.
``mark`` / ``rewind`` undo a failed forward, ``checkpoint`` / ``rollback`` a serving step
(`paged_ref.cache_undo`). ``watchers`` are told of every change to the keys a page holds (with
``page_summaries=True``, Quest's key min/max: `paged_ref.page_summaries`); ``growth="pow2"``
reserves power-of-two page counts (the IBM paper's growth). With ``kv_format`` (`paged_ref.quant.KVFormat`)
the pages hold K and V in 8 bits and their scales (`paged_ref.kv_pages`); ``dtype`` stays what ``gather`` returns.

Example:
    >>> cache = PagedKVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)
    >>> s = cache.add_sequence()
    >>> slots = cache.reserve(s, 6)                  # 6 tokens -> 2 pages
    >>> k = v = torch.arange(12.).view(6, 1, 2)      # [num_tokens, num_kv_heads, head_dim]
    >>> for layer in range(2): cache.write(layer, slots, k, v)
    >>> bool((cache.gather(0, s)[0] == k).all()), cache.pages(s)
    (True, [0, 1])
    >>> cache.free(s); cache.allocator.num_free
    8
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ._arith import cdiv
from ._cache_checks import batch_lists, check_device, check_layer, check_pool, check_write, growth_request, token_list
from ._validate import INT32_MAX, check_bool, check_choice, check_int, check_list, describe, is_int
from .allocator import OutOfPagesError, PageAllocator
from .block_table import flat_slots, pack_csr, pack_padded
from .cache_undo import Undo
from .kv_pages import QuantPages, raw
from .memory import KVGeometry, model_geometry
from .page_plan import compact_copies, plan_growth, round_to_pow2, truncate_cost
from .page_summaries import PageSummaries
from .prefix_cache import PrefixIndex, namespace_key, page_key
from .quant import kv_format as as_kv_format


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)  # physical page of each logical page (may reserve ahead)
    length: int = 0  # tokens held
    token_ids: list[int] | None = field(default_factory=list)  # for prefix hashing; None = unknown
    page_hashes: list[bytes] = field(default_factory=list)  # chained key of each full page
    root: bytes = b""  # key the chain starts from: the cache's namespace and the sequence's own


@dataclass(frozen=True)
class PageCopy:
    """One copy-on-write: ``seq_id``'s ``logical_page`` moved from the shared page ``source`` to its
    private copy ``page`` (``layer``: a `~paged_ref.layered_cache.LayeredKVCache`'s layer, else None)."""

    seq_id: int
    logical_page: int
    source: int
    page: int
    layer: int | None = None


class PagedKVCache(Undo):
    """A paged KV cache for ``num_layers`` layers sharing one page pool and block tables; `mark`, `rewind`,
    `checkpoint`, `commit` and `rollback` undo its changes (`paged_ref.cache_undo.Undo`)."""

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
        growth: str = "page",
        prefix_caching: bool = False,
        prefix_namespace: dict | None = None,
        page_summaries: bool = False,
        kv_format=None,
    ):
        self.num_layers = check_int("num_layers", num_layers, min_value=1)
        self.num_pages = check_int("num_pages", num_pages, min_value=1, max_value=INT32_MAX + 1)  # page ids: int32
        self.page_size = check_int("page_size", page_size, min_value=1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, min_value=1)
        self.head_dim = check_int("head_dim", head_dim, min_value=1)
        self.dtype = check_pool(self, dtype)
        self.growth = check_choice("growth", growth, {"page", "pow2"})
        self.prefix_caching = check_bool("prefix_caching", prefix_caching)
        self._prefix_root = namespace_key(prefix_namespace)
        self.device = check_device(device)
        self.kv_format = as_kv_format(kv_format)  # None: pages in ``dtype``; else 8-bit (`paged_ref.kv_pages`)
        stored = dtype if self.kv_format is None else self.kv_format.dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=stored, device=self.device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=stored, device=self.device) for _ in range(num_layers)]
        pool = dict(num_layers=num_layers, num_pages=num_pages, num_kv_heads=num_kv_heads, device=self.device)
        self.quant = None if self.kv_format is None else QuantPages(self.kv_format, **pool)
        self.allocator = PageAllocator(num_pages)
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self._prefix = PrefixIndex(page_size=self.page_size)
        self.prefix_hits = 0  # full pages reused from the prefix cache
        # the `PageCopy`s of the latest reserve, reserve_batch, truncate or compact (rewind clears it)
        self.last_copies: tuple[PageCopy, ...] = ()
        self._checkpoint = None  # a `paged_ref.cache_undo.Checkpoint` while a step may still be undone
        check_bool("page_summaries", page_summaries)
        # min / max of each page's keys for Quest (`paged_ref.page_summaries`); None: not kept
        pool = dict(num_pages=num_pages, page_size=page_size, dtype=dtype, device=self.device)
        self.summaries = PageSummaries(**pool, **self.geometry.kv_shape) if page_summaries else None
        self.watchers = [] if self.summaries is None else [self.summaries]  # told of key changes: `_tell`

    @classmethod
    def for_model(cls, model, *, num_pages: int, page_size: int, **options) -> PagedKVCache:
        """A cache shaped for a transformers model (layers, KV heads, head_dim, dtype, device);
        ``options``: the other keyword arguments."""
        return cls(num_pages=num_pages, page_size=page_size, **model_geometry(model).cache_kwargs, **options)

    @property
    def geometry(self) -> KVGeometry:
        """This cache's :class:`~paged_ref.memory.KVGeometry` (no query-head count: the cache has none)."""
        shape = dict(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        return KVGeometry(**shape, dtype=self.dtype, device=self.device)

    # ----------------------------------------------------------------- inspection
    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def seq_len(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def pages(self, seq_id: int) -> list[int]:
        """Physical pages the sequence holds, in logical order (including any reserved ahead)."""
        return list(self._seq(seq_id).pages)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across K and V of all layers (8-bit: one per value, plus the page's scales)."""
        return self.page_size * self.geometry.bytes_per_token if self.quant is None else self.quant.page_bytes(self)

    def kv_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """8-bit pages: ``(k_scale, v_scale)`` of ``layer``, float32 ``[num_pages, num_kv_heads]`` each (what
        attention backends take); floating pages: ``(None, None)``."""
        layer = check_layer(layer, self.num_layers)
        return (None, None) if self.quant is None else (self.quant.k_scales[layer], self.quant.v_scales[layer])

    tables_per_layer = False  # one block table serves every layer (`paged_ref.cache_interface`)

    def block_table(self, seq_ids=None, device=None, *, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table int32 [batch, max_pages], seq_lens int32 [batch])`` for ``seq_ids`` (default all),
        the same for every ``layer``: the pages that hold tokens, padded with 0."""
        check_layer(layer, self.num_layers)
        seqs = [self._seq(s) for s in self._batch(seq_ids)]
        tables = [s.pages[: cdiv(s.length, self.page_size)] for s in seqs]  # well formed: no re-check
        return pack_padded(tables, [s.length for s in seqs], device=self.device if device is None else device)

    def csr(self, seq_ids=None, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's ``(kv_indptr, kv_indices, kv_last_page_len)`` for ``seq_ids``."""
        seqs = [self._seq(s) for s in self._batch(seq_ids)]
        device = self.device if device is None else device  # device=0 is cuda:0
        return pack_csr([s.pages for s in seqs], [s.length for s in seqs], page_size=self.page_size, device=device)

    # ----------------------------------------------------------------- growth
    def add_sequence(self, token_ids=None, *, namespace: dict | None = None) -> int:
        """Start a new sequence and return its id. With ``prefix_caching`` and ``token_ids`` (the prompt) it
        starts holding the prompt's cached full pages, leaving at least the last token to compute.
        ``namespace`` (str -> str, e.g. ``{"adapter": "lora-7"}``) adds fields to ``prefix_namespace``:
        sequences whose K/V differ for equal tokens never share pages."""
        root = self._prefix_root
        if namespace is not None:
            key = namespace_key(namespace, parent=root, name="namespace")  # checks it
            root = key if namespace else root  # {} adds no field: the same as no namespace
        seq = _Sequence(root=root)
        if token_ids is not None:
            token_ids = token_list("token_ids", token_ids)
        if self.prefix_caching and token_ids is not None:
            self._match_prefix(seq, token_ids)
        seq_id = self._next_id
        self._next_id += 1
        self._seqs[seq_id] = seq
        return seq_id

    def cached_prefix(self, token_ids) -> list[int]:
        """The pages ``add_sequence(token_ids)`` would reuse, taking nothing (what admission asks first);
        those with ``allocator.refcount(page) == 0`` would come back from the pool."""
        token_ids = token_list("token_ids", token_ids)
        return [page for page, _ in self._prefix.match(self._prefix_root, token_ids)] if self.prefix_caching else []

    def reserve(self, seq_id: int, num_tokens: int, token_ids=None) -> torch.Tensor:
        """Grow ``seq_id`` by ``num_tokens`` and return their flat slots, ``int64 [num_tokens]``, all or
        nothing; a shared page the tokens land in is copied first. ``token_ids`` feed prefix caching.

        Example:
            >>> kv = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
            >>> a = kv.add_sequence(); _ = kv.reserve(a, 6)        # pages [0, 1]: 4 + 2 tokens
            >>> b = kv.fork(a)                                      # shares both pages
            >>> _ = kv.reserve(b, 1)                                # lands in shared page 1: copied
            >>> kv.last_copies
            (PageCopy(seq_id=1, logical_page=1, source=1, page=2, layer=None),)
            >>> kv.pages(a), kv.pages(b)
            ([0, 1], [0, 2])
        """
        self._seq(seq_id)
        return self._reserve([(seq_id, *growth_request(num_tokens, token_ids))])[0]

    def reserve_batch(self, seq_ids, num_tokens, token_ids=None) -> list[torch.Tensor]:
        """`reserve` for several sequences, all or nothing: the pages the whole batch needs (new pages,
        copies) are counted before any is taken. ``token_ids``: None, or one entry (None or ints) per sequence."""
        seq_ids, num_tokens, token_ids = batch_lists(seq_ids, num_tokens, token_ids)
        for s in seq_ids:
            self._seq(s)
        requests = [
            (s, *growth_request(n, ids, f"[{i}]")) for i, (s, n, ids) in enumerate(zip(seq_ids, num_tokens, token_ids))
        ]
        return self._reserve(requests)

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, check_values: bool = True
    ) -> None:
        """Store ``k, v: [num_tokens, num_kv_heads, head_dim]`` of ``layer`` at ``slots``. ``check_values`` also
        checks the slots lie in pages this cache handed out unshared (a host sync on a GPU: check once, at
        layer 0); a page published when reserved and shared since may be written until its last layer is."""
        layer = check_write(self, layer, slots, k, v, check_values, filling=self._prefix.unwritten)
        slots = slots.to(device=self.device, dtype=torch.int64)
        if self.quant is not None:  # quantized, the pages' scales grown first (it saves what it changes)
            self.quant.write(self, layer, slots, k, v)
            k = self.quant.read(self, layer, slots)[0] if self.watchers else k  # the keys as stored
        else:
            self._saving((layer,), slots)
            self.k_cache[layer].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
            self.v_cache[layer].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)
        self._tell("update", layer, slots, k)
        if self._prefix.unwritten and layer == self.num_layers - 1 and slots.numel():
            self._prefix.written(torch.unique(slots // self.page_size).tolist())

    def written(self, seq_id: int) -> None:
        """Take ``seq_id``'s pages as written in every layer, as a write of the last layer does (a dry run's)."""
        self._prefix.written(self._seq(seq_id).pages)

    def last_slots(self, seq_id: int, num_tokens: int) -> torch.Tensor:
        """The flat slots of the sequence's last ``num_tokens`` tokens, ``int64 [num_tokens]``: where a
        forward writes the tokens a scheduler reserved."""
        seq = self._seq(seq_id)
        if check_int("num_tokens", num_tokens, min_value=0) > seq.length:
            raise ValueError(f"num_tokens must be <= seq_len={seq.length} for sequence {seq_id}, got {num_tokens}")
        return flat_slots(seq.pages, seq.length - num_tokens, num_tokens, self.page_size).to(self.device)

    def layer_slots(self, slots: torch.Tensor, layer: int) -> torch.Tensor:
        """The slots ``layer`` writes out of ``reserve``'s: the same ones in every layer."""
        return slots

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V of ``layer`` as contiguous ``[seq_len, num_kv_heads, head_dim]``."""
        seq = self._seq(seq_id)
        layer = check_layer(layer, self.num_layers)
        return self._read(layer, flat_slots(seq.pages, 0, seq.length, self.page_size).to(self.device))

    # ----------------------------------------------------------------- sharing and release
    def fork(self, seq_id: int) -> int:
        """A new sequence sharing ``seq_id``'s pages; a write into a shared page copies it first (`reserve`)."""
        src = self._seq(seq_id)
        held = src.pages[: cdiv(src.length, self.page_size)]
        self.allocator.share(held)
        new_id = self._next_id
        self._next_id += 1
        token_ids = None if src.token_ids is None else list(src.token_ids)
        self._seqs[new_id] = replace(src, pages=list(held), token_ids=token_ids, page_hashes=list(src.page_hashes))
        return new_id

    def free(self, seq_id: int) -> None:
        """Release the sequence: one reference dropped from each of its pages (tail first)."""
        self._release(self._seq(seq_id).pages)
        del self._seqs[seq_id]

    def drop_pages(self, seq_id: int, logical_pages) -> None:
        """Remove whole logical pages from a sequence (eviction); they go back to the pool and the
        sequence stops taking part in prefix caching."""
        seq = self._seq(seq_id)
        held = cdiv(seq.length, self.page_size)
        logical_pages = check_list("logical_pages", logical_pages, "logical page indices")
        drop = sorted({check_int("logical_pages[i]", i, min_value=0) for i in logical_pages})
        if drop and drop[-1] >= held:
            raise ValueError(f"logical_pages must be in [0, {held}) for sequence {seq_id}, got {drop[-1]}")
        self._release([seq.pages[i] for i in drop])
        seq.length -= sum(min(self.page_size, seq.length - i * self.page_size) for i in drop)
        seq.pages = [p for i, p in enumerate(seq.pages) if i not in drop]
        seq.token_ids, seq.page_hashes = None, []

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Remove the last ``num_tokens`` tokens of a sequence, the inverse of `reserve`: pages left empty go
        back, the vacated slots of the last kept page become zero (copied first if shared: `OutOfPagesError`,
        nothing changed, when no page is free). Full pages kept stay cached."""
        seq = self._seq(seq_id)
        num_tokens = check_int("num_tokens", num_tokens, min_value=0)
        if num_tokens > seq.length:
            raise ValueError(f"num_tokens must be <= seq_len={seq.length} for sequence {seq_id}, got {num_tokens}")
        if num_tokens == 0:
            self.last_copies = ()
            return
        ps = self.page_size
        new_len = seq.length - num_tokens
        need = cdiv(new_len, ps)
        copy, released = truncate_cost(seq.pages, seq.length, num_tokens, self.allocator.refcount, page_size=ps)
        if copy and not self.allocator.can_allocate(1) and not released:
            raise OutOfPagesError(1, self.allocator.num_free)
        self._release(seq.pages[need:])
        seq.pages = seq.pages[:need]
        copies = self._copy_on_write(seq_id, [need - 1], self._allocate(1)) if copy else []  # shared, partly kept
        if new_len % ps:  # the last kept page loses slots
            self._prefix.forget(seq.pages[-1])
            start = (need - 1) * ps + new_len % ps
            self._zero_slots(flat_slots(seq.pages, start, need * ps - start, ps).to(self.device))
        seq.length = new_len
        if seq.token_ids is not None:
            seq.token_ids = seq.token_ids[:new_len]
            seq.page_hashes = seq.page_hashes[: new_len // ps]
        self.last_copies = tuple(copies)

    def compact(self, seq_id: int, keep: torch.Tensor) -> None:
        """Keep only the tokens where ``keep: bool [seq_len]`` is True, packed in order in every layer
        (token-level eviction); shared pages that receive tokens are copied first, pages no longer needed
        go back, and the sequence stops taking part in prefix caching."""
        seq = self._seq(seq_id)
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or tuple(keep.shape) != (seq.length,):
            raise ValueError(f"keep must be a bool tensor of shape [seq_len] = [{seq.length}], got {describe(keep)}")
        n_keep = int(keep.sum())
        need = cdiv(n_keep, self.page_size)
        shared = compact_copies(seq.pages, n_keep, self.allocator.refcount, page_size=self.page_size)
        copies = self._copy_on_write(seq_id, shared, self._allocate(len(shared)))  # OutOfPagesError before any change
        for page in seq.pages[:need]:
            self._prefix.forget(page)
        all_slots = flat_slots(seq.pages, 0, seq.length, self.page_size)
        src = all_slots[keep.cpu()].to(self.device)
        dst = all_slots[:n_keep].to(self.device)
        flat = (-1, self.num_kv_heads, self.head_dim)
        if self.quant is not None:  # 8-bit: each moved token under its new page's scale
            self.quant.move(self, src, dst)
        else:
            self._saving(range(self.num_layers), dst)
            for cache in (*self.k_cache, *self.v_cache):
                view = cache.view(flat)
                view.index_copy_(0, dst, view[src])  # view[src] is a copy taken before the writes
        self._release(seq.pages[need:])
        seq.pages = seq.pages[:need]
        seq.length = n_keep
        if n_keep % self.page_size:  # vacated slots of the last kept page: back to zeros
            self._zero_slots(all_slots[n_keep : need * self.page_size].to(self.device))
        if self.watchers:  # the packed pages hold these keys now
            self._tell("clear", seq.pages)
            for layer in range(self.num_layers):
                self._tell("update", layer, dst, self._read(layer, dst)[0])
        seq.token_ids, seq.page_hashes = None, []
        self.last_copies = tuple(copies)

    # ----------------------------------------------------------------- internals
    def _seq(self, seq_id) -> _Sequence:
        if not is_int(seq_id) or seq_id not in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is not a live sequence of this cache (live: {sorted(self._seqs)})")
        return self._seqs[seq_id]

    def _batch(self, seq_ids):
        return list(self._seqs) if seq_ids is None else check_list("seq_ids", seq_ids, "sequence ids")

    def _reserve(self, requests: list[tuple[int, int, list[int] | None]]) -> list[torch.Tensor]:
        """Grow each ``(seq_id, num_tokens, token_ids)`` in order, all or nothing: plan the pages
        (copies of shared pages, new pages), check the pool holds them, then change the sequences."""
        seqs = [self._seqs[s] for s, _, _ in requests]
        refcount = self.allocator.refcount
        plans = plan_growth(
            [(seq.pages, seq.length, n) for seq, (_, n, _) in zip(seqs, requests)], refcount, page_size=self.page_size
        )
        total = sum(len(copies) + grow for copies, grow in plans)
        if total > self.allocator.num_free:
            raise OutOfPagesError(total, self.allocator.num_free)
        if self.growth == "pow2":
            round_to_pow2(plans, [len(seq.pages) for seq in seqs], spare=self.allocator.num_free - total)
        slots, copied = [], []
        for (copies, grow), seq, (seq_id, n, token_ids) in zip(plans, seqs, requests):
            new_pages = self._allocate(grow + len(copies))
            copied += self._copy_on_write(seq_id, copies, new_pages[grow:])
            seq.pages.extend(new_pages[:grow])
            slots.append(flat_slots(seq.pages, seq.length, n, self.page_size).to(self.device))
            seq.length += n
            self._publish_full_pages(seq, token_ids)
        self.last_copies = tuple(copied)
        return slots

    def _read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at flat ``slots``, each ``[n, Hkv, D]`` in ``dtype`` (8-bit pages: their values)."""
        if self.quant is not None:
            return self.quant.read(self, layer, slots)
        flat = (-1, self.num_kv_heads, self.head_dim)
        return self.k_cache[layer].view(flat)[slots], self.v_cache[layer].view(flat)[slots]

    def _tell(self, event: str, *args) -> None:
        """The one hook the watchers of the pages' keys hang on: ``update(layer, slots, k)`` after keys are
        written, ``clear(pages)`` when pages start empty again, ``copy(src, dst)`` after a copy-on-write."""
        for watcher in self.watchers:
            getattr(watcher, event)(*args)

    def _allocate(self, n: int) -> list[int]:
        """Take ``n`` pages from the pool, all zero (a recycled cached page is zeroed here)."""
        pages = self.allocator.allocate(n) if n else []
        cached = [p for p in pages if p in self._prefix]  # the only free pages with data
        for page in pages:  # handed out again: whatever prefix it cached is gone
            self._prefix.forget(page)
        self._zero_pages(cached)
        self._tell("clear", pages)
        return pages

    def _release(self, pages: list[int]) -> None:
        """Drop one reference per page, tail first; pages with a cached prefix are reused last."""
        for page in self._prefix.unwritten.intersection(pages):  # its last holder goes: no forward will write it
            if self.allocator.refcount(page) == 1:
                self._prefix.forget(page)
        tail_first = pages[::-1]
        self.allocator.free(tail_first, cached=[p for p in tail_first if p in self._prefix])
        plain = [p for p in set(pages) if self.allocator.refcount(p) == 0 and p not in self._prefix]
        self._zero_pages(plain)  # a freed page keeps no K/V of its last owner

    def _zero_pages(self, pages: list[int]) -> None:
        if pages:
            index = torch.tensor(pages, device=self.device)  # int64 [n]
            if self._checkpoint is not None:
                self._saving(range(self.num_layers), flat_slots(pages, 0, len(pages) * self.page_size, self.page_size))
            for cache in (*self.k_cache, *self.v_cache):
                raw(cache).index_fill_(0, index, 0)
            if self.quant is not None:
                self.quant.zero(index)  # an empty page's scale is 0

    def _zero_slots(self, slots: torch.Tensor) -> None:
        flat = (-1, self.num_kv_heads, self.head_dim)
        self._saving(range(self.num_layers), slots)
        for cache in (*self.k_cache, *self.v_cache):
            raw(cache).view(flat).index_fill_(0, slots, 0)

    def _copy_on_write(self, seq_id: int, indices: list[int], new_pages: list[int]) -> list[PageCopy]:
        """Give the sequence private copies of its shared pages at ``indices``, into ``new_pages``."""
        seq, copies = self._seqs[seq_id], []
        for i, page in zip(indices, new_pages):
            copies.append(PageCopy(seq_id, i, seq.pages[i], page))
            if self._checkpoint is not None:
                self._saving(range(self.num_layers), flat_slots([page], 0, self.page_size, self.page_size))
            for cache in (*self.k_cache, *self.v_cache):
                cache[page].copy_(cache[seq.pages[i]])
            if self.quant is not None:
                self.quant.copy(seq.pages[i], page)  # the scale travels with the page
            self._tell("copy", seq.pages[i], page)
            self.allocator.free([seq.pages[i]])  # drops this sequence's reference only
            seq.pages[i] = page
        return copies

    def _match_prefix(self, seq: _Sequence, token_ids: list[int]) -> None:
        """Start ``seq`` with the cached full pages of its prompt, sharing or reviving each."""
        for page, key in self._prefix.match(seq.root, token_ids):
            if self.allocator.refcount(page) > 0:
                self.allocator.share([page])
            else:
                self.allocator.take(page)  # returned to the pool but not yet reused: revive it
            seq.pages.append(page)
            seq.page_hashes.append(key)
        seq.length = len(seq.pages) * self.page_size
        seq.token_ids = token_ids[: seq.length]
        self.prefix_hits += len(seq.pages)

    def _publish_full_pages(self, seq: _Sequence, token_ids) -> None:
        """Key the pages ``seq`` filled and publish them in the prefix index."""
        if not self.prefix_caching or seq.token_ids is None:
            return
        if token_ids is None:  # tokens unknown from here on: stop hashing this sequence
            seq.token_ids, seq.page_hashes = None, []
            return
        seq.token_ids.extend(token_ids)
        ps = self.page_size
        for i in range(len(seq.page_hashes), seq.length // ps):
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            key = page_key(seq.page_hashes[-1] if seq.page_hashes else seq.root, tokens)
            seq.page_hashes.append(key)
            self._prefix.publish(seq.pages[i], key, tokens)
