"""What `generate`, `stream` and `beam_search` check and set up before a page is taken.

`prepare` checks the model, the prompts (with their left-padding mask), the EOS / pad ids and
the prefix-cache namespaces, gives each prompt's real tokens, and makes the `PagedSession`, its
page pool sized to never run out (unless a cache or a pool size is given).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from .._arith import cdiv
from .._validate import check_int
from ..cache import PagedKVCache
from ..memory import model_geometry
from .session import PagedSession

__all__ = ["Prepared", "prepare"]


class Prepared(NamedTuple):
    """A generation's checked inputs and its session (not yet open)."""

    session: PagedSession
    prompts: list[torch.Tensor]  # each prompt's real tokens, LongTensor [len_b], on the model's device
    eos: torch.Tensor  # LongTensor [num_eos]
    pad: int
    namespaces: list  # each prompt's prefix-cache namespace (None or a dict)


def prepare(
    model,
    input_ids: torch.Tensor,
    copies: int,
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
) -> Prepared:
    """Check a generation's arguments (`paged_ref.hf.generate`'s) and make its session.

    ``copies``: the rows of each prompt (samples or beams), which share its pages. The pool made
    when neither ``kv_cache`` nor ``num_pages`` is given holds every row at full length: per prompt
    of P tokens, ``P // page_size`` shared pages plus, per row, the pages that positions
    ``P // page_size * page_size .. P + max_new_tokens`` span (a beam continued twice shares
    everything before its partial last page).
    """
    prompts, eos, pad = _prompts_and_ids(model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id)
    if namespace is None or isinstance(namespace, dict):
        namespaces = [namespace] * len(prompts)  # each checked by the cache when its sequence is added
    elif isinstance(namespace, (list, tuple)) and len(namespace) == len(prompts):
        namespaces = list(namespace)
    else:
        got = len(namespace) if isinstance(namespace, (list, tuple)) else type(namespace).__name__
        raise ValueError(f"namespace must be None, a dict or a list of one per row ({len(prompts)}), got {got}")
    if kv_cache is not None and num_pages is not None:
        raise ValueError("pass either kv_cache or num_pages, not both (num_pages sizes a cache created here)")
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
        eviction=eviction,
        budget=budget,
    )
    return Prepared(session, prompts, eos, pad, namespaces)


def _prompts_and_ids(model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id):
    """Validate the inputs; return (prompts: list of LongTensor [len_b], eos: LongTensor [k], pad: int)."""
    model_geometry(model)  # a transformers decoder, else a TypeError naming what it lacks
    check_int("max_new_tokens", max_new_tokens, min_value=1)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise TypeError(
            "input_ids must be a LongTensor [batch, prompt_len], got "
            + (
                f"a tensor of shape {list(input_ids.shape)} and dtype {input_ids.dtype}"
                if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__
            )
        )
    batch, length = input_ids.shape
    if batch < 1 or length < 1:
        raise ValueError(f"input_ids must hold at least one token per row, got shape {list(input_ids.shape)}")
    vocab = model.config.vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:  # (left padding must hold valid ids too, as for model.generate)
        raise ValueError(f"input_ids must hold token ids in [0, vocab_size={vocab}), got values in [{lo}, {hi}]")
    device = next(model.parameters()).device
    if attention_mask is None:
        prompts = [row.to(device) for row in input_ids]
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            got = (
                list(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise ValueError(
                f"attention_mask must be a tensor of the shape of input_ids {list(input_ids.shape)}, got {got}"
            )
        mask = attention_mask.to("cpu")
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1")
        mask = mask.bool()
        lengths = mask.sum(dim=1)
        left_padded = mask == (torch.arange(length)[None, :] >= (length - lengths)[:, None])
        if not left_padded.all():
            bad = int((~left_padded.all(dim=1)).nonzero()[0])
            raise ValueError(
                f"attention_mask row {bad} is not left-padded (zeros then ones); pad prompts on the left "
                "(tokenizer.padding_side = 'left'), as model.generate expects"
            )
        if int(lengths.min()) < 1:
            raise ValueError(
                f"every prompt needs at least one real token; attention_mask row {int(lengths.argmin())} is all 0"
            )
        prompts = [input_ids[b, length - int(n) :].to(device) for b, n in enumerate(lengths)]
    config = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        eos_token_id = []
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    eos_list = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if isinstance(eos_list, (str, bytes)) or not hasattr(eos_list, "__iter__") or not all(_is_int(e) for e in eos_list):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    eos_list = [int(e) for e in eos_list]
    if any(not 0 <= e < vocab for e in eos_list):
        raise ValueError(f"eos_token_id must be token ids in [0, vocab_size={vocab}), got {eos_list}")
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos_list[0] if eos_list else 0
    if not _is_int(pad_token_id) or not 0 <= int(pad_token_id) < vocab:
        raise ValueError(f"pad_token_id must be a token id in [0, vocab_size={vocab}) or None, got {pad_token_id!r}")
    eos = torch.tensor(eos_list, dtype=torch.long, device=device)
    return prompts, eos, int(pad_token_id)


def _is_int(x) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
