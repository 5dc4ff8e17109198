"""Grade a folder of submissions: every exercise function or class found, through its checker, into a CSV.

    python -m paged_ref.lab.check.grade submissions/ --out grades.csv

A submission is a notebook (``.ipynb``, e.g. a filled-in exercise notebook) or a module (``.py``)
anywhere under the folder. What is graded is found by the exercise notebooks' names:

===================== ==================== ==================================================
name                  exercise              checker
===================== ==================== ==================================================
``MyAllocator``       1                    `check_allocator`
``my_slot_mapping``   1                    `check_slot_mapping`
``my_paged_attention`` 2                   `check_paged_attention`
``my_token_scores``   3                    `check_token_scores`
``my_page_scores``    3                    `check_page_scores`
``MyPolicy``          4                    `check_eviction_policy`
``MyScheduler``       5                    `check_scheduler`
``MyPrefixCache``     6                    `check_prefix_cache`
``my_merge_states``   7                    `check_merge_states`
``MyQuest``           7                    `check_quest`
``my_quantize``       8                    `check_quantize`
``my_dequantize``     8                    `check_dequantize`
``my_write_into_page`` 8                   `check_page_write`
===================== ==================== ==================================================

From a notebook only the definitions are run (imports, functions, classes and assignments,
cell by cell, IPython ``%``/``!`` lines dropped): the check cells and figure cells are not, and
``PAGED_REF_SOLUTIONS`` is unset so ``use_solution`` returns the student's own code. A module is
run as a whole. Each submission runs in a process of its own, killed after ``--timeout``
seconds (code that hangs at import, or crashes the interpreter, costs one row, not the run);
inside it every checker case has its own time limit (``--time-limit``).

One CSV row per (submission, name found): the verdict (PASS / FAIL / TODO for a skeleton that
still raises NotImplementedError), the cases run, the seconds, the hint and the whole report.
A submission that defines none of the names gets one row ``MISSING``; one that cannot be loaded
``ERROR``; one killed at the timeout ``TIMEOUT``.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .report import DEFAULT_TIME_LIMIT_S
from .solutions import SOLUTIONS_ENV

__all__ = ["COLUMNS", "EXERCISE_NAMES", "find_submissions", "grade", "grade_one", "main", "write_csv"]

# name in the exercise notebooks -> (exercise, checker function name in paged_ref.lab.check)
EXERCISE_NAMES = {
    "MyAllocator": (1, "check_allocator"),
    "my_slot_mapping": (1, "check_slot_mapping"),
    "my_paged_attention": (2, "check_paged_attention"),
    "my_token_scores": (3, "check_token_scores"),
    "my_page_scores": (3, "check_page_scores"),
    "MyPolicy": (4, "check_eviction_policy"),
    "MyScheduler": (5, "check_scheduler"),
    "MyPrefixCache": (6, "check_prefix_cache"),
    "my_merge_states": (7, "check_merge_states"),
    "MyQuest": (7, "check_quest"),
    "my_quantize": (8, "check_quantize"),
    "my_dequantize": (8, "check_dequantize"),
    "my_write_into_page": (8, "check_page_write"),
}
COLUMNS = ["submission", "name", "exercise", "checker", "verdict", "cases", "seconds", "summary", "hint", "report"]
_MARK = "PAGED_REF_GRADE_ROWS "  # the line a grading process reports its rows on (student code may print)
_SKIP_DIRS = {".ipynb_checkpoints", "__pycache__", ".git"}


def find_submissions(folder) -> list[Path]:
    """Every ``.ipynb`` and ``.py`` file under ``folder`` (or ``folder`` itself, a file), sorted."""
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        raise FileNotFoundError(f"submissions must be a folder or a .ipynb/.py file, got {str(folder)!r}")
    return sorted(
        p
        for p in folder.rglob("*")
        if p.suffix in (".ipynb", ".py") and p.is_file() and not _SKIP_DIRS & set(p.relative_to(folder).parts)
    )


def _is_definition(node: ast.stmt) -> bool:
    """Statements a notebook's definitions consist of; calls to checkers or figures excluded."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
        for call in (n for n in ast.walk(node.value) if isinstance(n, ast.Call)):
            func = call.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
            if called.startswith("check_") or owner == "figures":
                return False
        return True
    return False


def _load_notebook(path: Path) -> dict:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    scope = {"__name__": "submission", "__file__": str(path)}
    for index, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell.get("source", []))
        lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
        tree = ast.parse("\n".join(lines), filename=f"{path.name} cell {index}")
        tree.body = [node for node in tree.body if _is_definition(node)]
        exec(compile(tree, f"{path.name} cell {index}", "exec"), scope)
    return scope


def _load_module(path: Path) -> dict:
    import runpy

    sys.path.insert(0, str(path.parent))  # the module may import its neighbours
    try:
        return runpy.run_path(str(path), run_name="submission")
    finally:
        sys.path.remove(str(path.parent))


def grade_one(path, *, time_limit: float | None = DEFAULT_TIME_LIMIT_S, label: str | None = None) -> list[dict]:
    """Rows for one submission, graded in this process (`grade` runs each in a process of its own)."""
    from .. import check

    path = Path(path)
    label = label or str(path)
    base = {"submission": label, "name": "", "exercise": "", "checker": "", "cases": "", "seconds": "", "hint": ""}
    try:
        scope = _load_notebook(path) if path.suffix == ".ipynb" else _load_module(path)
    except BaseException as error:  # the submission's own code: report it, whatever it raised
        if isinstance(error, KeyboardInterrupt):
            raise
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        return [{**base, "verdict": "ERROR", "summary": f"loading the submission raised {text}", "report": text}]
    rows = []
    for name, (exercise, checker_name) in EXERCISE_NAMES.items():
        if name not in scope:
            continue
        start = time.perf_counter()
        report = getattr(check, checker_name)(scope[name], time_limit=time_limit)
        text = str(report)
        rows.append(
            {
                **base,
                "name": name,
                "exercise": exercise,
                "checker": checker_name,
                "verdict": report.verdict,
                "cases": report.cases_run,
                "seconds": round(time.perf_counter() - start, 2),
                "summary": text.splitlines()[0],
                "hint": report.failure.hint if report.failure else "",
                "report": text,
            }
        )
    if not rows:
        names = ", ".join(EXERCISE_NAMES)
        rows.append({**base, "verdict": "MISSING", "summary": f"defines none of {names}", "report": ""})
    return rows


def grade(
    submissions, *, time_limit: float | None = DEFAULT_TIME_LIMIT_S, timeout: float = 300.0, progress=None
) -> list[dict]:
    """Rows for every submission under ``submissions``, each graded in a fresh Python process.

    Args:
        submissions: a folder (searched recursively) or one file.
        time_limit: seconds per checker case.
        timeout: seconds per submission (loading and every checker); past it the process is
            killed and the submission gets a ``TIMEOUT`` row.
        progress: called with each submission's label before it is graded (e.g. ``print``).
    """
    root = Path(submissions)
    env = {k: v for k, v in os.environ.items() if k != SOLUTIONS_ENV}
    package_root = str(Path(__file__).resolve().parents[2])  # the grading process imports this same paged_ref
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    rows = []
    for path in find_submissions(root):
        label = str(path.relative_to(root)) if root.is_dir() else path.name
        if progress is not None:
            progress(label)
        command = [sys.executable, "-m", "paged_ref.lab.check.grade", "--one", str(path), "--label", label]
        command += ["--time-limit", "none" if time_limit is None else str(time_limit)]
        base = {"submission": label, "name": "", "exercise": "", "checker": "", "cases": "", "hint": ""}
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=path.parent)
        except subprocess.TimeoutExpired:
            rows.append(
                {
                    **base,
                    "verdict": "TIMEOUT",
                    "seconds": round(time.perf_counter() - start, 2),
                    "summary": f"killed after {timeout:g} s (loading it or a checker did not finish)",
                    "report": "",
                }
            )
            continue
        found = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
        if found:
            rows.extend(json.loads(found[-1][len(_MARK) :]))
        else:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            rows.append(
                {
                    **base,
                    "verdict": "ERROR",
                    "seconds": round(time.perf_counter() - start, 2),
                    "summary": f"the grading process exited with code {done.returncode} and no result",
                    "report": "\n".join(tail),
                }
            )
    return rows


def write_csv(rows: list[dict], path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in COLUMNS})


def _time_limit(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_ref.lab.check.grade",
        description="Run the coursework checkers on a folder of submitted notebooks or modules; write a CSV.",
    )
    parser.add_argument("submissions", nargs="?", help="a folder of .ipynb / .py submissions, or one file")
    parser.add_argument("--out", default="grades.csv", help="the CSV to write (default: grades.csv)")
    parser.add_argument(
        "--time-limit", type=_time_limit, default=DEFAULT_TIME_LIMIT_S, help="seconds per checker case, or none"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per submission (default: 300)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a grading process: one submission, rows on stdout
    parser.add_argument("--label", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        rows = grade_one(args.one, time_limit=args.time_limit, label=args.label)
        sys.stdout.write("\n" + _MARK + json.dumps(rows) + "\n")
        return 0
    if not args.submissions:
        parser.error("name a folder of submissions")
    rows = grade(
        args.submissions,
        time_limit=args.time_limit,
        timeout=args.timeout,
        progress=lambda label: print(f"grading {label} ...", flush=True),
    )
    write_csv(rows, args.out)
    width = max([len(r["submission"]) for r in rows] + [10])
    for r in rows:
        print(f"{r['submission']:<{width}}  {r['name'] or '-':<18} {r['verdict']:<8} {r['hint'][:70]}")
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
