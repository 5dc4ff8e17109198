"""Benchmarks, run as ``python -m paged_ref.bench <name> [args]``.

Each benchmark is a module ``paged_ref/bench/<name>.py`` with a ``main(argv)`` function;
``python -m paged_ref.bench --help`` lists them with the first line of their docstring.
Shared timing, environment and JSON helpers live in :mod:`paged_ref.bench.common`; results go
to ``figures/data/<name>_{cpu,gpu}.json``.
"""

import ast
import pkgutil
from pathlib import Path

__all__ = ["available"]

_NOT_BENCHMARKS = {"common", "__main__"}


def available() -> dict[str, str]:
    """Benchmark names -> first line of each module's docstring (read without importing it).

    Example:
        >>> "decode" in available()
        True
    """
    folder = Path(__file__).parent
    found = {}
    for info in sorted(pkgutil.iter_modules([str(folder)]), key=lambda i: i.name):
        if info.name in _NOT_BENCHMARKS or info.name.startswith("_") or info.ispkg:
            continue
        source = (folder / f"{info.name}.py").read_text()
        doc = ast.get_docstring(ast.parse(source)) or ""
        found[info.name] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found
