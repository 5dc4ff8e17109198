"""Widgets for notebook 09: scrub through a recorded serving run; replay a workload through the engine.

- :func:`step_view` / :func:`step_panel`: a slider over the steps of a run recorded with
  a `paged_ref.lab.page_trace.PageTrace` (the page map and the queues at that step);
- :func:`simulation_view` / :func:`simulation_panel`: pool size, page size and reservation policy
  sliders; each move serves the same seeded workload again through the engine's own scheduler, dry
  (`paged_ref.lab.fragmentation.serve_dry`: no model, so a redraw takes about a second) and draws who holds each
  page at every step, with the run's numbers in the title.

Example:
    >>> fig = simulation_view(1024, 16, "paged")
    >>> simulation_numbers(1024, 16, "max_len")["peak_running"] <= 1024 // MAX_LEN
    True
"""

from __future__ import annotations

from functools import lru_cache

from matplotlib.figure import Figure

from ..._validate import check_choice, check_int
from ...serve.scheduler import RESERVATIONS
from ..fragmentation import Workload, make_workload, serve_dry
from ..viz.serve import page_timeline_figure, step_figure
from . import with_static_figure

#: Slider choices: the pool in token slots, page sizes, and the policies.
POOL_TOKENS = tuple(range(512, 4096 + 1, 256))
PAGE_SIZES = (4, 8, 16, 32, 64)
WIDGET_REQUESTS = 40
MAX_LEN = 256  # the workload's longest request, what "max_len" reserves


@lru_cache(maxsize=1)
def default_workload() -> Workload:
    """The panel's workload: 40 mixed-length requests arriving about every 4 steps (seed 0)."""
    return make_workload(WIDGET_REQUESTS, seed=0, mean_prompt=48, mean_output=48, arrival_rate=0.25, max_len=MAX_LEN)


def _run(pool_tokens: int, page_size: int, reservation: str, workload: Workload | None):
    check_int("pool_tokens", pool_tokens, min_value=1)
    check_int("page_size", page_size, min_value=1)
    check_choice("reservation", reservation, RESERVATIONS)
    return serve_dry(
        workload if workload is not None else default_workload(),
        num_pages=pool_tokens // page_size,
        page_size=page_size,
        reservation=reservation,
        max_num_seqs=64,
        max_batched_tokens=256,
        trace=True,
    )


def simulation_numbers(pool_tokens: int, page_size: int, reservation: str, workload: Workload | None = None) -> dict:
    """`paged_ref.lab.fragmentation.DryRun.summary` of the panel's run (times in steps)."""
    return _run(pool_tokens, page_size, reservation, workload).summary()


def simulation_view(pool_tokens: int, page_size: int, reservation: str, workload: Workload | None = None) -> Figure:
    """The panel's callback: who holds each page at every step, and the run's numbers."""
    run = _run(pool_tokens, page_size, reservation, workload)
    s = run.summary()
    title = (
        f"{reservation}, {pool_tokens // page_size} pages of {page_size}: done in {s['makespan']:.0f} steps, "
        f"{s['mean_running']:.1f} running on average (peak {s['peak_running']}), "
        f"TTFT p50/p90 {s['ttft_p50_s']:.0f}/{s['ttft_p90_s']:.0f} steps,\n"
        f"{s['preemptions']} preemptions, {s['recomputed_tokens']} tokens recomputed "
        f"({s['recompute_share']:.0%} of the workload's)"
    )
    return page_timeline_figure(run.trace.history, title=title)


def simulation_panel(workload: Workload | None = None):
    """Sliders for pool size, page size and reservation, redrawing :func:`simulation_view`."""
    import ipywidgets as w
    from IPython.display import display

    style = {"description_width": "initial"}
    pool = w.SelectionSlider(
        options=POOL_TOKENS, value=1024, description="pool (token slots)", continuous_update=False, style=style
    )
    page = w.SelectionSlider(
        options=PAGE_SIZES, value=16, description="page size", continuous_update=False, style=style
    )
    policy = w.ToggleButtons(options=RESERVATIONS, value="paged", description="reservation", style=style)
    out = w.interactive_output(
        lambda pool_tokens, page_size, reservation: display(
            simulation_view(pool_tokens, page_size, reservation, workload)
        ),
        {"pool_tokens": pool, "page_size": page, "reservation": policy},
    )
    return with_static_figure(
        w.VBox([w.HBox([pool, page]), policy, out]), simulation_view(pool.value, page.value, policy.value, workload)
    )


def step_view(history, index: int) -> Figure:
    """The step panel's callback: step ``index`` of a recorded run (`paged_ref.lab.viz.serve.step_figure`)."""
    return step_figure(history, index)


def step_panel(history, index: int = 0):
    """A slider over the steps of a run recorded by a ``PageTrace`` (its ``history``), redrawing :func:`step_view`."""
    import ipywidgets as w
    from IPython.display import display

    step_view(history, index)  # fail here, before any widget is made, on a bad history or index
    n = len(history)
    slider = w.IntSlider(
        value=index % n,
        min=0,
        max=n - 1,
        description="step",
        continuous_update=False,
        style={"description_width": "initial"},
    )
    out = w.interactive_output(lambda index: display(step_view(history, index)), {"index": slider})
    return with_static_figure(w.VBox([slider, out]), step_view(history, slider.value))
