"""Serving many requests from one page pool: continuous batching on the paged cache.

Reading order:

- `request`: a request's state in flight (prompt + output, tokens computed) and its `RequestOutput`;
- `scheduler`: waiting / running / swapped queues, admission with a watermark, the per-step token budget
  with chunked prefill, preemption (recompute or swap); `reservation`: what admission commits up front;
- `swap`: a preempted sequence's K/V to host memory and back, from the cache's public methods;
- `engine`: `Engine`, one scheduler step and one forward of `paged_ref.hf.PagedSession` per step;
- `dry`: the same engine with no model (pages and scheduling only), for quick simulations;
- `metrics`: what each step did and the run's counters (`Engine.stats`).

Example:
    >>> import paged_ref as pr
    >>> engine = pr.serve.Engine(None, num_pages=8, page_size=4, max_num_seqs=4, max_batched_tokens=16)
    >>> ids = [engine.add_request(list(range(10)), max_new_tokens=8) for _ in range(3)]
    >>> outs = engine.run()
    >>> [len(o.token_ids) for o in outs], engine.stats()["preemptions"] > 0, engine.stats()["free_pages"]
    ([8, 8, 8], True, 8)
"""

from .engine import CLOCKS, Engine, StepRecord
from .request import Request, RequestOutput
from .scheduler import PREEMPTIONS, RESERVATIONS, Schedule, Scheduler

__all__ = ["CLOCKS", "Engine", "PREEMPTIONS", "RESERVATIONS", "Request", "RequestOutput", "Schedule", "Scheduler"]
__all__ += ["StepRecord"]
