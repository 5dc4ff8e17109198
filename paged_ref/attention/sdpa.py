"""Paged attention as "gather by slot, then PyTorch SDPA": the fast backend on a CPU.

The K/V still live only in pages; each call copies a batch's tokens out through a slot map
``slots[b, t] = block_table[b, t // page_size] * page_size + t % page_size`` (one indexing
op per tensor) and hands them to ``torch.nn.functional.scaled_dot_product_attention`` with a
boolean mask for the ragged lengths (and causality in prefill). This is what transformers' own
continuous batching does with SDPA. It pays a copy of the batch's K/V per layer, which a paged
kernel (Triton) avoids; on a CPU, where there is no such kernel, it is the practical path.

The slot map and the mask depend only on the block table and the lengths, which every layer of
a step shares, so `prepare` builds them once per step and the per-layer calls reuse them.

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

__all__ = ["DECODE_CHUNK", "FusedDecode", "SlotGather", "attend_chunked", "prepare", "prepare_fused"]
__all__ += ["sdpa_fused_paged_decode", "sdpa_paged_decode", "sdpa_paged_prefill"]


class SlotGather(NamedTuple):
    """Per-step gather plan.

    slots: int64 ``[batch, max_kv]`` (prefill; None in decode). mask: bool ``[batch, 1, q_len,
    max_kv]`` (prefill) or None (decode masks by ``padding``). max_kv: the longest sequence (decode).
    pages: int64 ``[batch, max_pages_used]`` (decode: gathered a page at a time; padding -> 0).
    start: decode of one sequence whose pages are consecutive: its first slot (its K/V are then
    read in place, no copy); else None.
    causal: no mask, SDPA's own causal flag instead: every row is a whole fresh prompt (its new
    tokens are all its tokens), so query ``i`` sees keys ``0..i`` and a padded key is seen only by
    padding rows; SDPA then skips the upper triangle (half the work of a masked prefill).
    padded_rows: some rows have fewer new tokens than ``q_len`` (their padding rows are zeroed).
    padding: bool ``[batch, max_kv]``, True where a row's gathered K/V is not its own token (past
    its length: another sequence's slot, or its last page's unwritten tail), or None when there
    is none. Those K/V are zeroed after the gather: a masked score gets weight 0, but 0 x Inf
    or 0 x NaN in a neighbour's V would still be NaN.
    """

    slots: torch.Tensor | None
    mask: torch.Tensor | None
    causal: bool = False
    padded_rows: bool = False
    pages: torch.Tensor | None = None
    start: int | None = None
    max_kv: int = 0
    padding: torch.Tensor | None = None


def prepare(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    q_lens: torch.Tensor | None = None,
    q_len: int = 1,
) -> SlotGather:
    """Slot map and attention mask for one step (decode when ``q_lens`` is None).

    Args:
        block_table: int ``[batch, max_pages]``; seq_lens: int ``[batch]``.
        page_size: tokens per page.
        q_lens: int ``[batch]`` new tokens per sequence (prefill), or None (decode).
        q_len: query rows of the step (``max(q_lens)`` in prefill).
    """
    lens = seq_lens.long()  # [batch]
    max_kv = int(lens.max())
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
        return SlotGather(None, None, pages=pages, start=start, max_kv=max_kv, padding=padding)
    page_col = (t // page_size).clamp(max=block_table.shape[1] - 1)
    slots = block_table.long()[:, page_col] * page_size + t % page_size  # [batch, max_kv]
    slots = torch.where(in_seq, slots, 0)  # padding reads slot 0: zeroed in `_attend`, masked
    padded_rows = bool((q_lens < q_len).any())
    if bool((q_lens.long() == lens).all()) and q_len == max_kv:  # whole fresh prompts
        return SlotGather(slots, None, causal=True, padded_rows=padded_rows, padding=padding)
    q_pos = (lens - q_lens.long())[:, None] + torch.arange(q_len, device=lens.device)  # [batch, q_len]
    mask = (t[None, None, :] <= q_pos[:, :, None]) & in_seq[:, None, :]  # [batch, q_len, max_kv]
    # mask [batch, 1, q_len, max_kv]
    return SlotGather(slots, mask[:, None], padded_rows=padded_rows, padding=padding)


def _attend(q, k_cache, v_cache, gather: SlotGather, scale: float) -> torch.Tensor:
    """q: [batch, Hq, q_len, D] -> [batch, Hq, q_len, D]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat = (-1, num_kv_heads, head_dim)
    k = k_cache.view(flat)[gather.slots]  # [batch, max_kv, Hkv, D], a copy
    v = v_cache.view(flat)[gather.slots]  # [batch, max_kv, Hkv, D], a copy
    if gather.padding is not None:
        k.masked_fill_(gather.padding[:, :, None, None], 0.0)
        v.masked_fill_(gather.padding[:, :, None, None], 0.0)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [batch, Hkv, max_kv, D]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=gather.mask, is_causal=gather.causal, scale=scale, enable_gqa=q.shape[1] != num_kv_heads
    )


# Tokens per chunk of `attend_chunked`. With it, SmolLM2's decode step at 8192 tokens on 2 CPU cores
# went from 1.53x to 0.94x of DynamicCache's (`python -m paged_ref.lab.bench generate`, contexts workload).
DECODE_CHUNK = 512
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int = DECODE_CHUNK):
    """One query token over one sequence's ``[T, Hkv, D]`` K/V (any strides), split into chunks.

    SDPA on one long strided view runs one work item per KV head (3 for SmolLM2), too few to
    share between cores, and walks tokens ``Hkv * D`` elements apart. Here the tokens are cut into
    ``chunk``-token pieces that become SDPA's batch (a strided view: nothing is copied), each
    piece returns its output and log-sum-exp, and the pieces merge by their log-sum-exps
    (`online_softmax.merge_partials`, the Triton kernel's split-K reduction). The query heads of
    one KV head ride in SDPA's query-length dimension (GQA without ``enable_gqa``).

    Args:
        q: ``[Hq, D]``; k, v: ``[T, Hkv, D]`` with ``Hq % Hkv == 0``; scale: softmax scale.
        chunk: tokens per piece (a tail of ``T % chunk`` tokens is one more piece); fewer than
            ``2 * chunk`` tokens go to SDPA in one piece.

    Returns:
        ``[Hq, D]``, dtype of ``q``.
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
        out, lse = _FLASH_CPU(qg.expand(count, -1, -1, -1), kc, vc, scale=scale)[:2]  # [n, Hkv, G, D], [n, Hkv, G]
        pieces.append((out, lse))
    acc = torch.promote_types(q.dtype, torch.float32)  # merge in float32 (float64 for float64)
    out = torch.cat([o for o, _ in pieces]).to(acc).flatten(1, 2)  # [pieces, Hq, D], normalized per piece
    lse = torch.cat([lse for _, lse in pieces]).to(acc).flatten(1)  # [pieces, Hq]
    # the split-K reduction of `online_softmax`: a normalized piece is (m = lse in base 2, l = 1, acc = out)
    merged = merge_partials(lse * LOG2E, torch.ones_like(lse), out)  # [Hq, D]
    return merged.to(q.dtype)


def _attend_decode(q, k_cache, v_cache, gather: SlotGather, scale: float) -> torch.Tensor:
    """q: [batch, Hq, D] -> [batch, Hq, D], attention by matmul in the cache's own layout.

    One sequence on consecutive pages is read in place (a strided view, `attend_chunked`).
    Otherwise K/V are taken a page at a time (one ``index_select`` of whole pages, not one index
    per token); one sequence then goes through `attend_chunked` too, and a batch through two
    batched matmuls on strided views, so the ``[tokens, heads, head_dim]`` layout is never
    transposed into a copy (SDPA on the transposed view would make one).
    """
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_q_heads, _ = q.shape
    max_kv = gather.max_kv
    if gather.start is not None:  # in place: the run of slots viewed as it lies, no copy
        k = k_cache.view(-1, num_kv_heads, head_dim)[gather.start : gather.start + max_kv]  # [T, Hkv, D]
        v = v_cache.view(-1, num_kv_heads, head_dim)[gather.start : gather.start + max_kv]  # [T, Hkv, D]
        return attend_chunked(q[0], k, v, scale)[None]  # [1, Hq, D]
    flat = gather.pages.reshape(-1)  # [batch * n_pages]
    k = k_cache.index_select(0, flat).view(batch, -1, num_kv_heads, head_dim)[:, :max_kv]  # [B, T, Hkv, D]
    v = v_cache.index_select(0, flat).view(batch, -1, num_kv_heads, head_dim)[:, :max_kv]
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


def sdpa_paged_decode(
    q, k_cache, v_cache, block_table, seq_lens, *, scale=None, gather=None, check_values=True
) -> torch.Tensor:
    """Decode attention over the pages (same contract as `reference_paged_decode`).

    Args:
        q: ``[batch, num_q_heads, head_dim]``.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``, contiguous.
        block_table: int32 ``[batch, max_pages]``; seq_lens: int32 ``[batch]`` (>= 1).
        scale: default ``head_dim ** -0.5``.
        gather: ``prepare(block_table, seq_lens, page_size)`` built once per step, or None.
        check_values: also check values (copies the block table to the host).

    Returns:
        ``[batch, num_q_heads, head_dim]``.
    """
    scale = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values)
    if gather is None:
        gather = prepare(block_table, seq_lens, k_cache.shape[1])
    return _attend_decode(q, k_cache, v_cache, gather, scale)


class FusedDecode(NamedTuple):
    """Per-step plan of `sdpa_fused_paged_decode` (built once by `prepare_fused`, read by every layer).

    pages: int64 ``[batch * n_pages]``, each row's pages; a row's entries past its last page repeat
    its first page, so every gathered token is one of the row's own pages (masked where unused).
    tails: int64 ``[n]``, positions in the gathered ``[batch * n_pages * page_size]`` tokens past a
    row's length on its last page (zeroed after the gather: masked, but 0 x NaN would still be NaN).
    bias: ``[batch, 1, 1, n_pages * page_size]`` in the queries' dtype (the kernel reads the mask as
    that type), 0 for a row's tokens, -inf past its length.
    single: the `SlotGather` of a one-row step (read in place by `attend_chunked`), else None.
    """

    pages: torch.Tensor | None
    tails: torch.Tensor | None
    bias: torch.Tensor | None
    single: SlotGather | None = None


def prepare_fused(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, dtype: torch.dtype = torch.float32
) -> FusedDecode:
    """`FusedDecode` of one decode step: block_table int ``[batch, max_pages]``, seq_lens int ``[batch]``,
    ``dtype`` the queries'."""
    if block_table.shape[0] == 1:
        return FusedDecode(None, None, None, single=prepare(block_table, seq_lens, page_size))
    lens = seq_lens.long()  # [batch]
    used = cdiv(lens, page_size)  # [batch] pages per row
    n_pages = int(used.max())
    col = torch.arange(n_pages, device=lens.device)  # [n_pages]
    own = block_table[:, :n_pages].long()  # [batch, n_pages]
    pages = torch.where(col[None, :] < used[:, None], own, own[:, :1])  # [batch, n_pages]
    t = torch.arange(n_pages * page_size, device=lens.device)  # [T] gathered token index
    past = t[None, :] >= lens[:, None]  # [batch, T]
    bias = torch.zeros(past.shape, dtype=dtype, device=lens.device).masked_fill_(past, float("-inf"))  # [batch, T]
    tails = (past & (t[None, :] < (used * page_size)[:, None])).reshape(-1).nonzero().squeeze(1)  # [n]
    return FusedDecode(pages.reshape(-1), tails, bias[:, None, None, :])


def sdpa_fused_paged_decode(
    q, k_cache, v_cache, block_table, seq_lens, *, scale=None, fused=None, check_values=True
) -> torch.Tensor:
    """Decode attention in one fused CPU kernel call per layer (same contract as `sdpa_paged_decode`).

    `sdpa_paged_decode` spells a batch's attention out: gather, mask V, matmul, mask the scores,
    softmax, matmul, each a pass over memory. Here the pages are gathered once (`FusedDecode.pages`)
    and handed, as strided ``[batch, Hkv, T, D]`` views, to PyTorch's flash-attention CPU kernel
    with the step's additive mask (built once per step, not per layer): scores, softmax and the
    weighted sum happen in one tiled pass. The query heads of a KV head ride in the kernel's
    query-length dimension (GQA without repeating K/V). One sequence is read in place, as in
    `sdpa_paged_decode`.

    Args:
        q, k_cache, v_cache, block_table, seq_lens, scale, check_values: as in `sdpa_paged_decode`.
        fused: ``prepare_fused(block_table, seq_lens, page_size)`` built once per step, or None.

    Returns:
        ``[batch, num_q_heads, head_dim]``.
    """
    scale = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values)
    if fused is None:
        fused = prepare_fused(block_table, seq_lens, k_cache.shape[1], q.dtype)
    if fused.single is not None or _FLASH_CPU is None or q.device.type != "cpu":
        gather = fused.single or prepare(block_table, seq_lens, k_cache.shape[1])
        return _attend_decode(q, k_cache, v_cache, gather, scale)
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_q_heads, _ = q.shape
    k = k_cache.index_select(0, fused.pages)  # [batch * n_pages, page_size, Hkv, D], a copy
    v = v_cache.index_select(0, fused.pages)
    k.view(-1, num_kv_heads, head_dim).index_fill_(0, fused.tails, 0.0)  # tails past each row's length
    v.view(-1, num_kv_heads, head_dim).index_fill_(0, fused.tails, 0.0)
    k = k.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # [batch, Hkv, T, D], strided
    v = v.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [batch, Hkv, G, D]
    out = _FLASH_CPU(qg, k, v, attn_mask=fused.bias.to(q.dtype), scale=scale)[0]  # [batch, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim)


def sdpa_paged_prefill(
    q, k_cache, v_cache, block_table, seq_lens, q_lens, *, scale=None, gather=None, check_values=True
) -> torch.Tensor:
    """Causal prefill over the pages (same contract as `reference_paged_prefill`).

    Args:
        q: ``[batch, num_q_heads, max_q_len, head_dim]``.
        q_lens: int32 ``[batch]``; the other arguments as in `sdpa_paged_decode`, with
            ``gather = prepare(block_table, seq_lens, page_size, q_lens, max_q_len)``.

    Returns:
        ``[batch, num_q_heads, max_q_len, head_dim]``; padding rows are 0.
    """
    scale = check_prefill_inputs(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=check_values
    )
    if gather is None:
        gather = prepare(block_table, seq_lens, k_cache.shape[1], q_lens, q.shape[2])
    out = _attend(q, k_cache, v_cache, gather, scale)  # [batch, Hq, max_q_len, D]
    if not gather.padded_rows:
        return out
    padding = torch.arange(q.shape[2], device=q.device)[None, :] >= q_lens[:, None]  # [batch, max_q_len]
    return out.masked_fill_(padding[:, None, :, None], 0.0)
