"""The transformers `Cache` that writes each layer's K/V into a `PagedKVCache`.

transformers' attention layers call ``cache.update(key_states, value_states, layer_idx, ...)``
right after RoPE. `PagedCache.update` writes the new tokens' K/V into their pages; the
registered attention function (`attention.py`) then reads each sequence's whole history back
from the pages. Both halves read one `StepPlan`, built once per forward by the session.

A forward is a *rectangle*: row ``b`` of ``input_ids: [batch, max_q_len]`` holds the ``q_lens[b]``
new tokens of sequence ``seq_ids[b]``, then padding, which never reaches the cache (decode:
``max_q_len == 1``); a *packed* forward (`pack_rows`) is one row of every sequence's new tokens.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import Cache

from ..cache_interface import KVCache

__all__ = ["StepPlan", "PagedCache", "pack_rows", "region"]


def region(name: str):
    """A named region in a `torch.profiler` profile (`bench serve --profile` groups by them); no cost
    (a null context) when no profiler runs."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


@dataclass
class StepPlan:
    """Everything one forward needs to write and read the paged cache (built once, read by every layer).

    Attributes:
        kv: the `KVCache` (a `PagedKVCache`, or a `LayeredKVCache` with a block table per layer).
        seq_ids: the sequence of each batch row.
        slots: int64 ``[num_new]``, the cache slot of each new token, rows in order (``[num_layers,
            num_new]`` on a `LayeredKVCache`).
        q_lens: int32 ``[batch]``, new tokens per row (>= 1); ``max_q_len`` is their max.
        valid: bool ``[batch, max_q_len]``, the real tokens of the rectangle; None when every row is full.
        block_table: int32 ``[batch, max_pages]`` after the new tokens were reserved (layer 0's).
        seq_lens: int32 ``[batch]``, tokens held per sequence, the new ones included.
        decode: ``f(q [batch, Hq, D], k_cache, v_cache, block_table, seq_lens, *, scale, **attn_kwargs)``.
        prefill: ``f(q [batch, Hq, max_q_len, D], k_cache, v_cache, block_table, seq_lens, q_lens, *, scale, ...)``.
        attn_kwargs: keywords of this step's attention calls (`attention.Backend.prepare`).
        layer_tables: on a `LayeredKVCache`, each layer's ``(block_table, attn_kwargs)``; else None.
        parts: a packed forward's ``(index, plan)`` pairs: ``index`` int64 ``[n]``, the positions in
            the packed row of the tokens of ``plan``'s rows (`pack_rows`); None for a rectangle.
        packed: ``f(q [num_new, Hq, D], ..., seq_lens, q_lens, *, scale)``: the new tokens of every row in
            one call where none is padding (``valid`` None: decode, a packed forward), or None
            (`attention.Backend.packed`); it returns None where it cannot run ``q``.
        span: the most positions a row's sequence spans with the new tokens (a window this wide masks none), or None.
    """

    kv: KVCache
    seq_ids: list[int]
    slots: torch.Tensor
    q_lens: torch.Tensor
    valid: torch.Tensor | None
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    decode: Callable
    prefill: Callable
    max_q_len: int
    attn_kwargs: dict = field(default_factory=dict)
    layer_tables: list[tuple[torch.Tensor, dict]] | None = None
    parts: list[tuple[torch.Tensor, StepPlan]] | None = None
    packed: Callable | None = None
    span: int | None = None

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, dict]:
        """``(block_table, attn_kwargs)`` the attention of layer ``layer_idx`` reads."""
        if self.layer_tables is None:
            return self.block_table, self.attn_kwargs
        return self.layer_tables[layer_idx]

    @property
    def is_decode(self) -> bool:
        """One new token per sequence: the decode kernel's case."""
        return self.max_q_len == 1


class PagedCache(Cache):
    """A transformers `Cache` that holds no tensors: `update` writes into ``plan.kv`` at ``plan.slots``.

    Use it through `PagedSession`, which registers the matching attention and sets ``plan`` before
    each forward; with any other attention implementation the model would see the new tokens only.

    Example:
        >>> from paged_ref import PagedKVCache
        >>> cache = PagedCache(PagedKVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=32))
        >>> cache.get_seq_length()     # no forward in flight
        0
    """

    def __init__(self, kv_cache: KVCache):
        if not isinstance(kv_cache, KVCache):
            raise TypeError(
                f"kv_cache must be a paged_ref.PagedKVCache or LayeredKVCache, got {type(kv_cache).__name__}"
            )
        super().__init__(layers=[])  # the base class's per-layer storage stays empty
        self.kv = kv_cache
        self.plan: StepPlan | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this layer's new K/V, ``[batch, num_kv_heads, max_q_len, head_dim]`` after RoPE, into
        their pages; returns them unchanged (attention reads the whole history from the pages).
        ``*args, **kwargs``: transformers 5.24 passes ``kwargs=...``, 5.17 ``cache_kwargs``."""
        plan = self.plan
        if plan is None:
            raise RuntimeError(
                "PagedCache.update was called outside a paged_ref forward; use paged_ref.hf.generate / "
                "PagedSession, which set the step plan before calling the model"
            )
        k = key_states.transpose(1, 2)  # [batch, max_q_len, Hkv, D]
        v = value_states.transpose(1, 2)  # [batch, max_q_len, Hkv, D]
        if plan.valid is None:
            k, v = k.flatten(0, 1), v.flatten(0, 1)  # [batch * max_q_len, Hkv, D]
        else:
            k, v = k[plan.valid], v[plan.valid]  # [num_new, Hkv, D], row-major like slots
        slots = plan.kv.layer_slots(plan.slots, layer_idx)  # [num_new]
        check = layer_idx == 0 or plan.kv.tables_per_layer  # slots shared by every layer: checked once
        with region("paged_ref::cache_write"):
            plan.kv.write(layer_idx, slots, k, v, check_values=check)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Most tokens a sequence of the forward in flight holds (0 if none); not a position."""
        return int(self.plan.seq_lens.max()) if self.plan is not None else 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        """(kv_length, kv_offset) for mask builders; unused, since the paged attention masks itself."""
        return self.get_seq_length(), 0

    @property
    def is_compileable(self) -> bool:
        return False

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"PagedCache does not support {what}: model.generate's beam search and assisted decoding "
            "reorder or crop a cache in place, while paged sequences share pages instead. Use "
            "paged_ref.hf.generate(model, ids, num_beams=k) or paged_ref.hf.beam_search (beams fork their "
            "pages, copy-on-write) and do_sample/num_return_sequences there (samples fork the prompt's pages)."
        )

    def reorder_cache(self, beam_idx):
        self._unsupported("reorder_cache")

    def crop(self, max_length):
        self._unsupported("crop")

    def batch_repeat_interleave(self, repeats):
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices")

    def __repr__(self) -> str:
        return f"PagedCache({self.kv!r})"


def pack_rows(plan: StepPlan, input_ids, position_ids, prepare: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn ``plan``'s rectangle into one row of its valid tokens; returns ``(input_ids, position_ids)``,
    each ``[1, num_new]``, and sets ``plan.parts``: the decode rows and the longer rows, each part
    with its own block table, lengths and ``prepare(sub_plan)`` keywords."""
    device = plan.kv.device
    q_lens = plan.q_lens.tolist()
    starts = [0, *itertools.accumulate(q_lens[:-1])]  # each row's first token in the packed row
    parts = []
    for rows in ([b for b, n in enumerate(q_lens) if n == 1], [b for b, n in enumerate(q_lens) if n > 1]):
        if not rows:
            continue
        index = torch.cat([torch.arange(starts[b], starts[b] + q_lens[b]) for b in rows]).to(device)  # [n]
        sub_q = plan.q_lens[rows]  # [rows]
        max_q = max(q_lens[b] for b in rows)
        sub = replace(
            plan,
            seq_ids=[plan.seq_ids[b] for b in rows],
            q_lens=sub_q,
            valid=None
            if all(q_lens[b] == max_q for b in rows)
            else torch.arange(max_q, device=device)[None, :] < sub_q[:, None],  # [rows, max_q]
            block_table=plan.block_table[rows],
            seq_lens=plan.seq_lens[rows],
            max_q_len=max_q,
        )
        sub.attn_kwargs = prepare(sub)
        parts.append((index, sub))
    valid = plan.valid
    plan.parts, plan.valid = parts, None  # the cache writes the packed row's tokens in order
    return input_ids[valid][None], position_ids[valid][None]  # [1, num_new] each
