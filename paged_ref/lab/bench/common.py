"""Shared helpers for the benchmarks: timing (:func:`cpu_median`: median wall-clock time after a
warm-up; :func:`gpu_median`: ``triton.testing.do_bench``'s median), the ratio of two methods
measured in turns (:func:`paired_ratio`: the median of the pairs' ratios), the environment record,
tables and JSON. A benchmark opens its JSON with :func:`result_file` before measuring and saves
it as parts finish (``"complete": false`` until the end), so a killed run keeps what it measured.

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
    "paired_ratio",
    "gpu_median",
    "graph_median",
    "host_median",
    "copy_bandwidth",
    "environment",
    "write_json",
    "result_file",
    "ResultFile",
    "print_table",
    "table",
    "bench_parser",
    "command_line",
    "DATA_DIR",
    "stage_log",
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


def paired_ratio(numerators, denominators) -> float:
    """The median of the ratios ``numerators[i] / denominators[i]`` of values measured side by side, pair by
    pair (the methods taking turns); for an even number of pairs, the mean of the two middle ratios.

    Each ratio is taken within one pair, so a load that changes between pairs cancels out of it, which a
    ratio of two medians does not do.

    Example:
        >>> paired_ratio([2.0, 3.0, 8.0, 4.0], [1.0, 1.0, 2.0, 2.0])
        2.5
    """
    numerators, denominators = list(numerators), list(denominators)
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(
            f"numerators and denominators must pair up, one of each per pair, got {len(numerators)} "
            f"and {len(denominators)} values"
        )
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def gpu_median(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median seconds of ``fn()`` on the current CUDA device (``triton.testing.do_bench``: warm-up
    for ``warmup_ms``, the L2 cleared before each run, CUDA events, runs for about ``rep_ms``)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3


def graph_median(fn: Callable[[], object], *, rep_ms: float = 100) -> tuple[float, object]:
    """``(median seconds, output)`` of ``fn`` captured once in a CUDA graph and replayed: the GPU
    work alone, without the Python and launch time a plain call spends on the host (timed like
    `gpu_median`). ``fn`` must be capturable (no host syncs); it runs once on a side stream first."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up off the capture: compiles and allocator growth happen here
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    seconds = gpu_median(graph.replay, rep_ms=rep_ms)
    graph.replay()
    torch.cuda.synchronize()
    return seconds, out


def host_median(fn: Callable[[], object], *, calls: int = 50) -> float:
    """Median host seconds one call of ``fn`` takes to return (Python, checks, launches), the GPU
    left to run behind it: ``calls`` stays far below CUDA's launch queue, so no call waits on
    the device. Synchronizes before and after (on a machine with CUDA)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    sync()
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30, device: str = "cuda") -> dict:
    """The bandwidth ceiling: a device-to-device copy of ``nbytes`` of random data, counting the
    bytes read plus written. Returns ``{"bytes": int, "median_s": float, "bandwidth_GBps": float}``."""
    numel = nbytes // 2
    src = torch.randn(numel, dtype=torch.bfloat16, device=device)  # random: never time zeros
    dst = torch.empty_like(src)
    seconds = gpu_median(lambda: dst.copy_(src))
    moved = 2 * numel * src.element_size()
    return {"bytes": moved, "median_s": seconds, "bandwidth_GBps": moved / seconds / 1e9}


def write_json(data: dict, filename: str, out_dir: str | Path | None = None) -> Path:
    """Write ``data`` as indented JSON to ``out_dir/filename`` (default: ``figures/data/``)."""
    folder = Path(out_dir) if out_dir is not None else data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


class ResultFile:
    """One benchmark's JSON file: created (so a bad path fails before measuring), then replaced
    whole on each ``save`` (a temporary file renamed over it: never half a file).

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
    """:class:`ResultFile` for a command line: an unusable ``--out`` ends it through ``parser.error``."""
    try:
        return ResultFile(filename, out_dir)
    except (OSError, ValueError) as err:
        parser.error(f"--out: {err}")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print rows under headers as aligned text columns (`paged_ref.lab.texttable.format_table`)."""
    print(format_table(headers, rows))


def _cell(fmt: str, row: dict) -> str:
    try:
        return fmt.format_map(row)
    except (KeyError, TypeError):  # a value the row lacks, or None
        return "-"


def table(columns, rows) -> str:
    """``rows`` (dicts) as a text table; ``columns``: ``[(header, format)]``, a format filled from one row
    (``"{peak[paged]:.1f}"``); a value the row lacks, or None, prints as ``-``."""
    return format_table([h for h, _ in columns], [[_cell(f, r) for _, f in columns] for r in rows])


def bench_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The parser of ``python -m paged_ref.lab.bench <name>``: ``doc`` as its help, and ``--out``."""
    parser = argparse.ArgumentParser(
        prog=f"python -m paged_ref.lab.bench {name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=None, help="folder for the JSON (default figures/data)")
    return parser


def command_line(name: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces a run (``argv`` None: this process's), without ``--out DIR``.

    Example:
        >>> command_line("scaling", ["--cpu", "--out", "/tmp/x", "--quick"])
        'python -m paged_ref.lab.bench scaling --cpu --quick'
    """
    args, skip = [], False
    for a in sys.argv[1:] if argv is None else argv:
        if skip or a == "--out":
            skip = not skip
            continue
        if not a.startswith("--out="):
            args.append(a)
    return " ".join([f"python -m paged_ref.lab.bench {name}", *args])


def stage_log() -> Callable[[str], None]:
    """A ``log(msg)`` printing each message after the seconds since this call, flushed (a long run's stages)."""
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {msg}", flush=True)

    return log
