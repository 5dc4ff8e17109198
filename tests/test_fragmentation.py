"""Workload simulation: hand-traced scenarios, accounting invariants, and every error."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_ref.lab.fragmentation import (
    POLICIES,
    Workload,
    _Contiguous,
    compare_policies,
    make_workload,
    page_size_sweep,
    requests_that_fit,
    simulate,
)

CATEGORIES = ("used", "future", "internal", "external", "free")


def workload(arrival, prompt, output, max_len):
    return Workload(np.array(arrival), np.array(prompt), np.array(output), max_len)


def test_make_workload_is_seeded_and_within_limits():
    a, b = make_workload(500, seed=3), make_workload(500, seed=3)
    for name in ("arrival", "prompt_len", "output_len"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.prompt_len, make_workload(500, seed=4).prompt_len)
    assert len(a) == 500 and a.max_len == 2048
    assert (a.prompt_len >= 1).all() and (a.output_len >= 1).all()
    assert (a.total_len <= a.max_len).all()
    assert (np.diff(a.arrival) >= 0).all() and a.arrival[0] >= 0
    assert len(np.unique(a.total_len)) > 100  # mixed lengths, not a constant


def test_make_workload_means_follow_the_parameters():
    wl = make_workload(20000, seed=0, mean_prompt=100, mean_output=50, sigma=0.5, arrival_rate=2.0, max_len=4096)
    assert wl.prompt_len.mean() == pytest.approx(100, rel=0.05)
    assert wl.output_len.mean() == pytest.approx(50, rel=0.05)
    assert len(wl) / wl.arrival[-1] == pytest.approx(2.0, rel=0.05)


def test_first_fit_holes_merge_back():
    mem = _Contiguous(16)
    assert mem.admit(0, 4) and mem.admit(1, 4) and mem.admit(2, 8)
    assert not mem.admit(3, 1) and mem.largest_hole() == 0
    mem.release(0)
    mem.release(2)
    assert mem.largest_hole() == 8 and sum(mem.sizes) == 12
    assert not mem.admit(3, 12)  # 12 free in total, but split 4 + 8
    mem.release(1)
    assert (mem.starts, mem.sizes) == ([0], [16])


def test_exact_hand_traced_external_fragmentation():
    # four 4-slot requests fill 16 slots; 0 and 2 leave at once, 1 and 3 stay two more
    # steps; request 4 (8 slots) arrives at step 1 and finds 8 free slots in two 4-slot holes
    wl = workload([0, 0, 0, 0, 1], [3, 1, 3, 1, 7], [1, 3, 1, 3, 1], max_len=8)
    res = simulate(wl, "exact", budget_slots=16)
    assert res.external[1] == 8 and res.free[1] == 0
    assert (res.used[1], res.future[1], res.waiting[1]) == (4, 4, 1)
    assert res.admitted_step.tolist() == [0, 0, 0, 0, 3]
    assert res.finished_step.tolist() == [0, 2, 0, 2, 3]
    # paging serves request 4 at once from the two free pages
    paged = simulate(wl, "paged", budget_slots=16, page_size=4)
    assert paged.admitted_step[4] == 1 and paged.external.sum() == 0
    # a max-length reservation admits only two requests at a time
    assert simulate(wl, "reserve_max", budget_slots=16).running.max() == 2


def test_pow2_growth_doubles_pages_and_reserves_past_the_end():
    # 3-token prompt, 3 new tokens, 2-token pages: 2 pages on admission (room for token 4),
    # doubled to 4 pages when token 5 arrives; at step 2 it holds 8 slots for 5 tokens,
    # and 3 of them (one in the last page of tokens, a page past its end) are empty
    res = simulate(workload([0], [3], [3], max_len=8), "paged_pow2", budget_slots=16, page_size=2)
    assert res.used.tolist() == [3, 4, 5]
    assert res.future.tolist() == [0, 0, 0]
    assert res.internal.tolist() == [1, 0, 3]
    assert res.free.tolist() == [12, 12, 8]
    assert res.finished_step.tolist() == [2]


def test_paged_preempts_the_youngest_and_finishes_everything():
    wl = workload([0, 0], [3, 3], [5, 5], max_len=8)
    res = simulate(wl, "paged", budget_slots=8, page_size=4)
    assert res.preemptions == 1
    # request 1 is preempted at step 1 holding 3 prompt + 1 generated tokens: 4 to prefill again
    assert res.recomputed_tokens == 4 and res.total_tokens == 16
    assert res.summary()["recompute_share"] == 4 / 16
    assert res.finished_step.tolist() == [4, 8]
    assert res.admitted_step.tolist() == [0, 0]
    assert res.running.tolist()[:3] == [2, 2, 1]  # snapshots precede each step's decode


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [2048, 6144, 16384])
@pytest.mark.parametrize("policy", POLICIES)
def test_accounting_invariants(policy, budget, seed):
    wl = make_workload(120, seed=seed, mean_prompt=200, mean_output=150, arrival_rate=1.0)
    page = 16
    res = simulate(wl, policy, budget_slots=budget, page_size=page)
    parts = np.stack([getattr(res, k) for k in CATEGORIES])
    assert (parts >= 0).all()
    assert (parts.sum(axis=0) == budget).all()  # every slot is in one category
    assert (res.finished_step >= res.admitted_step).all()
    assert (res.admitted_step >= wl.arrival).all()
    s = res.summary()
    for key in ("utilization", "future", "internal", "external", "free"):
        assert 0.0 <= s[key] <= 1.0
    assert sum(s[k] for k in ("utilization", *CATEGORIES[1:])) == pytest.approx(1.0)
    before_first_departure = res.finished_step.min()
    if policy.startswith("paged"):
        assert (res.external == 0).all()  # any free page serves any request
    if policy == "paged":
        assert (res.future % page == 0).all() and (res.future <= page * res.running).all()
        assert (res.internal < page * np.maximum(res.running, 1)).all()  # < a page each
    assert (res.recomputed_tokens > 0) == (res.preemptions > 0)
    assert s["internal_over_used"] == pytest.approx(
        res.internal[res.waiting > 0].mean() / res.used[res.waiting > 0].mean()
    )
    if not policy.startswith("paged"):
        assert res.preemptions == 0
        # no hole can open before the first departure: no external fragmentation
        assert (res.external[: before_first_departure + 1] == 0).all()
    if policy == "exact":
        assert (res.internal == 0).all()
    if policy == "reserve_max":
        assert res.running.max() <= budget // wl.max_len


def test_paging_fits_more_requests_than_contiguous():
    wl = make_workload(150, seed=0)
    fit = {s["policy"]: s for s in compare_policies(wl, budget_slots=16384, page_size=16)}
    assert fit["paged"]["mean_running"] > fit["exact"]["mean_running"] > fit["reserve_max"]["mean_running"]
    assert fit["paged"]["utilization"] > fit["exact"]["utilization"] > fit["reserve_max"]["utilization"]


def test_page_size_sweep_one_token_pages_have_no_internal_fragmentation():
    wl = make_workload(80, seed=5)
    sweep = page_size_sweep(wl, budget_slots=8192, page_sizes=[1, 16, 256])
    assert [s["page_size"] for s in sweep] == [1, 16, 256]
    assert sweep[0]["internal"] == 0.0
    assert sweep[2]["internal"] > sweep[1]["internal"] > 0


def test_requests_that_fit_seed_example():
    kw = dict(page_size=16, reserved_per_request=128)
    assert requests_that_fit([19, 45, 70], budget_slots=256, **kw) == {"reserve_max": 2, "exact": 3, "paged": 3}
    assert requests_that_fit([19, 45, 70], budget_slots=150, **kw) == {"reserve_max": 1, "exact": 3, "paged": 2}
    assert requests_that_fit([19, 200], budget_slots=10**6, **kw)["reserve_max"] == 1


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(policy="buddy"), ValueError, "policy must be one of"),
        (dict(budget_slots=100), ValueError, "budget_slots must be >= workload.max_len = 2048"),
        (dict(budget_slots=2050, policy="paged"), ValueError, "multiple of page_size = 16"),
        (dict(page_size=0), ValueError, "page_size must be >= 1"),
        (dict(budget_slots=4096.0), TypeError, "budget_slots must be an int"),
    ],
)
def test_simulate_errors(kwargs, exc, words):
    args = dict(policy="exact", budget_slots=4096, page_size=16) | kwargs
    with pytest.raises(exc, match=words):
        simulate(make_workload(5), args.pop("policy"), **args)


def test_simulate_rejects_other_workloads():
    with pytest.raises(TypeError, match="workload must be a Workload"):
        simulate([19, 45, 70], "paged", budget_slots=4096)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(num_requests=0), ValueError, "num_requests must be >= 1"),
        (dict(seed=-1), ValueError, "seed must be >= 0"),
        (dict(max_len=1), ValueError, "max_len must be >= 2"),
        (dict(sigma=0), ValueError, "sigma must be a positive number, got 0"),
        (dict(arrival_rate=-1.0), ValueError, "arrival_rate must be a positive number"),
        (dict(mean_output=float("nan")), ValueError, "mean_output must be a positive number"),
        (dict(mean_prompt="long"), TypeError, "mean_prompt must be a number, got str"),
    ],
)
def test_make_workload_errors(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        make_workload(**(dict(num_requests=10) | kwargs))


@pytest.mark.parametrize(
    "arrival, prompt, output, max_len, exc, words",
    [
        ([0, 1], [3], [1, 1], 8, ValueError, "one equal length"),
        ([1, 0], [3, 3], [1, 1], 8, ValueError, "arrival must be non-decreasing and >= 0; request 1"),
        ([-1], [3], [1], 8, ValueError, "arrival must be non-decreasing"),
        ([0], [0], [1], 8, ValueError, "prompt_len must be >= 1; request 0"),
        ([0, 0], [3, 3], [1, 0], 8, ValueError, "output_len must be >= 1; request 1"),
        ([0], [5], [4], 8, ValueError, r"prompt_len \+ output_len must be <= max_len = 8"),
        ([0.5], [3], [1], 8, TypeError, "arrival must be a 1-D integer array"),
        ([0], [3], [1], 1, ValueError, "max_len must be >= 2"),
    ],
)
def test_workload_validates_hand_made_requests(arrival, prompt, output, max_len, exc, words):
    with pytest.raises(exc, match=words):
        workload(arrival, prompt, output, max_len)


def test_workload_needs_a_request():
    empty = np.zeros(0, dtype=np.int64)
    with pytest.raises(ValueError, match="one equal length >= 1, got 0, 0, 0"):
        Workload(empty, empty, empty, 8)


def test_requests_that_fit_errors():
    with pytest.raises(ValueError, match=r"lengths\[0\] must be >= 1"):
        requests_that_fit([0], budget_slots=10, page_size=4, reserved_per_request=8)
    with pytest.raises(TypeError, match="lengths must be a sequence"):
        requests_that_fit(5, budget_slots=10, page_size=4, reserved_per_request=8)
    with pytest.raises(ValueError, match="budget_slots must be >= 1"):
        requests_that_fit([1], budget_slots=0, page_size=4, reserved_per_request=8)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), min_size=1, max_size=60))
def test_first_fit_matches_a_slot_by_slot_model(ops):
    """Hole bookkeeping vs a plain list of slots: same placements, same holes, always merged."""
    budget = 48
    mem, slots, live = _Contiguous(budget), [None] * budget, []
    for req, (admit, size) in enumerate(ops):
        if admit or not live:
            start = next((s for s in range(budget - size + 1) if all(x is None for x in slots[s : s + size])), None)
            assert mem.admit(req, size) == (start is not None)
            if start is not None:
                assert mem.where[req] == (start, size)
                slots[start : start + size] = [req] * size
                live.append(req)
        else:
            victim = live.pop(size % len(live))
            mem.release(victim)
            slots = [None if x == victim else x for x in slots]
        runs, s = [], 0
        while s < budget:  # maximal runs of free slots
            if slots[s] is None:
                e = s
                while e < budget and slots[e] is None:
                    e += 1
                runs.append((s, e - s))
                s = e
            else:
                s += 1
        assert list(zip(mem.starts, mem.sizes)) == runs
        assert mem.largest_hole() == max((n for _, n in runs), default=0)


def test_far_apart_arrivals_finish_without_recording_idle_steps():
    # idle steps between arrivals are skipped, not simulated (and recorded) one by one: 10**9 of them here
    wl = workload([0, 10**9], [3, 3], [2, 2], max_len=8)
    res = simulate(wl, "paged", budget_slots=16, page_size=4)
    assert res.finished_step.tolist() == [1, 10**9 + 1]
    assert res.num_steps == 4 and res.idle_steps == 10**9 - 2
    assert res.summary()["makespan"] == 10**9 + 2


def test_a_tiny_arrival_rate_finishes():
    wl = make_workload(3, arrival_rate=1e-9, seed=0)
    for policy in POLICIES:
        res = simulate(wl, policy, budget_slots=4096, page_size=16)
        assert (res.finished_step >= wl.arrival).all() and res.num_steps < 10_000
