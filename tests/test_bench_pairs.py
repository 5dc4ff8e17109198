"""Ratios of two methods measured in turns: `paired_ratio` (the median of the pairs' ratios) and the
benchmarks that take turns, on synthetic timings (a fake clock and a load that drifts during the run:
a ratio of two medians taken one method after the other reads the drift, a paired ratio does not)."""

from __future__ import annotations

import pytest
import torch

from paged_ref.lab.bench import _model_bench, _scaling_latency
from paged_ref.lab.bench._scaling_latency import LadderConfig, run_ladder, run_ladders
from paged_ref.lab.bench.common import paired_ratio
from paged_ref.lab.bench.scaling_report import noise_summary, pair_quartiles, ratio_kind, ratio_pairs, ratios_to


# --- paired_ratio ---------------------------------------------------------------------------------
def test_paired_ratio_is_the_true_median_for_an_even_count():
    # ratios 1, 2, 3, 4: the median is 2.5 (the upper middle would be 3)
    assert paired_ratio([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]) == 2.5
    assert paired_ratio([2.0, 9.0, 4.0], [1.0, 3.0, 1.0]) == 3.0
    assert _model_bench.paired_ratio is paired_ratio  # the model benchmarks use the same one


@pytest.mark.parametrize("num, den", [([1.0, 2.0], [1.0]), ([], [])])
def test_paired_ratio_refuses_values_that_do_not_pair_up(num, den):
    with pytest.raises(ValueError, match="numerators and denominators must pair up"):
        paired_ratio(num, den)


def test_speed_vs_full_and_alloc_take_paired_ratio(monkeypatch):
    from paged_ref.lab.bench import alloc
    from paged_ref.lab.bench.eviction import speed_vs_full

    assert speed_vs_full([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0])["time_per_token_vs_full_paired"] == 2.5
    data = alloc.measure(num_seqs=4, max_len=64, repeats=4)
    peer = data["results"][alloc.PEER]["ns_per_page_op_repeats"]
    for r in data["results"].values():
        assert r["torch_over_this"] == paired_ratio(peer, r["ns_per_page_op_repeats"])
    z = alloc.zeroing_cost(num_layers=2, pages=4, repeats=4)
    assert z["zero_over_write"] == paired_ratio(z["zero_page_ns_repeats"], z["write_page_ns_repeats"])


# --- the scaling ladder in turns, on fake decoders and a fake clock -------------------------------
class _Clock:
    """A clock each decoder step advances by its cost times a load that grows with every step taken."""

    def __init__(self, drift=0.05):
        self.now, self.steps, self.drift = 0.0, 0, drift

    def __call__(self):
        return self.now

    def spend(self, cost):
        self.steps += 1
        self.now += cost * (1.0 + self.drift * self.steps)


class _FakeDecoder:
    def __init__(self, clock, cost, order, name):
        self.clock, self.cost, self.order, self.name = clock, cost, order, name

    def feed(self, chunks, predict=True):
        if predict:
            self.clock.spend(self.cost)
            self.order.append(self.name)
            return torch.tensor([int(chunks[0][-1])])
        return None

    def kv_bytes(self):
        return 0

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    clock, order = _Clock(), []
    costs = {"dynamic": 1.0, "sdpa": 2.0, "none": 8.0}
    monkeypatch.setattr(
        _scaling_latency,
        "make_decoder",
        lambda model, name, max_len, page_size: _FakeDecoder(clock, costs[name], order, name),
    )
    model = torch.nn.Linear(1, 1)
    prompt = torch.arange(3, 200)
    return clock, order, model, prompt


def test_ladder_decoders_take_turns_and_their_ratio_is_the_median_of_the_pairs(fake):
    clock, order, model, prompt = fake
    cfg = LadderConfig(contexts=[16, 64], warmup=1, steps=7, nocache_steps=3)
    ladder = run_ladders(model, {"dynamic": cfg, "sdpa": cfg, "none": cfg}, prompt, clock=clock)
    assert order[:3] == ["dynamic", "sdpa", "none"]  # context 16: one warm-up round (no cache's only one)
    # then each round has one step of each decoder still running, the first decoder rotating
    rounds = [order[3 + 3 * r : 6 + 3 * r] for r in range(3)]
    assert [sorted(r) for r in rounds] == [["dynamic", "none", "sdpa"]] * 3
    assert [r[0] for r in rounds] == ["dynamic", "sdpa", "none"]
    dyn, sdpa, none = ladder
    assert [len(p["times_s"]) for p in none["points"]] == [3, 3]
    assert sdpa["in_turns_with"] == ["contiguous (DynamicCache)", "no cache (recompute)"]
    ratios = ratios_to(ladder, dyn["label"])
    for r in (sdpa, none):
        for p, b in zip(r["points"], dyn["points"]):
            n = len(p["times_s"])
            assert ratios[r["label"]][p["context"]] == paired_ratio(p["times_s"], b["times_s"][:n])
    # the load grew by 5% a step: the pairs still read sdpa's cost as 2x of dynamic's within 10%,
    # where the ratio of medians of the same steps reads the drift
    assert all(abs(x / 2.0 - 1) < 0.1 for x in ratios[sdpa["label"]].values())
    assert ratio_kind(ladder, dyn["label"]) == "median of paired steps"
    assert ratio_pairs(ladder, dyn["label"]) == {sdpa["label"]: {16: 7, 64: 7}, none["label"]: {16: 3, 64: 3}}
    assert noise_summary(ladder, "dynamic", "sdpa")["peer_over_base"] == [
        min(ratios[sdpa["label"]].values()),
        max(ratios[sdpa["label"]].values()),
    ]


def test_pair_quartiles_bracket_the_paired_ratio_and_skip_decoders_that_ran_alone(fake):
    clock, order, model, prompt = fake
    cfg = LadderConfig(contexts=[16, 64], warmup=1, steps=7, nocache_steps=3)
    ladder = run_ladders(model, {"dynamic": cfg, "sdpa": cfg}, prompt, clock=clock)
    base = ladder[0]["label"]
    quartiles, ratios = pair_quartiles(ladder, base), ratios_to(ladder, base)
    for context, (p25, median, p75) in quartiles["paged (sdpa)"].items():
        assert median == pytest.approx(ratios["paged (sdpa)"][context]) and p25 < median < p75
    alone = [ladder[0], run_ladder(model, "sdpa", prompt, cfg, clock=clock)]
    assert pair_quartiles(alone, base) == {} and pair_quartiles(ladder, "no such decoder") == {}


def test_a_decoder_that_fails_leaves_the_others_ladder_whole(fake, monkeypatch):
    clock, order, model, prompt = fake
    make = _scaling_latency.make_decoder

    def failing(model, name, max_len, page_size):
        dec = make(model, name, max_len=max_len, page_size=page_size)
        if name == "sdpa":  # its first 4 steps (context 16: 1 warm-up, 3 timed) run, the next raises
            feed, steps = dec.feed, []

            def fed(chunks, predict=True):
                steps.append(predict)
                return feed(chunks, predict) if steps.count(True) <= 4 else 1 / 0

            dec.feed = fed
        return dec

    monkeypatch.setattr(_scaling_latency, "make_decoder", failing)
    cfg = LadderConfig(contexts=[16, 64], warmup=1, steps=3)
    dyn, sdpa, none = run_ladders(model, {"dynamic": cfg, "sdpa": cfg, "none": cfg}, prompt, clock=clock)
    assert sdpa["error"] == "ZeroDivisionError: division by zero"
    assert [p["context"] for p in sdpa["points"]] == [16]  # none from the context it failed at
    assert [p["context"] for p in dyn["points"]] == [p["context"] for p in none["points"]] == [16, 64]
    assert "error" not in dyn and "error" not in none
    assert list(ratios_to([dyn, sdpa, none], dyn["label"])[sdpa["label"]]) == [16]


def test_decoders_run_one_after_another_give_ratios_of_medians(fake):
    clock, order, model, prompt = fake
    cfg = LadderConfig(contexts=[16, 64], warmup=1, steps=5)
    ladder = [run_ladder(model, name, prompt, cfg, clock=clock) for name in ("dynamic", "sdpa")]
    assert order == ["dynamic"] * 12 + ["sdpa"] * 12
    ratios = ratios_to(ladder, ladder[0]["label"])[ladder[1]["label"]]
    for p, b in zip(ladder[1]["points"], ladder[0]["points"]):
        assert ratios[p["context"]] == p["median_s"] / b["median_s"]
    assert ratio_kind(ladder, ladder[0]["label"]) == "ratio of medians" and ratio_pairs(ladder, "x") == {}
    # one after the other, the drift is in the ratio: sdpa's steps all ran under a higher load
    assert all(x > 2.2 for x in ratios.values())


def test_ladders_refuse_decoders_on_different_contexts(fake):
    _, _, model, prompt = fake
    a, b = LadderConfig(contexts=[16, 64]), LadderConfig(contexts=[16, 128])
    with pytest.raises(ValueError, match="the same contexts"):
        run_ladders(model, {"dynamic": a, "sdpa": b}, prompt)


# --- bench pages: SmolLM2 sampling with sdpa and cascade, runs in turns ----------------------------
def test_pages_sampling_runs_take_turns_and_the_speedup_is_the_median_of_the_pairs(monkeypatch):
    from paged_ref import hf
    from paged_ref.lab.bench import _pages_cascade
    from paged_ref.lab.bench import eviction as ev

    clock, order = _Clock(drift=0.01), []
    costs = {"sdpa": 6.0, "cascade": 1.0}

    def fake_generate(model, ids, *, max_new_tokens, num_return_sequences, backend, callback, **kwargs):
        order.append(backend)
        for step in range(max_new_tokens):
            clock.spend(costs[backend])
            callback(step, None)
        return torch.zeros(num_return_sequences, ids.shape[1] + max_new_tokens, dtype=torch.long)

    monkeypatch.setattr(hf, "generate", fake_generate)
    monkeypatch.setattr(ev, "lm_text_ids", lambda tok, i, n: torch.arange(n))
    cfg = dict(samples=2, prompt=8, generate_steps=5, generate_pairs=3)
    g = _pages_cascade.generate_speed(None, None, cfg, lambda msg: None, clock=clock)
    assert order == ["sdpa", "cascade", "cascade", "sdpa", "sdpa", "cascade"]  # the order reversed every other pair
    runs = {b: g[b]["runs_ms_per_step"] for b in costs}
    assert len(runs["sdpa"]) == len(runs["cascade"]) == g["pairs"] == 3
    assert g["speedup"] == paired_ratio(runs["sdpa"], runs["cascade"])
    assert abs(g["speedup"] / 6.0 - 1) < 0.1  # the load grew 1% a step: the pairs still read 6x
    assert g["same_tokens"] and len(g["sdpa"]["steps_ms"]) == 3 * 4
    assert len(g["load_before"]) == len(g["load_after"]) == 3


# --- bench pages: one layer's paths, in turn every round -------------------------------------------
def test_pages_one_layer_speedups_are_the_median_of_the_rounds_ratios(monkeypatch):
    """A load that comes and goes between rounds, and once arrives within a round (after reference and sdpa,
    before cascade): each round's ratio still reads the true 2x and 5x, a ratio of the medians does not."""
    from paged_ref.lab.bench import _pages_cascade, pages

    clock = _Clock(drift=0.0)
    costs = {"reference": 2.0, "sdpa": 5.0, "cascade": 1.0}
    loads = iter([1] * 4 + [1, 1, 1] + [5, 5, 5] + [1, 1, 1] + [1, 1, 5] + [5, 5, 5])  # the error check, then 5 rounds

    def path(name):
        def run(case):
            clock.spend(costs[name] * next(loads))
            return case["q"]

        return run

    monkeypatch.setattr(_pages_cascade, "PATHS", {n: path(n) for n in costs})
    cfg = dict(samples=2, prompt=16, suffix_max=2, rounds=5)
    s = _pages_cascade.cascade_speed(cfg, lambda msg: None, clock=clock)
    assert s["rounds_ms"]["cascade"] == [1e3, 5e3, 1e3, 5e3, 5e3] and s["median_ms"]["cascade"] == 5e3
    for n in ("reference", "sdpa"):
        assert s["speedup_vs"][n] == paired_ratio(s["rounds_ms"][n], s["rounds_ms"]["cascade"]) == costs[n]
        assert s["median_ms"][n] / s["median_ms"]["cascade"] == costs[n] / 5  # the medians read the load
    rows = pages.cascade_tables({"cascade_speed": s, "cascade_bytes": []}).splitlines()
    assert [r.split()[:3] for r in rows[3:6]] == [["reference", "2000.00", "2.00"], ["sdpa", "5000.00", "5.00"],
                                                  ["cascade", "5000.00", "1.00"]]  # fmt: skip
