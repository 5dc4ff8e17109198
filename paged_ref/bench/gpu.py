"""Everything a GPU should measure, in one command that fits a short GPU loan (<= 6 minutes).

    python -m paged_ref.bench gpu --out DIR            (CUDA GPU: about 6 minutes at most)
    python -m paged_ref.bench gpu --out DIR --dry-run  (no GPU: the same steps at toy sizes)

Sections, run one after another, each in its own process with a time budget it cannot
overrun (the process group is killed at the budget, and the section is reported as such):

==========  ========  ==========================================================================
section     budget    what runs
==========  ========  ==========================================================================
tests       40 s      the ``gpu``-marked tests (Triton kernel and compiled flex on CUDA)
decode      160 s     ``bench decode``: four shapes, pages 16/64/128, paged vs its contiguous
                      run vs compiled flex vs SDPA, and the copy ceiling (flex started only in
                      its first 70 s)
scaling     130 s     ``bench scaling --gpu``: random-weight 1B-class Llama in bf16, 128 -> 32k
                      tokens, one 100k sequence, mixed batch, memory (sections that would start
                      after 100 s are skipped and recorded as skipped)
figures     15 s      PNGs from the two JSON files (``python -m paged_ref.viz.run_figures``)
==========  ========  ==========================================================================

The plan (budgets + 15 s to start) is checked against 360 s before anything runs. The split
between sections is an estimate until a GPU run records real times (``gpu_run.json``). Where a
section cannot run it says why and the next one starts. DIR receives at most 8 files:
``decode_gpu.json``, ``scaling_gpu.json``, ``decode_gpu.png``, ``scaling_latency_gpu.png``,
``gpu_run.json`` (sections, status, seconds, environment) and ``gpu.log`` (every section's
output). Copy the JSON files to ``figures/data/``: notebooks 05 and 06 read them from there
unchanged. ``--dry-run`` runs the same orchestration on the CPU (``bench decode --cpu --quick``,
``bench scaling --cpu --quick --model tiny``; file names then end in ``_cpu``), which CI tests.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .common import environment, print_table, write_json

__all__ = ["PLAN_LIMIT_S", "STARTUP_S", "Section", "plan", "main"]

PLAN_LIMIT_S = 360.0  # six minutes: two runs fit a 15-minute loan with its start-up
STARTUP_S = 15.0  # interpreter and imports before the first section
MAX_FILES = 8


class Section:
    """One step of the run: a command run in its own process, with the files it should write."""

    def __init__(self, name: str, budget_s: float, command: list[str], produces: tuple[str, ...] = ()):
        self.name, self.budget_s, self.command, self.produces = name, budget_s, command, produces


def plan(out: Path, *, dry_run: bool) -> list[Section]:
    """The sections of a run writing into ``out`` (toy sizes on the CPU with ``dry_run``)."""
    py = sys.executable
    kind = "cpu" if dry_run else "gpu"
    tests = [
        py,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "tests/test_triton_decode.py",
        "tests/test_attention_flex.py",
    ]
    if dry_run:
        decode = [py, "-m", "paged_ref.bench", "decode", "--cpu", "--quick", "--out", str(out)]
        scaling = [py, "-m", "paged_ref.bench", "scaling", "--cpu", "--quick", "--model", "tiny", "--out", str(out)]
    else:
        decode = [py, "-m", "paged_ref.bench", "decode", "--budget-s", "70", "--out", str(out)]
        scaling = [py, "-m", "paged_ref.bench", "scaling", "--gpu", "--time-budget", "100", "--out", str(out)]
    return [
        Section("tests", 40, tests),
        Section("decode", 160, decode, produces=(f"decode_{kind}.json",)),
        Section("scaling", 130, scaling, produces=(f"scaling_{kind}.json",)),
        Section(
            "figures",
            15,
            [py, "-m", "paged_ref.viz.run_figures", str(out), kind],
            produces=(f"decode_{kind}.png", f"scaling_latency_{kind}.png"),
        ),
    ]


def planned_seconds(sections: list[Section]) -> float:
    return STARTUP_S + sum(s.budget_s for s in sections)


def _run_command(section: Section, log) -> tuple[str, str]:
    """Run one command in its own process group; kill the group at the budget."""
    log.write(f"\n===== {section.name}: {' '.join(section.command)}\n")
    log.flush()
    try:
        proc = subprocess.Popen(
            section.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=_repo_root()
        )
    except OSError as err:
        return "not run", f"{type(err).__name__}: {err}"
    try:
        rc = proc.wait(timeout=section.budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "over budget", f"killed after {section.budget_s:.0f} s"
    if rc == 0:
        return "ok", ""
    if section.name == "tests" and rc == 5:
        return "ok", "no gpu test selected (none collected)"
    return "failed", f"exit status {rc} (see gpu.log)"


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m paged_ref.bench gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for the (at most 8) result files")
    parser.add_argument(
        "--dry-run", action="store_true", help="the same orchestration on the CPU at toy sizes (what CI runs)"
    )
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: use --dry-run to rehearse the run on the CPU")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sections = plan(out, dry_run=args.dry_run)
    planned = planned_seconds(sections)
    if planned > PLAN_LIMIT_S:
        raise SystemExit(f"plan needs {planned:.0f} s, over the {PLAN_LIMIT_S:.0f} s limit")
    print(
        f"plan: {', '.join(f'{s.name} {s.budget_s:.0f} s' for s in sections)}; "
        f"{planned:.0f} s of {PLAN_LIMIT_S:.0f} s with start-up"
    )
    start = time.monotonic()
    rows, record = [], []
    with open(out / "gpu.log", "w") as log:
        for section in sections:
            t = time.monotonic()
            status, why = _run_command(section, log)
            seconds = time.monotonic() - t
            made = [f for f in section.produces if (out / f).exists()]
            record.append(
                dict(
                    section=section.name,
                    status=status,
                    why=why,
                    seconds=round(seconds, 1),
                    budget_s=section.budget_s,
                    files=made,
                )
            )
            rows.append(
                [section.name, status, f"{seconds:.0f}", f"{section.budget_s:.0f}", ", ".join(made) or "-", why or "-"]
            )
            print(f"{section.name}: {status} in {seconds:.0f} s {why}", flush=True)
    data = dict(
        benchmark="gpu",
        dry_run=args.dry_run,
        planned_s=planned,
        limit_s=PLAN_LIMIT_S,
        elapsed_s=round(time.monotonic() - start, 1),
        sections=record,
        environment=environment(),
    )
    write_json(data, "gpu_run.json", out_dir=out)
    files = sorted(p.name for p in out.iterdir())
    print_table(["section", "status", "seconds", "budget", "files", "note"], rows)
    print(f"{len(files)} files in {out}: {', '.join(files)}")
    if len(files) > MAX_FILES:
        print(f"warning: more than {MAX_FILES} files in {out}; only {MAX_FILES} come back")
    return data


if __name__ == "__main__":
    main()
