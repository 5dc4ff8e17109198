"""The engine's argument checks, at its public door (the pool's are the cache's, the scheduler's its own)."""

from __future__ import annotations

from .._cache_checks import token_list
from .._validate import check_token_range, is_int
from ..block_table import pages_needed
from ..eviction.base import check_policy


def prompt_list(prompt_ids, vocab: int | None) -> list[int]:
    """A request's prompt as a non-empty list of token ids below ``vocab``."""
    prompt = token_list("prompt_ids", prompt_ids)
    if not prompt:
        raise ValueError("prompt_ids must hold at least one token, got an empty prompt")
    check_token_range("prompt_ids", min(prompt), max(prompt), vocab)
    return prompt


def check_eviction(eviction, session) -> None:
    evicts = getattr(session, "evicts", True)  # a dry session has no K/V: no cache to check the policy on
    if check_policy(eviction, None, session.kv if evicts else None) is not None and not evicts:
        raise ValueError("eviction needs a model: a dry run (Engine(None, ...)) has no K/V to score")


def check_request_id(request_id, num_requests: int) -> int:
    if not is_int(request_id):
        raise TypeError(f"request_id must be an int from add_request, got {type(request_id).__name__}")
    if not 0 <= request_id < num_requests:
        raise ValueError(f"request_id must be one that add_request returned, in [0, {num_requests}), got {request_id}")
    return request_id


def refusal(sched, r) -> str | None:
    """Why request ``r`` could never run in the pool of ``sched`` (a `Scheduler`), or None; asked before queueing."""
    ps, pool, wm = sched.page_size, sched.kv.num_pages, sched.watermark_pages
    prompt = len(r.prompt_ids)
    if r.peak_tokens + 1 > sched.max_model_len:
        return (
            f"prompt ({prompt} tokens) + max_new_tokens ({r.max_new_tokens}) = {r.peak_tokens + 1} exceeds "
            f"max_model_len={sched.max_model_len}"
        )
    if sched.evictions.peak_pages(r) > pool:
        return f"it needs {sched.evictions.peak_pages(r)} pages of {ps} tokens at its longest and the pool has {pool}"
    # the longest first chunk admission may have to place: the prompt, or prompt + output after a preemption
    chunk = min(sched.max_batched_tokens, prompt if r.eviction is not None else r.peak_tokens)
    first = max(sched.committed_pages(r), pages_needed(chunk, ps))
    if first + wm > pool:
        what = "committed up front" if sched.commitment.up_front else f"for a first chunk of {chunk} tokens"
        return (
            f"admission needs {first} pages of {ps} tokens ({what}) plus the watermark of {wm} kept free, "
            f"and the pool has {pool}"
        )
    return None
