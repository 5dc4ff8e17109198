"""`python -m paged_ref.lab.bench serve --quick`: the harness at toy sizes on the tiny model, and its figures."""

import json
import statistics

import pytest

from paged_ref.lab.bench import serve
from paged_ref.lab.viz import serve as viz


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve")
    data = serve.main(["--quick", "--out", str(out)])
    return data, json.loads((out / "serve_cpu_quick.json").read_text())


def test_quick_run_writes_every_section(quick):
    data, saved = quick
    assert saved["mode"] == "quick" and saved["clock"] == "simulated" and saved["environment"]["torch"]
    assert [r["rate"] for r in saved["rates"]] == list(serve.PROFILES["quick"]["rates"])
    n = saved["workload"]["requests"]
    for row in saved["rates"]:
        res = row["policies"]
        assert set(res) == set(serve.POLICIES)
        for name in ("paged", "exact", "max_len"):  # admission differs, tokens do not
            assert res[name]["requests_with_paged_tokens"] == n and res[name]["requests"] == n
        assert res["max_len"]["peak_running"] <= serve.PROFILES["quick"]["num_pages"] // 16
        assert res["exact"]["preemptions"] == res["max_len"]["preemptions"] == 0
        for r in res.values():
            assert r["tokens"] == sum(saved["workload"]["output_lens"])
            assert r["peak_pages"] <= r["peak_committed_pages"] <= serve.PROFILES["quick"]["num_pages"]
            assert r["ttft_p50_s"] <= r["ttft_p90_s"]
    peer = saved["peer"]
    assert peer["requests_with_identical_tokens"] == peer["requests"] == n
    assert peer["transformers"][0]["num_blocks"] in (None, serve.PROFILES["quick"]["num_pages"])
    assert {r["num_pages"] for r in saved["pools"]} == set(serve.PROFILES["quick"]["pools"])
    assert set(saved["goals"]) >= {"paged_vs_max_len_throughput_2x", "overhead_5pct_at_batch_16"}
    assert all(isinstance(g["met"], bool) for g in saved["goals"].values())
    assert data["goals"] == saved["goals"]


def test_figures_draw_from_the_json(quick):
    _, saved = quick
    for fig in (viz.rate_figure(saved), viz.pool_figure(saved)):
        assert fig.axes and "Measured on CPU" in fig.texts[-1].get_text()
    print(serve.format_rate_table(saved["rates"][-1]["policies"]))


def test_only_paged_admission_keeps_the_watermark():
    from paged_ref.models import tiny_llama

    cfg = serve.PROFILES["quick"]
    model = tiny_llama()
    pages = {name: serve._engine(model, cfg, name).scheduler.watermark_pages for name in serve.POLICIES}
    assert pages["paged"] == pages["paged_eviction"] == int(cfg["watermark"] * cfg["num_pages"]) > 0
    assert pages["exact"] == pages["max_len"] == 0


def test_profile_writes_the_tables_and_each_gain(tmp_path):
    from paged_ref.lab.bench._serve_profile import GROUPS, VARIANTS

    data = serve.main(["--profile", "--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serve_profile_cpu_quick.json").read_text())
    assert saved["complete"] and saved["environment"]["torch"] and len(data["gains"]) == len(saved["gains"])
    for v in saved["variants"].values():
        for kind in ("decode", "mixed"):
            t = v["profile"][kind]
            assert t["steps"] == len(t["rows"]) >= 1 and set(t["groups"]) == {*GROUPS, "other"}
            assert sum(op["share"] for op in t["ops"]) == pytest.approx(1.0)
            assert sum(g["share"] for g in t["groups"].values()) == pytest.approx(1.0)
    for row in saved["linear_libraries"]["layer0"]:
        assert row["speedup_vs_f_linear"]["f_linear"] == 1.0 and set(row["ms"]) >= {"f_linear", "onednn_prepacked"}
    names = list(VARIANTS)
    assert [(g["before"], g["after"]) for g in saved["gains"]] == [*zip(names, names[1:]), (names[0], names[-1])]
    for g in saved["gains"]:  # every speed-up keeps every token and the schedule
        assert g["same_schedule"] and g["requests_with_identical_tokens"] == g["requests"]
    assert saved["generate_check"]["identical"] == saved["generate_check"]["requests"]
    fig = viz.profile_figure(saved)
    assert len(fig.axes) == 3 and "Measured on CPU" in fig.texts[-1].get_text()


def test_pool_figure_labels_stay_apart_and_count_pages():
    from paged_ref.lab.runmode import data_dir

    data = json.loads((data_dir() / "serve_cpu.json").read_text())
    fig = viz.pool_figure(data)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        assert not ax.yaxis.label.get_window_extent(renderer).overlaps(title)
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert ticks[0].startswith(f"{data['config']['num_pages']}\n") and "MiB" in ticks[0]


def test_page_timeline_ticks_whole_pages_and_names_few_requests():
    from paged_ref.lab.page_trace import PageTrace
    from paged_ref.serve import Engine

    engine = Engine(None, num_pages=16, page_size=4, max_batched_tokens=16)
    trace = PageTrace(engine)
    for n in (5, 9, 3):
        engine.add_request(list(range(n)), max_new_tokens=6)
    engine.run()
    fig = viz.page_timeline_figure(trace.history)
    ax = fig.axes[0]
    assert all(float(t).is_integer() for t in ax.get_yticks())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["R0", "R1", "R2"]
    assert "mod" not in fig.texts[-1].get_text()


def test_fast_is_only_for_the_vllm_comparison(tmp_path):
    with pytest.raises(SystemExit):
        serve.main(["--quick", "--fast", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def _check_threads_profile(saved, counts, rounds, steps=True):
    """What ``serve --profile --all-threads`` records: each thread count set and its every part measured (and,
    with ``steps``, each run's steps, the same at every count, binned by tokens)."""
    from paged_ref.lab.bench._serve_threads import PARTS, by_tokens

    assert saved["complete"] and saved["environment"]["cpu_model"] and saved["parallel_backend"]
    assert saved["thread_counts"] == counts and saved["rounds"] == rounds
    assert set(saved["summary"]) == set(saved["threads"]) == {str(t) for t in counts}
    for t in counts:
        d, s = saved["threads"][str(t)], saved["summary"][str(t)]
        assert d["torch_threads"] == t and d["same_tokens_as_first"] and len(d["tokens_per_s"]) == rounds
        assert s["read_gb_per_s"] > 0 and set(s["stream"]) == {"1", str(saved["config"]["max_num_seqs"])}
        for m, v in s["stream"].items():  # a share of the read taken in each round, the summary's their median
            per_round = [(x["rows"][m], x["read_gb_per_s"]) for x in d["stream"]]
            assert all(r["of_read"] == pytest.approx(r["gb_per_s"] / read) for r, read in per_round)
            median = statistics.median(r["of_read"] for r, _ in per_round)
            assert v["gb_per_s"] > 0 and v["of_read"] == pytest.approx(median)
        for kind in ("decode", "mixed"):
            k = s[kind]
            assert set(k["ms_per_step"]) == {*PARTS, "other ops", "python"} and k["weight_stream_gb_per_s"] > 0
            assert k["step_ms"] == pytest.approx(sum(k["ms_per_step"].values()), rel=0.05)
    assert saved["summary"]["1"]["speedup"] == 1.0
    if steps:
        runs = [r for t in counts for r in saved["threads"][str(t)]["steps"]]
        assert len(runs) == rounds * len(counts) and len({tuple(n for n, _ in r) for r in runs}) == 1
        for t in counts:
            d, bins = saved["threads"][str(t)], saved["summary"][str(t)]["steps_by_tokens"]
            assert list(bins) == list(by_tokens(runs[0])) and sum(b["steps"] for b in bins.values()) == len(runs[0])
            base = saved["threads"][str(counts[0])]["steps"]
            for label, b in bins.items():  # per round: the bin's share of the run, the base run's time over this one's
                shares = [by_tokens(r)[label] / sum(by_tokens(r).values()) for r in d["steps"]]
                ratios = [by_tokens(a)[label] / by_tokens(r)[label] for a, r in zip(base, d["steps"])]
                assert b["share"] == pytest.approx(statistics.median(shares))
                assert b["speedup"] == pytest.approx(statistics.median(ratios))
                assert t != counts[0] or b["speedup"] == 1


def test_profile_at_every_thread_count_records_each_count_and_the_bandwidths(tmp_path):
    import os

    from paged_ref.fast.prepack import vector_floats
    from paged_ref.lab.bench import _serve_threads

    serve.main(["--profile", "--all-threads", "--quick", "--out", str(tmp_path)])
    tile = "" if vector_floats() in (None, 16) else f"_{vector_floats() * 32}bit"  # the file names a 256-bit tile
    saved = json.loads((tmp_path / f"serve_profile_threads_cpu{tile}_quick.json").read_text())
    _check_threads_profile(saved, sorted({1, os.cpu_count()}), 2)
    assert saved["vector_floats"] == vector_floats() and set(saved["openmp_env"]) == set(_serve_threads.OPENMP_ENV)
    with pytest.raises(SystemExit):
        serve.main(["--all-threads", "--quick", "--out", str(tmp_path)])  # a profile's option


def test_the_weight_stream_takes_turns_with_the_plain_read(monkeypatch):
    """Each repeat times the read, then each row count's stream, so that both see the memory alike; the rates
    and shares are the bests' (times faked: read 2, 1 row 3, 2 rows 4 s in the first repeat, all halved next)."""
    import torch

    from paged_ref.fast.prepack import stream_layout
    from paged_ref.lab.bench import _serve_threads

    weights = [torch.randn(70, 5), torch.randn(3, 8)]  # [out, in] each
    flat = torch.cat([w.flatten() for w in weights])
    calls, fake = [], iter([2.0, 3.0, 4.0, 1.0, 1.5, 2.0])

    def timed(fn):
        calls.append("read" if fn == flat.sum else "stream")
        fn()
        return next(fake)

    monkeypatch.setattr(_serve_threads, "_timed", timed)
    out = _serve_threads.weight_stream(weights, [stream_layout(w) for w in weights], flat, (1, 2), repeats=2)
    assert calls == ["read", "stream", "stream"] * 2
    gb = flat.numel() * 4 / 1e9
    assert out["read_gb_per_s"] == pytest.approx(gb / 1.0)
    assert out["rows"]["1"] == pytest.approx({"ms": 1.5e3, "gb_per_s": gb / 1.5, "of_read": 1 / 1.5})
    assert out["rows"]["2"]["of_read"] == pytest.approx(0.5)


def test_the_committed_threads_profile_measured_one_thread_and_every_core_over_a_plain_read_past_the_cache():
    from paged_ref.lab.runmode import data_dir

    saved = json.loads((data_dir() / "serve_profile_threads_cpu.json").read_text())
    assert saved["mode"] == "cpu" and saved["model"]["name"] and len(saved["thread_counts"]) == 2
    _check_threads_profile(saved, [1, saved["cores"]], saved["rounds"], steps=False)  # recorded before its steps
    assert saved["weights_gb"] * 1e9 >= 4 * saved["last_level_cache_bytes"]  # the read comes from memory


def test_the_committed_256bit_threads_profile_ran_the_8_float_tile_and_kept_its_steps():
    from paged_ref.lab.runmode import data_dir

    saved = json.loads((data_dir() / "serve_profile_threads_cpu_256bit.json").read_text())
    assert saved["vector_floats"] == 8 and "avx512f" not in saved["environment"]["cpu_features"]
    assert saved["openmp_env"]["OMP_WAIT_POLICY"] is None  # OpenMP's default wait
    _check_threads_profile(saved, [1, saved["cores"]], saved["rounds"])
    assert saved["weights_gb"] * 1e9 >= 4 * saved["last_level_cache_bytes"]


def test_the_vllm_peer_takes_vllms_kv_cache_dtypes_only():
    """A job's ``kv_cache_dtype`` is one of vLLM's names ("auto" or an 8-bit one, as `quant.VLLM_FORMATS` maps
    them); another is refused before vLLM is imported."""
    from paged_ref import quant
    from paged_ref.lab.bench import _vllm_peer

    assert set(_vllm_peer.KV_CACHE_DTYPES) == set(quant.VLLM_FORMATS) >= {"fp8"}
    limits = dict(page_size=32, num_pages=4, max_num_seqs=2, max_batched_tokens=64, max_model_len=64)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8'.*got 'int8'"):
        _vllm_peer.make_llm("/nonexistent", kv_cache_dtype="int8", **limits)


def test_same_bytes_gives_the_8bit_pool_more_pages_of_the_same_bytes(tmp_path):
    """``bench serve --quick --kv-format fp8_e4m3 --same-bytes``: the float32 pool and the 8-bit pool that fits
    in its bytes (the cache's own page bytes) serve the same requests at each rate; the structure, not timings."""
    data = serve.main(["--quick", "--kv-format", "fp8_e4m3", "--same-bytes", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serve_cpu_kv8_quick.json").read_text())
    assert saved["goals"] == data["goals"] and "other jobs ran" in saved["timing_note"]
    p = saved["same_bytes"]["pools"]
    assert p["float_pages"] == serve.PROFILES["quick"]["num_pages"] and p["kv8_format"] == "float8_e4m3fn"
    assert p["float_page_bytes"] == 4 * p["kv8_page_bytes"]  # float32 against one byte a value
    assert p["kv8_pool_bytes"] <= p["pool_bytes"] < p["kv8_pool_bytes"] + p["kv8_page_bytes"]
    assert p["kv8_pages"] > 3.9 * p["float_pages"]
    n, tokens = saved["workload"]["requests"], sum(saved["workload"]["output_lens"])
    rows = saved["same_bytes"]["rates"]
    assert [r["rate"] for r in rows] == [*serve.PROFILES["quick"]["rates"], None]  # None: offline
    for row in rows:
        f, q = row["float32"], row["kv8"]
        assert f["tokens"] == q["tokens"] == tokens and f["requests"] == q["requests"] == n
        assert f["peak_pages"] <= p["float_pages"] and q["peak_pages"] <= p["kv8_pages"]
        assert 0 <= q["requests_with_paged_tokens"] <= n == f["requests_with_paged_tokens"]
    goals = list(saved["goals"].values())
    assert len(goals) == 2 and all(isinstance(g["met"], bool) for g in goals)
    assert goals[-1]["peak_running"] == [rows[-1]["float32"]["peak_running"], rows[-1]["kv8"]["peak_running"]]


def test_same_bytes_pages_count_the_scales_of_either_granularity():
    import torch

    from paged_ref import quant
    from paged_ref.lab.bench._serve_kv8 import same_bytes_pages
    from paged_ref.memory import KVGeometry

    g = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)  # 64 B a float32 token
    layer = same_bytes_pages(g, num_pages=2, page_size=2, fmt=quant.KVFormat(torch.int8))  # 256 B
    page = same_bytes_pages(g, num_pages=2, page_size=2, fmt=quant.KVFormat(torch.int8, scales="page"))
    assert layer["pool_bytes"] == page["pool_bytes"] == 256
    assert (layer["kv8_page_bytes"], layer["kv8_pool_scale_bytes"], layer["kv8_pages"]) == (32, 16, 7)
    assert (page["kv8_page_bytes"], page["kv8_pool_scale_bytes"], page["kv8_pages"]) == (48, 0, 5)


@pytest.mark.parametrize(
    "argv, needs",
    [
        (["--kv-format", "int8"], "--kv-format and --same-bytes go together"),
        (["--same-bytes"], "--kv-format and --same-bytes go together"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype is vLLM's"),
        (["--kv-format", "int8", "--same-bytes", "--peer", "vllm"], "leave out --gpu, --peer and --fast"),
        (["--rates"], "--rates needs at least one rate"),
        (["--max-num-seqs", "4"], "--max-num-seqs is a number >= 1 for --same-bytes"),
    ],
)
def test_8bit_options_name_what_they_need(tmp_path, capsys, argv, needs):
    with pytest.raises(SystemExit):
        serve.main(["--quick", *argv, "--out", str(tmp_path)])
    assert needs in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_same_bytes_offline_alone_with_more_sequences(tmp_path):
    """``--rates`` with none: only the offline row; ``--max-num-seqs`` lifts the cap (its own file)."""
    options = ["--kv-format", "int8", "--same-bytes", "--rates", "--max-num-seqs", "16"]
    serve.main(["--quick", *options, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serve_cpu_kv8_quick_int8_layer_16seqs.json").read_text())
    assert saved["config"]["max_num_seqs"] == 16 and [r["rate"] for r in saved["same_bytes"]["rates"]] == [None]
    (goal,) = saved["goals"].values()
    assert goal["target_peak_running"] <= 16 and saved["same_bytes"]["pools"]["kv8_format"] == "int8"


@pytest.mark.parametrize("name", ["serve_cpu_peer_vllm_fp8.json", "serve_cpu_short_peer_vllm_fp8.json"])
def test_fp8_finding_says_what_was_measured(name):
    """The committed finding is `finding`'s on the committed numbers; vLLM's own bytes are said to differ from its
    float32 run's, truncated, only where some do (no cause is given: none is measured), and the one-code
    differences between the engines name the float32 differences they stand on."""
    from pathlib import Path

    from paged_ref.lab.bench._vllm_fp8 import finding

    data = json.loads((Path(__file__).parents[1] / "figures" / "data" / name).read_text())
    why = data["fp8_why"]
    text = finding(why, data["peer_vllm"])
    assert why["finding"] == text
    r0 = why["vllm_float32_requantized_vs_vllm_fp8_layer0"]
    own = r0["k_differ"] + r0["v_differ"]
    assert ("but for" in text["format_rounding_scale"]) == (own > 0)
    assert "two runs" not in text["format_rounding_scale"] and "kernels" not in text["bytes"]
    assert f"differ in {why['float32_per_layer'][0]['differ']} of" in text["bytes"]


def test_the_peer_comparison_counts_a_request_identical_only_if_it_is_in_every_repeat(monkeypatch):
    """Tokens are compared in every repeat, not only the last: a request that differs once counts as differing."""
    from paged_ref.lab.bench import serve

    theirs = iter([[[1, 2], [3, 9]], [[1, 2], [3, 4]]])  # the first repeat differs in request 1
    monkeypatch.setattr(serve, "_engine", lambda *a, **k: None)
    monkeypatch.setattr(serve, "_offline_run", lambda e, r: ([[1, 2], [3, 4]], {"wall_tokens_per_s": 2.0}))
    monkeypatch.setattr(serve, "run_peer", lambda *a, **k: (next(theirs), {"wall_tokens_per_s": 1.0}))
    cfg = dict(peer_repeats=2, page_size=16, num_pages=8, max_batched_tokens=64, max_num_seqs=4)
    out = serve.run_peer_comparison(None, cfg, [([0], 2), ([0], 2)])
    assert (out["requests_with_identical_tokens"], out["requests"]) == (1, 2)
    assert out["identical_per_repeat"] == [1, 2] and out["first_differing_requests"] == [1]


def test_few_rows_profile_writes_the_kernel_table_named_by_its_vector_width(tmp_path):
    """``--profile --few-rows``: the kernel against oneDNN by rows, in the file of this build's tile, with the
    CPU's vector extensions and the rows it is ahead to."""
    from paged_ref.fast.prepack import vector_floats
    from paged_ref.lab.bench._serve_profile import rows_ahead

    data = serve.main(["--profile", "--few-rows", "--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / f"few_rows_{vector_floats() * 32}bit_quick.json").read_text())
    assert saved["complete"] and saved["vector_floats"] == data["vector_floats"] == vector_floats()
    assert saved["torch_threads"] == 1 and isinstance(saved["environment"]["cpu_features"], list)
    assert [r["rows"] for r in saved["few_rows"]["rows"]] == [1, 4]
    assert saved["rows_ahead"] == rows_ahead(saved["few_rows"])


@pytest.mark.parametrize("argv", [["--few-rows"], ["--profile", "--all-threads", "--few-rows"]])
def test_few_rows_goes_with_profile_alone(argv, capsys):
    with pytest.raises(SystemExit):
        serve.main([*argv, "--quick"])
    expected = "--few-rows profiles the kernel alone: give it with --profile, without --all-threads"
    assert expected in capsys.readouterr().err


def test_rows_ahead_stops_at_the_first_row_count_behind():
    from paged_ref.lab.bench._serve_profile import rows_ahead

    table = {"rows": [{"rows": 8, "speedup": 1.1}, {"rows": 1, "speedup": 1.3}, {"rows": 4, "speedup": 1.0}]}
    assert rows_ahead(table) == 8
    table["rows"].insert(0, {"rows": 6, "speedup": 0.99})  # behind at 6: 8 is not "every count up to"
    assert rows_ahead(table) == 4
    assert rows_ahead({"rows": [{"rows": 1, "speedup": 0.5}]}) == 0
