"""Notebook 04's mask pictures, position traces, churned example batch and widget callback."""

import io

import matplotlib
import pytest
import torch
from matplotlib.figure import Figure
from torch.nn.attention.flex_attention import create_mask

matplotlib.use("Agg")

from attention_cases import make_decode_case, make_prefill_case  # noqa: E402

from paged_ref.attention.flex import paged_block_masks  # noqa: E402
from paged_ref.lab.flex_inspect import block_mask_visits  # noqa: E402
from paged_ref.lab.viz.masks import (  # noqa: E402
    VERDICTS,
    block_masks_figure,
    expected_visible,
    format_traces,
    listed_blocks,
    mask_views_figure,
    page_owners,
    trace_position,
    translation_figure,
    untranslated_block_mask,
)
from paged_ref.lab.widgets.masks import KV_BLOCK_SIZES, PAGE_SIZES, check_lengths, churned_cache, mask_panel, mask_view  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def table_of(cache, seqs):
    bt, lens = cache.block_table(seqs)
    return bt, lens, cache.num_pages


# --------------------------------------------------------------------------- ground truth
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_expected_visible_agrees_with_the_attention_cases(page_size, prefill):
    """Two independent ground truths (this module's and the attention tests') agree."""
    make = make_prefill_case if prefill else make_decode_case
    case = make(seed=40 + page_size, batch=5, page_size=page_size, num_kv_heads=1, group=1, head_dim=4)
    q_len = case.q.shape[2] if prefill else 1
    got = expected_visible(
        case.block_table, case.seq_lens, case.k_cache.shape[0], page_size, q_lens=case.q_lens, q_len=q_len
    )
    assert torch.equal(got, case.physical_mask())


def test_page_owners_ignores_padding_and_lists_shared_pages():
    bt = torch.tensor([[2, 0, 3], [0, 9, 9]])  # row 1 uses page 0 only; 9s: out-of-range padding
    assert page_owners(bt, torch.tensor([9, 2]), num_pages=4, page_size=4) == [(0, 1), (), (0,), (0,)]
    assert page_owners(bt, torch.tensor([4, 2]), num_pages=4, page_size=4) == [(1,), (), (0,), ()]


def test_listed_blocks_is_the_block_lists_alone():
    masks = paged_block_masks(torch.tensor([[3, 1]]), torch.tensor([5]), num_pages=4, page_size=4, kv_block_size=8)
    listed = listed_blocks(masks.physical)[0, 0]  # [16]
    # pages 3 and 1 -> physical blocks 1 (slots 8..15) and 0 (slots 0..7)
    assert listed.tolist() == [True] * 16
    visits = block_mask_visits(masks.physical)[0, 0, 0]
    assert bool((listed | (visits == 0)).all()) and int(visits.sum()) == 5


# --------------------------------------------------------------------------- traces
def test_trace_position_steps_and_verdicts():
    bt = torch.tensor([[2, 0, 7], [1, 3, 7]])  # padding 7 is never used
    lens = torch.tensor([6, 8])
    t = trace_position(bt, lens, page_size=4, b=0, physical=2)  # page 0 = logical page 1
    assert (t.page, t.offset, t.logical_page, t.logical, t.verdict) == (0, 2, 1, 6, "past seq_lens")
    assert trace_position(bt, lens, 4, 0, 9).verdict == "kept"  # page 2, logical 1
    assert trace_position(bt, lens, 4, 0, 5).verdict == "another sequence's page"
    assert trace_position(bt, lens, 4, 0, 29).verdict == "not in the batch"  # padding page 7
    t = trace_position(bt, lens, 4, 1, 13, q_lens=torch.tensor([2, 3]), q_idx=0)
    assert (t.logical, t.verdict) == (5, "kept")  # query 0 sits at position 5
    t = trace_position(bt, lens, 4, 1, 14, q_lens=torch.tensor([2, 3]), q_idx=0)
    assert t.verdict == "causal: after the query" and not t.kept
    assert trace_position(bt, lens, 4, 1, 13, q_lens=torch.tensor([2, 3]), q_idx=3).verdict == ("padding query row")
    assert {
        trace_position(bt, lens, 4, b, x, q_lens=torch.tensor([2, 3]), q_idx=i).verdict
        for b in (0, 1)
        for x in range(32)
        for i in (0, 3)
    } == set(VERDICTS)
    table = format_traces([trace_position(bt, lens, 4, 0, x) for x in (2, 9)])
    assert table.splitlines()[1].split() == ["2", "0", "2", "1", "6", "past", "seq_lens"]
    assert table.splitlines()[2].split() == ["9", "2", "1", "0", "1", "kept"]


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("page_size", [1, 4, 8])
def test_trace_agrees_with_the_physical_mask_mod_everywhere(page_size, prefill):
    cache, seqs = churned_cache([9, 3, 17, 1], page_size, seed=page_size)
    bt, lens, num_pages = table_of(cache, seqs)
    q_lens = torch.tensor([3, 3, 2, 0], dtype=torch.int32) if prefill else None  # 0: padding
    q_len = 3 if prefill else 1
    masks = paged_block_masks(bt, lens, num_pages, page_size, q_len=q_len, q_lens=q_lens, kv_block_size=8)
    says = create_mask(masks.physical.mask_mod, 4, 1, q_len, num_pages * page_size)[:, 0]
    for b in range(4):
        for i in range(q_len):  # padding query rows included
            for x in range(num_pages * page_size):
                t = trace_position(bt, lens, page_size, b, x, q_lens=q_lens, q_idx=i)
                assert t.kept == bool(says[b, i, x]), (b, i, x, t)


# --------------------------------------------------------------------------- example batch
def test_churned_cache_scatters_pages_and_reuses_the_finished_requests():
    cache, seqs = churned_cache([11, 5, 16], page_size=4, seed=0, num_kv_heads=2, head_dim=8)
    bt, lens, num_pages = table_of(cache, seqs)
    assert lens.tolist() == [11, 5, 16] and num_pages == 3 + 2 + 4 + 2
    rows = [cache.pages(s) for s in seqs]
    held = [p for r in rows for p in r]
    assert len(set(held)) == len(held) == 9  # no page held twice
    assert any(r != sorted(r) for r in rows)  # out of order: X's pages reused
    assert cache.allocator.num_free == 2
    for s in seqs:  # every token written, finite
        k, v = cache.gather(0, s)
        assert k.abs().sum(-1).gt(0).all() and v.abs().sum(-1).gt(0).all()
    free = [p for p in range(num_pages) if cache.allocator.refcount(p) == 0]
    assert not cache.k_cache[0][free].any()  # X's pages were zeroed when freed


def test_churned_cache_is_seeded_and_layout_independent_of_head_shape():
    a, sa = churned_cache([7, 12], 2, seed=3)
    b, sb = churned_cache([7, 12], 2, seed=3, num_kv_heads=2, head_dim=16)
    c, sc = churned_cache([7, 12], 2, seed=4)
    assert torch.equal(a.block_table(sa)[0], b.block_table(sb)[0])
    assert torch.equal(a.k_cache[0], churned_cache([7, 12], 2, seed=3)[0].k_cache[0])
    assert not torch.equal(a.block_table(sa)[0], c.block_table(sc)[0])


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_churned_cache_fits_any_page_size(page_size):
    for lens in ([1], [1, 1, 1], [64, 2, 33]):
        cache, seqs = churned_cache(lens, page_size, seed=1, spare_pages=0)
        assert [cache.seq_len(s) for s in seqs] == lens and cache.allocator.num_free == 0


def test_churned_cache_errors():
    with pytest.raises(ValueError, match="at least one sequence"):
        churned_cache([], 4)
    with pytest.raises(ValueError, match=r"lengths\[1\] must be >= 1"):
        churned_cache([3, 0], 4)
    with pytest.raises(TypeError, match="page_size must be an int"):
        churned_cache([3], 4.0)
    with pytest.raises(ValueError, match="spare_pages must be >= 0"):
        churned_cache([3], 4, spare_pages=-1)


# --------------------------------------------------------------------------- figures
def test_block_masks_figure_reports_block_visits():
    cache, seqs = churned_cache([11, 5, 16], 4)
    bt, lens, num_pages = table_of(cache, seqs)
    masks = paged_block_masks(bt, lens, num_pages, 4, kv_block_size=8)
    fig = block_masks_figure(masks, bt, lens, 4)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    n_log, n_phys = int(masks.logical.kv_num_blocks.sum()), int(masks.physical.kv_num_blocks.sum())
    assert f"logical BlockMask: {n_log} block visits" in titles
    assert f"physical BlockMask: {n_phys} block visits" in titles
    assert n_phys > n_log  # blocks of 8 over pages of 4


def test_mask_views_figure_counts_leaks_misses_and_double_visits():
    bt, lens = torch.tensor([[1], [0]]), torch.tensor([3, 2])
    truth = expected_visible(bt, lens, 2, 4)  # [2, 1, 8]
    leak = truth.clone()
    leak[0, 0, 0] = True  # row 0 sees row 1's slot
    miss = truth.int()
    miss[1, 0, 1] = 0
    twice = truth.int() * 2
    fig = mask_views_figure(
        [("right", truth), ("leak", leak), ("miss", miss), ("twice", twice)],
        bt,
        lens,
        4,
        expected=truth,
        names=["A", "B"],
    )
    titles = [ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")]
    assert titles == [
        "right\nmatches the ground truth",
        "leak\n1 wrong cells",
        "miss\n1 wrong cells",
        "twice\n5 wrong cells",
    ]
    with pytest.raises(ValueError, match="must have shape"):
        mask_views_figure([("bad", truth[:1])], bt, lens, 4, expected=truth)
    with pytest.raises(ValueError, match="at least one"):
        mask_views_figure([], bt, lens, 4, expected=truth)


def test_untranslated_block_mask_is_caught_by_the_replay_only():
    cache, seqs = churned_cache([11, 5, 16], 4)
    bt, lens, num_pages = table_of(cache, seqs)
    masks = paged_block_masks(bt, lens, num_pages, 4, kv_block_size=8)
    broken = untranslated_block_mask(masks)
    truth = expected_visible(bt, lens, num_pages, 4)
    assert torch.equal(create_mask(broken.mask_mod, 3, 1, 1, num_pages * 4)[:, 0], truth)
    assert not torch.equal(block_mask_visits(broken)[:, 0], truth.int())
    assert torch.equal(block_mask_visits(masks.physical)[:, 0], truth.int())


def test_translation_figure_has_one_panel_per_sequence():
    cache, seqs = churned_cache([11, 5, 16], 4)
    bt, lens, num_pages = table_of(cache, seqs)
    fig = translation_figure(bt, lens, num_pages, 4)
    assert len(fig.axes) == 3
    assert fig.axes[0].get_title(loc="left") == f"seq 0: 11 tokens, block table row {cache.pages(seqs[0])}"
    big, bs = churned_cache([64, 64], 1)
    fig = translation_figure(*table_of(big, bs), 1)  # 130 pages: no labels, short rows
    assert "..." in fig.axes[0].get_title(loc="left")


# --------------------------------------------------------------------------- widget
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mask_view_is_exact_for_every_slider_position(page_size, prefill):
    for kv_block in KV_BLOCK_SIZES[:: 2 if page_size > 1 else 1]:
        fig = mask_view(page_size, kv_block, (11, 5, 16), prefill=prefill)
        assert isinstance(fig, Figure)
        assert fig._suptitle.get_text().endswith("ground truth: exact")


def test_mask_view_is_pure_and_follows_its_inputs():
    base = png(mask_view(4, 8, "11, 5, 16"))
    assert png(mask_view(4, 8, (11, 5, 16))) == base
    assert png(mask_view(8, 8, (11, 5, 16))) != base
    assert png(mask_view(4, 16, (11, 5, 16))) != base
    assert png(mask_view(4, 8, (11, 5, 17))) != base
    assert "page size 2, flex KV block 32, lengths 3, 9" in mask_view(2, 32, "3 9")._suptitle.get_text()


def test_check_lengths():
    assert check_lengths("11, 5,16") == (11, 5, 16)
    assert check_lengths([1]) == (1,) and check_lengths(torch.tensor([2, 3])) == (2, 3)
    with pytest.raises(ValueError, match="whole numbers"):
        check_lengths("11, five")
    with pytest.raises(ValueError, match="1 to 6 sequences"):
        check_lengths("")
    with pytest.raises(ValueError, match="1 to 6 sequences"):
        check_lengths([1] * 7)
    with pytest.raises(ValueError, match="<= 64"):
        check_lengths([65])
    with pytest.raises(ValueError, match=r"lengths\[0\] must be >= 1"):
        check_lengths([0])
    with pytest.raises(TypeError, match="lengths must be a sequence"):
        check_lengths(12)


def test_mask_view_errors():
    with pytest.raises(ValueError, match="kv_block_size must be a positive power of two"):
        mask_view(4, 12)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        mask_view(0, 8)


def test_mask_panel_builds():
    panel = mask_panel()
    assert len(panel.children) == 3


def test_block_kinds_of_a_causal_mask():
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    from paged_ref.lab.viz.masks import FULL, PARTIAL, SKIPPED, block_kinds, block_mask_figure

    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    bm = create_block_mask(causal, None, None, 12, 12, device="cpu", BLOCK_SIZE=4)
    kinds = block_kinds(bm)
    # diagonal blocks need the mask_mod, blocks below it are full, blocks above are never visited
    assert kinds.tolist() == [[PARTIAL, SKIPPED, SKIPPED], [FULL, PARTIAL, SKIPPED], [FULL, FULL, PARTIAL]]
    # every kept element lies in a visited block, and full blocks hold only kept elements
    dense = create_mask(causal, 1, 1, 12, 12)[0, 0]
    per_elem = kinds.repeat_interleave(4, 0).repeat_interleave(4, 1)
    assert (per_elem[dense] != SKIPPED).all() and dense[per_elem == FULL].all()
    block_mask_figure(bm, dense)


def test_block_kinds_full_and_partial_in_one_row():
    from torch.nn.attention.flex_attention import create_block_mask

    from paged_ref.lab.viz.masks import FULL, PARTIAL, block_kinds

    # keys 0..4 kept: block 0 (keys 0-3) is full, block 1 (keys 4-7) partial
    bm = create_block_mask(lambda b, h, q, kv: kv < 5, None, None, 4, 8, device="cpu", BLOCK_SIZE=4)
    assert block_kinds(bm).tolist() == [[FULL, PARTIAL]]
