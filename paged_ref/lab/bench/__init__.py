"""Benchmarks, run as ``python -m paged_ref.lab.bench <name> [args]``: each is a public module with a
``main(argv)``; results go to ``figures/data/``. Public modules without ``main`` (``common``, the
reports) are helpers that notebooks may import.
"""

import ast
import pkgutil
from pathlib import Path

__all__ = ["available"]


def available() -> dict[str, str]:
    """Benchmarks (public modules of this folder defining ``main``) -> their docstring's first line.

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
