"""The engine: a stream of requests served from one page pool, one forward per step.

Each `Engine.step` queues the requests that have arrived, asks the `Scheduler` for the step's rows
(their pages taken at once), runs **one** packed ``session.extend`` over decode rows and prefill
chunks side by side, and gives every request whose tokens are all computed its greedy next token,
finishing it on ``max_new_tokens`` or EOS (its pages go back at once). A step is all or nothing: if
it raises, all is put back (`paged_ref.serve.undo`, which also says when a request ends with an error).

Clocks: ``"simulated"`` (default with a model) adds each step's wall time and skips idle gaps;
``"real"`` reads the wall clock and sleeps when idle; ``"steps"`` (a dry run's default) counts steps.

Example:
    >>> import torch
    >>> from paged_ref.models import tiny_llama
    >>> from paged_ref import hf
    >>> model = tiny_llama()
    >>> engine = Engine(model, num_pages=6, page_size=4, max_num_seqs=4, max_batched_tokens=8, eos_token_id=[])
    >>> a = engine.add_request([1, 5, 9, 4, 7], max_new_tokens=6)
    >>> b = engine.add_request([3, 8], max_new_tokens=4, arrival_s=0.5)
    >>> outs = engine.run()
    >>> [o.request_id for o in outs], [len(o.token_ids) for o in outs]
    ([0, 1], [6, 4])
    >>> alone = hf.generate(model, torch.tensor([[1, 5, 9, 4, 7]]), max_new_tokens=6, eos_token_id=[])
    >>> outs[0].token_ids == alone[0, 5:].tolist()
    True
    >>> engine.stats()["free_pages"]
    6
"""

from __future__ import annotations

import heapq
import time

from .._validate import check_choice, check_int, check_real, eos_ids
from ..cache import PagedKVCache
from ._checks import check_eviction, check_request_id, prompt_list, refusal
from .dry import DrySession
from .metrics import COUNTS, StepClock, StepRecord, count_fed, engine_stats, record_step
from .request import FINISHED, PENDING, Request, RequestOutput
from .reservation import Reservation
from .scheduler import Scheduler
from .undo import StepCheckpoint

__all__ = ["CLOCKS", "Engine", "StepRecord"]

CLOCKS = ("simulated", "real", "steps")


def _open_session(model, fast, rows: int, max_model_len, *, kv_format, **pool):
    """The step's session (a `DrySession` for ``model=None``), the model's vocabulary size and EOS ids
    (None and ``[]`` for a dry run), and the longest request: by default, and at most, the model's
    ``max_position_embeddings``. ``pool``: the cache's ``num_pages``, ``page_size`` and ``prefix_caching``."""
    if model is None:
        for name, value in (("fast", fast), ("kv_format", kv_format)):
            if value is not None and value is not False:
                raise ValueError(
                    f"{name} needs a model: a dry run (Engine(None, ...)) computes no token, got {value!r}"
                )
        return DrySession(**pool), None, [], max_model_len
    from ..hf.session import PagedSession, fast_step

    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)  # not a model: refused below
    if max_model_len is None:
        max_model_len = limit
    elif limit is not None and check_int("max_model_len", max_model_len, min_value=1) > limit:
        raise ValueError(f"max_model_len must be <= the model's max_position_embeddings={limit}, got {max_model_len}")
    kv = PagedKVCache.for_model(model, **pool, kv_format=kv_format)
    session = PagedSession(model, kv_cache=kv, fast=fast_step(fast, model, rows=rows)).open()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return session, model.config.vocab_size, eos, max_model_len


class Engine:
    """Continuous batching over one page pool; see the module docstring.

    Args:
        model: a transformers causal LM, or None for a dry run (`paged_ref.serve.dry`: no token computed).
        reservation, preemption, max_num_seqs, max_batched_tokens: the `Scheduler`'s (``reservation``: a
            name, keeping 1% of the pool free, or a `paged_ref.serve.reservation.Reservation` with its own share).
        kv_format: K and V in 8 bits (`paged_ref.quant.KVFormat`, an 8-bit dtype or vLLM's "fp8"); None: the
            model's dtype.
        fast: the CPU speed-ups (`paged_ref.fast.Fast`; True: all the model allows, attention through
            ``cpu_paged`` and the few-rows kernel up to ``max_num_seqs`` rows and its `kernel_rows`); None: eager.
        max_model_len: longest request; default the model's ``max_position_embeddings`` (dry: the pool).
        eos_token_id: int or ints that end a request (default the model's; ``[]``: never).

    ``observers``: callables ``f(engine)`` run inside each step after its forward, before the requests it
    finished give their pages back (`paged_ref.lab.page_trace` reads the pool there); one that raises undoes the step.
    """

    HOOK_TRIES = 3  # a request whose own eviction hook raises in this many steps is finished with an error

    def __init__(
        self,
        model,
        *,
        num_pages: int,
        page_size: int = 16,
        max_num_seqs: int = 64,
        max_batched_tokens: int = 512,
        reservation: str | Reservation = "paged",
        preemption: str = "recompute",
        prefix_caching: bool = False,
        fast=None,
        kv_format=None,
        max_model_len: int | None = None,
        eos_token_id: int | list[int] | None = None,
        clock: str | None = None,
    ):
        default_clock = "steps" if model is None else "simulated"
        self.clock = check_choice("clock", default_clock if clock is None else clock, CLOCKS)
        pool = dict(num_pages=num_pages, page_size=page_size, prefix_caching=prefix_caching, kv_format=kv_format)
        opened = _open_session(model, fast, max_num_seqs, max_model_len, **pool)
        self.session, self.vocab_size, eos, max_model_len = opened
        self.model = model
        self.kv = self.session.kv
        try:
            self.eos = frozenset(eos_ids(eos if eos_token_id is None else eos_token_id, self.vocab_size))
            self.scheduler = Scheduler(
                self.session,
                max_num_seqs=max_num_seqs,
                max_batched_tokens=max_batched_tokens,
                reservation=reservation,
                preemption=preemption,
                max_model_len=max_model_len,
            )
        except BaseException:
            self.session.close()
            raise
        self.observers: list = []
        self.history: list[StepRecord] = []
        self._requests: list[Request] = []  # every request ever added, by id
        self._pending: list[tuple[float, int]] = []  # heap of (arrival_s, request_id) not arrived yet
        self._unreturned: list[int] = []  # ids `run` has not returned yet
        self._origin = time.perf_counter()
        self._now = 0.0
        self._counts = dict.fromkeys(COUNTS, 0)

    # ------------------------------------------------------------------ requests in
    @property
    def now(self) -> float:
        """The engine's clock (see the module docstring)."""
        return time.perf_counter() - self._origin if self.clock == "real" else self._now

    def add_request(self, prompt_ids, *, max_new_tokens: int, arrival_s: float | None = None, eviction=None) -> int:
        """Queue a request; returns its id (0, 1, 2, ... in submission order). ``arrival_s``: on the
        engine's clock (default now); ``eviction``: an `paged_ref.eviction.EvictionPolicy` for its K/V
        (one object can serve many). Bad arguments, or a request this pool could never serve, raise
        TypeError / ValueError and queue nothing."""
        prompt = prompt_list(prompt_ids, self.vocab_size)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, min_value=1)
        now = self.now
        arrival = now if arrival_s is None else arrival_s
        arrival_s = check_real("arrival_s", arrival, "a finite number of seconds or None")
        check_eviction(eviction, self.session)
        r = Request(len(self._requests), prompt, max_new_tokens, arrival_s, eviction)
        why = refusal(self.scheduler, r)
        if why is not None:
            raise ValueError(f"add_request: this request can never be served: {why}")
        self._requests.append(r)
        self._unreturned.append(r.request_id)
        if r.arrival_s <= now:
            self.scheduler.add(r)
        else:
            heapq.heappush(self._pending, (r.arrival_s, r.request_id))
        return r.request_id

    def abort(self, request_id: int) -> RequestOutput:
        """Stop a request that has not finished, freeing its pages (or host copy) at once; returns its
        `RequestOutput` (``finish_reason="abort"``, the tokens generated so far)."""
        r = self._requests[check_request_id(request_id, len(self._requests))]
        if r.status == FINISHED:
            raise ValueError(f"request {request_id} has already finished ({r.finish_reason}); nothing to abort")
        if r.status == PENDING:
            self._pending.remove((r.arrival_s, r.request_id))
            heapq.heapify(self._pending)
        self.scheduler.remove(r)
        self._finish(r, "abort")
        return r.output()

    # ------------------------------------------------------------------ steps
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward, all or nothing (observers included); the requests it finished."""
        if not self.has_unfinished_requests():
            return []
        with StepCheckpoint(self) as step:  # undone whole if it raises (`paged_ref.serve.undo`)
            clock = StepClock(self.session)  # the phases, timed (`paged_ref.serve.metrics`)
            sched = step.sched = self._schedule(step.horizon)  # 1. schedule: preemptions, swaps, admissions, rows
            clock.scheduled(self.kv)
            logits = self.session.extend(*sched.inputs(), packed=True, reserved=True)  # 2. forward: [rows, vocab]
            clock.forwarded()
            next_tokens = logits.argmax(dim=-1).tolist()  # 3. sample (greedy)
            for observe in self.observers:  # they see the pool the forward left
                observe(self)
        # undone: the requests whose own eviction hook kept raising, finished with an error; else 4. finish
        return step.outputs or self._finish_step(sched, next_tokens, clock)

    def _schedule(self, horizon: float):
        """The requests that have arrived by ``horizon`` queued, the step's `Schedule` (its rows' pages taken)."""
        self._arrive(horizon)
        sched = self.scheduler.schedule()
        if not sched.rows:
            raise RuntimeError(f"the scheduler planned no tokens: {self.scheduler.queues()}")
        return sched

    def _finish_step(self, sched, next_tokens: list[int], clock: StepClock) -> list[RequestOutput]:
        """Count each row's tokens as computed and give a row that completed its tokens its next token (EOS or
        max_new_tokens finish it); then finished requests free their pages, the clock moves."""
        count_fed(self._counts, sched)
        finished = []
        for (r, n), token in zip(sched.rows, next_tokens):
            r.num_computed += n
            r.high_water = max(r.high_water, r.num_computed)
            if r.num_computed < r.num_tokens:  # mid-prefill: these logits are not needed
                continue
            r.output_ids.append(token)
            self._counts["generated"] += 1
            if token in self.eos:
                finished.append((r, "stop"))
            elif len(r.output_ids) == r.max_new_tokens:
                finished.append((r, "length"))
        pages = clock.pages_used, clock.pages_used + self.scheduler.unfilled_commitments(), len(self.scheduler.running)
        for r, _ in finished:
            self.scheduler.remove(r)
        times = clock.end()
        if self.clock == "simulated":
            self._now += times[-1] - times[0]
        elif self.clock == "steps":
            self._now += 1.0
        now = self.now
        for r, _ in sched.rows:
            if r.first_token_s is None and r.output_ids:
                r.first_token_s = now
        for r, reason in finished:
            self._finish(r, reason, now)
        done = [r for r, _ in finished]
        record_step(self.history, self._counts, sched, done, self.scheduler, now=now, pages=pages, times=times)
        return [r.output() for r in done]

    def has_unfinished_requests(self) -> bool:
        """True while a request added is not finished: waiting, running, swapped or yet to arrive."""
        return self.scheduler.has_work or bool(self._pending)

    def run(self) -> list[RequestOutput]:
        """Step until every added request is done; the outputs of those added since the last `run`
        (aborted ones included), in submission order."""
        while self.has_unfinished_requests():
            self.step()
        outs = [self._requests[i].output() for i in self._unreturned]
        self._unreturned = []
        return outs

    def _arrive(self, horizon: float) -> None:
        """Queue the requests arrived by ``horizon`` (the checkpoint's); with none queued, first wait for the next
        (the clock moves to its arrival)."""
        if not self.scheduler.has_work and self._pending:
            if self.clock == "real":
                time.sleep(max(0.0, self._pending[0][0] - self.now))
            else:
                self._now = max(self._now, self._pending[0][0])
        now = min(self.now, horizon)
        while self._pending and self._pending[0][0] <= now:
            _, rid = heapq.heappop(self._pending)
            self.scheduler.add(self._requests[rid])

    def _finish(self, r: Request, reason: str, now: float | None = None) -> None:
        r.status = FINISHED
        r.finish_reason = reason
        r.finish_s = self.now if now is None else now

    # ------------------------------------------------------------------ what happened
    def stats(self) -> dict:
        """Counters of the run so far (`paged_ref.serve.metrics.engine_stats`; times on ``clock``)."""
        pending = len(self._pending)
        return engine_stats(self.clock, self._requests, self.history, self._counts, self.scheduler, pending, self.kv)

    def close(self) -> None:
        """Abort every request in flight, freeing its pages."""
        for r in self._requests:
            if r.status != FINISHED:
                self.abort(r.request_id)
