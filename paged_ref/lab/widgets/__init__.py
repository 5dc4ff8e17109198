"""ipywidgets panels for the notebooks, one module per topic.

Each panel redraws through a pure function in the same module (arguments in, Figure or data
out) that the tests call directly; the panel only wires sliders to it with
``continuous_update=False``.
"""

from __future__ import annotations

import io


def figure_png(fig) -> bytes:
    """The PNG bytes of a matplotlib Figure (what a static notebook viewer can show)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def with_static_figure(panel, fig):
    """Make ``panel`` also carry a PNG of ``fig``, its default setting, when displayed.

    A live JupyterLab shows the widget (its mimetype ranks first); a static viewer (GitHub,
    nbviewer without widget state, an exported HTML) cannot run it and shows the PNG instead
    of a bare ``VBox(...)`` line. Returns ``panel``.
    """
    png = figure_png(fig)
    live = panel._repr_mimebundle_

    def mimebundle(**kwargs):
        data = live(**kwargs)
        data["image/png"] = png
        data["text/plain"] = (
            "(interactive panel: run the notebook to move the sliders; the picture shows its default setting)"
        )
        return data

    panel._repr_mimebundle_ = mimebundle
    return panel
