"""Serving many requests from one page pool: continuous batching on the paged cache.

Read `request` (a request in flight), `scheduler` (what each step feeds: vLLM's decisions) and
`engine` (schedule -> forward -> sample -> finish); the README names the modules beside them.

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
from .reservation import VLLM_ADMISSION, Reservation
from .scheduler import PREEMPTIONS, RESERVATIONS, Schedule, Scheduler

__all__ = ["CLOCKS", "Engine", "PREEMPTIONS", "RESERVATIONS", "Request", "RequestOutput", "Schedule", "Scheduler"]
__all__ += ["VLLM_ADMISSION", "Reservation", "StepRecord"]
