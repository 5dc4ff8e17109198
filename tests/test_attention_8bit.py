"""The 8-bit page contract every attention backend follows (`paged_ref.attention._checks.check_page_scales`):
8-bit K/V pages with float32 scales ``[num_pages, num_kv_heads]``, read as ``byte.float() * scale``. The
reference is the oracle: on 8-bit pages it equals the reference on the same values stored in float32."""

from __future__ import annotations

import pytest
import torch
from attention_cases import make_decode_case, make_prefill_case, quantize_case, rel_error

from paged_ref import quant
from paged_ref.attention import reference_paged_decode, reference_paged_prefill

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


def _dequantized(case):
    """The same case with its 8-bit pages stored as float32 values (what the bytes stand for)."""
    k = quant.dequantize(case.k_cache, case.k_scale[:, None, :, None])
    v = quant.dequantize(case.v_cache, case.v_scale[:, None, :, None])
    return (case.q, k, v, *case.args[3:])


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("scales", ["page", "layer"])
@pytest.mark.parametrize("page_size, layout", [(1, (2, 4)), (8, (1, 4)), (16, (2, 1))])
def test_reference_on_8bit_pages_is_the_reference_on_their_values(fmt, scales, page_size, layout):
    for make in (make_decode_case, make_prefill_case):
        case = quantize_case(
            make(seed=page_size, batch=5, page_size=page_size, num_kv_heads=layout[0], group=layout[1], head_dim=32),
            fmt,
            scales=scales,
        )
        f = reference_paged_decode if case.q_lens is None else reference_paged_prefill
        out = f(*case.args, **case.scales)
        assert out.dtype == case.q.dtype and torch.equal(out, f(*_dequantized(case)))  # the same float32 values
        assert rel_error(out, case.expected()) < 1e-5  # and float64 attention on what the bytes hold


def test_a_per_layer_scale_is_one_value_expanded():
    case = make_decode_case(seed=3, batch=3, page_size=4, num_kv_heads=2, group=2, head_dim=16)
    q8 = quantize_case(case, torch.float8_e4m3fn, scales="layer")
    assert q8.k_scale.stride() == (0, 0)
    out = reference_paged_decode(*q8.args, **q8.scales)
    assert rel_error(out, q8.expected()) < 1e-5
    assert rel_error(out, case.expected()) < 0.1  # 3 mantissa bits: close to the float32 pages' answer


def _errors(case, **scales):
    with pytest.raises((TypeError, ValueError)) as err:
        reference_paged_decode(*case.args, **scales)
    return str(err.value)


def test_bad_page_scales_are_refused_naming_the_argument():
    case = make_decode_case(seed=1, batch=2, page_size=4, num_kv_heads=2, group=1, head_dim=8)
    q8 = quantize_case(case, torch.int8)
    num_pages = case.k_cache.shape[0]
    assert "k_scale must be a float32 tensor" in _errors(q8)  # 8-bit pages without scales
    assert "k_scale must be None" in _errors(case, k_scale=q8.k_scale, v_scale=q8.v_scale)  # float pages
    half = q8.v_scale.half()
    assert "v_scale must be a float32 tensor with torch.int8 pages, got dtype torch.float16" in _errors(
        q8, k_scale=q8.k_scale, v_scale=half
    )
    assert f"k_scale must have shape [num_pages, num_kv_heads] = [{num_pages}, 2], got (2, {num_pages})" in _errors(
        q8, k_scale=q8.k_scale.T.contiguous(), v_scale=q8.v_scale
    )
    mixed = (case.q, q8.k_cache, q8.v_cache.view(torch.float8_e4m3fn), *case.args[3:])
    with pytest.raises(TypeError, match="v_cache must have k_cache's 8-bit dtype"):
        reference_paged_decode(*mixed, **q8.scales)
    with pytest.raises(TypeError, match="k_cache must have the same dtype as q"):
        reference_paged_decode(case.q, case.k_cache.half(), case.v_cache.half(), *case.args[3:])
