"""PagedKVCache: per-layer K/V page tensors plus per-sequence block tables.

Storage is one pair of tensors per layer in the layout vLLM's and FlashAttention's paged
kernels read::

    k_cache[layer], v_cache[layer]: [num_pages, page_size, num_kv_heads, head_dim]

A physical page id indexes the same page in every layer, so one block table per sequence
serves all layers (as in vLLM). Writing a sequence's tokens is two steps:
``slots = reserve(seq_id, n)`` grows the sequence (allocating pages as needed) and returns
each new token's flat slot ``page * page_size + offset``; then ``write(layer, slots, k, v)``
stores that layer's K/V there. Every page of a sequence but the last is full.

All or nothing. Every operation counts the pages it needs before it changes anything and
raises `OutOfPagesError` (or a bad-argument error) with the cache as it was; ``reserve_batch``
grows a whole batch of sequences that way, as a model's forward needs.

Sharing. ``fork`` makes a second sequence that shares the first's pages (reference counts);
the first write into a shared page copies it (copy-on-write happens in ``reserve``, which is
where a write begins, so the slots it returns already point into the private copy). With
``prefix_caching=True`` each full page is identified by a SHA-256 key chained over the previous
page's key and its own token ids, rooted in an optional ``prefix_namespace`` (model, adapter, user
salt: tagged fields, so K/V computed by another model or adapter never matches), and a hit is
confirmed by comparing the token ids themselves; ``add_sequence(token_ids=prompt)`` reuses cached
full pages of the prompt (live ones are shared; returned ones that were not yet handed out again are revived)
and counts them in ``prefix_hits``. A page that ``reserve`` fills is offered for reuse only once
``write`` has stored its K/V in every layer, so a sequence added in between computes its own.
Freed pages go back tail first, and cached ones are reused last, least recently freed first.

Clean slots. Every slot that holds no token is zero: a page is zeroed when it is handed out
and when it returns to the pool holding no cached prefix, and ``compact`` zeroes the slots it
vacates. A kernel that reads more than a sequence's own tokens (FlexAttention reads whole
blocks; eager FlexAttention on CPU reads the whole cache) then adds ``0 * v`` there, never
``0 * nan`` left over from another sequence.

Growth. ``growth="page"`` takes one page at a time; ``growth="pow2"`` reserves so that a
sequence holds a power-of-two number of pages (what the IBM paper describes), falling back to
the exact need when the pool cannot give the power of two.

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

import hashlib
import numbers
from dataclasses import dataclass, field

import torch

from ._arith import next_pow2
from ._validate import check_choice, check_int, check_list, describe
from .allocator import OutOfPagesError, PageAllocator
from .block_table import pad_block_tables, pages_needed, slot_mapping, to_csr
from .memory import KVGeometry, model_geometry


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)  # physical page of each logical page (may reserve ahead)
    length: int = 0  # tokens held
    token_ids: list[int] | None = field(default_factory=list)  # for prefix hashing; None = unknown
    page_hashes: list[bytes] = field(default_factory=list)  # chained key of each full page
    root: bytes = b""  # key the chain starts from: the cache's namespace and the sequence's own


class PagedKVCache:
    """A paged KV cache for ``num_layers`` layers sharing one page pool and block tables."""

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
    ):
        self.num_layers = check_int("num_layers", num_layers, min_value=1)
        self.num_pages = check_int("num_pages", num_pages, min_value=1)
        self.page_size = check_int("page_size", page_size, min_value=1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, min_value=1)
        self.head_dim = check_int("head_dim", head_dim, min_value=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(
                f"dtype must be a floating torch.dtype (float32, float16, bfloat16, float64), got {dtype!r}"
            )
        self.growth = check_choice("growth", growth, {"page", "pow2"})
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        self.prefix_caching = prefix_caching
        self._prefix_root = _namespace_key(prefix_namespace)
        self.dtype = dtype
        self.device = torch.device(device)
        if self.device.type == "meta":
            raise ValueError("device must hold real memory (cpu, cuda, ...), got 'meta'")
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.allocator = PageAllocator(num_pages)
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self._prefix_index: dict[bytes, int] = {}  # page key -> physical page
        self._page_hash: dict[int, bytes] = {}  # physical page -> its key (reverse of the index)
        self._page_tokens: dict[int, tuple[int, ...]] = {}  # physical page -> its token ids
        # filled pages waiting for their K/V: page -> (key, token ids, layers written so far)
        self._pending: dict[int, tuple[bytes, tuple[int, ...], set[int]]] = {}
        self.prefix_hits = 0  # full pages reused from the prefix cache

    @classmethod
    def for_model(cls, model, *, num_pages: int, page_size: int, **options) -> PagedKVCache:
        """A cache shaped for a transformers model (its layers, KV heads, head_dim, dtype, device).

        ``options`` are the other keyword arguments (``growth``, ``prefix_caching``, ...).

        Example:
            >>> from paged_ref.models import tiny_llama
            >>> kv = PagedKVCache.for_model(tiny_llama(), num_pages=4, page_size=2)
            >>> kv.geometry.kv_shape
            {'num_layers': 2, 'num_kv_heads': 2, 'head_dim': 32}
        """
        return cls(num_pages=num_pages, page_size=page_size, **model_geometry(model).cache_kwargs, **options)

    @property
    def geometry(self) -> KVGeometry:
        """This cache's :class:`~paged_ref.memory.KVGeometry` (no query-head count: the cache has none)."""
        return KVGeometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

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
        """Bytes of one page across K and V of all layers."""
        return self.page_size * self.geometry.bytes_per_token

    def block_table(self, seq_ids=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table int32 [batch, max_pages], seq_lens int32 [batch])`` for ``seq_ids``.

        Lists the pages that hold tokens; padding entries are 0. Defaults to every sequence.
        """
        seqs = [self._seq(s) for s in self._batch(seq_ids)]
        tables = [s.pages[: pages_needed(s.length, self.page_size)] for s in seqs]
        return pad_block_tables(
            tables, [s.length for s in seqs], page_size=self.page_size, device=device or self.device
        )

    def csr(self, seq_ids=None, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's ``(kv_indptr, kv_indices, kv_last_page_len)`` for ``seq_ids``."""
        seqs = [self._seq(s) for s in self._batch(seq_ids)]
        return to_csr(
            [s.pages for s in seqs], [s.length for s in seqs], page_size=self.page_size, device=device or self.device
        )

    # ----------------------------------------------------------------- growth
    def add_sequence(self, token_ids=None, *, namespace: dict | None = None) -> int:
        """Start a new sequence and return its id.

        With ``prefix_caching`` and ``token_ids`` (the prompt), cached full pages of the prompt
        are reused and the sequence starts with ``seq_len(seq_id)`` tokens already held; at
        least the last prompt token is left for the caller to compute (it needs its logits).
        ``namespace`` (str -> str, e.g. ``{"adapter": "lora-7"}``) adds this sequence's own
        fields to the cache's ``prefix_namespace``: sequences whose K/V differ for equal tokens
        (another adapter, another user salt) never share pages. ``{}`` adds none (as None).
        """
        root = self._prefix_root
        if namespace is not None:
            key = _namespace_key(namespace, parent=root, name="namespace")  # checks it
            root = key if namespace else root  # {} adds no field: the same as no namespace
        seq = _Sequence(root=root)
        if token_ids is not None:
            token_ids = _token_list("token_ids", token_ids)
        if self.prefix_caching and token_ids is not None:
            self._match_prefix(seq, token_ids)
        seq_id = self._next_id
        self._next_id += 1
        self._seqs[seq_id] = seq
        return seq_id

    def reserve(self, seq_id: int, num_tokens: int, token_ids=None) -> torch.Tensor:
        """Grow ``seq_id`` by ``num_tokens`` and return their flat slots, ``int64 [num_tokens]``.

        Allocates pages as needed (all or nothing: raises OutOfPagesError and changes nothing
        when the pool is short) and copies any shared page the new tokens land in
        (copy-on-write). ``token_ids`` (``num_tokens`` ints) feed prefix caching.
        """
        seq = self._seq(seq_id)
        num_tokens = check_int("num_tokens", num_tokens, min_value=1)
        if token_ids is not None:
            token_ids = _token_list("token_ids", token_ids)
            if len(token_ids) != num_tokens:
                raise ValueError(f"token_ids must have num_tokens={num_tokens} entries, got {len(token_ids)}")
        return self._reserve([(seq, num_tokens, token_ids)])[0]

    def reserve_batch(self, seq_ids, num_tokens, token_ids=None) -> list[torch.Tensor]:
        """`reserve` for several sequences at once, all or nothing; returns each one's slots.

        The pages the whole batch needs (new pages, and copies of the shared pages its tokens
        land in) are counted before any is taken: when the pool is short, OutOfPagesError is
        raised and no sequence changes. With ``growth="pow2"`` a sequence gets its power of two
        only where the pages the rest of the batch needs stay free. ``token_ids``: None, or one
        entry (None or ``num_tokens[i]`` ints) per sequence.

        Example:
            >>> kv = PagedKVCache(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1, head_dim=2)
            >>> a, b = kv.add_sequence(), kv.add_sequence()
            >>> kv.reserve_batch([a, b], [3, 5])      # b needs 2 pages: 3 in all, 2 free
            Traceback (most recent call last):
            ...
            paged_ref.allocator.OutOfPagesError: requested 3 page(s) but only 2 of the pool are free
            >>> kv.seq_len(a), kv.allocator.num_free  # a was not grown either
            (0, 2)
        """
        seq_ids = check_list("seq_ids", seq_ids, "sequence ids")
        num_tokens = check_list("num_tokens", num_tokens, "token counts")
        token_ids = [None] * len(seq_ids) if token_ids is None else check_list("token_ids", token_ids, "token-id lists")
        if not len(seq_ids) == len(num_tokens) == len(token_ids):
            raise ValueError(
                f"seq_ids, num_tokens and token_ids must have one entry per sequence, got "
                f"{len(seq_ids)}, {len(num_tokens)} and {len(token_ids)}"
            )
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
        requests = []
        for i, (seq_id, n, ids) in enumerate(zip(seq_ids, num_tokens, token_ids)):
            seq = self._seq(seq_id)
            n = check_int(f"num_tokens[{i}]", n, min_value=1)
            if ids is not None:
                ids = _token_list(f"token_ids[{i}]", ids)
                if len(ids) != n:
                    raise ValueError(f"token_ids[{i}] must have num_tokens[{i}]={n} entries, got {len(ids)}")
            requests.append((seq, n, ids))
        return self._reserve(requests)

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, check_values: bool = True
    ) -> None:
        """Store ``k, v: [num_tokens, num_kv_heads, head_dim]`` of ``layer`` at ``slots``.

        ``check_values`` also checks that every slot is in range and lies in a page this cache
        handed out and nobody shares. That reads ``slots`` on the host (a device sync on a
        GPU); a caller writing the same slots into every layer can check them once, at layer 0.
        """
        layer = check_int("layer", layer, min_value=0)
        if layer >= self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"slots must be a 1-D int32/int64 tensor, got {describe(slots)}")
        expected = (slots.shape[0], self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"{name} must have shape [num_tokens, num_kv_heads, head_dim] = {list(expected)}, "
                    f"got {list(t.shape)}"
                )
            if t.dtype != self.dtype:
                raise TypeError(f"{name} must have the cache dtype {self.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on the cache device {self.device}, got {t.device}")
        if check_values and slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= self.num_pages * self.page_size:
                raise ValueError(f"slots must be in [0, {self.num_pages * self.page_size}), got values in [{lo}, {hi}]")
            for page in torch.unique(slots // self.page_size).tolist():
                if self.allocator.refcount(page) != 1:
                    raise ValueError(
                        f"slots point into page {page} with refcount {self.allocator.refcount(page)}; "
                        "write only into slots returned by reserve() (shared pages are copied there)"
                    )
        slots = slots.to(device=self.device, dtype=torch.int64)
        self.k_cache[layer].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
        self.v_cache[layer].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)
        if self._pending and slots.numel():
            self._mark_written(layer, torch.unique(slots // self.page_size).tolist())

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V of ``layer`` as contiguous ``[seq_len, num_kv_heads, head_dim]``."""
        seq = self._seq(seq_id)
        layer = check_int("layer", layer, min_value=0)
        if layer >= self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        slots = slot_mapping(seq.pages, start=0, num_tokens=seq.length, page_size=self.page_size).to(self.device)
        flat = (-1, self.num_kv_heads, self.head_dim)
        return self.k_cache[layer].view(flat)[slots], self.v_cache[layer].view(flat)[slots]

    # ----------------------------------------------------------------- sharing and release
    def fork(self, seq_id: int) -> int:
        """A new sequence sharing ``seq_id``'s pages (reference counts; copy-on-write later)."""
        src = self._seq(seq_id)
        held = src.pages[: pages_needed(src.length, self.page_size)]
        self.allocator.share(held)
        new_id = self._next_id
        self._next_id += 1
        self._seqs[new_id] = _Sequence(
            pages=list(held),
            length=src.length,
            token_ids=None if src.token_ids is None else list(src.token_ids),
            page_hashes=list(src.page_hashes),
            root=src.root,
        )
        return new_id

    def free(self, seq_id: int) -> None:
        """Release the sequence: one reference dropped from each of its pages (tail first)."""
        seq = self._seq(seq_id)
        self._release(seq.pages)
        del self._seqs[seq_id]

    def drop_pages(self, seq_id: int, logical_pages) -> None:
        """Remove whole logical pages from a sequence (eviction); they go back to the pool.

        The remaining pages keep their order; ``seq_len`` shrinks by the tokens the dropped
        pages held. The sequence stops taking part in prefix caching.
        """
        seq = self._seq(seq_id)
        held = pages_needed(seq.length, self.page_size)
        logical_pages = check_list("logical_pages", logical_pages, "logical page indices")
        drop = sorted({check_int("logical_pages[i]", i, min_value=0) for i in logical_pages})
        if drop and drop[-1] >= held:
            raise ValueError(f"logical_pages must be in [0, {held}) for sequence {seq_id}, got {drop[-1]}")
        tokens = [min(self.page_size, seq.length - i * self.page_size) for i in drop]
        pages = [seq.pages[i] for i in drop]
        self._release(pages)
        dropped = set(drop)
        seq.pages = [p for i, p in enumerate(seq.pages) if i not in dropped]
        seq.length -= sum(tokens)
        seq.token_ids, seq.page_hashes = None, []

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Remove the last ``num_tokens`` tokens of a sequence: the inverse of `reserve`.

        Pages left without a token go back to the pool (tail first, reserved-ahead pages too).
        The vacated slots of the last kept page become zero, like every slot that holds no
        token; if another sequence shares that page, this sequence first gets its own copy
        (one page from the pool: `OutOfPagesError`, with nothing changed, when none is free).
        A page whose tokens may now change stops being offered for prefix reuse; the full pages
        kept stay cached, so prefix caching goes on for the sequence.

        Example:
            >>> kv = PagedKVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
            >>> s = kv.add_sequence()
            >>> _ = kv.reserve(s, 7)
            >>> kv.truncate(s, 4)
            >>> kv.seq_len(s), len(kv.pages(s)), kv.allocator.num_free
            (3, 1, 3)
        """
        seq = self._seq(seq_id)
        num_tokens = check_int("num_tokens", num_tokens, min_value=0)
        if num_tokens > seq.length:
            raise ValueError(f"num_tokens must be <= seq_len={seq.length} for sequence {seq_id}, got {num_tokens}")
        if num_tokens == 0:
            return
        ps = self.page_size
        new_len = seq.length - num_tokens
        need = pages_needed(new_len, ps)
        copy, released = self._truncate_pages(seq, num_tokens)
        if copy and not self.allocator.can_allocate(1) and not released:
            raise OutOfPagesError(1, self.allocator.num_free)
        self._release(seq.pages[need:])
        seq.pages = seq.pages[:need]
        if new_len % ps:  # the last kept page loses slots
            if copy:
                self._copy_on_write(seq, [need - 1], self._allocate(1))
            self._forget_hash(seq.pages[-1])
            start = (need - 1) * ps + new_len % ps
            slots = slot_mapping(seq.pages, start=start, num_tokens=need * ps - start, page_size=ps)
            self._zero_slots(slots.to(self.device))
        seq.length = new_len
        if seq.token_ids is not None:
            seq.token_ids = seq.token_ids[:new_len]
            seq.page_hashes = seq.page_hashes[: new_len // ps]

    def compact(self, seq_id: int, keep: torch.Tensor) -> None:
        """Keep only the tokens where ``keep: bool [seq_len]`` is True, packed in order.

        Kept tokens move to the front of the sequence's pages in every layer (token-level
        eviction); pages no longer needed go back to the pool. Shared pages that receive
        tokens are copied first. The sequence stops taking part in prefix caching.
        """
        seq = self._seq(seq_id)
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or tuple(keep.shape) != (seq.length,):
            raise ValueError(f"keep must be a bool tensor of shape [seq_len] = [{seq.length}], got {describe(keep)}")
        n_keep = int(keep.sum())
        need = pages_needed(n_keep, self.page_size)
        shared = self._compact_copies(seq, n_keep)
        self._copy_on_write(seq, shared, self._allocate(len(shared)))  # OutOfPagesError before any change
        for page in seq.pages[:need]:
            self._forget_hash(page)
        all_slots = slot_mapping(seq.pages, start=0, num_tokens=seq.length, page_size=self.page_size)
        src = all_slots[keep.cpu()].to(self.device)
        dst = all_slots[:n_keep].to(self.device)
        flat = (-1, self.num_kv_heads, self.head_dim)
        for cache in (*self.k_cache, *self.v_cache):
            view = cache.view(flat)
            view.index_copy_(0, dst, view[src])  # view[src] is a copy taken before the writes
        self._release(seq.pages[need:])
        seq.pages = seq.pages[:need]
        seq.length = n_keep
        if n_keep % self.page_size:  # vacated slots of the last kept page: back to zeros
            self._zero_slots(all_slots[n_keep : need * self.page_size].to(self.device))
        seq.token_ids, seq.page_hashes = None, []

    # ----------------------------------------------------------------- internals
    def _seq(self, seq_id) -> _Sequence:
        if isinstance(seq_id, bool) or not isinstance(seq_id, numbers.Integral) or seq_id not in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is not a live sequence of this cache (live: {sorted(self._seqs)})")
        return self._seqs[seq_id]

    def _batch(self, seq_ids):
        if seq_ids is None:
            return list(self._seqs)
        return check_list("seq_ids", seq_ids, "sequence ids")

    def _reserve(self, requests: list[tuple[_Sequence, int, list[int] | None]]) -> list[torch.Tensor]:
        """Grow each ``(sequence, num_tokens, token_ids)`` in order; count every page first."""
        ps = self.page_size
        refs: dict[int, int] = {}  # a page's refcount once the requests before have copied it away
        plans = []  # per request: [logical pages to copy, pages to add]
        for seq, n, _ in requests:
            need = pages_needed(seq.length + n, ps)
            copies = []
            for i in range(seq.length // ps, min(need, len(seq.pages))):  # held pages the new tokens land in
                page = seq.pages[i]
                refs.setdefault(page, self.allocator.refcount(page))
                if refs[page] > 1:  # shared: this sequence writes into its own copy
                    copies.append(i)
                    refs[page] -= 1
            plans.append([copies, max(0, need - len(seq.pages))])
        total = sum(len(copies) + grow for copies, grow in plans)
        if total > self.allocator.num_free:
            raise OutOfPagesError(total, self.allocator.num_free)
        if self.growth == "pow2":  # round each up to a power of two while the pages left allow
            spare = self.allocator.num_free - total
            for plan, (seq, _, _) in zip(plans, requests):
                extra = next_pow2(len(seq.pages) + plan[1]) - len(seq.pages) - plan[1] if plan[1] else 0
                if extra <= spare:
                    plan[1] += extra
                    spare -= extra
        slots = []
        for (copies, grow), (seq, n, token_ids) in zip(plans, requests):
            new_pages = self._allocate(grow + len(copies))
            self._copy_on_write(seq, copies, new_pages[grow:])
            seq.pages.extend(new_pages[:grow])
            slots.append(slot_mapping(seq.pages, start=seq.length, num_tokens=n, page_size=ps).to(self.device))
            seq.length += n
            self._register_full_pages(seq, token_ids)
        return slots

    def _truncate_pages(self, seq: _Sequence, num_tokens: int) -> tuple[bool, int]:
        """What cutting ``num_tokens`` takes and gives: whether the last kept page, shared and
        partly kept, must be copied first, and how many pages go back to the pool."""
        new_len = seq.length - num_tokens
        need = pages_needed(new_len, self.page_size)
        copy = bool(new_len % self.page_size) and self.allocator.refcount(seq.pages[need - 1]) > 1
        return copy, sum(self.allocator.refcount(p) == 1 for p in seq.pages[need:])

    def _compact_copies(self, seq: _Sequence, n_keep: int) -> list[int]:
        """Logical pages that receive kept tokens and are shared: compacting copies them first."""
        need = pages_needed(n_keep, self.page_size)
        return [i for i in range(need) if self.allocator.refcount(seq.pages[i]) > 1]

    def _mark(self, seq_id: int) -> tuple:
        """A sequence as it is now, for `_rewind` (valid while it only reserves and writes): its
        pages, its length and its prefix-key lists with their lengths (reserve only appends to
        those lists, or replaces them)."""
        seq = self._seq(seq_id)
        known = None if seq.token_ids is None else len(seq.token_ids)
        return list(seq.pages), seq.length, (seq.token_ids, known), (seq.page_hashes, len(seq.page_hashes))

    def _rewind(self, seq_id: int, mark: tuple) -> None:
        """Put ``seq_id`` back as `_mark` saw it, undoing the reserves and writes made since (a
        failed forward's rollback): each shared page that a private copy replaced is shared
        again, the pages taken since go back to the pool, and the slots written since in the
        pages it kept are zeroed and no longer offered for prefix reuse.

        Rewind a batch in the reverse of the order it was reserved in: a page one sequence
        copied away may have been written in place by a later one, which must give it back first.
        Returned pages that kept a prefix for reuse and were handed out since stay forgotten:
        their K/V were overwritten.
        """
        seq = self._seq(seq_id)
        pages, length, (token_ids, known), (page_hashes, hashed) = mark
        ps, before, now = self.page_size, set(pages), set(seq.pages)
        self.allocator.share([p for p in pages if p not in now])  # raises, changing nothing, if one is gone
        # tokens written since into pages held before (the partial last page, pages reserved ahead)
        written = [t for t in range(length, min(seq.length, len(pages) * ps)) if seq.pages[t // ps] == pages[t // ps]]
        if written:
            for page in {pages[t // ps] for t in written}:
                self._forget_hash(page)  # no longer full with those tokens
            self._zero_slots(torch.tensor([pages[t // ps] * ps + t % ps for t in written], device=self.device))
        taken = [p for p in seq.pages if p not in before]  # new pages and private copies
        for page in taken:
            self._forget_hash(page)  # filled by the failed step: never offered for reuse
        self._release(taken)
        if token_ids is not None:
            del token_ids[known:]
        del page_hashes[hashed:]
        seq.pages, seq.length, seq.token_ids, seq.page_hashes = pages, length, token_ids, page_hashes

    def _allocate(self, n: int) -> list[int]:
        """Take ``n`` pages from the pool, all zero (a recycled cached page is zeroed here)."""
        pages = self.allocator.allocate(n) if n else []
        cached = [p for p in pages if p in self._page_hash]  # the only free pages with data
        for page in pages:  # handed out again: whatever prefix it cached is gone
            self._forget_hash(page)
        self._zero_pages(cached)
        return pages

    def _release(self, pages: list[int]) -> None:
        """Drop one reference per page, tail first; pages with a cached prefix are reused last."""
        tail_first = pages[::-1]
        self.allocator.free(tail_first, cached=[p for p in tail_first if p in self._page_hash])
        plain = [p for p in set(pages) if self.allocator.refcount(p) == 0 and p not in self._page_hash]
        for page in plain:
            self._pending.pop(page, None)  # freed before its K/V was written: never cached
        self._zero_pages(plain)  # a freed page keeps no K/V of its last owner

    def _zero_pages(self, pages: list[int]) -> None:
        if pages:
            index = torch.tensor(pages, device=self.device)  # int64 [n]
            for cache in (*self.k_cache, *self.v_cache):
                cache.index_fill_(0, index, 0)

    def _zero_slots(self, slots: torch.Tensor) -> None:
        flat = (-1, self.num_kv_heads, self.head_dim)
        for cache in (*self.k_cache, *self.v_cache):
            cache.view(flat).index_fill_(0, slots, 0)

    def _forget_hash(self, page: int) -> None:
        h = self._page_hash.pop(page, None)
        self._page_tokens.pop(page, None)
        self._pending.pop(page, None)
        if h is not None and self._prefix_index.get(h) == page:
            del self._prefix_index[h]

    def _mark_written(self, layer: int, pages) -> None:
        """Count ``layer`` as written for pending pages; publish a page once every layer is."""
        for page in pages:
            entry = self._pending.get(page)
            if entry is None:
                continue
            key, tokens, layers = entry
            layers.add(layer)
            if len(layers) == self.num_layers:
                del self._pending[page]
                if key not in self._prefix_index:
                    self._prefix_index[key] = page
                    self._page_hash[page] = key
                    self._page_tokens[page] = tokens

    def _copy_page(self, src: int, dst: int) -> None:
        for cache in (*self.k_cache, *self.v_cache):
            cache[dst].copy_(cache[src])

    def _copy_on_write(self, seq: _Sequence, indices: list[int], new_pages: list[int]) -> None:
        """Give ``seq`` private copies of its shared pages at ``indices``, into ``new_pages``."""
        for i, page in zip(indices, new_pages):
            self._copy_page(seq.pages[i], page)
            self.allocator.free([seq.pages[i]])  # drops this sequence's reference only
            seq.pages[i] = page

    def _match_prefix(self, seq: _Sequence, token_ids: list[int]) -> None:
        ps, prev = self.page_size, seq.root
        for i in range((len(token_ids) - 1) // ps):  # leave >= 1 token to compute
            tokens = tuple(token_ids[i * ps : (i + 1) * ps])
            h = _page_key(prev, tokens)
            page = self._prefix_index.get(h)
            if page is None or self._page_tokens.get(page) != tokens:  # confirm, never trust a key alone
                break
            if self.allocator.refcount(page) > 0:
                self.allocator.share([page])
            else:
                self.allocator.take(page)  # returned to the pool but not yet reused: revive it
            seq.pages.append(page)
            seq.page_hashes.append(h)
            prev = h
        seq.length = len(seq.pages) * ps
        seq.token_ids = token_ids[: seq.length]
        self.prefix_hits += len(seq.pages)

    def _register_full_pages(self, seq: _Sequence, token_ids) -> None:
        if not self.prefix_caching or seq.token_ids is None:
            return
        if token_ids is None:  # tokens unknown from here on: stop hashing this sequence
            seq.token_ids, seq.page_hashes = None, []
            return
        seq.token_ids.extend(token_ids)
        ps = self.page_size
        for i in range(len(seq.page_hashes), seq.length // ps):
            prev = seq.page_hashes[-1] if seq.page_hashes else seq.root
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            h = _page_key(prev, tokens)
            seq.page_hashes.append(h)
            if h not in self._prefix_index:  # offered for reuse once write() has stored it
                self._forget_hash(seq.pages[i])
                self._pending[seq.pages[i]] = (h, tokens, set())

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_pages={self.num_pages}, page_size={self.page_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"sequences={len(self._seqs)}, free_pages={self.allocator.num_free})"
        )


def _namespace_key(namespace, parent: bytes = b"paged_ref prefix cache v1", name: str = "prefix_namespace") -> bytes:
    """The root of a key chain: a digest of ``parent`` and the tagged namespace fields."""
    if namespace is None:
        namespace = {}
    if not isinstance(namespace, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in namespace.items()
    ):
        raise TypeError(
            f"{name} must be None or a dict of str -> str (e.g. {{'model': ..., 'adapter': ...}}), got {namespace!r}"
        )
    h = hashlib.sha256(parent)
    for k, v in sorted(namespace.items()):  # each field tagged with its name and length
        for part in (k, v):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little") + data)
    return h.digest()


def _page_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """SHA-256 over the parent page's key and this page's token ids (any Python ints)."""
    h = hashlib.sha256(parent)
    h.update(repr(tokens).encode())
    return h.digest()


def _token_list(name: str, token_ids) -> list[int]:
    """Token ids as a list of Python ints; floats, bools and non-numbers are refused."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {describe(token_ids)}")
        return token_ids.tolist()
    out = []
    for i, t in enumerate(check_list(name, token_ids, "ints or a 1-D integer tensor")):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}] must be an int, got {type(t).__name__} ({t!r})")
        out.append(int(t))
    return out
