"""Mixed-length batches under a fixed KV budget: how many fit, how much memory is wasted, tokens/s.

A batch of requests is drawn from a realistic length distribution (lognormal prompt and output
lengths, :func:`paged_ref.fragmentation.make_workload`) and held at once in a KV budget of
``budget_tokens`` token slots. Two ways to hold it:

* **contiguous max-length reservation**: each request reserves ``max_len`` slots up front (a
  ``StaticCache`` of ``max_len`` per row), so ``budget_tokens // max_len`` requests fit;
* **paged**: each request holds ``ceil(len / page_size)`` pages, so requests fit until the pool's
  pages run out (counted by the real allocator).

Memory overhead of the paged cache = slots held / tokens held - 1, counted from a real
`PagedKVCache` (the theoretical minimum is the KV bytes of the tokens actually held).
Throughput = tokens decoded per second by the whole batch (one token per request per step),
measured with the model on the admitted batches, and on the same (smaller) batch for a
like-for-like step time.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..block_table import pages_needed
from ..memory import KVGeometry
from ._scaling_decoders import ContiguousDecoder, PagedDecoder, synchronize
from .scaling_report import fit_counts, paged_overhead

__all__ = ["page_size_sweep", "batch_throughput"]


def _attention_time(decode, lengths, *, page_size, geometry: KVGeometry, repeats: int) -> float:
    """Median time of one decode-attention call over the batch held in a shuffled page pool."""
    num_kv_heads, head_dim, dtype, device = geometry.num_kv_heads, geometry.head_dim, geometry.dtype, geometry.device
    num_q_heads = geometry.num_q_heads or num_kv_heads
    gen = torch.Generator().manual_seed(0)
    total = sum(pages_needed(n, page_size) for n in lengths)
    perm = torch.randperm(total, generator=gen)  # physical pages in shuffled order
    k_cache = torch.randn(total, page_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(total, page_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    tables, start = [], 0
    for n in lengths:
        p = pages_needed(n, page_size)
        tables.append(perm[start : start + p])
        start += p
    width = max(len(t) for t in tables)
    block_table = torch.zeros(len(lengths), width, dtype=torch.int32)  # [batch, max_pages]
    for b, t in enumerate(tables):
        block_table[b, : len(t)] = t
    block_table = block_table.to(device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)  # [batch]
    q = torch.randn(len(lengths), num_q_heads, head_dim, generator=gen).to(device, dtype)  # [batch, Hq, D]
    decode(q, k_cache, v_cache, block_table, seq_lens)  # warm-up (and compile on GPU)
    times = []
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        decode(q, k_cache, v_cache, block_table, seq_lens)
        synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def page_size_sweep(
    lengths, page_sizes, *, geometry: KVGeometry, backends: dict, repeats: int = 5, deadline: float | None = None
) -> list[dict]:
    """Overhead (counted) and decode-attention time (measured) of the batch for each page size.

    Args:
        lengths: the batch's sequence lengths.
        page_sizes: e.g. ``[8, 16, 32, 64, 128, 256]``.
        geometry: the model's KV geometry (heads, head_dim, dtype and device of its layers).
        backends: name -> decode attention function (the common signature).
        repeats: timed calls per point (median kept).
        deadline: ``time.monotonic()`` after which points are no longer timed (None in the result;
            a compiled backend may compile once per page size).

    Returns:
        one dict per page size: `paged_overhead` plus ``attention_s: {backend: seconds or None}``
        (one layer, the whole batch).
    """
    rows = []
    for ps in page_sizes:
        row = paged_overhead(lengths, page_size=ps)
        row["attention_s"] = {}
        for name, fn in backends.items():
            late = deadline is not None and time.monotonic() > deadline
            row["attention_s"][name] = (
                None if late else _attention_time(fn, lengths, page_size=ps, geometry=geometry, repeats=repeats)
            )
        rows.append(row)
    return rows


def _teacher_steps(decoder, prompt, lengths, steps, warmup, rows=None, device="cpu"):
    """Feed each row its next prompt token for ``warmup`` + ``steps`` steps; time the last ``steps``."""
    rows = list(range(len(lengths))) if rows is None else rows
    pos = [lengths[r] for r in rows]
    times = []
    for i in range(warmup + steps):
        chunks = [prompt[p : p + 1] for p in pos]
        synchronize(device)
        t = time.perf_counter()
        if isinstance(decoder, PagedDecoder):
            decoder.feed(chunks, rows=rows)
        else:
            decoder.feed(chunks)
        if i >= warmup:
            times.append(time.perf_counter() - t)
        pos = [p + 1 for p in pos]
    return times


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
    """Tokens/s of the contiguous max-length reservation vs the paged cache, same KV budget.

    The contiguous run holds the first ``budget_tokens // max_len`` requests in a StaticCache of
    ``max_len`` per row (prefilled in one left-padded forward); each paged run holds as many
    requests as its pool of ``budget_tokens // page_size`` pages admits (each prefilled on its
    own), then decodes all of them together, and also times the contiguous run's smaller batch
    (same rows) for a step-for-step comparison. Row ``r`` holds ``prompt[:lengths[r]]`` and is
    fed ``prompt[lengths[r] + i]`` at step ``i`` (teacher forcing), so every run decodes the same
    tokens.

    Returns:
        ``{"fit": admission counts at the prompts' lengths, "decoded": requests the paged batch
        decodes (those whose pages still fit after every timed step), "contiguous": {...},
        "paged": {backend: {...}}}``; each with ``batch``,
        ``step_s`` (median), ``tokens_per_s``, ``kv_bytes`` held, ``peak_bytes`` (CUDA) and,
        for paged, ``same_batch_step_s`` / ``same_batch_tokens_per_s``.
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
    n_contig = fit["reserve_max"]
    # the paged batch decodes the requests whose pages still fit once they have grown by every
    # timed step (the first n_contig rows grow twice: their same-batch run comes after)
    grown = [n + (warmup + steps) * (2 if r < n_contig else 1) for r, n in enumerate(lengths)]
    n_paged = fit_counts(grown, budget_tokens=budget_tokens, max_len=max_len, page_size=page_size)["paged_allocator"]
    out = {"fit": fit, "decoded": n_paged, "paged": {}}

    def peak_reset():
        if device.type == "cuda":
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)

    def peak():
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    if n_contig >= 1:
        dec = ContiguousDecoder(model, "static", max_len=max_len)
        try:
            peak_reset()
            dec.feed([prompt[:n] for n in lengths[:n_contig]], predict=False)
            times = _teacher_steps(dec, prompt, lengths[:n_contig], steps, warmup, device=device)
            step = statistics.median(times)
            out["contiguous"] = {
                "label": "contiguous max-length reservation (StaticCache)",
                "batch": n_contig,
                "step_s": step,
                "tokens_per_s": n_contig / step,
                "times_s": times,
                "kv_bytes": dec.kv_bytes(),
                "peak_bytes": peak(),
            }
        finally:
            dec.close()
    for backend in paged_backends:
        dec = PagedDecoder(model, backend=backend, num_pages=budget_tokens // page_size, page_size=page_size)
        try:
            peak_reset()
            dec.start(n_paged)
            for r, n in enumerate(lengths[:n_paged]):  # one request at a time: no padding in prefill
                for s in range(0, n, prefill_chunk):
                    dec.feed([prompt[s : min(n, s + prefill_chunk)]], predict=False, rows=[r])
            held_tokens = sum(lengths[:n_paged])
            pages = dec.pages_held()
            times = _teacher_steps(dec, prompt, lengths[:n_paged], steps, warmup, device=device)
            step = statistics.median(times)
            entry = {
                "label": f"paged ({backend})",
                "batch": n_paged,
                "step_s": step,
                "tokens_per_s": n_paged / step,
                "times_s": times,
                "kv_bytes": dec.kv_bytes(),
                "peak_bytes": peak(),
                "pages_after_prefill": pages,
                "tokens_after_prefill": held_tokens,
                "overhead_after_prefill": pages * page_size / held_tokens - 1,
                "alloc_calls": list(dec.timer.calls),
            }
            if 1 <= n_contig <= n_paged:
                grown = [n + warmup + steps for n in lengths[:n_contig]]
                same = _teacher_steps(dec, prompt, grown, steps, warmup, rows=list(range(n_contig)), device=device)
                entry["same_batch_step_s"] = statistics.median(same)
                entry["same_batch_tokens_per_s"] = n_contig / entry["same_batch_step_s"]
            out["paged"][backend] = entry
        finally:
            dec.close()
    return out
