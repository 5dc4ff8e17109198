"""Matplotlib figures, one module per topic; every function returns a new ``Figure``.

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so they hold no global
state (a widget can redraw hundreds of times without leaking figures).
"""

from __future__ import annotations


def add_note(fig, text: str) -> None:
    """Write a small provenance line (hardware, versions, date, or 'arithmetic') under a figure."""
    fig.text(
        0.01, 0.0, text, fontsize=7, color="0.35", ha="left", va="top"
    )  # below the axes; savefig with bbox_inches="tight" keeps it
