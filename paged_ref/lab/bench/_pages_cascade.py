"""`bench pages`, the cascade half: one layer's decode attention with a shared prompt, timed and
its K/V reads counted; the Triton path checked; SmolLM2 sampling with and without cascade."""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

from ..._arith import cdiv
from ...attention.cascade import reference_cascade_decode, suffix_table
from ...attention.reference import gather_sequence, reference_paged_decode
from ...attention.sdpa import sdpa_paged_decode
from . import eviction as ev
from ._reads import CallCounter, ReadCounter
from .common import paired_ratio

__all__ = ["PAGE_SIZE", "PATHS", "SMOLLM2", "cascade_bytes", "cascade_case", "cascade_speed", "generate_speed"]
__all__ += ["cascade_breakdown", "generate_breakdown", "triton_check"]

PAGE_SIZE = 16
SMOLLM2 = dict(num_q_heads=9, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's attention geometry


def cascade_case(samples: int, prompt: int, suffix_max: int, *, seed: int = 0, dtype=torch.float32) -> dict:
    """``samples`` requests sharing ``prompt`` tokens (whole pages of 16), each with 1..``suffix_max``
    tokens of its own, scattered over a shuffled cache of SmolLM2's geometry; the arguments of
    `reference_cascade_decode` as a dict (``group_indptr``, ``prefix_lens``: one group)."""
    g = torch.Generator().manual_seed(seed)
    suffix = torch.randint(1, suffix_max + 1, (samples,), generator=g)  # [samples]
    prefix_pages, own = prompt // PAGE_SIZE, [cdiv(int(s), PAGE_SIZE) for s in suffix]
    num_pages = prefix_pages + sum(own) + 1
    shape = (num_pages, PAGE_SIZE, SMOLLM2["num_kv_heads"], SMOLLM2["head_dim"])
    k_cache = torch.randn(shape, generator=g, dtype=dtype)  # [num_pages, page_size, Hkv, D]
    v_cache = torch.randn(shape, generator=g, dtype=dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    shared = [perm.pop() for _ in range(prefix_pages)]
    rows = [shared + [perm.pop() for _ in range(n)] for n in own]
    width = max(map(len, rows))
    return dict(
        q=torch.randn(samples, SMOLLM2["num_q_heads"], SMOLLM2["head_dim"], generator=g, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.int32),
        seq_lens=(prompt + suffix).int(),
        group_indptr=torch.tensor([0, samples]),
        prefix_lens=torch.tensor([prompt]),
    )


def _plain(case):
    return {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens")}


PATHS = {
    "reference": lambda c: reference_paged_decode(**_plain(c)),
    "sdpa": lambda c: sdpa_paged_decode(**_plain(c)),
    "cascade": lambda c: reference_cascade_decode(**c),
}


def cascade_speed(cfg, log, *, clock=time.perf_counter) -> dict:
    """CPU time per call of each path on one case, the paths in turn every round: each path's median and
    rounds (ms), and ``speedup_vs``, each other path's time over cascade's as the median of the rounds'
    ratios (`common.paired_ratio`). ``clock`` is the timer."""
    case = cascade_case(cfg["samples"], cfg["prompt"], cfg["suffix_max"])
    ref = PATHS["reference"](case).double()
    errors = {n: float((f(case).double() - ref).norm() / ref.norm()) for n, f in PATHS.items()}
    times = {n: [] for n in PATHS}
    for _ in range(cfg["rounds"]):
        for name, f in PATHS.items():
            t0 = clock()
            f(case)
            times[name].append(clock() - t0)
    median = {n: statistics.median(t) for n, t in times.items()}
    log(f"cascade speed: {', '.join(f'{n} {1e3 * t:.2f} ms' for n, t in median.items())}")
    return dict(
        samples=cfg["samples"],
        prompt=cfg["prompt"],
        suffix_tokens=(case["seq_lens"] - cfg["prompt"]).tolist(),
        median_ms={n: 1e3 * t for n, t in median.items()},
        rounds_ms={n: [1e3 * x for x in t] for n, t in times.items()},
        speedup_vs={n: paired_ratio(times[n], times["cascade"]) for n in PATHS if n != "cascade"},
        rel_error_vs_reference=errors,
    )


def cascade_bytes(cfg) -> list[dict]:
    """K/V bytes one layer's decode step reads, counted, for n = each of ``sharing`` requests sharing
    the prompt, plain and cascade, beside the formulas (whole pages: what a paged read touches)."""
    rows = []
    token_bytes = 2 * SMOLLM2["num_kv_heads"] * SMOLLM2["head_dim"] * 4  # K and V of one token, float32
    for n in cfg["sharing"]:
        case = cascade_case(n, cfg["prompt"], cfg["suffix_max"], seed=n)
        counted = {}
        for name, f in PATHS.items():
            with ReadCounter([case["k_cache"], case["v_cache"]]) as reads:
                f(case)
            counted[name] = reads.bytes
        own_pages = [cdiv(int(s) - cfg["prompt"], PAGE_SIZE) for s in case["seq_lens"]]
        prefix_pages = cfg["prompt"] // PAGE_SIZE
        rows.append(
            dict(
                requests=n,
                prompt=cfg["prompt"],
                bytes_counted=counted,
                bytes_formula=dict(
                    plain=sum(prefix_pages + p for p in own_pages) * PAGE_SIZE * token_bytes,
                    cascade=(prefix_pages + sum(own_pages)) * PAGE_SIZE * token_bytes,
                ),
                prefix_bytes_plain_over_cascade=n,
            )
        )
    return rows


def triton_check(cfg, log) -> dict:
    """The Triton cascade against the reference (interpreter on CPU: a small case); timed on a GPU."""
    try:
        from ...attention.triton_cascade import triton_cascade_decode
        from ...attention.triton_decode import triton_paged_decode
    except ImportError as err:  # pragma: no cover - no triton wheel
        return dict(skipped=str(err))
    cuda = torch.cuda.is_available()
    samples, prompt = (cfg["samples"], cfg["prompt"]) if cuda else (4, 64)
    case = cascade_case(samples, prompt, cfg["suffix_max"], seed=1)
    if cuda:
        case = {k: v.cuda() for k, v in case.items()}
    ref = reference_paged_decode(**{k: v.double() if v.is_floating_point() else v for k, v in _plain(case).items()})
    out = triton_cascade_decode(**case)
    result = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        samples=samples,
        prompt=prompt,
        rel_error=float((out.double() - ref).norm() / ref.norm()),
    )
    if cuda:
        from .common import gpu_median

        plain = gpu_median(lambda: triton_paged_decode(**_plain(case), check_values=False))
        cascade = gpu_median(lambda: triton_cascade_decode(**case))
        result.update(plain_us=plain * 1e6, cascade_us=cascade * 1e6, speedup=plain / cascade)
    log(f"triton cascade: {result}")
    return result


def generate_speed(model, tok, cfg, log, *, clock=time.perf_counter) -> dict:
    """SmolLM2 sampling ``samples`` continuations of one ``prompt``-token prompt (they fork its pages)
    with the ``sdpa`` and the ``cascade`` backends, in ``generate_pairs`` pairs of runs taken in turns
    (the order reversed every other pair): each run's median seconds per decode step (all layers, the
    whole model), ``speedup`` the median of the pairs' ratios sdpa / cascade (`common.paired_ratio`),
    ``ms_per_step`` the median over all of a backend's steps, and whether the seeded tokens are the same
    in every run. ``clock`` is the timer (the decode steps are the intervals between its readings)."""
    from ...hf import generate

    ids = ev.lm_text_ids(tok, 3, cfg["prompt"])[None]  # [1, prompt]
    backends = ("sdpa", "cascade")
    steps, runs, tokens = ({b: [] for b in backends} for _ in range(3))
    load_before = os.getloadavg()
    for p in range(cfg["generate_pairs"]):
        for backend in backends if p % 2 == 0 else backends[::-1]:
            stamps = []
            torch.manual_seed(0)
            seqs = generate(
                model,
                ids,
                max_new_tokens=cfg["generate_steps"],
                do_sample=True,
                num_return_sequences=cfg["samples"],
                backend=backend,
                eos_token_id=[],
                callback=lambda step, toks: stamps.append(clock()),
            )
            run = [b - a for a, b in zip(stamps, stamps[1:])]  # decode steps (the first stamp follows the prefill)
            steps[backend] += run
            runs[backend].append(1e3 * statistics.median(run))
            tokens[backend].append(seqs[:, cfg["prompt"] :].tolist())
    same = all(t == tokens["sdpa"][0] for b in backends for t in tokens[b])
    result = dict(samples=cfg["samples"], prompt=cfg["prompt"], same_tokens=same, pairs=cfg["generate_pairs"])
    for b in backends:
        ms = [1e3 * t for t in steps[b]]
        result[b] = dict(ms_per_step=statistics.median(ms), runs_ms_per_step=runs[b], steps_ms=ms)
    result["speedup"] = paired_ratio(runs["sdpa"], runs["cascade"])
    result.update(load_before=list(load_before), load_after=list(os.getloadavg()))
    log(f"sampling {cfg['samples']} x SmolLM2: sdpa {result['sdpa']['ms_per_step']:.0f} ms/step, cascade "
        f"{result['cascade']['ms_per_step']:.0f} ms/step, {result['speedup']:.2f}x (median of "
        f"{cfg['generate_pairs']} pairs), same tokens: {same}")  # fmt: skip
    return result


# --------------------------------------------------------------------------- where the time goes
def _gathers(case, cascade: bool) -> None:
    """Only the K/V copies a path makes (`gather_sequence`, as the path calls it), nothing else."""
    kc, vc, bt, lens = case["k_cache"], case["v_cache"], case["block_table"], case["seq_lens"]
    if not cascade:
        for b, n in enumerate(lens.tolist()):
            gather_sequence(kc, bt[b], n), gather_sequence(vc, bt[b], n)
        return
    prefix = int(case["prefix_lens"][0])
    gather_sequence(kc, bt[0], prefix), gather_sequence(vc, bt[0], prefix)  # one group: the prefix once
    table = suffix_table(bt, torch.full_like(lens, prefix // kc.shape[1]))  # [batch, max_pages]
    for b, n in enumerate((lens - prefix).tolist()):
        gather_sequence(kc, table[b], n), gather_sequence(vc, table[b], n)


def _median_ms(ways: dict, rounds: int) -> tuple[dict, dict]:
    """Each way called once per round, the ways in turn (a warm call first): medians and all rounds, ms."""
    for f in ways.values():
        f()
    times = {n: [] for n in ways}
    for _ in range(rounds):
        for name, f in ways.items():
            t0 = time.perf_counter()
            f()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {n: statistics.median(t) for n, t in times.items()}, times


def cascade_breakdown(cfg, log) -> dict:
    """Where the reference's and cascade's time goes at ``samples`` requests (one layer, the case of
    `cascade_speed`). In turns, every round: each whole path; only its K/V gathers; each path on a
    case of the same batch with a 1-page prefix and 1-token suffixes (the same Python and the same
    PyTorch calls, almost no data: the per-request cost); a plain ``sum`` of as many bytes as the
    reference gathers (the rate memory is read at). Also the PyTorch calls each path makes, and ``speedup``,
    the reference's time over cascade's as the median of the rounds' ratios (`common.paired_ratio`)."""
    case = cascade_case(cfg["samples"], cfg["prompt"], cfg["suffix_max"])
    tiny = cascade_case(cfg["samples"], PAGE_SIZE, 1)
    counted = {}
    for name in ("reference", "cascade"):
        with ReadCounter([case["k_cache"], case["v_cache"]]) as reads, CallCounter() as calls:
            PATHS[name](case)
        counted[name] = dict(kv_bytes=reads.bytes, torch_calls=calls.calls)
    flat = torch.randn(counted["reference"]["kv_bytes"] // 4)  # float32: the bytes the reference gathers
    ways = {"sum": lambda: flat.sum()}
    for name in ("reference", "cascade"):
        ways[f"{name}"] = lambda n=name: PATHS[n](case)
        ways[f"{name}_gathers"] = lambda n=name: _gathers(case, n == "cascade")
        ways[f"{name}_tiny"] = lambda n=name: PATHS[n](tiny)
        ways[f"{name}_tiny_gathers"] = lambda n=name: _gathers(tiny, n == "cascade")
    load_before = os.getloadavg()
    median, rounds = _median_ms(ways, cfg["rounds"])
    rate = flat.numel() * 4 / median["sum"] / 1e6  # GB/s
    paths = {}
    for name in ("reference", "cascade"):
        total, gathers, tiny_total = median[name], median[f"{name}_gathers"], median[f"{name}_tiny"]
        gather_data = max(gathers - median[f"{name}_tiny_gathers"], 0.0)
        paths[name] = dict(
            **counted[name],
            ms=total,
            gathers_ms=gathers,
            per_request_ms=tiny_total,  # Python and PyTorch calls with (almost) no data
            gather_data_ms=gather_data,  # the gathers' copying, their calls taken out
            math_ms=max(total - tiny_total - gather_data, 0.0),  # the rest: the math on the data
            kv_gb_per_s=counted[name]["kv_bytes"] / total / 1e6,
            read_ms_at_sum_rate=counted[name]["kv_bytes"] / rate / 1e6,
        )
    log(f"cascade breakdown: {', '.join(f'{n} {t:.2f} ms' for n, t in median.items())}")
    return dict(
        samples=cfg["samples"],
        prompt=cfg["prompt"],
        rounds=cfg["rounds"],
        median_ms=median,
        rounds_ms=rounds,
        sum_gb_per_s=rate,
        paths=paths,
        speedup=paired_ratio(rounds["reference"], rounds["cascade"]),  # the median of the rounds' ratios
        load_before=list(load_before),
        load_after=list(os.getloadavg()),
    )


@contextlib.contextmanager
def _timed_attention(times: list):
    """Within the block, every layer's attention call of `paged_ref.hf` appends its seconds to ``times``."""
    from ...hf import attention as hf_attention

    inner = hf_attention._attention

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return out

    hf_attention._attention = timed
    try:
        yield
    finally:
        hf_attention._attention = inner


def generate_breakdown(model, tok, cfg, log, repeats: int = 2) -> dict:
    """`generate_speed` with every layer's attention timed inside the model: per decode step, the
    step's milliseconds, its attention's (all layers) and the rest; ``repeats`` runs of each backend,
    in turns. Medians over steps and repeats."""
    from ...hf import generate

    ids = ev.lm_text_ids(tok, 3, cfg["prompt"])[None]  # [1, prompt]
    layers = model.config.num_hidden_layers
    steps = {b: dict(step_ms=[], attention_ms=[], layer_ms=[]) for b in ("sdpa", "cascade")}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for backend, rec in steps.items():
            stamps, attention = [], []
            torch.manual_seed(0)
            stamp = lambda step, tokens: stamps.append((time.perf_counter(), len(attention)))  # noqa: E731
            with _timed_attention(attention):
                generate(model, ids, max_new_tokens=cfg["generate_steps"], do_sample=True, eos_token_id=[],
                         num_return_sequences=cfg["samples"], backend=backend, callback=stamp)  # fmt: skip
            for (t0, a0), (t1, a1) in zip(stamps, stamps[1:]):  # decode steps: `layers` attention calls each
                if a1 - a0 == layers:
                    rec["step_ms"].append(1e3 * (t1 - t0))
                    rec["attention_ms"].append(1e3 * sum(attention[a0:a1]))
                    rec["layer_ms"] += [1e3 * t for t in attention[a0:a1]]
    out = {}
    for backend, rec in steps.items():
        rest = [s - a for s, a in zip(rec["step_ms"], rec["attention_ms"])]
        out[backend] = dict(
            {k: statistics.median(v) for k, v in rec.items()},
            rest_ms=statistics.median(rest),
            steps=len(rec["step_ms"]),
            step_ms_all=rec["step_ms"],
            attention_ms_all=rec["attention_ms"],
        )
    parts = [f"{b} step {o['step_ms']:.0f} ms, attention {o['attention_ms']:.0f} ms" for b, o in out.items()]
    log(f"generate breakdown: {', '.join(parts)}")
    return dict(
        samples=cfg["samples"],
        prompt=cfg["prompt"],
        layers=layers,
        repeats=repeats,
        **out,
        load_before=list(load_before),
        load_after=list(os.getloadavg()),
    )
