"""The bytes vLLM's CPU build writes into an fp8 KV cache are `paged_ref.quant.quantize`'s with
``rounding="zero"`` (runs in .venv-vllm: `make test-vllm`).

vLLM's cache write (``torch.ops._C.cpu_attn_reshape_and_cache``, the op its CPU attention backend
calls for every layer's new K and V) is called directly on small tensors: random values over many
magnitudes, the specials (0, -0, subnormals, the format's max and beyond, inf, NaN), float32 and
bfloat16 inputs, scales of 1.0 (vLLM's default), calibrated and arbitrary, tokens scattered over the
blocks by a random slot mapping. Its ``vec`` layout: K column-major in a block ([head_dim, block_size]
per block and KV head), V row-major ([block_size, head_dim]). And its fp8 attention
(``cpu_attention_with_kv_cache``) on those pages is `paged_ref`'s reference on the dequantized pages.
"""

import pytest
import torch
from vllm_peer import require_vllm

from paged_ref import quant

require_vllm()

BLOCK, HEADS, DIM, BLOCKS = 32, 2, 64, 4
NAMES = list(quant.VLLM_FORMATS)  # vLLM's kv_cache_dtype names: "fp8", "fp8_e4m3", "fp8_e5m2"


@pytest.fixture(scope="module")
def write():
    """vLLM's cache write: ``(k, v, slots, k_scale, v_scale, kv_cache_dtype) -> (k_bytes, v_bytes)``, each uint8
    ``[num_tokens, HEADS, DIM]`` in the tokens' order."""
    if not torch.cpu._is_avx512_supported():
        pytest.skip("vLLM's CPU build writes fp8 pages only on x86 with AVX-512 or AMX")
    from vllm.platforms import current_platform

    current_platform.import_kernels()

    def run(k, v, slots, k_scale, v_scale, name):
        key_cache = torch.zeros(BLOCKS, HEADS, BLOCK, DIM, dtype=torch.uint8)  # vLLM's [blocks, Hkv, block, D]
        value_cache = torch.zeros_like(key_cache)
        torch.ops._C.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec", k_scale, v_scale, name)
        block, offset = slots // BLOCK, slots % BLOCK
        k_bytes = key_cache.view(BLOCKS, HEADS, DIM, BLOCK)[block, :, :, offset]  # [tokens, Hkv, D]
        return k_bytes, value_cache[block, :, offset]

    return run


def _values(n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, HEADS, DIM]`` float32: normal values times 10^U(-7, 5), so every binade of both formats shows up."""
    magnitude = 10.0 ** (torch.rand(n, HEADS, DIM, generator=gen) * 12 - 7)
    return torch.randn(n, HEADS, DIM, generator=gen) * magnitude


SPECIALS = [0.0, -0.0, 2**-9, -(2**-10) * 3, 2**-16, 2**-17 * 3, 1e-30, 448.0, 464.0, 480.0, 1e4]
SPECIALS += [57344.0, 61440.0, 1e6, float("inf"), float("-inf"), float("nan"), 1.0625, -1.1875, 1.25]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_vllm_writes_the_bytes_quantize_gives_rounding_toward_zero(write, name, dtype, seed):
    fmt = quant.VLLM_FORMATS[name]
    gen = torch.Generator().manual_seed(seed)
    n = BLOCK * BLOCKS - 5
    k, v = _values(n, gen), _values(n, gen)
    k.view(-1)[: len(SPECIALS)] = torch.tensor(SPECIALS)
    v.view(-1)[-len(SPECIALS) :] = torch.tensor(SPECIALS)
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(BLOCK * BLOCKS, generator=gen)[:n]  # tokens scattered over the blocks
    for k_scale, v_scale in [(1.0, 1.0), (0.37, 3.0e-3), (float(quant.calibrate(k, fmt)), 1.7e3)]:
        k_bytes, v_bytes = write(k, v, slots, k_scale, v_scale, name)
        ours_k = quant.quantize(k, k_scale, fmt, rounding="zero").view(torch.uint8)
        ours_v = quant.quantize(v, v_scale, fmt, rounding="zero").view(torch.uint8)
        assert torch.equal(k_bytes, ours_k), (k_scale, (k_bytes != ours_k).sum().item())
        assert torch.equal(v_bytes, ours_v), (v_scale, (v_bytes != ours_v).sum().item())


def test_vllm_truncates_where_torch_rounds_to_nearest(write):
    """The default ``rounding="nearest"`` (torch's cast, vLLM's CUDA kernels) differs from vLLM's CPU
    write in about half the values: each value whose nearest code lies beyond it."""
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(BLOCK, HEADS, DIM, generator=gen)
    slots = torch.arange(BLOCK)
    for name, fmt in quant.VLLM_FORMATS.items():
        k_bytes, _ = write(k, k, slots, 1.0, 1.0, name)
        nearest = quant.quantize(k, 1.0, fmt).view(torch.uint8)
        assert torch.equal(nearest, k.to(fmt).view(torch.uint8))
        differ = (k_bytes != nearest).float().mean().item()
        assert 0.3 < differ < 0.7, (fmt, differ)
        assert torch.equal(k_bytes, quant.quantize(k, 1.0, fmt, rounding="zero").view(torch.uint8))


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.02, 0.5)])
def test_vllms_fp8_attention_is_the_reference_on_the_dequantized_pages(write, name, k_scale, v_scale):
    """vLLM's CPU attention reads the bytes unscaled and folds ``k_scale`` into the logits' scale and
    ``v_scale`` into the output: the same as dequantizing the pages and attending, to float32 rounding."""
    from vllm import _custom_ops as ops

    import paged_ref as pr

    gen, fmt, pool = torch.Generator().manual_seed(3), quant.VLLM_FORMATS[name], 8
    lens = torch.tensor([45, 70, 1], dtype=torch.int32)  # a page and a bit, two pages and a bit, one token
    block_table = torch.tensor([[5, 2, 0], [1, 7, 3], [6, 0, 0]], dtype=torch.int32)  # [batch, max_pages]
    slots = torch.cat(
        [
            block_table[b, torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
            for b, n in enumerate(lens.tolist())
        ]
    )
    k = torch.randn(len(slots), HEADS, DIM, generator=gen)  # [tokens, num_kv_heads, head_dim]
    v = torch.randn(len(slots), HEADS, DIM, generator=gen)
    key_cache = torch.zeros(pool, HEADS, BLOCK, DIM, dtype=torch.uint8)  # vLLM's [blocks, Hkv, block, D]
    value_cache = torch.zeros_like(key_cache)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots.long(), "vec", k_scale, v_scale, name)
    q = torch.randn(3, 4 * HEADS, DIM, generator=gen)  # [batch, num_q_heads, head_dim]: GQA 4
    starts = torch.arange(4, dtype=torch.int32)  # one query token per request
    meta = ops.cpu_attn_get_scheduler_metadata(
        3, 4 * HEADS, HEADS, DIM, lens, torch.float32, starts, True, -1, "vec", False, None, name
    )
    out = torch.zeros_like(q)
    ops.cpu_attention_with_kv_cache(
        q, key_cache, value_cache, out, starts, lens, DIM**-0.5, True, None, -1, block_table, 0.0, meta, None,
        None, k_scale, v_scale, name,
    )  # fmt: skip

    def pages(x, scale):  # ours: [num_pages, page_size, num_kv_heads, head_dim], dequantized in float64
        stored = torch.zeros(pool * BLOCK, HEADS, DIM, dtype=fmt)
        stored[slots] = quant.quantize(x, scale, fmt, rounding="zero")
        return quant.dequantize(stored, scale, torch.float64).view(pool, BLOCK, HEADS, DIM)

    ref = pr.reference_paged_decode(q.double(), pages(k, k_scale), pages(v, v_scale), block_table, lens)
    torch.testing.assert_close(out, ref.float(), rtol=0, atol=1e-5)


def test_vllms_cpu_fp8_cache_needs_a_head_size_divisible_by_32_and_avx512_or_amx():
    """The backend's ISA choice (``_get_attn_isa``): fp8 refuses head sizes 80 and 112 (multiples of 16,
    not of 32), which an unquantized cache runs on ``vec16``; where the CPU has neither AVX-512 nor AMX,
    fp8 is refused outright."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for head_size in (80, 112):
        assert _get_attn_isa(torch.float32, 32, head_size, "auto") == "vec16"
        with pytest.raises(NotImplementedError, match="head_size divisible by 32"):
            _get_attn_isa(torch.float32, 32, head_size, "fp8")
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        assert _get_attn_isa(torch.float32, 32, 64, "fp8") in ("vec", "amx")
    else:
        with pytest.raises(NotImplementedError, match="AVX-512 or AMX"):
            _get_attn_isa(torch.float32, 32, 64, "fp8")
