"""Where the second thread goes (``bench serve --profile --all-threads``): the fast step at 1 thread and at
every core, by operation, and the weight stream against a plain read of memory.

One process sets torch's threads (``torch.set_num_threads``: OpenMP's, which oneDNN, MKL and the C++
kernels' ``at::parallel_for`` run on) to each count in turn; every measurement takes its thread counts
in alternating order (1, n, then n, 1, ...) and keeps the median over rounds:

- **Throughput**: the engine with the fast options (`._serve_profile.VARIANTS`' last) serves the
  profile's workload (all requests at once); generated tokens per second of busy step time. The
  speed-up is the median of the per-round ratios (each round runs every thread count once); every
  run's tokens are compared with the first run's (``same_tokens_as_first``). Each step's tokens and time are
  kept: with the same tokens every run serves the same steps, so the busy time by the tokens a step feeds
  (`by_tokens`) gives, bin by bin, the share of a run's time and the speed-up on the same work.
- **Parts of a step**: `torch.profiler` around decode steps (every row one new token) and mixed steps
  (decode rows beside a prompt chunk) after a warm-up, self CPU time by `PARTS` (the linear products:
  the few-rows kernel for decode steps, oneDNN for a step's prompt tokens; attention; norms, RoPE and
  SwiGLU; cache writes; sampling), the other ops, and the host's Python (the step's wall time under the
  profiler less all its ops' self time), each in ms per step, the step's linear products by rows.
- **Weight stream**: every product of a decode step (all layers, fused as ``prepack`` fuses them, and
  the LM head) at a full decode step's rows (``max_num_seqs``) and at 1 row through the kernel a
  decode step runs with AVX-512 (`paged_ref.fast.prepack.few_rows_kernel`; without AVX-512 a step of more
  than `paged_ref.fast.prepack.kernel_rows` rows runs oneDNN), weights streamed from memory: the bytes
  of weights over the time (the best of ``repeats``); against a plain read: ``sum()`` of the same
  weights as one float32 tensor (at least 4x the last-level cache), the best of ``repeats``, the read and the
  streams taking turns. The stream's share of the read is taken in each round, and the summary keeps the median
  of the rounds' shares, as it keeps the median of the rounds' throughput ratios: the read's rate moves between
  rounds (other tenants of the machine), so the best stream over the best read would pair rounds apart.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from ...fast.prepack import few_rows_kernel, stream_layout
from ._serve_profile import PROFILE_WORKLOAD, VARIANTS, _engine, _kind

__all__ = ["OPENMP_ENV", "PARTS", "by_tokens", "last_level_cache_bytes", "run_threads", "step_parts", "throughput"]
__all__ += ["weight_stream"]

#: part of a step -> the ops or named regions whose time (their own ops included) it is; the rest of the
#: ops' self time is "other ops", the step's wall time past all ops' self time "python" (the host's)
PARTS = {
    "linear products": ("paged_ref_linear::few_rows", "mkldnn::_linear_pointwise", "aten::linear"),
    "attention": ("paged_ref::attention",),  # `paged_ref.hf.attention`'s named region
    "norms, RoPE, SwiGLU": ("paged_ref_cpu::add_norm", "paged_ref_cpu::rotate", "paged_ref_cpu::silu_mul"),
    "cache writes": ("paged_ref::cache_write",),  # `PagedCache.update`'s named region
    "sampling": ("aten::argmax",),
}
#: the environment that sets how OpenMP's threads wait between parallel regions and where they run, read once when
#: the runtime loads (before torch is imported): ``OMP_WAIT_POLICY=ACTIVE`` keeps them spinning; unset, they spin
#: a while, then sleep
OPENMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")
_FAST = VARIANTS["few_rows"][0]
_QUICK = dict(requests=10, mean_output=12, page_size=4, num_pages=64, max_num_seqs=8, max_batched_tokens=32, steps=2)


def last_level_cache_bytes() -> int | None:
    """The last-level cache of CPU 0 (Linux's sysfs), or None where it is not listed."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        text = (index / "size").read_text().strip() if (index / "size").exists() else ""
        if text[:-1].isdigit():
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1))
    return max(sizes) if sizes else None


def throughput(model, cfg, requests) -> tuple[float, list[list[int]], list[list]]:
    """Generated tokens per second of busy step time, the tokens, and each step's ``[tokens fed, seconds]``: the
    fast engine serving ``requests`` at once."""
    engine = _engine(model, cfg, _FAST)
    for prompt, new in requests:
        engine.add_request(prompt, max_new_tokens=new)
    outs = engine.run()
    engine.close()
    steps = [[h.tokens, h.step_s] for h in engine.history]
    return sum(len(o.token_ids) for o in outs) / sum(s for _, s in steps), [o.token_ids for o in outs], steps


def _bin(tokens: int) -> str:
    """`by_tokens`' bin of a step feeding ``tokens``: the power of two at or below, up to the next (512 up: one)."""
    low = 1 << (tokens.bit_length() - 1)
    return str(low) if low == 1 else f"{low}+" if low >= 512 else f"{low}-{2 * low - 1}"


def by_tokens(steps: list[list]) -> dict[str, float]:
    """Seconds of ``steps`` (``[tokens fed, seconds]`` each) by the tokens a step feeds, in bins of powers of two
    (a step of few tokens reads every weight for little arithmetic, a step of many computes):

    >>> by_tokens([[1, 0.5], [3, 0.25], [2, 0.25], [32, 1.0], [40, 2.0], [512, 1.0]])
    {'1': 0.5, '2-3': 0.5, '32-63': 3.0, '512+': 1.0}
    """
    bins = {}
    for tokens, seconds in steps:
        label = _bin(tokens)
        bins[label] = bins.get(label, 0.0) + seconds
    return dict(sorted(bins.items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+"))))


def step_parts(model, cfg, requests) -> dict:
    """``{"decode" | "mixed": {"ms_per_step": {part: ms}, "step_ms", "rows"}}``: the fast engine's steps
    under the profiler, each part's time (`PARTS`, "other ops", "python") averaged over its steps; ``rows``:
    each step's rows of the linear products (its tokens)."""
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(model, cfg, _FAST)
    for prompt, new in requests:
        engine.add_request(prompt, max_new_tokens=new)
    sums = {"decode": {}, "mixed": {}}
    rows = {"decode": [], "mixed": []}
    while engine.has_unfinished_requests() and min(map(len, rows.values())) < cfg["steps"]:
        if len(engine.history) < cfg["warmup"]:
            engine.step()
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            engine.step()
            wall_us = (time.perf_counter() - started) * 1e6
        kind = _kind(engine.history[-1])
        if kind is None or len(rows[kind]) >= cfg["steps"]:
            continue
        rows[kind].append(engine.history[-1].tokens)
        events = prof.key_averages()
        ops_us = sum(e.self_cpu_time_total for e in events)
        parts = {p: sum(e.cpu_time_total for e in events if e.key in ops) for p, ops in PARTS.items()}
        parts["other ops"] = ops_us - sum(parts.values())
        parts["python"] = max(0.0, wall_us - ops_us)
        for p, us in parts.items():
            sums[kind][p] = sums[kind].get(p, 0.0) + us
    engine.close()
    out = {}
    for kind, parts in sums.items():
        if rows[kind]:
            ms = {p: us / len(rows[kind]) / 1e3 for p, us in parts.items()}
            out[kind] = {"ms_per_step": ms, "step_ms": sum(ms.values()), "rows": rows[kind]}
    return out


def _step_weights(model) -> list[torch.Tensor]:
    """Every weight a decode step reads in a product, fused as ``prepack`` fuses them: [out, in] each."""
    weights = [model.get_output_embeddings().weight.detach()]  # [vocab, hidden]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight]
        weights += [torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
    return [w.detach().contiguous() for w in weights]


def weight_stream(weights, streams, flat, rows: tuple, repeats: int) -> dict:
    """At the current thread count: ``{"read_gb_per_s", "rows": {m: {"ms", "gb_per_s", "of_read"}}}``
    (the weights' bytes over the best of ``repeats`` times, the plain read and each stream taking turns;
    ``of_read``: the share of the plain read's rate)."""
    few = few_rows_kernel()
    gb = flat.numel() * flat.element_size() / 1e9
    x = {m: [torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights] for m in rows}  # [m, in] per product
    times = {"read": [], **{m: [] for m in rows}}
    for _ in range(repeats):  # the read, then each stream, then again: each sees the memory as the others do
        times["read"].append(_timed(flat.sum))
        for m in rows:
            times[m].append(_timed(lambda: [few(a, s, w.shape[0]) for a, s, w in zip(x[m], streams, weights)]))
    best = min(times["read"])
    out = {"read_gb_per_s": gb / best, "rows": {}}
    for m in rows:
        t = min(times[m])
        out["rows"][str(m)] = {"ms": t * 1e3, "gb_per_s": gb / t, "of_read": best / t}
    return out


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run_threads(model, requests_fn, *, quick: bool, counts: list[int], rounds: int, save) -> dict:
    """Every measurement of the module docstring at each of ``counts`` threads, ``rounds`` rounds in
    alternating order; ``save(data)`` stores the JSON as parts finish. Torch's thread count is restored."""
    cfg = {**PROFILE_WORKLOAD, **(_QUICK if quick else {})}
    lengths = {k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")}
    requests = requests_fn(**lengths)
    before = torch.get_num_threads()
    weights = _step_weights(model)
    streams = [stream_layout(w) for w in weights]  # [ceil(out / 64), in, 64] each
    flat = torch.cat([w.flatten() for w in weights])  # every weight, to time a plain read of them
    llc = last_level_cache_bytes()
    parallel = [line for line in torch.__config__.parallel_info().splitlines() if "parallel backend" in line]
    data = {
        "config": cfg,
        "options": _FAST.options(),
        "thread_counts": counts,
        "rounds": rounds,
        "cores": os.cpu_count(),
        "parallel_backend": parallel[0].split(":", 1)[1].strip() if parallel else None,
        "openmp_env": {k: os.environ.get(k) for k in OPENMP_ENV},
        "weights_gb": flat.numel() * flat.element_size() / 1e9,
        "last_level_cache_bytes": llc,
        "plain_read": "sum() of every product's weights as one float32 tensor, the best of a round's repeats, "
        "taking turns with the streams; a stream's share of it (of_read) is taken in each round, the summary's the "
        "median of the rounds' shares",
        "load_before": os.getloadavg(),
        "threads": {
            str(t): {"torch_threads": None, "tokens_per_s": [], "steps": [], "parts": [], "stream": []} for t in counts
        },
    }
    few_rows, first = (1, cfg["max_num_seqs"]), None  # first: the tokens of the first run
    try:
        for r in range(rounds):
            for t in counts if r % 2 == 0 else counts[::-1]:
                torch.set_num_threads(t)
                d = data["threads"][str(t)]
                d["torch_threads"] = torch.get_num_threads()
                rate, tokens, steps = throughput(model, cfg, requests)
                d["tokens_per_s"].append(rate)
                d["steps"].append(steps)
                first = first or tokens
                d["same_tokens_as_first"] = d.get("same_tokens_as_first", True) and tokens == first
                d["parts"].append(step_parts(model, cfg, requests))
                d["stream"].append(weight_stream(weights, streams, flat, few_rows, repeats=3 if quick else 5))
            save(data)
    finally:
        torch.set_num_threads(before)
    data["load_after"] = os.getloadavg()
    data["summary"] = summarize(data)
    save(data)
    return data


def _median_parts(runs: list[dict], kind: str) -> dict:
    runs = [r[kind] for r in runs if kind in r]
    parts = {p: statistics.median(r["ms_per_step"][p] for r in runs) for p in runs[0]["ms_per_step"]}
    return {"ms_per_step": parts, "step_ms": statistics.median(r["step_ms"] for r in runs), "rows": runs[0]["rows"]}


def _steps_by_tokens(runs: list[list], base: list[list]) -> dict:
    """Each bin of `by_tokens`: its share of a run's busy time and its speed-up over ``base`` (the runs of the first
    thread count), medians over rounds of per-round values; every run serves the same steps (its tokens equal)."""
    bins, base_bins = [by_tokens(r) for r in runs], [by_tokens(r) for r in base]
    return {
        label: {
            "steps": sum(1 for tokens, _ in runs[0] if _bin(tokens) == label),
            "share": statistics.median(b[label] / sum(b.values()) for b in bins),
            "speedup": statistics.median(a[label] / b[label] for a, b in zip(base_bins, bins)),
        }
        for label in bins[0]
    }


def summarize(data: dict) -> dict:
    """Medians over rounds at each thread count, and each count's speed-up over the first (1 thread):
    throughput (median of per-round ratios), its steps by tokens (`by_tokens`), each part of a decode and a mixed
    step, the plain read's and the weight stream's rates, and the stream's share of the read (median of per-round
    shares)."""
    counts = [str(t) for t in data["thread_counts"]]
    base = data["threads"][counts[0]]
    out = {}
    for t in counts:
        d = data["threads"][t]
        s = {
            "tokens_per_s": statistics.median(d["tokens_per_s"]),
            "speedup": statistics.median(a / b for a, b in zip(d["tokens_per_s"], base["tokens_per_s"])),
            "read_gb_per_s": statistics.median(x["read_gb_per_s"] for x in d["stream"]),
        }
        s["stream"] = {
            m: {k: statistics.median(x["rows"][m][k] for x in d["stream"]) for k in ("gb_per_s", "of_read")}
            for m in d["stream"][0]["rows"]
        }
        s["steps_by_tokens"] = _steps_by_tokens(d["steps"], base["steps"])
        for kind in ("decode", "mixed"):
            if all(kind in p for p in d["parts"]):
                s[kind] = _median_parts(d["parts"], kind)
                b = _median_parts(base["parts"], kind)["ms_per_step"]
                s[kind]["speedup"] = {p: (b[p] / ms if ms else None) for p, ms in s[kind]["ms_per_step"].items()}
                linear_ms = s[kind]["ms_per_step"]["linear products"]
                s[kind]["weight_stream_gb_per_s"] = data["weights_gb"] / linear_ms * 1e3 if linear_ms else None
        out[t] = s
    return out
