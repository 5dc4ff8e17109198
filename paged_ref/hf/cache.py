"""The transformers `Cache` that writes each layer's K/V into a `PagedKVCache`.

transformers' attention layers call ``cache.update(key_states, value_states, layer_idx, ...)``
right after RoPE and right before attention. `PagedCache` implements that call by writing the
new tokens' K/V into their pages; the registered attention function (`attention.py`) then reads
all of a sequence's K/V back from the pages. The two halves share one `StepPlan`, built once per
forward by the session: which sequence each batch row is, the cache slots of the new tokens,
and the block table and lengths the attention kernels need.

Layout of a forward (a "rectangle"): row ``b`` of ``input_ids: [batch, max_q_len]`` holds the
``q_lens[b]`` new tokens of sequence ``seq_ids[b]`` left-aligned; the rest of the row is
padding. Padding never reaches the cache: ``update`` writes only the valid tokens, so pages hold
real tokens only. A decode step is the rectangle with ``max_q_len == 1``. A *packed* forward
(``PagedSession.extend(..., packed=True)`` over rows of different lengths) is a rectangle of one
row, every row's tokens one after the other, so no padding is computed; ``StepPlan.parts`` tells
attention where each row's tokens are.

Version note: transformers 5.24 passes the cache as ``cache=`` and calls
``update(k, v, layer_idx, kwargs=...)``; 5.17 passes ``past_key_values=`` and calls
``update(k, v, layer_idx, cache_kwargs)``. `update` accepts both, and nothing here depends on
the base class's per-layer storage (``self.layers`` stays empty).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import Cache

from ..cache_interface import KVCache

__all__ = ["StepPlan", "PagedCache", "pack_rows"]


@dataclass
class StepPlan:
    """Everything one forward needs to write and read the paged cache (built once, used by every layer).

    Attributes:
        kv: the paged cache (a `KVCache`: a `PagedKVCache`, or a `LayeredKVCache` with a block table
            per layer).
        seq_ids: sequence id of each batch row, ``batch`` ints.
        slots: int64 ``[num_new]``, flat cache slot of each valid new token, rows in order
            (``[num_layers, num_new]`` on a `LayeredKVCache`: a row per layer).
        q_lens: int32 ``[batch]``, new tokens in each row (>= 1); ``max_q_len`` is their max.
        valid: bool ``[batch, max_q_len]`` marking the real tokens of the rectangle, or None
            when every row is full (decode, or equal lengths).
        block_table: int32 ``[batch, max_pages]`` after the new tokens were reserved (layer 0's on
            a `LayeredKVCache`).
        seq_lens: int32 ``[batch]``, tokens held per sequence including the new ones.
        decode: attention function for ``max_q_len == 1``:
            ``f(q [batch, Hq, D], k_cache, v_cache, block_table, seq_lens, *, scale)``.
        prefill: attention function for longer rows:
            ``f(q [batch, Hq, max_q_len, D], k_cache, v_cache, block_table, seq_lens, q_lens, *, scale)``.
        max_q_len: width of the rectangle.
        attn_kwargs: extra keywords for this step's attention calls (see `attention.Backend.prepare`).
        layer_tables: on a `LayeredKVCache`, ``(block_table, attn_kwargs)`` of each layer; else None
            (every layer reads ``block_table`` with ``attn_kwargs``).
        parts: a packed forward (``PagedSession.extend(..., packed=True)`` over rows of different
            lengths): the model sees one row holding every new token, rows one after the other
            (``valid`` is then None), so no padding is computed; attention reads it in parts,
            ``(index, plan)`` pairs: ``index`` int64 ``[n]`` the positions in the packed row of the
            tokens of ``plan``'s rows (the decode rows, then the longer rows), each with its own
            block table, lengths and ``attn_kwargs``. None: the rectangle as described above.
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
    """A transformers `Cache` whose storage is a paged KV cache shared by many sequences.

    It holds no tensors of its own: `update` writes into ``plan.kv`` at ``plan.slots``. Use it
    only through `paged_ref.hf` (which registers the matching attention function and sets the
    plan before each forward); with any other attention implementation the model would attend
    to the new tokens only.

    Args:
        kv_cache: the `KVCache` (`PagedKVCache` or `LayeredKVCache`) to write into.

    Example:
        >>> from paged_ref import PagedKVCache
        >>> kv = PagedKVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=32)
        >>> cache = PagedCache(kv)
        >>> cache.get_seq_length()     # no forward in flight
        0
    """

    def __init__(self, kv_cache: KVCache):
        if not isinstance(kv_cache, KVCache):
            raise TypeError(
                f"kv_cache must be a paged_ref.PagedKVCache or LayeredKVCache, got {type(kv_cache).__name__}"
            )
        try:
            super().__init__(layers=[])  # transformers >= 4.56: per-layer storage, unused here
        except TypeError:  # pragma: no cover - older base classes take no arguments
            super().__init__()
        self.kv = kv_cache
        self.plan: StepPlan | None = None

    # ------------------------------------------------------------------ the one real method
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this layer's new K/V into their pages.

        Args:
            key_states, value_states: ``[batch, num_kv_heads, max_q_len, head_dim]`` (after RoPE).
            layer_idx: the layer.

        Returns:
            ``(key_states, value_states)`` unchanged: the registered attention function reads
            the full history from the pages, not from these tensors.
        """
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
        # slots shared by every layer are checked once per forward, at layer 0
        check = layer_idx == 0 or plan.kv.tables_per_layer
        with torch.profiler.record_function("paged_ref::cache_write"):  # a named region in a profile
            plan.kv.write(layer_idx, slots, k.contiguous(), v.contiguous(), check_values=check)
        return key_states, value_states

    # ------------------------------------------------------------------ queries the model makes
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Longest number of tokens held by a sequence of the forward in flight (0 if none).

        transformers < 5.20 derives a default ``cache_position`` from it; paged_ref always passes
        explicit ``position_ids``, so it never sets positions (eviction makes tokens held and
        absolute positions differ).
        """
        return int(self.plan.seq_lens.max()) if self.plan is not None else 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        """(kv_length, kv_offset) for mask builders; unused, since the paged attention masks itself."""
        return self.get_seq_length(), 0

    def get_max_length(self, *args, **kwargs) -> int:
        return -1  # grows page by page; bounded only by the pool

    @property
    def is_compileable(self) -> bool:
        return False

    # ------------------------------------------------------------------ unsupported generate() features
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
    """Turn ``plan``'s rectangle into one row of its valid tokens, split in parts for attention.

    Returns ``(input_ids, position_ids)``, each ``[1, num_new]``, and sets ``plan.parts``: the
    decode rows (one new token each) and the longer rows, each part with its own block table,
    lengths and attention keywords prepared by ``prepare(sub_plan)`` (`StepPlan.parts`).
    """
    device = plan.kv.device
    q_lens = plan.q_lens.tolist()
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
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
