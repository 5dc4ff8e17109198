"""Slots outside a sequence never reach its output, whatever they hold (vLLM's kernel tests ask
the same): NaN/Inf in pages nobody owns, in other sequences' pages, in stale freed pages and in
block-table padding. Each batch runs in one call, every row on its own copy of the cache
poisoned outside its pages (`attention_cases.per_row_copies`). Every block-sparse backend is
immune by itself (flex compiled, with its page-aligned default blocks); sdpa gathers whole pages
and padding, and zeroes the K/V it gathered past each row's length; eager flex on CPU reads the
whole cache, and `PagedKVCache` keeps every slot that holds no token at zero, which covers stale
pages and unwritten tails.
"""

import pytest
import torch
from attention_cases import COMPILED_DECODE_CASE, make_decode_case, make_prefill_case, per_row_copies, rel_error

import paged_ref as pr
from paged_ref.attention.cpu_paged import cpu_paged_decode, cpu_paged_prefill
from paged_ref.attention.flex import flex_paged_decode
from paged_ref.attention.reference import reference_paged_decode, reference_paged_prefill
from paged_ref.attention.sdpa import sdpa_paged_decode, sdpa_paged_prefill
from paged_ref.attention.triton_decode import triton_paged_decode


def compiled(fn):
    return lambda *args, **kw: fn(*args, compiled=True, **kw)


# compiled flex: the same poisoned rows in test_flex_compiled.py, which compiles each shape once
DECODERS = {
    "reference": reference_paged_decode,
    "triton": triton_paged_decode,
    "sdpa": sdpa_paged_decode,
    "cpu_paged": cpu_paged_decode,
}
PREFILLERS = {"reference": reference_paged_prefill, "sdpa": sdpa_paged_prefill, "cpu_paged": cpu_paged_prefill}
# the cache route also holds for eager flex: nothing stale is left to read
CACHE_DECODERS = {**DECODERS, "flex": compiled(flex_paged_decode), "flex eager": flex_paged_decode}


@pytest.mark.parametrize("backend", sorted(DECODERS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_ignores_nonfinite_unowned_pages(backend, page_size):
    case = per_row_copies(
        make_decode_case(seed=page_size, batch=4, page_size=page_size, num_kv_heads=2, group=4, head_dim=32)
    )
    out = DECODERS[backend](*case.args)
    assert torch.isfinite(out).all(), backend
    assert rel_error(out, case.expected()) < 1e-4


# ragged new tokens after a cached prefix (a masked prefill); whole fresh prompts (sdpa's causal path)
PREFILL_SHAPES = {
    "chunks": dict(max_q_len=6),
    "prompts": dict(seq_lens=[5, 9, 3], q_lens=[5, 9, 3], max_q_len=9),
}


@pytest.mark.parametrize("backend", sorted(PREFILLERS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", sorted(PREFILL_SHAPES))
def test_prefill_ignores_nonfinite_unowned_pages(backend, page_size, shape):
    case = per_row_copies(
        make_prefill_case(
            seed=3, batch=3, page_size=page_size, num_kv_heads=2, group=2, head_dim=32, **PREFILL_SHAPES[shape]
        )
    )
    out = PREFILLERS[backend](*case.args)
    expected = case.expected()
    for b, m in enumerate(case.q_lens.tolist()):  # padding rows are unspecified
        assert torch.isfinite(out[b, :, :m]).all(), (backend, b)
        assert rel_error(out[b, :, :m], expected[b, :, :m]) < 1e-4, (backend, b)


@pytest.mark.parametrize("backend", sorted(CACHE_DECODERS))
def test_through_the_cache_stale_pages_do_not_leak(backend):
    """A finished sequence left NaN in its pages; the new sequence reuses them (its last page
    only half written) next to a live neighbour and attends correctly."""
    torch.manual_seed(0)
    c = pr.PagedKVCache(num_layers=1, num_pages=6, page_size=16, num_kv_heads=2, head_dim=32)
    stale = c.add_sequence()
    slots = c.reserve(stale, 48)
    nan = torch.full((48, 2, 32), float("nan"))
    c.write(0, slots, nan, nan)
    neighbour = c.add_sequence()
    slots = c.reserve(neighbour, 40)
    c.write(0, slots, torch.randn(40, 2, 32), torch.randn(40, 2, 32))
    c.free(stale)
    s = c.add_sequence()
    slots = c.reserve(s, 21)  # reuses the stale pages; 11 slots unwritten
    k, v = torch.randn(21, 2, 32), torch.randn(21, 2, 32)
    c.write(0, slots, k, v)
    table, lens = c.block_table([s])
    q = torch.randn(1, 8, 32)
    out = CACHE_DECODERS[backend](q, c.k_cache[0], c.v_cache[0], table, lens)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], enable_gqa=True
    )[:, :, 0]
    assert torch.isfinite(out).all() and rel_error(out, dense) < 1e-4


def test_flex_limits_blocks_larger_than_pages_and_eager_flex_read_foreign_slots():
    """The documented limits: a 128-token block over 16-token pages reads foreign slots, and
    eager flex (CPU) reads the whole cache; a live neighbour's NaN then leaks."""
    case = per_row_copies(make_decode_case(seed=16, **COMPILED_DECODE_CASE))  # test_flex_compiled's shapes
    assert torch.isfinite(flex_paged_decode(*case.args, compiled=True)).all()
    assert torch.isnan(flex_paged_decode(*case.args, kv_block_size=128, compiled=True)).any()
    assert torch.isnan(flex_paged_decode(*case.args)).any()
