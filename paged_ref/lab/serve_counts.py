"""Scheduling counts of a serving run: who was admitted and preempted when, and what it cost.

A run's `paged_ref.serve.StepRecord` history says, step by step, which requests were admitted,
preempted and finished. `request_events` reads one request's story out of it; `tpot_breakdown`
splits a request's time per output token into the steps it decoded and the steps it spent
preempted or computing its tokens again. `bench_dry` serves the requests of ``python -m
paged_ref.lab.bench serve`` (same lengths, arrivals, pool and budgets) on a dry engine
(``Engine(None, ...)``: no model, the clock counts steps), for the questions that are about
scheduling decisions alone: preemptions, recomputed tokens, steps; `watermark_trade` does it for
several watermarks.

Example:
    >>> run = bench_dry("paged", rate=4.0, step_s=0.1, profile="quick")
    >>> run.engine.stats()["tokens"] == sum(new for _, new in run.requests)
    True
    >>> b = tpot_breakdown(run.engine.history, run.outputs)[0]
    >>> b["window_steps"] == b["decode_steps"] + b["away_steps"]
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ..serve.engine import Engine
from ..serve.request import RequestOutput
from ..serve.reservation import Reservation
from .serve_metrics import summarize

__all__ = ["DryBench", "bench_dry", "request_events", "tpot_breakdown", "watermark_trade"]


def request_events(history, request_id: int) -> dict[str, list[int]]:
    """The steps at which request ``request_id`` was ``admitted``, ``preempted`` and ``finished``."""
    events = ("admitted", "preempted", "finished")
    return {what: [h.step for h in history if request_id in getattr(h, what)] for what in events}


def tpot_breakdown(history, outputs: list[RequestOutput]) -> list[dict]:
    """Per request with at least two tokens, on a clock that counts steps (``clock="steps"``):
    ``tokens``; ``window_steps``: the steps from its first token to its last, whose count over
    ``tokens - 1`` is its TPOT in steps; ``decode_steps`` (``tokens - 1``: one token per step while
    it decodes) and ``away_steps`` (the rest: preempted, waiting or feeding its prompt and tokens
    again); ``preemptions_after_first`` (preemptions inside the window) and ``tpot_steps``."""
    out = []
    for o in outputs:
        n = len(o.token_ids)
        if n < 2:
            continue
        first, last = round(o.first_token_s), round(o.finish_s)
        window = last - first
        pre = [h.step for h in history if o.request_id in h.preempted and first <= h.step < last]
        out.append(
            {
                "request_id": o.request_id,
                "tokens": n,
                "window_steps": window,
                "decode_steps": n - 1,
                "away_steps": window - (n - 1),
                "preemptions_after_first": len(pre),
                "tpot_steps": window / (n - 1),
            }
        )
    return out


@dataclass
class DryBench:
    """A dry run of the benchmark's requests: the engine (``stats()``, ``history``), outputs, requests."""

    engine: Engine
    outputs: list[RequestOutput]
    requests: list[tuple[list[int], int]]

    def summary(self) -> dict:
        """`summarize` (times in steps) plus the engine's counters: ``steps``, ``preemptions``,
        ``recomputed_tokens``, ``mean_running``, ``peak_running``, ``tokens_per_step`` (generated
        tokens per step of the span: the dry run's throughput) and ``computed_tokens`` (tokens fed)."""
        s = self.engine.stats()
        out = summarize(self.outputs)
        out.update({k: s[k] for k in ("steps", "preemptions", "recomputed_tokens", "mean_running", "peak_running")})
        out["tokens_per_step"] = out["tokens_per_s"]
        out["computed_tokens"] = sum(h.tokens for h in self.engine.history)
        return out


def bench_dry(
    policy: str,
    *,
    rate: float | None,
    step_s: float = 1.0,
    profile: str = "cpu",
    watermark: float | None = None,
    num_pages: int | None = None,
    workload: str = "chat",
) -> DryBench:
    """The requests of ``bench serve``'s ``profile`` (with ``workload``'s lengths), arriving at
    ``rate`` per second (None: all at once, as in its comparison with transformers), served dry
    under ``policy`` (``paged``, ``exact`` or ``max_len``) with the benchmark's settings;
    ``watermark`` and ``num_pages`` override the benchmark's (``watermark`` applies to ``paged``
    only, as there).

    A dry step carries the same requests and tokens as a real one, but its clock counts steps: a
    request arriving at ``t`` seconds (at rate 1) arrives at step ``t / (rate * step_s)``, with
    ``step_s`` the seconds a real step takes (read it from a real run: ``busy_s / steps``).
    """
    from .bench.serve import PROFILES, WORKLOADS, make_requests

    cfg = {**PROFILES[profile], **WORKLOADS[workload]}
    lengths = {k: cfg[k] for k in ("requests", "mean_prompt", "mean_output", "sigma", "min_prompt", "max_model_len")}
    ids_only = SimpleNamespace(config=SimpleNamespace(vocab_size=1000))  # a dry run reads no token
    requests, arrivals = make_requests(ids_only, None, **lengths)
    paged = policy == "paged"
    watermark = (cfg["watermark"] if watermark is None else watermark) if paged else 0.0
    engine = Engine(
        None,
        num_pages=num_pages or cfg["num_pages"],
        page_size=cfg["page_size"],
        max_num_seqs=cfg["max_num_seqs"],
        max_batched_tokens=cfg["max_batched_tokens"],
        max_model_len=cfg["max_model_len"],
        reservation=Reservation(policy, watermark=watermark),
        eos_token_id=[],
    )
    for (prompt, new), t in zip(requests, arrivals):
        engine.add_request(prompt, max_new_tokens=new, arrival_s=0.0 if rate is None else t / (rate * step_s))
    return DryBench(engine, engine.run(), requests)


def watermark_trade(watermarks, *, rate: float, step_s: float, profile: str = "cpu") -> list[dict]:
    """`DryBench.summary` of ``paged`` on the benchmark's pool for each watermark, with
    ``watermark`` and ``watermark_pages`` (the pages admission keeps free)."""
    rows = []
    for w in watermarks:
        run = bench_dry("paged", rate=rate, step_s=step_s, profile=profile, watermark=w)
        rows.append({"watermark": w, "watermark_pages": run.engine.scheduler.watermark_pages, **run.summary()})
    return rows
