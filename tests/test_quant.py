"""8-bit K/V (`paged_ref.quant`): round trips within the format's rounding bound on fresh random
inputs, saturation, scales per layer and per page and KV head on a real page layout, page bytes,
and the errors. (The bytes against vLLM's CPU cache write: tests/test_vllm_quant.py.)"""

import math

import numpy as np
import pytest
import torch

import paged_ref as pr
from paged_ref import quant

FMTS = list(quant.FORMATS)
MANTISSA = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, smallest normal exponent


def _bound(y: torch.Tensor, fmt, rounding: str) -> torch.Tensor:
    """The most a value ``y`` (already divided by its scale, float64) moves when stored: half a step
    between codes to nearest, a whole step toward zero."""
    whole = 1.0 if rounding == "zero" else 0.5
    if fmt == torch.int8:
        return torch.full_like(y, whole)
    m, emin = MANTISSA[fmt]
    exponent = torch.floor(torch.log2(y.abs().clamp_min(2.0**emin)))  # subnormals share the smallest normal's step
    return whole * 2.0 ** (exponent - m)


def _values(shape, gen) -> torch.Tensor:
    """Normal values times 10^U(-6, 3): many binades, subnormals included at scale 1."""
    return torch.randn(shape, generator=gen) * 10.0 ** (torch.rand(shape, generator=gen) * 9 - 6)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rounding", ["nearest", "zero"])
@pytest.mark.parametrize("seed", range(4))
def test_round_trip_within_the_formats_rounding(fmt, rounding, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _values((64, 3, 16), gen)  # [tokens, num_kv_heads, head_dim]
    for scale in (1.0, 0.37, quant.calibrate(x, fmt)):
        q = quant.quantize(x, scale, fmt, rounding=rounding)
        assert q.dtype == fmt and q.shape == x.shape
        s = float(scale)
        y = x.double() / s
        inside = y.abs() <= quant.FORMATS[fmt]
        err = (quant.dequantize(q, scale).double() - x.double()).abs() / s
        slack = 1e-6 * y.abs() + 1e-30  # float32's rounding of x / scale and of q * scale
        assert bool((err <= _bound(y, fmt, rounding) + slack)[inside].all())
        if rounding == "zero":  # never away from zero
            assert bool((quant.dequantize(q, scale).abs() <= x.abs() * (1 + 1e-6))[inside].all())
    assert quant.count_saturated(x, quant.calibrate(x, fmt), fmt) == 0


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_to_nearest_is_torchs_own_cast(fmt):
    x = _values((1000,), torch.Generator().manual_seed(5))
    assert torch.equal(quant.quantize(x, 1.0, fmt).view(torch.uint8), x.to(fmt).view(torch.uint8))
    assert torch.equal(quant.quantize(x, 0.25, fmt).view(torch.uint8), (x * 4).to(fmt).view(torch.uint8))


@pytest.mark.parametrize("fmt", FMTS)
def test_beyond_the_range_saturates_at_the_formats_max(fmt):
    top = quant.FORMATS[fmt]
    x = torch.tensor([3 * top, -5 * top, math.inf, -math.inf, math.nan, 0.5 * top, top])
    back = quant.dequantize(quant.quantize(x, 2.0, fmt), 2.0)
    assert back[:5].tolist() == [2 * top, -2 * top, 2 * top, -2 * top, 2 * top]  # NaN: +max, as vLLM's CPU write
    assert quant.dequantize(quant.quantize(x[6:], 1.0, fmt), 1.0).item() == top  # the max itself is held
    assert quant.count_saturated(x, 2.0, fmt) == 5 and quant.count_saturated(x, 10.0, fmt) == 3
    if fmt == torch.float8_e5m2:  # torch's own cast overflows to inf here; the clamp keeps it finite
        assert x[:1].to(fmt).float().isinf().all()


def test_dequantize_is_the_exact_product_in_float64_and_float32s_in_narrower_types():
    x = _values((256,), torch.Generator().manual_seed(9))
    for fmt in FMTS:
        q, scale = quant.quantize(x, 0.37, fmt), torch.tensor(0.37, dtype=torch.float32)
        assert torch.equal(quant.dequantize(q, 0.37, torch.float64), q.double() * scale.double())
        assert torch.equal(quant.dequantize(q, 0.37), q.float() * scale)
        assert torch.equal(quant.dequantize(q, 0.37, torch.bfloat16), (q.float() * scale).bfloat16())


def test_requantizing_what_was_read_back_keeps_the_bytes_to_nearest_not_toward_zero():
    """Why a copy (copy-on-write, swap, compaction) must move the bytes and their scale, not the values:
    ``q * scale * (1 / scale)`` lands a hair below ``q`` about as often as above; to nearest it rounds back,
    toward zero it can drop one code."""
    x = torch.randn(20000, generator=torch.Generator().manual_seed(2)) * 3
    for fmt in FMTS:
        for scale in (0.37, 0.01, 3.3):
            q = quant.quantize(x, scale, fmt)
            back = quant.quantize(quant.dequantize(q, scale), scale, fmt)
            assert torch.equal(back.view(torch.uint8), q.view(torch.uint8)), (fmt, scale)
    q = quant.quantize(x, 0.01, torch.float8_e4m3fn, rounding="zero")  # many at +-448: 448 * 0.01 * 100 < 448
    back = quant.quantize(quant.dequantize(q, 0.01), 0.01, torch.float8_e4m3fn, rounding="zero")
    assert (back.float().abs() < q.float().abs()).sum() > 1000


def test_int8_is_symmetric_and_rounds_ties_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, -1000.0, 126.5])
    assert quant.quantize(x, 1.0, torch.int8).tolist() == [0, 2, 2, 0, -2, -127, 126]
    assert quant.quantize(x, 1.0, torch.int8, rounding="zero").tolist() == [0, 1, 2, 0, -2, -127, 126]


def _filled_cache():
    """A page layout as the cache holds it: sequences of 5, 8 and 1 tokens in 4-token pages, KV head 0
    a thousand times smaller than head 1 (as a model's heads differ)."""
    cache = pr.PagedKVCache(num_layers=1, num_pages=6, page_size=4, num_kv_heads=2, head_dim=8)
    gen = torch.Generator().manual_seed(0)
    for n in (5, 8, 1):
        slots = cache.reserve(cache.add_sequence(), n)
        k = torch.randn(n, 2, 8, generator=gen) * torch.tensor([1e-3, 1.0])[:, None]  # [n, num_kv_heads, head_dim]
        cache.write(0, slots, k, k)
    return cache


@pytest.mark.parametrize("fmt", FMTS)
def test_a_scale_per_page_and_kv_head_on_the_caches_pages(fmt):
    cache = _filled_cache()
    pages = cache.k_cache[0]  # [num_pages, page_size, num_kv_heads, head_dim]
    scales = quant.calibrate(pages, fmt, dim=(1, 3))  # [num_pages, num_kv_heads]
    assert scales.shape == (6, 2) and scales.dtype == torch.float32
    for p in range(6):
        for h in range(2):
            assert scales[p, h] == quant.calibrate(pages[p, :, h], fmt)  # one page, one head, on its own
    assert (scales[-1] == 1.0).all()  # a page never written: all zeros, scale 1
    per_page = scales[:, None, :, None]  # broadcasts against [num_pages, page_size, num_kv_heads, head_dim]
    q = quant.quantize(pages, per_page, fmt)
    assert q.shape == pages.shape and quant.count_saturated(pages, per_page, fmt) == 0
    y = pages.double() / per_page
    assert bool(((quant.dequantize(q, per_page) - pages).abs() / per_page <= _bound(y, fmt, "nearest") + 1e-6).all())
    # one int8 scale for the layer, set by head 1, rounds head 0's small values to 0 (fp8's exponent holds them)
    layer, head0, its_own = quant.calibrate(pages, fmt), pages[:, :, 0], scales[:, None, :1]
    err_layer = (quant.dequantize(quant.quantize(head0, layer, fmt), layer) - head0).abs().max()
    err_page = (quant.dequantize(quant.quantize(head0, its_own, fmt), its_own) - head0).abs().max()
    assert (err_page * 10 < err_layer) == (fmt == torch.int8)


def test_calibrate_maps_the_largest_magnitude_to_the_max_without_saturating():
    for seed in range(50):
        x = _values((40,), torch.Generator().manual_seed(seed))
        for fmt in FMTS:
            scale = quant.calibrate(x, fmt)
            assert quant.count_saturated(x, scale, fmt) == 0
            assert quant.dequantize(quant.quantize(x, scale, fmt), scale).abs().max() >= x.abs().max() * 0.87
    assert quant.calibrate(torch.tensor([0.0, math.nan, math.inf, -2.0]), torch.int8).item() == pytest.approx(2 / 127)
    assert quant.calibrate(torch.zeros(3), torch.float8_e5m2).item() == 1.0


def test_page_bytes_count_the_values_in_one_byte_and_the_scales():
    geo = dict(num_layers=2, num_kv_heads=2, head_dim=8)
    float32_page = pr.PagedKVCache(num_pages=1, page_size=4, **geo).page_bytes
    for fmt in FMTS:
        assert quant.page_bytes(fmt, page_size=4, **geo) * 4 == float32_page
        assert quant.page_bytes(fmt, page_size=4, **geo, scales="page") == float32_page // 4 + 2 * 2 * 2 * 4


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: quant.quantize(torch.ones(2), 1.0, torch.float16), ValueError, "fmt must be one of"),
        (lambda: quant.quantize(torch.ones(2), 1.0, "fp8"), ValueError, "torch.float8_e4m3fn"),
        (lambda: quant.quantize(torch.ones(2), 0.0, torch.int8), ValueError, "scale must be finite and > 0, got 0.0"),
        (lambda: quant.quantize(torch.ones(2), -2, torch.int8), ValueError, "got -2.0"),
        (lambda: quant.quantize(torch.ones(2), math.nan, torch.int8), ValueError, "got nan"),
        (lambda: quant.quantize(torch.ones(2), math.inf, torch.int8), ValueError, "got inf"),
        (lambda: quant.quantize(torch.ones(2), torch.tensor([1.0, 0.0]), torch.int8), ValueError, "(1 such)"),
        (lambda: quant.quantize(torch.ones(2), True, torch.int8), TypeError, "got bool"),
        (lambda: quant.quantize(torch.ones(2), "1", torch.int8), TypeError, "got str"),
        (lambda: quant.quantize(torch.ones(2), torch.ones(2, dtype=torch.int32), torch.int8), TypeError, "int32"),
        (lambda: quant.quantize(torch.ones(2), 1.0, torch.int8, rounding="up"), ValueError, "got 'up'"),
        (lambda: quant.quantize(torch.ones(2, dtype=torch.int64), 1.0, torch.int8), TypeError, "x must be a floating"),
        (lambda: quant.dequantize(torch.ones(2), 1.0), TypeError, "got tensor of shape [2] and dtype torch.float32"),
        (lambda: quant.calibrate([0.5, -2.0], torch.int8), TypeError, "x must be a floating tensor, got list"),
        (lambda: quant.calibrate(3.0, torch.int8), TypeError, "x must be a floating tensor, got float"),
        (lambda: quant.calibrate(np.ones(2), torch.int8), TypeError, "x must be a floating tensor, got ndarray"),
        (
            lambda: quant.calibrate(torch.tensor([1, 2]), torch.int8),
            TypeError,
            "got tensor of shape [2] and dtype torch.int64",
        ),
        (lambda: quant.calibrate(torch.tensor([True]), torch.int8), TypeError, "x must be a floating tensor"),
        (lambda: quant.calibrate(torch.ones(2), "int8"), ValueError, "fmt must be one of"),
        (lambda: quant.dequantize(torch.ones(2, dtype=torch.int8), 0), ValueError, "scale must be finite and > 0"),
        (lambda: quant.check_scale(-1.0, "k_scale"), ValueError, "k_scale must be finite and > 0, got -1.0"),
        (
            lambda: quant.page_bytes(torch.int8, page_size=0, num_layers=1, num_kv_heads=1, head_dim=1),
            ValueError,
            "page_size",
        ),
        (
            lambda: quant.page_bytes(torch.int8, page_size=1, num_layers=1, num_kv_heads=1, head_dim=1, scales="head"),
            ValueError,
            "got 'head'",
        ),
    ],
)
def test_bad_input_is_refused_with_what_was_expected_and_given(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


@pytest.mark.parametrize(
    "dim, error, given",
    [
        (3, ValueError, "in [-3, 2], got 3"),
        (-4, ValueError, "in [-3, 2], got -4"),
        ((1, 3), ValueError, "got (1, 3)"),
        ((0, 0), ValueError, "got (0, 0)"),
        ((1, -2), ValueError, "got (1, -2)"),  # the same dim twice
        ((), ValueError, "one or more distinct dims of x, in [-3, 2], got ()"),
        (1.0, TypeError, "None, an int or a tuple of ints, got float (1.0)"),
        ("1", TypeError, "got str ('1')"),
        (True, TypeError, "got bool (True)"),
        ((0, 1.5), TypeError, "got tuple ((0, 1.5))"),
        ((False,), TypeError, "got tuple ((False,))"),
        (torch.tensor(1), TypeError, "got Tensor"),
    ],
)
def test_calibrate_refuses_a_dim_that_is_not_dims_of_x_naming_it(dim, error, given):
    """Before anything is computed: torch's amax would raise its own error for these, or take ``()`` as all of x."""
    with pytest.raises(error) as info:
        quant.calibrate(torch.ones(2, 3, 4), torch.int8, dim=dim)
    assert str(info.value).startswith("dim must ") and given in str(info.value)


def test_calibrate_takes_dims_as_ints_lists_or_negative_and_refuses_an_empty_reduction():
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    per_page = quant.calibrate(x, torch.int8, dim=(0, 2))
    for dim in ([0, 2], (-3, -1), (np.int64(2), 0)):
        assert torch.equal(quant.calibrate(x, torch.int8, dim=dim), per_page)
    assert torch.equal(quant.calibrate(x, torch.int8, dim=np.int64(1)), quant.calibrate(x, torch.int8, dim=1))
    assert quant.calibrate(torch.tensor(-2.54), torch.int8, dim=0).item() == pytest.approx(0.02)  # 0-d: dim 0 or -1
    with pytest.raises(ValueError, match=r"^dim must .* in \[-1, 0\], got 1$"):
        quant.calibrate(torch.tensor(1.0), torch.int8, dim=1)
    assert quant.calibrate(torch.ones(0, 3), torch.int8, dim=1).shape == (0,)  # no value to reduce, none reduced
    for shape, dim in (((0,), None), ((0, 3), 0)):
        with pytest.raises(ValueError, match=rf"^x must hold a value over dim={dim}, got shape \[{shape[0]}"):
            quant.calibrate(torch.ones(shape), torch.int8, dim=dim)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: quant.quantize(torch.ones(4), torch.ones(3, 1), torch.int8), ValueError, "got shape [3, 1]"),
        (lambda: quant.quantize(torch.ones(4), torch.ones(3), torch.int8), ValueError, "x's shape [4], got shape [3]"),
        (lambda: quant.count_saturated(torch.ones(4), torch.ones(2, 4), torch.int8), ValueError, "got shape [2, 4]"),
        (
            lambda: quant.dequantize(torch.ones(4, dtype=torch.int8), torch.ones(3, 1)),
            ValueError,
            "scale must broadcast to q's shape [4], got shape [3, 1]",
        ),
        (lambda: quant.dequantize(torch.ones(2, dtype=torch.int8), 1.0, torch.int8), ValueError, "got torch.int8"),
        (lambda: quant.dequantize(torch.ones(2, dtype=torch.int8), 1.0, "float32"), ValueError, "got 'float32'"),
        (
            lambda: quant.dequantize(torch.ones(2, dtype=torch.int8), 1.0, torch.float8_e4m3fn),
            ValueError,
            "dtype must be torch.float16, bfloat16, float32 or float64, got torch.float8_e4m3fn",
        ),
        (lambda: quant.KVFormat(torch.int8).layer_scales(0), ValueError, "num_layers must be >= 1, got 0"),
        (lambda: quant.KVFormat(torch.int8).layer_scales(2.0), TypeError, "num_layers must be an int, got float"),
        (lambda: quant.KVFormat(torch.int8).layer_scales(True), TypeError, "num_layers must be an int, got bool"),
    ],
)
def test_calibrates_siblings_refuse_a_scale_that_would_reshape_x_a_dtype_and_a_layer_count_naming_them(
    call, error, words
):
    """A scale broadcasting to more than x's shape gave a quantized tensor of another shape (the doc says x's);
    dequantize's dtype an integer or a string, and layer_scales' num_layers, met torch's own errors or ran on."""
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


def test_numpy_scalars_are_scales_like_python_numbers():
    import numpy as np

    assert quant.KVFormat(torch.int8, k_scale=np.float32(0.5), v_scale=np.int64(2)) == quant.KVFormat(
        torch.int8, k_scale=0.5, v_scale=2.0
    )
    assert quant.quantize(torch.ones(2), np.float64(0.5), torch.int8).tolist() == [2, 2]
    with pytest.raises(TypeError, match="scale must be a finite number > 0 or a tensor of them, got bool"):
        quant.quantize(torch.ones(2), True, torch.int8)
