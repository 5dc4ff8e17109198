"""Widget for notebook 08: scrub through a recorded generation's page maps, step by step.

The generation runs once (the real model is too slow to rerun on every slider move); a
:class:`~paged_ref.lab.viz.generation.PageTracer` records the cache after every step, and the slider
picks which snapshot :func:`trace_view` draws.

Example:
    >>> import torch
    >>> from paged_ref import PagedKVCache, hf
    >>> from paged_ref.models import tiny_llama
    >>> from paged_ref.lab.viz.generation import PageTracer
    >>> kv = PagedKVCache(num_layers=2, num_pages=8, page_size=2, num_kv_heads=2, head_dim=32)
    >>> tracer = PageTracer(kv)
    >>> _ = hf.generate(tiny_llama(), torch.tensor([[1, 5, 9]]), max_new_tokens=3, kv_cache=kv, callback=tracer)
    >>> fig = trace_view(tracer.finish(), 1)
"""

from __future__ import annotations

from matplotlib.figure import Figure

from ..viz.generation import GenerationTrace
from ..viz.pages import page_map_figure
from . import with_static_figure


def trace_view(trace: GenerationTrace, index: int) -> Figure:
    """The panel's callback: the page map of snapshot ``index`` (0 = after the prefill, -1 = the end).

    Args:
        trace: from ``PageTracer.finish()``.
        index: snapshot index in ``[-len(trace.steps), len(trace.steps))``.
    """
    if not isinstance(trace, GenerationTrace):
        raise TypeError(f"trace must be a GenerationTrace (from PageTracer.finish()), got {type(trace).__name__}")
    n = len(trace.maps)
    if isinstance(index, bool) or not isinstance(index, int) or not -n <= index < n:
        raise ValueError(f"index must be an int in [{-n}, {n}) (the trace has {n} snapshots), got {index!r}")
    index %= n
    return page_map_figure(trace.maps[index], title=f"snapshot {index}/{n - 1}: {trace.title(index)}")


def trace_panel(trace: GenerationTrace, index: int = 0):
    """A slider over the trace's snapshots, redrawing :func:`trace_view`."""
    import ipywidgets as w
    from IPython.display import display

    trace_view(trace, index)  # fail here, before any widget is made, on a bad trace or index
    slider = w.IntSlider(
        value=index % len(trace.maps),
        min=0,
        max=len(trace.maps) - 1,
        description="snapshot",
        continuous_update=False,
        style={"description_width": "initial"},
    )
    out = w.interactive_output(lambda index: display(trace_view(trace, index)), {"index": slider})
    return with_static_figure(w.VBox([slider, out]), trace_view(trace, slider.value))
