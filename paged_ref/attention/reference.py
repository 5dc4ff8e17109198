"""Plain-PyTorch paged attention: the oracle every faster path is checked against.

The paged cache stores K and V in fixed-size pages, in the layout vLLM and FlashAttention use:

    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]

A sequence's tokens live on the pages listed in its row of the block table, in order:
logical token ``t`` of sequence ``b`` sits at physical page ``block_table[b, t // page_size]``,
offset ``t % page_size``. Only the first ``ceil(seq_lens[b] / page_size)`` entries of a row are
read; the rest of the row is padding and may hold anything (even out-of-range page ids).

The functions here do the obvious thing: gather each sequence's pages into a contiguous
``[seq_len, num_kv_heads, head_dim]`` tensor, then compute softmax attention one sequence at a
time. Clarity over speed: they are the reference, not a fast path.

Two entry points share one input check (:func:`check_paged_inputs`, also used by the other
implementations so that every path rejects the same bad inputs with the same message):

* :func:`paged_attention_reference` - decode, one new query token per sequence.
* :func:`paged_prefill_reference` - many new query tokens per sequence, causal over the
  cached prefix plus the new tokens.
"""

from __future__ import annotations

import math

import torch

from .._arith import cdiv

__all__ = [
    "check_paged_inputs",
    "check_prefill_inputs",
    "gather_sequence",
    "paged_attention_reference",
    "paged_prefill_reference",
]

_INT_DTYPES = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    q_ndim: int = 3,
    check_values: bool = True,
) -> float:
    """Validate the common paged-attention arguments and return the softmax scale to use.

    Raises ``TypeError`` for a wrong type or dtype and ``ValueError`` for a wrong shape, device
    or value; each message names the argument, what was expected and what was given.

    Args:
        q: ``[batch, num_q_heads, head_dim]`` (``q_ndim=3``, decode) or
            ``[batch, num_q_heads, max_q_len, head_dim]`` (``q_ndim=4``, prefill); floating point.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``, same dtype and
            device as ``q``; ``num_q_heads`` must be a multiple of ``num_kv_heads``.
        block_table: int32/int64 ``[batch, max_pages]``; the entries a sequence uses must be
            distinct valid page ids, the rest are ignored.
        seq_lens: int32/int64 ``[batch]``, each in ``[1, max_pages * page_size]``.
        scale: ``None`` (meaning ``head_dim ** -0.5``) or a finite real number.
        check_values: also check values that need reading the tensors (``seq_lens`` range and
            the used block-table entries). This copies them to the host; a GPU fast path may
            turn it off.

    Returns:
        The scale as a Python float.

    Example:
        >>> q = torch.randn(2, 4, 8)
        >>> kc = torch.randn(3, 4, 2, 8)
        >>> check_paged_inputs(q, kc, kc, torch.tensor([[0, 1], [2, 0]]), torch.tensor([5, 3]))
        0.3535533905932738
    """
    for name, t in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_table", block_table),
        ("seq_lens", seq_lens),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    layout = "[batch, num_q_heads, head_dim]" if q_ndim == 3 else "[batch, num_q_heads, max_q_len, head_dim]"
    if q.dim() != q_ndim:
        raise ValueError(f"q must have shape {layout} ({q_ndim} dims), got shape {_shape(q)}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must have shape [num_pages, page_size, num_kv_heads, head_dim], got shape {_shape(k_cache)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the same shape as k_cache {_shape(k_cache)}, got {_shape(v_cache)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_q_heads = q.shape[0], q.shape[1]
    if num_pages < 1 or page_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"k_cache must have no empty dimension, got shape {_shape(k_cache)}")
    if q.shape[-1] != head_dim:
        raise ValueError(f"q head_dim (last dim) must equal k_cache head_dim {head_dim}, got q shape {_shape(q)}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads}) of k_cache"
        )
    if batch < 1:
        raise ValueError(f"q must hold at least one sequence, got batch {batch}")
    if block_table.dtype not in _INT_DTYPES:
        raise TypeError(f"block_table must be int32 or int64, got dtype {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape [batch={batch}, max_pages>=1], got shape {_shape(block_table)}")
    if seq_lens.dtype not in _INT_DTYPES:
        raise TypeError(f"seq_lens must be int32 or int64, got dtype {seq_lens.dtype}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must have shape [batch={batch}], got shape {_shape(seq_lens)}")
    if scale is None:
        scale = head_dim**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be None or a real number, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if check_values:
        max_pages = block_table.shape[1]
        lens = seq_lens.tolist()
        for b, n in enumerate(lens):
            if not 1 <= n <= max_pages * page_size:
                raise ValueError(
                    f"seq_lens[{b}] must be in [1, max_pages * page_size = {max_pages} * {page_size}], got {n}"
                )
        table = block_table.tolist()
        for b, n in enumerate(lens):
            used = table[b][: cdiv(n, page_size)]
            bad = [p for p in used if not 0 <= p < num_pages]
            if bad:
                raise ValueError(
                    f"block_table[{b}] uses page ids outside [0, num_pages={num_pages}) "
                    f"within its first {len(used)} entries (seq_lens[{b}]={n}): {bad[:4]}"
                )
            if len(set(used)) != len(used):
                # One physical page cannot hold two logical pages of the same sequence; a
                # repeat is a corrupted table (pages shared *between* sequences are fine).
                twice = sorted({p for p in used if used.count(p) > 1})
                raise ValueError(
                    f"block_table[{b}] lists page ids {twice[:4]} more than once within its "
                    f"first {len(used)} entries (seq_lens[{b}]={n})"
                )
    return float(scale)


def check_prefill_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    *,
    scale: float | None = None,
    check_values: bool = True,
) -> float:
    """:func:`check_paged_inputs` for prefill, plus ``q_lens``: int ``[batch]`` with
    ``0 <= q_lens[b] <= min(seq_lens[b], max_q_len)``. Returns the scale."""
    scale = check_paged_inputs(
        q, k_cache, v_cache, block_table, seq_lens, scale=scale, q_ndim=4, check_values=check_values
    )
    if not isinstance(q_lens, torch.Tensor):
        raise TypeError(f"q_lens must be a torch.Tensor, got {type(q_lens).__name__}")
    if q_lens.dtype not in _INT_DTYPES:
        raise TypeError(f"q_lens must be int32 or int64, got dtype {q_lens.dtype}")
    if q_lens.shape != seq_lens.shape:
        raise ValueError(f"q_lens must have shape [batch={q.shape[0]}], got {_shape(q_lens)}")
    if q_lens.device != q.device:
        raise ValueError(f"q_lens must be on the same device as q ({q.device}), got {q_lens.device}")
    if check_values:
        max_q_len = q.shape[2]
        for b, (m, n) in enumerate(zip(q_lens.tolist(), seq_lens.tolist())):
            if not 0 <= m <= min(n, max_q_len):
                raise ValueError(f"q_lens[{b}] must be in [0, min(seq_lens[{b}]={n}, max_q_len={max_q_len})], got {m}")
    return scale


def gather_sequence(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Copy one sequence's tokens out of a paged cache, in logical order.

    Args:
        cache: ``[num_pages, page_size, num_kv_heads, head_dim]``.
        block_table_row: int ``[max_pages]``, the sequence's pages in logical order.
        seq_len: number of tokens to return.

    Returns:
        ``[seq_len, num_kv_heads, head_dim]``.

    Example:
        >>> kc = torch.arange(12.).view(3, 2, 1, 2)      # 3 pages of 2 tokens
        >>> gather_sequence(kc, torch.tensor([2, 0]), 3)[:, 0, 0].tolist()
        [8.0, 10.0, 0.0]
    """
    page_size = cache.shape[1]
    num_used = cdiv(seq_len, page_size)  # ceil
    pages = cache[block_table_row[:num_used].long()]  # [num_used, page_size, H, D]
    return pages.flatten(0, 1)[:seq_len]  # [seq_len, H, D]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention of one sequence with GQA.

    q: [num_q_heads, q_len, D]; k, v: [kv_len, num_kv_heads, D]; mask: bool [q_len, kv_len]
    (True = may attend) or None. Returns [num_q_heads, q_len, D] in float32 or float64.
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[0] // k.shape[1]  # query heads per KV head
    k = k.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, kv_len, D]
    v = v.to(compute).transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, kv_len, D]
    scores = (q.to(compute) @ k.transpose(1, 2)) * scale  # [Hq, q_len, kv_len]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # [Hq, q_len, D]


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Decode attention over a paged KV cache, by gathering each sequence's pages.

    Query ``b`` attends to the first ``seq_lens[b]`` tokens of sequence ``b`` (no causal mask:
    the query is the newest token and its own K/V is already in the cache).
    Arithmetic is float32 (float64 when ``q`` is float64).

    Args:
        q: ``[batch, num_q_heads, head_dim]``.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``;
            ``num_q_heads % num_kv_heads == 0`` (query head ``h`` reads KV head
            ``h // (num_q_heads // num_kv_heads)``).
        block_table: int32 ``[batch, max_pages]``; entries past a sequence's pages are ignored.
        seq_lens: int32 ``[batch]``, each ``>= 1``.
        scale: softmax scale, default ``head_dim ** -0.5``.
        check_values: also check the values of ``seq_lens`` and the used block-table entries
            (reads them on the host); every backend takes this keyword.

    Returns:
        ``[batch, num_q_heads, head_dim]``, dtype of ``q``.

    Example:
        >>> kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
        >>> q = torch.randn(2, 8, 64)
        >>> bt = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)   # 7: unused padding
        >>> out = paged_attention_reference(q, kc, vc, bt, torch.tensor([20, 5]))
        >>> out.shape
        torch.Size([2, 8, 64])
    """
    scale = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values)
    out = torch.empty_like(q)  # [batch, Hq, D]
    for b, n in enumerate(seq_lens.tolist()):
        k = gather_sequence(k_cache, block_table[b], n)  # [n, Hkv, D]
        v = gather_sequence(v_cache, block_table[b], n)  # [n, Hkv, D]
        out[b] = _attend(q[b].unsqueeze(1), k, v, None, scale).squeeze(1).to(q.dtype)
    return out


def paged_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    *,
    scale: float | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Prefill (or chunked prefill) attention over a paged KV cache, causal.

    Sequence ``b`` has ``seq_lens[b]`` tokens in the cache, of which the last ``q_lens[b]`` are
    the new tokens whose queries are in ``q`` (their K/V must already be written). New token
    ``i`` sits at logical position ``p = seq_lens[b] - q_lens[b] + i`` and attends to the
    cached tokens ``0..p`` (the prefix and the new tokens up to itself). A plain prefill has
    ``q_lens == seq_lens``; a decode step is ``q_lens == 1``.

    The layout of ``q`` is the one Hugging Face attention functions receive
    (``[batch, heads, q_len, head_dim]``), right-padded to ``max_q_len``; rows
    ``i >= q_lens[b]`` are padding and come back as zeros.

    Args:
        q: ``[batch, num_q_heads, max_q_len, head_dim]``.
        k_cache, v_cache: ``[num_pages, page_size, num_kv_heads, head_dim]``.
        block_table: int32 ``[batch, max_pages]``.
        seq_lens: int32 ``[batch]``, cached tokens per sequence including the new ones, ``>= 1``.
        q_lens: int32 ``[batch]``, new tokens per sequence, ``0 <= q_lens[b] <= seq_lens[b]``.
        scale: softmax scale, default ``head_dim ** -0.5``.
        check_values: also check the values of ``seq_lens``, ``q_lens`` and the used block-table
            entries (reads them on the host), as `paged_attention_reference` does.

    Returns:
        ``[batch, num_q_heads, max_q_len, head_dim]``, dtype of ``q``; padding rows are 0.

    Example:
        >>> kc, vc = torch.randn(4, 8, 1, 32), torch.randn(4, 8, 1, 32)
        >>> q = torch.randn(2, 2, 5, 32)           # up to 5 new tokens per sequence
        >>> bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        >>> out = paged_prefill_reference(q, kc, vc, bt, torch.tensor([12, 3]),
        ...                               torch.tensor([5, 3]))
        >>> out.shape, bool(out[1, :, 3:].eq(0).all())
        (torch.Size([2, 2, 5, 32]), True)
    """
    scale = check_prefill_inputs(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=check_values
    )
    out = torch.zeros_like(q)  # [batch, Hq, max_q_len, D]
    for b, (n, m) in enumerate(zip(seq_lens.tolist(), q_lens.tolist())):
        if m == 0:
            continue
        k = gather_sequence(k_cache, block_table[b], n)  # [n, Hkv, D]
        v = gather_sequence(v_cache, block_table[b], n)  # [n, Hkv, D]
        q_pos = torch.arange(n - m, n, device=q.device)  # [m] logical positions of queries
        kv_pos = torch.arange(n, device=q.device)  # [n]
        causal = kv_pos[None, :] <= q_pos[:, None]  # [m, n]
        out[b, :, :m] = _attend(q[b, :, :m], k, v, causal, scale).to(q.dtype)
    return out
