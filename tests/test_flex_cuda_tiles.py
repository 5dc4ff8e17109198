"""Compiled flex on CUDA, checked without a GPU: torch's own tile heuristics against our BlockMasks.

torch compiles flex_attention into a decoding kernel (short queries, static batch, power-of-two
GQA group) or a general kernel; both walk a BlockMask block of ``(q_block, kv_block)`` tokens
in tiles of ``BLOCK_M`` x ``BLOCK_N``, and the general kernel raises "Q and KV block size must
be divisible by BLOCK_M and BLOCK_N" when a tile does not divide its block. Which tile a call
gets is torch's default for the GPU (read here from torch's CUDA heuristics with the capability
set to sm_90 or sm_80) unless ``kernel_options`` names one: paged_ref passes
`cuda_kernel_options`. Every shape the GPU run (`bench gpu`) sends to compiled flex is checked
for both kernels, whichever torch picks.
"""

import pytest
import torch

from paged_ref._arith import next_pow2
from paged_ref.attention._flex_compiled import cuda_kernel_options
from paged_ref.attention.flex import DEFAULT_Q_BLOCK_SIZE, default_kv_block_size
from paged_ref.lab.bench import decode
from paged_ref.lab.bench._scaling_models import LLAMA_1B_SHAPES, SMOLLM2_SHAPES
from paged_ref.lab.bench.scaling import PAGE_SIZE, PROFILES

heuristics = pytest.importorskip("torch._inductor.template_heuristics.triton")


def _geometry(fields):
    return fields["head_dim"], fields["num_attention_heads"] // fields["num_key_value_heads"]


def gpu_run_shapes():
    """(dtype, head_dim, group, page_size) of every compiled-flex call in `bench gpu`."""
    shapes = set()
    # the gpu-marked flex tests (tests/test_attention_flex.py): head_dim 128, GQA 4
    for dtype in (torch.float32, torch.bfloat16):
        for page in (1, 16, 128):
            shapes.add((dtype, 128, 4, page))
    # bench decode: bf16 (float16 on a T4), GPU_HEADS, GPU_PAGE_SIZES
    heads = decode.GPU_HEADS
    for dtype in (torch.bfloat16, torch.float16):
        for page in decode.GPU_PAGE_SIZES:
            shapes.add((dtype, heads["head_dim"], heads["num_q_heads"] // heads["num_kv_heads"], page))
    # bench scaling --gpu: both models in 16-bit, PAGE_SIZE and the page-size sweep
    pages = {PAGE_SIZE, *PROFILES[("gpu", "full")]["sweep"]["page_sizes"]}
    for fields in (LLAMA_1B_SHAPES, SMOLLM2_SHAPES):
        for dtype in (torch.bfloat16, torch.float16):
            for page in pages:
                shapes.add((dtype, *_geometry(fields), page))
    return sorted(shapes, key=str)


Q_LENS = range(1, 1025)  # decode (1) up to the GPU profile's prefill chunk (1024)
CAPABILITIES = [(9, 0), (8, 0)]


@pytest.fixture(params=CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
def cuda(request, monkeypatch):
    """torch's CUDA heuristics, answering for the given compute capability."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: request.param)
    return heuristics.CUDAConfigHeuristic()


def tiles(cuda, dtype, head_dim, group, page_size, q_len):
    """The (BLOCK_M, BLOCK_N) each of torch's kernels would use for one call, as torch's
    lowering sets them: ``kernel_options`` first, torch's default where none is given."""
    block = (DEFAULT_Q_BLOCK_SIZE, default_kv_block_size(page_size, "cuda"))
    options = cuda_kernel_options(dtype, head_dim, q_len, group, block)
    (fwd,) = cuda.get_flex_attn_fwd_configs(head_dim, dtype)
    (dec,) = cuda.get_flex_decode_configs(head_dim, dtype)
    general = (options.get("BLOCK_M", fwd.block_m), options.get("BLOCK_N", fwd.block_n))
    decoding = (
        options.get("BLOCK_M", max(next_pow2(q_len * group), 16)),
        options.get("BLOCK_N", min(dec.block_n, block[1])),
    )
    return block, options, (fwd.block_m, fwd.block_n), general, decoding


@pytest.mark.parametrize("shape", gpu_run_shapes(), ids=str)
def test_every_tile_divides_its_block_mask_blocks(cuda, shape):
    dtype, head_dim, group, page_size = shape
    for q_len in Q_LENS:
        block, options, default, general, decoding = tiles(cuda, dtype, head_dim, group, page_size, q_len)
        for kernel, (m, n) in (("general", general), ("decoding", decoding)):
            assert block[0] % m == 0 and block[1] % n == 0, (kernel, shape, q_len, block, (m, n))
        # the decoding kernel packs whole GQA groups into a tile (it asserts BLOCK_M % G == 0)
        if group & (group - 1) == 0:
            assert decoding[0] % group == 0, (shape, q_len, decoding)
        # never a larger tile than torch's own default: it fits where theirs fits
        assert general[0] <= default[0] and general[1] <= default[1], (shape, q_len, general, default)


def test_without_kernel_options_torch_default_tile_would_not_divide_16_token_blocks(cuda):
    """The reason for passing a tile: torch's defaults for the GPU run's shapes do not divide a
    16-token KV block, so the general kernel (a prefill of 128+ tokens, or a batch made dynamic)
    would raise."""
    (fwd,) = cuda.get_flex_attn_fwd_configs(128, torch.bfloat16)
    assert default_kv_block_size(16, "cuda") % fwd.block_n != 0
