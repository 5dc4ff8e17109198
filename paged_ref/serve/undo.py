"""Undoing a step: what a step may change, saved before it and put back if it raises.

``with StepCheckpoint(engine) as step:`` guards one `paged_ref.serve.Engine.step`. On entry it saves
what the step may change: the requests (running, swapped, those the scheduler may admit and those
arriving by the time it plans), the scheduler's queues and counters, the swap space, the eviction
policies' records (each policy's ``snapshot``), the session's sequences (positions, policies), the
engine's clock and arrivals; the cache keeps its own checkpoint (`paged_ref.cache_undo`). `save`
copies the objects' fields (each list, dict, set or deque one level down: a step appends to or
replaces those, never changes what they hold; of a request only its output).

On a clean exit the cache commits. If the body raises, everything is put back and the error goes
on with a note naming the requests concerned, except that a request whose own eviction hook raised
in `Engine.HOOK_TRIES` steps (vLLM aborts it) is finished with ``finish_reason="error"``: then the
error stops here and ``step.outputs`` holds those requests' outputs.

Example:
    >>> from paged_ref.serve.request import Request
    >>> r = Request(request_id=0, prompt_ids=[5, 6], max_new_tokens=3, arrival_s=0.0)
    >>> saved = save([], [r], policies=[])
    >>> r.num_computed = 2; r.output_ids.append(9)
    >>> restore(saved); r.num_computed, r.output_ids
    (0, [])
"""

from __future__ import annotations

import itertools
from collections import deque

__all__ = ["StepCheckpoint", "restore", "save"]

_CONTAINERS = {list, dict, set, deque}


def save(objects, requests, policies) -> tuple[list, list]:
    """The fields of ``objects`` and ``requests`` (`paged_ref.serve.request.Request`), and the snapshot
    of each of ``policies`` (each policy once)."""
    fields = [(o, {k: v.copy() if type(v) in _CONTAINERS else v for k, v in vars(o).items()}) for o in objects]
    for r in requests:
        values = vars(r).copy()
        values["output_ids"] = list(r.output_ids)
        fields.append((r, values))
    unique = {id(p): p for p in policies}.values()
    return fields, [(p, p.snapshot()) for p in unique]


def restore(saved: tuple[list, list]) -> None:
    """Put every object and policy back as `save` saw it."""
    fields, policies = saved
    for o, values in fields:
        vars(o).clear()
        vars(o).update(values)
    for p, snapshot in policies:
        p.restore(snapshot)


class StepCheckpoint:
    """One step, all or nothing (see the module docstring). ``sched``: the step's `Schedule`, once planned
    (the requests an error names); ``outputs``: after an undone step, the requests finished with an error."""

    def __init__(self, engine):
        self.engine = engine
        self.sched = None
        self.outputs: list = []

    def __enter__(self) -> StepCheckpoint:
        e, s = self.engine, self.engine.scheduler
        self.horizon = max(e.now, e._pending[0][0]) if e._pending and not s.has_work else e.now
        arriving = [e._requests[i] for t, i in e._pending if t <= self.horizon]
        requests = [*s.running, *s.swapped, *itertools.islice(s.waiting, s.max_num_seqs), *arriving]
        policies = [r.eviction for r in requests if r.eviction is not None] + s.hooks()
        e.kv.checkpoint()
        self.saved = (e._now, list(e._pending)), save([s, s.swap, s.evictions, e.session], requests, policies)
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None:
            self.engine.kv.commit()
            return False
        self.outputs = self._rollback(error)
        return bool(self.outputs)  # True: the error stops here

    def _rollback(self, error: BaseException) -> list:
        """Put everything back and note the requests concerned on ``error``; the outputs of the requests
        whose own hook has now failed `HOOK_TRIES` times, finished with an error (none: ``error`` goes on)."""
        e = self.engine
        culprits = e.scheduler.evictions.raised_by(e.scheduler.running)  # whose own hook raised
        rows = [r for r, _ in self.sched.rows] if self.sched is not None else []
        e.kv.rollback()
        (e._now, e._pending), fields = self.saved
        restore(fields)
        names = ", ".join(f"request {r.request_id}" for r in culprits or rows) or "no request planned yet"
        where = "whose own eviction hook raised" if culprits else "in the step's planning or forward"
        error.add_note(f"Engine.step was undone, nothing changed: {names} ({where})")
        if not isinstance(error, Exception):  # KeyboardInterrupt and the like: never retried or counted
            return []
        outs = []
        for r in culprits:
            r.hook_failures += 1
            if r.hook_failures >= e.HOOK_TRIES:
                e.scheduler.remove(r)
                r.error = f"{type(error).__name__}: {error}"
                e._finish(r, "error")
                outs.append(r.output())
        return outs
