"""8-bit pages inside a cache (`paged_ref.quant`): the scales that travel with each page, the write that
quantizes and the read that dequantizes.

``PagedKVCache(kv_format=...)`` stores ``k_cache[layer], v_cache[layer]`` in the format's 8-bit dtype
(its ``dtype`` stays the compute dtype: what ``gather`` returns) and keeps a `QuantPages` as
``cache.quant``; the cache calls it where bytes are written, read, copied or zeroed. Stored byte ``q`` of
page ``p``, KV head ``h`` stands for ``q.float() * scale[p, h]``: ``cache.kv_scales(layer)`` gives the
float32 ``[num_pages, num_kv_heads]`` scales of K and of V, what every attention backend reads.

- ``scales="layer"``: one scale per layer for K and one for V (vLLM's ``k_scale`` / ``v_scale``), fixed;
  `kv_scales` returns it expanded (stride 0). A byte means the same in every page: moving a token moves bytes.
- ``scales="page"``: one per page and KV head, for K and for V, per layer. A write into a page raises
  that page's scale (per KV head) to fit the new tokens (`paged_ref.quant.calibrate`), never lowers it;
  if it grew, the page's earlier tokens are re-quantized to the new scale (dequantized with the old one,
  quantized with the new, to nearest whatever the format's rounding: truncating at each growth would
  drift them toward zero). A page zeroed or handed out again starts at scale 0 (its bytes are 0). The
  scale belongs to the physical page: a copy-on-write copies its row, a shared or prefix-cached page
  keeps it, a token moved by compaction is written into its new page under that page's scale.

Example (one page of 4 tokens; the second write needs a larger scale, so the first token is re-quantized):
    >>> from paged_ref.cache import PagedKVCache
    >>> from paged_ref.quant import KVFormat
    >>> kv = PagedKVCache(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1, head_dim=2,
    ...                   kv_format=KVFormat(torch.int8, scales="page"))
    >>> s = kv.add_sequence()
    >>> kv.write(0, kv.reserve(s, 1), torch.tensor([[[1.0, -0.5]]]), torch.ones(1, 1, 2))
    >>> round(kv.kv_scales(0)[0][0].item() * 127, 4), kv.k_cache[0][0, 0, 0].tolist()
    (1.0, [127, -64])
    >>> kv.write(0, kv.reserve(s, 1), torch.tensor([[[2.54, 0.0]]]), torch.ones(1, 1, 2))
    >>> round(kv.kv_scales(0)[0][0].item() * 127, 4), kv.k_cache[0][0, :2, 0].tolist()
    (2.54, [[50, -25], [127, 0]])
"""

from __future__ import annotations

import torch

from . import quant
from .block_table import flat_slots

__all__ = ["QuantPages", "raw"]


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its bytes (a uint8 view of the same shape) for a float8 tensor: torch's index ops
    (``index_copy_``, ``index_fill_``) do not take float8."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def values(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What bytes ``q`` stand for: ``q * scale`` in float32 (float64 for ``dtype`` float64), in ``dtype``
    (`paged_ref.quant.dequantize`'s product; a scale of 0 is allowed: its bytes are 0)."""
    work = torch.promote_types(dtype, torch.float32)
    return (q.to(work) * scale.to(work)).to(dtype)


class QuantPages:
    """A cache's 8-bit side: per layer, the scales of K and of V, and the writes and reads through them."""

    def __init__(self, fmt: quant.KVFormat, *, num_layers: int, num_pages: int, num_kv_heads: int, device):
        self.format = fmt
        self.per_page = fmt.scales == "page"
        shape = (num_pages, num_kv_heads)
        if self.per_page:  # float32 [num_pages, Hkv] per layer, 0 until a token is written
            self.k_scales = [torch.zeros(shape, device=device) for _ in range(num_layers)]
            self.v_scales = [torch.zeros(shape, device=device) for _ in range(num_layers)]
        else:  # one value per layer, expanded to [num_pages, Hkv] (stride 0)
            k, v = (s.to(device) for s in fmt.layer_scales(num_layers))  # float32 [num_layers] each
            self.k_scales = [k[i].expand(shape) for i in range(num_layers)]
            self.v_scales = [v[i].expand(shape) for i in range(num_layers)]

    def page_bytes(self, cache) -> int:
        """Bytes of one page of ``cache`` (`paged_ref.quant.page_bytes`: 1 per value, plus its scales)."""
        shape = cache.geometry.kv_shape
        return quant.page_bytes(self.format.dtype, page_size=cache.page_size, **shape, scales=self.format.scales)

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor, rounding: str | None = None) -> torch.Tensor:
        safe = torch.where(scale > 0, scale, 1.0)  # 0 only where every value is 0: any scale stores 0
        return quant.quantize(x, safe, self.format.dtype, rounding=rounding or self.format.rounding)

    def _grow(self, scales: torch.Tensor, pages: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``scales`` (``[num_pages, Hkv]``) raised where ``x: [n, Hkv, D]`` written into ``pages: [n]`` needs more."""
        amax = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).abs().amax(-1)  # [n, Hkv]
        need = torch.where(amax > 0, quant.calibrate(x, self.format.dtype, dim=-1), 0.0)
        return scales.clone().scatter_reduce_(0, pages[:, None].expand_as(need), need, "amax")

    def _rescale(self, data: torch.Tensor, old: torch.Tensor, new: torch.Tensor, pages: torch.Tensor) -> None:
        """Re-quantize ``pages`` of ``data`` from scales ``old`` to ``new`` (only the KV heads whose scale grew),
        to nearest: truncating again at every growth would drift a page's first tokens toward zero."""
        q, o, n = data[pages], old[pages][:, None, :, None], new[pages][:, None, :, None]  # [g, ps, Hkv, D]
        y = self._quantize(values(q, o, torch.float32), n, "nearest")
        raw(data).index_copy_(0, pages, torch.where(n == o, raw(q), raw(y)))
        old[pages] = new[pages]

    def _pairs(self, cache, layer: int):
        return (cache.k_cache[layer], self.k_scales[layer]), (cache.v_cache[layer], self.v_scales[layer])

    def write(self, cache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, src=None) -> None:
        """Store ``k, v: [n, Hkv, D]`` (floating) at ``slots: int64 [n]`` of ``layer``, growing the pages'
        scales first; ``src``: for a move, ``(bytes, scales)`` of K and of V where the tokens come from,
        copied as they are into a page of the same scale (re-quantizing them is not exact)."""
        pages = slots // cache.page_size
        flat = (-1, cache.num_kv_heads, cache.head_dim)
        pairs = self._pairs(cache, layer)
        if self.per_page:
            grown = [self._grow(s, pages, x) for (_, s), x in zip(pairs, (k, v))]
            grew = ((grown[0] > pairs[0][1]) | (grown[1] > pairs[1][1])).any(1).nonzero().flatten()  # [g]
            changed = torch.cat([slots, flat_slots(grew.tolist(), 0, len(grew) * cache.page_size, cache.page_size)])
            cache._saving((layer,), changed.to(slots.device).unique())
            for (data, scales), new in zip(pairs, grown):
                self._rescale(data, scales, new, grew)
            if cache.watchers and len(grew):  # the keys re-quantized, as stored now; an empty slot (all 0) left out
                held = changed[len(slots) :].to(slots.device)
                held = held[self.read(cache, layer, held)[0].flatten(1).any(1)]
                cache._tell("update", layer, held, self.read(cache, layer, held)[0])
        else:
            cache._saving((layer,), slots)
        for i, ((data, scales), x) in enumerate(zip(pairs, (k, v))):
            scale = scales[pages][:, :, None]  # [n, Hkv, 1]
            q = raw(self._quantize(x, scale))
            if src is not None:  # a moved token keeps its bytes where its scale is the same
                q = torch.where(src[i][1][:, :, None] == scale, raw(src[i][0]), q)
            raw(data).view(flat).index_copy_(0, slots, q)

    def read(self, cache, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None):
        """K and V at ``slots: int64 [n]`` of ``layer`` as values ``[n, Hkv, D]`` in ``dtype`` (default the cache's)."""
        pages = slots // cache.page_size
        flat = (-1, cache.num_kv_heads, cache.head_dim)
        return tuple(
            values(data.view(flat)[slots], scales[pages][:, :, None], dtype or cache.dtype)
            for data, scales in self._pairs(cache, layer)
        )

    def move(self, cache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Compaction's move in every layer: the tokens at slots ``src`` written to ``dst`` (int64 [n])."""
        if not self.per_page:  # one scale per layer: the bytes move as they are
            flat = (-1, cache.num_kv_heads, cache.head_dim)
            cache._saving(range(len(self.k_scales)), dst)
            for data in (*cache.k_cache, *cache.v_cache):
                raw(data).view(flat).index_copy_(0, dst, raw(data).view(flat)[src])
            return
        pages = src // cache.page_size
        for layer in range(len(self.k_scales)):
            k, v = self.read(cache, layer, src, torch.float32)  # taken before any write
            moved = [(data.view(-1, *data.shape[2:])[src], scales[pages]) for data, scales in self._pairs(cache, layer)]
            self.write(cache, layer, dst, k, v, src=moved)

    # ----------------------------------------------------------------- scales travelling with their page
    def copy(self, src: int, dst: int) -> None:
        """Page ``dst`` became a copy of page ``src``: its scale rows too."""
        if self.per_page:
            for s in (*self.k_scales, *self.v_scales):
                s[dst] = s[src]

    def zero(self, index: torch.Tensor) -> None:
        """Pages ``index`` (int64 [n]) hold no token again: scale 0."""
        if self.per_page:
            for s in (*self.k_scales, *self.v_scales):
                s.index_fill_(0, index, 0.0)

    def rows(self, pages: torch.Tensor):
        """The scale rows of ``pages`` (int64 [n]) in every layer, for `set_rows` (None with per-layer scales)."""
        return [(k[pages], v[pages]) for k, v in zip(self.k_scales, self.v_scales)] if self.per_page else None

    def set_rows(self, pages: torch.Tensor, rows) -> None:
        if rows is not None:
            for (k, v), (k_rows, v_rows) in zip(zip(self.k_scales, self.v_scales), rows):
                k[pages], v[pages] = k_rows, v_rows


# --------------------------------------------------------------------- a sequence's pages out and back (swap)
def read_pages(cache, seq_id: int) -> tuple:
    """``seq_id``'s pages as stored, for `write_pages`: ``(k, v, rows)``, ``k, v``: the bytes of the pages
    holding its tokens in every layer ``[num_layers, n, page_size, Hkv, D]`` (copies), ``rows``: their scale
    rows (None unless scaled per page). 8-bit pages leave as bytes and scales: re-quantizing what they stand
    for would not give the same bytes back."""
    pages = cache.pages(seq_id)[: -(-cache.seq_len(seq_id) // cache.page_size)]
    index = torch.tensor(pages, dtype=torch.int64, device=cache.device)  # [n]
    k, v = (torch.stack([raw(t)[index] for t in tensors]) for tensors in (cache.k_cache, cache.v_cache))
    return k, v, None if cache.quant is None else cache.quant.rows(index)


def write_pages(cache, seq_id: int, stored: tuple) -> None:
    """Write `read_pages`' ``stored`` into the pages ``seq_id`` holds now: as many tokens, just reserved."""
    k, v, rows = stored
    ps, n = cache.page_size, cache.seq_len(seq_id)
    pages = cache.pages(seq_id)[: -(-n // ps)]
    if len(pages) != k.shape[1]:
        raise ValueError(f"sequence {seq_id} holds {len(pages)} pages of tokens, the stored pages are {k.shape[1]}")
    index = torch.tensor(pages, dtype=torch.int64, device=cache.device)  # [n_pages]
    cache._saving(range(cache.num_layers), flat_slots(pages, 0, len(pages) * ps, ps).to(cache.device))
    for data, saved in zip((*cache.k_cache, *cache.v_cache), (*k, *v)):
        raw(data).index_copy_(0, index, saved.to(cache.device))
    if rows is not None:
        cache.quant.set_rows(index, [(a.to(cache.device), b.to(cache.device)) for a, b in rows])
    cache.written(seq_id)
    slots = flat_slots(pages, 0, n, ps).to(cache.device)
    for layer in range(cache.num_layers):
        cache._tell("update", layer, slots, cache._read(layer, slots)[0])
