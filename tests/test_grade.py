"""`python -m paged_ref.lab.check.grade`: a folder of submissions -> one CSV row per exercise name found."""

import csv
import json
from pathlib import Path

import nbformat

from paged_ref.lab.check import grade

EXERCISES = Path(__file__).resolve().parents[1] / "notebooks" / "exercises"
SOLUTIONS = EXERCISES / "solutions" / "solutions.py"

ALIASES = """
MyAllocator = StudentAllocator
my_slot_mapping = student_slot_mapping
my_paged_attention = student_attention
my_token_scores = student_token_scores
my_page_scores = student_page_scores
MyPolicy = StudentPagedEviction
MyScheduler = StudentScheduler
MyPrefixCache = StudentPrefixCache
my_merge_states = student_merge_states
MyQuest = StudentQuest
my_quantize = student_quantize
my_dequantize = student_dequantize
my_write_into_page = student_write_into_page
"""

# exercise 1 as a student hands it in: an allocator whose free ignores the other references,
# the slot mapping left as the skeleton
NO_REFCOUNT = """
class MyAllocator:
    def __init__(self, num_pages):
        self.num_pages, self.fresh, self.returned, self.refs = num_pages, 0, [], [0] * num_pages

    @property
    def num_free(self):
        return self.num_pages - self.fresh + len(self.returned)

    def allocate(self, n):
        if n > self.num_free:
            raise MemoryError(n)
        pages = []
        for _ in range(n):
            if self.fresh < self.num_pages:
                page, self.fresh = self.fresh, self.fresh + 1
            else:
                page = self.returned.pop(0)
            self.refs[page] = 1
            pages.append(page)
        return pages

    def share(self, pages):
        if any(self.refs[p] == 0 for p in pages):
            raise ValueError(pages)
        for p in pages:
            self.refs[p] += 1

    def free(self, pages):
        if any(self.refs[p] == 0 for p in pages):
            raise ValueError(pages)
        for p in pages:
            self.refs[p] = 0
            self.returned.append(p)

    def refcount(self, page):
        return self.refs[page]


MyAllocator = use_solution("StudentAllocator", MyAllocator)
"""


def _handed_in_notebook(path: Path) -> None:
    nb = nbformat.read(EXERCISES / "ex1_allocator_and_slots.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "class MyAllocator" in c.source)
    cell.source = NO_REFCOUNT
    nbformat.write(nb, path)


def test_a_folder_of_submissions_becomes_a_csv(tmp_path, monkeypatch):
    subs = tmp_path / "submissions"
    (subs / "student_b").mkdir(parents=True)
    (subs / "student_a.py").write_text(SOLUTIONS.read_text() + ALIASES)
    _handed_in_notebook(subs / "student_b" / "ex1_allocator_and_slots.ipynb")
    (subs / "student_c.py").write_text("def my_slot_mapping(pages, *, start, num_tokens, page_size)\n")  # no colon
    (subs / "notes.py").write_text("ANSWER = 42\n")
    (subs / ".ipynb_checkpoints").mkdir()
    (subs / ".ipynb_checkpoints" / "old.py").write_text("raise SystemExit('never graded')\n")
    monkeypatch.setenv("PAGED_REF_SOLUTIONS", str(SOLUTIONS))  # the grader must not take the solutions
    out = tmp_path / "grades.csv"

    assert grade.main([str(subs), "--out", str(out), "--timeout", "120"]) == 0

    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == grade.COLUMNS
    by = {(r["submission"], r["name"]): r for r in rows}
    assert {s for s, _ in by} == {"student_a.py", "student_b/ex1_allocator_and_slots.ipynb", "student_c.py", "notes.py"}
    for name, (exercise, checker) in grade.EXERCISE_NAMES.items():
        row = by[("student_a.py", name)]
        assert row["verdict"] == "PASS" and row["checker"] == checker and int(row["exercise"]) == exercise, row
        assert int(row["cases"]) >= 1 and row["summary"].startswith("PASS")
    wrong = by[("student_b/ex1_allocator_and_slots.ipynb", "MyAllocator")]
    assert wrong["verdict"] == "FAIL" and "free drops one" in wrong["hint"] and "<- here" in wrong["report"]
    assert by[("student_b/ex1_allocator_and_slots.ipynb", "my_slot_mapping")]["verdict"] == "TODO"
    assert by[("student_c.py", "")]["verdict"] == "ERROR" and "SyntaxError" in by[("student_c.py", "")]["summary"]
    assert by[("notes.py", "")]["verdict"] == "MISSING"


def test_a_submission_that_hangs_is_killed_at_the_timeout(tmp_path):
    (tmp_path / "hangs.py").write_text("while True:\n    pass\n")
    rows = grade.grade(tmp_path, timeout=4)
    assert [(r["submission"], r["verdict"]) for r in rows] == [("hangs.py", "TIMEOUT")]


def test_only_definitions_run_from_a_notebook(tmp_path):
    """The check and figure cells of a notebook are not run when it is graded, its definitions are."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%matplotlib inline\nimport torch\nfrom paged_ref.lab.check import figures"),
        nbformat.v4.new_code_cell(
            "def my_page_scores(scores, page_size):\n"
            "    return torch.stack([c.mean() for c in scores.split(page_size)])"
        ),
        nbformat.v4.new_code_cell("raise RuntimeError('a cell the grader must not run')"),
        nbformat.v4.new_code_cell(
            "report = pr.lab.check.check_page_scores(my_page_scores)\nfigures.scores_figure(1, 2)"
        ),
    ]
    path = tmp_path / "ex3.ipynb"
    nbformat.write(nb, path)
    rows = grade.grade_one(path)
    assert [(r["name"], r["verdict"]) for r in rows] == [("my_page_scores", "PASS")]
    json.dumps(rows)  # what a grading process sends back
