"""Everything a GPU should measure, in one command for anyone with a CUDA GPU (<= 6 or 8 minutes).

    python -m paged_ref.lab.bench gpu --out DIR                 (CUDA GPU: 6 minutes at most)
    python -m paged_ref.lab.bench gpu --out DIR --plan full     (CUDA GPU: 8 minutes at most)
    python -m paged_ref.lab.bench gpu --out DIR --dry-run       (no GPU: the same steps at toy sizes)

A pre-check line (driver, CUDA, torch, triton, and the C compiler and Python headers Triton
builds its launchers with), then sections, each in its own process group killed at its budget:
``compile`` (every Triton launch of the run replayed and compiled for sm_90, one process per
core, so Triton's cache holds them), ``tests`` and ``flex`` (the ``gpu``-marked tests of the
kernel and of compiled flex), ``decode`` (``bench decode``, flex only where it starts in the
first 10 s), ``scaling`` (``bench scaling --gpu``, what would start after 32 s skipped) and
``figures`` (``python -m paged_ref.lab.viz.run_figures``). Budgets are 1.5x each section's estimate
(`estimates`); the plan is checked against 360 s first. A section ends "ok", "errors" (its JSON
lists some), "failed", "over budget" (keeping what its benchmark saved) or "not run". DIR gets
at most 8 files: ``decode_gpu.json``, ``scaling_gpu.json``, their PNGs, ``gpu_run.json``
(pre-check, sections, environment) and ``gpu.log``; copy the JSON to ``figures/data/``. The dry
run (CI's) runs the CPU commands (``bench decode --cpu --quick``, ``bench scaling --cpu --quick
--model tiny``) with 4x the budgets.

``--plan full`` (<= 480 s, `FULL_PLAN_LIMIT_S`) is the second run: what the first left unmeasured.
``compile`` as above; ``decode`` with flex started in its first 45 s at batches >= 8 (flex as a
model calls it, its BlockMask reused, beside the per-call number; the kernel from a CUDA graph
beside the plain call; ``--eight-bit``: the kernel on float8_e4m3fn pages at page size 16, its
bandwidth beside the 16-bit kernel's on the same shapes); ``scaling``: ``bench scaling --gpu
--model llama1b`` with 115 s (the ladder, then the 100k-token sequence for every paged backend and
the mixed batch, which the 32 s of the first plan skip); ``smollm2``: SmolLM2's ladder in 20 s
(``--out DIR/smollm2``; real weights where the GGUF and ``gguf`` load, else a random-weight model of
its shapes, as its JSON records), its model then merged into ``DIR/scaling_gpu.json``; ``serve``:
``bench serve --gpu`` on 16 requests at 64 req/s (no peer, no pool sweep); ``sharing``: ``bench
sharing --gpu --repeats 1``.
It leaves out the ``tests`` and ``flex`` sections (the first run passed them; every decode row is
checked against float32 and every scaling decoder against DynamicCache's tokens) and ``figures``
(drawn here from the JSON: ``python -m paged_ref.lab.viz.run_figures DIR gpu``). Files:
``gpu_run.json``, ``gpu.log``, ``decode_gpu.json``, ``scaling_gpu.json``,
``smollm2/scaling_gpu.json``, ``serve_gpu.json``, ``sharing_gpu.json``. Its dry run uses the CPU
commands (``bench serve --quick``, ``bench sharing --quick --model tiny``, the tiny model for both
scaling sections).
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
from dataclasses import dataclass
from pathlib import Path

from .common import environment, print_table, result_file

__all__ = [
    "FULL_PLAN_LIMIT_S",
    "PLAN_LIMIT_S",
    "PLANS",
    "STARTUP_S",
    "Section",
    "plan",
    "precheck",
    "section_errors",
    "main",
]

PLAN_LIMIT_S = 360.0  # the whole standard plan: six minutes
FULL_PLAN_LIMIT_S = 480.0  # the full plan: eight minutes
PLANS = {"standard": PLAN_LIMIT_S, "full": FULL_PLAN_LIMIT_S}
FULL_MARGIN = 1.25  # the full plan's budgets over its estimates (most are GPU seconds of the first run)
STARTUP_S = 15.0  # interpreter and imports before the first section
MAX_FILES = 8
MARGIN = 1.5  # each section's budget over its estimate
DRY_RUN_SLACK = 4  # the dry run's budgets over the GPU's: a CPU compiles flex in 5-60 s a shape

# The estimates: counts measured without a GPU, seconds measured on a 2-core CPU or assumed.
#: Distinct sm_90 compiles and C launchers per section (tests/test_triton_launch_replay.py checks them).
TRITON_COMPILES = {"tests": 29, "decode": 12, "scaling": 14}
TRITON_LAUNCHERS = {"tests": 9, "decode": 3, "scaling": 3}
TRITON_COMPILE_S = 2.0  # median sm_90 compile of the decode kernel (figures/data/kernels.json, 385 configs)
LAUNCHER_S = 1.0  # gcc building one launcher, rounded up from a CPU measurement (without linking libcuda)
REPLAY_RECORD_S = 15.0  # recording and binding the launches of the replay, rounded up from a CPU measurement
GPU_CORES = 16  # CPU cores assumed beside the GPU: the compile section compiles in that many processes
FLEX_COMPILES = 4  # the flex tests' graphs: fp32 and bf16 prefill, a decode static then dynamic
FLEX_COMPILE_S = 5.4  # a new flex shape through inductor on the CPU, fastest of 4: a proxy for CUDA's
FLEX_FIRST_S = 15.0  # assumed: dynamo and inductor imports and set-up before a process's first compile
PYTEST_START_S = 5.0  # pytest collecting one test file with torch and triton imported
DECODE_FLEX_WINDOW_S = 10  # `bench decode --budget-s`: compiled flex is started only in the first 10 s
SCALING_TIME_BUDGET_S = 32  # `bench scaling --time-budget`: sections that would start later are skipped
# The full plan. First-run seconds on the H200 (figures/data/gpu_run.json, 2026-12-04): decode 39.6
# with a 10 s flex window; scaling's 1B Llama loaded in 7.0 s (scaling_gpu.json).
FIRST_RUN_DECODE_S = 39.6
FULL_DECODE_FLEX_WINDOW_S = 45  # flex (reused mask, then per call) started only in the first 45 s,
FLEX_MIN_BATCH = 8  # and at batches >= 8 (the goal's cases; the first run timed batch 1's)
FULL_FLEX_S = FLEX_FIRST_S + 4 * FLEX_COMPILE_S + 12 * 0.5  # set-up, a compile per page size + one, 12 cases timed
# `--eight-bit`: 2 compiles (split or not, page size 16) and, per shape, quantizing, a reference and a timing (~1 s)
EIGHT_BIT_S = 2 * TRITON_COMPILE_S + 4 * 1.0
FULL_SCALING_BUDGET_S = 115  # llama1b: the ladder, then the long sequence per backend, then the batch
SMOLLM2_BUDGET_S = 20  # SmolLM2's ladder
MODEL_LOAD_S = 7.0
SERVE_ARGS = ["--requests", "16", "--rates", "64", "--skip-peer", "--skip-pools"]
SERVE_STEPS = 4 * 320  # four policies x the longest of the 16 requests' outputs (304 tokens) + prefills
STEP_S = 0.02  # a decode step of the 1B Llama, assumed from scaling's ladder (13-21 ms per token at batch 1)
SHARING_STEPS = 12 * 2 * 2 * 64  # 12 runs x (paged, transformers) x (recorded, timed) x 64 new tokens


def estimates() -> dict[str, float]:
    """Each GPU section's estimated compile + run seconds."""
    waves = -(-sum(TRITON_COMPILES.values()) // GPU_CORES)  # rounds of GPU_CORES parallel compiles
    decode_flex = DECODE_FLEX_WINDOW_S + FLEX_FIRST_S + FLEX_COMPILE_S  # the window, then one more compile
    return {
        "compile": REPLAY_RECORD_S + waves * TRITON_COMPILE_S + PYTEST_START_S,
        # launchers (kernels compiled) + 21 s making the 65k-token cases on the host (as in the replay)
        "tests": TRITON_LAUNCHERS["tests"] * LAUNCHER_S + 21 + PYTEST_START_S,
        "flex": FLEX_FIRST_S + FLEX_COMPILES * FLEX_COMPILE_S + 3 + PYTEST_START_S,  # + 3 s running
        # launchers + 13 s timing (52 do_bench medians x 0.25 s) + 10 s inputs and references + flex
        "decode": TRITON_LAUNCHERS["decode"] * LAUNCHER_S + 13 + 10 + decode_flex,
        # its time budget + the last section started (a flex and a prefill compile) + 5 s writing
        "scaling": SCALING_TIME_BUDGET_S + 2 * FLEX_COMPILE_S + 5,
        "figures": 10.0,  # 9 s measured in the dry run, which draws the same two figures from smaller JSON
    }


@dataclass
class Section:
    """One step of the run: a command in its own process, the files it should write, its budget
    and the estimate that budget was sized from (seconds)."""

    name: str
    budget_s: float
    command: list[str]
    produces: tuple[str, ...] = ()
    estimate_s: float | None = None


def full_estimates() -> dict[str, float]:
    """Each section of the full plan: estimated seconds (the basis beside each constant)."""
    return {
        "compile": estimates()["compile"],
        # the first run's decode less its one flex (set-up and a compile), the full plan's flex at
        # batch >= 8, ~1 s per case for the graph, host and mask timings
        "decode": FIRST_RUN_DECODE_S - (FLEX_FIRST_S + FLEX_COMPILE_S) + FULL_FLEX_S + 12 * 1.0 + EIGHT_BIT_S,
        "scaling": FULL_SCALING_BUDGET_S + 2 * FLEX_COMPILE_S + 5,
        "smollm2": SMOLLM2_BUDGET_S + MODEL_LOAD_S + FLEX_COMPILE_S + 5,
        "serve": MODEL_LOAD_S + SERVE_STEPS * STEP_S + 5 + 3 * TRITON_COMPILE_S,  # + the overhead section
        "sharing": 3 + SHARING_STEPS * STEP_S / 2 + 3 * TRITON_COMPILE_S,  # SmolLM2-135M: half a 1B step
    }


def plan(out: Path, *, dry_run: bool, which: str = "standard") -> list[Section]:
    """The sections of a run writing into ``out``, budgets ``MARGIN`` x each estimate rounded up
    to 5 s (x ``DRY_RUN_SLACK`` in the dry run, which replays without compiling); ``which="full"``:
    the full plan (`full_plan`)."""
    if which == "full":
        return full_plan(out, dry_run=dry_run)
    if which != "standard":
        raise ValueError(f"which must be one of {sorted(PLANS)}, got {which!r}")
    py = sys.executable
    kind = "cpu" if dry_run else "gpu"
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    bench = [py, "-m", "paged_ref.lab.bench"]
    if dry_run:
        decode = bench + ["decode", "--cpu", "--quick", "--out", str(out)]
        scaling = bench + ["scaling", "--cpu", "--quick", "--model", "tiny", "--out", str(out)]
    else:
        decode = bench + ["decode", "--budget-s", str(DECODE_FLEX_WINDOW_S), "--out", str(out)]
        scaling = bench + ["scaling", "--gpu", "--time-budget", str(SCALING_TIME_BUDGET_S), "--out", str(out)]
    est = estimates()

    def section(name, command, produces=()):
        budget = 5 * math.ceil(MARGIN * est[name] / 5)
        return Section(name, budget * (DRY_RUN_SLACK if dry_run else 1), command, produces, est[name])

    replay = ["tests/test_triton_launch_replay.py", "-k", "split_counts" if dry_run else "compiles_for_sm_90"]
    flex = ["-m", "gpu", "-k", "128_tokens or batch_changes", "tests/test_attention_flex.py"]
    figures = [py, "-m", "paged_ref.lab.viz.run_figures", str(out), kind]
    return [
        section("compile", pytest + replay),
        section("tests", pytest + ["-m", "gpu", "tests/test_triton_decode.py"]),
        section("flex", pytest + flex),
        section("decode", decode, (f"decode_{kind}.json",)),
        section("scaling", scaling, (f"scaling_{kind}.json",)),
        section("figures", figures, (f"decode_{kind}.png", f"scaling_latency_{kind}.png")),
    ]


def full_plan(out: Path, *, dry_run: bool) -> list[Section]:
    """The full plan's sections (module docstring), budgets ``FULL_MARGIN`` x each estimate rounded
    up to 5 s (x ``DRY_RUN_SLACK`` in the dry run)."""
    py = sys.executable
    kind = "cpu" if dry_run else "gpu"
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    bench = [py, "-m", "paged_ref.lab.bench"]
    small = str(out / SMOLLM2_DIR)
    if dry_run:
        decode = bench + ["decode", "--cpu", "--quick", "--eight-bit", "--out", str(out)]
        scaling = bench + ["scaling", "--cpu", "--quick", "--model", "tiny", "--out", str(out)]
        smollm2 = bench + ["scaling", "--cpu", "--quick", "--model", "tiny", "--out", small]
        serve = bench + ["serve", "--quick", "--out", str(out)]
        sharing = bench + ["sharing", "--quick", "--model", "tiny", "--out", str(out)]
    else:
        decode = bench + ["decode", "--budget-s", str(FULL_DECODE_FLEX_WINDOW_S)]
        decode += ["--flex-min-batch", str(FLEX_MIN_BATCH), "--eight-bit", "--out", str(out)]
        scaling = bench + ["scaling", "--gpu", "--model", "llama1b"]
        scaling += ["--time-budget", str(FULL_SCALING_BUDGET_S), "--out", str(out)]
        smollm2 = bench + ["scaling", "--gpu", "--model", "smollm2", "--time-budget", str(SMOLLM2_BUDGET_S)]
        smollm2 += ["--out", small]
        serve = bench + ["serve", "--gpu", *SERVE_ARGS, "--out", str(out)]
        sharing = bench + ["sharing", "--gpu", "--repeats", "1", "--out", str(out)]
    est = full_estimates()

    def section(name, command, produces=()):
        budget = 5 * math.ceil(FULL_MARGIN * est[name] / 5)
        return Section(name, budget * (DRY_RUN_SLACK if dry_run else 1), command, produces, est[name])

    replay = ["tests/test_triton_launch_replay.py", "-k", "split_counts" if dry_run else "compiles_for_sm_90"]
    return [
        section("compile", pytest + replay),
        section("decode", decode, (f"decode_{kind}.json",)),
        section("scaling", scaling, (f"scaling_{kind}.json",)),
        section("smollm2", smollm2, (f"{SMOLLM2_DIR}/scaling_{kind}.json",)),
        section("serve", serve, (f"serve_{kind}{'_quick' if dry_run else ''}.json",)),
        section("sharing", sharing, (f"sharing_{kind}.json",)),
    ]


SMOLLM2_DIR = "smollm2"  # the smollm2 section's folder under DIR (its scaling JSON has the same name)


def merge_models(into: Path, source: Path) -> str:
    """Put the models ``source`` (a scaling JSON) measured into ``into`` (another run's scaling JSON
    of the same kind), recording where each came from; returns what was done, in words."""
    if not source.exists():
        return f"nothing to merge: {source.name} was not written"
    if not into.exists():
        return f"nothing to merge into: {into.name} was not written"
    target, extra = json.loads(into.read_text()), json.loads(source.read_text())
    merged = list(extra.get("models", {}))
    for name in merged:
        target.setdefault("models", {})[name] = extra["models"][name]
        target["models"][name]["command"] = extra.get("command")
        target["models"][name]["time_budget_s"] = extra.get("time_budget_s")
    skipped = [m for m in target.get("skipped_models", []) if m not in merged]
    target["skipped_models"] = skipped + list(extra.get("skipped_models", []))
    target.setdefault("merged", []).append(dict(command=extra.get("command"), models=merged))
    target["errors"] = target.get("errors", []) + list(extra.get("errors", []))
    target["complete"] = bool(target.get("complete")) and bool(extra.get("complete"))
    into.write_text(json.dumps(target, indent=2) + "\n")
    return f"merged {', '.join(merged) or 'no model'} into {into.name}"


def planned_seconds(sections: list[Section]) -> float:
    return STARTUP_S + sum(s.budget_s for s in sections)


def precheck() -> dict:
    """Driver, CUDA, torch and triton versions, and the C compiler and Python headers Triton
    builds each kernel's launcher with (without either, every Triton section fails)."""
    driver = None
    if shutil.which("nvidia-smi"):
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            driver = None
    compiler = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    env = environment()  # the versions, as every result file records them
    check = dict(driver=driver or None, cuda=env["cuda"], torch=env["torch"], triton=env["triton"])
    check["c_compiler"] = shutil.which(compiler) if compiler else None
    check["python_headers"] = str(headers) if headers.exists() else None
    return check


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
            found += [str(e) for e in value] if key == "errors" and isinstance(value, list) else section_errors(value)
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
    """Run one command in its own process group, from the repository's root; kill the group at the budget."""
    log.write(f"\n===== {section.name}: {' '.join(section.command)}\n")
    log.flush()
    root = Path(__file__).resolve().parents[3]
    try:
        proc = subprocess.Popen(section.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m paged_ref.lab.bench gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="folder for the (at most 8) result files")
    parser.add_argument(
        "--dry-run", action="store_true", help="the same orchestration on the CPU at toy sizes (what CI runs)"
    )
    parser.add_argument(
        "--plan",
        choices=sorted(PLANS),
        default="standard",
        help="standard (6 minutes: the first run's plan) or full (8 minutes: the second run's; see above)",
    )
    args = parser.parse_args(argv)
    limit = PLANS[args.plan]
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: use --dry-run to rehearse the run on the CPU")
    record_file = result_file(parser, args.out, "gpu_run.json")  # checked before anything runs
    out = record_file.path.parent.resolve()
    check = precheck()
    print(_precheck_line(check), flush=True)
    sections = plan(out, dry_run=args.dry_run, which=args.plan)
    planned = planned_seconds(sections)
    if planned > limit and not args.dry_run:
        raise SystemExit(f"plan needs {planned:.0f} s, over the {limit:.0f} s limit")
    print(
        f"plan: {', '.join(f'{s.name} {s.budget_s:.0f} s' for s in sections)}; "
        f"{planned:.0f} s with start-up"
        + (f" (dry run: {DRY_RUN_SLACK}x the GPU budgets)" if args.dry_run else f" of {limit:.0f} s")
    )
    start = time.monotonic()
    rows, record = [], []
    data = dict(benchmark="gpu", plan=args.plan, dry_run=args.dry_run, planned_s=planned, limit_s=limit)
    data["precheck"] = check
    data.update(sections=record, environment=environment())
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
                why = (f"{why}; " if why else "") + f"kept what it measured: {', '.join(incomplete)} incomplete"
            entry = dict(section=section.name, status=status, why=why, errors=errors, seconds=round(seconds, 1))
            entry.update(budget_s=section.budget_s, estimate_s=section.estimate_s, files=made)
            if section.name == "smollm2":  # one scaling JSON for both models
                kind = "cpu" if args.dry_run else "gpu"
                entry["merge"] = merge_models(out / f"scaling_{kind}.json", out / SMOLLM2_DIR / f"scaling_{kind}.json")
            record.append(entry)
            budget = f"{section.budget_s:.0f}"
            rows.append([section.name, status, f"{seconds:.0f}", budget, ", ".join(made) or "-", why or "-"])
            print(f"{section.name}: {status} in {seconds:.0f} s {why}", flush=True)
            data["elapsed_s"] = round(time.monotonic() - start, 1)
            record_file.save(data)  # a run cut short keeps the sections it finished
    record_file.save(data, complete=True)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    print_table(["section", "status", "seconds", "budget", "files", "note"], rows)
    print(f"{len(files)} files in {out}: {', '.join(files)}")
    if len(files) > MAX_FILES:
        print(f"warning: more than {MAX_FILES} files in {out}; only {MAX_FILES} come back")
    return data


if __name__ == "__main__":
    main()
