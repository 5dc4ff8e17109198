"""Fragmentation of KV memory, read from the serving engine's own dry runs.

A workload (:func:`make_workload`) is a seeded stream of mixed-length requests. :func:`serve_dry`
serves it through `paged_ref.serve.Engine` with no model (``Engine(None, ...)``: the scheduler that
serves the real model, over a real page pool; `paged_ref.serve.dry`) under one of the engine's
reservations, ``"paged"``, ``"exact"`` or ``"max_len"`` (`paged_ref.serve.scheduler`), and after
every step reads where the pool's token slots are:

* ``used``: tokens whose K/V the running requests hold;
* ``last_page``: slots of held pages that hold no token: the empty end of each request's last
  page (internal fragmentation of paging; fewer than ``page_size`` per request);
* ``future``: slots of pages committed to a request (``"exact"``, ``"max_len"``) and not yet
  taken, that it will fill before it ends;
* ``waste``: slots of committed pages that it will never fill (``"max_len"``'s tail past the
  request's own length: reservation waste);
* ``free``: slots of pages neither held nor committed.

The five add up to the pool at every step. Committed pages are still pages, so ``"exact"`` here
pays a contiguous cache's memory cost without its external fragmentation (no holes to fit):
what it shows is an upper bound on a contiguous server.

Example:
    >>> wl = make_workload(20, seed=0, mean_prompt=32, mean_output=32, max_len=256)
    >>> run = serve_dry(wl, num_pages=64, page_size=16, max_batched_tokens=256)
    >>> s = run.summary()
    >>> s["tokens"] == int(wl.output_len.sum()), run.engine.stats()["free_pages"], 0 < s["used"] < 1
    (True, 64, True)
    >>> bool((run.used + run.last_page + run.future + run.waste + run.free == 64 * 16).all())
    True
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .._validate import check_choice, check_int
from ..block_table import pages_needed
from ..serve.engine import Engine
from ..serve.request import RequestOutput
from ..serve.reservation import Reservation
from ..serve.scheduler import RESERVATIONS
from .page_trace import PageTrace
from .serve_metrics import summarize

__all__ = [
    "CATEGORIES",
    "DryRun",
    "Workload",
    "compare_reservations",
    "make_workload",
    "page_size_sweep",
    "requests_that_fit",
    "serve_dry",
]

#: Where a slot of the pool is after a step (see the module docstring); they add up to the pool.
CATEGORIES = ("used", "last_page", "future", "waste", "free")


@dataclass(frozen=True)
class Workload:
    """Requests to serve. Arrays are int64 ``[num_requests]``, ordered by arrival step."""

    arrival: np.ndarray  # step at which each request arrives (non-decreasing, >= 0)
    prompt_len: np.ndarray  # tokens in the prompt (>= 1)
    output_len: np.ndarray  # tokens to generate (>= 1)
    max_len: int  # the model's context limit: prompt_len + output_len <= max_len

    def __post_init__(self):
        max_len = check_int("max_len", self.max_len, min_value=2)
        arrays = {}
        for name in ("arrival", "prompt_len", "output_len"):
            a = np.asarray(getattr(self, name))
            if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
                raise TypeError(f"{name} must be a 1-D integer array, got dtype {a.dtype} and shape {a.shape}")
            arrays[name] = a.astype(np.int64)
        arrival, prompt, output = arrays["arrival"], arrays["prompt_len"], arrays["output_len"]
        if not len(arrival) == len(prompt) == len(output) >= 1:
            raise ValueError(
                f"arrival, prompt_len and output_len must have one equal length >= 1, "
                f"got {len(arrival)}, {len(prompt)}, {len(output)}"
            )
        for name, bad in (
            ("arrival", (arrival < 0) | np.r_[False, np.diff(arrival) < 0]),
            ("prompt_len", prompt < 1),
            ("output_len", output < 1),
            ("prompt_len + output_len", prompt + output > max_len),
        ):
            if bad.any():
                i = int(np.argmax(bad))
                rule = {"arrival": "non-decreasing and >= 0", "prompt_len + output_len": f"<= max_len = {max_len}"}.get(
                    name, ">= 1"
                )
                raise ValueError(f"{name} must be {rule}; request {i} breaks it")
        for name, a in arrays.items():
            object.__setattr__(self, name, a)
        object.__setattr__(self, "max_len", max_len)

    @property
    def total_len(self) -> np.ndarray:
        """Final length of each request, ``prompt_len + output_len``: int64 [num_requests]."""
        return self.prompt_len + self.output_len

    def __len__(self) -> int:
        return len(self.arrival)


def make_workload(
    num_requests: int,
    *,
    seed: int = 0,
    mean_prompt: float = 256.0,
    mean_output: float = 256.0,
    sigma: float = 1.0,
    arrival_rate: float = 0.5,
    max_len: int = 2048,
) -> Workload:
    """A seeded stream of mixed-length requests.

    Prompt and output lengths are lognormal with the given means and shape ``sigma`` (a long
    tail, as in chat traffic), rounded, at least 1, and clipped so that each request fits in
    ``max_len``. Arrivals form a Poisson process of ``arrival_rate`` requests per step.

    Example: ``make_workload(200, seed=1).total_len.max() <= 2048``.
    """
    num_requests = check_int("num_requests", num_requests, min_value=1)
    seed = check_int("seed", seed, min_value=0)
    max_len = check_int("max_len", max_len, min_value=2)
    for name, value in (
        ("mean_prompt", mean_prompt),
        ("mean_output", mean_output),
        ("sigma", sigma),
        ("arrival_rate", arrival_rate),
    ):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
        if not value > 0:  # also rejects NaN
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    rng = np.random.default_rng(seed)

    def lognormal(mean: float) -> np.ndarray:  # mean of exp(N(mu, sigma^2)) is exp(mu + s^2/2)
        return rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, num_requests)

    prompt = np.clip(np.rint(lognormal(mean_prompt)), 1, max_len - 1).astype(np.int64)
    output = np.clip(np.rint(lognormal(mean_output)), 1, max_len - prompt).astype(np.int64)
    arrival = np.floor(np.cumsum(rng.exponential(1.0 / arrival_rate, num_requests)))
    return Workload(arrival.astype(np.int64), prompt, output, max_len)


def _slots_after_step(engine: Engine) -> tuple[int, int, int, int, int, int, int]:
    """The pool's split now in slots, ``(used, last_page, future, waste, free)``, then ``(running, waiting)``."""
    kv, sched = engine.kv, engine.scheduler
    ps = kv.page_size
    used = future = waste = 0
    for r in sched.running:
        held = len(kv.pages(r.seq_id))
        used += kv.seq_len(r.seq_id)
        ahead = max(0, r.reserved_pages - held)  # committed, not taken yet
        fills = max(0, pages_needed(r.peak_tokens, ps) - held)  # of those, pages it will still fill
        future += min(ahead, fills) * ps
        waste += max(0, ahead - fills) * ps
    held_slots = (kv.num_pages - kv.allocator.num_free) * ps
    free = kv.num_pages * ps - held_slots - future - waste
    return used, held_slots - used, future, waste, free, len(sched.running), len(sched.waiting)


@dataclass(frozen=True)
class DryRun:
    """A finished dry run: the engine (``stats()``, ``history``), every request's output, and the pool's
    split after every step (int64 ``[num_steps]`` arrays of token slots, step ``i`` is ``history[i]``)."""

    engine: Engine
    outputs: list[RequestOutput]
    workload_tokens: int  # prompt + output tokens of the workload
    used: np.ndarray
    last_page: np.ndarray
    future: np.ndarray
    waste: np.ndarray
    free: np.ndarray
    running: np.ndarray  # requests running after the step
    waiting: np.ndarray  # requests queued after the step (arrived, not admitted, or preempted)
    trace: PageTrace | None = None  # the page map of every step, with ``serve_dry(trace=True)``

    @property
    def pool_slots(self) -> int:
        return self.engine.kv.num_pages * self.engine.kv.page_size

    def summary(self) -> dict:
        """Memory under pressure and what the run served.

        Memory: ``used``, ``last_page``, ``future``, ``waste``, ``free`` (shares of the pool) and
        ``running_under_pressure`` (requests running), averaged over the steps after which a request
        waited (memory was the bottleneck; all steps if none did); ``last_page_over_used``: empty slots
        of last pages per token stored. Served (times in steps): `paged_ref.lab.serve_metrics.summarize` plus
        ``makespan`` (first arrival to last finish), ``steps`` (forwards), ``tokens_per_step`` (generated
        tokens over the makespan), ``mean_running`` and ``peak_running`` (rows per forward, over all
        steps), ``preemptions``, ``recomputed_tokens``, ``recompute_share``
        (recomputed tokens per token of the workload) and ``computed_share`` (tokens fed to the model
        per token the workload must feed: prompt + output - 1 per request).
        """
        mask = self.waiting > 0
        if not mask.any():
            mask = self.running > 0
        pool = self.pool_slots
        kv, s = self.engine.kv, self.engine.stats()
        out = {
            "reservation": self.engine.scheduler.reservation,
            "page_size": kv.page_size,
            "pool_slots": pool,
            **{k: float(getattr(self, k)[mask].mean() / pool) for k in CATEGORIES},
            "running_under_pressure": float(self.running[mask].mean()),
            "pressure_steps": int(mask.sum()),
            "last_page_over_used": float(self.last_page[mask].mean() / self.used[mask].mean()),
        }
        out.update(summarize(self.outputs))
        out.update(
            makespan=out["span_s"],
            steps=s["steps"],
            tokens_per_step=out["tokens"] / out["span_s"],
            mean_running=s["mean_running"],
            peak_running=s["peak_running"],
            preemptions=s["preemptions"],
            recomputed_tokens=s["recomputed_tokens"],
            recompute_share=s["recomputed_tokens"] / self.workload_tokens,
            computed_share=sum(h.tokens for h in self.engine.history) / (self.workload_tokens - len(self.outputs)),
        )
        return out


def serve_dry(
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
) -> DryRun:
    """Serve ``workload`` on ``Engine(None, ...)`` with these settings, reading the pool after every step.

    Request ``i`` arrives at step ``workload.arrival[i]`` (the ``"steps"`` clock) with a prompt of
    ``prompt_len[i]`` tokens and generates ``output_len[i]``; ``max_model_len`` is ``workload.max_len``
    (what ``"max_len"`` reserves). A step is one forward of at most ``max_batched_tokens`` tokens:
    prompts, prefill chunks and recomputation after a preemption take their share of it. ``trace``:
    keep every step's page map (`paged_ref.lab.page_trace`) in the result's ``trace``.
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a paged_ref.lab.fragmentation.Workload, got {type(workload).__name__}")
    engine = Engine(
        None,
        num_pages=num_pages,
        page_size=page_size,
        reservation=Reservation(reservation, watermark=watermark),
        preemption=preemption,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        max_model_len=workload.max_len,
    )
    pages = PageTrace(engine) if trace else None
    for arrival, prompt, output in zip(
        workload.arrival.tolist(), workload.prompt_len.tolist(), workload.output_len.tolist()
    ):
        engine.add_request([0] * prompt, max_new_tokens=output, arrival_s=float(arrival))
    rows = []
    while engine.has_unfinished_requests():
        engine.step()
        rows.append(_slots_after_step(engine))
    series = np.asarray(rows, dtype=np.int64).T  # [7, num_steps]
    return DryRun(
        engine,
        engine.run(),  # every request is done: returns their outputs
        int(workload.total_len.sum()),
        *series,
        pages,
    )


def _pool(budget_slots, page_size) -> tuple[int, int]:
    budget = check_int("budget_slots", budget_slots, min_value=1)
    page_size = check_int("page_size", page_size, min_value=1)
    if budget % page_size:
        raise ValueError(f"budget_slots must be a multiple of page_size = {page_size}, got {budget}")
    return budget // page_size, page_size


def compare_reservations(workload: Workload, *, budget_slots: int, page_size: int = 16, **engine) -> list[dict]:
    """:meth:`DryRun.summary` of each reservation (``"paged"``, ``"exact"``, ``"max_len"``) on the same
    workload and a pool of ``budget_slots`` token slots; ``engine``: more `serve_dry` settings."""
    num_pages, page_size = _pool(budget_slots, page_size)
    return [
        serve_dry(workload, num_pages=num_pages, page_size=page_size, reservation=r, **engine).summary()
        for r in RESERVATIONS
    ]


def page_size_sweep(
    workload: Workload, *, budget_slots: int, page_sizes, reservation: str = "paged", **engine
) -> list[dict]:
    """:meth:`DryRun.summary` of one reservation for each page size, at the same pool in token slots."""
    check_choice("reservation", reservation, RESERVATIONS)
    out = []
    for p in page_sizes:
        num_pages, p = _pool(budget_slots, p)
        out.append(serve_dry(workload, num_pages=num_pages, page_size=p, reservation=reservation, **engine).summary())
    return out


def requests_that_fit(lengths, *, budget_slots: int, page_size: int, reserved_per_request: int) -> dict[str, int]:
    """How many of ``lengths`` (taken in order, all present at once) fit in ``budget_slots``.

    A static count at the requests' final lengths in fresh memory: ``"max_len"`` reserves
    ``reserved_per_request`` each, ``"exact"`` the length, ``"paged"`` whole pages.
    Example: ``requests_that_fit([19, 45, 70], budget_slots=256, page_size=16,
    reserved_per_request=128) == {"max_len": 2, "exact": 3, "paged": 3}``.
    """
    budget = check_int("budget_slots", budget_slots, min_value=1)
    page_size = check_int("page_size", page_size, min_value=1)
    reserved = check_int("reserved_per_request", reserved_per_request, min_value=1)
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise TypeError(f"lengths must be a sequence of ints, got {type(lengths).__name__}")
    lengths = [check_int(f"lengths[{i}]", n, min_value=1) for i, n in enumerate(lengths)]
    cost = {
        "max_len": lambda n: reserved,
        "exact": lambda n: n,
        "paged": lambda n: pages_needed(n, page_size) * page_size,
    }
    fit = {}
    for policy, slots in cost.items():
        spent, count = 0, 0
        for n in lengths:
            if (policy == "max_len" and n > reserved) or spent + slots(n) > budget:
                break
            spent += slots(n)
            count += 1
        fit[policy] = count
    return fit
