"""Cascade (shared-prefix) decode attention: a prefix that many requests share is read once.

When 32 samples fork one prompt, their block tables start with the same pages, and plain paged
attention reads them 32 times a step. Cascade attention (Hydragen; FlashInfer's cascade API)
splits each request's keys in two: the **prefix** shared by a group, read once, every query of
the group attending to it in one matmul (their rows side by side, as a prefill stacks tokens);
and the **suffix**, each request's own pages, attended alone. Each half returns ``(o, lse)``,
the normalised output and the log-sum-exp of its scores in base 2, and the two merge with
split-K's rule (:func:`merge_states`; ``(o, lse)`` is the split state ``(m = lse, l = 1, acc = o)``).

Who shares what: ``group_indptr [num_groups + 1]`` (group ``g`` is requests ``group_indptr[g] ..
group_indptr[g + 1] - 1``, as FlashInfer's ``indptr``) and ``prefix_lens [num_groups]``, the
tokens they share, a whole number of pages on which their block-table rows agree.

Example:
    >>> import torch
    >>> from paged_ref.attention.reference import reference_paged_decode
    >>> kc, vc = torch.randn(6, 4, 1, 8), torch.randn(6, 4, 1, 8)   # 6 pages of 4 tokens
    >>> bt = torch.tensor([[0, 1, 2], [0, 1, 3], [0, 1, 4]])          # pages 0, 1: a shared prefix
    >>> q, lens = torch.randn(3, 2, 8), torch.tensor([9, 11, 8])
    >>> out = reference_cascade_decode(q, kc, vc, bt, lens, torch.tensor([0, 3]), torch.tensor([8]))
    >>> torch.allclose(out, reference_paged_decode(q, kc, vc, bt, lens), atol=1e-6)
    True
"""

from __future__ import annotations

import torch

from ._checks import check_cascade_inputs
from .online_softmax import LOG2E, merge_partials
from .reference import gather_sequence

__all__ = ["attend_with_lse", "merge_states", "reference_cascade_decode", "request_prefixes", "shared_prefix_groups"]
__all__ += ["suffix_table"]


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over keys ``A`` and ``B`` from the softmax over each: outputs ``o [..., head_dim]``
    and base-2 log-sum-exps ``lse [...]`` merged by split-K's reduction (:func:`merge_partials` on
    the states ``(lse, 1, o)``). An empty part (``lse = -inf``) weighs nothing; each row needs one
    finite ``lse``.

    Example:
        >>> scores, v = torch.tensor([[1.0, 2.0, 0.5, 3.0]]), torch.arange(8.0).view(4, 2)   # base 2
        >>> ln2 = 0.6931471805599453
        >>> def part(s, v):                                   # (o, lse) of one part, lse in base 2
        ...     return torch.softmax(s * ln2, -1) @ v, torch.logsumexp(s * ln2, -1) / ln2
        >>> o, lse = merge_states(*part(scores[:, :2], v[:2]), *part(scores[:, 2:], v[2:]))
        >>> torch.allclose(o, part(scores, v)[0]) and torch.allclose(lse, part(scores, v)[1])
        True
    """
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"o_a, o_b must be [..., head_dim] and lse_a, lse_b the same [...], got o_a {tuple(o_a.shape)}, "
            f"lse_a {tuple(lse_a.shape)}, o_b {tuple(o_b.shape)}, lse_b {tuple(lse_b.shape)}"
        )
    m = torch.stack([lse_a, lse_b]).reshape(2, -1)  # [2, rows]: each part's max is its own lse
    acc = torch.stack([o_a, o_b]).reshape(2, m.shape[1], -1)  # [2, rows, D]
    o = merge_partials(m, torch.ones_like(m), acc).reshape(o_a.shape)  # [..., D]
    top = m.amax(0)  # [rows]
    lse = top + torch.log2(torch.exp2(m - top).sum(0))  # [rows]
    return o, lse.reshape(lse_a.shape)


def attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of many query rows over one key set, GQA without copying K/V: the rows of
    ``q[h]`` (``q: [num_kv_heads, rows, D]``) read KV head ``h`` of ``k, v: [kv_len >= 1,
    num_kv_heads, D]``. Returns float32 (float64 for float64 ``q``) ``(o [num_kv_heads, rows, D],
    lse [num_kv_heads, rows])``, ``lse`` in base 2."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k.to(compute).transpose(0, 1)  # [Hkv, kv_len, D]
    v = v.to(compute).transpose(0, 1)  # [Hkv, kv_len, D]
    scores = (q.to(compute) @ k.transpose(1, 2)) * (scale * LOG2E)  # [Hkv, rows, kv_len], base 2
    top = scores.amax(-1, keepdim=True)  # [Hkv, rows, 1]
    p = torch.exp2(scores - top)  # [Hkv, rows, kv_len]
    total = p.sum(-1)  # [Hkv, rows]
    return (p @ v) / total[..., None], top[..., 0] + torch.log2(total)


def request_prefixes(
    seq_lens: torch.Tensor, group_indptr: torch.Tensor, prefix_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's shared prefix and own suffix in tokens, ``(prefix [batch], suffix [batch])``.

    Example:
        >>> request_prefixes(torch.tensor([9, 11, 5]), torch.tensor([0, 2, 3]), torch.tensor([8, 0]))
        (tensor([8, 8, 0]), tensor([1, 3, 5]))
    """
    sizes = group_indptr[1:] - group_indptr[:-1]  # [num_groups] requests per group
    prefix = torch.repeat_interleave(prefix_lens, sizes, output_size=seq_lens.shape[0])  # [batch]
    return prefix, seq_lens - prefix


def suffix_table(block_table: torch.Tensor, prefix_pages: torch.Tensor) -> torch.Tensor:
    """``block_table`` with row ``b`` shifted left by ``prefix_pages[b]`` entries: the request's own
    pages from column 0 (the tail repeats the last entry: padding).

    Example:
        >>> suffix_table(torch.tensor([[0, 1, 2], [0, 1, 3]]), torch.tensor([2, 1])).tolist()
        [[2, 2, 2], [1, 3, 3]]
    """
    max_pages = block_table.shape[1]
    cols = torch.arange(max_pages, device=block_table.device)[None, :] + prefix_pages[:, None]  # [batch, max_pages]
    return block_table.gather(1, cols.clamp(max=max_pages - 1).long()).contiguous()


def shared_prefix_groups(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Who shares what in a batch, read on the host: ``(order, group_indptr, prefix_lens)``.

    Requests whose first page is the same are grouped (the batch reordered as ``block_table[order]``),
    sharing the longest run of pages full in every row; a request alone has ``prefix_lens = 0``.

    Example:
        >>> bt = torch.tensor([[0, 1, 2], [5, 6, 7], [0, 1, 3], [0, 4, 8]])
        >>> order, indptr, prefix = shared_prefix_groups(bt, torch.tensor([9, 9, 10, 12]), 4)
        >>> order.tolist(), indptr.tolist(), prefix.tolist()
        ([0, 2, 3, 1], [0, 3, 4], [4, 0])
    """
    lens, table = seq_lens.tolist(), block_table.tolist()
    full = [n // page_size for n in lens]  # full pages per row
    first = [table[b][0] if full[b] else -1 - b for b in range(len(lens))]  # rows without a full page stay alone
    order = sorted(range(len(lens)), key=lambda b: (first[b], b))
    indptr, prefix = [0], []
    for b in order:
        if len(indptr) > 1 and first[b] == first[order[indptr[-1] - 1]]:
            indptr[-1] += 1
            head = order[indptr[-2]]
            shared = 0
            while shared < min(prefix[-1], full[b]) and table[b][shared] == table[head][shared]:
                shared += 1
            prefix[-1] = shared
        else:
            indptr.append(indptr[-1] + 1)
            prefix.append(full[b])
    prefix = [p * page_size if end - start > 1 else 0 for p, start, end in zip(prefix, indptr, indptr[1:])]
    device = block_table.device
    return torch.tensor(order, device=device), torch.tensor(indptr, device=device), torch.tensor(prefix, device=device)


def reference_cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    group_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    scale: float | None = None,
    check_values: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~.reference.reference_paged_decode` (8-bit pages included) with each group's shared prefix read
    once for all its requests (``group_indptr``, ``prefix_lens``: see the module docstring; ``check_values``
    also checks the groups' sharing, off only for groups :func:`shared_prefix_groups` made)."""
    args = (q, k_cache, v_cache, block_table, seq_lens, group_indptr, prefix_lens)
    scale = check_cascade_inputs(*args, scale=scale, check_values=check_values, k_scale=k_scale, v_scale=v_scale)
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    o_prefix = torch.zeros(batch, num_q_heads, head_dim, dtype=compute, device=q.device)  # [batch, Hq, D]
    lse_prefix = torch.full((batch, num_q_heads), float("-inf"), dtype=compute, device=q.device)  # [batch, Hq]
    bounds = group_indptr.tolist()
    for g, prefix in enumerate(prefix_lens.tolist()):
        first, last = bounds[g], bounds[g + 1]
        if prefix == 0:
            continue
        k = gather_sequence(k_cache, block_table[first], prefix, k_scale)  # [prefix, Hkv, D]: read once
        v = gather_sequence(v_cache, block_table[first], prefix, v_scale)  # [prefix, Hkv, D]
        n = last - first
        rows = q[first:last].reshape(n, num_kv_heads, group, head_dim)  # [n, Hkv, group, D]
        rows = rows.permute(1, 0, 2, 3).reshape(num_kv_heads, n * group, head_dim)  # [Hkv, n * group, D]
        o, lse = attend_with_lse(rows, k, v, scale)  # [Hkv, n * group, D], [Hkv, n * group]
        o_prefix[first:last] = o.reshape(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3).flatten(1, 2)
        lse_prefix[first:last] = lse.reshape(num_kv_heads, n, group).permute(1, 0, 2).flatten(1, 2)
    prefix_tokens, suffix_lens = request_prefixes(seq_lens, group_indptr, prefix_lens)  # [batch] each
    table = suffix_table(block_table, prefix_tokens // page_size)  # [batch, max_pages]
    o_suffix = torch.zeros_like(o_prefix)  # [batch, Hq, D]
    lse_suffix = torch.full_like(lse_prefix, float("-inf"))  # [batch, Hq]
    for b, n in enumerate(suffix_lens.tolist()):
        if n == 0:
            continue
        k = gather_sequence(k_cache, table[b], n, k_scale)  # [n, Hkv, D]: this request's own pages
        v = gather_sequence(v_cache, table[b], n, v_scale)  # [n, Hkv, D]
        o, lse = attend_with_lse(q[b].view(num_kv_heads, group, head_dim), k, v, scale)  # [Hkv, group(, D)]
        o_suffix[b], lse_suffix[b] = o.flatten(0, 1), lse.flatten()
    out, _ = merge_states(o_prefix, lse_prefix, o_suffix, lse_suffix)  # [batch, Hq, D]
    return out.to(q.dtype)
