"""The value checks of `paged_ref.hf`'s public doors (prompts, token ids, EOS / pad ids, streamers),
made before a page is taken, each naming the argument, what was expected and what was given."""

from __future__ import annotations

import importlib
import inspect

import torch

from .._validate import check_bool, check_int, check_list, check_token_range, describe, eos_ids, is_int
from ..cache import PagedKVCache
from ..cache_interface import KVCache
from ..memory import model_geometry
from .attention import AUTO, BACKENDS

__all__ = ["check_batch", "check_hooks", "check_live", "check_prompts", "check_room", "token_ids"]
__all__ += ["for_8bit_pages", "reads_8bit", "session_cache", "show_progress"]

PROGRESS_MIN_TOKENS = 128  # progress=None shows a bar from this many new tokens on


def check_batch(seq_ids, tokens, live) -> tuple[list, list]:
    """`PagedSession.extend`'s ``seq_ids`` and ``tokens`` as two lists of one length (a ``[batch, n]``
    tensor of tokens is a row per sequence), non-empty, the ids distinct and ``live`` (`check_live`)."""
    seq_ids = check_list("seq_ids", seq_ids, "sequence ids")
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
        tokens = list(tokens)  # [batch, n]: one row per sequence
    tokens = check_list("tokens", tokens, "token-id tensors")
    if len(seq_ids) != len(tokens) or not seq_ids:
        raise ValueError(
            f"seq_ids and tokens must be non-empty and of equal length, got {len(seq_ids)} and {len(tokens)}"
        )
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
    for s in seq_ids:
        check_live(s, live)
    return seq_ids, tokens


def check_live(seq_id, live) -> None:
    """``seq_id`` is one of ``live``, a session's sequences (an int: ``True`` and ``1.0`` equal 1 as keys)."""
    if not is_int(seq_id) or seq_id not in live:
        raise ValueError(f"seq_id {seq_id!r} is not a live sequence of this session (live: {sorted(live)})")


def check_room(seq_ids, q_lens, policies: dict, kv) -> None:
    """Each row feeds at most the tokens its sequence's policy (``policies``: seq -> policy or None, for
    the sequences past their prefill) lets in before it acts (``tokens_until_action``)."""
    for b, (s, n) in enumerate(zip(seq_ids, q_lens)):
        policy = policies.get(s)
        if policy is None:
            continue
        room = policy.tokens_until_action(kv, s)
        if n > room:
            raise ValueError(
                f"tokens[{b}] has {n} tokens, but sequence {s}'s eviction policy must act after {room}; "
                "feed at most tokens_until_action() tokens per forward"
            )


def token_ids(name: str, t, vocab: int) -> torch.Tensor:
    """One sequence's new tokens as a LongTensor ``[n]``: 1-D integers in [0, vocab)."""
    if not isinstance(t, torch.Tensor):
        try:
            t = torch.as_tensor(t)
        except (TypeError, ValueError, RuntimeError):
            if isinstance(t, (list, tuple)) and t and all(is_int(x) for x in t):  # ints beyond int64
                check_token_range(name, min(t), max(t), vocab)
            raise TypeError(f"{name} must be a 1-D tensor (or list) of token ids, got {type(t).__name__}") from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex() or t.dim() > 1:
        raise TypeError(
            f"{name} must be a 1-D integer tensor of token ids, got shape {list(t.shape)} and dtype {t.dtype}"
        )
    t = t.reshape(-1).long()
    if t.numel():
        check_token_range(name, int(t.min()), int(t.max()), vocab)
    return t


def show_progress(progress, max_new_tokens) -> bool:
    """Whether `generate` and `beam_search` show a tqdm bar: ``progress``, or if None from 128 new tokens on."""
    if progress is None:
        return check_int("max_new_tokens", max_new_tokens, min_value=1) >= PROGRESS_MIN_TOKENS
    return check_bool("progress", progress, "True, False or None")


def check_hooks(streamer, callback, *, beam: bool) -> None:
    """`generate`'s ``callback`` (callable or None) and ``streamer``: None, or a transformers streamer
    (``put(tokens)`` and ``end()``), not with beam search (as in model.generate)."""
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    if streamer is None:
        return
    if beam:
        raise ValueError("streamer cannot be used with beam search (num_beams > 1), as in model.generate")
    missing = [m for m in ("put", "end") if not callable(getattr(streamer, m, None))]
    if missing:
        raise TypeError(
            f"streamer must have put(tokens) and end() methods (like "
            f"transformers.TextStreamer); {type(streamer).__name__} lacks {missing}"
        )


def check_prompts(model, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id):
    """Validate the inputs; return (prompts: list of LongTensor [len_b], eos: LongTensor [k], pad: int)."""
    model_geometry(model)  # a transformers decoder, else a TypeError naming what it lacks
    check_int("max_new_tokens", max_new_tokens, min_value=1)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise TypeError(f"input_ids must be a LongTensor [batch, prompt_len], got a {describe(input_ids)}")
    batch, length = input_ids.shape
    if batch < 1 or length < 1:
        raise ValueError(f"input_ids must hold at least one token per row, got shape {list(input_ids.shape)}")
    vocab = model.config.vocab_size  # (left padding must hold valid ids too, as for model.generate)
    check_token_range("input_ids", int(input_ids.min()), int(input_ids.max()), vocab)
    device = next(model.parameters()).device
    prompts = _unpadded(input_ids, attention_mask, device)
    eos_list, pad_token_id = _special_ids(model, eos_token_id, pad_token_id, vocab)
    eos = torch.tensor(eos_list, dtype=torch.long, device=device)
    return prompts, eos, int(pad_token_id)


def _unpadded(input_ids, attention_mask, device) -> list[torch.Tensor]:
    """Each row's prompt without its left padding (``attention_mask``, checked), on ``device``."""
    length = input_ids.shape[1]
    if attention_mask is None:
        prompts = [row.to(device) for row in input_ids]
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = list(input_ids.shape)
            raise ValueError(
                f"attention_mask must be a tensor of the shape of input_ids {shape}, got a {describe(attention_mask)}"
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
    return prompts


def _special_ids(model, eos_token_id, pad_token_id, vocab: int) -> tuple[list[int], int]:
    """The EOS ids and the pad id, checked; None takes the model's ``generation_config`` value."""
    config = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    eos_list = eos_ids(eos_token_id, vocab)
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos_list[0] if eos_list else 0
    if not is_int(pad_token_id) or not 0 <= int(pad_token_id) < vocab:
        raise ValueError(f"pad_token_id must be a token id in [0, vocab_size={vocab}) or None, got {pad_token_id!r}")
    return eos_list, int(pad_token_id)


def session_cache(geometry, kv_cache, *, kv_format, **pool) -> KVCache:
    """`PagedSession`'s cache: ``kv_cache`` checked against the model's ``geometry``, or when None a new
    `PagedKVCache` of ``pool`` (``num_pages``, ``page_size``) with ``kv_format``."""
    if kv_cache is None:
        return PagedKVCache(**pool, kv_format=kv_format, **geometry.cache_kwargs)
    if kv_format is not None:
        raise ValueError(f"kv_format is that of a cache made here; give it to the kv_cache passed, got {kv_format!r}")
    if pool["num_pages"] is not None:
        raise ValueError("pass either kv_cache or num_pages, not both (num_pages sizes a cache created here)")
    if not isinstance(kv_cache, KVCache):
        raise TypeError(
            f"kv_cache must be a paged_ref.PagedKVCache, a LayeredKVCache or None, got {type(kv_cache).__name__}"
        )
    if kv_cache.geometry.cache_kwargs != geometry.cache_kwargs:
        raise ValueError(
            f"kv_cache does not match the model: the model needs {geometry.cache_kwargs}, "
            f"kv_cache has {kv_cache.geometry.cache_kwargs}"
        )
    return kv_cache


def reads_8bit(backend) -> bool:
    """Whether every function of ``backend`` (a `paged_ref.hf.attention.Backend`) takes 8-bit pages'
    ``k_scale`` and ``v_scale`` (the 8-bit contract).

    Example:
        >>> reads_8bit(BACKENDS["reference"]), reads_8bit(BACKENDS["cascade"])
        (True, False)
    """
    where = [backend.decode, backend.prefill] + ([backend.packed] if backend.packed is not None else [])
    try:
        functions = [getattr(importlib.import_module(module), name) for module, name in where]
    except ImportError:  # a backend whose kernels are not installed here
        return False
    return all("k_scale" in inspect.signature(f).parameters for f in functions)


def for_8bit_pages(backend, *, asked):
    """``backend`` if it reads 8-bit pages; else, when ``"auto"`` chose it (``asked``), the reference; a backend
    asked for that cannot is refused, naming those that can."""
    if reads_8bit(backend):
        return backend
    if asked == AUTO:
        return BACKENDS["reference"]
    can = [name for name, b in BACKENDS.items() if reads_8bit(b)]
    raise ValueError(f"backend {backend.name!r} cannot read the cache's 8-bit pages; backends that can: {can}")
