"""Quick or full runs of the notebooks, and where their figures go.

CI executes the notebooks in quick mode (small workloads, seconds); ``make figures`` sets
``PAGED_REF_MODE=full`` and regenerates every figure under ``figures/`` from full runs.

Example:
    >>> from paged_ref.lab.runmode import quick_mode
    >>> n_requests = 300 if quick_mode() else 2000
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def quick_mode() -> bool:
    """True unless the environment variable ``PAGED_REF_MODE`` is ``full``."""
    return os.environ.get("PAGED_REF_MODE", "quick").strip().lower() != "full"


OUTPUT_ENV = "PAGED_REF_OUTPUT"


def output_root() -> Path:
    """The folder that holds ``figures/`` and ``figures/data/``.

    ``$PAGED_REF_OUTPUT`` if set; else the source checkout ``paged_ref`` is imported from (a
    ``pyproject.toml`` next to the package: the notebooks and committed data live there); else
    the current directory. An installed copy (``pip install .``) therefore never writes into
    site-packages.
    """
    if os.environ.get(OUTPUT_ENV):
        return Path(os.environ[OUTPUT_ENV]).expanduser().resolve()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "paged_ref").is_dir():
        return checkout
    return Path.cwd()


def figures_dir() -> Path:
    """``figures/`` under :func:`output_root`, created if missing."""
    path = output_root() / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """``figures/data/`` under :func:`output_root` (benchmark JSON; not created here)."""
    return output_root() / "figures" / "data"


def save_figure(fig, name: str, *, dpi: int = 110) -> Path | None:
    """Write ``fig`` to ``figures/<name>.png`` in full mode; in quick mode write nothing.

    Quick runs (CI, nbval) use smaller workloads, so they leave the committed full-mode
    figures untouched. Returns the path written, or None in quick mode. The PNG carries no
    timestamp, so re-running on the same inputs rewrites the same bytes.

    Args:
        fig: a ``matplotlib.figure.Figure``.
        name: a stable file stem such as ``"01_kv_vs_scores"`` (letters, digits, ``_.-``;
            no folders, no extension).
    """
    if not isinstance(name, str) or not _NAME.match(name) or name.endswith(".png"):
        raise ValueError(f"name must be a file stem of letters, digits and _.- without .png or folders, got {name!r}")
    if not hasattr(fig, "savefig"):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    if quick_mode():
        return None
    path = figures_dir() / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    return path
