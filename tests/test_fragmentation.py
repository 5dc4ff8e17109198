"""The fragmentation study on the serving engine's dry runs: hand-traced accounting, agreement with the
engine's own step records, what each reservation must show, the workload, and every error."""

import numpy as np
import pytest

from paged_ref.lab.fragmentation import (
    CATEGORIES,
    Workload,
    compare_reservations,
    make_workload,
    page_size_sweep,
    requests_that_fit,
    serve_dry,
)
from paged_ref.lab.viz.fragmentation import COLORS, LABELS


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


@pytest.mark.parametrize(
    "reservation, future, waste, free",
    [
        ("paged", [0, 0, 0], [0, 0, 0], [4, 4, 8]),
        ("exact", [2, 2, 0], [0, 0, 0], [2, 2, 8]),
        ("max_len", [2, 2, 0], [2, 2, 0], [0, 0, 8]),
    ],
)
def test_hand_traced_split_of_the_pool(reservation, future, waste, free):
    # a 3-token prompt and 3 new tokens in 4 pages of 2: its K/V peaks at 5 tokens (3 pages); "exact"
    # commits those 3 pages, "max_len" all 4 (max_len 8). Step 0 feeds the prompt (2 pages held,
    # one slot empty), step 1 one token (2 pages full), step 2 one more and the request finishes
    run = serve_dry(
        workload([0], [3], [3], max_len=8), num_pages=4, page_size=2, reservation=reservation, watermark=0.0
    )
    assert run.used.tolist() == [3, 4, 0] and run.last_page.tolist() == [1, 0, 0]
    assert (run.future.tolist(), run.waste.tolist(), run.free.tolist()) == (future, waste, free)
    assert run.running.tolist() == [1, 1, 0] and run.waiting.tolist() == [0, 0, 0]


@pytest.mark.parametrize("reservation", ["paged", "exact", "max_len"])
def test_the_split_agrees_with_the_engines_step_records(reservation):
    wl = make_workload(40, seed=1, mean_prompt=24, mean_output=24, arrival_rate=1.0, max_len=128)
    page = 8
    run = serve_dry(wl, num_pages=64, page_size=page, reservation=reservation, max_batched_tokens=128, trace=True)
    parts = np.stack([getattr(run, k) for k in CATEGORIES])
    assert (parts >= 0).all() and (parts.sum(axis=0) == 64 * page).all()
    history = run.trace.history
    assert len(history) == len(run.used)
    quiet = [i for i, h in enumerate(history) if not h.finished]  # no request left: the record is the state after it
    assert len(quiet) > len(history) // 2
    for i in quiet:
        h = history[i]
        assert sum(h.fill) == run.used[i]
        assert h.pages_used * page == run.used[i] + run.last_page[i] == sum(o >= 0 for o in h.owners) * page
        assert h.committed_pages * page == run.used[i] + run.last_page[i] + run.future[i] + run.waste[i]
        assert h.running == run.running[i] and h.waiting == run.waiting[i]
    assert (run.last_page < page * np.maximum(run.running, 1)).all()  # less than a page per request
    if reservation == "paged":
        assert not run.future.any() and not run.waste.any()
    if reservation == "exact":
        assert not run.waste.any() and run.future.any()  # it commits exactly what it will fill
    if reservation == "max_len":
        assert run.waste.any() and run.running.max() <= 64 // (128 // page)
    s = run.summary()
    assert sum(s[k] for k in CATEGORIES) == pytest.approx(1.0)
    mask = run.waiting > 0
    assert s["pressure_steps"] == mask.sum() > 0
    assert s["used"] == pytest.approx(run.used[mask].mean() / (64 * page))
    assert s["running_under_pressure"] == pytest.approx(run.running[mask].mean())
    assert s["mean_running"] == run.engine.stats()["mean_running"]  # rows per forward, every step
    assert s["tokens"] == int(wl.output_len.sum()) and s["requests"] == len(wl)
    assert s["tokens_per_step"] == pytest.approx(s["tokens"] / s["makespan"])
    assert (s["recomputed_tokens"] > 0) == (s["preemptions"] > 0)
    assert s["computed_share"] == pytest.approx(1 + s["recomputed_tokens"] / (int(wl.total_len.sum()) - len(wl)))


def test_paging_serves_more_requests_at_once_than_a_committed_reservation():
    wl = make_workload(60, seed=0, mean_prompt=64, mean_output=64, arrival_rate=2.0, max_len=512)
    s = {r["reservation"]: r for r in compare_reservations(wl, budget_slots=2048, page_size=16)}
    assert list(s) == ["paged", "exact", "max_len"]
    assert (
        s["paged"]["running_under_pressure"]
        > s["exact"]["running_under_pressure"]
        > s["max_len"]["running_under_pressure"]
    )
    assert s["paged"]["used"] > s["exact"]["used"] > s["max_len"]["used"]
    assert s["paged"]["tokens_per_step"] > s["max_len"]["tokens_per_step"]
    assert s["exact"]["preemptions"] == s["max_len"]["preemptions"] == 0


def test_page_size_sweep_one_token_pages_have_no_empty_slots():
    wl = make_workload(30, seed=5, mean_prompt=48, mean_output=48, arrival_rate=2.0, max_len=512)
    sweep = page_size_sweep(wl, budget_slots=2048, page_sizes=[1, 16, 256])
    assert [s["page_size"] for s in sweep] == [1, 16, 256]
    assert sweep[0]["last_page"] == 0.0
    assert sweep[2]["last_page"] > sweep[1]["last_page"] > 0


def test_far_apart_arrivals_are_not_stepped_through():
    run = serve_dry(workload([0, 10**9], [3, 3], [2, 2], max_len=8), num_pages=4, page_size=4)
    assert len(run.used) == 4 and run.summary()["makespan"] == 10**9 + 2


def test_every_category_has_a_color_and_a_label():
    assert tuple(COLORS) == tuple(LABELS) == CATEGORIES


def test_requests_that_fit_seed_example():
    kw = dict(page_size=16, reserved_per_request=128)
    assert requests_that_fit([19, 45, 70], budget_slots=256, **kw) == {"max_len": 2, "exact": 3, "paged": 3}
    assert requests_that_fit([19, 45, 70], budget_slots=150, **kw) == {"max_len": 1, "exact": 3, "paged": 2}
    assert requests_that_fit([19, 200], budget_slots=10**6, **kw)["max_len"] == 1


def test_dry_run_errors():
    wl = make_workload(5, seed=0, max_len=512)
    with pytest.raises(TypeError, match="workload must be a paged_ref.lab.fragmentation.Workload"):
        serve_dry([(1, 2)], num_pages=8)
    with pytest.raises(ValueError, match="reservation must be one of"):
        serve_dry(wl, num_pages=64, reservation="buddy")
    with pytest.raises(ValueError, match="budget_slots must be a multiple of page_size = 16, got 2050"):
        compare_reservations(wl, budget_slots=2050)
    with pytest.raises(TypeError, match="budget_slots must be an int"):
        compare_reservations(wl, budget_slots=4096.0)
    with pytest.raises(ValueError, match="reservation must be one of"):
        page_size_sweep(wl, budget_slots=4096, page_sizes=[16], reservation="buddy")
    with pytest.raises(ValueError, match="can never be served"):
        compare_reservations(wl, budget_slots=256)  # "max_len" commits 512 slots


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
