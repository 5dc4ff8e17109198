"""Undoing a step: what a step may change, saved before it and put back if it raises.

A step changes requests, the scheduler's queues and counters, the swap space, the eviction
policies' records, and the session and cache under them. `save` copies the objects' fields (each
list, dict, set or deque one level down: a step appends to or replaces those, never changes what
they hold; of a request only its output) and asks each policy for its snapshot; the session and
cache keep their own checkpoint (`paged_ref.cache.PagedKVCache.checkpoint`).

Example:
    >>> from paged_ref.serve.request import Request
    >>> r = Request(request_id=0, prompt_ids=[5, 6], max_new_tokens=3, arrival_s=0.0)
    >>> saved = save([], [r], policies=[])
    >>> r.num_computed = 2; r.output_ids.append(9)
    >>> restore(saved); r.num_computed, r.output_ids
    (0, [])
"""

from __future__ import annotations

from collections import deque

__all__ = ["restore", "save"]

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
