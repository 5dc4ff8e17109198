"""paged_ref against vLLM in alternating pairs: ``bench serve --peer vllm --pairs`` (`run_pairs`).

Each engine is loaded once per configuration and kept across its turns: for every thread count and pool, one
long-lived vLLM per mode of `._vllm_peer.MODES` (a subprocess in ``.venv-vllm``, `VllmPeer`, answering "run
these requests" over its stdin and stdout, so start-up and compilation happen once), and paged_ref's
``Engine`` in this process (a fresh one per turn on the same model; building it is not timed). Both sides:

* **threads**: the same count. paged_ref: ``torch.set_num_threads(n)``. vLLM in its own process: its worker
  bound to CPUs ``0..n-1`` by ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's way; its default, ``auto``, binds every
  CPU of the NUMA node but one, which it reserves for the engine core); in this process: ``OMP_NUM_THREADS``.
  What each really ran is read from ``/proc`` during every turn (`._threads.busy`: threads on a CPU for at
  least a quarter of the turn's wall time, per process).
* **warm-up**: start-up excluded on both sides, then one short generation each (`WARMUP`: the workload's
  first requests, a few tokens each) before the timed turns.
* **turns**: paged_ref, then each vLLM mode, ``pairs`` times on every workload; a ratio is the median of the
  per-pair ratios (paged_ref's tokens/s over vLLM's in the same pair).
* **tokens**: compared request by request in every turn.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

from ...serve import VLLM_ADMISSION, Engine
from ._threads import busy, cpu_times
from ._vllm_peer import CPU_BLOCK_MULTIPLE, MODES, check_page_size

__all__ = ["WARMUP", "VllmPeer", "vllm_binding", "bf16_supported", "token_agreement", "run_pairs"]

#: The warm-up generation both engines run before their timed turns: this many of the workload's first
#: requests, at most ``new`` tokens each.
WARMUP = dict(requests=8, new=8)


def vllm_binding(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a worker on ``threads`` CPUs, the first ones.

    Example:
        >>> vllm_binding(1), vllm_binding(4)
        ('0', '0-3')
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    return "0" if threads == 1 else f"0-{threads - 1}"


def bf16_supported(cpuinfo: str = "/proc/cpuinfo") -> tuple[bool, str]:
    """``(supported, why)``: whether this CPU has bfloat16 instructions (AVX512-BF16 or AMX-BF16), from its flags."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False, f"{cpuinfo} is not readable: this CPU's bfloat16 instructions are unknown"
    have = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    if have:
        return True, f"the CPU has {' and '.join(have)}"
    return False, "the CPU has neither avx512_bf16 nor amx_bf16: bfloat16 would run without its instructions"


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two engines' tokens agree: requests identical, and tokens before each request's first difference.

    Example:
        >>> a = token_agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]])
        >>> a["requests_identical"], a["requests"], a["tokens_before_first_difference"], a["tokens"]
        (1, 2, 4, 5)
        >>> a["first_differing_requests"]
        [0]
    """
    same, prefix = [], 0
    for a, b in zip(ours, theirs):
        same.append(a == b)
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n
    return {
        "requests_identical": sum(same),
        "requests": len(same),
        "tokens_before_first_difference": prefix,
        "tokens": sum(map(len, ours)),
        "first_differing_requests": [i for i, s in enumerate(same) if not s][:10],
    }


class VllmPeer:
    """One ``vllm.LLM`` in ``.venv-vllm``, loaded once, serving requests on demand (`._vllm_peer.serve`)."""

    def __init__(self, python: str, job: dict, *, threads: int, log_dir: str):
        from .serve import _checkout

        env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", PYTHONPATH=_checkout())
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if not MODES[job["mode"]]["in_process"]:
            env["VLLM_CPU_OMP_THREADS_BIND"] = vllm_binding(threads)
        self.log = open(os.path.join(log_dir, f"vllm_{job['mode']}_{threads}t_{os.getpid()}_{id(self)}.log"), "w")
        self.proc = subprocess.Popen(
            [python, "-m", __package__ + "._vllm_peer", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        started = time.perf_counter()
        self.start = self._ask(job)
        self.start["start_s"] = time.perf_counter() - started

    def _ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.flush()
            with open(self.log.name) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the vLLM peer ended (exit {self.proc.returncode}):\n{tail}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"the vLLM peer refused the job: {out['error']}")
        return out

    def run(self, requests) -> dict:
        return self._ask({"cmd": "run", "requests": [[list(p), int(n)] for p, n in requests]})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _ours(model, requests, limits: dict, fast) -> dict:
    """One turn of paged_ref: a fresh engine (not timed), every request at once, run to the end (timed)."""
    engine = Engine(model, eos_token_id=[], clock="real", reservation=VLLM_ADMISSION, fast=fast, **limits)
    for prompt, new in requests:
        engine.add_request(prompt, max_new_tokens=new)
    before = cpu_times(os.getpid())
    start = time.perf_counter()
    outs = engine.run()
    wall = time.perf_counter() - start
    tokens = [o.token_ids for o in outs]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "wall_tokens_per_s": sum(map(len, tokens)) / wall,
        "preemptions": engine.stats()["preemptions"],
        "torch_threads": torch.get_num_threads(),
        "processes": [p for p in busy(before, cpu_times(os.getpid()), wall_s=wall) if p["pid"] == os.getpid()],
    }


def _warmup(requests):
    return [(p, min(n, WARMUP["new"])) for p, n in requests[: WARMUP["requests"]]]


def _strip(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("tokens", "ttft_s", "tpot_s")}


def _cell(pairs_done: dict, modes) -> dict:
    """A workload's turns on one pool and thread count: the runs, the paired ratios and the tokens."""
    ours = pairs_done["paged_ref"]
    cell = {"paged_ref": [_strip(r) for r in ours]}
    for mode in modes:
        theirs = pairs_done[mode]
        paired = [a["wall_tokens_per_s"] / b["wall_tokens_per_s"] for a, b in zip(ours, theirs)]
        cell[mode] = {
            "runs": [_strip(r) for r in theirs],
            "ratio_paired": paired,
            "ratio_median": statistics.median(paired),
            "tokens": [token_agreement(a["tokens"], b["tokens"]) for a, b in zip(ours, theirs)],
        }
    return cell


def run_pairs(
    model,
    folder: str,
    workloads: dict,
    *,
    threads: list[int],
    pools: list[int],
    modes: dict,
    pairs: int,
    limits: dict,
    fast,
    dtype: str,
    python: str,
    check_blocks=(),
    save=None,
    record: dict | None = None,
) -> dict:
    """Every thread count x pool (blocks of 32) x workload, ``pairs`` alternating turns of paged_ref and each
    vLLM mode of ``modes[(threads, blocks)]``, plus one ``eager_in_process`` turn per pool of ``check_blocks`` and
    workload at the first thread count (the tokens' and preemptions' check, exact there). ``workloads``:
    name -> ``[(prompt_ids, max_new_tokens)]``; ``limits``: ``max_num_seqs``, ``max_batched_tokens``,
    ``max_model_len``. ``save(record)`` after every cell.
    """
    check_page_size(CPU_BLOCK_MULTIPLE)
    record = {} if record is None else record
    cells = record.setdefault("cells", [])
    checks = record.setdefault("in_process_checks", [])
    starts = record.setdefault("vllm_starts", [])
    log_dir = tempfile.mkdtemp(prefix="vllm_pairs_")
    print(f"vLLM logs in {log_dir}", flush=True)
    threads_before = torch.get_num_threads()
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for blocks in pools:
                lim = dict(limits, page_size=CPU_BLOCK_MULTIPLE, num_pages=blocks)
                lim["max_model_len"] = min(limits["max_model_len"], blocks * CPU_BLOCK_MULTIPLE)
                pool_modes = tuple(modes[(n_threads, blocks)])
                check = n_threads == threads[0] and blocks in check_blocks
                want = list(pool_modes) + (["eager_in_process"] if check else [])
                peers = {}
                try:
                    for mode in want:
                        job = {"model_dir": folder, "limits": lim, "mode": mode, "dtype": dtype}
                        peers[mode] = VllmPeer(python, job, threads=n_threads, log_dir=log_dir)
                        starts.append({"threads": n_threads, "blocks": blocks, **peers[mode].start})
                    for name, requests in workloads.items():
                        warm = {"paged_ref": _strip(_ours(model, _warmup(requests), lim, fast))}
                        warm.update({m: _strip(p.run(_warmup(requests))) for m, p in peers.items()})
                        done = {"paged_ref": [], **{m: [] for m in pool_modes}}
                        for _ in range(pairs):
                            done["paged_ref"].append(_ours(model, requests, lim, fast))
                            for mode in pool_modes:
                                done[mode].append(peers[mode].run(requests))
                        cell = {"threads": n_threads, "blocks": blocks, "workload": name, "warmup": warm}
                        cell.update(_cell(done, pool_modes))
                        cell["load_after"] = os.getloadavg()
                        cells.append(cell)
                        if "eager_in_process" in peers:
                            theirs = peers["eager_in_process"].run(requests)
                            ours = done["paged_ref"][-1]
                            checks.append(
                                {
                                    "threads": n_threads,
                                    "blocks": blocks,
                                    "workload": name,
                                    "paged_ref_preemptions": ours["preemptions"],
                                    "vllm_preemptions": theirs["preemptions"],
                                    "vllm": _strip(theirs),
                                    "tokens": token_agreement(ours["tokens"], theirs["tokens"]),
                                }
                            )
                        _print_cell(cell, pool_modes)
                        if save is not None:
                            save(record)
                finally:
                    for p in peers.values():
                        p.close()
    finally:
        torch.set_num_threads(threads_before)
    return record


def _print_cell(cell: dict, modes) -> None:
    ours = " ".join(f"{r['wall_tokens_per_s']:.1f}" for r in cell["paged_ref"])
    line = f"{cell['threads']} thread(s), {cell['blocks']} blocks, {cell['workload']}: paged_ref {ours}"
    for mode in modes:
        c = cell[mode]
        tps = " ".join(f"{r['wall_tokens_per_s']:.1f}" for r in c["runs"])
        same = c["tokens"][-1]
        line += (
            f"; vLLM {mode} {tps} -> {c['ratio_median']:.2f}x (tokens {same['requests_identical']}/{same['requests']})"
        )
    print(line, flush=True)


#: What vLLM 0.32's defaults are on a CPU, read in its sources (``vllm/platforms/cpu.py``,
#: ``vllm/utils/ompmultiprocessing.py``, ``vllm/envs.py``, ``vllm/entrypoints/llm.py``): what ``default`` runs.
VLLM_CPU_DEFAULTS = {
    "compilation": "the LLM's default compilation mode (VLLM_COMPILE) becomes DYNAMO_TRACE_ONCE with the "
    "inductor backend on CPU (CpuPlatform.check_and_update_config): one Dynamo trace compiled by inductor at "
    "start-up; no CUDA graphs (cudagraph_capture_sizes emptied); vLLM's own graph passes, which run in VLLM_COMPILE "
    "only, are off (its log says 'Inductor compilation was disabled by user settings' for them)",
    "processes": "the engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1) and the model in a "
    "worker process (the mp executor, forced on CPU so that OpenMP can be bound); async scheduling off on CPU",
    "VLLM_CPU_OMP_THREADS_BIND": "auto: one logical CPU per physical core of the NUMA node, less one core "
    "reserved for the engine core; the worker's OpenMP threads are bound to the rest (GOMP_CPU_AFFINITY, with "
    "torch's libgomp and vLLM's tcmalloc in LD_PRELOAD), and torch.set_num_threads is disabled in the worker",
    "VLLM_CPU_KVCACHE_SPACE": "unset: the pool sized from gpu_memory_utilization (here fixed by "
    "num_gpu_blocks_override, the same pool as paged_ref's)",
    "disable_log_stats": "True for vllm.LLM (no per-request statistics)",
}


def physical_cores() -> int:
    """The physical cores this process may run on (``/sys`` topology; ``os.cpu_count()`` where it is absent)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for c in cpus:
        base = f"/sys/devices/system/cpu/cpu{c}/topology/"
        try:
            with open(base + "core_id") as a, open(base + "physical_package_id") as b:
                cores.add((a.read().strip(), b.read().strip()))
        except OSError:
            cores.add(c)
    return len(cores)


def auto_binding() -> dict:
    """What vLLM's default ``VLLM_CPU_OMP_THREADS_BIND=auto`` binds on this machine, by its rule for x86 with
    one worker on one NUMA node (``OMPProcessManager._get_autobind_cpu_ids``): the last logical CPU of every
    physical core, less the last one, which it reserves for the engine core (unless only one is left)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    last = {}
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id") as f:
                last[f.read().strip()] = c
        except OSError:
            last[c] = c
    chosen = sorted(last.values())
    worker, reserved = (chosen[:-1], chosen[-1:]) if len(chosen) > 1 else (chosen, [])
    return {"worker_cpus": worker, "reserved_for_engine_core": reserved, "worker_threads": len(worker)}


def _worker(processes: list[dict]) -> dict:
    """vLLM's model worker among a turn's processes: the one named ``VLLM::Worker``, else the busiest."""
    return next((p for p in processes if "Worker" in p.get("name", "")), processes[0] if processes else {})


def summarize(record: dict) -> list[dict]:
    """One row per cell and vLLM mode: the median ratio and its pairs, each side's median tokens/s, the tokens
    and the threads each side ran (paged_ref's torch setting and busy threads; vLLM's worker's CPUs and busy
    threads, and the busy threads of its other processes)."""
    rows = []
    for cell in record["cells"]:
        ours = cell["paged_ref"]
        for mode in MODES:
            if mode not in cell:
                continue
            c = cell[mode]
            worker = [_worker(r["processes"]) for r in c["runs"]]
            others = [
                sum(p["busy_threads"] for p in r["processes"] if p is not _worker(r["processes"])) for r in c["runs"]
            ]
            rows.append(
                {
                    "threads": cell["threads"],
                    "blocks": cell["blocks"],
                    "workload": cell["workload"],
                    "vllm_mode": mode,
                    "ratio_median": c["ratio_median"],
                    "ratio_paired": c["ratio_paired"],
                    "pairs": len(c["ratio_paired"]),
                    "paged_ref_tokens_per_s": statistics.median(r["wall_tokens_per_s"] for r in ours),
                    "vllm_tokens_per_s": statistics.median(r["wall_tokens_per_s"] for r in c["runs"]),
                    "requests_identical_min": min(t["requests_identical"] for t in c["tokens"]),
                    "requests": c["tokens"][0]["requests"],
                    "tokens_before_first_difference_min": min(
                        t["tokens_before_first_difference"] / t["tokens"] for t in c["tokens"]
                    ),
                    "paged_ref_torch_threads": sorted({r["torch_threads"] for r in ours}),
                    "paged_ref_busy_threads": sorted({p["busy_threads"] for r in ours for p in r["processes"]}),
                    "vllm_worker": sorted({w.get("name", "?") for w in worker}),
                    "vllm_worker_cpus": sorted({c for w in worker for c in w.get("busy_cpus", [w.get("cpus", "?")])}),
                    "vllm_worker_busy_threads": sorted({w.get("busy_threads", 0) for w in worker}),
                    "vllm_other_busy_threads": sorted(set(others)),
                    "paged_ref_cpu_s_per_wall_s": statistics.median(
                        sum(p["cpu_s"] for p in r["processes"]) / r["wall_s"] for r in ours
                    ),
                    "vllm_cpu_s_per_wall_s": statistics.median(
                        sum(p["cpu_s"] for p in r["processes"]) / r["wall_s"] for r in c["runs"]
                    ),
                }
            )
    return rows


def check_pair_goals(record: dict) -> dict:
    """The comparison's goals from this run: at least 1.0x vLLM at its defaults in every cell (median of at
    least 3 pairs), identical tokens in float32 (agreement reported in bfloat16)."""
    rows = [r for r in record["summary"] if r["vllm_mode"] == "default"]
    if not rows:
        return {}
    float32 = record["dtype"] == "float32"
    worst = min(rows, key=lambda r: r["ratio_median"])
    goal = {
        "cells": len(rows),
        "cells_at_or_above_1x": sum(r["ratio_median"] >= 1.0 for r in rows),
        "worst_ratio": worst["ratio_median"],
        "worst_cell": {k: worst[k] for k in ("threads", "blocks", "workload")},
        "min_pairs": min(r["pairs"] for r in rows),
    }
    if float32:
        goal["identical_tokens_everywhere"] = all(r["requests_identical_min"] == r["requests"] for r in rows)
    goal["met"] = (
        goal["cells_at_or_above_1x"] == len(rows)
        and goal["min_pairs"] >= 3
        and goal.get("identical_tokens_everywhere", True)
    )
    return {"vllm_default_1x_every_cell": goal}


def main_pairs(parser, args, argv) -> dict:
    """``bench serve --peer vllm --peer-only --pairs N``: `run_pairs` over the profile's workloads and the
    thread counts and pools asked for; JSON ``serve_cpu[_quick]_peer_vllm_pairs[_bfloat16][_256bit].json``
    (``_256bit``: ``--fast`` where the few-rows kernel's build has 8-float vectors, no AVX-512)."""
    from ...fast import Fast
    from ...fast.option import resolve
    from ...fast.prepack import vector_floats
    from ._scaling_models import build_model
    from ._vllm_peer import save_smollm2
    from .common import command_line, environment, result_file
    from .serve import FAST, PROFILES, WORKLOADS, make_requests, tile_suffix, vllm_python

    if args.pairs < 1:
        parser.error(f"--pairs must be >= 1, got {args.pairs}")
    quick = args.quick
    cfg = dict(PROFILES["quick" if quick else "cpu"])
    if args.requests is not None:
        cfg["requests"] = args.requests
    same_memory = cfg["num_pages"] * cfg["page_size"] // CPU_BLOCK_MULTIPLE
    blocks = args.pair_blocks or ([same_memory] if quick else [same_memory, 256])
    threads = args.pair_threads or sorted({1, physical_cores()})
    workloads = args.pair_workloads or (["chat"] if quick else list(WORKLOADS))
    eager_blocks = blocks if args.eager_blocks is None else args.eager_blocks
    eager_threads = threads if args.eager_threads is None else args.eager_threads
    check_blocks = blocks if args.check_blocks is None else args.check_blocks
    eager = {(t, b) for t in eager_threads for b in eager_blocks}
    modes = {(t, b): ("default", "eager") if (t, b) in eager else ("default",) for t in threads for b in blocks}
    suffix = "_quick" if quick else ""
    floats = vector_floats() if args.fast else None  # the few-rows kernel's tile: 8 floats without AVX-512
    dtype_tag = "" if args.dtype == "float32" else f"_{args.dtype}"
    name = f"serve_cpu{suffix}_peer_vllm_pairs{dtype_tag}{tile_suffix(floats)}.json"
    result = result_file(parser, args.out, name)
    data = {
        "mode": "quick" if quick else "cpu",
        "command": command_line("serve", argv),
        "dtype": args.dtype,
        "environment": environment(),
        "physical_cores": physical_cores(),
        "vllm_cpu_defaults": VLLM_CPU_DEFAULTS,
        "vllm_auto_binding_here": auto_binding(),
        "warmup": dict(WARMUP, note="each engine, after its start-up and before its timed turns (start-up excluded)"),
        "pairs": args.pairs,
        "threads": threads,
        "blocks": blocks,
        "page_size": CPU_BLOCK_MULTIPLE,
        "vllm_modes": {f"{t} threads, {b} blocks": list(m) for (t, b), m in modes.items()},
        "in_process_check_blocks": check_blocks if args.dtype == "float32" else [],
        "order": "per workload: paged_ref, then each vLLM mode, repeated; ratio = median of per-pair ratios",
        "vector_floats": floats,
    }
    if args.dtype == "bfloat16":
        ok, why = bf16_supported()
        data["bf16_instructions"] = why
        if not ok:
            print(f"bfloat16 skipped: {why}")
            data["skipped"] = why
            result.save(data, complete=True)
            return data
    python = vllm_python()
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    model, info = build_model(cfg["model"], dtype=dtype)
    model.to(dtype)  # (the tiny model is built in float32)
    data["model"] = {k: info[k] for k in ("name", "weights", "params", "note")}
    data["model"]["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    limits = {k: cfg[k] for k in ("max_num_seqs", "max_batched_tokens", "max_model_len")}
    if not args.fast:
        fast, data["paged_ref_fast"] = None, {}
    elif args.dtype == "float32":
        fast, data["paged_ref_fast"] = FAST, FAST.options()
    else:  # the parts that take this dtype (Fast.supported: the C++ kernels are float32's)
        fast = resolve(True, model, rows=cfg["max_num_seqs"]) or Fast()
        data["paged_ref_fast"] = fast.options()
        data["paged_ref_fast_note"] = "every part of Fast.supported for this dtype; " + ", ".join(
            f"{f}={getattr(fast, f)!r} (float32 only)" for f, v in FAST.options().items() if getattr(fast, f) != v
        )
    data["limits"] = limits
    lengths = {k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")}
    reqs = {w: make_requests(model, info["tokenizer"], **{**lengths, **WORKLOADS[w]})[0] for w in workloads}
    data["workloads"] = {
        w: {"requests": len(r), "prompt_tokens": sum(len(p) for p, _ in r), "output_tokens": sum(n for _, n in r)}
        for w, r in reqs.items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "model")
        if info["name"].startswith("smollm2"):
            save_smollm2(folder)  # float32 weights; vLLM casts them to its dtype as it loads
        else:  # a random-weight model as it is, in float32 (vLLM casts it back)
            copy.deepcopy(model).float().save_pretrained(folder)
        run_pairs(
            model,
            folder,
            reqs,
            threads=threads,
            pools=blocks,
            modes=modes,
            pairs=args.pairs,
            limits=limits,
            fast=fast,
            dtype=args.dtype,
            python=python,
            check_blocks=check_blocks if args.dtype == "float32" else (),
            save=lambda rec: result.save({**data, **rec}),
            record=data,
        )
    data["summary"] = summarize(data)
    data["goals"] = check_pair_goals(data)
    data["seconds"] = time.perf_counter() - started
    report_pairs(data)
    for goal, g in data["goals"].items():
        print(f"  {'met    ' if g['met'] else 'NOT met'}  {goal}: {g}")
    path = result.save(data, complete=True)
    print(f"wrote {path} ({data['seconds']:.0f} s)")
    return data


def report_pairs(data: dict) -> None:
    """Print a ``--pairs`` run: how each engine ran (vLLM's resolved settings, the threads each side set and
    really ran, the warm-up, the pairs), one row per cell and vLLM mode, and the in-process checks."""
    from ..provenance import describe
    from .common import table

    print(describe(data))
    if "skipped" in data:
        print(f"skipped: {data['skipped']}")
        return
    if "bf16_instructions" in data:
        print(f"bfloat16: {data['bf16_instructions']}")
    starts = {}
    for s in data["vllm_starts"]:
        starts.setdefault(s["settings"]["mode"], []).append(s)
    for mode, runs in starts.items():
        st = runs[0]["settings"]
        binds = sorted({f"{r['threads']}: {r['settings']['VLLM_CPU_OMP_THREADS_BIND']} -> torch.get_num_threads() "
                        f"{r['worker']['torch_threads']} on CPUs {r['worker']['cpus']}, {r['worker']['omp_env']}"
                        for r in runs})  # fmt: skip
        print(
            f"vLLM {mode}: compilation {st['compilation_mode']}"
            f"{'' if st['compilation_mode'] == 'NONE' else ' (' + st['compilation_backend'] + ')'}, "
            f"engine core in its own process: {st['engine_core_in_own_process']} ({st['executor']} executor); "
            f"start-up {min(r['start_s'] for r in runs):.0f}-{max(r['start_s'] for r in runs):.0f} s, excluded"
        )
        if st["engine_core_in_own_process"]:
            print(f"  threads: VLLM_CPU_OMP_THREADS_BIND -> what its worker reports, {'; '.join(binds)}")
    auto = data.get("vllm_auto_binding_here")
    if auto:
        print(
            f"  (vLLM's own default, VLLM_CPU_OMP_THREADS_BIND=auto, would bind the worker to CPUs "
            f"{auto['worker_cpus']} and keep {auto['reserved_for_engine_core']} for the engine core here)"
        )
    fast = data["paged_ref_fast"] or "the eager step"
    w = data["warmup"]
    print(
        f"paged_ref: fast={fast}, torch.set_num_threads(n); warm-up on both sides: the first {w['requests']} "
        f"requests, {w['new']} tokens each; {data['pairs']} alternating pair(s) per cell (paged_ref first)"
    )
    rows = [{**r, "paired": " ".join(f"{x:.2f}" for x in r["ratio_paired"])} for r in data["summary"]]
    print(table(PAIR_COLUMNS, rows))
    for c in data.get("in_process_checks", []):
        t = c["tokens"]
        print(
            f"vLLM eager_in_process, {c['threads']} thread(s), {c['blocks']} blocks, {c['workload']}: "
            f"identical tokens {t['requests_identical']}/{t['requests']}, "
            f"preemptions {c['paged_ref_preemptions']} (paged_ref) vs {c['vllm_preemptions']} (vLLM)"
        )


PAIR_COLUMNS = [
    ("threads", "{threads}"),
    ("blocks", "{blocks}"),
    ("workload", "{workload}"),
    ("vLLM", "{vllm_mode}"),
    ("ratio", "{ratio_median:.2f}x"),
    ("pairs", "{paired}"),
    ("tok/s ours/vLLM", "{paged_ref_tokens_per_s:.1f}/{vllm_tokens_per_s:.1f}"),
    ("same tokens", "{requests_identical_min}/{requests}"),
    ("agree", "{tokens_before_first_difference_min:.1%}"),
    ("ours: busy, CPU s/s", "{paged_ref_busy_threads}, {paged_ref_cpu_s_per_wall_s:.2f}"),
    ("vLLM busy: worker, others", "{vllm_worker_busy_threads}, {vllm_other_busy_threads}"),
    ("vLLM, all processes: CPU s/s", "{vllm_cpu_s_per_wall_s:.2f}"),
]
