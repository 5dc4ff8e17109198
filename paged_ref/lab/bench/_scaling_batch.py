"""Mixed-length batches under a fixed KV budget of ``budget_tokens`` slots: how many fit, tokens/s.

The lengths come from `scaling_report.mixed_lengths` (lognormal prompts and outputs). A
contiguous max-length reservation (a ``StaticCache`` of ``max_len`` per row) admits
``budget_tokens // max_len`` requests; the paged pool admits requests until its pages run out
(counted by the real allocator). Throughput: tokens decoded per second by the whole batch (one
token per request per step, median step), on each admitted batch and, for paged, also on the
contiguous run's smaller batch (same rows) for a like-for-like step time.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from ...attention.flex import flex_paged_decode, paged_block_masks
from ...block_table import pack_padded, pages_needed
from ...memory import KVGeometry
from ._scaling_latency import ContiguousDecoder, PagedDecoder, peak_bytes, reset_peak, synchronize
from .scaling_report import fit_counts, paged_overhead

__all__ = ["page_size_sweep", "batch_throughput"]


def _attention_time(decode, lengths, *, page_size, geometry: KVGeometry, repeats: int, reuse_mask: bool = False):
    """Median time of one decode-attention call over the batch held in a shuffled page pool.

    ``reuse_mask`` (flex): the BlockMask is built once, as a model builds it once per step for all
    its layers, and passed to every call; returns ``(call seconds, build seconds)`` (both medians)."""
    num_kv_heads, head_dim, dtype, device = geometry.num_kv_heads, geometry.head_dim, geometry.dtype, geometry.device
    num_q_heads = geometry.num_q_heads or num_kv_heads
    gen = torch.Generator().manual_seed(0)
    total = sum(pages_needed(n, page_size) for n in lengths)
    perm = torch.randperm(total, generator=gen).tolist()  # physical pages in shuffled order
    k_cache = torch.randn(total, page_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(total, page_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    tables, start = [], 0
    for n in lengths:
        tables.append(perm[start : start + pages_needed(n, page_size)])
        start += len(tables[-1])
    block_table, seq_lens = pack_padded(tables, lengths, device=device)  # [batch, max_pages], [batch]
    q = torch.randn(len(lengths), num_q_heads, head_dim, generator=gen).to(device, dtype)  # [batch, Hq, D]
    if reuse_mask:
        build = partial(paged_block_masks, block_table, seq_lens, total, page_size)
        mask = build().physical
        call = partial(decode, q, k_cache, v_cache, block_table, seq_lens, block_mask=mask, check_values=False)
        return _median_time(call, repeats, device), _median_time(build, repeats, device)
    return _median_time(partial(decode, q, k_cache, v_cache, block_table, seq_lens), repeats, device)


def _median_time(fn, repeats: int, device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` synchronized calls, after one warm-up (and compile)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def page_size_sweep(
    lengths, page_sizes, *, geometry: KVGeometry, backends: dict, repeats: int = 5, deadline: float | None = None
) -> list[dict]:
    """Per page size: `paged_overhead` of ``lengths`` plus ``attention_s: {backend: seconds}``, the
    median of ``repeats`` decode-attention calls (one layer of ``geometry``, the whole batch) of
    each ``backends`` function; None once ``time.monotonic()`` is past ``deadline``. Flex is timed
    twice: as called alone (its BlockMask built per call) and as a model calls it, ``"<name> (mask
    reused)"`` with the mask built once (its build time in ``block_mask_s``)."""
    rows = []
    for ps in page_sizes:
        row = paged_overhead(lengths, page_size=ps)
        row["attention_s"] = {}
        for name, fn in backends.items():
            late = deadline is not None and time.monotonic() > deadline
            row["attention_s"][name] = (
                None if late else _attention_time(fn, lengths, page_size=ps, geometry=geometry, repeats=repeats)
            )
            if fn is flex_paged_decode:
                late = deadline is not None and time.monotonic() > deadline
                reused = (
                    (None, None)
                    if late
                    else _attention_time(fn, lengths, page_size=ps, geometry=geometry, repeats=repeats, reuse_mask=True)
                )
                row["attention_s"][f"{name} (mask reused)"], row["block_mask_s"] = reused
        rows.append(row)
    return rows


def _teacher_steps(decoder, prompt, lengths, steps, warmup, device, rows=None) -> list[float]:
    """Times of ``steps`` steps after ``warmup``, each feeding every row (or ``rows``) its next token."""
    pos = list(lengths)
    kwargs = {} if rows is None else {"rows": rows}
    times = []
    for i in range(warmup + steps):
        chunks = [prompt[p : p + 1] for p in pos]
        synchronize(device)
        t = time.perf_counter()
        decoder.feed(chunks, **kwargs)
        if i >= warmup:
            times.append(time.perf_counter() - t)
        pos = [p + 1 for p in pos]
    return times


def _run(label: str, batch: int, times: list[float], dec, device) -> dict:
    step = statistics.median(times)
    return {
        "label": label,
        "batch": batch,
        "step_s": step,
        "tokens_per_s": batch / step,
        "times_s": times,
        "kv_bytes": dec.kv_bytes(),
        "peak_bytes": peak_bytes(device),
    }


def batch_throughput(
    model,
    prompt: torch.Tensor,
    lengths,
    *,
    budget_tokens: int,
    max_len: int,
    page_size: int,
    paged_backends,
    steps: int,
    warmup: int,
    prefill_chunk: int = 2048,
) -> dict:
    """Tokens/s of the contiguous max-length reservation vs the paged cache in one KV budget. Row ``r``
    holds ``prompt[:lengths[r]]`` (contiguous: one left-padded prefill; paged: one per request) and
    is fed ``prompt[lengths[r] + i]`` at step ``i``.

    Returns:
        ``{"fit": admission counts at the prompts' lengths (`fit_counts`), "decoded": requests the
        paged batch decodes (those whose pages still fit after every timed step), "contiguous":
        {...}, "paged": {backend: {...}}}``; each run with ``batch``, ``step_s`` (median),
        ``tokens_per_s``, ``times_s``, ``kv_bytes``, ``peak_bytes`` (CUDA) and, for paged, the pages
        after prefill and ``same_batch_step_s`` / ``same_batch_tokens_per_s``.
    """
    device = next(model.parameters()).device
    need = max(lengths) + warmup + steps + 1
    if prompt.numel() < need:
        raise ValueError(f"prompt must hold at least {need} tokens, got {prompt.numel()}")
    if max(lengths) + warmup + steps > max_len:
        raise ValueError(
            f"max_len={max_len} must cover the longest request plus the decode steps "
            f"({max(lengths)} + {warmup + steps})"
        )
    fit = fit_counts(lengths, budget_tokens=budget_tokens, max_len=max_len, page_size=page_size)
    n_contig = fit["max_len"]
    # the paged batch decodes the requests whose pages still fit once they have grown by every
    # timed step (the first n_contig rows grow twice: their same-batch run comes after)
    grown = [n + (warmup + steps) * (2 if r < n_contig else 1) for r, n in enumerate(lengths)]
    n_paged = fit_counts(grown, budget_tokens=budget_tokens, max_len=max_len, page_size=page_size)["paged_allocator"]
    out = {"fit": fit, "decoded": n_paged, "paged": {}}
    if n_contig >= 1:
        dec = ContiguousDecoder(model, "static", max_len=max_len)
        try:
            reset_peak(device)
            dec.feed([prompt[:n] for n in lengths[:n_contig]], predict=False)
            times = _teacher_steps(dec, prompt, lengths[:n_contig], steps, warmup, device)
            out["contiguous"] = _run("contiguous max-length reservation (StaticCache)", n_contig, times, dec, device)
        finally:
            dec.close()
    for backend in paged_backends:
        dec = PagedDecoder(model, backend=backend, num_pages=budget_tokens // page_size, page_size=page_size)
        try:
            reset_peak(device)
            dec.start(n_paged)
            for r, n in enumerate(lengths[:n_paged]):  # one request at a time: no padding in prefill
                for s in range(0, n, prefill_chunk):
                    dec.feed([prompt[s : min(n, s + prefill_chunk)]], predict=False, rows=[r])
            held_tokens = sum(lengths[:n_paged])
            pages = dec.pages_held()
            times = _teacher_steps(dec, prompt, lengths[:n_paged], steps, warmup, device)
            entry = _run(f"paged ({backend})", n_paged, times, dec, device)
            entry.update(
                pages_after_prefill=pages,
                tokens_after_prefill=held_tokens,
                overhead_after_prefill=pages * page_size / held_tokens - 1,
                alloc_calls=list(dec.timer.calls),
            )
            if 1 <= n_contig <= n_paged:
                grown = [n + warmup + steps for n in lengths[:n_contig]]
                same = _teacher_steps(dec, prompt, grown, steps, warmup, device, rows=list(range(n_contig)))
                entry["same_batch_step_s"] = statistics.median(same)
                entry["same_batch_tokens_per_s"] = n_contig / entry["same_batch_step_s"]
            out["paged"][backend] = entry
        finally:
            dec.close()
    return out
