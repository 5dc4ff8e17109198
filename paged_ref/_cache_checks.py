"""Argument checks at the cache's public door (`PagedKVCache`, `LayeredKVCache`).

Every check raises with a message naming the argument, what was expected and what was given,
before the cache changes anything. The caches' internal steps trust what these let through.
"""

from __future__ import annotations

import math

import torch

from ._validate import check_bool, check_int, check_list, describe, is_int


def check_dtype(dtype) -> torch.dtype:
    """``dtype``, a floating torch.dtype (the cache's storage type)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (float32, float16, bfloat16, float64), got {dtype!r}")
    return dtype


def check_pool(cache, dtype) -> torch.dtype:
    """``dtype`` (`check_dtype`), ``cache``'s K and V of every layer in it under 2**63 bytes (torch's sizes: int64)."""
    sizes = {k: getattr(cache, k) for k in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim")}
    if (total := 2 * math.prod(sizes.values()) * check_dtype(dtype).itemsize) >= 2**63:
        raise ValueError(f"2 * {' * '.join(sizes)} * {dtype.itemsize} bytes must be < 2**63, got {total}: {sizes}")
    return dtype


def check_device(device) -> torch.device:
    """``device`` as a torch.device that holds real memory (not ``meta``)."""
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("device must hold real memory (cpu, cuda, ...), got 'meta'")
    return device


def check_layer(layer, num_layers: int) -> int:
    """``layer`` as an int in ``[0, num_layers)``."""
    layer = check_int("layer", layer, min_value=0)
    if layer >= num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")
    return layer


def token_list(name: str, token_ids) -> list[int]:
    """Token ids as a list of Python ints; floats, bools and non-numbers are refused."""
    if isinstance(token_ids, torch.Tensor):
        not_ints = token_ids.dtype == torch.bool or token_ids.is_floating_point() or token_ids.is_complex()
        if not_ints or token_ids.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {describe(token_ids)}")
        return token_ids.tolist()
    return [
        check_int(f"{name}[{i}]", t) for i, t in enumerate(check_list(name, token_ids, "ints or a 1-D integer tensor"))
    ]


def growth_request(num_tokens, token_ids, suffix: str = "") -> tuple[int, list[int] | None]:
    """One sequence's ``(num_tokens, token_ids)`` for a reserve, checked; ``suffix`` (e.g.
    ``"[2]"``) names the batch entry in the messages."""
    n = check_int(f"num_tokens{suffix}", num_tokens, min_value=1)
    if token_ids is not None:
        token_ids = token_list(f"token_ids{suffix}", token_ids)
        if len(token_ids) != n:
            raise ValueError(f"token_ids{suffix} must have num_tokens{suffix}={n} entries, got {len(token_ids)}")
    return n, token_ids


def batch_lists(seq_ids, num_tokens, token_ids) -> tuple[list, list, list]:
    """A batch reserve's three per-sequence lists, as lists of one length with distinct ids."""
    seq_ids = check_list("seq_ids", seq_ids, "sequence ids")
    num_tokens = check_list("num_tokens", num_tokens, "token counts")
    token_ids = [None] * len(seq_ids) if token_ids is None else check_list("token_ids", token_ids, "token-id lists")
    if not len(seq_ids) == len(num_tokens) == len(token_ids):
        raise ValueError(
            f"seq_ids, num_tokens and token_ids must have one entry per sequence, got "
            f"{len(seq_ids)}, {len(num_tokens)} and {len(token_ids)}"
        )
    ids = [s for s in seq_ids if is_int(s)]  # the others are refused as no live sequence
    if len(set(ids)) != len(ids):
        raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
    return seq_ids, num_tokens, token_ids


def check_reserved(seq_ids, q_lens, held: dict, kv) -> None:
    """A session's ``extend(..., reserved=True)``: each row's sequence in ``kv`` holds its ``q_lens`` new tokens beyond
    ``held`` (seq -> tokens held after its last forward), no more, no fewer: the slots reserved for the forward."""
    for b, (s, n) in enumerate(zip(seq_ids, q_lens)):
        if kv.seq_len(s) - held[s] != n:
            raise ValueError(
                f"reserved=True: tokens[{b}] has {n} tokens, but sequence {s} has {kv.seq_len(s) - held[s]} reserved "
                "since its last forward; reserve exactly each row's tokens first (kv.reserve)"
            )


def check_write(cache, layer, slots, k, v, check_values: bool, filling=frozenset()) -> int:
    """`PagedKVCache.write`'s arguments: the layer, int slots, K/V of the cache's shape, dtype and device (not
    recorded by autograd), and (``check_values``) slots in range in pages the cache handed out unshared (or shared
    since a reservation filled them: ``filling``)."""
    layer = check_layer(layer, cache.num_layers)
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots must be a 1-D int32/int64 tensor, got {describe(slots)}")
    expected = (slots.shape[0], cache.num_kv_heads, cache.head_dim)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != expected:
            raise ValueError(
                f"{name} must have shape [num_tokens, num_kv_heads, head_dim] = {list(expected)}, got {list(t.shape)}"
            )
        if t.dtype != cache.dtype:
            raise TypeError(f"{name} must have the cache dtype {cache.dtype}, got {t.dtype}")
        if t.device != cache.device:
            raise ValueError(f"{name} must be on the cache device {cache.device}, got {t.device}")
        if t.requires_grad and torch.is_grad_enabled():  # as the native ops refuse it: the pages hold values, no graph
            raise ValueError(f"{name} requires grad: write under torch.no_grad(), or pass {name}.detach()")
    if check_bool("check_values", check_values) and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= cache.num_pages * cache.page_size:
            raise ValueError(f"slots must be in [0, {cache.num_pages * cache.page_size}), got values in [{lo}, {hi}]")
        for page in torch.unique(slots // cache.page_size).tolist():
            if cache.allocator.refcount(page) != 1 and not (cache.allocator.refcount(page) > 1 and page in filling):
                raise ValueError(
                    f"slots point into page {page} with refcount {cache.allocator.refcount(page)}; "
                    "write only into slots returned by reserve() (shared pages are copied there)"
                )
    return layer
