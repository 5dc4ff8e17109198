"""Compiled FlexAttention on the CPU (inductor's C++ template, block sparse like the GPU kernel)
against the float64 oracle: the path CUDA runs, exercised where CI runs. Each case compiles
once (static shapes; seconds each), so the shapes are few, and each compiled shape is checked
twice at once: against the oracle, the whole batch in one call, each sequence on its own copy
of the cache with NaN in K and Inf in V of every page it does not own (block sparsity must skip
them)."""

import pytest
import torch
from attention_cases import COMPILED_DECODE_CASE, make_decode_case, make_prefill_case, per_row_copies, rel_error

from paged_ref.attention.flex import flex_paged_decode, flex_paged_prefill

TOL = 1e-4  # float32


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_compiled_decode_matches_the_oracle_and_skips_other_pages(page_size):
    """A ragged batch, each row on its own copy of the cache with NaN/Inf in every page it does
    not own: page-aligned blocks never visit them."""
    case = per_row_copies(make_decode_case(seed=page_size, **{**COMPILED_DECODE_CASE, "page_size": page_size}))
    out = flex_paged_decode(*case.args, compiled=True)
    assert torch.isfinite(out).all()
    assert rel_error(out, case.expected()) < TOL


def test_compiled_decode_with_blocks_of_eight_pages():
    """kv_block_size 128 over 16-token pages (it failed to build without full-block lists), on
    clean copies of the decode test's cache: test_nonfinite_slots poisons the same shapes to show
    that such blocks read foreign pages."""
    case = per_row_copies(make_decode_case(seed=16, **COMPILED_DECODE_CASE), poison=False)
    assert rel_error(flex_paged_decode(*case.args, kv_block_size=128, compiled=True), case.expected()) < TOL


# page size 1: every block one token; 16: a larger batch with an empty row and longer prompts
PREFILL_CASES = {
    1: dict(seed=3, batch=3, num_kv_heads=2, group=2, head_dim=32, max_q_len=6),
    16: dict(seed=16, batch=4, num_kv_heads=2, group=2, head_dim=64, max_q_len=12),
}


@pytest.mark.parametrize("page_size", sorted(PREFILL_CASES))
def test_compiled_prefill_matches_the_oracle_and_skips_other_pages(page_size):
    case = per_row_copies(make_prefill_case(page_size=page_size, **PREFILL_CASES[page_size]))
    out = flex_paged_prefill(*case.args, compiled=True)
    expected = case.expected()
    for b, m in enumerate(case.q_lens.tolist()):  # padding rows are unspecified
        if m:
            assert torch.isfinite(out[b, :, :m]).all(), b
            assert rel_error(out[b, :, :m], expected[b, :, :m]) < TOL, b
