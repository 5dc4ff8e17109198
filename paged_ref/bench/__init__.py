"""Benchmarks, run as ``python -m paged_ref.bench <name> [args]``.

Each benchmark is a public module ``paged_ref/bench/<name>.py`` with a ``main(argv)`` function;
``python -m paged_ref.bench --help`` lists them with the first line of their docstring.
Shared timing, environment and JSON helpers live in :mod:`paged_ref.bench.common`; results go
to ``figures/data/<name>_{cpu,gpu}.json``. Public modules without ``main`` (``common``,
``scaling_report``) are helpers that notebooks may import.
"""

import ast
import pkgutil
from pathlib import Path

__all__ = ["available"]


def available() -> dict[str, str]:
    """Benchmark names -> first line of each module's docstring (read without importing it).

    A benchmark is a public module of this folder that defines ``main``.

    Example:
        >>> "decode" in available()
        True
    """
    folder = Path(__file__).parent
    found = {}
    for info in sorted(pkgutil.iter_modules([str(folder)]), key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        tree = ast.parse((folder / f"{info.name}.py").read_text())
        if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            continue
        doc = ast.get_docstring(tree) or ""
        found[info.name] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found
