"""The benchmark harness of the decode kernel: the dispatcher, the CPU run, the GPU path's logic."""

import json

import pytest
import torch


def test_bench_dispatcher_lists_and_rejects(capsys):
    from paged_ref.lab.bench import __main__ as dispatcher

    assert dispatcher.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert "decode" in listed and "common" not in listed
    assert dispatcher.main(["no_such_bench"]) == 2
    assert "unknown benchmark 'no_such_bench'" in capsys.readouterr().err


def test_bench_decode_cpu_quick(tmp_path):
    from paged_ref.lab.bench import decode

    decode.main(["--cpu", "--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "decode_cpu.json").read_text())
    assert data["environment"]["torch"] == torch.__version__
    assert data["results"], "no measurement recorded"
    for row in data["results"]:
        assert row["median_s"] > 0 and row["rel_err"] < 1e-4


def test_bench_decode_gpu_path_smoke(monkeypatch):
    """The GPU harness's own logic (layouts, records, ratios, goals) on tiny float32 CPU sizes,
    with CPU timers standing in for CUDA events."""
    from paged_ref.lab.bench import common, decode

    monkeypatch.setattr(decode, "gpu_median", lambda fn, **kw: common.cpu_median(fn, warmup=0, repeats=1)["median_s"])
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: dict(bytes=1, median_s=1.0, bandwidth_GBps=1.0))
    monkeypatch.setattr(decode, "graph_median", lambda fn, **kw: (decode.gpu_median(fn), fn()))  # no graphs on CPU
    monkeypatch.setattr(decode, "host_median", lambda fn, **kw: decode.gpu_median(fn))
    heads = dict(num_q_heads=4, num_kv_heads=2, head_dim=32)
    data = decode.run_gpu(
        [(2, 64)], [16, 32], budget_s=60, rep_ms=1, eight_bit=True, heads=heads, dtype=torch.float32, device="cpu"
    )
    impls = {r["impl"] for r in data["results"]}
    assert {"paged_decode", "paged_decode contiguous", "paged_decode (again)", "sdpa contiguous"} <= impls
    assert {"paged_decode (CUDA graph)", "flex_paged_decode (mask reused)", "flex_paged_decode"} <= impls
    assert all(r["rel_err"] < 1e-4 for r in data["results"]), data["results"]
    assert all(r["block_mask_s"] > 0 for r in data["results"] if r["impl"] == "flex_paged_decode (mask reused)")
    data["config"] = dict(layers=4)
    ratios, goals = decode.summarize_gpu(data)
    assert [(r["batch"], r["seq_len"], r["page_size"]) for r in ratios] == [(2, 64, 16), (2, 64, 32)]
    assert all(r["paged_over_contiguous"] > 0 and r["sdpa_over_paged"] > 0 for r in ratios)
    assert all(r["graph_frac_of_copy"] > 0 and r["host_us"] > 0 for r in ratios)
    # float8_e4m3fn pages at page size 16 only: a byte a value and the float32 scales
    (fp8,) = [r for r in data["results"] if r["impl"] == "paged_decode fp8"]
    assert fp8["page_size"] == decode.EIGHT_BIT_PAGE_SIZE == 16
    assert fp8["kv_bytes"] == 2 * (2 * 64 * 2 * 32 + 4 * (2 * 64 // 16) * 2)
    assert [r["fp8_over_paged"] is not None for r in ratios] == [True, False]
    # per step: the reused call plus a quarter of the mask's build (4 layers share it)
    rows = {(r["page_size"], r["impl"]): r for r in data["results"]}
    for r in ratios:
        reused = rows[(r["page_size"], "flex_paged_decode (mask reused)")]
        paged = rows[(r["page_size"], "paged_decode")]
        step = reused["median_s"] + reused["block_mask_s"] / 4
        assert r["flex_step_over_paged"] == pytest.approx(step / paged["median_s"])
    assert any("page sizes" in g["goal"] for g in goals)
    assert not any("batch >= 8" in g["goal"] for g in goals)  # no batch of 8 measured: no such goal claimed


def test_bench_decode_leaves_flex_out_below_its_minimum_batch(monkeypatch):
    from paged_ref.lab.bench import common, decode

    monkeypatch.setattr(decode, "gpu_median", lambda fn, **kw: common.cpu_median(fn, warmup=0, repeats=1)["median_s"])
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: dict(bytes=1, median_s=1.0, bandwidth_GBps=1.0))
    monkeypatch.setattr(decode, "graph_median", lambda fn, **kw: (decode.gpu_median(fn), fn()))
    monkeypatch.setattr(decode, "host_median", lambda fn, **kw: decode.gpu_median(fn))
    heads = dict(num_q_heads=2, num_kv_heads=1, head_dim=16)
    data = decode.run_gpu(
        [(1, 32)], [16], budget_s=60, rep_ms=1, flex_min_batch=2, heads=heads, dtype=torch.float32, device="cpu"
    )
    assert not any(r["impl"].startswith("flex") for r in data["results"])
    assert data["notes"] == ["flex left out at (1, 32, page 16): batch below --flex-min-batch 2"]
