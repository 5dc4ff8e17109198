"""Every attention backend against the float64 oracle, on one pairwise grid of fresh cases.

One module for all backends (reference, eager FlexAttention, the Triton kernel through the
interpreter, SDPA over gathered slots, the C++ kernel reading the pages in place): each runs the
same cases from `attention_cases` (ragged lengths, shuffled pages, garbage in unowned slots and in
block-table padding). The grid is pairwise: every (page size, head layout), (page size, head_dim)
and (head layout, head_dim) pair appears at least once, in 25 cases instead of the 50 of the full
product.
A backend's own features (block masks, split-K, gathers) are tested in its own module.
"""

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

from paged_ref.attention.cpu_paged import cpu_paged_decode, cpu_paged_prefill
from paged_ref.attention.flex import flex_paged_decode, flex_paged_prefill
from paged_ref.attention.reference import reference_paged_decode, reference_paged_prefill
from paged_ref.attention.sdpa import sdpa_paged_decode, sdpa_paged_prefill
from paged_ref.attention.triton_decode import triton_paged_decode

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

DECODERS = {
    "reference": reference_paged_decode,
    "flex": flex_paged_decode,
    "triton": triton_paged_decode,
    "sdpa": sdpa_paged_decode,
    "cpu_paged": cpu_paged_decode,
}
PREFILLERS = {"reference": reference_paged_prefill, "flex": flex_paged_prefill, "sdpa": sdpa_paged_prefill}
PREFILLERS["cpu_paged"] = cpu_paged_prefill
F32_TOL = 1e-4
ON_CPU_FLOAT32_ONLY = {"triton"}  # Triton's interpreter runs float32 only


def pairwise_grid():
    """(page_size, (num_kv_heads, group), head_dim, id): all pairs of the three axes."""
    grid = []
    for i, page_size in enumerate(PAGE_SIZES):
        for j, heads in enumerate(HEAD_LAYOUTS):
            head_dim = HEAD_DIMS[(i + j) % len(HEAD_DIMS)]
            grid.append(pytest.param(page_size, heads, head_dim, id=f"p{page_size}-{HEAD_LAYOUT_IDS[j]}-d{head_dim}"))
    return grid


GRID = pairwise_grid()


def test_the_grid_covers_every_pair():
    cells = [p.values for p in GRID]
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        axes = [PAGE_SIZES, HEAD_LAYOUTS, HEAD_DIMS]
        assert {(c[a], c[b]) for c in cells} == {(x, y) for x in axes[a] for y in axes[b]}


def _seed(backend: str, page_size: int, heads, head_dim: int) -> int:
    """Fresh inputs per backend and cell (a backend never sees only another's lucky case)."""
    return sorted(DECODERS).index(backend) * 10_000 + page_size * 31 + head_dim + heads[0] * 7 + heads[1]


@pytest.mark.parametrize("backend", sorted(DECODERS))
@pytest.mark.parametrize("page_size, heads, head_dim", GRID)
def test_decode_matches_float64(backend, page_size, heads, head_dim):
    num_kv_heads, group = heads
    case = make_decode_case(
        seed=_seed(backend, page_size, heads, head_dim),
        batch=5,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
    )
    out = DECODERS[backend](*case.args)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert rel_error(out, case.expected()) < F32_TOL, f"seed {case.seed}"


@pytest.mark.parametrize("backend", sorted(PREFILLERS))
@pytest.mark.parametrize("page_size, heads, head_dim", GRID)
def test_prefill_matches_float64(backend, page_size, heads, head_dim):
    num_kv_heads, group = heads
    case = make_prefill_case(
        seed=50_000 + _seed(backend, page_size, heads, head_dim),
        batch=5,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
    )
    out = PREFILLERS[backend](*case.args)
    assert out.shape == case.q.shape
    assert rel_error(out, case.expected()) < F32_TOL, f"seed {case.seed}"
    for b, m in enumerate(case.q_lens.tolist()):  # padding query rows are exactly zero
        assert torch.all(out[b, :, m:] == 0)


@pytest.mark.parametrize("backend", sorted(DECODERS))
def test_decode_scale_is_used(backend):
    case = make_decode_case(seed=5, batch=4, page_size=8, num_kv_heads=1, group=4, head_dim=64)
    out = DECODERS[backend](*case.args, scale=0.3)
    assert rel_error(out, case.expected(scale=0.3)) < F32_TOL
    assert rel_error(out, case.expected()) > 1e-2  # the scale is actually used


@pytest.mark.parametrize("backend", sorted(PREFILLERS))
def test_prefill_scale_is_used(backend):
    case = make_prefill_case(seed=6, batch=4, page_size=8, num_kv_heads=1, group=4, head_dim=64)
    out = PREFILLERS[backend](*case.args, scale=0.3)
    assert rel_error(out, case.expected(scale=0.3)) < F32_TOL
    assert rel_error(out, case.expected()) > 1e-2


LARGE_SCALE = 20.0  # scores reach hundreds: exp() of them overflows float32 unless the max is subtracted


LARGE_SCORE_CASES = {"decode": (DECODERS, make_decode_case, 9), "prefill": (PREFILLERS, make_prefill_case, 10)}


@pytest.mark.parametrize(
    "mode, backend", [(mode, b) for mode, (fns, _, _) in LARGE_SCORE_CASES.items() for b in sorted(fns)]
)
def test_large_scores_stay_finite(mode, backend):
    fns, make_case, seed = LARGE_SCORE_CASES[mode]
    case = make_case(seed=seed, batch=4, page_size=8, num_kv_heads=2, group=2, head_dim=64)
    out = fns[backend](*case.args, scale=LARGE_SCALE)
    assert torch.isfinite(out).all()
    assert rel_error(out, case.expected(scale=LARGE_SCALE)) < 1e-3


CONTIGUOUS_PAGES_ONLY = {"flex", "triton"}  # they refuse strided pages (tested in their own modules)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` in another memory layout (stored transposed, viewed back): not contiguous."""
    return t.transpose(0, -1).contiguous().transpose(0, -1)


@pytest.mark.parametrize("backend", sorted(set(DECODERS) - CONTIGUOUS_PAGES_ONLY))
@pytest.mark.parametrize("seq_lens", [[8], [1, 16, 17, 3]], ids=["one-page", "ragged"])
def test_decode_reads_strided_inputs(backend, seq_lens):
    """q, the caches and the table as views of other layouts: the same answer (one page: a run of slots)."""
    case = make_decode_case(
        seed=12, batch=len(seq_lens), page_size=8, num_kv_heads=2, group=3, head_dim=40, seq_lens=seq_lens
    )
    args = [_strided(t) for t in case.args]
    assert not any(t.is_contiguous() for t in args[:3])
    assert rel_error(DECODERS[backend](*args), case.expected()) < F32_TOL


@pytest.mark.parametrize("backend", sorted(set(PREFILLERS) - CONTIGUOUS_PAGES_ONLY))
def test_prefill_reads_strided_inputs(backend):
    case = make_prefill_case(seed=13, batch=4, page_size=5, num_kv_heads=2, group=3, head_dim=40)
    args = [_strided(t) for t in case.args]
    assert not any(t.is_contiguous() for t in args[:3])
    assert rel_error(PREFILLERS[backend](*args), case.expected()) < F32_TOL


@pytest.mark.parametrize("backend", sorted(set(DECODERS) - ON_CPU_FLOAT32_ONLY))
def test_float64_inputs_give_float64_exactly(backend):
    case = make_decode_case(seed=3, batch=4, page_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float64)
    out = DECODERS[backend](*case.args)
    assert out.dtype == torch.float64
    assert rel_error(out, case.expected()) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", sorted(set(DECODERS) - ON_CPU_FLOAT32_ONLY))
def test_half_precision_inputs(backend, dtype):
    case = make_decode_case(seed=4, batch=4, page_size=16, num_kv_heads=2, group=4, head_dim=64, dtype=dtype)
    out = DECODERS[backend](*case.args)
    assert out.dtype == dtype
    assert rel_error(out, case.expected()) < 1e-2


@pytest.mark.parametrize("backend", sorted(DECODERS))
def test_check_values_false_gives_the_same_answer(backend):
    """The switch only skips the host-side checks of valid input; the answer is unchanged."""
    case = make_decode_case(seed=8, batch=5, page_size=16, num_kv_heads=2, group=2, head_dim=64)
    torch.testing.assert_close(DECODERS[backend](*case.args, check_values=False), DECODERS[backend](*case.args))


def test_prefill_last_row_is_a_decode_step():
    """Row q_len-1 of a prefill is the decode query of the whole sequence; row q_len-2 is the
    decode query of the sequence one token shorter (the oracle agrees with itself across modes)."""
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
    out = reference_paged_prefill(*case.args)
    last = reference_paged_decode(case.q[:, :, 2], *args, case.seq_lens)
    before = reference_paged_decode(case.q[:, :, 1], *args, case.seq_lens - 1)
    torch.testing.assert_close(out[:, :, 2], last)
    torch.testing.assert_close(out[:, :, 1], before)


# ---- validation: every backend names the argument, the expectation and what it got ---------
REJECTING_DECODERS = {"reference", "flex"}  # the common checks; triton and sdpa: their own modules


@pytest.mark.parametrize("backend", sorted(REJECTING_DECODERS))
@pytest.mark.parametrize("name,change,error,words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_prefill_rejects(backend, name, change, error, words):
    check_rejects(PREFILLERS[backend], change, error, words, decode=False)


@pytest.mark.parametrize("backend", sorted(REJECTING_DECODERS))
@pytest.mark.parametrize("name,change,error,words", DECODE_BAD_INPUTS, ids=[b[0] for b in DECODE_BAD_INPUTS])
def test_decode_rejects(backend, name, change, error, words):
    check_rejects(DECODERS[backend], change, error, words, decode=True)


@pytest.mark.parametrize("backend", sorted(REJECTING_DECODERS))
def test_decode_rejects_4d_q(backend):
    a = valid_inputs()
    del a["q_lens"]
    with pytest.raises(ValueError, match=r"q must have shape \[batch, num_q_heads, head_dim\]"):
        DECODERS[backend](*a.values())
