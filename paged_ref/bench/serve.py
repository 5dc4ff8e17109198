"""Serving a stream of requests from one KV pool: what paging buys, against transformers' own engine.

    python -m paged_ref.bench serve [--quick] [--gpu] [--threads N] [--out DIR] [--skip-peer] [--skip-pools]

One workload, one run, ratios measured side by side (`paged_ref.serve.Engine` on SmolLM2, CPU):

* **Requests**: ``requests`` prompts of real English (CPython's documentation, `paged_ref.textdata`,
  tokenized by the model's tokenizer; random ids for a random-weight model) with heavy-tailed
  lengths (lognormal prompt and output lengths, `paged_ref.fragmentation.make_workload`), each
  generating exactly its drawn output length (EOS ignored, so every policy does the same work),
  arriving as a Poisson process. The same requests at every rate (gaps scaled by 1 / rate).
* **Rates**: at each request rate, the same engine, kernels and pool of ``num_pages`` pages under
  four admission policies: ``paged``, ``exact`` (prompt + output reserved up front: an oracle that
  knows the output length), ``max_len`` (``max_model_len`` reserved per request) and
  ``paged_eviction`` (paged, each request's cache bounded by PagedEviction at ``eviction_budget``
  tokens); ``paged`` admission keeps a ``watermark`` of the pool free. The four engines take turns
  step by step, so a change in the machine's load hits them alike; each keeps its own clock, the
  **simulated clock**: advanced by each of its steps' measured wall time, idle gaps jumped (no
  sleeping), so the latencies are measured compute time.
* **Overhead**: an offline batch of 16 equal requests; the engine's own share (scheduling, laying
  out the forward, sampling) of each decode step with 16 rows.
* **Peer**: the same requests all at once (offline) through ``paged`` and through transformers'
  continuous batching (`paged_ref.bench._serve_peer`: the manager ``generate_batch`` runs, with its
  paged cache of equal size), taking turns ``peer_repeats`` times; throughput is generated tokens
  over real wall time, and the tokens are compared request by request.
* **Pools**: throughput vs pool size at the highest rate, ``paged``/``exact``/``max_len``.

Reported per run: generated tokens/s, TTFT and TPOT (p50, p90), normalized latency (seconds per
generated token, the vLLM paper's measure), requests running at once (mean over steps and peak),
preemptions, recomputed tokens, peak pages. The goals of the issue are checked at the end from
this run's numbers (met or not, with the ratios). The JSON is written after every section, so an
interrupted run keeps what it measured: ``figures/data/serve_{cpu,gpu}.json`` (``_quick`` in quick
mode), with the machine's load average before and after each section. ``--gpu``: the random-weight
1B Llama of ``bench scaling --gpu`` in bf16 on CUDA, larger workload.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import numpy as np
import torch

from .. import textdata
from ..eviction import make_policy
from ..fragmentation import make_workload
from ..memory import model_geometry
from ..serve import Engine, summarize
from ._scaling_models import build_model
from ._serve_peer import run_peer
from ._serve_report import POLICIES, check_goals, eviction_quality, format_rate_table, print_rate
from .common import bench_parser, environment, print_table, result_file

__all__ = ["PROFILES", "POLICIES", "make_requests", "run_rate", "check_goals", "format_rate_table", "main"]


#: What each mode runs. Lengths: lognormal with these means and shape ``sigma``, clipped so that
#: prompt + output <= max_model_len; prompts at least ``min_prompt`` tokens. Outputs twice as long
#: as prompts on average, as in the chat traces serving papers replay (ShareGPT: 161 prompt and 338
#: output tokens). ``watermark``: the share of the pool that ``paged`` admission keeps free for the
#: running requests to grow into (1%, vLLM's default, is no page at all of a 64-page pool); the
#: committed policies keep none, since their commitment already covers every request's growth.
PROFILES = {
    "cpu": dict(
        model="smollm2",
        device="cpu",
        requests=64,
        mean_prompt=32,
        mean_output=64,
        sigma=1.0,
        min_prompt=8,
        max_model_len=512,
        rates=(1.0, 2.0, 4.0),
        page_size=16,
        num_pages=64,
        watermark=0.1,
        max_num_seqs=32,
        max_batched_tokens=512,
        eviction_budget=128,
        pools=(128, 256),
        peer_repeats=3,
        overhead=dict(batch=16, prompt=64, new=24),
    ),
    "quick": dict(
        model="tiny",
        device="cpu",
        requests=10,
        mean_prompt=24,
        mean_output=12,
        sigma=1.0,
        min_prompt=4,
        max_model_len=64,
        rates=(100.0, 2000.0),
        page_size=4,
        num_pages=40,
        watermark=0.1,
        max_num_seqs=8,
        max_batched_tokens=32,
        eviction_budget=16,
        pools=(24,),
        peer_repeats=1,
        overhead=dict(batch=4, prompt=8, new=4),
    ),
    "gpu": dict(
        model="llama1b",
        device="cuda",
        requests=256,
        mean_prompt=512,
        mean_output=128,
        sigma=1.0,
        min_prompt=16,
        max_model_len=4096,
        rates=(8.0, 16.0, 32.0, 64.0),
        page_size=16,
        num_pages=2048,
        watermark=0.01,
        max_num_seqs=128,
        max_batched_tokens=2048,
        eviction_budget=256,
        pools=(1024, 4096),
        peer_repeats=2,
        overhead=dict(batch=16, prompt=256, new=64),
    ),
}


def make_requests(model, tokenizer, *, requests, mean_prompt, mean_output, sigma, min_prompt, max_model_len, seed=0):
    """``(requests, unit_arrivals)``: ``[(prompt_ids, max_new_tokens)]`` and Poisson arrival times at rate 1.

    Lengths from `paged_ref.fragmentation.make_workload`; prompt ``i`` is real text starting at
    paragraph ``i`` (seeded random ids without a tokenizer).
    """
    wl = make_workload(
        requests, seed=seed, mean_prompt=mean_prompt, mean_output=mean_output, sigma=sigma, max_len=max_model_len
    )
    prompt_lens = np.maximum(wl.prompt_len, min_prompt)
    output_lens = np.minimum(wl.output_len, max_model_len - prompt_lens)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, new) in enumerate(zip(prompt_lens.tolist(), output_lens.tolist())):
        if tokenizer is None:
            ids = torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
        else:
            words, start = n, i % len(textdata.paragraphs(20))
            while True:  # about 1.3 tokens per word: grow the passage until it is long enough
                ids = tokenizer(textdata.english_text(words, start=start)).input_ids
                if len(ids) >= n:
                    break
                words = int(words * 1.5) + 8
            ids = ids[:n]
        out.append((ids, int(new)))
    rng = np.random.default_rng(seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0, requests))
    arrivals -= arrivals[0]  # the first request arrives at 0
    return out, arrivals.tolist()


def _engine(model, cfg, policy, *, num_pages=None, device_clock="simulated"):
    paged = policy in ("paged", "paged_eviction")
    return Engine(
        model,
        num_pages=num_pages or cfg["num_pages"],
        page_size=cfg["page_size"],
        max_num_seqs=cfg["max_num_seqs"],
        max_batched_tokens=cfg["max_batched_tokens"],
        reservation="paged" if paged else policy,
        watermark=cfg["watermark"] if paged else 0.0,
        max_model_len=cfg["max_model_len"],
        eos_token_id=[],
        clock=device_clock,
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
    r.update(
        {k: s[k] for k in ("steps", "mean_running", "peak_running", "preemptions", "recomputed_tokens")},
        peak_pages=s["peak_pages"],
        peak_committed_pages=s["peak_committed_pages"],
        prompt_tokens=s["prompt_tokens"],
        busy_s=s["busy_s"],
        overhead_share=s["overhead_share"],
    )
    if reference_tokens is not None:
        same = [o.token_ids == t for o, t in zip(outs, reference_tokens)]
        r["requests_with_paged_tokens"] = sum(same)
    return r


def run_rate(model, cfg, requests, arrivals, rate: float) -> dict:
    """The four policies on the requests arriving at ``rate`` per second, in lockstep."""
    engines = {}
    policy = make_policy("paged_eviction", cfg["eviction_budget"])
    for name in POLICIES:
        e = _engine(model, cfg, name)
        for (prompt, new), t in zip(requests, arrivals):
            e.add_request(
                prompt, max_new_tokens=new, arrival_s=t / rate, eviction=policy if "eviction" in name else None
            )
        engines[name] = e
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
    return {
        "batch": o["batch"],
        "decode_steps": len(steps),
        "step_ms_median": statistics.median(h.step_s for h in steps) * 1e3,
        "schedule_ms_median": statistics.median(h.schedule_s for h in steps) * 1e3,
        "plan_ms_median": statistics.median(h.plan_s for h in steps) * 1e3,
        "post_ms_median": statistics.median(h.post_s for h in steps) * 1e3,
        "overhead_share_median": statistics.median(shares),
        "overhead_share_max": max(shares),
    }


def run_peer_comparison(model, cfg, requests) -> dict:
    """``paged`` offline vs transformers' continuous batching offline, taking turns ``peer_repeats`` times."""
    ours, theirs = [], []
    ours_tokens = theirs_tokens = None
    for _ in range(cfg["peer_repeats"]):
        e = _engine(model, cfg, "paged", device_clock="real")
        for prompt, new in requests:
            e.add_request(prompt, max_new_tokens=new)
        start = time.perf_counter()
        outs = e.run()
        wall = time.perf_counter() - start
        ours_tokens = [o.token_ids for o in outs]
        r = summarize(outs)
        r.update(wall_s=wall, wall_tokens_per_s=r["tokens"] / wall, preemptions=e.stats()["preemptions"])
        ours.append(r)
        peer = run_peer(
            model,
            requests,
            page_size=cfg["page_size"],
            num_pages=cfg["num_pages"],
            max_batched_tokens=cfg["max_batched_tokens"],
            max_num_seqs=cfg["max_num_seqs"],
        )
        theirs_tokens = peer["tokens"]
        tokens = sum(len(t) for t in peer["tokens"])
        ttft = [t for t in peer["first_token_s"] if t is not None]
        tpot = [
            (f - t) / (len(toks) - 1)
            for t, f, toks in zip(peer["first_token_s"], peer["finish_s"], peer["tokens"])
            if t is not None and len(toks) > 1
        ]
        from ..serve.metrics import percentile

        theirs.append(
            {
                "tokens": tokens,
                "wall_s": peer["wall_s"],
                "wall_tokens_per_s": tokens / peer["wall_s"],
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_p90_s": percentile(ttft, 90),
                "tpot_p50_s": percentile(tpot, 50),
                "tpot_p90_s": percentile(tpot, 90),
                "num_blocks": peer["num_blocks"],
            }
        )
    paired = [a["wall_tokens_per_s"] / b["wall_tokens_per_s"] for a, b in zip(ours, theirs)]
    same = [a == b for a, b in zip(ours_tokens, theirs_tokens)]
    return {
        "paged": ours,
        "transformers": theirs,
        "throughput_ratio_paired": paired,
        "throughput_ratio_median": statistics.median(paired),
        "requests_with_identical_tokens": sum(same),
        "requests": len(same),
        "first_differing_requests": [i for i, s in enumerate(same) if not s][:10],
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


def main(argv=None):
    parser = bench_parser("serve", __doc__)
    parser.add_argument(
        "--quick", action="store_true", help="toy sizes on the tiny random model (the tests' harness check)"
    )
    parser.add_argument("--gpu", action="store_true", help="the random-weight 1B Llama on CUDA, larger workload")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: steadier on a shared machine)"
    )
    parser.add_argument("--skip-peer", action="store_true", help="leave out transformers' continuous batching")
    parser.add_argument("--skip-pools", action="store_true", help="leave out the pool-size sweep")
    parser.add_argument("--requests", type=int, default=None, help="override the profile's number of requests")
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="override the profile's request rates")
    args = parser.parse_args(argv)
    if args.quick and args.gpu:
        parser.error("--quick and --gpu are exclusive")
    mode = "quick" if args.quick else "gpu" if args.gpu else "cpu"
    cfg = dict(PROFILES[mode])
    if args.requests is not None:
        cfg["requests"] = args.requests
    if args.rates is not None:
        cfg["rates"] = tuple(sorted(args.rates))
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA GPU")
    name = f"serve_{'gpu' if mode == 'gpu' else 'cpu'}{'_quick' if args.quick else ''}.json"
    result = result_file(parser, args.out, name)  # checked before the model loads
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, info = build_model(cfg["model"], device=cfg["device"])
    requests, arrivals = make_requests(
        model,
        info["tokenizer"],
        **{k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")},
    )
    geometry = model_geometry(model)
    data = {
        "mode": mode,
        "model": {k: info[k] for k in ("name", "weights", "dtype", "params", "note")},
        "torch_threads": torch.get_num_threads(),
        "clock": "simulated",
        "clock_note": "each engine's clock advances by its own steps' measured wall time; idle gaps are jumped "
        "(the peer comparison uses real wall time)",
        "config": {k: v for k, v in cfg.items()},
        "workload": {
            "requests": len(requests),
            "prompt_lens": [len(p) for p, _ in requests],
            "output_lens": [n for _, n in requests],
            "unit_arrivals_s": arrivals,
            "kv_bytes_per_token": geometry.bytes_per_token,
            "pool_bytes": cfg["num_pages"] * cfg["page_size"] * geometry.bytes_per_token,
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
    save = lambda: result.save(data)  # noqa: E731
    for rate in cfg["rates"]:
        row = run_rate(model, cfg, requests, arrivals, rate)
        data["rates"].append(row)
        print_rate(row)
        save()
    data["overhead"] = run_overhead(model, cfg, requests)
    o = data["overhead"]
    print(
        f"\noverhead at batch {o['batch']}: {o['overhead_share_median']:.2%} of a {o['step_ms_median']:.0f} ms "
        f"decode step (median of {o['decode_steps']})"
    )
    save()
    if not args.skip_peer:
        data["peer"] = run_peer_comparison(model, cfg, requests)
        p = data["peer"]
        print(f"\noffline, all {p['requests']} requests at once: paged vs transformers continuous batching")
        print_table(
            ["engine", "tok/s (wall)", "wall s", "TTFT p50/p90 s", "TPOT p50/p90 ms"],
            [
                [
                    eng,
                    " ".join(f"{r['wall_tokens_per_s']:.1f}" for r in p[eng]),
                    " ".join(f"{r['wall_s']:.1f}" for r in p[eng]),
                    f"{p[eng][-1]['ttft_p50_s']:.2f}/{p[eng][-1]['ttft_p90_s']:.2f}",
                    f"{p[eng][-1]['tpot_p50_s'] * 1e3:.0f}/{p[eng][-1]['tpot_p90_s'] * 1e3:.0f}",
                ]
                for eng in ("paged", "transformers")
            ],
        )
        print(
            f"  ratio paged / transformers {p['throughput_ratio_median']:.2f}x (median of per-repeat ratios); "
            f"identical tokens {p['requests_with_identical_tokens']}/{p['requests']}"
        )
        save()
    if not args.skip_pools:
        data["pools"] = run_pools(model, cfg, requests, arrivals, cfg["rates"][-1])
        print(
            f"\nthroughput vs pool size at {cfg['rates'][-1]:g} req/s "
            f"(the {cfg['num_pages']}-page pool is the rate table above)"
        )
        print_table(
            ["pages", "policy", "tok/s", "running mean/peak", "preempt"],
            [
                [
                    r["num_pages"],
                    r["policy"],
                    "skipped" if "skipped" in r else f"{r['tokens_per_s']:.1f}",
                    "-" if "skipped" in r else f"{r['mean_running']:.1f}/{r['peak_running']}",
                    r.get("preemptions", "-"),
                ]
                for r in data["pools"]
            ],
        )
        save()
    data["goals"] = check_goals(data)
    data["seconds"] = time.perf_counter() - started
    print("\ngoals (this run):")
    for goal, g in data["goals"].items():
        print(
            f"  {'met    ' if g['met'] else 'NOT met'}  {goal}: "
            + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in g.items() if k != "met")
        )
    path = result.save(data, complete=True)
    print(f"wrote {path} ({data['seconds']:.0f} s)")
    return data


if __name__ == "__main__":
    main()
