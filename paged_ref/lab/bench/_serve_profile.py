"""Where a serving step's time goes (``bench serve --profile``): a profile by op, then each speed-up's gain.

The engine serves a reduced offline workload (all requests at once) once per variant of `VARIANTS`,
each adding one speed-up to the one before (a field of `paged_ref.fast.Fast`, the engine's ``fast=``):
``eager`` (the lesson's path: ``sdpa`` attention, ``F.linear``), ``prepacked_linears``
(``prepack=True``: oneDNN-packed weights, q/k/v and gate/up each one product), ``paged_kernel``
(``backend="cpu_paged"``: attention reading the pages in place, a step's decode rows and prompt
chunks in one call), ``flat_forward`` (``flat=True``: the layers as one loop, without transformers'
module calls), ``cpu_ops`` (``cpu_ops=True``: the loop's norms, RoPE and SwiGLU in C++),
``few_rows`` (``few_rows=True``: products of at most ``max_num_seqs`` rows, and of no more than this
CPU's `paged_ref.fast.prepack.kernel_rows`, through a kernel that reads each weight once, block by block).

- **Profile**: `torch.profiler` around single engine steps, kept for the first ``steps`` decode steps
  (every row one new token) and mixed steps (decode rows next to a prompt chunk) after a warm-up;
  a table of ops by self CPU time, summed over those steps, with each op's share and calls per step,
  and the step's parts (`GROUPS`: linear layers, attention, cache writes, ...) by inclusive time.
- **Gain**: two engines, a variant and the one before it, take turns step by step (which goes first
  alternates), on the same requests; their schedules are the same because their tokens are, so step
  ``i`` of one does the work of step ``i`` of the other. The gain is the median of the per-step
  ratios of step time (before / after), over decode and mixed steps separately, and the ratio of
  total busy time; tokens are compared request by request.
- **Linear libraries** (`linear_libraries`): one layer's products at a decode step's and a prompt
  chunk's number of rows through ``F.linear`` (the BLAS), oneDNN with a prepacked weight (laid out
  with no row count, then for ``prepack``'s row count), MKL with a prepacked weight (what inductor's
  freezing packs float32 weights for when torch has MKL), and oneDNN on q/k/v and gate/up fused into
  one product each, laid out for that row count (what ``prepack=True`` runs).
- **Few rows** (`few_rows_products`): every product of a step (all layers, fused as ``prepack``
  fuses them, and the LM head), weights streamed from memory as in a serving step, at 1 to 64 rows
  (the engine sends it up to ``max_num_seqs``, 32): oneDNN's prepacked weights against `paged_ref.fast.prepack`'s
  one-stream kernel, with the rate each reads the weights at and the rate this core reads memory (a
  sum over all of them).
- **Checks** (`native_checks`): what the native ops' argument checks cost in a decode step of the last
  variant: each op's checks alone (its ``*_checks`` entry: the same C++ as the op runs first) and the
  whole op, timed in turns on a decode step's arguments (``max_num_seqs`` rows; the block table's
  every entry in use, one pass over them), times its calls per step, against the step's time in the
  profile.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ...fast import Fast
from ...fast.prepack import PACK_FOR_ROWS, few_rows_kernel, stream_layout
from ...serve import VLLM_ADMISSION, Engine

__all__ = ["VARIANTS", "PROFILE_WORKLOAD", "linear_libraries", "native_checks", "profile_variant", "paired_gain"]
__all__ += ["few_rows_products", "rows_ahead", "run_profile"]

#: name -> (the engine's ``fast=``, what it adds), each variant on top of the one before.
VARIANTS = {
    "eager": (Fast(backend="sdpa"), "the lesson's path: sdpa attention (gather, mask, matmul, softmax), F.linear"),
    "prepacked_linears": (
        Fast(backend="sdpa", prepack=True),
        "linear layers through weights packed once for oneDNN, q/k/v and gate/up each one product",
    ),
    "paged_kernel": (
        Fast(backend="cpu_paged", prepack=True),
        "decode attention in a C++ kernel reading K/V where the pages lie (no gather, no padding)",
    ),
    "flat_forward": (
        Fast(backend="cpu_paged", prepack=True, flat=True),
        "the model's layers as one flat loop: transformers' operations without its module calls",
    ),
    "cpu_ops": (
        Fast(backend="cpu_paged", prepack=True, flat=True, cpu_ops=True),
        "the flat loop's residual adds and norms, RoPE and SwiGLU each one C++ kernel, as vLLM's CPU ops",
    ),
    "few_rows": (
        Fast(backend="cpu_paged", prepack=True, few_rows=True, flat=True, cpu_ops=True),
        "products of at most max_num_seqs rows through a C++ kernel reading each weight once, block by block",
    ),
}

#: The reduced workload: ``bench serve``'s lengths, fewer and shorter requests, the issue's engine sizes.
PROFILE_WORKLOAD = dict(
    requests=48,
    mean_prompt=32,
    mean_output=32,
    sigma=1.0,
    min_prompt=8,
    max_model_len=512,
    page_size=32,
    num_pages=256,
    max_num_seqs=32,
    max_batched_tokens=512,
    steps=3,  # profiled steps of each kind
    warmup=2,  # steps before the first profiled one
)
_QUICK = dict(requests=10, mean_output=12, page_size=4, num_pages=64, max_num_seqs=8, max_batched_tokens=32, steps=2)
_TOP = 14  # ops listed by name; the rest are summed as "other"

#: The parts of a step, each the inclusive time of one region or op (its own ops included); the rest
#: of the step's self time is "other" (norms, RoPE, residual adds, the engine's host work).
GROUPS = {
    "linear layers": ("aten::linear", "mkldnn::_linear_pointwise", "paged_ref_linear::few_rows"),  # eager; packed
    "attention": ("paged_ref::attention",),  # `paged_ref.hf.attention`'s named region
    "cache writes": ("paged_ref::cache_write",),  # `PagedCache.update`'s named region
    "mlp activation": ("aten::silu", "paged_ref_cpu::silu_mul"),
}


def _engine(model, cfg, fast: Fast) -> Engine:
    sizes = {k: cfg[k] for k in ("num_pages", "page_size", "max_num_seqs", "max_batched_tokens", "max_model_len")}
    return Engine(model, eos_token_id=[], clock="real", reservation=VLLM_ADMISSION, fast=fast, **sizes)


def _kind(record) -> str | None:
    if record.rows == record.decode_rows:
        return "decode"
    return "mixed" if record.decode_rows else None  # None: prompt chunks only


def _table(events: dict, inclusive: dict, steps: int) -> dict:
    """Ops by self CPU time (``events``: op -> (us, calls)), summed over ``steps`` steps, and the
    `GROUPS` from ``inclusive`` (op -> us with its children): ``{"total_ms_per_step", "groups", "ops"}``."""
    total = sum(t for t, _ in events.values())
    ranked = sorted(events.items(), key=lambda kv: -kv[1][0])
    ops = [
        {"op": name, "ms_per_step": t / steps / 1e3, "share": t / total, "calls_per_step": n / steps}
        for name, (t, n) in ranked[:_TOP]
    ]
    rest = ranked[_TOP:]
    if rest:
        t = sum(t for _, (t, _) in rest)
        ops.append({"op": "other", "ms_per_step": t / steps / 1e3, "share": t / total, "calls_per_step": None})
    groups = {g: sum(inclusive.get(op, 0.0) for op in members) for g, members in GROUPS.items()}
    groups["other"] = total - sum(groups.values())
    parts = {g: {"ms_per_step": t / steps / 1e3, "share": t / total} for g, t in groups.items()}
    return {"steps": steps, "total_ms_per_step": total / steps / 1e3, "groups": parts, "ops": ops}


def profile_variant(model, cfg, requests, fast: Fast) -> dict:
    """``{"decode": table, "mixed": table}`` of one variant (`_table`), each over ``cfg["steps"]`` steps,
    with the rows of each step and the load average before the run."""
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(model, cfg, fast)
    for prompt, new in requests:
        engine.add_request(prompt, max_new_tokens=new)
    load = os.getloadavg()
    events = {"decode": {}, "mixed": {}}
    inclusive = {"decode": {}, "mixed": {}}
    counts = {"decode": 0, "mixed": 0, "rows": {"decode": [], "mixed": []}}
    while engine.has_unfinished_requests() and min(counts["decode"], counts["mixed"]) < cfg["steps"]:
        if len(engine.history) < cfg["warmup"]:
            engine.step()
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        kind = _kind(engine.history[-1])
        if kind is None or counts[kind] >= cfg["steps"]:
            continue
        counts[kind] += 1
        counts["rows"][kind].append(engine.history[-1].rows)
        for e in prof.key_averages():
            t, n = events[kind].get(e.key, (0.0, 0))
            events[kind][e.key] = (t + e.self_cpu_time_total, n + e.count)
            inclusive[kind][e.key] = inclusive[kind].get(e.key, 0.0) + e.cpu_time_total
    engine.close()
    out = {}
    for kind, ev in events.items():
        if counts[kind]:
            out[kind] = {**_table(ev, inclusive[kind], counts[kind]), "rows": counts["rows"][kind], "load": load}
    return out


def paired_gain(model, cfg, requests, before: Fast, after: Fast) -> dict:
    """Two engines taking turns step by step; per-step time ratios ``before / after`` (see the module docstring)."""
    engines = [_engine(model, cfg, before), _engine(model, cfg, after)]
    for e in engines:
        for prompt, new in requests:
            e.add_request(prompt, max_new_tokens=new)
    load = os.getloadavg()
    started = time.perf_counter()
    turn = 0
    while any(e.has_unfinished_requests() for e in engines):
        for e in engines[:: 1 if turn % 2 == 0 else -1]:  # who goes first alternates
            if e.has_unfinished_requests():
                e.step()
        turn += 1
    outs = [e.run() for e in engines]
    a, b = (e.history for e in engines)
    same_schedule = [(x.rows, x.tokens) for x in a] == [(y.rows, y.tokens) for y in b]
    ratios = {"decode": [], "mixed": [], "all": []}
    for x, y in zip(a, b):
        kind = _kind(x)
        r = x.step_s / y.step_s
        ratios["all"].append(r)
        if kind is not None:
            ratios[kind].append(r)
    return {
        "wall_s": time.perf_counter() - started,
        "load_before": load,
        "load_after": os.getloadavg(),
        "steps": len(a),
        "same_schedule": same_schedule,
        "requests_with_identical_tokens": sum(o.token_ids == p.token_ids for o, p in zip(*outs)),
        "requests": len(requests),
        "step_ratio_median": {k: statistics.median(v) if v else None for k, v in ratios.items()},
        "steps_of_kind": {k: len(v) for k, v in ratios.items()},
        "busy_ratio": sum(x.step_s for x in a) / sum(y.step_s for y in b),
        "ms_per_step_median": {
            "before": statistics.median(x.step_s for x in a) * 1e3,
            "after": statistics.median(y.step_s for y in b) * 1e3,
        },
        "tokens": [[o.token_ids for o in outs[0]], [o.token_ids for o in outs[1]]],
    }


def _in_turns(ways: dict, repeats: int, calls: int) -> dict:
    """``{way: [seconds per call]}``: each round times every way once, in turn, after a warm call, as the
    mean of ``calls`` calls."""
    times = {k: [] for k in ways}
    for _ in range(repeats):
        for k, fn in ways.items():
            fn()  # warm
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            times[k].append((time.perf_counter() - started) / calls)
    return times


def linear_libraries(model, rows=(32, 512), repeats: int = 7) -> list[dict]:
    """Each way of running layer 0's linear layers, timed in turns (`._model_bench.paired_ratio`):
    ``[{"rows", "ms": {way: median}, "speedup_vs_f_linear": {way: median of per-round ratios}}]``."""
    import torch.nn.functional as F

    from ._model_bench import paired_ratio

    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    layers = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    weights = [m.weight.detach() for m in layers]  # [out, in] each
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    hinted = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS) for w in weights]
    fused = [torch.cat(weights[:3]), weights[3], torch.cat(weights[4:6]), weights[6]]  # qkv, o, gate|up, down
    fused_packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS) for w in fused]
    out = []
    for m in rows:
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights] if torch._C.has_mkl else None

        def inputs(ws):
            return [torch.randn(m, w.shape[1], dtype=w.dtype) for w in ws]  # [rows, in] per product

        x, xf = inputs(weights), inputs(fused)
        ways = {
            "f_linear": lambda: [F.linear(a, w) for a, w in zip(x, weights)],
            "onednn_prepacked": lambda: [
                torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], "") for a, p in zip(x, onednn)
            ],
            f"onednn_prepacked_for_{PACK_FOR_ROWS}_rows": lambda: [
                torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], "") for a, p in zip(x, hinted)
            ],
            "onednn_prepacked_fused_qkv_gate_up": lambda: [
                torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], "") for a, p in zip(xf, fused_packed)
            ],
        }
        if mkl is not None:
            ways["mkl_prepacked"] = lambda: [
                torch.ops.mkl._mkl_linear(a, p, w, None, m) for a, p, w in zip(x, mkl, weights)
            ]
        times = _in_turns(ways, repeats, calls=5)
        out.append(
            {
                "rows": m,
                "ms": {k: statistics.median(t) * 1e3 for k, t in times.items()},
                "speedup_vs_f_linear": {k: paired_ratio(times["f_linear"], t) for k, t in times.items()},
            }
        )
    return out


def few_rows_products(model, rows=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), repeats: int = 5) -> dict:
    """A step's products through oneDNN's prepacked weights and through `few_rows_kernel`, timed in turns:
    ``{"weights_gb", "sum_gb_per_s", "rows": [{"rows", "ms": {way: median}, "gb_per_s", "speedup"}]}``
    (``speedup``: oneDNN's time over the kernel's, the median of per-round ratios)."""
    from ._model_bench import paired_ratio

    few = few_rows_kernel()
    weights = [model.get_output_embeddings().weight.detach()]  # [vocab, hidden]; then each layer's, fused
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight]
        weights += [torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
    weights = [w.detach().contiguous() for w in weights]  # [out, in] each
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS) for w in weights]
    streams = [stream_layout(w) for w in weights]  # [ceil(out / 64), in, 64] each
    gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    flat = torch.cat([w.flatten() for w in weights])  # every weight, to time a plain read of them
    sums = []
    for _ in range(repeats):
        started = time.perf_counter()
        flat.sum()
        sums.append(time.perf_counter() - started)
    out = {"weights_gb": gb, "sum_gb_per_s": gb / statistics.median(sums), "rows": []}
    del flat
    for m in rows:  # past KERNEL_ROWS too: where oneDNN takes over
        x = [torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights]  # [rows, in] per product
        ways = {
            "onednn_prepacked": lambda: [
                torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], "") for a, p in zip(x, onednn)
            ],
            "few_rows": lambda: [few(a, b, w.shape[0]) for a, b, w in zip(x, streams, weights)],
        }
        times = _in_turns(ways, repeats, calls=1)
        ms = {k: statistics.median(t) * 1e3 for k, t in times.items()}
        out["rows"].append(
            {
                "rows": m,
                "ms": ms,
                "gb_per_s": {k: gb / t * 1e3 for k, t in ms.items()},
                "speedup": paired_ratio(times["onednn_prepacked"], times["few_rows"]),
            }
        )
    return out


def rows_ahead(table: dict) -> int:
    """The most rows before the first row count at which a `few_rows_products` table has the kernel behind
    oneDNN (its ``speedup`` below 1): the rows up to which it was measured at least as fast at every count."""
    ahead = 0
    for row in sorted(table["rows"], key=lambda r: r["rows"]):
        if row["speedup"] < 1.0:
            break
        ahead = row["rows"]
    return ahead


#: rounds of an op's checks in one call of its ``*_checks`` entry (`native_checks`)
TIMES = 100


def native_checks(model, cfg, step_ms: float, repeats: int = 7) -> dict:
    """The native ops' checks in a decode step of ``cfg["max_num_seqs"]`` rows, each op's alone and whole,
    timed in turns (median us per call; a checks call runs them ``TIMES`` times: its dispatch is left out),
    times its calls per step: ``{"ops": {op: {"calls_per_step",
    "checks_us", "op_us"}}, "checks_ms_per_step", "step_ms", "share"}`` (``share``: of ``step_ms``)."""
    from ...attention.cpu_paged import kernel
    from ...fast.cpu_ops import cpu_ops

    c, rows = model.config, cfg["max_num_seqs"]
    D, Hq, Hkv = c.hidden_size // c.num_attention_heads, c.num_attention_heads, c.num_key_value_heads
    layers, P, pages = c.num_hidden_layers, cfg["page_size"], cfg["num_pages"]
    max_pages = cfg["max_model_len"] // P
    attention, ops, few = kernel(), cpu_ops(), few_rows_kernel()
    q, kc, vc = torch.randn(rows, Hq, D), torch.randn(pages, P, Hkv, D), torch.randn(pages, P, Hkv, D)
    table = torch.randint(0, pages, (rows, max_pages), dtype=torch.int32)  # [rows, max_pages], all in use
    lens, ones = torch.full((rows,), max_pages * P, dtype=torch.int32), torch.ones(rows, dtype=torch.int32)
    h, y, w = torch.randn(rows, 1, c.hidden_size), torch.randn(rows, 1, c.hidden_size), torch.randn(c.hidden_size)
    x, cos = torch.randn(rows, 1, Hq, D), torch.randn(rows, 1, 1, D)
    gate = torch.randn(rows, 1, c.intermediate_size)
    a, wb = torch.randn(rows, c.hidden_size), stream_layout(torch.randn(c.intermediate_size, c.hidden_size))
    calls = {  # op -> (calls per step, its checks, the op)
        "paged_attention": (
            layers,
            lambda: attention.paged_attention_checks(q, kc, vc, table, lens, ones, TIMES),
            lambda: attention.paged_attention(q, kc, vc, table, lens, ones, 1.0),
        ),
        "add_norm": (2 * layers + 1, lambda: ops.add_norm_checks(h, y, w, TIMES), lambda: ops.add_norm(h, y, w, 1e-6)),
        "rotate": (2 * layers, lambda: ops.rotate_checks(x, cos, cos, TIMES), lambda: ops.rotate(x, cos, cos)),
        "silu_mul": (layers, lambda: ops.silu_mul_checks(gate, gate, TIMES), lambda: ops.silu_mul(gate, gate)),
    }
    if few is not None:  # q/k/v, o, gate/up, down and the LM head: one product each (its shape here: gate's)
        n = c.intermediate_size
        checks = torch.ops.paged_ref_linear.few_rows_checks
        calls["few_rows"] = (4 * layers + 1, lambda: checks(a, wb, n, TIMES), lambda: few(a, wb, n))
    out = {}
    for name, (count, check, whole) in calls.items():
        times = _in_turns({"checks": check, "op": whole}, repeats, calls=20)
        us = {k: statistics.median(t) * 1e6 / (TIMES if k == "checks" else 1) for k, t in times.items()}
        out[name] = {"calls_per_step": count, "checks_us": us["checks"], "op_us": us["op"]}
    total = sum(v["calls_per_step"] * v["checks_us"] for v in out.values()) / 1e3
    return {"rows": rows, "ops": out, "checks_ms_per_step": total, "step_ms": step_ms, "share": total / step_ms}


def _generate_check(model, requests, outs, n: int) -> dict:
    """The first ``n`` requests through ``model.generate`` (greedy): the same tokens as ``outs``?"""
    same = 0
    for (prompt, new), tokens in zip(requests[:n], outs[:n]):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        same += ref[0, len(prompt) :].tolist() == tokens
    return {"requests": n, "identical": same}


def run_profile(model, requests_fn, *, quick: bool, save) -> dict:
    """The profile and the gain of every variant; ``requests_fn(**lengths)`` makes the requests,
    ``save(data)`` stores the JSON as parts finish. Returns the data."""
    from tqdm.auto import tqdm

    cfg = {**PROFILE_WORKLOAD, **(_QUICK if quick else {})}
    lengths = {k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")}
    requests = requests_fn(**lengths)
    data = {
        "config": cfg,
        "torch_threads": torch.get_num_threads(),
        "workload": {"prompt_lens": [len(p) for p, _ in requests], "output_lens": [n for _, n in requests]},
        "variants": {name: {"options": f.options(), "adds": adds} for name, (f, adds) in VARIANTS.items()},
        "gains": [],
    }
    data["linear_libraries"] = {
        "load": os.getloadavg(),
        "layer0": linear_libraries(model, rows=(cfg["max_num_seqs"], cfg["max_batched_tokens"])),
    }
    if few_rows_kernel() is not None:  # else it has warned; the variant runs oneDNN alone
        data["few_rows"] = few_rows_products(model, **({"rows": (1, 4)} if quick else {}))
    save(data)
    names = list(VARIANTS)
    for name in tqdm(names, desc="profile", leave=False):
        data["variants"][name]["profile"] = profile_variant(model, cfg, requests, VARIANTS[name][0])
        save(data)
    decode = data["variants"][names[-1]]["profile"].get("decode")
    if decode is not None:
        data["native_checks"] = {"load": os.getloadavg(), **native_checks(model, cfg, decode["total_ms_per_step"])}
        save(data)
    for before, after in tqdm(list(zip(names, names[1:])), desc="gains", leave=False):
        gain = paired_gain(model, cfg, requests, VARIANTS[before][0], VARIANTS[after][0])
        gain.pop("tokens")
        data["gains"].append({"before": before, "after": after, **gain})
        save(data)
    first, last = names[0], names[-1]
    gain = paired_gain(model, cfg, requests, VARIANTS[first][0], VARIANTS[last][0])
    tokens = gain.pop("tokens")
    data["gains"].append({"before": first, "after": last, **gain})
    data["generate_check"] = {"variant": last, **_generate_check(model, requests, tokens[1], 2 if quick else 4)}
    save(data)
    return data
