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


# One process compiles the decode kernel with one thread, a second one with two threads finds
# it in inductor's on-disk cache. torch 2.11 leaves the thread count out of that cache's key: the
# second process got the first one's per-thread scratch buffers and wrote past them (`double free
# or corruption`) until paged_ref put the count into the key (`_flex_compiled._compile_key`). torch 2.13
# keys its cache by the thread count itself, so the check (two compiles, ~30 s) runs only on
# older torch: `make gpu-image` (torch 2.11) runs it.
_TWO_PROCESSES = """
import torch
from paged_ref.attention.flex import flex_paged_decode
from paged_ref.attention.reference import reference_paged_decode

gen = torch.Generator().manual_seed(0)
k, v = torch.randn(5, 16, 2, 32, generator=gen), torch.randn(5, 16, 2, 32, generator=gen)  # [pages, 16, Hkv, D]
table, lens = torch.arange(5, dtype=torch.int32)[None], torch.tensor([70], dtype=torch.int32)
for _ in range(20):
    q = torch.randn(1, 4, 32, generator=gen)  # [batch, Hq, D]
    out = flex_paged_decode(q, k, v, table, lens, compiled=True)
    torch.testing.assert_close(out, reference_paged_decode(q, k, v, table, lens), rtol=1e-4, atol=1e-4)
print("threads", torch.get_num_threads())
"""


@pytest.mark.skipif(torch.__version__ >= "2.13", reason="torch >= 2.13 keys inductor's cache by the thread count")
def test_a_kernel_compiled_with_fewer_threads_is_not_reused_with_more(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for threads in (1, 2):
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        }
        run = subprocess.run([sys.executable, "-c", _TWO_PROCESSES], env=env, capture_output=True, text=True)
        assert run.returncode == 0, (threads, run.returncode, run.stderr[-2000:])
        assert run.stdout.split()[-1] == str(threads)
