"""Decode latency and KV memory vs context: no cache, a contiguous cache, and the paged cache.

    python -m paged_ref.lab.bench scaling --cpu [--quick] [--model smollm2|tiny] [--threads N] [--out DIR]
    python -m paged_ref.lab.bench scaling --gpu [--quick] [--model llama1b|smollm2] [--out DIR]

On one model and the same tokens, in one run:

1. Per-token decode latency vs context, batch 1 (`_scaling_latency`), of no cache,
   ``DynamicCache``, ``StaticCache`` and the paged cache with each backend; on CPU the decoders take
   turns step by step and each ratio to ``DynamicCache`` is the median of the ratios of steps taken
   in the same round (``ratio_kind``); on CPU the Triton kernel runs in its interpreter: checked, not timed.
   GPU: the decoders run one after another (each point also records the peak device memory of its
   decoder alone), ratios of medians; also a 100k-token sequence, paged only.
2. A mixed-length batch in one KV budget (`_scaling_batch`): requests admitted and tokens/s under
   a contiguous max-length reservation vs the paged pool.
3. Memory: KV bytes held (CPU) or peak device memory (GPU) against tokens held x bytes per token;
   the paged overhead at page size 16 (goal <= 5%); a page-size sweep of overhead and attention time
   (flex both as called alone and with its BlockMask built once and reused, as a model's layers share it).
4. A growing-context chat with and without prefix caching (`_scaling_chat`).
5. The latency of every page operation of every paged pool in the run (median, p99).

Greedy predictions of every decoder are compared with ``DynamicCache``'s position by position.
Output: tables and ``figures/data/scaling_{cpu,gpu}.json`` (``_threads{N}`` with ``--threads N``,
``_quick`` in quick mode) with the environment. ``--time-budget`` (default 220 s on GPU) skips sections
that would start later and records them.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback
from dataclasses import replace

import torch

from ...attention.flex import flex_paged_decode
from ...attention.reference import reference_paged_decode
from ...attention.triton_decode import interpreted, triton_paged_decode
from ...memory import model_geometry
from ._scaling_batch import batch_throughput, page_size_sweep
from ._scaling_chat import run_chat
from ._scaling_latency import LABELS, LadderConfig, agreement, run_ladder, run_ladders
from ._scaling_models import MODELS, build_model, prompt_ids
from .common import bench_parser, command_line, environment, result_file
from .scaling_report import (
    alloc_summary,
    mixed_lengths,
    paged_overhead,
    print_model_report,
    ratio_kind,
    ratio_pairs,
    ratios_to,
)

__all__ = ["main", "PROFILES", "run_model"]

_POW2 = lambda lo, hi: [1 << k for k in range(lo.bit_length() - 1, hi.bit_length())]  # noqa: E731

#: What each (device, mode) runs. ``ladder``: timed decoders; ``check``: run once at the first
#: context for predictions only (Triton's interpreter on CPU).
PROFILES = {
    ("cpu", "full"): dict(
        # the decoders take turns step by step: 25 pairs per point with DynamicCache, enough for a median
        # that moves less than the gaps it is read for on a shared 2-core machine; no cache pays a whole
        # prefill per step, so it takes 5
        models=["smollm2"],
        contexts=_POW2(128, 2048),
        in_turns=True,
        warmup=2,
        steps=25,
        nocache_steps=5,
        prefill_chunk=2048,
        ladder=["dynamic", "none", "static", "sdpa", "reference", "flex"],
        check=["triton"],
        long=None,
        batch=dict(
            num=64, max_len=1024, mean_len=192, budget_tokens=4096, steps=5, warmup=1, backends=["sdpa", "reference"]
        ),
        chat=dict(turns=6, user_tokens=96, reply_tokens=8, backend="reference"),
        sweep=dict(page_sizes=_POW2(8, 256), backends=["reference", "flex"], repeats=5),
    ),
    ("cpu", "quick"): dict(
        models=["smollm2"],
        contexts=[128, 512],
        in_turns=True,
        warmup=1,
        steps=3,
        nocache_steps=3,
        prefill_chunk=2048,
        ladder=["dynamic", "none", "sdpa", "reference", "flex"],
        check=["triton"],
        long=None,
        batch=dict(num=32, max_len=512, mean_len=128, budget_tokens=1024, steps=2, warmup=1, backends=["reference"]),
        chat=dict(turns=3, user_tokens=48, reply_tokens=4, backend="reference"),
        sweep=dict(page_sizes=_POW2(8, 256), backends=["reference", "flex"], repeats=2),
    ),
    ("gpu", "full"): dict(
        models=["llama1b", "smollm2"],
        contexts=_POW2(128, 32768),
        warmup=3,
        steps=10,
        nocache_steps=3,
        # most important first: the time budget skips what comes last
        prefill_chunk=1024,
        ladder=["dynamic", "triton", "flex", "none", "static"],
        check=[],
        long=100_000,
        batch=dict(
            num=256, max_len=8192, mean_len=1024, budget_tokens=65536, steps=10, warmup=3, backends=["triton", "flex"]
        ),
        chat=dict(turns=8, user_tokens=256, reply_tokens=32, backend="triton"),
        sweep=dict(page_sizes=_POW2(8, 256), backends=["triton", "flex"], repeats=20),
    ),
    ("gpu", "quick"): dict(
        models=["llama1b"],
        contexts=[128, 2048, 32768],
        warmup=3,
        steps=8,
        nocache_steps=2,
        prefill_chunk=1024,
        ladder=["dynamic", "triton", "flex", "none"],
        check=[],
        long=None,
        batch=dict(num=128, max_len=8192, mean_len=1024, budget_tokens=32768, steps=5, warmup=2, backends=["triton"]),
        chat=dict(turns=4, user_tokens=256, reply_tokens=16, backend="triton"),
        sweep=dict(page_sizes=[16, 64, 256], backends=["triton", "flex"], repeats=10),
    ),
}
#: The tiny test model: same sections, small numbers (tiny_llama's context limit is 1024).
TINY = dict(
    contexts=[32, 64],
    warmup=1,
    steps=2,
    nocache_steps=1,
    prefill_chunk=256,
    overrides={},
    batch=dict(num=32, max_len=256, mean_len=64, budget_tokens=512, steps=2, warmup=1, backends=["reference"]),
    chat=dict(turns=3, user_tokens=24, reply_tokens=3, backend="reference"),
    sweep=dict(page_sizes=[8, 16, 256], backends=["reference"], repeats=1),
)

DECODE_FUNCTIONS = {"reference": reference_paged_decode, "flex": flex_paged_decode, "triton": triton_paged_decode}
PAGE_SIZE = 16


class _Clock:
    """Deadline bookkeeping for ``--time-budget``."""

    def __init__(self, budget_s: float | None):
        self.start = time.monotonic()
        self.deadline = None if budget_s is None else self.start + budget_s

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _failures(res: dict, what: str, ladders: list[dict]) -> list[dict]:
    """``ladders``, each decoder that failed partway (`run_ladders`' ``"error"``) named in ``res["errors"]``;
    what it measured before it failed stays."""
    res["errors"] += [f"{what} {r['backend']}: {r['error']}" for r in ladders if "error" in r]
    return ladders


def _guarded(res: dict, what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None with the error in ``res["errors"]``: one failure must not lose a run."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - recorded and printed, never swallowed silently
        res["errors"].append(f"{what}: {type(err).__name__}: {err}")
        _log(f"[scaling] ERROR in {what}:\n{traceback.format_exc()}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def run_model(model_name: str, profile: dict, *, device, clock: _Clock, checkpoint=None) -> dict:
    """All sections for one model; returns its result dict (see the module docstring).
    ``checkpoint(res)``, if given, receives the result dict after each section, to be saved."""
    t0 = time.monotonic()
    model, info = build_model(model_name, device=device)
    geom = model_geometry(model)
    res = {"model": {k: v for k, v in info.items() if k != "tokenizer"}, "skipped": [], "errors": []}
    res["model"]["load_s"] = time.monotonic() - t0
    res["kv_bytes_per_token"] = geom.bytes_per_token
    chunk = profile["prefill_chunk"]
    steps = dict(warmup=profile["warmup"], steps=profile["steps"])
    shared = dict(prefill_chunk=chunk, page_size=PAGE_SIZE)
    ladder_cfg = LadderConfig(profile["contexts"], **steps, nocache_steps=profile["nocache_steps"], **shared)
    long = profile.get("long")
    need = max(ladder_cfg.tokens_needed(), (long or 0) + 64, profile["batch"]["max_len"] + 1)
    prompt = prompt_ids(model, info, need)
    interpreter = interpreted(torch.device(device))  # Triton on CPU: checked in the ladder, never timed

    def timed_here(names):
        return [n for n in names if not (n == "triton" and interpreter)]

    def section(what: str, need_s: float, log: str, fn, *args, **kwargs):
        """`_guarded` ``fn(*args, **kwargs)``, or None and ``what`` skipped with under ``need_s`` s left."""
        if clock.left() < need_s:
            res["skipped"].append(what)
            return None
        _log(f"[scaling] {model_name}: {log}")
        return _guarded(res, what, fn, *args, **kwargs)

    def save():
        if checkpoint is not None:
            checkpoint(res)

    # 1. latency ladder, then the check-only decoders (first context, 2 untimed steps)
    res["ladder"] = []
    cfgs = {n: replace(ladder_cfg, **profile.get("overrides", {}).get(n, {})) for n in profile["ladder"]}
    if profile.get("in_turns"):
        log = f"ladder, in turns: {', '.join(LABELS[n] for n in cfgs)}"
        r = section("ladder", 20, log, run_ladders, model, cfgs, prompt, deadline=clock.deadline)
        res["ladder"] += _failures(res, "ladder", r or [])
    for name, cfg in cfgs.items() if not profile.get("in_turns") else ():
        what, log = f"ladder {name}", f"ladder {LABELS[name]}"
        r = section(what, 20, log, run_ladder, model, name, prompt, cfg, deadline=clock.deadline)
        res["ladder"] += _failures(res, "ladder", [r] if r is not None else [])
    for name in profile["check"]:
        cfg = LadderConfig(ladder_cfg.contexts[:1], warmup=0, steps=2, timed=False, **shared)
        _log(f"[scaling] {model_name}: {LABELS[name]} (interpreter: predictions only, not timed)")
        r = _guarded(res, f"check {name}", run_ladder, model, name, prompt, cfg)
        res["ladder"] += _failures(res, "check", [r] if r is not None else [])
    base = LABELS["dynamic"]
    res["ratio_base"] = base
    res["ratios"] = ratios_to(res["ladder"], base)
    res["ratio_kind"] = ratio_kind(res["ladder"], base)
    res["ratio_pairs"] = ratio_pairs(res["ladder"], base)
    res["agreement"] = agreement(sorted(res["ladder"], key=lambda r: r["label"] != base))
    save()

    # 1b. one long sequence, paged backends only
    res["long"] = []
    paged = [n for n in profile["ladder"] if n in DECODE_FUNCTIONS] if long else []
    for name in paged:
        cfg = LadderConfig([long], **steps, **shared)
        log = f"{long}-token sequence, {LABELS[name]}"
        r = section(f"long {name}", 60, log, run_ladder, model, name, prompt, cfg, deadline=clock.deadline)
        res["long"] += _failures(res, "long", [r] if r is not None else [])
        save()

    # 2-3. mixed batch and its paged overhead at PAGE_SIZE
    b = profile["batch"]
    lengths = mixed_lengths(b["num"], max_len=b["max_len"] - b["warmup"] - b["steps"] - 1, mean_len=b["mean_len"])
    kwargs = {k: b[k] for k in ("budget_tokens", "max_len", "steps", "warmup")}
    kwargs.update(page_size=PAGE_SIZE, paged_backends=timed_here(b["backends"]), prefill_chunk=chunk)
    batch = section("batch", 30, "mixed batch", batch_throughput, model, prompt, lengths, **kwargs)
    if batch is not None:
        batch.update(
            num_requests=len(lengths),
            mean_len=sum(lengths) / len(lengths),
            max_len=b["max_len"],
            budget_tokens=b["budget_tokens"],
            page_size=PAGE_SIZE,
            lengths=lengths,
            overhead_ps16=paged_overhead(lengths[: batch["fit"]["paged_allocator"]], page_size=PAGE_SIZE),
            overhead_ps16_workload=paged_overhead(lengths, page_size=PAGE_SIZE),
        )
        res["batch"] = batch
    save()

    # 4. growing chat, without and with prefix caching
    c = profile["chat"]
    if clock.left() < 30:
        res["skipped"].append("chat")
    else:
        _log(f"[scaling] {model_name}: growing-context chat")
        span = max(1, prompt.numel() - c["user_tokens"])
        users = [prompt[1000 * t % span :][: c["user_tokens"]] for t in range(c["turns"])]
        backend = "reference" if c["backend"] == "triton" and interpreter else c["backend"]
        kwargs = dict(reply_tokens=c["reply_tokens"], page_size=PAGE_SIZE, backend=backend, prefill_chunk=chunk)
        runs = [
            _guarded(res, f"chat prefix_caching={pc}", run_chat, model, users, prefix_caching=pc, **kwargs)
            for pc in (False, True)
        ]
        if None not in runs:
            res["chat"] = {
                "runs": runs,
                "user_tokens": c["user_tokens"],
                "reply_tokens": c["reply_tokens"],
                "replies_identical": runs[0]["replies"] == runs[1]["replies"],
            }
    save()

    # 3b. page-size sweep over the admitted batch
    s = profile["sweep"]
    admitted = lengths[: res["batch"]["fit"]["paged_allocator"]] if "batch" in res else lengths[:8]
    backends = {n: DECODE_FUNCTIONS[n] for n in timed_here(s["backends"])}
    kwargs = dict(geometry=geom, backends=backends, repeats=s["repeats"], deadline=clock.deadline)
    sweep = section("sweep", 20, "page-size sweep", page_size_sweep, admitted, s["page_sizes"], **kwargs)
    if sweep is not None:
        res["sweep"] = sweep

    # 5. allocation latency over every paged pool of the run
    pools = res["ladder"] + res["long"] + list(res.get("batch", {}).get("paged", {}).values())
    pools += res.get("chat", {}).get("runs", [])
    res["alloc"] = alloc_summary([call for r in pools for call in r.get("alloc_calls", [])])
    res = _without_bulk(res)
    res["elapsed_s"] = time.monotonic() - t0
    model = None  # free the weights before the next model loads
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return res


def _without_bulk(res: dict) -> dict:
    """A copy of a model's result without the raw per-call timings and predictions."""

    def slim(rows):
        return [{k: v for k, v in r.items() if k not in ("alloc_calls", "predictions")} for r in rows]

    view = {**res, "ladder": slim(res.get("ladder", [])), "long": slim(res.get("long", []))}
    if "batch" in res:
        paged = res["batch"]["paged"]
        view["batch"] = {**res["batch"], "paged": dict(zip(paged, slim(paged.values())))}
    if "chat" in res:
        view["chat"] = {**res["chat"], "runs": slim(res["chat"]["runs"])}
    return view


def main(argv=None) -> dict:
    parser = bench_parser("scaling", __doc__)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--cpu", action="store_true", help="run on the CPU (default without CUDA)")
    where.add_argument("--gpu", action="store_true", help="run on the CUDA GPU (default with CUDA)")
    parser.add_argument("--quick", action="store_true", help="fewer contexts and steps (CI, first GPU look)")
    parser.add_argument("--model", choices=MODELS, help="run one model instead of the profile's (tiny: the test model)")
    parser.add_argument(
        "--time-budget", type=float, help="seconds; sections that would start later are skipped (default 220 on GPU)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's choice); given, the JSON's name ends in _threads{N}",
    )
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    gpu = args.gpu or (not args.cpu and torch.cuda.is_available())
    if gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device; use --cpu")
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, gpu, parser)
    finally:
        torch.set_num_threads(threads)


def _run(args, argv, gpu, parser) -> dict:
    kind = "gpu" if gpu else "cpu"
    profile = dict(PROFILES[(kind, "quick" if args.quick else "full")])
    if args.model is not None:
        profile["models"] = [args.model]
    if args.model == "tiny":
        profile.update(copy.deepcopy(TINY))
    budget = args.time_budget if args.time_budget is not None else (220.0 if gpu else None)
    threads = f"_threads{args.threads}" if args.threads is not None else ""  # apart from the run at torch's default
    filename = f"scaling_{kind}{threads}{'_quick' if args.quick and args.out is None else ''}.json"
    result = result_file(parser, args.out, filename)  # checked before anything is measured
    clock = _Clock(budget)
    device = torch.device("cuda" if gpu else "cpu")
    data = {
        "benchmark": "scaling",
        "device": kind,
        "quick": args.quick,
        "command": command_line("scaling", argv),
        "environment": environment(),
        "torch_threads": torch.get_num_threads(),
        "page_size": PAGE_SIZE,
        "time_budget_s": budget,
        "load_before": list(os.getloadavg()),
        "models": {},
    }
    result.save(data)
    for name in profile["models"]:
        if clock.left() < 30:
            data.setdefault("skipped_models", []).append(name)
            continue
        errors = {"errors": []}

        def checkpoint(res, name=name):
            data["models"][name] = _without_bulk(res)
            result.save(data)

        res = _guarded(
            errors, f"model {name}", run_model, name, profile, device=device, clock=clock, checkpoint=checkpoint
        )
        if res is None:
            data.setdefault("errors", []).extend(errors["errors"])  # the sections it finished stay
            result.save(data)
            continue
        data["models"][name] = res
        result.save(data)
        print_model_report(name, res)
    data["elapsed_s"] = time.monotonic() - clock.start
    data["load_after"] = list(os.getloadavg())
    path = result.save(data, complete=True)
    shown = path.name if args.out is not None else f"figures/data/{path.name}"  # no local paths in outputs
    print(f"\nwrote {shown} ({data['elapsed_s']:.0f} s)")
    return data


if __name__ == "__main__":
    main()
