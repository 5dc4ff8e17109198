"""What a student reads in the notebooks: the markdown and the printed outputs, and two checks.

* **No process jargon.** Words from the project's tracker ("issue", "goal", "closing note",
  "TODO") mean nothing to a student; a notebook says what is measured and why instead.
* **No GPU claim without GPU data.** While no ``figures/data/*_gpu.json`` is committed, nothing
  may read as measured on a GPU: "measured on an H200", a bandwidth in TB/s that is not labelled
  as a datasheet/peak figure, "is checked ... on a GPU". Conditional sentences ("when a GPU is
  present", "once measured", "not measured yet") are what a notebook says instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").rglob("*.ipynb"))

JARGON = re.compile(r"(?i)\b(issues?|issue's|goals?|closing note|acceptance|todo|fixme)\b")

GPU_WORD = re.compile(r"(?i)\b(GPUs?|H100|H200|A100|T4|L4|CUDA|Hopper)\b")
MEASURED = re.compile(
    r"(?i)\b(measured on|(is|are|was|were) (checked|tested|measured|verified)|"
    r"runs at|reaches|achieves|achieved)\b"
)
BANDWIDTH = re.compile(r"\d(?:[.,]\d+)?\s*TB/s")
# words that make a sentence about the GPU a plan, a condition or a specification, not a result
CONDITIONAL = re.compile(
    r"(?i)\b(when|once|if|would|will|not|never|until|no|without|where|"
    r"datasheet|spec|specification|peak|paper|papers|reports?|reported|"
    r"claims?|estimate)\b"
)


def student_text(path: Path) -> list[tuple[int, str]]:
    """(cell index, text) for every markdown cell and every printed output of a code cell."""
    nb = json.loads(path.read_text())
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown":
            out.append((i, "".join(cell["source"])))
        elif cell["cell_type"] == "code":
            for o in cell.get("outputs", []):
                if o.get("output_type") == "stream":
                    out.append((i, "".join(o["text"])))
    return out


def sentences(text: str) -> list[str]:
    """Split prose into sentences (and list items / paragraphs), whitespace folded."""
    parts = re.split(r"(?<=[.!?;:])\s+|\n\s*\n|\n\s*[*-] |\n#+ ", text)
    return [" ".join(p.split()) for p in parts if p.strip()]


def jargon(text: str) -> list[str]:
    """Sentences that use the tracker's vocabulary."""
    return [s for s in sentences(text) if JARGON.search(s)]


def gpu_claims(text: str) -> list[str]:
    """Sentences that read as a GPU measurement (see the module docstring)."""
    found = []
    for s in sentences(text):
        if CONDITIONAL.search(s):
            continue
        if BANDWIDTH.search(s) or (GPU_WORD.search(s) and MEASURED.search(s)):
            found.append(s)
    return found


def gpu_data_committed() -> bool:
    return any((ROOT / "figures" / "data").glob("*_gpu.json"))


def panels_without_picture(path: Path) -> list[int]:
    """Cells that show an ipywidgets panel but saved no PNG beside it (static viewers then show
    a bare ``VBox(...)`` line)."""
    nb = json.loads(path.read_text())
    bad = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code" or not re.search(r"\w+_panel\(", "".join(cell["source"])):
            continue
        if not any("image/png" in o.get("data", {}) for o in cell.get("outputs", [])):
            bad.append(i)
    return bad
