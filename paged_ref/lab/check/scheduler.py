"""`check_scheduler`: exercise 5's scheduler, step by step against `paged_ref.serve.Scheduler`.

The student writes the decision of a serving step (notebook 09): which running requests get how
many tokens, which request is preempted when a row needs a page and none is free, and which waiting
requests are admitted. What is given: the page pool (`Pool`: pages counted per request) and the
requests (`Req`); the checker plays the forward (every row's tokens counted as computed; a request
whose tokens are all computed gets its next token and finishes at ``max_new_tokens``).

The class the student writes::

    class MyScheduler:
        def __init__(self, pool, *, max_num_seqs, max_batched_tokens): ...
        def add(self, req): ...          # req arrived
        def schedule(self): ...          # -> [(req, num_tokens), ...]: this step's rows
        def finish(self, req): ...       # req finished (its pages are already back)

The same request streams (200 random ones, small pools, and hand-made edge cases: a pool exactly
full, a prompt longer than the budget, preemptions that cascade over several running requests, a
request that finishes in the step it is admitted, a request that can never fit) run through the
student's class and through `paged_ref.serve.Scheduler` over a `paged_ref.serve.dry.DrySession`
(vLLM's settings: paged reservation, no watermark, preemption by recompute). At every step the
rows, the preempted requests and the pages each request holds must agree; the first step that
differs is shown with what each side did and a hint naming the rule broken.
"""

from __future__ import annotations

import numbers
import random
from dataclasses import dataclass

from ..._arith import cdiv
from ...serve import VLLM_ADMISSION, Scheduler
from ...serve.dry import DrySession
from ...serve.request import Request
from .report import (
    DEFAULT_TIME_LIMIT_S,
    CheckReport,
    Failure,
    NotImplementedYet,
    OverTime,
    Run,
    StudentError,
    check_count,
    raised_hint,
)

__all__ = ["EDGE_CASES", "Pool", "Req", "Stream", "check_scheduler", "random_stream", "trace"]

MAX_STEPS = 400


class Req:
    """A request in flight (given). ``num_tokens``: prompt + tokens generated so far; ``num_computed``:
    tokens fed to the model since its latest admission; ``remaining``: tokens still to feed before it
    can sample its next token (1 while it decodes)."""

    def __init__(self, id: int, prompt_len: int, max_new_tokens: int):
        self.id, self.prompt_len, self.max_new_tokens = id, prompt_len, max_new_tokens
        self.generated = 0
        self.num_computed = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    def __repr__(self) -> str:
        return f"Req({self.id}: {self.num_computed}/{self.num_tokens} computed)"


class Pool:
    """The page pool (given): ``num_pages`` pages of ``page_size`` tokens, counted per request.

    ``pages_needed(req, n)``: new pages ``req`` needs to hold ``n`` more tokens; ``grow(req, n)``
    takes them (MemoryError, taking nothing, if fewer are free); ``free(req)`` gives back every page
    ``req`` holds and sets ``req.num_computed = 0`` (its K/V are gone); ``held(req)``: its pages.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._tokens: dict[int, int] = {}  # request id -> tokens it holds
        self.log: list[tuple[str, int, int]] = []  # ("grow" | "free", request id, tokens) since the step began

    @property
    def num_free(self) -> int:
        return self.num_pages - sum(cdiv(t, self.page_size) for t in self._tokens.values())

    def held(self, req) -> int:
        return cdiv(self._tokens.get(req.id, 0), self.page_size)

    def pages_needed(self, req, n: int) -> int:
        return cdiv(self._tokens.get(req.id, 0) + n, self.page_size) - self.held(req)

    def grow(self, req, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"pool.grow: n must be an int >= 1, got {n!r}")
        need = self.pages_needed(req, int(n))
        if need > self.num_free:
            raise MemoryError(f"pool.grow(req {req.id}, {n}) needs {need} new pages and {self.num_free} are free")
        self._tokens[req.id] = self._tokens.get(req.id, 0) + int(n)
        self.log.append(("grow", req.id, int(n)))

    def free(self, req) -> None:
        self._tokens.pop(req.id, None)
        req.num_computed = 0
        self.log.append(("free", req.id, 0))

    def holding(self) -> dict[int, int]:
        return {i: cdiv(t, self.page_size) for i, t in self._tokens.items() if t}


@dataclass(frozen=True)
class Stream:
    """One case: a pool, the scheduler's limits and requests ``(prompt_len, max_new_tokens, arrival_step)``."""

    num_pages: int
    page_size: int
    max_num_seqs: int
    max_batched_tokens: int
    requests: tuple[tuple[int, int, int], ...]
    name: str = ""

    def describe(self) -> str:
        reqs = ", ".join(f"{i}: {p}+{m} @{a}" for i, (p, m, a) in enumerate(self.requests))
        head = f"{self.name}: " if self.name else ""
        return (
            f"{head}pool of {self.num_pages} pages of {self.page_size} tokens, max_num_seqs={self.max_num_seqs}, "
            f"max_batched_tokens={self.max_batched_tokens}\nrequests (id: prompt tokens + max_new_tokens @ arrival "
            f"step): {reqs}"
        )


EDGE_CASES = (
    Stream(4, 4, 4, 16, ((16, 1, 0), (4, 2, 0)), "a pool exactly full"),
    Stream(6, 4, 4, 4, ((11, 3, 0), (3, 2, 0)), "a prompt longer than the budget"),
    Stream(6, 2, 5, 9, ((2, 6, 2), (1, 5, 2), (2, 3, 2), (5, 3, 1)), "a preemption that cascades over two requests"),
    Stream(4, 4, 3, 6, ((5, 1, 0), (2, 1, 0), (3, 2, 1)), "requests that finish in the step they are admitted"),
    Stream(4, 2, 4, 8, ((3, 2, 0), (9, 1, 0), (2, 2, 0)), "a request that can never fit (it blocks the queue)"),
    Stream(5, 2, 3, 5, ((3, 4, 0), (3, 4, 0), (3, 4, 0), (1, 3, 1)), "decodes and prefill chunks sharing the budget"),
)


def random_stream(rng: random.Random) -> Stream:
    page_size = rng.choice((1, 2, 4))
    num_pages = rng.randint(3, 10)
    capacity = num_pages * page_size
    reqs = []
    for _ in range(rng.randint(2, 7)):
        prompt = rng.randint(1, max(1, capacity * 2 // 3))
        new = rng.randint(1, 6)
        if prompt + new - 1 > capacity:  # could never finish: refused by the engine, not a scheduling case
            new = max(1, capacity - prompt + 1)
        reqs.append((prompt, new, rng.randint(0, 5)))
    return Stream(num_pages, page_size, rng.randint(1, 4), rng.randint(2, 12), tuple(reqs))


# ---------------------------------------------------------------------------------------- the two sides
class _Reference:
    """`paged_ref.serve.Scheduler` over a `DrySession`, stepped as `paged_ref.serve.Engine` steps it."""

    def __init__(self, s: Stream):
        self.session = DrySession(num_pages=s.num_pages, page_size=s.page_size)
        self.sched = Scheduler(self.session, max_num_seqs=s.max_num_seqs, max_batched_tokens=s.max_batched_tokens,
                               reservation=VLLM_ADMISSION)  # fmt: skip
        self.reqs = {
            i: Request(request_id=i, prompt_ids=[1] * p, max_new_tokens=m, arrival_s=0.0)
            for i, (p, m, _) in enumerate(s.requests)
        }

    def add(self, i: int) -> None:
        self.sched.add(self.reqs[i])

    def step(self) -> tuple[dict, list, set]:
        out = self.sched.schedule()
        rows = {r.request_id: n for r, n in out.rows}
        if out.rows:
            self.session.extend(*out.inputs(), reserved=True)
        holding = {r.request_id: len(self.session.kv.pages(r.seq_id)) for r in self.sched.running}
        finished = set()
        for r, n in out.rows:
            r.num_computed += n
            if r.num_computed >= r.num_tokens:
                r.output_ids.append(0)
                if len(r.output_ids) == r.max_new_tokens:
                    finished.add(r.request_id)
        for i in finished:
            self.sched.remove(self.reqs[i])
        return rows, [r.request_id for r in out.preempted], holding, finished

    def queues(self) -> tuple[list, list]:
        return [r.request_id for r in self.sched.running], [r.request_id for r in self.sched.waiting]


class _BadReturn(Exception):
    """The student's schedule() returned something that is not a list of (req, num_tokens) rows."""


def _student_rows(result, reqs: dict) -> dict[int, int]:
    if not isinstance(result, (list, tuple)):
        raise _BadReturn(f"schedule() returns a list of (req, num_tokens) pairs, got a {type(result).__name__}")
    rows: dict[int, int] = {}
    known = {id(r) for r in reqs.values()}
    for row in result:
        if not isinstance(row, (list, tuple)) or len(row) != 2:
            raise _BadReturn(f"each row is a pair (req, num_tokens), got {row!r}")
        req, n = row
        if id(req) not in known:
            raise _BadReturn(f"a row's first item must be one of the Req objects given to add(), got {req!r}")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise _BadReturn(f"a row's num_tokens must be an int, got {type(n).__name__} ({n!r})")
        if n < 1:
            raise _BadReturn(f"a row feeds at least one token; leave a request out instead of {n!r}")
        if req.id in rows:
            raise _BadReturn(f"request {req.id} has two rows in one step")
        rows[req.id] = int(n)
    return rows


def _show(rows: dict, preempted: list) -> str:
    text = "rows {" + ", ".join(f"req {i}: {n}" for i, n in rows.items()) + "}"
    return text + (f", preempted {preempted}" if preempted else ", no preemption")


# ---------------------------------------------------------------------------------------- hints
RULES = (
    "running requests first, oldest admission first: a decode takes 1 token, a prefill min(tokens left, budget "
    "left); a row that needs pages preempts the most recently admitted running request first; then waiting "
    "requests in order while the budget, max_num_seqs and the pool allow"
)


def _hint(ctx: dict, want: tuple, got: tuple, grows: dict) -> str:
    """Name the rule the student's step broke (``want``/``got``: rows, preempted, holding)."""
    (w_rows, w_pre, _), (g_rows, g_pre, g_hold) = want, got
    s, running, waiting, reqs = ctx["stream"], ctx["running"], ctx["waiting"], ctx["reqs"]
    budget, decodes = s.max_batched_tokens, [i for i in running if reqs[i].remaining == 1]
    if sum(g_rows.values()) > budget:
        extra = " (decode rows count too: one token each)" if any(i in decodes for i in g_rows) else ""
        return f"budget: the rows add up to {sum(g_rows.values())} tokens, more than max_batched_tokens={budget}{extra}"
    if len(g_hold) > s.max_num_seqs:
        return f"max_num_seqs: {len(g_hold)} requests hold pages, at most max_num_seqs={s.max_num_seqs} may run"
    if w_pre != g_pre:
        if w_pre and not g_pre:
            return (
                "preemption: a row needs pages and none are free, so the most recently admitted running request "
                "gives its pages back (pool.free(req)) and goes back to the front of the waiting queue"
            )
        if w_pre and g_pre and g_pre[0] != w_pre[0]:
            return (
                "preemption victim: the most recently admitted running request (the end of the running list) goes "
                "first, not the oldest and not the request that needs the page (unless it is the most recent)"
            )
        return "preempt one request at a time, only while the row still needs pages that are not free"
    for i, n in w_rows.items():  # the running requests' rows
        if i not in running:
            continue
        if i not in g_rows:
            return f"every running request gets a row while the budget lasts: request {i} was left out"
        m, r = g_rows[i], reqs[i]
        if m != n:
            if abs(m - n) == 1:
                return f"chunk size off by one: request {i} gets {n} tokens here: min(tokens it has left, budget left)"
            return f"chunk size: request {i} gets min(tokens it has left to feed, budget left) = {n}, not {m}"
    w_adm = [i for i in w_rows if i not in running]
    g_adm = [i for i in grows if i not in running]
    if w_adm != g_adm:
        if g_adm and w_pre:
            return "no request is admitted in a step that preempted one"
        k = next((j for j, (a, b) in enumerate(zip(w_adm, g_adm)) if a != b), min(len(w_adm), len(g_adm)))
        if k < len(g_adm):
            x, head = g_adm[k], waiting[k] if k < len(waiting) else None
            head_fits = head is not None and cdiv(reqs[head].num_tokens, s.page_size) <= ctx["free_after_rows"]
            if head is not None and x != head:
                if ctx["preempted_before"].get(head):
                    return (
                        "a preempted request goes back to the front of the waiting queue, not the back, at once "
                        "(appendleft): of two preempted in one step, the one preempted second is first"
                    )
                if not head_fits:
                    return (
                        "first come, first served: a waiting request that cannot be admitted blocks the ones behind "
                        "it (no skipping ahead)"
                    )
                return "first come, first served: admit waiting requests in arrival order, oldest first, not newest"
            whole = cdiv(reqs[x].num_tokens, s.page_size)
            if whole > ctx["free_after_rows"]:
                return (
                    f"whole-prompt admission: request {x} needs {whole} pages for its whole sequence (prompt, and the "
                    f"tokens it generated before a preemption) and {ctx['free_after_rows']} are free: admit only when "
                    "all of them are, not just its first chunk's"
                    + (
                        f" (ceil({reqs[x].num_tokens} / {s.page_size}) = {whole}: a partly filled last page counts)"
                        if reqs[x].num_tokens % s.page_size
                        else ""
                    )
                )
            if len(running) + k >= s.max_num_seqs:
                return f"max_num_seqs: at most {s.max_num_seqs} requests run at once"
            return f"admission: {RULES}"
        missing = w_adm[k]
        if w_rows[missing] < reqs[missing].num_tokens:
            return (
                "chunked prefill: a waiting request whose prompt is longer than the budget left is admitted anyway, "
                "with a first chunk of the budget left"
            )
        return (
            "admission: admit waiting requests in order while budget is left, fewer than max_num_seqs run and the "
            "pages of the request's whole sequence are free"
        )
    for i, n in w_rows.items():  # the admitted requests' first chunks
        m, r = g_rows.get(i), reqs[i]
        if m is not None and m != n:
            if r.generated and m == min(r.prompt_len, s.max_batched_tokens):
                return "a preempted request feeds its prompt and the tokens it had generated again, not its prompt only"
            if abs(m - n) == 1:
                return f"chunk size off by one: request {i}'s first chunk is min(its tokens, budget left) = {n}"
            return f"chunk size: request {i}'s first chunk is min(its tokens, budget left) = {n}, not {m}"
    for i in g_rows:
        if i not in w_rows:
            return f"request {i} gets no row here: {RULES}"
    if grows != g_rows:
        return "take each row's pages when you plan it: pool.grow(req, num_tokens) once per row, with its num_tokens"
    for i in w_pre:
        if g_hold.get(i):
            return "a preempted request's pages go back to the pool: pool.free(req)"
    return RULES


# ---------------------------------------------------------------------------------------- one stream
def _play(cls, s: Stream, run: Run, where: list) -> Failure | None:
    ref = _Reference(s)
    pool = Pool(s.num_pages, s.page_size)
    reqs = {i: Req(i, p, m) for i, (p, m, _) in enumerate(s.requests)}
    student = run.call(cls, pool, max_num_seqs=s.max_num_seqs, max_batched_tokens=s.max_batched_tokens)
    preempted_before: dict[int, bool] = {}
    last_arrival = max(a for _, _, a in s.requests)
    for step in range(MAX_STEPS):
        where[:] = [step]  # and the queues before the step, once they are known
        for i, (_, _, a) in enumerate(s.requests):
            if a == step:
                ref.add(i)
                run.call(lambda r=reqs[i]: student.add(r))
        running, waiting = ref.queues()
        ctx = dict(stream=s, running=running, waiting=waiting, reqs=reqs, preempted_before=dict(preempted_before))
        before = _state_line(step, running, waiting, reqs, pool)
        where[1:] = [_state_line(step, running, waiting, reqs, pool, "the one that raised")]
        w_rows, w_pre, w_hold, w_done = ref.step()
        pool.log = []
        try:
            result = run.call(lambda: student.schedule())
        except StudentError as raised:
            if isinstance(raised.error, MemoryError) and "pool.grow" in str(raised.error):
                return Failure(
                    f"{s.describe()}\n{before}",
                    _show(w_rows, w_pre),
                    f"schedule() raised {raised}",
                    "the row needed pages the pool did not have: preempt first (the most recently admitted running "
                    "request gives its pages back with pool.free(req)), and admit a waiting request only when the "
                    "pages of its whole sequence are free",
                )
            raise
        try:
            g_rows = _student_rows(result, reqs)
        except _BadReturn as bad:
            return Failure(f"{s.describe()}\n{before}", _show(w_rows, w_pre), f"{result!r}"[:200], str(bad))
        g_pre = [i for op, i, _ in pool.log if op == "free"]
        grows: dict[int, int] = {}
        for op, i, n in pool.log:
            if op == "grow":
                grows[i] = grows.get(i, 0) + n
        g_hold = pool.holding()
        ctx["free_after_rows"] = s.num_pages - sum(
            cdiv(reqs[i].num_computed + w_rows.get(i, 0), s.page_size) for i in running if i not in w_pre
        )
        order = [i for i in w_rows if i not in running] != [i for i in grows if i not in running]
        if (w_rows, w_pre) != (g_rows, g_pre) or w_hold != g_hold or grows != g_rows or order:
            hint = _hint(ctx, (w_rows, w_pre, w_hold), (g_rows, g_pre, g_hold), grows)
            got = _show(g_rows, g_pre) + (f"; pages held {g_hold}" if w_hold != g_hold else "")
            expected = _show(w_rows, w_pre) + (f"; pages held {w_hold}" if w_hold != g_hold else "")
            return Failure(f"{s.describe()}\n{before}", expected, got, hint)
        for i in w_pre:
            preempted_before[i] = True
        for i, n in g_rows.items():  # the forward
            r = reqs[i]
            r.num_computed += n
            if r.num_computed >= r.num_tokens:
                r.generated += 1
        for i in sorted(w_done):
            pool.free(reqs[i])
            run.call(lambda r=reqs[i]: student.finish(r))
        if not w_rows and step >= last_arrival:
            return None
    return None


def _state_line(
    step: int, running: list, waiting: list, reqs: dict, pool: Pool, what: str = "the first that differs"
) -> str:
    def show(i):
        r = reqs[i]
        return f"{i} (decoding)" if r.remaining == 1 else f"{i} (prefill, {r.remaining} left)"

    return (
        f"step {step}, {what}; before it: running {[show(i) for i in running]} (oldest admission "
        f"first), waiting {waiting} (queue order), {pool.num_free} free pages"
    ).replace("'", "")


def trace(cls, stream: Stream, max_steps: int = 60) -> list[str]:
    """A student's scheduler (or the solution) played alone on ``stream``: one line per step.

    Example:
        >>> from paged_ref.lab.check.scheduler import EDGE_CASES
        >>> class OneAtATime:                      # admits one request, feeds it whole, then the next
        ...     def __init__(self, pool, *, max_num_seqs, max_batched_tokens):
        ...         self.pool, self.queue, self.current = pool, [], None
        ...     def add(self, req):
        ...         self.queue.append(req)
        ...     def finish(self, req):
        ...         self.current = None
        ...     def schedule(self):
        ...         if self.current is None and self.queue:
        ...             self.current = self.queue.pop(0)
        ...         if self.current is None:
        ...             return []
        ...         n = self.current.remaining
        ...         self.pool.grow(self.current, n)
        ...         return [(self.current, n)]
        >>> print(*trace(OneAtATime, EDGE_CASES[0]), sep="\\n")
        step 0: rows {req 0: 16}, no preemption; 0 free pages after
        step 1: rows {req 1: 4}, no preemption; 3 free pages after
        step 2: rows {req 1: 1}, no preemption; 2 free pages after
    """
    pool = Pool(stream.num_pages, stream.page_size)
    reqs = {i: Req(i, p, m) for i, (p, m, _) in enumerate(stream.requests)}
    sched = cls(pool, max_num_seqs=stream.max_num_seqs, max_batched_tokens=stream.max_batched_tokens)
    lines, done = [], set()
    for step in range(max_steps):
        for i, (_, _, a) in enumerate(stream.requests):
            if a == step:
                sched.add(reqs[i])
        pool.log = []
        rows = _student_rows(sched.schedule(), reqs)
        preempted = [i for op, i, _ in pool.log if op == "free"]
        lines.append(f"step {step}: {_show(rows, preempted)}; {pool.num_free} free pages after")
        for i, n in rows.items():
            r = reqs[i]
            r.num_computed += n
            if r.num_computed >= r.num_tokens:
                r.generated += 1
                if r.generated == r.max_new_tokens:
                    pool.free(r)
                    sched.finish(r)
                    done.add(i)
        if len(done) == len(reqs) or (not rows and step >= max(a for _, _, a in stream.requests)):
            break
    return lines


def check_scheduler(
    cls, *, seed: int = 0, streams: int = 200, time_limit: float | None = DEFAULT_TIME_LIMIT_S
) -> CheckReport:
    """Check exercise 5's scheduler class against `paged_ref.serve.Scheduler` (see the module docstring).

    Args:
        cls: ``cls(pool, max_num_seqs=..., max_batched_tokens=...)`` with ``add(req)``, ``schedule()``
            (-> a list of ``(req, num_tokens)``) and ``finish(req)``.
        seed, streams: the random request streams, played after the hand-made `EDGE_CASES`.
        time_limit: seconds per stream, or None.
    """
    check_count("streams", streams)
    rng = random.Random(seed)
    cases = list(EDGE_CASES) + [random_stream(rng) for _ in range(streams)]
    name = "scheduler"
    run = Run(name, len(cases), time_limit)
    for count, s in enumerate(cases, start=1):
        where = [0]
        try:
            with run.case(count):
                failure = _play(cls, s, run, where)
        except NotImplementedYet:
            return run.finish(CheckReport(name, False, count, not_implemented=True))
        except OverTime:
            failure = run.over_time(s.describe(), f"at step {where[0]}")
        except StudentError as raised:
            failure = Failure(
                f"{s.describe()}\n" + (where[1] if len(where) > 1 else f"at step {where[0]}"),
                "a result",
                f"raised {raised}",
                raised_hint(
                    raised,
                    "the class needs __init__(pool, *, max_num_seqs, max_batched_tokens), add(req), schedule() "
                    "returning a list of (req, num_tokens), and finish(req)",
                ),
            )
        if failure is not None:
            return run.finish(CheckReport(name, False, count, failure))
    return run.finish(CheckReport(name, True, len(cases)))
