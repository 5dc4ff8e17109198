"""Tests of `python -m paged_ref.lab.bench scaling` and its parts (CPU, tiny model; no timed assertions)."""

from __future__ import annotations

import json

import pytest
import torch

from paged_ref.allocator import PageAllocator
from paged_ref.lab.bench import scaling
from paged_ref.lab.bench._scaling_batch import batch_throughput
from paged_ref.lab.bench._scaling_chat import run_chat
from paged_ref.lab.bench._scaling_latency import (
    AllocationTimer,
    ContiguousDecoder,
    LadderConfig,
    NoCacheDecoder,
    PagedDecoder,
    make_decoder,
    run_ladder,
)
from paged_ref.lab.bench.scaling_report import alloc_summary, fit_counts, mixed_lengths, paged_overhead, ratios_to
from paged_ref.lab.fragmentation import requests_that_fit
from paged_ref.models import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    data = scaling.main(["--cpu", "--quick", "--model", "tiny", "--out", str(out)])
    return data, out


def _random_ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed))


# --- the whole benchmark, quick, on the tiny model ----------------------------------------------
def test_main_writes_json_with_environment(run):
    data, out = run
    on_disk = json.loads((out / "scaling_cpu.json").read_text())
    assert on_disk["models"].keys() == {"tiny"}
    env = on_disk["environment"]
    for key in ("date_utc", "torch", "transformers", "cpu"):
        assert env[key], key
    assert on_disk["device"] == "cpu" and on_disk["quick"] is True
    assert on_disk["models"]["tiny"]["errors"] == [] and on_disk["models"]["tiny"]["skipped"] == []


def test_a_run_at_a_chosen_thread_count_is_written_apart_and_records_it(tmp_path):
    data = scaling.main(["--cpu", "--quick", "--model", "tiny", "--threads", "1", "--out", str(tmp_path)])
    assert [p.name for p in tmp_path.iterdir()] == ["scaling_cpu_threads1.json"]
    assert data["torch_threads"] == 1 and data["command"].endswith("--threads 1")


def test_a_decoder_failing_in_the_ladder_is_reported_and_the_others_are_kept(tmp_path, monkeypatch, capsys):
    from paged_ref.lab.bench import _scaling_latency

    make = _scaling_latency.make_decoder

    def failing(model, name, **kwargs):
        dec = make(model, name, **kwargs)
        if name == "flex":
            dec.feed = lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("flex broke"))
        return dec

    monkeypatch.setattr(_scaling_latency, "make_decoder", failing)
    data = scaling.main(["--cpu", "--quick", "--model", "tiny", "--out", str(tmp_path)])
    res = data["models"]["tiny"]
    assert res["errors"] == ["ladder flex: RuntimeError: flex broke"]
    ladder = {r["backend"]: r for r in res["ladder"]}
    assert ladder["flex"]["points"] == [] and ladder["flex"]["error"] == "RuntimeError: flex broke"
    assert all(len(ladder[n]["points"]) == 2 for n in ("dynamic", "sdpa", "reference", "none"))
    assert "paged (flex)" not in res["ratios"] or res["ratios"]["paged (flex)"] == {}
    assert "per-token decode latency" in capsys.readouterr().out


def test_main_every_decoder_predicts_the_same_tokens(run):
    res = run[0]["models"]["tiny"]
    labels = {r["label"] for r in res["ladder"]}
    assert {"no cache (recompute)", "contiguous (DynamicCache)", "paged (flex)", "paged (triton)"} <= labels
    assert len(res["agreement"]) == len(res["ladder"]) - 1
    for label, a in res["agreement"].items():
        assert a["compared"] >= 1 and a["equal"] == a["compared"], (label, a)


def test_main_triton_interpreter_is_checked_not_timed(run):
    triton = next(r for r in run[0]["models"]["tiny"]["ladder"] if r["backend"] == "triton")
    assert triton["timed"] is False
    assert all(p["median_s"] is None for p in triton["points"])


def test_main_memory_counts(run):
    res = run[0]["models"]["tiny"]
    per_token = res["kv_bytes_per_token"]  # 2 layers x 2 KV heads x 32 dims x K,V x 4 bytes
    assert per_token == 2 * 2 * 2 * 32 * 4
    for r in res["ladder"]:
        for p in r["points"]:
            if r["backend"] == "none":
                assert p["kv_bytes"] == 0
            elif r["backend"] == "dynamic":
                assert p["kv_bytes"] == p["tokens_held"] * per_token
            elif r["backend"] in ("flex", "reference", "triton"):
                pages = -(-p["tokens_held"] // scaling.PAGE_SIZE)
                assert p["kv_bytes"] == pages * scaling.PAGE_SIZE * per_token
    b = res["batch"]
    o = b["overhead_ps16"]
    assert o["overhead"] == pytest.approx(o["slots"] / o["tokens"] - 1)
    assert b["fit"]["paged_allocator"] == b["fit"]["paged"] > b["fit"]["max_len"]
    assert b["paged"]["reference"]["pages_after_prefill"] * scaling.PAGE_SIZE == o["slots"]


def test_main_chat_and_allocations(run):
    res = run[0]["models"]["tiny"]
    chat = res["chat"]
    assert chat["replies_identical"]
    off, on = chat["runs"]
    assert not off["prefix_caching"] and on["prefix_caching"]
    assert sum(t["pages_allocated"] for t in on["turns"]) < sum(t["pages_allocated"] for t in off["turns"])
    assert {"allocate", "free"} <= set(res["alloc"])
    assert res["alloc"]["allocate"]["p99_ns"] >= res["alloc"]["allocate"]["median_ns"] > 0


def test_figures_state_provenance(run):
    import matplotlib

    matplotlib.use("Agg")
    from paged_ref.lab.viz import scaling as vs

    data = run[0]
    date = data["environment"]["date_utc"][:10]
    for fn in (
        vs.latency_figure,
        vs.memory_figure,
        vs.batch_figure,
        vs.chat_figure,
        vs.page_size_figure,
        vs.alloc_figure,
    ):
        fig = fn(data, "tiny")
        texts = [t.get_text() for t in fig.texts]
        assert any(date in t and "torch" in t for t in texts), fn.__name__
    with pytest.raises(ValueError, match="model must be one of"):
        vs.latency_figure(data, "llama1b")


# --- decoders -----------------------------------------------------------------------------------
def test_decoders_agree_on_a_ragged_batch(model):
    """Left padding (contiguous) and per-sequence lengths (paged) give the same predictions."""
    lengths = [9, 23, 16]
    prompt = _random_ids(40, seed=1)
    results = []
    for make in (
        lambda: ContiguousDecoder(model, "dynamic"),
        lambda: ContiguousDecoder(model, "static", max_len=32),
        lambda: PagedDecoder(model, backend="reference", num_pages=16, page_size=4),
    ):
        dec = make()
        preds = [dec.feed([prompt[:n] for n in lengths]).tolist()]
        for i in range(3):
            preds.append(dec.feed([prompt[n + i : n + i + 1] for n in lengths]).tolist())
        dec.close()
        results.append(preds)
    assert results[0] == results[1] == results[2]


def test_no_cache_decoder_matches_cache_and_holds_nothing(model):
    prompt = _random_ids(30, seed=2)
    a, b = NoCacheDecoder(model), ContiguousDecoder(model)
    a.feed([prompt[:20]], predict=False)
    b.feed([prompt[:20]], predict=False)
    assert a.feed([prompt[20:21]]).tolist() == b.feed([prompt[20:21]]).tolist()
    assert a.kv_bytes() == 0 and b.kv_bytes() > 0


def test_decoder_input_errors(model):
    with pytest.raises(ValueError, match="kind must be"):
        ContiguousDecoder(model, "paged")
    with pytest.raises(ValueError, match="max_len must be"):
        ContiguousDecoder(model, "static")
    with pytest.raises(ValueError, match="decoder name must be none, dynamic, static"):
        make_decoder(model, "vllm", max_len=8)
    with pytest.raises(ValueError, match="num_pages must be"):
        PagedDecoder(model, backend="reference")
    dec = ContiguousDecoder(model)
    with pytest.raises(ValueError, match=r"chunks\[0\] must be a non-empty 1-D LongTensor"):
        dec.feed([torch.tensor([1.0, 2.0])])
    with pytest.raises(TypeError, match="chunks must be a non-empty list"):
        dec.feed(torch.tensor([1, 2]))
    assert dec.cache is None  # failed calls changed nothing


def test_allocation_timer_records_and_preserves_behaviour():
    alloc = PageAllocator(6)
    timer = AllocationTimer(alloc)
    pages = alloc.allocate(4)
    alloc.share(p for p in pages[:2])  # a generator is counted without being used up
    alloc.free(iter(pages))
    assert alloc.num_free == 4 and alloc.refcount(pages[0]) == 1
    assert [(op, n) for op, _, n in timer.calls] == [("allocate", 4), ("share", 2), ("free", 4)]
    summary = alloc_summary(timer.calls)
    assert summary["allocate"]["pages"] == 4 and summary["free"]["calls"] == 1


# --- ladder, batch, chat --------------------------------------------------------------------------
def test_ladder_config_and_prompt_errors(model):
    with pytest.raises(ValueError, match="gaps > warmup"):
        LadderConfig(contexts=[16, 20], warmup=2, steps=3)
    with pytest.raises(ValueError, match="contexts must be positive"):
        LadderConfig(contexts=[])
    cfg = LadderConfig(contexts=[16, 32], warmup=1, steps=2)
    with pytest.raises(ValueError, match="prompt must hold at least"):
        run_ladder(model, "dynamic", _random_ids(20, 0), cfg)
    with pytest.raises(TypeError, match="prompt must be a 1-D LongTensor"):
        run_ladder(model, "dynamic", _random_ids(60, 0).float(), cfg)


def test_ladder_skips_contexts_past_the_deadline(model):
    cfg = LadderConfig(contexts=[16, 32], warmup=1, steps=2)
    r = run_ladder(model, "dynamic", _random_ids(60, 0), cfg, deadline=0.0)
    assert r["points"] == [] and r["skipped"] == [16, 32]


def test_ratios_to_base():
    ladder = [
        {"label": "a", "timed": True, "points": [{"context": 8, "median_s": 2.0}]},
        {"label": "b", "timed": True, "points": [{"context": 8, "median_s": 3.0}]},
        {"label": "c", "timed": False, "points": [{"context": 8, "median_s": None}]},
    ]
    assert ratios_to(ladder, "a") == {"b": {8: 1.5}}


def test_overhead_and_fit_counts_on_the_seed_example():
    # 19, 45, 70 tokens in 16-token pages: 2 + 3 + 5 pages = 160 slots for 134 tokens
    o = paged_overhead([19, 45, 70], page_size=16)
    assert (o["pages"], o["slots"], o["tokens"]) == (10, 160, 134)
    assert o["overhead"] == pytest.approx(26 / 134)
    lengths = mixed_lengths(60, max_len=512, mean_len=128, seed=3)
    fit = fit_counts(lengths, budget_tokens=2048, max_len=512, page_size=16)
    assert fit["max_len"] == 4
    assert (
        fit["paged_allocator"]
        == requests_that_fit(lengths, budget_slots=2048, page_size=16, reserved_per_request=512)["paged"]
    )


def test_chat_reuses_the_previous_turns_full_pages(model):
    users = [_random_ids(n, seed) for n, seed in ((21, 4), (13, 5), (30, 6))]
    off = run_chat(model, users, reply_tokens=3, page_size=4, prefix_caching=False, backend="reference")
    on = run_chat(model, users, reply_tokens=3, page_size=4, prefix_caching=True, backend="reference")
    assert off["replies"] == on["replies"]
    held = [21 + 3, 21 + 3 + 13 + 3]  # tokens the previous request held (prompt + reply fed back)
    assert [t["prefix_pages_reused"] for t in on["turns"]] == [0] + [n // 4 for n in held]
    requests = [21, 21 + 3 + 13, 21 + 3 + 13 + 3 + 30]  # history + the new user message
    assert [t["prefilled"] for t in off["turns"]] == requests
    assert [t["prefilled"] for t in on["turns"]] == [21, requests[1] - 24, requests[2] - 40]
    assert all(t["prefix_pages_reused"] == 0 for t in off["turns"])


def test_gpu_profile_code_paths_on_cpu(model):
    """The GPU profile's extra paths (a long sequence for the paged backends, the static cache in
    the ladder, the time budget) run on CPU with the tiny model."""
    profile = dict(scaling.PROFILES[("gpu", "quick")], **scaling.TINY)
    profile.update(
        models=["tiny"],
        ladder=["dynamic", "static", "reference"],
        long=300,
        batch=dict(scaling.TINY["batch"], backends=["reference"]),
    )
    res = scaling.run_model("tiny", profile, device="cpu", clock=scaling._Clock(None))
    assert res["errors"] == []
    assert [r["backend"] for r in res["long"]] == ["reference"]
    assert res["long"][0]["points"][0]["context"] == 300
    static = next(r for r in res["ladder"] if r["backend"] == "static")
    # the static cache reserves the ladder's longest context from the first token on
    assert len({p["kv_bytes"] for p in static["points"]}) == 1
    out_of_time = scaling.run_model("tiny", profile, device="cpu", clock=scaling._Clock(0))
    assert out_of_time["ladder"] == [] and "ladder dynamic" in out_of_time["skipped"]


def test_noise_summary_from_the_ladder():
    from paged_ref.lab.bench.scaling_report import noise_summary

    def decoder(backend, label, pts):
        return {
            "backend": backend,
            "label": label,
            "timed": True,
            "points": [{"context": c, "median_s": sorted(t)[len(t) // 2], "times_s": t} for c, t in pts],
        }

    ladder = [
        decoder("dynamic", "dyn", [(128, [0.010, 0.011, 0.012]), (512, [0.020, 0.022, 0.024])]),
        decoder("static", "sta", [(128, [0.012] * 3), (512, [0.011] * 3)]),
        decoder("none", "none", [(128, [0.1]), (512, [1.6])]),
    ]
    n = noise_summary(ladder)
    assert n["steps"] == {"dyn": [3], "sta": [3], "none": [1]}
    assert n["spread"]["dyn"][512] == pytest.approx([20.0, 21.0, 22.0, 23.0, 24.0])
    assert n["peer_over_base"] == pytest.approx([0.5, 12 / 11])
    g = n["no_cache_growth"]
    assert g["first"] == (128, pytest.approx(100.0)) and g["doublings"] == 2
    assert g["factor"] == pytest.approx(16.0) and g["per_doubling"] == pytest.approx(4.0)


def test_batch_decodes_only_requests_whose_grown_pages_fit(model):
    # four 16-token prompts fill a 64-token pool exactly: a decode step would need a fifth page,
    # so the paged batch decodes the requests that still fit after their timed steps
    prompt = torch.arange(1, 65)
    out = batch_throughput(
        model,
        prompt,
        [16, 16, 16, 16],
        budget_tokens=64,
        max_len=32,
        page_size=16,
        paged_backends=["reference"],
        steps=2,
        warmup=1,
    )
    assert out["fit"]["paged_allocator"] == 4
    assert out["decoded"] == 2  # 16 + 3 tokens take two pages each
    assert out["paged"]["reference"]["batch"] == 2


def test_page_size_sweep_times_flex_alone_and_with_its_mask_reused():
    """The sweep times flex twice per page size: building its BlockMask per call, and as a model
    calls it, the mask built once (its build time recorded apart); a missed deadline records None."""
    from paged_ref.attention.flex import flex_paged_decode
    from paged_ref.lab.bench._scaling_batch import page_size_sweep
    from paged_ref.memory import KVGeometry

    geometry = KVGeometry(
        num_layers=1, num_kv_heads=2, head_dim=16, num_q_heads=4, dtype=torch.float32, device=torch.device("cpu")
    )
    rows = page_size_sweep([5, 20], [8], geometry=geometry, backends={"flex": flex_paged_decode}, repeats=1)
    assert set(rows[0]["attention_s"]) == {"flex", "flex (mask reused)"}
    assert rows[0]["attention_s"]["flex (mask reused)"] > 0 and rows[0]["block_mask_s"] > 0
    late = page_size_sweep([5], [8], geometry=geometry, backends={"flex": flex_paged_decode}, deadline=0.0)
    assert late[0]["attention_s"] == {"flex": None, "flex (mask reused)": None} and late[0]["block_mask_s"] is None
