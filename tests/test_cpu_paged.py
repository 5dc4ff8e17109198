"""The C++ paged attention kernel: cases beyond the backend grid (decode, prefill, packed rows), its fallback."""

import warnings

import pytest
import torch
from attention_cases import make_decode_case, make_prefill_case, rel_error

from paged_ref.attention import cpu_paged
from paged_ref.attention.cpu_paged import cpu_paged_decode, cpu_paged_packed, cpu_paged_prefill


@pytest.mark.parametrize("seed", range(4))
def test_long_ragged_rows_on_a_shuffled_pool_match_float64(seed):
    g = torch.Generator().manual_seed(seed)
    page_size = [1, 7, 32, 128][seed]
    case = make_decode_case(seed=seed, batch=int(torch.randint(1, 12, (1,), generator=g)), page_size=page_size,
                            num_kv_heads=3, group=3, head_dim=64, max_len=600)  # fmt: skip
    assert cpu_paged.kernel() is not None  # the kernel itself, not the fallback
    assert rel_error(cpu_paged_decode(*case.args), case.expected()) < 1e-4


def test_a_kernel_that_cannot_be_built_falls_back_with_one_warning(monkeypatch):
    import torch.utils.cpp_extension as ext

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    case = make_decode_case(seed=5, batch=3, page_size=16, num_kv_heads=2, group=4, head_dim=32)
    chunks = make_prefill_case(seed=5, batch=4, page_size=16, num_kv_heads=2, group=4, head_dim=32)
    monkeypatch.setattr(ext, "load_inline", no_compiler)
    cpu_paged.kernel.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [cpu_paged_decode(*case.args) for _ in range(2)]
            prefill = cpu_paged_prefill(*chunks.args)
            packed = cpu_paged_packed(*_packed(chunks), scale=0.125)
        assert len(caught) == 1 and "Ninja is required" in str(caught[0].message)
        assert "sdpa_paged_" in str(caught[0].message)
        assert all(rel_error(o, case.expected()) < 1e-4 for o in outs)
        assert rel_error(prefill, chunks.expected()) < 1e-4 and packed is None  # None: the caller takes parts
    finally:
        cpu_paged.kernel.cache_clear()  # the next caller loads the real kernel again


def test_bad_input_is_refused_before_the_kernel_reads_memory():
    case = make_decode_case(seed=6, batch=2, page_size=8, num_kv_heads=2, group=2, head_dim=32)
    q, kc, vc, bt, lens = case.args
    with pytest.raises(ValueError, match="seq_lens"):
        cpu_paged_decode(q, kc, vc, bt, lens + 10_000)


def test_an_unchecked_empty_row_is_refused_by_the_kernel():
    case = make_decode_case(seed=7, batch=3, page_size=8, num_kv_heads=2, group=2, head_dim=32)
    q, kc, vc, bt, lens = case.args
    lens = lens.clone()
    lens[1] = 0  # what the Python checks refuse; unchecked, the kernel's own checks refuse it
    with pytest.raises(RuntimeError, match=r"paged_attention: q_lens\[1\] must be in \[0, seq_lens\[1\] = 0\], got 1"):
        cpu_paged_decode(q, kc, vc, bt, lens, check_values=False)


def _packed(case):
    """A prefill case as a packed forward lays it out: ``(q [num_new, Hq, D], k_cache, ..., q_lens)``."""
    q, kc, vc, bt, lens, q_lens = case.args
    valid = torch.arange(q.shape[2])[None, :] < q_lens[:, None]  # [batch, max_q_len]
    return q.transpose(1, 2)[valid], kc, vc, bt, lens, q_lens


@pytest.mark.parametrize("seed", range(4))
def test_packed_rows_match_the_prefill_contract(seed):
    """Decode rows, chunks after a cached prefix, whole prompts and empty rows side by side in one call."""
    page_size = [1, 5, 16, 32][seed]
    case = make_prefill_case(seed=100 + seed, batch=6, page_size=page_size, num_kv_heads=3, group=3, head_dim=64,
                             max_len=200, max_q_len=40)  # fmt: skip
    q, *_, q_lens = case.args
    out = cpu_paged_packed(*_packed(case), scale=q.shape[-1] ** -0.5)  # [num_new, Hq, D]
    expected = case.expected().transpose(1, 2)[torch.arange(q.shape[2])[None, :] < q_lens[:, None]]
    assert out.shape == expected.shape and rel_error(out, expected) < 1e-4
    assert cpu_paged_packed(*_packed(case), scale=0.3).sub(out).abs().max() > 1e-3  # the scale is used


def test_packed_rows_that_do_not_add_up_to_q_are_refused():
    case = make_prefill_case(seed=9, batch=3, page_size=8, num_kv_heads=2, group=2, head_dim=32)
    q, kc, vc, bt, lens, q_lens = _packed(case)
    with pytest.raises(RuntimeError, match="q_lens must add up to q's"):
        cpu_paged_packed(q[1:], kc, vc, bt, lens, q_lens, scale=1.0)


def test_packed_rows_in_another_dtype_are_left_to_the_parts():
    case = make_prefill_case(seed=10, batch=3, page_size=8, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float64)
    assert cpu_paged_packed(*_packed(case), scale=1.0) is None
