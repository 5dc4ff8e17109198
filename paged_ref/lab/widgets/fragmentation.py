"""Widget for notebook 03: page size and memory budget against fragmentation."""

from __future__ import annotations

from functools import lru_cache

from matplotlib.figure import Figure

from ..fragmentation import Workload, compare_policies, make_workload
from ..viz.fragmentation import policy_bars_figure
from . import with_static_figure

#: Slider choices: page sizes (tokens) and budgets (token slots, multiples of every page size).
PAGE_SIZES = tuple(2**k for k in range(0, 9))  # 1 .. 256
BUDGETS = tuple(range(4096, 65536 + 1, 4096))  # 4k .. 64k slots
WIDGET_REQUESTS = 300


@lru_cache(maxsize=1)
def default_workload() -> Workload:
    """The panel's workload: 300 mixed-length requests, seed 0 (built once)."""
    return make_workload(WIDGET_REQUESTS, seed=0)


def fragmentation_numbers(page_size: int, budget_slots: int, workload: Workload | None = None) -> list[dict]:
    """Summaries of the three policies on ``workload`` (default: :func:`default_workload`)."""
    return compare_policies(
        workload if workload is not None else default_workload(), budget_slots=budget_slots, page_size=page_size
    )


def fragmentation_view(page_size: int, budget_slots: int, workload: Workload | None = None) -> Figure:
    """The panel's callback: a new Figure of the budget split and concurrency per policy."""
    fig = policy_bars_figure(fragmentation_numbers(page_size, budget_slots, workload))
    fig.suptitle(f"page size {page_size} tokens, budget {budget_slots:,} slots", fontsize=10)
    return fig


def fragmentation_panel(workload: Workload | None = None):
    """Sliders for page size and budget, redrawing :func:`fragmentation_view`."""
    import ipywidgets as w
    from IPython.display import display

    style = {"description_width": "initial"}
    page = w.SelectionSlider(
        options=PAGE_SIZES, value=16, description="page size", continuous_update=False, style=style
    )
    budget = w.SelectionSlider(
        options=BUDGETS, value=16384, description="budget (slots)", continuous_update=False, style=style
    )
    out = w.interactive_output(
        lambda page_size, budget_slots: display(fragmentation_view(page_size, budget_slots, workload)),
        {"page_size": page, "budget_slots": budget},
    )
    return with_static_figure(
        w.VBox([w.HBox([page, budget]), out]), fragmentation_view(page.value, budget.value, workload)
    )
