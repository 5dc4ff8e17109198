"""Notebook 05's package code: the kernel's math in plain PyTorch, its figures and its widget.

The spec (`paged_ref.attention.online_softmax`) is checked against a float64 oracle on fresh
random paged batches (garbage in every slot and table entry it must not read), against the
Triton kernel itself (interpreter on CPU), and piece by piece against plain softmax.
"""

import io

import matplotlib
import pytest
import torch
from matplotlib.figure import Figure

matplotlib.use("Agg")

from attention_cases import HEAD_LAYOUT_IDS, HEAD_LAYOUTS, make_decode_case, rel_error  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from paged_ref.attention.online_softmax import (  # noqa: E402
    LOG2E,
    merge_partials,
    online_update,
    paged_decode_spec,
    split_ranges,
    token_slots,
)
from paged_ref.attention.reference import gather_sequence  # noqa: E402
from paged_ref.lab.softmax_steps import online_softmax_steps  # noqa: E402
from paged_ref.lab.viz import kernel as vk  # noqa: E402
from paged_ref.lab.widgets import kernel as wk  # noqa: E402


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def softmax_base2(scores, values):
    """Plain softmax attention with base-2 scores: softmax(s * ln 2) @ v, float64."""
    return torch.softmax(scores.double() / LOG2E, dim=-1) @ values.double()


# --- the spec of the kernel --------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 8, 16, 64])
@pytest.mark.parametrize("layout", HEAD_LAYOUTS, ids=HEAD_LAYOUT_IDS)
def test_spec_matches_float64_oracle(page_size, layout):
    num_kv_heads, group = layout
    case = make_decode_case(
        seed=31 * page_size + group, batch=3, page_size=page_size, num_kv_heads=num_kv_heads, group=group, head_dim=16
    )
    expected = case.expected()
    for num_splits, block_n in ((1, 32), (3, 8), (5, 5)):
        out = paged_decode_spec(*case.args, num_splits=num_splits, block_n=block_n)
        assert out.dtype == case.q.dtype and out.shape == case.q.shape
        assert rel_error(out, expected) < 1e-5, (num_splits, block_n)


def test_spec_float64_inputs_are_exact_to_rounding_and_custom_scale():
    case = make_decode_case(seed=7, batch=4, page_size=4, num_kv_heads=2, group=2, head_dim=8, dtype=torch.float64)
    for num_splits in (1, 2, 7):
        out = paged_decode_spec(*case.args, scale=0.3, num_splits=num_splits, block_n=4)
        assert rel_error(out, case.expected(scale=0.3)) < 1e-12


def test_spec_matches_the_triton_kernel_split_for_split():
    from paged_ref.attention.triton_decode import triton_paged_decode

    case = make_decode_case(seed=3, batch=2, page_size=8, num_kv_heads=2, group=2, head_dim=16, seq_lens=[70, 9])
    for num_splits in (1, 3):
        kernel = triton_paged_decode(*case.args, num_splits=num_splits)
        spec = paged_decode_spec(*case.args, num_splits=num_splits, block_n=32)
        assert rel_error(kernel, spec.double()) < 1e-6


def test_spec_rejects_bad_arguments_like_the_reference():
    case = make_decode_case(seed=1, batch=2, page_size=4, num_kv_heads=1, group=2, head_dim=8)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_spec(*case.args, num_splits=0)
    with pytest.raises(TypeError, match="block_n"):
        paged_decode_spec(*case.args, block_n=2.5)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_spec(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens * 1000)


# --- the pieces --------------------------------------------------------------------------------
@pytest.mark.parametrize("n, block_n", [(1, 4), (12, 4), (13, 5), (40, 64)])
def test_online_softmax_steps_end_at_the_softmax(n, block_n):
    gen = torch.Generator().manual_seed(n + block_n)
    scores = torch.randn(3, n, generator=gen) * 4  # [rows, n]
    values = torch.randn(n, 5, generator=gen)  # [n, d]
    steps = online_softmax_steps(scores, values, block_n=block_n)
    assert [(s.start, s.end) for s in steps] == [(a, min(a + block_n, n)) for a in range(0, n, block_n)]
    assert torch.allclose(steps[-1].out.double(), softmax_base2(scores, values), atol=1e-6)
    assert torch.equal(steps[0].alpha, torch.zeros(3))  # 2^(-inf - m) = 0
    for before, after in zip(steps, steps[1:]):  # the max never falls
        assert (after.m >= before.m).all()
        assert torch.allclose(after.alpha, torch.exp2(before.m - after.m))
    for s in steps:  # m is the max so far
        assert torch.equal(s.m, scores[:, : s.end].amax(dim=1))
        assert torch.allclose(s.out.double(), softmax_base2(scores[:, : s.end], values[: s.end]), atol=1e-6)


def test_online_update_is_overflow_free_where_the_naive_sum_is_not():
    scores = torch.tensor([[200.0, 0.0, 199.0]])  # 2^200 overflows float32
    values = torch.tensor([[1.0], [2.0], [3.0]])
    assert torch.isinf(torch.exp2(scores)).any()
    out = online_softmax_steps(scores, values, block_n=1)[-1].out
    assert torch.allclose(out.double(), softmax_base2(scores, values), atol=1e-6)


def test_online_softmax_steps_errors():
    with pytest.raises(ValueError, match="scores"):
        online_softmax_steps(torch.zeros(3), torch.zeros(3, 1), block_n=2)
    with pytest.raises(ValueError, match="values"):
        online_softmax_steps(torch.zeros(1, 3), torch.zeros(4, 1), block_n=2)
    with pytest.raises(ValueError, match="finite"):
        online_softmax_steps(torch.tensor([[0.0, float("inf")]]), torch.zeros(2, 1), block_n=2)
    with pytest.raises(ValueError, match="block_n"):
        online_softmax_steps(torch.zeros(1, 3), torch.zeros(3, 1), block_n=0)


@pytest.mark.parametrize(
    "seq_len, num_splits, block_n",
    [(1, 1, 32), (1, 4, 32), (100, 3, 16), (40, 4, 16), (64, 2, 32), (65, 2, 32), (300, 7, 8)],
)
def test_split_ranges_cover_the_sequence_in_whole_tiles(seq_len, num_splits, block_n):
    ranges = split_ranges(seq_len, num_splits, block_n=block_n)
    assert len(ranges) == num_splits
    assert ranges[0][0] == 0 and ranges[-1][1] == seq_len
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c and a <= b  # contiguous, in order
    for a, _ in ranges:
        assert a % block_n == 0 or a == seq_len  # tiles start aligned
    assert ranges[0][1] > 0  # split 0 never empty


def test_merge_partials_equals_one_softmax_with_empty_splits():
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 30, generator=gen) * 5  # [rows, n], base 2
    values = torch.randn(30, 4, generator=gen)
    parts = []
    for a, b in [(0, 7), (7, 7), (7, 29), (29, 30), (30, 30)]:  # uneven, two empty
        m = torch.full((2,), float("-inf"))
        l, acc = torch.zeros(2), torch.zeros(2, 4)
        if b > a:
            m, l, acc, _ = online_update(m, l, acc, scores[:, a:b], values[a:b])
        parts.append((m, l, acc))
    m, l, acc = (torch.stack(x) for x in zip(*parts))
    assert torch.allclose(merge_partials(m, l, acc).double(), softmax_base2(scores, values), atol=1e-6)
    with pytest.raises(ValueError, match="non-empty"):
        merge_partials(torch.full((2, 1), float("-inf")), torch.zeros(2, 1), torch.zeros(2, 1, 3))
    with pytest.raises(ValueError, match="num_splits"):
        merge_partials(m, l[:, :1], acc)


def test_token_slots_agree_with_the_gather():
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(9, 4, 1, 3, generator=gen)  # [pages, page_size, H, D]
    row = torch.tensor([6, 0, 8, 3], dtype=torch.int32)
    tokens = torch.arange(14)
    pages, offsets = token_slots(row, tokens, page_size=4)
    assert torch.equal(cache[pages, offsets], gather_sequence(cache, row, 14))
    with pytest.raises(ValueError, match="tokens"):
        token_slots(row, torch.tensor([16]), page_size=4)


# --- figures -----------------------------------------------------------------------------------
def physical_slot_colors(fig):
    """{slot: facecolor} of the unit cells in the physical row of a tile map."""
    ax = fig.axes[0]
    return {
        int(p.get_gid().split()[1]): p.get_facecolor() for p in ax.patches if (p.get_gid() or "").startswith("slot ")
    }


@pytest.mark.parametrize("page_size, block_n", [(1, 4), (4, 16), (16, 4), (8, 8)])
def test_tile_map_colors_every_slot_by_the_tile_that_reads_it(page_size, block_n):
    seq_len = 37
    table, num_pages = wk.shuffled_table(seq_len, page_size, seed=page_size)
    fig = vk.tile_map_figure(table, seq_len, page_size, block_n, num_splits=2, num_pages=num_pages)
    colors = physical_slot_colors(fig)
    assert len(colors) == num_pages * page_size
    expected = {}
    pages, offsets = token_slots(table, torch.arange(seq_len), page_size)
    for t, (p, o) in enumerate(zip(pages.tolist(), offsets.tolist())):
        expected[p * page_size + o] = to_rgba(vk.tile_color(t // block_n), 0.85)
    for slot, color in colors.items():
        want = expected.get(slot, to_rgba(vk.UNUSED_COLOR, 0.85))
        assert color == pytest.approx(want), slot


def test_tile_map_errors():
    with pytest.raises(ValueError, match="at least"):
        vk.tile_map_figure([0, 1], seq_len=9, page_size=4, block_n=4)
    with pytest.raises(ValueError, match="distinct"):
        vk.tile_map_figure([0, 0, 1], seq_len=9, page_size=4, block_n=4)
    with pytest.raises(ValueError, match="num_pages"):
        vk.tile_map_figure([5, 0, 1], seq_len=9, page_size=4, block_n=4, num_pages=3)


def test_online_and_split_figures_draw_their_inputs():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 12, generator=gen)
    steps = online_softmax_steps(scores, torch.randn(12, 2, generator=gen), block_n=4)
    fig = vk.online_softmax_figure(scores, steps)
    ax_l = fig.axes[1]
    bars = ax_l.patches  # per tile: old l * alpha, then the tile on top
    assert [p.get_height() for p in bars[0::2]] == pytest.approx(
        [0.0] + [float(a.l[0] * b.alpha[0]) for a, b in zip(steps, steps[1:])], rel=1e-6
    )
    assert [p.get_y() + p.get_height() for p in bars[1::2]] == pytest.approx([float(s.l[0]) for s in steps], rel=1e-6)
    with pytest.raises(ValueError, match="steps"):
        vk.online_softmax_figure(scores, [])
    ranges = split_ranges(12, 3, block_n=4)
    m = torch.tensor([scores[0, a:b].max() for a, b in ranges])
    l = torch.tensor([torch.exp2(scores[0, a:b] - scores[0, a:b].max()).sum() for a, b in ranges])
    fig = vk.split_reduction_figure(scores[0], ranges, m, l)
    shares = [p.get_height() for p in fig.axes[1].patches]
    assert sum(shares) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="one entry per split"):
        vk.split_reduction_figure(scores[0], ranges[:2], m, l)


def test_gqa_bytes_and_figure():
    assert vk.kv_bytes_requested(32, 8, 1000, 128, 2) == {
        "per_query_head": 32 * 2 * 1000 * 128 * 2,
        "per_kv_head": 8 * 2 * 1000 * 128 * 2,
    }
    fig = vk.gqa_figure(8, 2, 4096, 128)
    assert [p.get_height() for p in fig.axes[1].patches] == pytest.approx([16.0, 4.0])
    with pytest.raises(ValueError, match="multiple"):
        vk.kv_bytes_requested(6, 4, 10, 8)
    with pytest.raises(ValueError, match="seq_len"):
        vk.gqa_figure(8, 2, 0, 128)


def test_bandwidth_figure_reads_the_benchmark_json(monkeypatch):
    """Run the GPU harness on tiny CPU sizes (CPU timer for CUDA events), then draw its output."""
    from paged_ref.lab.bench import common, decode

    monkeypatch.setattr(decode, "gpu_median", lambda fn, **kw: common.cpu_median(fn, warmup=0, repeats=1)["median_s"])
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: dict(bytes=1, median_s=1.0, bandwidth_GBps=0.5))
    data = decode.run_gpu(
        [(2, 32)],
        [16, 32],
        budget_s=0,
        rep_ms=1,
        heads=dict(num_q_heads=2, num_kv_heads=1, head_dim=16),
        dtype=torch.float32,
        device="cpu",
    )
    data["environment"] = common.environment()
    fig = vk.bandwidth_figure(data)
    ax = fig.axes[0]
    heights = sorted(p.get_height() for p in ax.patches)
    want = sorted(r["bandwidth_GBps"] for r in data["results"] if r["page_size"] is not None)
    want += [r["bandwidth_GBps"] for r in data["results"] if r["page_size"] is None] * 2
    assert heights == pytest.approx(sorted(want))  # SDPA drawn at each page
    assert any(line.get_ydata()[0] == 0.5 for line in ax.get_lines())  # the copy ceiling
    assert "Measured on CPU" in fig.texts[-1].get_text()
    with pytest.raises(ValueError, match="results"):
        vk.bandwidth_figure({"copy": {}})


# --- the widget --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, tiles, pages, per_tile, splits",
    [
        ((4, 16, 2, 45), 3, 12, 4, [(0, 32), (32, 45)]),
        ((64, 16, 1, 100), 7, 2, 1, [(0, 100)]),
        ((16, 16, 4, 100), 7, 7, 1, [(0, 32), (32, 64), (64, 96), (96, 100)]),
        ((1, 8, 8, 10), 2, 10, 8, [(0, 8), (8, 10), (10, 10), (10, 10), (10, 10), (10, 10), (10, 10), (10, 10)]),
    ],
)
def test_tiling_numbers(args, tiles, pages, per_tile, splits):
    n = wk.tiling_numbers(*args)
    assert (n["tiles"], n["pages"], n["max_pages_per_tile"], n["splits"]) == (tiles, pages, per_tile, splits)
    assert n["empty_splits"] == sum(a == b for a, b in splits)
    assert n["rel_err"] < 1e-12


def test_tiling_view_is_a_new_figure_that_follows_its_inputs():
    a = wk.tiling_view(4, 16, 2, 45)
    b = wk.tiling_view(4, 16, 2, 45)
    c = wk.tiling_view(16, 16, 2, 45)
    assert isinstance(a, Figure) and a is not b
    assert "page 4, BLOCK_N 16" in a.axes[0].get_title()
    assert png(a) == png(b) and png(a) != png(c)


@pytest.mark.parametrize(
    "args, exc",
    [
        ((0, 16, 1, 10), ValueError),
        ((4, 16, 1, 10**4), ValueError),
        ((4, 16.0, 1, 10), TypeError),
        ((4, 16, 0, 10), ValueError),
    ],
)
def test_tiling_errors(args, exc):
    with pytest.raises(exc):
        wk.tiling_view(*args)


def test_tiling_panel_builds():
    panel = wk.tiling_panel()
    assert len(panel.children) == 3
