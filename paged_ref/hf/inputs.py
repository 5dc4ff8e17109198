"""What `generate`, `stream` and `beam_search` check and set up before a page is taken: `prepare`
checks the prompts (with their left-padding mask), the EOS / pad ids and the prefix-cache namespaces,
and makes the `PagedSession`, its page pool sized never to run out unless a cache or size is given.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._arith import cdiv
from .._validate import check_int
from ..cache import PagedKVCache
from ..eviction.policies import resolve_policy
from ._checks import check_prompts
from .session import PagedSession

__all__ = ["Prepared", "prepare"]


class Prepared(NamedTuple):
    """A generation's checked inputs and its session (not yet open)."""

    session: PagedSession
    prompts: list[torch.Tensor]  # each prompt's real tokens, LongTensor [len_b], on the model's device
    eos: torch.Tensor  # LongTensor [num_eos]
    pad: int
    namespaces: list  # each prompt's prefix-cache namespace (None or a dict)
    max_new_tokens: int


def prepare(
    model,
    input_ids: torch.Tensor,
    copies: int,
    caller: str,
    /,
    *,
    max_new_tokens: int,
    page_size: int = 16,
    num_pages: int | None = None,
    backend="auto",
    attention_mask: torch.Tensor | None = None,
    eviction=None,
    budget: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    kv_cache: PagedKVCache | None = None,
    namespace: dict | list | None = None,
    **unknown,
) -> Prepared:
    """Check a generation's arguments (`paged_ref.hf.generate`'s) and make its session.

    Args:
        copies: the rows of each prompt (samples or beams), which share its pages.
        caller: the function called (``"generate"``), which an unknown keyword's error names.
        page_size, num_pages: the cache created here; by default it holds every row at full length:
            per prompt of P tokens ``P // page_size`` shared pages plus, per row, the pages that
            positions ``P // page_size * page_size .. P + max_new_tokens`` span.
        backend: which paged attention reads the pages (`paged_ref.hf.attention`).
        attention_mask: ``[batch, prompt_len]`` of 0/1, 1 on real tokens, padding on the left.
        eviction, budget: a policy (`paged_ref.eviction`) and its tokens; one row per prompt only.
        eos_token_id: int or ints ending a sequence (default: ``generation_config``'s; ``[]``: none).
        pad_token_id: fills finished rows (default: ``generation_config``'s, else the first EOS id).
        kv_cache: a `PagedKVCache` to use instead (its sequences are freed at the end).
        namespace: the prefix-cache namespace (str -> str) of every prompt, or a list of one per prompt.
    """
    if unknown:  # a keyword none of prepare's and none of the caller's own
        raise TypeError(f"{caller}() got an unexpected keyword argument {next(iter(unknown))!r}")
    prompts, eos, pad = check_prompts(model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id)
    if namespace is None or isinstance(namespace, dict):
        namespaces = [namespace] * len(prompts)  # each checked by the cache when its sequence is added
    elif isinstance(namespace, (list, tuple)) and len(namespace) == len(prompts):
        namespaces = list(namespace)
    else:
        got = len(namespace) if isinstance(namespace, (list, tuple)) else type(namespace).__name__
        raise ValueError(f"namespace must be None, a dict or a list of one per row ({len(prompts)}), got {got}")
    if copies > 1 and (eviction is not None or budget is not None):
        raise NotImplementedError(
            "KV eviction with sequences that share pages (num_return_sequences > 1 or num_beams > 1) is not "
            "implemented; pass eviction=None"
        )
    if kv_cache is None and num_pages is None:
        page_size = check_int("page_size", page_size, min_value=1)  # the sizing divides by it
        num_pages = sum(
            p.numel() // page_size + copies * cdiv(p.numel() % page_size + max_new_tokens, page_size) for p in prompts
        )
    session = PagedSession(
        model,
        kv_cache=kv_cache,
        num_pages=num_pages,
        page_size=page_size,
        backend=backend,
        eviction=resolve_policy(eviction, budget),
    )
    return Prepared(session, prompts, eos, pad, namespaces, max_new_tokens)
