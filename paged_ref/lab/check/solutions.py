"""Where an exercise notebook takes an instructor's solution instead of the student's code.

Set ``PAGED_REF_SOLUTIONS`` to a Python file that defines the solutions by name (the project's
are in ``notebooks/exercises/solutions/solutions.py``); `use_solution` then returns the file's
object, otherwise the student's. CI runs the exercise notebooks both ways.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["SOLUTIONS_ENV", "load_solutions", "use_solution"]

SOLUTIONS_ENV = "PAGED_REF_SOLUTIONS"


def load_solutions(path):
    """Import the solutions file at ``path`` as a module."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{SOLUTIONS_ENV} must name a solutions .py file, got {str(path)!r}")
    spec = importlib.util.spec_from_file_location("paged_ref_exercise_solutions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use_solution(name: str, mine):
    """``mine`` (the student's), or the solution ``name`` when ``$PAGED_REF_SOLUTIONS`` is set."""
    path = os.environ.get(SOLUTIONS_ENV)
    return getattr(load_solutions(path), name) if path else mine
