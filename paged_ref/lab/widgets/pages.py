"""Widget for notebook 02: the page map of a small serving story, over page size and request count.

The same token-level story (:func:`paged_ref.lab.scenarios.random_scenario`) runs on a pool of a
fixed number of token slots cut into pages of the chosen size, so moving the page-size slider
shows the trade-off directly: small pages waste little in each sequence's last page but need
long block tables; large pages waste more and fit fewer requests. When the pool runs out the
story stops at that step and the figure says so (a server would queue or preempt the request).

Example:
    >>> r = page_scenario(page_size=4, num_seqs=3, seed=1)
    >>> r.complete, r.page_map.num_pages, r.page_map.page_size
    (True, 40, 4)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from matplotlib.figure import Figure

from ..._validate import check_int
from ...allocator import OutOfPagesError
from ...cache import PagedKVCache
from ..scenarios import ScenarioPlayer, Step, random_scenario
from ..viz.pages import PageMap, page_map, page_map_figure
from . import with_static_figure

#: Page sizes offered by the slider.
PAGE_SIZES = (1, 2, 4, 8, 16, 32)
#: Token slots in the pool the panel draws (cut into POOL_TOKENS // page_size pages).
POOL_TOKENS = 160
MAX_SEQS = 8


@dataclass(frozen=True)
class ScenarioResult:
    """What :func:`page_scenario` returns.

    Attributes:
        page_map: the cache after the last step that ran.
        steps: the whole story; ``steps_run`` of them ran.
        stopped_at: the step that found the pool too small, or None if all ran.
    """

    page_map: PageMap
    steps: tuple[Step, ...]
    steps_run: int
    stopped_at: Step | None

    @property
    def complete(self) -> bool:
        return self.stopped_at is None

    @property
    def wasted_slots(self) -> int:
        """Held but empty slots (internal fragmentation plus pages reserved ahead)."""
        return self.page_map.held_slots - self.page_map.stored_tokens


def page_scenario(page_size: int, num_seqs: int, seed: int = 0, *, pool_tokens: int = POOL_TOKENS) -> ScenarioResult:
    """Run ``random_scenario(num_seqs, seed)`` on a pool of ``pool_tokens`` slots in pages of ``page_size``.

    A fresh cache each call (1 layer, 1 KV head, head_dim 1: the page map needs no more), so
    the result depends only on the arguments. Every sequence's gathered K/V is checked against
    the tokens it should hold before returning.

    Args:
        page_size: tokens per page (>= 1, at most ``pool_tokens``).
        num_seqs: requests in the story (1 .. 26).
        seed: draws the prompt and decode lengths.
        pool_tokens: token slots in the pool; the pool has ``pool_tokens // page_size`` pages.
    """
    page_size = check_int("page_size", page_size, min_value=1)
    pool_tokens = check_int("pool_tokens", pool_tokens, min_value=1)
    if page_size > pool_tokens:
        raise ValueError(f"page_size must be <= pool_tokens={pool_tokens}, got {page_size}")
    steps = random_scenario(num_seqs, seed)
    cache = PagedKVCache(
        num_layers=1,
        num_pages=pool_tokens // page_size,
        page_size=page_size,
        num_kv_heads=1,
        head_dim=1,
        dtype=torch.float32,
    )
    player = ScenarioPlayer(cache)
    stopped = None
    for step in steps:
        try:
            player.apply(step)
        except OutOfPagesError:
            stopped = step
            break
    player.check()
    return ScenarioResult(page_map(cache, player.names), steps, len(player.history), stopped)


def page_map_view(page_size: int, num_seqs: int, seed: int = 0, *, pool_tokens: int = POOL_TOKENS) -> Figure:
    """The panel's callback: a new page-map Figure for these arguments (no side effects)."""
    r = page_scenario(page_size, num_seqs, seed, pool_tokens=pool_tokens)
    pm = r.page_map
    head = (
        f"{pool_tokens}-slot pool in {pm.num_pages} pages of {page_size}: "
        f"{pm.stored_tokens} tokens, {r.wasted_slots} held slots empty"
    )
    tail = (
        "all steps ran"
        if r.complete
        else f"POOL FULL at step {r.steps_run + 1}/{len(r.steps)} ({r.stopped_at.describe()})"
    )
    return page_map_figure(pm, title=f"{head}; {tail}", cols=32 if pm.num_pages > 64 else 16)


def page_map_panel(page_size: int = 4, num_seqs: int = 4, seed: int = 0):
    """Sliders for page size, number of requests and seed, redrawing :func:`page_map_view`."""
    import ipywidgets as w
    from IPython.display import display

    style = {"description_width": "initial"}
    size = w.SelectionSlider(
        options=PAGE_SIZES, value=page_size, description="page size", continuous_update=False, style=style
    )
    seqs = w.IntSlider(
        value=num_seqs, min=1, max=MAX_SEQS, description="requests", continuous_update=False, style=style
    )
    seed_w = w.IntSlider(value=seed, min=0, max=20, description="seed", continuous_update=False, style=style)
    out = w.interactive_output(
        lambda page_size, num_seqs, seed: display(page_map_view(page_size, num_seqs, seed)),
        {"page_size": size, "num_seqs": seqs, "seed": seed_w},
    )
    return with_static_figure(w.VBox([w.HBox([size, seqs, seed_w]), out]), page_map_view(page_size, num_seqs, seed))
