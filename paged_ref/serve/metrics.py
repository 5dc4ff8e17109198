"""What a serving run is judged by: throughput, time to first token, time per output token.

*Time to first token* (TTFT) is queueing plus prefill: what a user waits before text appears.
*Time per output token* (TPOT) is the gap between later tokens: how fast the text then flows.
They pull apart under load: a scheduler that admits more requests at once raises throughput and
cuts queueing (TTFT), while every decode step, now carrying more rows, takes longer (TPOT).

`summarize` computes those per request; `StepRecord` is what one engine step did, and
`engine_stats` adds up a run's steps and queues (`paged_ref.serve.Engine.stats`).

Example:
    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 90)
    (2.5, 3.7)
    >>> from paged_ref.serve.request import RequestOutput
    >>> out = RequestOutput(0, [1], [5, 6, 7], "length", 0.0, 1.0, 3.0, 1.0, 1.0, 0)
    >>> summarize([out])["tokens_per_s"]
    1.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .request import FINISHED, RequestOutput

__all__ = ["StepRecord", "engine_stats", "percentile", "summarize"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks (numpy's default);
    None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(outputs: Sequence[RequestOutput]) -> dict:
    """Throughput and latency percentiles of finished requests (aborted and failed ones are left out).

    Returns ``requests``, ``tokens`` (generated), ``span_s`` (first arrival to last finish),
    ``tokens_per_s`` (generated tokens over the span), ``ttft_p50_s``/``ttft_p90_s``,
    ``tpot_p50_s``/``tpot_p90_s``, ``latency_p50_s``/``latency_p90_s`` (arrival to finish) and
    ``normalized_latency_s``: the mean over requests of latency per generated token (the vLLM
    paper's measure of a serving system under load).
    """
    done = [o for o in outputs if o.finish_reason not in ("abort", "error")]
    if not done:
        raise ValueError("summarize needs at least one finished request")
    tokens = sum(len(o.token_ids) for o in done)
    span = max(o.finish_s for o in done) - min(o.arrival_s for o in done)
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    tpot = [o.tpot_s for o in done if o.tpot_s is not None]
    latency = [o.finish_s - o.arrival_s for o in done]
    return {
        "requests": len(done),
        "tokens": tokens,
        "span_s": span,
        "tokens_per_s": tokens / span if span > 0 else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p90_s": percentile(tpot, 90),
        "latency_p50_s": percentile(latency, 50),
        "latency_p90_s": percentile(latency, 90),
        "normalized_latency_s": sum(t / len(o.token_ids) for t, o in zip(latency, done)) / len(done),
    }


@dataclass(frozen=True)
class StepRecord:
    """What one step did (``Engine.history``). Times in seconds of wall time, whatever the clock.

    ``owners``/``fill`` (with ``Engine(trace=True)``): per physical page, the request holding it
    (-1: free; a page shared by several requests names the oldest) and the tokens stored in it,
    right after the step's forward.
    """

    step: int
    now: float  # the engine's clock after the step
    rows: int  # requests in the forward
    decode_rows: int  # of which decoding one token
    tokens: int  # tokens fed (decodes + prefill chunks)
    pages_used: int  # pages held during the forward (before eviction hooks and finishes)
    committed_pages: int  # pages held or committed to running requests (reservations)
    running: int
    waiting: int
    swapped: int
    preempted: tuple[int, ...]  # request ids preempted while planning this step
    admitted: tuple[int, ...]
    finished: tuple[int, ...]
    step_s: float
    schedule_s: float  # planning the step: queues, admission, preemption, swaps
    plan_s: float  # the session laying out the forward (slots, block table, attention inputs)
    forward_s: float  # the model's forward, plan excluded
    post_s: float  # sampling and finishing requests
    owners: tuple[int, ...] | None = None
    fill: tuple[int, ...] | None = None

    @property
    def overhead_s(self) -> float:
        """The engine's own time in the step: everything but the model's forward."""
        return self.schedule_s + self.plan_s + self.post_s


def engine_stats(*, clock: str, requests, history, counts: dict, scheduler, pending: int, kv) -> dict:
    """`paged_ref.serve.Engine.stats`: the run's counters from its requests, step history, running
    counts, scheduler queues, requests not arrived yet (``pending``) and cache. ``tokens_per_s``: generated
    tokens over first arrival to last finish; ``prompt_tokens``: computed the first time; ``recomputed_tokens``:
    fed again after a preemption; ``peak_pages``: most held during a forward; ``peak_committed_pages``: held
    or committed; ``overhead_share``: scheduling, laying out the forward and sampling over the steps' time."""
    done = [r for r in requests if r.status == FINISHED and r.finish_reason not in ("abort", "error")]
    span = 0.0
    if done:
        span = max(r.finish_s for r in done) - min(r.arrival_s for r in done)
    h = history
    busy = sum(s.step_s for s in h)
    overhead = sum(s.overhead_s for s in h)
    c = counts
    return {
        "clock": clock,
        "steps": len(h),
        "tokens": c["generated"],
        "tokens_per_s": c["generated"] / span if span > 0 else None,
        "span_s": span,
        "busy_s": busy,
        "prompt_tokens": c["prompt_tokens"],
        "recomputed_tokens": c["recomputed_tokens"],
        "prefix_hit_tokens": c["prefix_hit_tokens"],
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "swapped": len(scheduler.swapped),
        "pending": pending,
        "peak_running": c["peak_running"],
        "mean_running": sum(s.rows for s in h) / len(h) if h else 0.0,
        "peak_pages": c["peak_pages"],
        "peak_committed_pages": c["peak_committed_pages"],
        "free_pages": kv.allocator.num_free,
        "num_pages": kv.num_pages,
        "preemptions": scheduler.preemptions,
        "swapped_out_tokens": scheduler.swap.swapped_out_tokens,
        "swapped_in_tokens": scheduler.swap.swapped_in_tokens,
        "schedule_s": sum(s.schedule_s for s in h),
        "plan_s": sum(s.plan_s for s in h),
        "forward_s": sum(s.forward_s for s in h),
        "post_s": sum(s.post_s for s in h),
        "overhead_share": overhead / busy if busy > 0 else None,
    }
