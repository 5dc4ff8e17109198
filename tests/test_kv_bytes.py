"""Notebook 11's lab code: the formats' facts, storing pages at a scale granularity, the bytes a token takes,
and the widget's callback (a pure function of its data and choices)."""

from __future__ import annotations

import pytest
import torch

from paged_ref import quant
from paged_ref.lab import kv_bytes as kb
from paged_ref.lab.viz import kv_bytes as vk
from paged_ref.lab.widgets.kv_bytes import FORMAT_NAMES, bytes_view

EIGHT_BIT = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


@pytest.mark.parametrize("fmt", EIGHT_BIT, ids=str)
def test_format_facts_agree_with_the_values_the_format_stores(fmt):
    facts, values = kb.format_facts(fmt), kb.representable(fmt)
    assert facts["bits"] == 8 and 1 + facts["exponent_bits"] + facts["mantissa_bits"] == 8
    assert values.max().item() == facts["max"] == quant.FORMATS[fmt]
    assert values.min().item() == facts["min_subnormal"]
    if fmt != torch.int8:  # a float's neighbours among the normals are eps apart (relative)
        normal = values[values >= facts["min_normal"]]
        assert (normal[1:] / normal[:-1] - 1).max().item() == pytest.approx(facts["relative_step"])


def _pages(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 4, 2, 8, generator=g) * scale  # [num_pages, page_size, Hkv, D]


@pytest.mark.parametrize("fmt", EIGHT_BIT, ids=str)
@pytest.mark.parametrize("granularity", kb.GRANULARITIES)
def test_stored_is_quantize_then_dequantize_at_the_granularity(fmt, granularity):
    x = _pages()
    s = kb.stored(x, fmt, granularity)
    scale = s["scale"]
    assert scale.shape == {"one": (), "layer": (), "page": (3, 1, 2, 1)}[granularity]
    expected = quant.dequantize(quant.quantize(x, scale, fmt), scale)
    assert torch.equal(s["values"], expected)
    assert s["rel_error"] == pytest.approx(float((expected - x).norm() / x.norm()))
    if granularity != "one":  # calibrated: nothing saturates
        assert s["saturated"] == 0


def test_saturation_is_counted_and_a_float_cast_takes_no_scale():
    x = _pages(scale=1000.0)  # far beyond e4m3's 448 at scale 1
    s = kb.stored(x, torch.float8_e4m3fn, "one")
    assert s["saturated"] == int((x.abs() > 448).sum()) > 0
    assert s["values"].abs().max().item() == 448.0
    b = kb.stored(x, torch.bfloat16)
    assert torch.equal(b["values"], x.bfloat16().float()) and b["saturated"] == 0


def test_token_bytes_is_the_page_arithmetic():
    geo = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16)
    assert kb.token_bytes(torch.float32, "one", **geo) == 2 * 30 * 3 * 64 * 4
    assert kb.token_bytes(torch.bfloat16, "page", **geo) == 2 * 30 * 3 * 64 * 2  # no scale
    assert kb.token_bytes(torch.int8, "layer", **geo) == 2 * 30 * 3 * 64
    page = quant.page_bytes(torch.int8, scales="page", **geo)
    assert kb.token_bytes(torch.int8, "page", **geo) == page / 16 == 2 * 30 * 3 * 64 + 2 * 30 * 3 * 4 / 16


def _kv():
    g = torch.Generator().manual_seed(1)
    ks = [torch.randn(37, 2, 8, generator=g) * (i + 1) for i in range(3)]  # [n, Hkv, D] per layer
    return kb.RealKV.from_tokens(ks, [k / 10 for k in ks], page_size=8, note="random")


def test_real_kv_pages_hold_the_tokens_then_zeros():
    kv = _kv()
    assert kv.ks[0].shape == (5, 8, 2, 8) and kv.num_tokens == 37
    assert kv.ks[2].flatten(0, 1)[37:].eq(0).all()


@pytest.mark.parametrize("fmt", list(FORMAT_NAMES))
def test_the_widget_callback_counts_whole_pages_and_stores_one_page(fmt):
    kv = _kv()
    fig, stats = bytes_view(kv, fmt, "page", pool_mib=1, context=20, layer=2, page=1)
    per_token = kb.token_bytes(FORMAT_NAMES[fmt], "page", num_layers=3, num_kv_heads=2, head_dim=8, page_size=8)
    assert stats["bytes_per_token"] == per_token and stats["float32_bytes_per_token"] == 3 * 2 * 2 * 8 * 4
    assert stats["sequences"] == 2**20 // (24 * per_token)  # 20 tokens take 3 pages of 8
    assert stats["float32_sequences"] == 2**20 // (24 * 384)
    true = kv.ks[2][1]
    back = kb.stored(kv.ks[2], FORMAT_NAMES[fmt], "page")["values"][1]
    assert stats["page_rel_error"] == pytest.approx(float((back - true).norm() / true.norm()))
    again = bytes_view(kv, fmt, "page", pool_mib=1, context=20, layer=2, page=1)[1]
    assert again == stats and len(fig.axes) >= 3  # pure: the same choices, the same numbers


def test_the_widget_refuses_bad_choices_by_name():
    kv = _kv()
    for kwargs, match in [
        (dict(fmt="fp4"), "fmt"),
        (dict(granularity="token"), "granularity"),
        (dict(layer=3), r"layer must be in \[0, 3\)"),
        (dict(page=5), r"page must be in \[0, 5\)"),
        (dict(pool_mib=0), "pool_mib"),
    ]:
        args = dict(fmt="int8", granularity="page", pool_mib=1, context=20, layer=0) | kwargs
        with pytest.raises((ValueError, TypeError), match=match):
            bytes_view(kv, **args)


def test_the_figures_draw_from_their_rows():
    kv = _kv()
    rows = kb.error_rows(kv, [torch.float8_e4m3fn, torch.int8, torch.bfloat16])
    assert len(rows) == (3 + 3 + 1) * 2 * 3  # (format, granularity) x K/V x layers
    assert len(vk.error_figure(rows).axes) == 2
    grids = {"e4m3": kb.representable(torch.float8_e4m3fn)}
    assert len(vk.grid_figure(grids, kv.ks[0], "|K|").axes) == 2


def test_the_scales_figure_draws_a_cache_with_scales_per_page():
    from paged_ref.cache import PagedKVCache
    from paged_ref.quant import KVFormat

    cache = PagedKVCache(
        num_layers=1,
        num_pages=4,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        kv_format=KVFormat(torch.int8, scales="page"),
    )
    s = cache.add_sequence()
    k = _pages().flatten(0, 1)[:6]  # [6 tokens, 2 heads, 8]
    cache.write(0, cache.reserve(s, 6), k, k)
    ks, vs = cache.kv_scales(0)
    assert (ks[2:] == 0).all() and (ks[:2] > 0).all()  # two pages hold tokens
    assert len(vk.scales_figure(ks, vs, {0: "A", 1: "A"}).axes) == 2  # the grid and its colour bar
