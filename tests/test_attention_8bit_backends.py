"""Every attention backend on 8-bit pages (issue 61's contract, `paged_ref.attention._checks.check_page_scales`)
against the reference on the same pages: the same bytes times the same float32 scales, so the backends differ
from the reference only by their attention's own float32 rounding.

The grid: the three formats, both scale kinds ("page": one per page and KV head; "layer": one value expanded,
strides 0), page sizes 1 to 64 with GQA, MQA and MHA layouts, ragged lengths and junk in the unowned slots
(`attention_cases`). The cases are built once per module and shared by the backends: SDPA and the C++ kernel
on the whole grid, the Triton kernel (interpreter) and eager flex on a few shapes, then the spec, Quest and
the cascades.
"""

import functools

import pytest
import torch
from attention_cases import make_decode_case, make_prefill_case, quantize_case, rel_error

from paged_ref import quant
from paged_ref.attention import triton_decode
from paged_ref.attention._checks import EIGHT_BIT_BACKENDS
from paged_ref.attention.cascade import reference_cascade_decode
from paged_ref.attention.cpu_paged import cpu_paged_decode, cpu_paged_packed, cpu_paged_prefill, kernel
from paged_ref.attention.flex import flex_paged_decode, flex_paged_prefill
from paged_ref.attention.online_softmax import paged_decode_spec
from paged_ref.attention.quest import quest_paged_decode
from paged_ref.attention.reference import reference_paged_decode, reference_paged_prefill
from paged_ref.attention.sdpa import sdpa_paged_decode, sdpa_paged_prefill
from paged_ref.attention.triton_cascade import triton_cascade_decode
from paged_ref.attention.triton_decode import triton_paged_decode

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


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("scales", SCALES)
def test_triton_on_8bit_pages(fmt, scales):
    """Triton's interpreter (float32 q): a page per token (page size 1, split) and tiles inside a page (64)."""
    check("decode", triton_paged_decode, fmt, scales, SHAPES[0], num_splits=3)
    check("decode", triton_paged_decode, fmt, scales, SHAPES[3], num_splits=1)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_triton_decodes_float8_from_its_bits(monkeypatch, fmt):
    """Before sm_89 Triton cannot convert float8: the kernel reads float8 bytes as uint8 and decodes them. On
    pages holding every finite byte, that path gives the native load's answer bit for bit."""
    q8, _ = case("decode", fmt, "page", SHAPES[2])
    gen = torch.Generator().manual_seed(0)
    pages = [torch.randint(0, 256, q8.k_cache.shape, generator=gen, dtype=torch.uint8) for _ in range(2)]
    special = 0x7F if fmt == torch.float8_e4m3fn else 0x7C  # e4m3: S.1111.111 is NaN; e5m2: exponent 11111
    k, v = (p.masked_fill_(p & special == special, 0).view(fmt) for p in pages)  # [pages, P, Hkv, D]
    scales = dict(k_scale=q8.k_scale / quant.FORMATS[fmt], v_scale=q8.v_scale)
    args = (q8.q, k, v, q8.block_table, q8.seq_lens)
    native = triton_paged_decode(*args, **scales)
    monkeypatch.setattr(triton_decode, "_fp8_native", lambda device, interpret: False)
    assert torch.equal(triton_paged_decode(*args, **scales), native)
    assert rel_error(native, reference_paged_decode(*args, **scales)) < TOL


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("scales", SCALES)
def test_flex_on_8bit_pages(fmt, scales):
    """Eager flex on the used pages dequantized first (the module docstring says so)."""
    for shape in (SHAPES[0], SHAPES[2]):
        check("decode", flex_paged_decode, fmt, scales, shape)
        check("prefill", flex_paged_prefill, fmt, scales, shape)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("scales", SCALES)
def test_spec_and_quest_on_8bit_pages(fmt, scales):
    check("decode", paged_decode_spec, fmt, scales, SHAPES[1], num_splits=2, block_n=4)
    q8, _ = case("decode", fmt, scales, SHAPES[1])
    k = quant.dequantize(q8.k_cache, q8.k_scale[:, None, :, None])  # float32 [num_pages, P, Hkv, D]
    v = quant.dequantize(q8.v_cache, q8.v_scale[:, None, :, None])
    summaries = (k.amin(1), k.amax(1))  # [num_pages, Hkv, D]: of what the pages hold
    k_min, k_max = summaries
    check(
        "decode", quest_paged_decode, fmt, scales, SHAPES[1], k_min=k_min, k_max=k_max, budget=q8.block_table.shape[1]
    )
    chosen = quest_paged_decode(*q8.args, *summaries, budget=2, **q8.scales)  # fewer pages: Quest's own answer
    assert rel_error(chosen, quest_paged_decode(q8.q, k, v, *q8.args[3:], *summaries, budget=2)) < TOL


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_cascade_on_8bit_pages(fmt):
    """The reference cascade reads 8-bit pages; the Triton cascade refuses them, naming the backends that can."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 4, 2, 16, generator=gen)  # K and V: [num_pages, page_size, Hkv, D]
    scale = quant.calibrate(x, fmt, dim=(2, 4))  # [2, num_pages, Hkv]
    k, v = quant.quantize(x, scale[:, :, None, :, None], fmt)
    table = torch.tensor([[0, 1, 2], [0, 1, 3], [0, 1, 4]], dtype=torch.int32)  # pages 0, 1 shared
    args = (torch.randn(3, 4, 16, generator=gen), k, v, table, torch.tensor([9, 11, 8], dtype=torch.int32))
    groups = (torch.tensor([0, 3]), torch.tensor([8]))
    scales = dict(k_scale=scale[0], v_scale=scale[1])
    out = reference_cascade_decode(*args, *groups, **scales)
    assert rel_error(out, reference_paged_decode(*args, **scales)) < TOL
    with pytest.raises(ValueError, match=f"triton_cascade_decode cannot read {fmt} pages .*{EIGHT_BIT_BACKENDS[-1]}"):
        triton_cascade_decode(*args, *groups)
