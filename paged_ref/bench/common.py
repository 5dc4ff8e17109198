"""Shared helpers for the benchmarks: timing, the environment record, tables and JSON.

Timing rules:

* CPU: :func:`cpu_median` runs a function a few times after a warm-up and keeps the median of
  wall-clock times.
* GPU: :func:`gpu_median` uses ``triton.testing.do_bench`` (CUDA events, warm-up, the L2 flushed
  before each run, median), or plain CUDA events when triton is missing.
* Every result file carries :func:`environment` (GPU name, versions, date; no host name) and is
  written by :func:`write_json` under ``figures/data/``.
* A benchmark opens its result file with :func:`result_file` before it measures anything (a bad
  ``--out`` ends the command at once, with a message) and calls ``save(data)`` as parts finish,
  so a killed or failed run keeps what it measured (``"complete": false`` until the end).

Example:
    >>> t = cpu_median(lambda: sum(range(1000)), repeats=3)
    >>> t["median_s"] > 0 and len(t["times_s"]) == 3
    True
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..provenance import environment
from ..runmode import data_dir
from ..texttable import format_table

__all__ = [
    "cpu_median",
    "gpu_median",
    "copy_bandwidth",
    "environment",
    "write_json",
    "result_file",
    "ResultFile",
    "print_table",
    "bench_parser",
    "command_line",
    "DATA_DIR",
]

DATA_DIR = data_dir()  # figures/data of the checkout, or of $PAGED_REF_OUTPUT / the current folder


def cpu_median(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5) -> dict:
    """Median wall-clock time of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    Returns:
        ``{"median_s": float, "times_s": [float, ...]}``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "times_s": times}


def gpu_median(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time in seconds of ``fn()`` on the current CUDA device.

    ``triton.testing.do_bench`` does the work when triton is installed: it warms up for
    ``warmup_ms``, clears the L2 cache before each run, times each run with CUDA events and
    repeats for about ``rep_ms``. Without triton: CUDA events around each of as many runs.
    """
    try:
        import triton.testing
    except ImportError:
        triton = None
    if triton is not None:
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    times = []
    for _ in range(max(5, int(rep_ms / estimate_ms))):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30, device: str = "cuda") -> dict:
    """The memory-bandwidth ceiling: a device-to-device copy of ``nbytes`` of random data.

    Bandwidth counts the bytes read plus the bytes written. Returns
    ``{"bytes": int, "median_s": float, "bandwidth_GBps": float}``.
    """
    numel = nbytes // 2
    src = torch.randn(numel, dtype=torch.bfloat16, device=device)  # random: never time zeros
    dst = torch.empty_like(src)
    seconds = gpu_median(lambda: dst.copy_(src))
    moved = 2 * numel * src.element_size()
    return {"bytes": moved, "median_s": seconds, "bandwidth_GBps": moved / seconds / 1e9}


def write_json(data: dict, filename: str, out_dir: str | Path | None = None) -> Path:
    """Write ``data`` as indented JSON to ``out_dir/filename`` (default ``figures/data/`` of
    :func:`paged_ref.runmode.output_root`: never inside an installed package)."""
    folder = Path(out_dir) if out_dir is not None else data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


class ResultFile:
    """One benchmark's JSON file: checked and created before measuring, rewritten as it grows.

    Creating it makes the folder (parents too) and writes ``{"complete": false}`` to the file,
    so every way an output path can fail (``--out ''``, a parent that is a file, a name too
    long, a folder without write permission) fails here, before any measurement. ``save``
    replaces the file whole (a temporary file renamed over it): a kill mid-write leaves the
    previous version, never half a file.

    Example:
        >>> import tempfile
        >>> result = ResultFile("demo.json", tempfile.mkdtemp())
        >>> data = {"rows": [1]}
        >>> _ = result.save(data)                            # a part is measured: on disk now
        >>> json.loads(result.path.read_text())["complete"]
        False
        >>> _ = result.save(data, complete=True)
        >>> json.loads(result.path.read_text())
        {'rows': [1], 'complete': True}
    """

    def __init__(self, filename: str, out_dir: str | Path | None = None):
        if out_dir is not None and not str(out_dir).strip():
            raise ValueError("out must name a folder (or be left out for figures/data/), got ''")
        folder = Path(out_dir) if out_dir is not None else data_dir()
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"out must be a folder, got {str(folder)!r}, which is a file")
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / filename
        if self.path.is_dir():
            raise IsADirectoryError(f"the result file {str(self.path)!r} is a folder")
        self.save({})

    def save(self, data: dict, *, complete: bool = False) -> Path:
        """Write ``data`` with ``"complete": complete`` (the key is added to ``data`` too)."""
        data["complete"] = complete
        partial = self.path.with_name(self.path.name + ".part")
        partial.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        os.replace(partial, self.path)
        return self.path


def result_file(parser: argparse.ArgumentParser, out_dir: str | Path | None, filename: str) -> ResultFile:
    """:class:`ResultFile` for a benchmark's command line: an unusable ``--out`` ends the
    command through ``parser.error`` (exit status 2, the reason printed), before measuring."""
    try:
        return ResultFile(filename, out_dir)
    except (OSError, ValueError) as err:
        parser.error(f"--out: {err}")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print rows under headers as aligned text columns (`paged_ref.texttable.format_table`)."""
    print(format_table(headers, rows))


def bench_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The command line of ``python -m paged_ref.bench <name>``: the module's docstring as its
    help, and ``--out`` (the folder for the JSON; default ``figures/data/``) that every benchmark takes."""
    parser = argparse.ArgumentParser(
        prog=f"python -m paged_ref.bench {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="folder for the JSON (default figures/data)")
    return parser


def command_line(name: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces a run of benchmark ``name`` (``argv`` None: this process's),
    without ``--out DIR``: no local paths in results.

    Example:
        >>> command_line("scaling", ["--cpu", "--out", "/tmp/x", "--quick"])
        'python -m paged_ref.bench scaling --cpu --quick'
    """
    args, skip = [], False
    for a in sys.argv[1:] if argv is None else argv:
        if skip or a == "--out":
            skip = not skip
            continue
        if not a.startswith("--out="):
            args.append(a)
    return " ".join([f"python -m paged_ref.bench {name}", *args])
