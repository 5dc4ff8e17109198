"""8-bit pages in the caches (`paged_ref.kv_pages`): writes quantize, gathers dequantize, and the scales
travel with their page through fork, copy-on-write, truncate, compaction, drop_pages, free, prefix
caching, swap, rewind and rollback; fresh random inputs (ragged lengths, several page sizes, GQA)."""

from __future__ import annotations

import math

import pytest
import torch
from cache_state import snapshot

from paged_ref import quant
from paged_ref.attention.reference import attend, reference_paged_decode
from paged_ref.cache import PagedKVCache
from paged_ref.kv_pages import raw, values
from paged_ref.layered_cache import LayeredKVCache
from paged_ref.quant import KVFormat
from paged_ref.serve.swap import SwapSpace

FMTS = list(quant.FORMATS)
STEP = {torch.float8_e4m3fn: (2.0**-3, 2.0**-9), torch.float8_e5m2: (2.0**-2, 2.0**-16), torch.int8: (0.0, 1.0)}


def _cache(fmt, scales="page", *, page_size=4, num_kv_heads=2, num_layers=2, num_pages=16, **options):
    fmt = KVFormat(fmt, scales=scales, **{k: options.pop(k) for k in ("rounding", "k_scale") if k in options})
    shape = dict(num_layers=num_layers, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads)
    return PagedKVCache(**shape, head_dim=8, kv_format=fmt, **options)


def _kv(gen, n, cache, spread=True):
    """K, V ``[n, Hkv, D]`` whose tokens differ in magnitude by up to 100x (so pages' scales must grow)."""
    shape = (n, cache.num_kv_heads, cache.head_dim)
    size = 10.0 ** (torch.rand(n, 1, 1, generator=gen) * 2 - 1) if spread else 1.0
    return (torch.randn(shape, generator=gen) * size).to(cache.dtype), torch.randn(shape, generator=gen).to(cache.dtype)


def _fill(cache, gen, lengths, *, chunk=None):
    """Sequences of ``lengths`` tokens written ``chunk`` tokens at a time (None: all at once); returns
    ``{seq: (k, v)}``, what was written, ``[len, Hkv, D]`` each."""
    written = {}
    for n in lengths:
        s = cache.add_sequence()
        ks, vs = [], []
        for start in range(0, n, chunk or n):
            m = min(chunk or n, n - start)
            slots = cache.reserve(s, m)
            k, v = _kv(gen, m, cache)
            for layer in range(cache.num_layers):
                cache.write(layer, slots, k * (layer + 1), v)
            ks.append(k)
            vs.append(v)
        written[s] = torch.cat(ks), torch.cat(vs)
    return written


def _bound(x, scale, fmt, steps):
    """How far a stored value may be from ``x`` after ``steps`` quantizations at scales <= ``scale`` (to nearest)."""
    rel, absolute = STEP[fmt]
    return steps * (rel * x.abs() * (1 + rel) ** steps + absolute * scale / 2) + 1e-7


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("page_size, num_kv_heads", [(1, 1), (4, 2), (16, 4)])
def test_a_prefill_stores_each_page_at_its_own_calibrated_scale(fmt, page_size, num_kv_heads):
    gen = torch.Generator().manual_seed(page_size)
    cache = _cache(fmt, page_size=page_size, num_kv_heads=num_kv_heads, num_pages=64)
    written = _fill(cache, gen, [1, 7, 2 * page_size + 1, 13])
    for s, (k, v) in written.items():
        n, pages = len(k), cache.pages(s)
        pad = -n % page_size  # the page-sized view of the tokens: [pages, page_size, Hkv, D]
        for layer, (x, scales) in enumerate(zip((k * 2, v), cache.kv_scales(1))):
            paged = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]).view(-1, page_size, *x.shape[1:])
            expected = quant.calibrate(paged, fmt, dim=(1, 3))  # [pages, Hkv]
            assert torch.equal(scales[pages], expected)
            q = quant.quantize(paged, expected[:, None, :, None], fmt)
            assert torch.equal(raw(cache.k_cache[1] if layer == 0 else cache.v_cache[1])[pages], raw(q))
        gk, gv = cache.gather(1, s)
        assert gk.dtype == cache.dtype and torch.equal(
            gv, quant.dequantize(q, expected[:, None, :, None]).flatten(0, 1)[:n]
        )


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("rounding", ["nearest", "zero"])
def test_token_by_token_writes_grow_the_page_scale_and_requantize_its_tokens(fmt, rounding):
    gen = torch.Generator().manual_seed(7)
    cache = _cache(fmt, page_size=8, num_kv_heads=2, num_pages=32, rounding=rounding)
    written = _fill(cache, gen, [5, 17, 30], chunk=1)
    first = 2 if rounding == "zero" else 1  # the write: toward zero a whole step, not half; re-quantizing: half
    for s, (k, _) in written.items():
        pages = torch.tensor(cache.pages(s))
        scale = cache.kv_scales(0)[0][pages]  # [pages, Hkv]: the final scale is that of the whole page
        pad = torch.cat([k, k.new_zeros(-len(k) % 8, *k.shape[1:])]).view(-1, 8, *k.shape[1:])
        assert torch.equal(scale, quant.calibrate(pad, fmt, dim=(1, 3)))
        per_token = scale.repeat_interleave(8, 0)[: len(k), :, None]  # [n, Hkv, 1]
        later = (7 - torch.arange(len(k)) % 8)[:, None, None]  # writes into its page after it: re-quantizations
        err = (cache.gather(0, s)[0] - k).abs()
        assert bool((err <= _bound(k, per_token, fmt, first + later)).all())
        assert bool((err <= per_token * quant.FORMATS[fmt] * 0.2).all())  # and a fifth of the page's range at most


def test_a_page_scale_never_lowers_and_a_zero_token_leaves_it():
    cache = _cache(torch.int8, page_size=4, num_kv_heads=1, num_layers=1, num_pages=2)
    s = cache.add_sequence()
    for x, expect in ((0.0, 0.0), (2.54, 0.02), (1.0, 0.02), (-5.08, 0.04)):
        k = torch.full((1, 1, 8), x)
        cache.write(0, cache.reserve(s, 1), k, k)
        assert math.isclose(cache.kv_scales(0)[0][0, 0].item(), expect, rel_tol=1e-6)
    assert cache.k_cache[0][0, :, 0, 0].tolist() == [0, 64, 25, -127]  # 2.54 / 0.04 = 63.5 -> 64, 1.0 -> 25


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_per_layer_scales_are_fixed_and_expanded(fmt):
    cache = _cache(fmt, "layer", k_scale=[0.5, 2.0])
    k_scale, v_scale = cache.kv_scales(1)
    assert k_scale.shape == (16, 2) and k_scale.stride() == (0, 0) and k_scale.dtype == torch.float32
    assert float(k_scale[3, 1]) == 2.0 and float(v_scale[0, 0]) == 1.0
    gen = torch.Generator().manual_seed(3)
    for s, (k, v) in _fill(cache, gen, [3, 9]).items():
        got_k, got_v = cache.gather(1, s)
        assert torch.equal(got_k, quant.dequantize(quant.quantize(k * 2, 2.0, fmt), 2.0))
        assert torch.equal(got_v, quant.dequantize(quant.quantize(v, 1.0, fmt), 1.0))
    floating = PagedKVCache(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2)
    assert floating.kv_scales(0) == (None, None) and floating.quant is None


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("scales", ["page", "layer"])
def test_the_reference_on_the_cache_is_attention_on_the_dequantized_gather(fmt, scales):
    gen = torch.Generator().manual_seed(11)
    cache = _cache(fmt, scales, page_size=4, num_kv_heads=2, num_pages=32)
    seqs = list(_fill(cache, gen, [3, 10, 17], chunk=3))
    q = torch.randn(len(seqs), 4, 8, generator=gen)  # [batch, Hq, D]: 2 query heads per KV head
    table, lens = cache.block_table(seqs)
    k_scale, v_scale = cache.kv_scales(1)
    out = reference_paged_decode(q, cache.k_cache[1], cache.v_cache[1], table, lens, k_scale=k_scale, v_scale=v_scale)
    for b, s in enumerate(seqs):
        k, v = cache.gather(1, s)
        assert torch.equal(out[b], attend(q[b, :, None], k, v, None, 8**-0.5)[:, 0])


@pytest.mark.parametrize("scales", ["page", "layer"])
def test_copy_on_write_copies_the_scale_row_with_the_page(scales):
    gen = torch.Generator().manual_seed(5)
    cache = _cache(torch.float8_e4m3fn, scales)
    (a,) = _fill(cache, gen, [6])
    before = cache.gather(0, a)
    b = cache.fork(a)
    k, v = _kv(gen, 1, cache)
    slots = cache.reserve(b, 1)  # lands in the shared page 1: copied
    (copy,) = cache.last_copies
    for scale in cache.kv_scales(0):
        assert torch.equal(scale[copy.page], scale[copy.source])
    assert torch.equal(raw(cache.k_cache[0][copy.page]), raw(cache.k_cache[0][copy.source]))
    for layer in range(2):
        cache.write(layer, slots, k * 100, v)  # grows the copy's scale, not the source's
    assert torch.equal(cache.gather(0, a)[0], before[0])  # the source page is untouched
    if scales == "layer":  # one scale: the copy's bytes still stand for a's values
        assert torch.equal(cache.gather(0, b)[0][:6], before[0])


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("page_size", [2, 4, 8])
def test_compaction_writes_moved_tokens_under_their_new_pages_scale(fmt, page_size):
    gen = torch.Generator().manual_seed(page_size)
    for scales in ("page", "layer"):
        cache = _cache(fmt, scales, page_size=page_size, num_pages=32)
        (s,) = _fill(cache, gen, [3 * page_size + 1], chunk=2)
        before = [cache.gather(layer, s) for layer in range(2)]
        keep = torch.rand(cache.seq_len(s), generator=gen) < 0.6
        keep[0] = True
        cache.compact(s, keep)
        pages = torch.tensor(cache.pages(s))
        for layer in range(2):
            for got, old, scale in zip(cache.gather(layer, s), before[layer], cache.kv_scales(layer)):
                want = old[keep]
                if scales == "layer":  # the bytes moved as they were
                    assert torch.equal(got, want)
                    continue
                per_token = scale[pages].repeat_interleave(page_size, 0)[: len(want), :, None]
                assert bool(((got - want).abs() <= _bound(want, per_token, fmt, 1)).all())
                # and the page's scale holds every token it has now (nothing beyond the format's range)
                assert bool((got.abs() <= per_token * quant.FORMATS[fmt] * (1 + 1e-6)).all())


@pytest.mark.parametrize("rounding", ["nearest", "zero"])
def test_compaction_into_a_page_of_another_scale_requantizes_and_keeps_equal_scales_bytes(rounding):
    cache = _cache(torch.int8, page_size=2, num_kv_heads=1, num_layers=1, rounding=rounding)
    s = cache.add_sequence()
    for x in (1.27, 0.5, 12.7, 6.0):  # page 0 at scale 0.01, page 1 at scale 0.1
        k = torch.full((1, 1, 8), x)
        cache.write(0, cache.reserve(s, 1), k, torch.full((1, 1, 8), 0.3))
    v_bytes = cache.v_cache[0][:2, 0, 0, 0].tolist()  # V: one scale in both pages
    cache.compact(s, torch.tensor([True, False, True, False]))  # 12.7 moves into page 0
    k_scale, v_scale = cache.kv_scales(0)
    assert math.isclose(v_scale[0, 0] * 127, 0.3, rel_tol=1e-6)
    if rounding == "nearest":  # 12.7 is stored as 127 at 0.1, and page 0's 1.27 re-quantized there: 12.7 -> 13
        assert math.isclose(k_scale[0, 0].item(), 0.1, rel_tol=1e-6) and cache.k_cache[0][0, :, 0, 0].tolist() == [
            13,
            127,
        ]
    assert cache.v_cache[0][0, :, 0, 0].tolist() == v_bytes  # moved between pages of one scale: the same bytes
    assert cache.seq_len(s) == 2 and k_scale[1, 0] == 0  # page 1 went back: scale 0


@pytest.mark.parametrize("scales", ["page", "layer"])
def test_truncate_drop_and_free_zero_bytes_and_reset_the_scales_of_returned_pages(scales):
    gen = torch.Generator().manual_seed(2)
    cache = _cache(torch.int8, scales, page_size=4)
    a, b = _fill(cache, gen, [11, 9])
    page_a = cache.pages(a)
    cache.truncate(a, 5)  # keeps 6: page 2 goes back, page 1 keeps 2 tokens
    assert cache.k_cache[0][page_a[1], 2:].abs().sum() == 0 and cache.k_cache[0][page_a[2]].abs().sum() == 0
    if scales == "page":
        assert cache.kv_scales(0)[0][page_a[2]].abs().sum() == 0 and bool((cache.kv_scales(0)[0][page_a[1]] > 0).all())
    cache.drop_pages(b, [0])
    cache.free(a)
    cache.free(b)
    assert all(int(raw(t).abs().sum()) == 0 for t in (*cache.k_cache, *cache.v_cache))
    if scales == "page":
        assert all(float(s.sum()) == 0 for s in (*cache.quant.k_scales, *cache.quant.v_scales))


def test_a_prefix_cached_page_keeps_its_scale_until_it_is_reused():
    cache = _cache(torch.float8_e4m3fn, page_size=4, num_pages=3, prefix_caching=True)
    gen = torch.Generator().manual_seed(1)
    prompt = list(range(9))
    a = cache.add_sequence(token_ids=prompt)
    slots = cache.reserve(a, 9, token_ids=prompt)
    k, v = _kv(gen, 9, cache)
    for layer in range(2):
        cache.write(layer, slots, k, v)
    held, scales = cache.gather(0, a), [s.clone() for s in cache.kv_scales(0)]
    cache.free(a)
    b = cache.add_sequence(token_ids=prompt)  # revives pages 0 and 1, bytes and scales as they were
    assert cache.pages(b) == [0, 1] and torch.equal(cache.gather(0, b)[0], held[0][:8])
    assert all(torch.equal(s[:2], t[:2]) for s, t in zip(cache.kv_scales(0), scales))
    cache.free(b)
    c = cache.add_sequence()
    cache.reserve(c, 12)  # every page handed out again: zero bytes, scale 0
    assert all(float(s.abs().sum()) == 0 for s in cache.kv_scales(1)) and int(raw(cache.k_cache[1]).sum()) == 0


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("scales", ["page", "layer"])
def test_swap_moves_bytes_and_scales_so_they_come_back_identical(fmt, scales):
    gen = torch.Generator().manual_seed(4)
    cache = _cache(fmt, scales, page_size=4, num_pages=12, rounding="zero", prefix_caching=True)
    a, b = _fill(cache, gen, [10, 7], chunk=3)
    pages = cache.pages(a)
    stored = [raw(t[pages]).clone() for t in (*cache.k_cache, *cache.v_cache)]
    rows = [s[pages].clone() for layer in range(2) for s in cache.kv_scales(layer)]
    space = SwapSpace()
    space.swap_out(cache, a)
    _fill(cache, gen, [5])  # the freed pages go to another sequence meanwhile
    space.swap_in(cache, a)
    new = cache.pages(a)
    assert all(torch.equal(raw(t[new]), s) for t, s in zip((*cache.k_cache, *cache.v_cache), stored))
    assert all(torch.equal(s[new], r) for s, r in zip([s for layer in range(2) for s in cache.kv_scales(layer)], rows))
    assert space.swapped_in_tokens == space.swapped_out_tokens == 10


@pytest.mark.parametrize("fmt", FMTS, ids=str)
def test_rewind_restores_a_requantized_last_page(fmt):
    gen = torch.Generator().manual_seed(9)
    cache = _cache(fmt, page_size=8)
    (a,) = _fill(cache, gen, [5])
    for forked in (False, True):  # a writes in place into its last page; then a fork copies the shared page first
        s = cache.fork(a) if forked else a
        before = snapshot(cache, exact=False)  # rewind returns pages, not in the order they left
        mark = cache.mark(s)
        slots = cache.reserve(s, 4)
        k, v = _kv(gen, 4, cache)
        for layer in range(2):
            cache.write(layer, slots, k * 1000, v * 1000)  # every scale grows: the 5 tokens re-quantized
        cache.rewind(s, mark)
        assert snapshot(cache, exact=False) == before, snapshot(cache, exact=False).diff(before)


@pytest.mark.parametrize("length", [12, 10], ids=["whole-pages", "partial-page"])
def test_rewind_resets_the_scale_of_a_page_reserved_ahead(length):
    """growth="pow2" holds pages ahead of the tokens (3 of 4 used, bytes and scales 0); a failed forward's tokens
    land in them and grow their scales; after the rewind they hold no token again: scale 0, as a fresh page,
    so the next token is stored at its own scale (not the failed one's, 1000x coarser)."""
    gen = torch.Generator().manual_seed(4)
    cache = _cache(torch.int8, page_size=4, growth="pow2")
    (a,) = _fill(cache, gen, [length])
    assert len(cache.pages(a)) > -(-length // 4)  # pages reserved ahead
    before = snapshot(cache, exact=False)
    mark = cache.mark(a)
    slots = cache.reserve(a, 16 - length)  # up to the end of the page reserved ahead: no new page
    k, v = _kv(gen, len(slots), cache)
    for layer in range(2):
        cache.write(layer, slots, k * 1000, v * 1000)
    cache.rewind(a, mark)
    assert snapshot(cache, exact=False) == before, snapshot(cache, exact=False).diff(before)


@pytest.mark.parametrize("fmt", FMTS, ids=str)
@pytest.mark.parametrize("scales", ["page", "layer"])
def test_rollback_restores_bytes_and_scales_exactly(fmt, scales):
    gen = torch.Generator().manual_seed(8)
    cache = _cache(fmt, scales, page_size=4, num_pages=24, prefix_caching=True)
    seqs = list(_fill(cache, gen, [6, 9, 3], chunk=2))
    before = snapshot(cache)
    cache.checkpoint()
    fork = cache.fork(seqs[1])
    for s in (fork, seqs[0]):
        slots = cache.reserve(s, 3)
        k, v = _kv(gen, 3, cache)
        for layer in range(2):
            cache.write(layer, slots, k * 50, v)
    cache.compact(seqs[1], torch.rand(9, generator=gen) < 0.5)
    cache.truncate(seqs[0], 4)
    cache.free(seqs[2])
    _fill(cache, gen, [7], chunk=3)
    space = SwapSpace()
    space.swap_out(cache, fork)
    space.swap_in(cache, fork)
    assert snapshot(cache) != before
    cache.rollback()
    assert snapshot(cache) == before, snapshot(cache).diff(before)


@pytest.mark.parametrize("scales", ["page", "layer"])
def test_the_layered_cache_stores_8bit_pages_per_layer(scales):
    gen = torch.Generator().manual_seed(6)
    cache = LayeredKVCache(
        num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, kv_format=KVFormat(torch.int8, scales)
    )
    s = cache.add_sequence()
    slots = cache.reserve(s, 7)
    k = torch.randn(7, 2, 8, generator=gen)
    for layer in range(2):
        cache.write(layer, slots[layer], k * (layer + 1), k)
    assert cache.kv_scales(1)[0].shape == (16, 2) and cache.k_cache[0].dtype == torch.int8
    err = (cache.gather(1, s)[0] - 2 * k).abs().max()
    assert err <= cache.kv_scales(1)[0].max() / 2 + 1e-6
    cache.compact(s, torch.tensor([[True] * 3 + [False] * 4, [False] * 4 + [True] * 3]))
    assert torch.allclose(cache.gather(1, s)[0], 2 * k[4:], atol=float(cache.kv_scales(1)[0].max()))
    assert cache.page_bytes == 2 * quant.page_bytes(
        torch.int8, page_size=4, num_layers=1, num_kv_heads=2, head_dim=8, scales=scales
    )
    with pytest.raises(ValueError, match="share one pool"):
        LayeredKVCache(
            num_layers=2,
            num_pages=2,
            page_size=2,
            num_kv_heads=1,
            head_dim=2,
            kv_format=KVFormat(torch.int8, k_scale=[1.0, 2.0]),
        )


def test_page_summaries_bound_the_keys_as_stored():
    gen = torch.Generator().manual_seed(12)
    cache = _cache(torch.float8_e5m2, page_size=4, page_summaries=True)
    (s,) = _fill(cache, gen, [10])
    k = cache.gather(0, s)[0]
    for page, lo, hi in zip(cache.pages(s), k.split(4), k.split(4)):
        assert bool(
            (cache.summaries.k_min[0][page] <= lo.amin(0)).all()
            and (cache.summaries.k_max[0][page] >= hi.amax(0)).all()
        )


@pytest.mark.parametrize("bits, ratio", [(torch.float16, 2), (torch.float32, 4)])
def test_a_pool_of_the_same_bytes_holds_2x_or_4x_the_tokens_less_the_scales(bits, ratio):
    geo = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M
    floating = PagedKVCache(num_pages=1, page_size=16, dtype=bits, **geo)
    budget = 1000 * floating.page_bytes
    for scales in ("layer", "page"):
        q8 = PagedKVCache(num_pages=1, page_size=16, dtype=bits, kv_format=KVFormat(torch.int8, scales), **geo)
        scale_bytes = 2 * 30 * 3 * 4 if scales == "page" else 0
        assert q8.page_bytes == 16 * 2 * 30 * 3 * 64 + scale_bytes
        pages = budget // q8.page_bytes
        if scales == "layer":  # the per-layer scales belong to the pool, not to a page
            assert pages == ratio * 1000
        else:  # 16-token pages: the scales cost under 1%
            assert ratio * 1000 * 0.99 < pages < ratio * 1000


def test_float64_compute_dequantizes_exactly():
    cache = _cache(torch.int8, dtype=torch.float64, num_layers=1)
    gen = torch.Generator().manual_seed(0)
    (s,) = _fill(cache, gen, [6])
    page = cache.pages(s)[0]
    k = cache.gather(0, s)[0]
    assert k.dtype == torch.float64
    assert torch.equal(k[:4], cache.k_cache[0][page].double() * cache.kv_scales(0)[0][page][None, :, None].double())
    assert torch.equal(
        values(cache.k_cache[0][page], cache.kv_scales(0)[0][page][None, :, None], torch.float32), k[:4].float()
    )


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: _cache(torch.float16), ValueError, "dtype must be one of [torch.float8_e4m3fn"),
        (
            lambda: PagedKVCache(num_layers=1, num_pages=1, page_size=1, num_kv_heads=1, head_dim=1, kv_format="fp16"),
            ValueError,
            "'fp8_e5m2'",
        ),
        (lambda: _cache(torch.int8, "layer", k_scale=0.0), ValueError, "k_scale must be finite and > 0, got 0.0"),
        (lambda: _cache(torch.int8, "layer", k_scale=-1), ValueError, "got -1.0"),
        (lambda: _cache(torch.int8, "layer", k_scale=math.inf), ValueError, "got inf"),
        (
            lambda: _cache(torch.int8, "layer", k_scale=[1.0, math.nan]),
            ValueError,
            "k_scale[1] must be finite and > 0, got nan",
        ),
        (lambda: _cache(torch.int8, "layer", k_scale=[1.0, 2.0, 3.0]), ValueError, "one per layer (2), got 3 values"),
        (lambda: _cache(torch.int8, "page", k_scale=2.0), ValueError, "scales='page' grows each page's own"),
        (lambda: _cache(torch.int8, "token"), ValueError, "scales must be one of ['layer', 'page'], got 'token'"),
        (lambda: _cache(torch.int8, rounding="up"), ValueError, "rounding must be one of"),
        (lambda: KVFormat(torch.int8, k_scale=True), TypeError, "got bool"),
    ],
)
def test_bad_formats_are_refused_naming_the_argument(make, error, words):
    with pytest.raises(error) as info:
        make()
    assert words in str(info.value)


def test_vllm_names_and_dtypes_normalize_to_a_format():
    assert quant.kv_format("fp8") == KVFormat(torch.float8_e4m3fn) == quant.kv_format(torch.float8_e4m3fn)
    assert quant.kv_format("fp8_e5m2").dtype == torch.float8_e5m2 and quant.kv_format(None) is None
    cache = PagedKVCache(num_layers=1, num_pages=1, page_size=1, num_kv_heads=1, head_dim=1, kv_format="fp8_e4m3")
    assert cache.k_cache[0].dtype == torch.float8_e4m3fn and cache.dtype == torch.float32


def test_a_refused_write_leaves_the_cache_unchanged():
    gen = torch.Generator().manual_seed(1)
    cache = _cache(torch.int8)
    (s,) = _fill(cache, gen, [5])
    slots = cache.reserve(s, 2)
    before = snapshot(cache)
    for k in (torch.ones(2, 2, 8, dtype=torch.int8), torch.ones(2, 2, 8).half(), torch.ones(3, 2, 8)):
        with pytest.raises((TypeError, ValueError)):
            cache.write(0, slots, k, k)
        assert snapshot(cache) == before
    with pytest.raises(ValueError, match="layer must be in"):
        cache.kv_scales(2)


def test_rewind_leaves_a_copied_last_page_to_its_other_holder():
    """A mark keeps the last page of a sequence, to put back tokens a grown scale re-quantized. If the sequence
    copied that page since (it was shared), the page is another sequence's alone: one that wrote into it since
    keeps what it wrote when the first one rewinds."""
    cache = _cache(torch.int8, page_size=2, num_layers=1, growth="pow2")
    full = torch.ones(5, 2, 8)
    a = cache.add_sequence()
    cache.write(0, cache.reserve(a, 5), full, full)  # pages [0, 1, 2] and 3 reserved ahead
    b = cache.fork(a)  # shares pages 0-2
    mark = cache.mark(a)
    slots = cache.reserve(a, 3)  # copies shared page 2, then writes into page 3
    cache.write(0, slots, full[:3] * 5, full[:3] * 5)
    assert cache.pages(a) == [0, 1, 4, 3] and cache.pages(b) == [0, 1, 2]
    k = torch.full((1, 2, 8), 2.0)
    cache.write(0, cache.reserve(b, 1), k, k)  # b, page 2's one holder now, writes in place
    cache.rewind(a, mark)
    assert cache.pages(a) == [0, 1, 2, 3]
    assert torch.equal(cache.gather(0, b)[0][5], k[0])


def test_page_summaries_bound_keys_requantized_by_a_grown_page_scale():
    """With a scale per page, a write that grows the scale re-quantizes the page's earlier keys: each may move
    by up to half the new scale, out of the min / max folded when it was written; the summaries fold them again."""
    gen = torch.Generator().manual_seed(3)
    cache = _cache(torch.int8, page_size=8, num_layers=1, page_summaries=True)
    s = cache.add_sequence()
    for size in (1.0, 1.5, 3.0, 7.0, 20.0, 50.0):  # every token needs a larger scale
        k, v = _kv(gen, 1, cache, spread=False)
        cache.write(0, cache.reserve(s, 1), k * size, v)
    k = cache.gather(0, s)[0]  # [6, Hkv, D] as stored
    page = cache.pages(s)[0]
    assert bool((cache.summaries.k_min[0][page] <= k.amin(0)).all()), cache.summaries.k_min[0][page] - k.amin(0)
    assert bool((cache.summaries.k_max[0][page] >= k.amax(0)).all()), cache.summaries.k_max[0][page] - k.amax(0)
