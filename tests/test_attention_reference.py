"""The plain-PyTorch paged attention reference against a float64 oracle on logical K/V."""

import pytest
import torch
from attention_cases import (
    BAD_INPUTS,
    DECODE_BAD_INPUTS,
    HEAD_DIMS,
    HEAD_LAYOUT_IDS,
    HEAD_LAYOUTS,
    PAGE_SIZES,
    check_rejects,
    make_decode_case,
    make_prefill_case,
    rel_error,
    valid_inputs,
)

from paged_ref.attention.reference import (
    gather_sequence,
    paged_attention_reference,
    paged_prefill_reference,
)

F32_TOL = 1e-4


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_LAYOUT_IDS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_matches_float64(page_size, heads, head_dim):
    num_kv_heads, group = heads
    case = make_decode_case(
        seed=1000 + page_size * 31 + head_dim + group,
        batch=6,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
    )
    out = paged_attention_reference(*case.args)
    assert out.shape == case.q.shape and out.dtype == torch.float32
    assert rel_error(out, case.expected()) < F32_TOL, f"seed {case.seed}"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=HEAD_LAYOUT_IDS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefill_matches_float64(page_size, heads, head_dim):
    num_kv_heads, group = heads
    case = make_prefill_case(
        seed=2000 + page_size * 31 + head_dim + group,
        batch=5,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
    )
    out = paged_prefill_reference(*case.args)
    assert out.shape == case.q.shape
    assert rel_error(out, case.expected()) < F32_TOL, f"seed {case.seed}"
    for b, m in enumerate(case.q_lens.tolist()):  # padding query rows are exactly zero
        assert torch.all(out[b, :, m:] == 0)


def test_float64_inputs_give_float64_exactly():
    case = make_decode_case(seed=3, batch=4, page_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float64)
    out = paged_attention_reference(*case.args)
    assert out.dtype == torch.float64
    assert rel_error(out, case.expected()) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    case = make_decode_case(seed=4, batch=4, page_size=16, num_kv_heads=2, group=4, head_dim=64, dtype=dtype)
    out = paged_attention_reference(*case.args)
    assert out.dtype == dtype
    assert rel_error(out, case.expected()) < 1e-2


def test_custom_scale():
    case = make_prefill_case(seed=5, batch=4, page_size=8, num_kv_heads=1, group=4, head_dim=64)
    out = paged_prefill_reference(*case.args, scale=0.3)
    assert rel_error(out, case.expected(scale=0.3)) < F32_TOL
    assert rel_error(out, case.expected()) > 1e-2  # the scale is actually used


def test_nan_in_unowned_slots_never_reaches_the_output():
    """Spare pages, page tails past seq_len: the reference reads none of them."""
    case = make_decode_case(seed=6, batch=6, page_size=16, num_kv_heads=2, group=2, head_dim=64, garbage=float("nan"))
    assert torch.isnan(case.k_cache).any()
    out = paged_attention_reference(*case.args)
    assert torch.isfinite(out).all()
    assert rel_error(out, case.expected()) < F32_TOL
    prefill = make_prefill_case(
        seed=7, batch=5, page_size=16, num_kv_heads=2, group=2, head_dim=64, garbage=float("nan")
    )
    out = paged_prefill_reference(*prefill.args)
    assert torch.isfinite(out).all()
    assert rel_error(out, prefill.expected()) < F32_TOL


def test_prefill_last_row_is_a_decode_step():
    """Row q_len-1 of a prefill is the decode query of the whole sequence; row q_len-2 is the
    decode query of the sequence one token shorter."""
    case = make_prefill_case(
        seed=8,
        batch=3,
        page_size=8,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        seq_lens=[9, 20, 17],
        q_lens=[3, 3, 3],
        max_q_len=3,
    )
    args = (case.k_cache, case.v_cache, case.block_table)
    out = paged_prefill_reference(*case.args)
    last = paged_attention_reference(case.q[:, :, 2], *args, case.seq_lens)
    before = paged_attention_reference(case.q[:, :, 1], *args, case.seq_lens - 1)
    torch.testing.assert_close(out[:, :, 2], last)
    torch.testing.assert_close(out[:, :, 1], before)


def test_gather_sequence_follows_the_block_table():
    cache = torch.arange(5 * 4, dtype=torch.float32).view(5, 4, 1, 1)  # slot id as value
    row = torch.tensor([3, 0, 4, -1], dtype=torch.int32)
    got = gather_sequence(cache, row, 9).flatten().tolist()
    assert got == [12, 13, 14, 15, 0, 1, 2, 3, 16]


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,change,error,words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_prefill_rejects(name, change, error, words):
    check_rejects(paged_prefill_reference, change, error, words, decode=False)


@pytest.mark.parametrize("name,change,error,words", DECODE_BAD_INPUTS, ids=[b[0] for b in DECODE_BAD_INPUTS])
def test_decode_rejects(name, change, error, words):
    check_rejects(paged_attention_reference, change, error, words, decode=True)


def test_decode_rejects_4d_q():
    a = valid_inputs()
    del a["q_lens"]
    with pytest.raises(ValueError, match=r"q must have shape \[batch, num_q_heads, head_dim\]"):
        paged_attention_reference(*a.values())


@pytest.mark.parametrize(
    "scale,error", [("0.1", TypeError), (True, TypeError), (float("inf"), ValueError), (float("nan"), ValueError)]
)
def test_rejects_bad_scale(scale, error):
    with pytest.raises(error, match="scale must be"):
        paged_attention_reference(*valid_inputs(decode=True).values(), scale=scale)


def test_rejects_other_device():
    args = list(valid_inputs(decode=True).values())
    with pytest.raises(ValueError, match="seq_lens must be on the same device as q"):
        paged_attention_reference(*args[:4], args[4].to("meta"))
