"""Compiled FlexAttention on the CPU (inductor's C++ template, block sparse like the GPU kernel)
against the float64 oracle: the path CUDA runs, exercised where CI runs. Each case compiles
once (static shapes; seconds each), so the shapes are few, and each compiled shape is checked
twice at once: against the oracle, one sequence at a time, with NaN in K and Inf in V of every
page that sequence does not own (block sparsity must skip them)."""

import pytest
import torch
from attention_cases import COMPILED_DECODE_CASE, make_decode_case, make_prefill_case, poison_all_but_one, rel_error

from paged_ref.attention.flex import flex_paged_decode, flex_paged_prefill

TOL = 1e-4  # float32


def test_compiled_decode_of_a_batch_matches_the_oracle():
    case = make_decode_case(seed=16, **COMPILED_DECODE_CASE)  # page-aligned default blocks
    assert rel_error(flex_paged_decode(*case.args, compiled=True), case.expected()) < TOL


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_compiled_decode_skips_poisoned_pages_of_other_sequences(page_size):
    """One sequence at a time, NaN/Inf in every page it does not own: page-aligned blocks
    never visit them (the old full-batch oracle check at these page sizes, poisoned)."""
    case = make_decode_case(seed=page_size, **{**COMPILED_DECODE_CASE, "page_size": page_size})
    expected = case.expected()
    for b in range(len(case.seq_lens)):
        k, v, table, lens = poison_all_but_one(case, b)
        row = flex_paged_decode(case.q[b : b + 1], k, v, table, lens, compiled=True)
        assert torch.isfinite(row).all(), b
        assert rel_error(row, expected[b : b + 1]) < TOL


def test_compiled_decode_with_blocks_of_eight_pages():
    """kv_block_size 128 over 16-token pages (it failed to build without full-block lists);
    row by row, the shapes test_nonfinite_slots then poisons to show such blocks read foreign pages."""
    case = make_decode_case(seed=16, **COMPILED_DECODE_CASE)
    expected = case.expected()
    for b in range(len(case.seq_lens)):
        rows = slice(b, b + 1)
        args = (case.q[rows], case.k_cache, case.v_cache, case.block_table[rows], case.seq_lens[rows])
        assert rel_error(flex_paged_decode(*args, kv_block_size=128, compiled=True), expected[rows]) < TOL


def test_compiled_prefill_matches_the_oracle():
    case = make_prefill_case(seed=16, batch=4, page_size=16, num_kv_heads=2, group=2, head_dim=64, max_q_len=12)
    out = flex_paged_prefill(*case.args, compiled=True)
    expected = case.expected()
    for b, m in enumerate(case.q_lens.tolist()):  # padding rows are unspecified
        if m:
            assert rel_error(out[b, :, :m], expected[b, :, :m]) < TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_compiled_prefill_skips_poisoned_pages_of_other_sequences(page_size):
    case = make_prefill_case(seed=3, batch=3, page_size=page_size, num_kv_heads=2, group=2, head_dim=32, max_q_len=6)
    expected = case.expected()
    for b in range(3):
        k, v, table, lens = poison_all_but_one(case, b)
        m = int(case.q_lens[b])
        out = flex_paged_prefill(case.q[b : b + 1], k, v, table, lens, case.q_lens[b : b + 1], compiled=True)
        assert torch.isfinite(out[:, :, :m]).all(), b
        assert rel_error(out[:, :, :m], expected[b : b + 1, :, :m]) < TOL
