"""A `paged_ref.lab.fragmentation.Workload` served by the engine's own scheduler, dry (no model).

Notebook 03 simulates allocation with token counts: one token per running request per step,
prefill free in the admission step, preemption's price counted but not charged. `replay` serves
the same requests through `Engine(None, ...)`: the scheduler that serves a real model, with a token
budget per step (prefill chunks and recomputation take their share of it), a watermark at
admission, and preemption by recompute (or swap). A step is one forward of at most
``max_batched_tokens`` tokens and the clock counts steps, so prompts and every recomputed token
cost steps here. Request ``i`` arrives at step ``workload.arrival[i]``, with a prompt of
``prompt_len[i]`` tokens, and generates ``output_len[i]`` tokens (its K/V then holds one token
fewer than ``total_len``: the last token generated is never fed back).

Example:
    >>> from paged_ref.lab.fragmentation import make_workload
    >>> wl = make_workload(20, seed=0, mean_prompt=32, mean_output=32, max_len=256)
    >>> run = replay(wl, num_pages=64, page_size=16, max_batched_tokens=256)
    >>> s = run.summary()
    >>> s["tokens"] == int(wl.output_len.sum()), run.engine.stats()["free_pages"]
    (True, 64)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..serve.engine import Engine
from ..serve.metrics import summarize
from ..serve.request import RequestOutput
from .fragmentation import Workload

__all__ = ["Replay", "replay"]


@dataclass
class Replay:
    """A finished dry run: the engine (``stats()``, ``history``) and every request's output."""

    engine: Engine
    outputs: list[RequestOutput]
    workload_tokens: int  # prompt + output tokens of the workload

    def summary(self) -> dict:
        """`summarize` (times in steps) plus the engine's counters: ``steps`` (forwards),
        ``makespan`` (first arrival to last finish, idle steps included), ``mean_running``,
        ``peak_running``, ``preemptions``, ``recomputed_tokens``, ``recompute_share`` (recomputed
        tokens per token of the workload) and ``computed_share``: tokens fed to the model (prompts,
        recomputation, decodes) per token the workload must feed (prompt + output - 1 per request)."""
        s = self.engine.stats()
        out = summarize(self.outputs)
        out.update(
            makespan=out["span_s"],
            steps=s["steps"],
            mean_running=s["mean_running"],
            peak_running=s["peak_running"],
            preemptions=s["preemptions"],
            recomputed_tokens=s["recomputed_tokens"],
            recompute_share=s["recomputed_tokens"] / self.workload_tokens,
            computed_share=sum(h.tokens for h in self.engine.history) / (self.workload_tokens - len(self.outputs)),
        )
        return out


def replay(
    workload: Workload,
    *,
    num_pages: int,
    page_size: int = 16,
    reservation: str = "paged",
    preemption: str = "recompute",
    max_num_seqs: int = 256,
    max_batched_tokens: int = 2048,
    watermark: float = 0.01,
    trace: bool = False,
) -> Replay:
    """Serve ``workload`` on a dry engine with these settings (see the module docstring)."""
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a paged_ref.lab.fragmentation.Workload, got {type(workload).__name__}")
    engine = Engine(
        None,
        num_pages=num_pages,
        page_size=page_size,
        reservation=reservation,
        preemption=preemption,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        watermark=watermark,
        max_model_len=workload.max_len,
        trace=trace,
    )
    for arrival, prompt, output in zip(
        workload.arrival.tolist(), workload.prompt_len.tolist(), workload.output_len.tolist()
    ):
        engine.add_request([0] * prompt, max_new_tokens=output, arrival_s=float(arrival))
    return Replay(engine, engine.run(), int(workload.total_len.sum()))
