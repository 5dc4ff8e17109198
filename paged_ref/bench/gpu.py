"""Everything a GPU should measure, in one command for anyone with a CUDA GPU (<= 6 minutes).

    python -m paged_ref.bench gpu --out DIR            (CUDA GPU: about 6 minutes at most)
    python -m paged_ref.bench gpu --out DIR --dry-run  (no GPU: the same steps at toy sizes)

First a pre-check line: the driver, CUDA, torch and triton versions, and whether a C compiler
and Python's headers are there (Triton builds its launchers with them). Then sections, run one
after another, each in its own process with a time budget it cannot overrun (the process
group is killed at the budget, and the section is reported as such):

==========  ========  ==========================================================================
section     budget    what runs
==========  ========  ==========================================================================
compile     45 s      every Triton launch of the run replayed and compiled for sm_90 in one
                      process per core (tests/test_triton_launch_replay.py): Triton's cache then
                      holds all 55 kernels before the sections below launch them
tests       55 s      the ``gpu``-marked tests of the Triton kernel
flex        70 s      the ``gpu``-marked compiled-flex tests of a 128+-token prefill on
                      16-token pages and a decode whose batch changes
decode      85 s      ``bench decode``: four shapes, pages 16/64/128, paged vs its contiguous
                      run vs SDPA, and the copy ceiling; compiled flex only where started in
                      the first 10 s (a compile costs seconds per shape)
scaling     75 s      ``bench scaling --gpu``: random-weight 1B-class Llama in bf16 (sections
                      that would start after 32 s are skipped and recorded as skipped)
figures     15 s      PNGs from the two JSON files (``python -m paged_ref.viz.run_figures``)
==========  ========  ==========================================================================

Each budget is 1.5x an estimate of the section's compile and run time (`estimates`: compile
counts measured without a GPU, times per compile measured on a CPU or stated as assumptions),
and the plan (budgets + 15 s to start) is checked against 360 s before anything runs. The dry
run gives each section 4x its GPU budget: a CPU compiles flex far more slowly. A
section whose JSON lists errors is reported as "errors" (with them) rather than "ok"; one
killed at its budget keeps what its benchmark had written (benchmarks save as they go, marked
``"complete": false``). Where a section cannot run it says why and the next one starts. DIR
receives at most 8 files: ``decode_gpu.json``, ``scaling_gpu.json``, ``decode_gpu.png``,
``scaling_latency_gpu.png``, ``gpu_run.json`` (pre-check, sections, status, seconds, errors,
environment) and ``gpu.log`` (every section's output). Copy the JSON files to
``figures/data/``: notebooks 05 and 06 read them from there unchanged. ``--dry-run`` runs the
same orchestration on the CPU (``bench decode --cpu --quick``, ``bench scaling --cpu --quick
--model tiny``; file names then end in ``_cpu``), which CI tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from .common import environment, print_table, result_file

__all__ = ["PLAN_LIMIT_S", "STARTUP_S", "Section", "plan", "precheck", "section_errors", "main"]

PLAN_LIMIT_S = 360.0  # six minutes: the whole plan, so that a failed run can be repeated at once
STARTUP_S = 15.0  # interpreter and imports before the first section
MAX_FILES = 8
MARGIN = 1.5  # each section's budget over its estimate
DRY_RUN_SLACK = 4  # the dry run's budgets over the GPU's: a CPU compiles flex through inductor's C++
#                    template (5-60 s a shape on 2 cores, where the GPU plan assumes 5.4 s)

# What each section's estimate is made of. Counts are measured without a GPU; per-item seconds
# are measured on a 2-core CPU where they can be, else assumed (each says which).
#: Distinct Triton compiles for sm_90 per section (tests/test_triton_launch_replay.py replays
#: every launch through Triton's binding and checks these counts).
TRITON_COMPILES = {"tests": 32, "decode": 11, "scaling": 14}
#: Distinct C launchers Triton builds for those (one per argument signature; same test).
TRITON_LAUNCHERS = {"tests": 9, "decode": 3, "scaling": 3}
TRITON_COMPILE_S = 2.0  # median sm_90 compile of the decode kernel (figures/data/kernels.json, 385 configs)
LAUNCHER_S = 1.0  # gcc building one launcher, rounded up from a CPU measurement (without linking libcuda)
REPLAY_RECORD_S = 15.0  # recording and binding the launches of the replay, rounded up from a CPU measurement
GPU_CORES = 16  # CPU cores assumed beside the GPU: the compile section compiles in that many processes
#: Compiled-flex graphs of the flex section: its two tests, fp32 and bf16 prefill of 128+
#: tokens (2) and a decode at batch 1 then 8 and 3 (2: static, then one dynamic batch).
FLEX_COMPILES = 4
FLEX_COMPILE_S = 5.4  # a new flex shape through inductor on the CPU (the fastest of 4 measured; a
#                       proxy: the CUDA path compiles a Triton template instead, not measurable here)
FLEX_FIRST_S = 15.0  # assumed: dynamo and inductor imports and set-up before a process's first compile
PYTEST_START_S = 5.0  # pytest collecting one test file with torch and triton imported
DECODE_FLEX_WINDOW_S = 10  # `bench decode --budget-s`: compiled flex is started only in the first 10 s
SCALING_TIME_BUDGET_S = 32  # `bench scaling --time-budget`: sections that would start later are skipped


def estimates() -> dict[str, tuple[float, str]]:
    """Each GPU section's estimated compile + run seconds, with how it was reached."""
    compiles = sum(TRITON_COMPILES.values())
    waves = -(-compiles // GPU_CORES)
    decode_flex = DECODE_FLEX_WINDOW_S + FLEX_FIRST_S + FLEX_COMPILE_S  # the window, then one more compile
    return {
        "compile": (
            REPLAY_RECORD_S + waves * TRITON_COMPILE_S + PYTEST_START_S,
            f"record {REPLAY_RECORD_S:.0f} s + {compiles} compiles (counted per section) in {waves} waves of "
            f"{GPU_CORES} x {TRITON_COMPILE_S} s + pytest {PYTEST_START_S:.0f} s",
        ),
        "tests": (
            TRITON_LAUNCHERS["tests"] * LAUNCHER_S + 21 + PYTEST_START_S,
            f"{TRITON_LAUNCHERS['tests']} launchers x {LAUNCHER_S} s (kernels already compiled) + 21 s making "
            f"the cases on the host (65k-token caches; as long as the replay took to make them here) + "
            f"pytest {PYTEST_START_S:.0f} s",
        ),
        "flex": (
            FLEX_FIRST_S + FLEX_COMPILES * FLEX_COMPILE_S + 3 + PYTEST_START_S,
            f"{FLEX_FIRST_S:.0f} s first compile set-up + {FLEX_COMPILES} compiles x {FLEX_COMPILE_S} s + "
            f"3 s running + pytest {PYTEST_START_S:.0f} s",
        ),
        "decode": (
            TRITON_LAUNCHERS["decode"] * LAUNCHER_S + 13 + 10 + decode_flex,
            f"{TRITON_LAUNCHERS['decode']} launchers + 13 s timing (52 do_bench medians x 0.25 s) + 10 s inputs "
            f"and references + flex window {DECODE_FLEX_WINDOW_S} s, its set-up {FLEX_FIRST_S:.0f} s and one "
            f"compile past it {FLEX_COMPILE_S} s",
        ),
        "scaling": (
            SCALING_TIME_BUDGET_S + 2 * FLEX_COMPILE_S + 5,
            f"its time budget {SCALING_TIME_BUDGET_S} s + the section started last, at most a ladder point "
            f"with a flex compile and a prefill compile ({2 * FLEX_COMPILE_S:.1f} s) + 5 s writing",
        ),
        "figures": (10.0, "9 s measured in the dry run, which draws the same two figures from smaller JSON"),
    }


class Section:
    """One step of the run: a command run in its own process, with the files it should write,
    its budget and the estimate that budget was sized from (seconds)."""

    def __init__(
        self,
        name: str,
        budget_s: float,
        command: list[str],
        produces: tuple[str, ...] = (),
        estimate_s: float | None = None,
    ):
        self.name, self.budget_s, self.command, self.produces = name, budget_s, command, produces
        self.estimate_s = estimate_s


def plan(out: Path, *, dry_run: bool) -> list[Section]:
    """The sections of a run writing into ``out`` (toy sizes on the CPU with ``dry_run``).

    Budgets are ``MARGIN`` x each section's estimate (`estimates`), rounded up to 5 s. The dry
    run runs the CPU versions of the same commands with ``DRY_RUN_SLACK`` times those budgets
    (it rehearses the orchestration; only the GPU plan has to fit ``PLAN_LIMIT_S``): the replay
    of the Triton launches without compiling them (CI compiles them in the unit tests), the
    gpu-marked tests (none run without CUDA), the benchmarks at toy sizes.
    """
    py = sys.executable
    kind = "cpu" if dry_run else "gpu"
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    replay = "tests/test_triton_launch_replay.py"
    compile_cmd = pytest + [replay, "-k", "split_counts" if dry_run else "compiles_for_sm_90"]
    tests = pytest + ["-m", "gpu", "tests/test_triton_decode.py"]
    flex = pytest + ["-m", "gpu", "-k", "128_tokens or batch_changes", "tests/test_attention_flex.py"]
    if dry_run:
        decode = [py, "-m", "paged_ref.bench", "decode", "--cpu", "--quick", "--out", str(out)]
        scaling = [py, "-m", "paged_ref.bench", "scaling", "--cpu", "--quick", "--model", "tiny", "--out", str(out)]
    else:
        decode = [py, "-m", "paged_ref.bench", "decode", "--budget-s", str(DECODE_FLEX_WINDOW_S), "--out", str(out)]
        scaling = [
            py, "-m", "paged_ref.bench", "scaling", "--gpu", "--time-budget", str(SCALING_TIME_BUDGET_S),
            "--out", str(out),
        ]  # fmt: skip
    est = estimates()

    def section(name, command, produces=()):
        estimate = est[name][0]
        budget = 5 * math.ceil(MARGIN * estimate / 5)
        return Section(name, budget * (DRY_RUN_SLACK if dry_run else 1), command, produces, estimate)

    return [
        section("compile", compile_cmd),
        section("tests", tests),
        section("flex", flex),
        section("decode", decode, (f"decode_{kind}.json",)),
        section("scaling", scaling, (f"scaling_{kind}.json",)),
        section(
            "figures",
            [py, "-m", "paged_ref.viz.run_figures", str(out), kind],
            (f"decode_{kind}.png", f"scaling_latency_{kind}.png"),
        ),
    ]


def planned_seconds(sections: list[Section]) -> float:
    return STARTUP_S + sum(s.budget_s for s in sections)


def precheck() -> dict:
    """What the run stands on: driver, CUDA, torch and triton versions, and whether a C compiler
    and Python's headers are present (Triton builds each kernel's launcher with them: without
    either, every Triton section fails at its first launch)."""
    import torch

    from ..provenance import package_version

    driver = None
    if shutil.which("nvidia-smi"):
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            driver = None
    compiler = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return dict(
        driver=driver or None,
        cuda=torch.version.cuda,
        torch=torch.__version__,
        triton=package_version("triton"),
        c_compiler=shutil.which(compiler) if compiler else None,
        python_headers=str(headers) if headers.exists() else None,
    )


def _precheck_line(check: dict) -> str:
    missing = [
        what for what, key in (("C compiler", "c_compiler"), ("Python headers", "python_headers")) if not check[key]
    ]
    return (
        f"pre-check: driver {check['driver'] or 'unknown'}, CUDA {check['cuda'] or 'none'}, "
        f"torch {check['torch']}, triton {check['triton'] or 'none'}; C compiler {check['c_compiler'] or 'MISSING'}, "
        f"Python headers {'present' if check['python_headers'] else 'MISSING'}"
        + (f" (Triton cannot build its launchers without the {' and '.join(missing)})" if missing else "")
    )


def section_errors(data) -> list[str]:
    """Every entry of every non-empty ``"errors"`` list in a benchmark's JSON (at any depth)."""
    found = []
    if isinstance(data, dict):
        for key, value in data.items():
            if key == "errors" and isinstance(value, list):
                found += [str(e) for e in value]
            else:
                found += section_errors(value)
    elif isinstance(data, list):
        for value in data:
            found += section_errors(value)
    return found


def _read_errors(out: Path, section: Section) -> tuple[list[str], list[str]]:
    """(errors listed in the section's JSON files, files it left incomplete)."""
    errors, incomplete = [], []
    for name in section.produces:
        path = out / name
        if path.suffix != ".json" or not path.exists():
            continue
        try:
            data = json.loads(path.read_text())
        except ValueError as err:
            errors.append(f"{name}: unreadable JSON ({err})")
            continue
        errors += [f"{name}: {e}" for e in section_errors(data)]
        if data.get("complete") is False:
            incomplete.append(name)
    return errors, incomplete


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
    if section.name in ("tests", "flex") and rc == 5:
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
    record_file = result_file(parser, args.out, "gpu_run.json")  # checked before anything runs
    out = record_file.path.parent.resolve()
    check = precheck()
    print(_precheck_line(check), flush=True)
    sections = plan(out, dry_run=args.dry_run)
    planned = planned_seconds(sections)
    if planned > PLAN_LIMIT_S and not args.dry_run:
        raise SystemExit(f"plan needs {planned:.0f} s, over the {PLAN_LIMIT_S:.0f} s limit")
    print(
        f"plan: {', '.join(f'{s.name} {s.budget_s:.0f} s' for s in sections)}; "
        f"{planned:.0f} s with start-up"
        + (f" (dry run: {DRY_RUN_SLACK}x the GPU budgets)" if args.dry_run else f" of {PLAN_LIMIT_S:.0f} s")
    )
    start = time.monotonic()
    rows, record = [], []
    data = dict(
        benchmark="gpu",
        dry_run=args.dry_run,
        planned_s=planned,
        limit_s=PLAN_LIMIT_S,
        precheck=check,
        sections=record,
        environment=environment(),
    )
    with open(out / "gpu.log", "w") as log:
        for section in sections:
            t = time.monotonic()
            status, why = _run_command(section, log)
            seconds = time.monotonic() - t
            made = [f for f in section.produces if (out / f).exists()]
            errors, incomplete = _read_errors(out, section)
            if errors and status == "ok":
                status, why = "errors", f"{len(errors)} listed: {errors[0][:200]}"
            if incomplete:
                why = f"{why}; " if why else ""
                why += f"kept what it measured: {', '.join(incomplete)} incomplete"
            record.append(
                dict(
                    section=section.name,
                    status=status,
                    why=why,
                    errors=errors,
                    seconds=round(seconds, 1),
                    budget_s=section.budget_s,
                    estimate_s=section.estimate_s,
                    files=made,
                )
            )
            rows.append(
                [section.name, status, f"{seconds:.0f}", f"{section.budget_s:.0f}", ", ".join(made) or "-", why or "-"]
            )
            print(f"{section.name}: {status} in {seconds:.0f} s {why}", flush=True)
            data["elapsed_s"] = round(time.monotonic() - start, 1)
            record_file.save(data)  # a run cut short keeps the sections it finished
    record_file.save(data, complete=True)
    files = sorted(p.name for p in out.iterdir())
    print_table(["section", "status", "seconds", "budget", "files", "note"], rows)
    print(f"{len(files)} files in {out}: {', '.join(files)}")
    if len(files) > MAX_FILES:
        print(f"warning: more than {MAX_FILES} files in {out}; only {MAX_FILES} come back")
    return data


if __name__ == "__main__":
    main()
