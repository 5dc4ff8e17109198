"""The engine's bookkeeping: a step's phases timed (`StepClock`), what each step did (`StepRecord`)
and the run's counters (`engine_stats`).

Throughput, time to first token and time per output token over a run's outputs:
`paged_ref.lab.serve_metrics`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .request import FINISHED

__all__ = ["COUNTS", "StepClock", "StepRecord", "count_fed", "engine_stats", "record_step"]

COUNTS = ("generated", "prompt_tokens", "recomputed_tokens", "prefix_hit_tokens")
COUNTS += ("peak_running", "peak_pages", "peak_committed_pages")


@dataclass(frozen=True)
class StepRecord:
    """What one step did (``Engine.history``). Times in seconds of wall time, whatever the clock."""

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

    @property
    def overhead_s(self) -> float:
        """The engine's own time in the step: everything but the model's forward."""
        return self.schedule_s + self.plan_s + self.post_s


class StepClock:
    """A step's phases on ``perf_counter``: its start, after scheduling (with the pages then held),
    after the forward and its end; and the seconds the session spent laying out the forward."""

    def __init__(self, session):
        self.session, self.plan_before = session, session.plan_seconds
        self.marks = [time.perf_counter()]

    def scheduled(self, kv) -> None:
        self.marks.append(time.perf_counter())
        self.pages_used = kv.num_pages - kv.allocator.num_free  # the rows' pages are taken

    def forwarded(self) -> None:
        self.marks.append(time.perf_counter())

    def end(self) -> tuple[float, float, float, float, float]:
        """``(started, scheduled, forwarded, plan_s, ended)``, as `record_step` takes them."""
        started, scheduled, forwarded = self.marks
        return started, scheduled, forwarded, self.session.plan_seconds - self.plan_before, time.perf_counter()


def count_fed(counts: dict, sched) -> None:
    """Count a step's rows before they are marked computed: the prefix hits of the requests it
    admitted, prompt tokens computed the first time, tokens computed again after a preemption."""
    for r in sched.admitted:
        counts["prefix_hit_tokens"] += r.num_computed
    for r, n in sched.rows:
        start = r.num_computed
        counts["recomputed_tokens"] += max(0, min(r.high_water, start + n) - start)
        counts["prompt_tokens"] += max(0, min(len(r.prompt_ids), start + n) - max(start, r.high_water))


def record_step(history: list, counts: dict, sched, finished, scheduler, *, now, pages, times) -> None:
    """Append what the step ``sched`` did to ``history`` and raise the peaks in ``counts``. ``pages``: held
    during the forward, held or committed then, requests running then; ``times``: ``perf_counter`` at the
    start, after scheduling and after the forward, the session's plan seconds, ``perf_counter`` at the end."""
    pages_used, committed, running = pages
    started, scheduled, forwarded, plan_s, ended = times
    counts["peak_running"] = max(counts["peak_running"], len(sched.rows))
    counts["peak_pages"] = max(counts["peak_pages"], pages_used)
    counts["peak_committed_pages"] = max(counts["peak_committed_pages"], committed)
    history.append(
        StepRecord(
            step=len(history),
            now=now,
            rows=len(sched.rows),
            decode_rows=sum(1 for r, n in sched.rows if n == 1 and r.remaining == 1),
            tokens=sum(n for _, n in sched.rows),
            pages_used=pages_used,
            committed_pages=committed,
            running=running,
            waiting=len(scheduler.waiting),
            swapped=len(scheduler.swapped),
            preempted=tuple(r.request_id for r in sched.preempted),
            admitted=tuple(r.request_id for r in sched.admitted),
            finished=tuple(r.request_id for r in finished),
            step_s=ended - started,
            schedule_s=scheduled - started,
            plan_s=plan_s,
            forward_s=forwarded - scheduled - plan_s,
            post_s=ended - forwarded,
        )
    )


def engine_stats(clock: str, requests, history, counts: dict, scheduler, pending: int, kv) -> dict:
    """`paged_ref.serve.Engine.stats`. ``tokens_per_s``: generated tokens over first arrival to last finish;
    ``peak_pages``: most held during a forward; ``overhead_share``: the engine's own share of the steps' time."""
    done = [r for r in requests if r.status == FINISHED and r.finish_reason not in ("abort", "error")]
    span = max(r.finish_s for r in done) - min(r.arrival_s for r in done) if done else 0.0
    h, c = history, counts
    busy = sum(s.step_s for s in h)
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
        **{phase: sum(getattr(s, phase) for s in h) for phase in ("schedule_s", "plan_s", "forward_s", "post_s")},
        "overhead_share": sum(s.overhead_s for s in h) / busy if busy > 0 else None,
    }
