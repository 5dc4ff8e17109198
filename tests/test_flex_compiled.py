"""Compiled FlexAttention on the CPU (inductor's C++ template, block sparse like the GPU kernel)
against the float64 oracle: the path CUDA runs, exercised where CI runs. Each case compiles
once (static shapes; seconds each), so the shapes are few."""

import pytest
from attention_cases import make_decode_case, make_prefill_case, rel_error

from paged_ref.attention.flex import flex_paged_decode, flex_paged_prefill

TOL = 1e-4  # float32


@pytest.mark.parametrize(
    "page_size, kv_block_size",
    [
        (16, None),  # page-aligned default blocks: full blocks skip the mask_mod
        (16, 128),  # blocks of 8 pages (the case that failed to build without full-block lists)
        (64, None),
    ],
)
def test_compiled_decode_matches_the_oracle(page_size, kv_block_size):
    case = make_decode_case(
        seed=page_size, batch=4, page_size=page_size, num_kv_heads=2, group=4, head_dim=64, seq_lens=[17, 300, 1024, 64]
    )
    out = flex_paged_decode(*case.args, kv_block_size=kv_block_size, compiled=True)
    assert rel_error(out, case.expected()) < TOL


@pytest.mark.parametrize("page_size", [16, 64])
def test_compiled_prefill_matches_the_oracle(page_size):
    case = make_prefill_case(
        seed=page_size, batch=4, page_size=page_size, num_kv_heads=2, group=2, head_dim=64, max_q_len=12
    )
    out = flex_paged_prefill(*case.args, compiled=True)
    expected = case.expected()
    for b, m in enumerate(case.q_lens.tolist()):  # padding rows are unspecified
        if m:
            assert rel_error(out[b, :, :m], expected[b, :, :m]) < TOL
