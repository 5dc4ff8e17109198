"""What a student reads in the notebooks: the markdown and the printed outputs, and the one check on it.

* **No GPU claim without committed GPU data behind it.** A sentence that reads as measured on a
  GPU ("measured on an H200", "reaches 4,150 GB/s", a bandwidth in GB/s or TB/s that is not
  labelled as a datasheet/peak figure, "is checked ... on a GPU") must come after a code cell that
  draws a committed ``figures/data/*_gpu*.json``, and every number in it must be one that such a
  cell printed. Without committed GPU data no cell draws any, so no GPU claim passes at all.
  Conditional sentences ("when a GPU is present", "once measured", "not measured yet") are what a
  notebook says about a measurement it does not have. A printed output that carries a CPU run's
  provenance line (`CPU_RUN`, as ``viz.provenance`` writes it) is that CPU's measurement, not a GPU's.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").rglob("*.ipynb"))


GPU_WORD = re.compile(r"(?i)\b(GPUs?|H100|H200|A100|T4|L4|CUDA|Hopper)\b")
MEASURED = re.compile(
    r"(?i)\b(measured on|(is|are|was|were) (checked|tested|measured|verified)|"
    r"runs at|reaches|achieves|achieved)\b"
)
BANDWIDTH = re.compile(r"\d(?:[.,]\d+)?\s*[GT]B/s")
CPU_RUN = re.compile(r"^Measured on CPU ", re.MULTILINE)  # `paged_ref.lab.viz.provenance` of a CPU run
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


def gpu_claims(text: str) -> list[str]:
    """Sentences that read as a GPU measurement (see the module docstring)."""
    found = []
    for s in sentences(text):
        if CONDITIONAL.search(s):
            continue
        if BANDWIDTH.search(s) or (GPU_WORD.search(s) and MEASURED.search(s)):
            found.append(s)
    return found


DATA_DIR = ROOT / "figures" / "data"
GPU_JSON = re.compile(r"\b\w*_gpu\w*\.json\b")
NUMBER = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?")  # not the 200 of H200, the 16 of bf16, the 3.2 of Llama-3.2


def numbers(text: str) -> set[str]:
    """The numbers in ``text``, thousands separators dropped ("4,150" and "4150" are one number);
    digits inside a name (H200, bf16, sm_90, Llama-3.2-1B) are no number."""
    return {n.rstrip(",").replace(",", "") for n in NUMBER.findall(text)}


def _parse(src: str) -> ast.Module:
    """A code cell's source as Python (IPython's ``%`` and ``!`` lines left out); empty if it
    does not parse."""
    lines = [line for line in src.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def gpu_data_cells(cells: list[dict], data_dir: Path = DATA_DIR) -> set[int]:
    """Indices of the code cells that draw committed GPU data: a cell that names a GPU JSON file
    present in ``data_dir`` (``decode_gpu.json``), and every later cell that uses a name such a
    cell assigned (``gpu = json.loads(...)``); names assigned in those later cells do not spread
    it further, so a cell that reuses ``res`` or ``fig`` for other data is not counted."""
    loaded: set[str] = set()
    found = set()
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        tree = _parse(src)
        if any((data_dir / f).is_file() for f in GPU_JSON.findall(src)):
            found.add(i)
            assigned = [t for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets]
            loaded |= {t.id for t in assigned if isinstance(t, ast.Name)}
        elif {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} & loaded:
            found.add(i)
    return found


def unbacked_gpu_claims(path: Path, data_dir: Path = DATA_DIR) -> list[tuple[int, str, str]]:
    """Every GPU claim (`gpu_claims`) a student reads in the notebook at ``path`` that committed
    GPU data does not back, as ``(cell index, sentence, why)``. A claim is backed when a code cell
    at or before it draws committed GPU data (`gpu_data_cells`) and every number in it was printed
    by such a cell; a cell that draws the data backs its own printed output."""
    cells = json.loads(path.read_text())["cells"]
    data_cells = gpu_data_cells(cells, data_dir)
    printed: dict[int, set[str]] = {}
    for i in sorted(data_cells):
        text = "".join("".join(o["text"]) for o in cells[i].get("outputs", []) if o.get("output_type") == "stream")
        printed[i] = numbers(text)
    bad = []
    for i, text in student_text(path):
        if i in data_cells or (cells[i]["cell_type"] == "code" and CPU_RUN.search(text)):
            continue
        for claim in gpu_claims(text):
            before = [j for j in printed if j < i]
            if not before:
                bad.append((i, claim, "no cell before it draws committed GPU data"))
                continue
            missing = numbers(claim) - set().union(*(printed[j] for j in before))
            if missing:
                bad.append((i, claim, f"numbers no GPU-data cell printed: {sorted(missing)}"))
    return bad


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


PRODUCT = re.compile(r"(\d+) times (\d+) is (?:equal to )?(\d+)")


def unflagged_wrong_products(path: Path) -> list[tuple[int, str]]:
    """Printed answers of the form "A times B is C" with C != A * B that the next markdown cell does
    not correct (it must name the right product): a model's wrong answer is shown, not passed over."""
    cells = json.loads(path.read_text())["cells"]
    bad = []
    for i, text in student_text(path):
        if cells[i]["cell_type"] != "code":
            continue
        for a, b, c in PRODUCT.findall(text):
            if int(a) * int(b) == int(c):
                continue
            after = next((j for j in range(i + 1, len(cells)) if cells[j]["cell_type"] == "markdown"), None)
            if after is None or str(int(a) * int(b)) not in numbers("".join(cells[after]["source"])):
                bad.append((i, f"{a} times {b} is {c}"))
    return bad
