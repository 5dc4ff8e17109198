"""Who holds each page after every step's forward: what notebook 09's page maps draw.

`PageTrace(engine)` joins the engine's ``observers``: after each step's forward, before the
requests that step finished give their pages back, it reads the pool and notes, per physical page,
the request holding it (-1: free; a page shared by several requests names the oldest) and the
tokens stored in it. ``trace.history`` is the engine's ``history`` with those two added.

Example:
    >>> from paged_ref.serve import Engine
    >>> engine = Engine(None, num_pages=4, page_size=2, max_batched_tokens=8)
    >>> trace = PageTrace(engine)
    >>> _ = engine.add_request([1, 2, 3], max_new_tokens=2); _ = engine.run()
    >>> [(h.owners, h.fill) for h in trace.history]
    [((0, 0, -1, -1), (2, 1, 0, 0)), ((0, 0, -1, -1), (2, 2, 0, 0))]
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..serve.engine import Engine
from ..serve.metrics import StepRecord

__all__ = ["PageTrace", "TracedStep"]


@dataclass(frozen=True)
class TracedStep(StepRecord):
    """A `StepRecord` with the pool as its forward left it."""

    owners: tuple[int, ...]  # per physical page: the request holding it, -1 if free
    fill: tuple[int, ...]  # per physical page: tokens stored in it


class PageTrace:
    """The pages' owners and fill after every step ``engine`` runs from now on."""

    def __init__(self, engine: Engine):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be a paged_ref.serve.Engine, got {type(engine).__name__}")
        self.engine = engine
        self._maps: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # step -> (owners, fill)
        engine.observers.append(self._observe)

    def _observe(self, engine: Engine) -> None:
        kv = engine.kv
        owners, fill = [-1] * kv.num_pages, [0] * kv.num_pages
        for r in reversed(engine.scheduler.running):  # the oldest written last: a shared page names it
            pages, n = kv.pages(r.seq_id), kv.seq_len(r.seq_id)
            for i, page in enumerate(pages):
                owners[page] = r.request_id
                fill[page] = max(0, min(kv.page_size, n - i * kv.page_size))
        self._maps[len(engine.history)] = tuple(owners), tuple(fill)

    @property
    def history(self) -> list[TracedStep]:
        """The engine's step records since the trace began, each with its page map."""
        names = [f.name for f in fields(StepRecord)]
        return [
            TracedStep(**{k: getattr(h, k) for k in names}, owners=self._maps[h.step][0], fill=self._maps[h.step][1])
            for h in self.engine.history
            if h.step in self._maps
        ]
