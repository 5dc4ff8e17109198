"""Notebook 09's widget callbacks and figures: pure functions, called here as the sliders call them."""

import pytest
from matplotlib.figure import Figure

from paged_ref.lab.fragmentation import make_workload, serve_dry
from paged_ref.lab.page_trace import PageTrace
from paged_ref.lab.viz import serve as viz
from paged_ref.lab.widgets import figure_png
from paged_ref.lab.widgets import serve as widgets
from paged_ref.serve import Engine


def test_simulation_numbers_are_the_dry_run_of_the_default_workload():
    got = widgets.simulation_numbers(1024, 16, "exact")
    want = serve_dry(
        widgets.default_workload(),
        num_pages=64,
        page_size=16,
        reservation="exact",
        max_num_seqs=64,
        max_batched_tokens=256,
    ).summary()
    assert got == want and got["requests"] == widgets.WIDGET_REQUESTS


def test_the_policies_order_as_they_should_on_a_binding_pool():
    runs = {p: widgets.simulation_numbers(1024, 16, p) for p in ("paged", "exact", "max_len")}
    assert runs["max_len"]["peak_running"] <= 1024 // widgets.MAX_LEN
    assert runs["paged"]["mean_running"] > runs["exact"]["mean_running"] > runs["max_len"]["mean_running"]
    assert runs["paged"]["makespan"] < runs["max_len"]["makespan"]
    assert runs["exact"]["preemptions"] == runs["max_len"]["preemptions"] == 0


def test_simulation_view_redraws_with_every_slider():
    base = figure_png(widgets.simulation_view(1024, 16, "paged"))
    for args in ((2048, 16, "paged"), (1024, 8, "paged"), (1024, 16, "max_len")):
        fig = widgets.simulation_view(*args)
        assert isinstance(fig, Figure) and figure_png(fig) != base
    with pytest.raises(ValueError, match="reservation must be one of"):
        widgets.simulation_view(1024, 16, "contiguous")


def test_step_view_and_the_timeline_read_a_traced_run():
    engine = Engine(None, num_pages=8, page_size=4, max_batched_tokens=8)
    trace = PageTrace(engine)
    for n in (9, 5, 12):
        engine.add_request(list(range(n)), max_new_tokens=6)
    engine.run()
    h = trace.history
    assert all(len(s.owners) == 8 for s in h) and h[-1].owners.count(-1) < 8
    held = [sum(o >= 0 for o in s.owners) for s in h]
    assert max(held) <= 8
    assert figure_png(widgets.step_view(h, 0)) != figure_png(widgets.step_view(h, -1))
    assert viz.page_timeline_figure(h).axes
    with pytest.raises(ValueError, match="index must be an int in"):
        widgets.step_view(h, len(h))
    untraced = Engine(None, num_pages=8, page_size=4)
    untraced.add_request([1, 2], max_new_tokens=2)
    untraced.run()
    with pytest.raises(ValueError, match="PageTrace"):
        viz.page_timeline_figure(untraced.history)


def test_a_dry_run_feeds_every_token_at_least_once():
    wl = make_workload(5, seed=0, mean_prompt=8, mean_output=8, max_len=64)
    assert serve_dry(wl, num_pages=16, page_size=4).summary()["computed_share"] >= 1.0
