"""A growing-context chat: turn ``t`` is a new request holding the whole conversation so far.

Each turn sends every earlier user message and reply plus the new user message and greedily
generates ``reply_tokens`` tokens, which join the history. Served from one paged pool without
prefix caching (every turn prefills its whole history) and with it (the turn starts from the
full pages the previous one left, `PagedKVCache(prefix_caching=True)`). Per turn: latency
(prefill + reply), tokens prefilled, pages allocated, prefix pages reused. Both runs must produce
the same replies (checked by the caller).

Example:
    >>> import torch
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> users = [torch.arange(3, 40), torch.arange(50, 70), torch.arange(80, 90)]
    >>> a = run_chat(model, users, reply_tokens=4, page_size=8, prefix_caching=False, backend="reference")
    >>> b = run_chat(model, users, reply_tokens=4, page_size=8, prefix_caching=True, backend="reference")
    >>> a["replies"] == b["replies"], [t["prefix_pages_reused"] for t in b["turns"]]
    (True, [0, 5, 8])
"""

from __future__ import annotations

import time

import torch

from ...block_table import pages_needed
from ...cache import PagedKVCache
from ...hf import PagedSession
from ._scaling_latency import AllocationTimer, synchronize

__all__ = ["run_chat"]


def run_chat(
    model,
    user_turns,
    *,
    reply_tokens: int,
    page_size: int = 16,
    prefix_caching: bool,
    backend: str = "flex",
    prefill_chunk: int = 2048,
) -> dict:
    """Serve ``user_turns`` (LongTensor ``[n_t]`` each) turn by turn; see the module docstring.

    Returns:
        ``{"prefix_caching", "backend", "page_size", "turns": [{"turn", "context", "prefilled",
        "latency_s", "prefill_s", "decode_s", "pages_allocated", "prefix_pages_reused",
        "pages_held"}], "replies": [[ids]], "alloc_calls": [(op, ns, pages)]}``.
    """
    if not user_turns:
        raise ValueError("user_turns must hold at least one turn")
    device = next(model.parameters()).device
    total = sum(int(u.numel()) for u in user_turns) + reply_tokens * len(user_turns)
    # the whole conversation twice over: the previous turn's freed pages are not reused for new
    # ones before the next turn can find them
    num_pages = 2 * pages_needed(total, page_size) + len(user_turns) + 2
    kv = PagedKVCache.for_model(model, num_pages=num_pages, page_size=page_size, prefix_caching=prefix_caching)
    timer = AllocationTimer(kv.allocator)
    history: list[int] = []
    turns, replies = [], []
    with PagedSession(model, kv_cache=kv, backend=backend) as session:
        for t, user in enumerate(user_turns):
            request = history + [int(x) for x in user]
            calls_before, hits_before = len(timer.calls), kv.prefix_hits
            synchronize(device)
            start = time.perf_counter()
            seq = session.add(request)  # with prefix caching: starts holding the cached full pages
            reused = kv.seq_len(seq)
            pos = reused
            while pos < len(request):  # prefill what the cache does not already hold
                end = min(len(request), pos + prefill_chunk)
                logits = session.extend([seq], [torch.tensor(request[pos:end], device=device)])
                pos = end
            synchronize(device)
            prefilled_at = time.perf_counter()
            reply = []
            for _ in range(reply_tokens):
                token = int(logits[0].argmax())
                reply.append(token)
                logits = session.extend([seq], [torch.tensor([token], device=device)])
            synchronize(device)
            done = time.perf_counter()
            new_calls = timer.calls[calls_before:]
            turns.append(
                {
                    "turn": t + 1,
                    "context": len(request) + reply_tokens,
                    "prefilled": len(request) - reused,
                    "latency_s": done - start,
                    "prefill_s": prefilled_at - start,
                    "decode_s": done - prefilled_at,
                    "pages_allocated": sum(n for op, _, n in new_calls if op == "allocate"),
                    "prefix_pages_reused": kv.prefix_hits - hits_before,
                    "pages_held": kv.allocator.num_pages - kv.allocator.num_free,
                }
            )
            replies.append(reply)
            history = request + reply
            session.finish(seq)  # the request ends; with prefix caching its full pages stay findable
    return {
        "prefix_caching": prefix_caching,
        "backend": backend,
        "page_size": page_size,
        "turns": turns,
        "replies": replies,
        "alloc_calls": list(timer.calls),
    }
