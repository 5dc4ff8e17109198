"""Paged attention as "gather by slot, then PyTorch SDPA": the fast backend on a CPU.

Each call copies a batch's tokens out of the pages through the slot map and hands them to
``scaled_dot_product_attention`` with a mask for the ragged lengths (and causality in prefill),
as transformers' continuous batching does: a copy of the K/V per layer that a paged kernel
avoids, the practical path on a CPU. `prepare` builds the slot map and mask once per step. 8-bit
pages (``k_scale``, ``v_scale``) are dequantized as they are gathered, then attended in float32.

Example:
    >>> kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
    >>> bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    >>> out = sdpa_paged_decode(torch.randn(2, 8, 64), kc, vc, bt, torch.tensor([20, 5]))
    >>> out.shape
    torch.Size([2, 8, 64])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._arith import cdiv
from ._checks import check_paged_inputs, check_prefill_inputs
from .online_softmax import LOG2E, merge_partials

__all__ = ["DECODE_CHUNK", "SlotGather", "attend_chunked", "prepare", "sdpa_paged_decode", "sdpa_paged_prefill"]


class SlotGather(NamedTuple):
    """Per-step gather plan of a prefill (``slots``, ``mask``) or a decode (``pages``, ``start``)."""

    slots: torch.Tensor | None  # int64 [batch, max_kv]
    mask: torch.Tensor | None  # bool [batch, 1, q_len, max_kv]
    causal: bool = False  # every row a whole fresh prompt: SDPA's causal flag replaces the mask
    padded_rows: bool = False  # some rows have fewer than q_len new tokens (zeroed)
    pages: torch.Tensor | None = None  # int64 [batch, pages used], padding -> page 0
    start: int | None = None  # one sequence on consecutive pages: its first slot, read in place
    max_kv: int = 0
    padding: torch.Tensor | None = None  # bool [batch, max_kv]: not the row's tokens, zeroed (0 x NaN is NaN)
    made_for: tuple = ()  # (q_len or "decode", batch, page_size): the calls it fits


def prepare(block_table, seq_lens, page_size: int, q_lens=None, q_len: int = 1) -> SlotGather:
    """The `SlotGather` of one step over int ``block_table [batch, max_pages]``, ``seq_lens [batch]``:
    decode when ``q_lens`` (int ``[batch]`` new tokens) is None, else prefill of ``q_len`` query rows."""
    lens = seq_lens.long()  # [batch]
    max_kv, made_for = int(lens.max()), ("decode" if q_lens is None else q_len, lens.shape[0], page_size)
    t = torch.arange(max_kv, device=block_table.device)  # [max_kv] logical token index
    in_seq = t[None, :] < lens[:, None]  # [batch, max_kv]
    padding = None if bool(in_seq.all()) else ~in_seq  # [batch, max_kv]
    if q_lens is None:  # decode reads whole pages (`_attend_decode`), masked by `padding`: no slot map
        n_pages = cdiv(max_kv, page_size)
        used = torch.arange(n_pages, device=lens.device)[None, :] < cdiv(lens, page_size)[:, None]
        pages = torch.where(used, block_table[:, :n_pages].long(), 0)  # [batch, n_pages]
        start = None
        if pages.shape[0] == 1 and bool((pages[0, 1:] - pages[0, :-1] == 1).all()):
            start = int(pages[0, 0]) * page_size  # consecutive pages: one run of slots
        return SlotGather(None, None, pages=pages, start=start, max_kv=max_kv, padding=padding, made_for=made_for)
    page_col = (t // page_size).clamp(max=block_table.shape[1] - 1)
    slots = block_table.long()[:, page_col] * page_size + t % page_size  # [batch, max_kv]
    slots = torch.where(in_seq, slots, 0)  # padding reads slot 0: zeroed in `_attend`, masked
    padded_rows = bool((q_lens < q_len).any())
    if bool((q_lens.long() == lens).all()) and q_len == max_kv:  # whole fresh prompts
        return SlotGather(slots, None, causal=True, padded_rows=padded_rows, padding=padding, made_for=made_for)
    q_pos = (lens - q_lens.long())[:, None] + torch.arange(q_len, device=lens.device)  # [batch, q_len]
    mask = (t[None, None, :] <= q_pos[:, :, None]) & in_seq[:, None, :]  # [batch, q_len, max_kv]
    mask = mask[:, None]  # [batch, 1, q_len, max_kv]
    return SlotGather(slots, mask, padded_rows=padded_rows, padding=padding, made_for=made_for)


def _fitting(gather, made_for: tuple) -> SlotGather:
    """``gather`` if `prepare` made it for ``made_for`` (q_len or "decode", batch, page_size), else an error."""
    if not isinstance(gather, SlotGather):
        raise TypeError(f"gather must be a SlotGather from prepare(...) or None, got {type(gather).__name__}")
    if gather.made_for != made_for:
        raise ValueError(f"gather must be prepare's for (q_len, batch, page_size) {made_for}, got {gather.made_for}")
    return gather


def _dequantized(pages: torch.Tensor, page_scale, page_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered ``pages [*page_ids.shape, ...]`` of 8-bit bytes times ``page_scale [num_pages, Hkv]`` at
    ``page_ids``, in float32 (the reference's product), then ``dtype``; ``pages`` as they are without a scale."""
    if page_scale is None:
        return pages
    scale = page_scale[page_ids].view(*page_ids.shape, *[1] * (pages.dim() - page_ids.dim() - 2), -1, 1)
    return (pages.float() * scale).to(dtype)  # [..., Hkv, D]


def _attend(q, k_cache, v_cache, gather: SlotGather, scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """q: [batch, Hq, q_len, D] (the compute dtype with 8-bit pages) -> [batch, Hq, q_len, D] (strided pages copied)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat = (-1, num_kv_heads, head_dim)
    pages = None if k_scale is None else gather.slots // k_cache.shape[1]  # [batch, max_kv] each slot's page
    k = _dequantized(k_cache.reshape(flat)[gather.slots], k_scale, pages, q.dtype)  # [batch, max_kv, Hkv, D], a copy
    v = _dequantized(v_cache.reshape(flat)[gather.slots], v_scale, pages, q.dtype)  # [batch, max_kv, Hkv, D], a copy
    if gather.padding is not None:
        k.masked_fill_(gather.padding[:, :, None, None], 0.0)
        v.masked_fill_(gather.padding[:, :, None, None], 0.0)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [batch, Hkv, max_kv, D]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=gather.mask, is_causal=gather.causal, scale=scale, enable_gqa=q.shape[1] != num_kv_heads
    )


# Tokens per chunk of `attend_chunked`: SDPA over one long view runs one work item per KV head, which leaves
# cores idle where they outnumber the KV heads, so a long sequence is read in pieces of this many tokens.
DECODE_CHUNK = 512
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int = DECODE_CHUNK):
    """One query token ``q [Hq, D]`` over one sequence's K/V ``[T, Hkv, D]`` (any strides) -> ``[Hq, D]``.

    SDPA on one long view runs one work item per KV head, too few for the cores: the tokens are
    cut into ``chunk``-token pieces as SDPA's batch (a view), merged by their log-sum-exps
    (split-K's reduction). Fewer than ``2 * chunk`` tokens go to SDPA in one piece.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    num_q_heads = q.shape[0]
    qg = q.view(1, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [1, Hkv, G, D]
    if _FLASH_CPU is None or q.device.type != "cpu" or num_tokens < 2 * chunk:  # one piece: plain SDPA
        out = F.scaled_dot_product_attention(qg, k[None].transpose(1, 2), v[None].transpose(1, 2), scale=scale)
        return out.reshape(num_q_heads, head_dim)
    n = num_tokens // chunk
    pieces = []
    for lo, count, size in ((0, n, chunk), (n * chunk, 1, num_tokens - n * chunk)):
        if size == 0:
            continue
        kc = k[lo : lo + count * size].view(count, size, num_kv_heads, head_dim).transpose(1, 2)  # [n, Hkv, C, D]
        vc = v[lo : lo + count * size].view(count, size, num_kv_heads, head_dim).transpose(1, 2)  # [n, Hkv, C, D]
        pieces.append(_FLASH_CPU(qg.expand(count, -1, -1, -1), kc, vc, scale=scale)[:2])  # [n, Hkv, G, D], [n, Hkv, G]
    acc = torch.promote_types(q.dtype, torch.float32)  # merge in float32 (float64 for float64)
    out = torch.cat([o for o, _ in pieces]).to(acc).flatten(1, 2)  # [pieces, Hq, D], normalized per piece
    lse = torch.cat([lse for _, lse in pieces]).to(acc).flatten(1)  # [pieces, Hq]
    # the split-K reduction of `online_softmax`: a normalized piece is (m = lse in base 2, l = 1, acc = out)
    return merge_partials(lse * LOG2E, torch.ones_like(lse), out).to(q.dtype)  # [Hq, D]


def _attend_decode(q, k_cache, v_cache, gather: SlotGather, scale: float, k_scale=None, v_scale=None):
    """q: [batch, Hq, D] (the compute dtype with 8-bit pages) -> [batch, Hq, D]: one sequence on consecutive
    contiguous floating pages read in place, else whole pages gathered; one sequence then through
    `attend_chunked`, a batch through two matmuls."""
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_q_heads, _ = q.shape
    max_kv = gather.max_kv
    in_place = gather.start is not None and k_scale is None and k_cache.is_contiguous() and v_cache.is_contiguous()
    if in_place:  # the run of slots viewed as it lies, no copy
        k = k_cache.view(-1, num_kv_heads, head_dim)[gather.start : gather.start + max_kv]  # [T, Hkv, D]
        v = v_cache.view(-1, num_kv_heads, head_dim)[gather.start : gather.start + max_kv]  # [T, Hkv, D]
        return attend_chunked(q[0], k, v, scale)[None]  # [1, Hq, D]
    flat = gather.pages.reshape(-1)  # [batch * n_pages]
    k = _dequantized(k_cache.index_select(0, flat), k_scale, flat, q.dtype)  # [B * n_pages, P, Hkv, D]
    v = _dequantized(v_cache.index_select(0, flat), v_scale, flat, q.dtype)
    k = k.view(batch, -1, num_kv_heads, head_dim)[:, :max_kv]  # [B, T, Hkv, D]
    v = v.view(batch, -1, num_kv_heads, head_dim)[:, :max_kv]
    if gather.padding is not None:  # the masked scores are -inf below; their V must be finite
        v.masked_fill_(gather.padding[:, :, None, None], 0.0)
    if batch == 1:  # gathered pages of one sequence: the same chunked path as in place
        return attend_chunked(q[0], k[0], v[0], scale)[None]  # [1, Hq, D]
    qg = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1))  # [B, Hkv, G, T]
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()  # softmax in fp32
    scores = scores * scale
    if gather.padding is not None:
        scores = scores.masked_fill(gather.padding[:, None, None, :], float("-inf"))  # padding [B, T]
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim)


def _compute(q: torch.Tensor, k_scale) -> torch.Tensor:
    """``q`` in the dtype attention runs in: its own, or float32 (float64 for float64) with 8-bit pages."""
    return q if k_scale is None else q.to(torch.promote_types(q.dtype, torch.float32))


def sdpa_paged_decode(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    scale=None,
    gather=None,
    check_values=True,
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """Decode attention over the pages, the contract of `reference_paged_decode`; ``gather``:
    ``prepare(block_table, seq_lens, page_size)`` built once per step, or None."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_paged_inputs(
        q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values, **scales
    )
    if gather is None:
        gather = prepare(block_table, seq_lens, k_cache.shape[1])
    gather = _fitting(gather, ("decode", q.shape[0], k_cache.shape[1]))
    return _attend_decode(_compute(q, k_scale), k_cache, v_cache, gather, scale, **scales).to(q.dtype)


def sdpa_paged_prefill(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    q_lens,
    *,
    scale=None,
    gather=None,
    check_values=True,
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """Causal prefill over the pages, the contract of `reference_paged_prefill`; ``gather``:
    ``prepare(block_table, seq_lens, page_size, q_lens, max_q_len)``, or None."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_prefill_inputs(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=check_values, **scales
    )
    if gather is None:
        gather = prepare(block_table, seq_lens, k_cache.shape[1], q_lens, q.shape[2])
    gather = _fitting(gather, (q.shape[2], q.shape[0], k_cache.shape[1]))
    out = _attend(_compute(q, k_scale), k_cache, v_cache, gather, scale, **scales).to(q.dtype)
    if not gather.padded_rows:
        return out
    padding = torch.arange(q.shape[2], device=q.device)[None, :] >= q_lens[:, None]  # [batch, max_q_len]
    return out.masked_fill_(padding[:, None, :, None], 0.0)
