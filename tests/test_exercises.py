"""The exercise notebooks: a skeleton reports "not implemented yet" cleanly, the solutions pass.

nbval runs all of them in both modes (`make test`); this test reads what the check cells print
in exercise 1, so a notebook that silently stopped checking would fail here.
"""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

EXERCISES = Path(__file__).resolve().parents[1] / "notebooks" / "exercises"
SOLUTIONS = EXERCISES / "solutions" / "solutions.py"


def _run(path: Path, solutions: bool) -> list[str]:
    """Execute a notebook; returns the text of every output, in order."""
    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("PAGED_REF_SOLUTIONS")
    if solutions:
        os.environ["PAGED_REF_SOLUTIONS"] = str(SOLUTIONS)
    else:
        os.environ.pop("PAGED_REF_SOLUTIONS", None)
    try:  # the kernel inherits this process's environment
        NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("PAGED_REF_SOLUTIONS", None)
        else:
            os.environ["PAGED_REF_SOLUTIONS"] = env_before
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", out
            texts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return texts


@pytest.mark.parametrize("solutions", [False, True], ids=["skeleton", "solutions"])
def test_exercise_one_reports_in_both_modes(solutions):
    texts = "\n".join(_run(EXERCISES / "ex1_allocator_and_slots.ipynb", solutions))
    if solutions:
        assert "PASS allocator: 200 cases" in texts and "PASS slot_mapping: 120 cases" in texts
        assert "Pass the check first" not in texts
    else:
        assert "TODO allocator: not implemented yet" in texts and "TODO slot_mapping: not implemented yet" in texts
        assert texts.count("Pass the check first") == 2


@pytest.mark.parametrize("solutions", [False, True], ids=["skeleton", "solutions"])
def test_exercises_five_to_eight_report_in_both_modes(solutions):
    names = {"ex5_scheduler": ["scheduler"], "ex6_prefix_cache": ["prefix_cache"]}
    names["ex7_reading_fewer_pages"] = ["merge_states", "quest"]
    names["ex8_fewer_bytes"] = ["quantize", "dequantize", "page_write"]
    for notebook, checkers in names.items():
        texts = "\n".join(_run(EXERCISES / f"{notebook}.ipynb", solutions))
        for name in checkers:
            if solutions:
                assert f"PASS {name}: " in texts, (notebook, texts[:500])
            else:
                assert f"TODO {name}: not implemented yet" in texts, (notebook, texts[:500])
        assert ("Pass the check first" in texts) != solutions, notebook


def test_every_exercise_names_solutions_the_file_defines():
    from paged_ref.lab.check import load_solutions

    module = load_solutions(SOLUTIONS)
    notebooks = sorted(EXERCISES.glob("ex*.ipynb"))
    assert len(notebooks) >= 8
    for path in notebooks:
        source = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
        names = [part.split('"')[1] for part in source.split("use_solution(")[1:]]
        assert names, f"{path.name} takes no solution"
        assert all(hasattr(module, n) for n in names), (path.name, names)
