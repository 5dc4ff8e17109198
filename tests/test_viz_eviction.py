"""Notebook 07's data functions, figures and widget callback (synthetic K/V; no model load)."""

import itertools
import json
import math

import matplotlib
import pytest
import torch
from matplotlib.figure import Figure

matplotlib.use("Agg")

import paged_ref.lab.viz.eviction as ve  # noqa: E402
import paged_ref.lab.widgets.eviction as we  # noqa: E402
from paged_ref.eviction import token_scores  # noqa: E402
from paged_ref.lab import eviction_analysis as analysis  # noqa: E402
from paged_ref.lab import stats  # noqa: E402
from paged_ref.lab.bench import eviction_report as report  # noqa: E402
from paged_ref.lab.eviction_replay import layout_stats, replay  # noqa: E402


def kv(seed=0, n=96, layers=3, heads=2, dim=8):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, heads, dim, generator=g) * torch.rand(n, 1, 1, generator=g).add(0.2) for _ in range(layers)]
    vs = [torch.randn(n, heads, dim, generator=g) * torch.rand(n, 1, 1, generator=g).add(0.2) for _ in range(layers)]
    return ks, vs


# --------------------------------------------------------------------------- scores
def test_layer_scores_are_token_scores_per_layer():
    ks, vs = kv()
    s = analysis.layer_scores(ks, vs)
    for m, t in s.items():
        assert t.shape == (3, 96)
        for layer in range(3):
            assert torch.equal(t[layer], token_scores(ks[layer], vs[layer], m))


def test_spearman_against_a_plain_rank_correlation():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(50, generator=g), torch.randn(50, generator=g)
    ra = torch.tensor([sorted(a.tolist()).index(x) for x in a.tolist()], dtype=torch.float64)
    rb = torch.tensor([sorted(b.tolist()).index(x) for x in b.tolist()], dtype=torch.float64)
    expected = float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])
    assert stats.spearman(a, b) == pytest.approx(expected, abs=1e-12)
    assert stats.spearman(a, a.exp()) == pytest.approx(1.0)  # monotone transform: same order
    assert stats.spearman(a, -a) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="same length"):
        stats.spearman(a, b[:10])


def test_correlations_on_constructed_norms():
    """Equal key norms: the ratio orders tokens exactly like ||V||; 1/||K|| then carries nothing."""
    n = 40
    k = torch.ones(n, 1, 4)  # ||K|| = 2 for every token
    v = torch.arange(1, n + 1, dtype=torch.float32).view(n, 1, 1).expand(n, 1, 4).clone()
    corr = analysis.score_correlations(analysis.layer_scores([k, k], [v, v]))
    assert corr[("value_key_ratio", "value_norm")] == pytest.approx([1.0, 1.0])
    assert corr[("value_key_ratio", "value_norm", "shared")] == pytest.approx(1.0)


def test_layer_agreement_identical_layers_and_weights():
    s = torch.rand(1, 64).repeat(4, 1)  # four identical layers
    a = analysis.layer_agreement(s, 16)
    assert (a["pairwise"] == 1).all() and (a["vs_shared"] == 1).all()
    assert a["weight"] == pytest.approx([0.25] * 4)
    s[3] *= 10  # a layer with 10x larger scores
    a = analysis.layer_agreement(s, 16)
    assert a["weight"][3] == pytest.approx(10 / 13)
    g = torch.Generator().manual_seed(0)
    a = analysis.layer_agreement(torch.rand(3, 64, generator=g), 16)  # independent layers: partial overlap
    assert a["pairwise"].diagonal().tolist() == [1, 1, 1] and (a["pairwise"] < 1).sum() == 6


def test_swap_check_reverses_the_order():
    n = 32
    k = torch.linspace(1, 4, n).view(n, 1, 1).expand(n, 2, 4).contiguous()  # ||K|| rising
    v = torch.linspace(4, 1, n).view(n, 1, 1).expand(n, 2, 4).contiguous()  # ||V|| falling
    out = analysis.swap_check([k], [v], budget=8)
    assert out["spearman"] == pytest.approx([-1.0])
    assert out["kept_overlap"] == [0.0]  # the swap keeps the other end
    assert out["values_replaced_by_keys"] == [True]
    right = token_scores(k, v)
    assert int(right.argmax()) == 0  # small K, large V: keep


# --------------------------------------------------------------------------- replay
def test_replay_full_evicts_nothing_and_bad_input():
    ks, vs = kv()
    r = replay(ks, vs, "full", page_size=16, prompt_len=40)
    assert r.kept.all() and r.budget is None and r.stats.tokens_evicted == 0
    with pytest.raises(ValueError, match="prompt_len"):
        replay(ks, vs, "full", page_size=16, prompt_len=97)
    with pytest.raises(TypeError, match="policy"):
        replay(ks, vs, 3, page_size=16, prompt_len=40)
    with pytest.raises(ValueError, match="ks\\[1\\]"):
        replay([ks[0], ks[1][:5]], vs[:2], "full", page_size=16, prompt_len=4)


def layer_mean(ks, vs, method="value_key_ratio"):
    return torch.stack([token_scores(k, v, method) for k, v in zip(ks, vs)]).mean(0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_paged_eviction_prefill_topc_then_whole_pages(seed):
    ks, vs = kv(seed, n=160)
    r = replay(ks, vs, "paged_eviction", budget=32, page_size=8, prompt_len=64)
    # prefill: the top-32 of the layer-mean ratio over the prompt (the first and newest pages reserved)
    score = layer_mean([k[:64] for k in ks], [v[:64] for v in vs])
    score[:8] = math.inf
    score[56:] = math.inf
    top = set(torch.sort(score, descending=True, stable=True).indices[:32].tolist())
    assert set(torch.nonzero(r.evicted_at[:64] != 0).flatten().tolist()) == top
    # decode: every decode-phase eviction takes a whole page of 8 consecutive, aligned tokens
    gone = torch.nonzero(r.evicted_at[64:] > 0).flatten() + 64
    runs = sorted(set((int(p) - 64) // 8 for p in gone))
    for page in runs:
        assert (r.evicted_at[64 + 8 * page : 64 + 8 * page + 8] > 0).all()
    assert layout_stats(r.kept, 8, 64)["holes"] == 0
    assert int(r.kept.sum()) <= 32 + 8 and r.max_pages <= 32 // 8 + 1


def test_replay_chunks_give_the_token_by_token_result():
    ks, vs = kv(5, n=120)
    for name in ("paged_eviction", "streaming_llm", "token_topk"):
        a = replay(ks, vs, name, budget=32, page_size=8, prompt_len=50)
        b = replay(ks, vs, name, budget=32, page_size=8, prompt_len=50, chunk=1)
        assert torch.equal(a.evicted_at, b.evicted_at), name


def test_replay_streaming_llm_and_token_topk():
    ks, vs = kv(7, n=128)
    r = replay(ks, vs, "streaming_llm", budget=32, page_size=8, prompt_len=64)
    kept = torch.nonzero(r.kept).flatten().tolist()
    assert kept[:4] == [0, 1, 2, 3] and kept[-1] == 127  # sinks and the newest token
    assert int(r.kept.sum()) <= 32 + 8
    t = replay(ks, vs, "token_topk", budget=32, page_size=8, prompt_len=64)
    assert int(t.kept.sum()) == 32 and t.stats.tokens_moved > 0 and t.stats.pages_dropped == 0
    assert layout_stats(t.kept, 8, 64)["holes"] > 0  # scattered survivors leave holes
    # when each token left: 32 at prefill, then exactly one per decoded token (t = 1 .. 64)
    assert int((t.evicted_at == 0).sum()) == 32
    assert torch.bincount(t.evicted_at[t.evicted_at > 0], minlength=65)[1:].tolist() == [1] * 64


def test_layout_stats_against_a_loop():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        n, ps = int(torch.randint(5, 60, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        kept = torch.rand(n, generator=g) < 0.4
        lo = int(torch.randint(0, n, (1,), generator=g))
        got = layout_stats(kept, ps, lo)
        pages = {p // ps for p in range(lo, n) if kept[p]}
        slots = sum(1 for p in range(lo, n) if p // ps in pages)
        assert got["pages_held"] == len(pages) and got["holes"] == slots - int(kept[lo:].sum())
    with pytest.raises(ValueError, match="bool"):
        layout_stats(torch.ones(4), 2)


# --------------------------------------------------------------------------- the evaluation's JSON
def fake_results(delta_nll=0.1, ratio_correct=18, abl_correct=2, trials=20):
    """Results shaped like `python -m paged_ref.lab.bench eviction` writes them."""
    lm_rows, pk_rows = [], []
    for text, ps, c in itertools.product(range(2), (16, 32), (128, 256)):
        base = 3.0 + 0.01 * text + 0.001 * c / 128 + 0.0001 * ps
        lm_rows.append(dict(policy="paged_eviction", text=text, page_size=ps, budget=c, nll=base))
        for abl in report.ABLATIONS:
            jitter = 0.01 * ((text + ps // 16 + c // 128) % 3 - 1) if delta_nll == 0 else 0.0
            lm_rows.append(dict(policy=abl, text=text, page_size=ps, budget=c, nll=base + delta_nll + jitter))
    for trial in range(trials):
        for c in (128,):
            pk_rows.append(dict(policy="paged_eviction", trial=trial, budget=c, correct=trial < ratio_correct))
            for abl in report.ABLATIONS:
                pk_rows.append(dict(policy=abl, trial=trial, budget=c, correct=trial < abl_correct))
    lm_summary = [
        dict(
            policy=p,
            budget=c,
            page_size=ps,
            texts=2,
            nll=3.0,
            nll_ci95=[2.9, 3.1],
            ppl=math.exp(3.0),
            ppl_ci95=[math.exp(2.9), math.exp(3.1)],
            kl_vs_full=0.1,
            max_pages_held=9,
            page_bound=9,
            kv_bytes_held=2**20 * (9 if p != "full" else 20),
            tokens_moved=0,
        )
        for p in ("full", "paged_eviction", *report.ABLATIONS)
        for ps in (16, 32)
        for c in (128, 256)
    ]
    retention_rows = [dict(r, nll=r["nll"] - 2.0) for r in lm_rows]  # the same differences, lower NLL
    pk_summary = [
        dict(
            policy=p,
            budget=128,
            trials=trials,
            correct=5,
            accuracy=0.25,
            ci95=[0.1, 0.5],
            key_held=7,
            key_held_rate=0.35,
            correct_when_held=4,
            correct_when_lost=1,
            key_readable=8,
            correct_when_unreadable=0,
            needle_held_mean=0.625,
            answered_number=9,
        )
        for p in ("full", "paged_eviction", *report.ABLATIONS)
    ]
    speed = [
        dict(
            policy=p,
            budget=None if p == "full" else 128,
            context=2048,
            batch=1,
            ms_per_token=100.0 * (i + 1),
            time_per_token_vs_full=float(i + 1),
            time_per_token_vs_full_paired=float(i + 1),  # each round's full-cache tokens/s over this one's
            tokens_per_s=10.0 / (i + 1),
            ratio_vs_full=1 / (i + 1),
            tokens_per_s_rounds=[9.0 / (i + 1), 10.0 / (i + 1), 12.0 / (i + 1)],
            kv_bytes_held=2**20 * (4 - i),
        )
        for i, p in enumerate(("full", "paged_eviction", "token_topk"))
    ]
    return dict(
        mode="quick",
        model="m",
        environment=dict(cpu="x86_64", torch="2", python="3", date_utc="d"),
        seconds=1.0,
        language_modelling=lm_summary,
        retention=[dict(r, nll=1.0, ppl=math.e, ppl_ci95=[math.exp(0.9), math.exp(1.1)]) for r in lm_summary],
        passkey=pk_summary,
        lm_rows=lm_rows,
        retention_rows=retention_rows,
        passkey_rows=pk_rows,
        speed=speed,
    )


def test_ablation_verdicts_follow_the_numbers():
    better = {r["ablation"]: r for r in report.ablation(fake_results(delta_nll=0.1, ratio_correct=18, abl_correct=2))}
    r = better["value_norm"]
    assert r["lm_cells"] == 8 and r["lm_mean_diff"] == pytest.approx(0.1) and r["lm_ratio_wins"] == 8
    assert r["lm_verdict"] == "ratio better" and r["passkey_verdict"] == "ratio better"
    assert r["retention_cells"] == 8 and r["retention_mean_diff"] == pytest.approx(0.1)
    assert r["retention_verdict"] == "ratio better"
    assert (r["passkey_only_ratio"], r["passkey_only_ablation"]) == (16, 0)
    assert r["passkey_mcnemar_p"] == pytest.approx(2 / 2**16)
    assert r["passkey_paired_verdict"] == "ratio better"
    # 16/20 vs 8/20, 8 discordant trials all for the ratio: the Wilson intervals overlap, the
    # paired test (p = 2 / 2**8) resolves it; 4 discordant trials (p = 0.125) do not
    close = report.ablation(fake_results(ratio_correct=16, abl_correct=8, trials=20))[0]
    assert close["passkey_verdict"] == "not resolved" and close["passkey_paired_verdict"] == "ratio better"
    assert close["passkey_mcnemar_p"] == pytest.approx(2 / 2**8)
    closer = report.ablation(fake_results(ratio_correct=16, abl_correct=12, trials=20))[0]
    assert closer["passkey_paired_verdict"] == "not resolved"
    worse = report.ablation(fake_results(delta_nll=-0.1, ratio_correct=2, abl_correct=18))[0]
    assert worse["lm_verdict"] == "ratio worse" and worse["passkey_verdict"] == "ratio worse"
    tie = report.ablation(fake_results(delta_nll=0.0, ratio_correct=10, abl_correct=9))[0]
    assert tie["lm_verdict"] == "not resolved" and tie["passkey_verdict"] == "not resolved"
    assert tie["lm_ci95"][0] < 0 < tie["lm_ci95"][1]
    text = report.ablation_table(report.ablation(fake_results()))
    assert "ratio vs random" in text and "ratio better" in text
    one = fake_results()
    one["lm_rows"] = [r for r in one["lm_rows"] if r["text"] == 0 and r["page_size"] == 16 and r["budget"] == 128]
    single = report.ablation(one)[0]
    assert single["lm_cells"] == 1 and single["lm_verdict"] == "not resolved"
    assert "no interval from 1 cell" in report.ablation_table([single])


def test_lm_pairs():
    res = fake_results()
    first = res["language_modelling"][4]
    assert (first["policy"], first["page_size"], first["budget"]) == ("paged_eviction", 16, 128)
    first["nll"] = 2.5
    pairs = report.lm_pairs(res, "paged_eviction", "value_norm")
    assert [(p["page_size"], p["budget"]) for p in pairs] == [(16, 128), (16, 256), (32, 128), (32, 256)]
    assert (pairs[0]["nll_a"], pairs[0]["nll_b"], pairs[1]["nll_a"]) == (2.5, 3.0, 3.0)
    assert report.lm_pairs(res, "paged_eviction", "no_such_policy") == []


def test_wilson_matches_the_known_interval():
    assert [round(x, 3) for x in stats.wilson(6, 10)] == [0.313, 0.832]


def test_load_results_prefers_full(tmp_path):
    assert report.load_results(tmp_path) == (None, None)
    (tmp_path / "eviction_quick.json").write_text(json.dumps({"mode": "quick"}))
    assert report.load_results(tmp_path) == ("eviction_quick.json", {"mode": "quick"})
    (tmp_path / "eviction_full.json").write_text(json.dumps({"mode": "full"}))
    assert report.load_results(tmp_path)[0] == "eviction_full.json"


def test_tables_print_exact_numbers():
    res = fake_results()
    lm = report.lm_table(res)
    assert f"{math.exp(3.0):.3f}" in lm and lm.count("\n") == 1 + len(res["language_modelling"])
    pk = report.passkey_table(res)
    assert "[0.100, 0.500]" in pk and "8/20" in pk and "0.62" in pk and "9/20" in pk
    assert "x86_64" in report.provenance(res) and "quick run" in report.provenance(res)
    speed = report.speed_table(res).splitlines()
    assert len(speed) == 5
    expected = ["2048", "1", "token_topk", "128", "300.0", "3.000", "3.000", "3.33", "3.00-4.00", "0.333", "2.00"]
    assert speed[4].split() == expected
    assert "2.9000-3.1000" in lm and "texts" in lm
    ret = report.lm_table(res, task="retention")
    assert f"{math.e:.3f}" in ret and ret.count("\n") == 1 + len(res["retention"])


# --------------------------------------------------------------------------- figures and widget
def test_figures_build():
    ks, vs = kv(n=64)
    s = analysis.layer_scores(ks, vs)
    res = fake_results()
    figs = [
        ve.score_distribution_figure(s),
        ve.score_positions_figure(s, budget=16),
        ve.correlation_figure(analysis.score_correlations(s)),
        ve.agreement_figure(analysis.layer_agreement(s["value_key_ratio"], 16), 16),
        ve.perplexity_figure(res),
        ve.perplexity_figure(res, "retention", policies=["full", "paged_eviction", "value_norm"]),
        ve.passkey_figure(res),
        ve.ablation_figure(res, report.ablation(res)),
        ve.cost_figure(res),
    ]
    # the default leaves the score ablations to ablation_figure; error bars are the CI of each cell
    drawn = [t.get_text() for t in figs[4].axes[-1].get_legend().get_texts()]
    assert "paged_eviction" in drawn and not set(drawn) & set(report.ABLATIONS)
    assert [t.get_text() for t in figs[5].axes[-1].get_legend().get_texts()] == [
        "full cache",
        "paged_eviction",
        "value_norm",
    ]
    long = ve.perplexity_figure(
        dict(res, long_context=res["language_modelling"], config={"long_context": 4096}), "long_context"
    )
    assert "after 4096 tokens" in long.axes[0].get_ylabel()
    runs = [replay(ks, vs, p, budget=16, page_size=4, prompt_len=32) for p in ("paged_eviction", "token_topk")]
    figs += [ve.page_map_figure(runs), ve.fragmentation_figure(runs)]
    assert all(isinstance(f, Figure) and f.axes for f in figs)
    grid = ve._page_grid(runs[1])  # codes: 1 kept, 2 prefill, 3 decode
    assert grid.shape == (16, 4) and (grid == 1).sum() == 16 and (grid[8:] != 2).all()


def test_widget_view_and_errors():
    ks, vs = kv(n=96, layers=2)
    fig = we.kept_pages_view(32, 8, "token_topk", kv=(ks, vs), prompt_len=48)
    assert [ax.get_title().split("\n")[0] for ax in fig.axes] == ["paged_eviction", "token_topk (ratio)"]
    labels = [
        ve.policy_label(replay(ks, vs, name, budget=32, page_size=8, prompt_len=48))
        for name in ("paged_eviction", "paged_eviction_literal", "value_norm", "key_value_ratio", "streaming_llm")
    ]
    assert labels == [
        "paged_eviction",
        "paged_eviction_literal",
        "page eviction (||V||)",
        "page eviction (||K||/||V||)",
        "streaming_llm",
    ]
    alone = we.kept_pages_view(32, 8, "paged_eviction", kv=(ks, vs))
    assert len(alone.axes) == 1
    with pytest.raises(ValueError, match="policy"):
        we.kept_pages_view(32, 8, "lru", kv=(ks, vs))
    with pytest.raises(TypeError, match="kv"):
        we.kept_pages_view(32, 8, kv=ks)
    # the tightest slider corner (smallest C, largest B) is valid for every policy
    big_k, big_v = kv(n=256, layers=1)
    for name in we.POLICIES:
        we.kept_pages_view(min(we.BUDGETS), max(we.PAGE_SIZES), name, kv=(big_k, big_v))
    panel = we.eviction_panel(kv=(ks, vs), prompt_len=48)
    assert len(panel.children) == 2
