"""Every attention backend on 8-bit pages (issue 61's contract, `paged_ref.attention._checks.check_page_scales`)
against the reference on the same pages: the same bytes times the same float32 scales, so the backends differ
from the reference only by their attention's own float32 rounding.

The grid: the three formats, both scale kinds ("page": one per page and KV head; "layer": one value expanded,
strides 0), page sizes 1 to 64 with GQA, MQA and MHA layouts, ragged lengths and junk in the unowned slots
(`attention_cases`). The cases are built once per module and shared by the backends.
"""

import functools

import pytest
import torch
from attention_cases import make_decode_case, make_prefill_case, quantize_case, rel_error

from paged_ref.attention.cpu_paged import cpu_paged_decode, cpu_paged_packed, cpu_paged_prefill, kernel
from paged_ref.attention.reference import reference_paged_decode, reference_paged_prefill
from paged_ref.attention.sdpa import sdpa_paged_decode, sdpa_paged_prefill

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
SCALES = ["page", "layer"]
SHAPES = [(1, (2, 4), 32), (8, (1, 4), 64), (16, (2, 2), 32), (64, (2, 1), 16)]  # page size, (Hkv, group), D
TOL = 1e-5  # against the reference on the same pages: float32 rounding of the attention only
GRID = [
    pytest.param(fmt, scales, shape, id=f"{str(fmt)[6:]}-{scales}-p{shape[0]}")
    for fmt in FORMATS
    for scales in SCALES
    for shape in SHAPES
]


@functools.cache
def case(mode: str, fmt: torch.dtype, scales: str, shape: tuple, dtype=torch.float32):
    """A decode or prefill case on 8-bit pages and the reference's answer on them."""
    page_size, (num_kv_heads, group), head_dim = shape
    make = make_decode_case if mode == "decode" else make_prefill_case
    seed = page_size * 7 + num_kv_heads + group + head_dim
    fresh = make(seed=seed, batch=5, page_size=page_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim)
    if dtype != torch.float32:
        fresh.q = fresh.q.to(dtype)
    q8 = quantize_case(fresh, fmt, scales=scales)
    ref = (reference_paged_decode if mode == "decode" else reference_paged_prefill)(*q8.args, **q8.scales)
    return q8, ref


def check(mode, fn, fmt, scales, shape, tol=TOL, dtype=torch.float32, **kwargs):
    """``fn`` on the case's 8-bit pages equals the reference on them (and is close to float64 attention)."""
    q8, ref = case(mode, fmt, scales, shape, dtype)
    out = fn(*q8.args, **q8.scales, **kwargs)
    assert out.dtype == q8.q.dtype and out.shape == q8.q.shape
    assert rel_error(out, ref) < tol
    assert rel_error(out, q8.expected()) < max(tol, 1e-4)
    return out


@pytest.mark.parametrize("fmt, scales, shape", GRID)
def test_sdpa_on_8bit_pages(fmt, scales, shape):
    check("decode", sdpa_paged_decode, fmt, scales, shape)
    check("prefill", sdpa_paged_prefill, fmt, scales, shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_sdpa_computes_in_float32_or_float64(dtype):
    """8-bit pages are attended in float32 for 16-bit q (float64 for float64), as the reference does."""
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    check("decode", sdpa_paged_decode, torch.int8, "page", SHAPES[1], tol, dtype)
    check("prefill", sdpa_paged_prefill, torch.int8, "page", SHAPES[1], tol, dtype)


def test_sdpa_one_sequence_on_consecutive_pages():
    """SDPA reads one sequence on consecutive floating pages in place; 8-bit pages go through the gather."""
    q8, _ = case("decode", torch.float8_e4m3fn, "page", SHAPES[2])
    num_pages = q8.k_cache.shape[0]
    table = torch.arange(num_pages, dtype=torch.int32)[None]  # [1, num_pages]
    lens = torch.tensor([num_pages * SHAPES[2][0] - 3], dtype=torch.int32)
    args = (q8.q[:1], q8.k_cache, q8.v_cache, table, lens)
    ref = reference_paged_decode(*args, **q8.scales)
    assert rel_error(sdpa_paged_decode(*args, **q8.scales), ref) < TOL


@pytest.mark.parametrize("fmt, scales, shape", GRID)
def test_cpu_paged_on_8bit_pages(fmt, scales, shape):
    if kernel() is None:
        pytest.skip("the C++ kernel could not be built here")
    check("decode", cpu_paged_decode, fmt, scales, shape)
    out = check("prefill", cpu_paged_prefill, fmt, scales, shape)
    q8, _ = case("prefill", fmt, scales, shape)
    valid = torch.arange(q8.q.shape[2])[None, :] < q8.q_lens[:, None]  # [batch, max_q_len]
    rows = q8.q.transpose(1, 2)[valid]  # [num_new, Hq, D] packed, row after row
    packed = cpu_paged_packed(rows, *q8.args[1:], scale=q8.q.shape[-1] ** -0.5, **q8.scales)
    assert torch.equal(packed, out.transpose(1, 2)[valid])  # the same kernel, packed


def test_cpu_paged_reads_a_non_contiguous_scale_through_its_strides():
    """A scale stored transposed (strides (1, num_pages)) gives the answer of its contiguous copy."""
    if kernel() is None:
        pytest.skip("the C++ kernel could not be built here")
    q8, ref = case("decode", torch.float8_e5m2, "page", SHAPES[2])
    k_scale, v_scale = (s.T.contiguous().T for s in (q8.k_scale, q8.v_scale))
    assert k_scale.stride() != q8.k_scale.stride()
    out = cpu_paged_decode(*q8.args, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(out, cpu_paged_decode(*q8.args, **q8.scales)) and rel_error(out, ref) < TOL
