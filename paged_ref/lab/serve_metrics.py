"""What a serving run is judged by: throughput, time to first token, time per output token.

*Time to first token* (TTFT) is queueing plus prefill: what a user waits before text appears.
*Time per output token* (TPOT) is the gap between later tokens: how fast the text then flows.
They pull apart under load: a scheduler that admits more requests at once raises throughput and
cuts queueing (TTFT), while every decode step, now carrying more rows, takes longer (TPOT).
`summarize` computes those over a run's `paged_ref.serve.RequestOutput` list.

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

from ..serve.request import RequestOutput

__all__ = ["percentile", "summarize"]


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
