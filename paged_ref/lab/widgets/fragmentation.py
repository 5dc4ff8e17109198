"""Widget for notebook 03: page size and pool size against fragmentation, on the serving engine's dry runs.

Example:
    >>> [s["reservation"] for s in fragmentation_numbers(16, 4096, make_workload(8, seed=0, max_len=512))]
    ['paged', 'exact', 'max_len']
"""

from __future__ import annotations

from functools import lru_cache

from matplotlib.figure import Figure

from ..fragmentation import Workload, compare_reservations, make_workload
from ..viz.fragmentation import reservation_bars_figure
from . import with_static_figure

#: Slider choices: page sizes (tokens) and pools (token slots, multiples of every page size).
PAGE_SIZES = tuple(2**k for k in range(0, 9))  # 1 .. 256
BUDGETS = tuple(range(1024, 8192 + 1, 512))  # 1k .. 8k slots
WIDGET_REQUESTS = 100
STEP_TOKENS = 512  # max_batched_tokens of the engine: one forward's tokens


@lru_cache(maxsize=1)
def default_workload() -> Workload:
    """The panel's workload: notebook 03's request mix (mean 64 + 64 tokens, max_len 512), 100 requests, seed 0."""
    return make_workload(WIDGET_REQUESTS, seed=0, mean_prompt=64, mean_output=64, arrival_rate=2.0, max_len=512)


def fragmentation_numbers(page_size: int, budget_slots: int, workload: Workload | None = None) -> list[dict]:
    """`paged_ref.lab.fragmentation.compare_reservations` on ``workload`` (default: :func:`default_workload`)."""
    return compare_reservations(
        workload if workload is not None else default_workload(),
        budget_slots=budget_slots,
        page_size=page_size,
        max_batched_tokens=STEP_TOKENS,
    )


def fragmentation_view(page_size: int, budget_slots: int, workload: Workload | None = None) -> Figure:
    """The panel's callback: a new Figure of the pool's split and concurrency per reservation."""
    fig = reservation_bars_figure(fragmentation_numbers(page_size, budget_slots, workload))
    fig.suptitle(f"page size {page_size} tokens, pool {budget_slots:,} slots", fontsize=10)
    return fig


def fragmentation_panel(workload: Workload | None = None):
    """Sliders for page size and pool size, redrawing :func:`fragmentation_view`."""
    import ipywidgets as w
    from IPython.display import display

    style = {"description_width": "initial"}
    page = w.SelectionSlider(
        options=PAGE_SIZES, value=16, description="page size", continuous_update=False, style=style
    )
    budget = w.SelectionSlider(
        options=BUDGETS, value=4096, description="pool (slots)", continuous_update=False, style=style
    )
    out = w.interactive_output(
        lambda page_size, budget_slots: display(fragmentation_view(page_size, budget_slots, workload)),
        {"page_size": page, "budget_slots": budget},
    )
    return with_static_figure(
        w.VBox([w.HBox([page, budget]), out]), fragmentation_view(page.value, budget.value, workload)
    )
