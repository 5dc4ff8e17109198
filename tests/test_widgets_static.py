"""Every panel also carries a PNG of its default setting for viewers that cannot run widgets."""

import pytest

from paged_ref.lab.fragmentation import make_workload
from paged_ref.lab.widgets import with_static_figure
from paged_ref.lab.widgets.fragmentation import fragmentation_panel
from paged_ref.lab.widgets.masks import mask_panel
from paged_ref.lab.widgets.memory import kv_memory_panel
from paged_ref.lab.widgets.pages import page_map_panel

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "make",
    [
        kv_memory_panel,
        lambda: fragmentation_panel(make_workload(20, seed=0, mean_prompt=64, mean_output=64, max_len=512)),
        lambda: page_map_panel(page_size=4, num_seqs=3, seed=0),
        lambda: mask_panel(page_size=4, kv_block_size=8, lengths="11, 5"),
    ],
    ids=["memory", "fragmentation", "pages", "masks"],
)
def test_panel_shows_live_widget_and_static_png(make):
    data = make()._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data  # JupyterLab: the live widget
    assert data["image/png"].startswith(PNG_MAGIC)  # GitHub, nbviewer: the picture
    assert "VBox" not in data["text/plain"]


def test_static_figure_is_the_one_given():
    import ipywidgets as w
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    fig.add_subplot().plot([0, 1])
    box = with_static_figure(w.VBox([]), fig)
    other = w.VBox([])
    assert "image/png" in box._repr_mimebundle_()
    assert "image/png" not in other._repr_mimebundle_()  # no global patching
