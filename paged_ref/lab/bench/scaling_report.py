"""What notebook 06 reports from `python -m paged_ref.lab.bench scaling`: batch-fit counts and a run's tables.

:func:`mixed_lengths` draws a batch's lengths, :func:`fit_counts` counts the requests that fit a
KV budget under max-length reservation and under paging, :func:`paged_overhead` the slots paging
holds beyond the tokens. The rest are pure functions over the benchmark's result dicts.

Examples:
    >>> lengths = mixed_lengths(40, max_len=1024, mean_len=256, seed=0)
    >>> fit = fit_counts(lengths, budget_tokens=4096, max_len=1024, page_size=16)
    >>> fit["max_len"], fit["paged"] > fit["max_len"]
    (4, True)
    >>> 0 <= paged_overhead(lengths[:10], page_size=16)["overhead"] < 0.2
    True
    >>> s = alloc_summary([("allocate", 900, 1), ("allocate", 1100, 1), ("free", 4000, 4)])
    >>> s["allocate"]["calls"], s["allocate"]["median_ns"], s["free"]["median_ns_per_page"]
    (2, 1000.0, 1000.0)
"""

from __future__ import annotations

import math

import numpy as np

from ...block_table import pages_needed
from ...cache import PagedKVCache
from ..fragmentation import make_workload, requests_that_fit
from ..sizing import reservation_report
from .common import paired_ratio, print_table

__all__ = [
    "mixed_lengths",
    "fit_counts",
    "paged_overhead",
    "alloc_summary",
    "decoder_ranges",
    "ratios_to",
    "ratio_kind",
    "ratio_pairs",
    "pair_quartiles",
    "noise_summary",
    "print_model_report",
]


def mixed_lengths(num: int, *, max_len: int, mean_len: float, seed: int = 0) -> list[int]:
    """Final lengths (prompt + output) of ``num`` requests; mean about ``mean_len``, each <= ``max_len``."""
    wl = make_workload(num, seed=seed, mean_prompt=mean_len / 2, mean_output=mean_len / 2, max_len=max_len)
    return [int(n) for n in wl.total_len]


def fit_counts(lengths, *, budget_tokens: int, max_len: int, page_size: int) -> dict:
    """Requests (in order) that fit ``budget_tokens`` slots: :func:`requests_that_fit`'s
    ``{"max_len", "exact", "paged"}``, and ``"paged_allocator"``, the paged count on a real
    `PagedKVCache` of ``budget_tokens // page_size`` pages (reserve until the pool says no)."""
    fit = requests_that_fit(lengths, budget_slots=budget_tokens, page_size=page_size, reserved_per_request=max_len)
    kv = PagedKVCache(
        num_layers=1, num_pages=budget_tokens // page_size, page_size=page_size, num_kv_heads=1, head_dim=1
    )
    count = 0
    for n in lengths:
        if not kv.allocator.can_allocate(pages_needed(n, page_size)):
            break
        kv.reserve(kv.add_sequence(), n)
        count += 1
    fit["paged_allocator"] = count
    return fit


def paged_overhead(lengths, *, page_size: int) -> dict:
    """``{"page_size", "tokens", "pages", "slots", "overhead"}`` of whole pages holding ``lengths``;
    ``overhead = slots / tokens - 1`` (the same ratio in bytes: every slot costs the same)."""
    r = reservation_report(lengths, page_size=page_size, reserved_per_request=max(lengths))
    return {
        "page_size": page_size,
        "tokens": r.used_slots,
        "pages": r.paged_slots // page_size,
        "slots": r.paged_slots,
        "overhead": r.paged_slots / r.used_slots - 1,
    }


def alloc_summary(calls) -> dict:
    """Per page operation of ``(op, nanoseconds, pages)`` calls (`AllocationTimer`): calls, pages,
    median and p99 nanoseconds per call and per page."""
    out = {}
    for op in sorted({c[0] for c in calls}):
        ns = np.array([c[1] for c in calls if c[0] == op], dtype=float)
        pages = np.array([max(c[2], 1) for c in calls if c[0] == op], dtype=float)
        per_page = ns / pages
        out[op] = {
            "calls": int(ns.size),
            "pages": int(pages.sum()),
            "median_ns": float(np.median(ns)),
            "p99_ns": float(np.percentile(ns, 99)),
            "median_ns_per_page": float(np.median(per_page)),
            "p99_ns_per_page": float(np.percentile(per_page, 99)),
        }
    return out


def _paired(r: dict, ref: dict) -> bool:
    """Whether decoder results ``r`` and ``ref`` took turns step by step (`run_ladders`)."""
    return ref["label"] in r.get("in_turns_with", ())


def ratios_to(ladder: list[dict], base: str) -> dict:
    """``{label: {context: ratio}}`` for every timed decoder against the decoder labelled ``base``:
    the median of the ratios of its steps to ``base``'s steps of the same round where the two took turns
    (`paged_ref.lab.bench.common.paired_ratio` over as many rounds as both ran), else the ratio of the
    two medians (a run where they ran one after another)."""
    timed = {r["label"]: r for r in ladder if r["timed"]}
    ref = timed.get(base)
    if ref is None:
        return {}
    out = {}
    for label, r in timed.items():
        if label == base:
            continue
        by_context = {p["context"]: p for p in ref["points"]}
        out[label] = {}
        for p in r["points"]:
            b = by_context.get(p["context"])
            if b is None or p["median_s"] is None:
                continue
            if _paired(r, ref):
                n = min(len(p["times_s"]), len(b["times_s"]))
                out[label][p["context"]] = paired_ratio(p["times_s"][:n], b["times_s"][:n])
            else:
                out[label][p["context"]] = p["median_s"] / b["median_s"]
    return out


def ratio_kind(ladder: list[dict], base: str) -> str:
    """How `ratios_to` took the ladder's ratios: ``"median of paired steps"`` or ``"ratio of medians"``."""
    timed = {r["label"]: r for r in ladder if r["timed"]}
    others = [r for label, r in timed.items() if label != base]
    paired = base in timed and others and all(_paired(r, timed[base]) for r in others)
    return "median of paired steps" if paired else "ratio of medians"


def ratio_pairs(ladder: list[dict], base: str) -> dict:
    """``{label: {context: pairs}}``: how many pairs of steps each paired ratio of `ratios_to` rests on."""
    timed = {r["label"]: r for r in ladder if r["timed"]}
    ref = timed.get(base)
    if ref is None:
        return {}
    steps = {p["context"]: len(p["times_s"] or []) for p in ref["points"]}
    return {
        label: {p["context"]: min(len(p["times_s"] or []), steps.get(p["context"], 0)) for p in r["points"]}
        for label, r in timed.items()
        if label != base and _paired(r, ref)
    }


def pair_quartiles(ladder: list[dict], base: str) -> dict:
    """``{label: {context: [p25, median, p75]}}`` of the ratios of a decoder's steps to ``base``'s steps
    of the same round (the pairs `ratios_to` takes the median of), for decoders that took turns with it."""
    timed = {r["label"]: r for r in ladder if r["timed"]}
    ref = timed.get(base)
    if ref is None:
        return {}
    by_context = {p["context"]: p["times_s"] for p in ref["points"] if p["times_s"]}
    out = {}
    for label, r in timed.items():
        if label == base or not _paired(r, ref):
            continue
        out[label] = {}
        for p in r["points"]:
            if p["times_s"] and p["context"] in by_context:
                ratios = [a / b for a, b in zip(p["times_s"], by_context[p["context"]])]
                out[label][p["context"]] = [float(x) for x in np.percentile(ratios, [25, 50, 75])]
    return out


def noise_summary(ladder: list[dict], base: str = "dynamic", peer: str = "static") -> dict:
    """What a run's timings can tell apart: each point's spread and the gap between two contiguous
    caches (``base``, ``peer``), a difference no paging causes.

    Returns:
        ``{"steps": {label: timed steps per point}, "spread": {label: {context: [min, p25,
        median, p75, max] ms}}, "peer_over_base": [min, max] over contexts of peer / base as
        `ratios_to` takes it, "iqr_over_median": {label: largest (p75 - p25) / median over contexts},
        "no_cache_growth": {"first", "last" (context, ms), "factor", "doublings", "per_doubling"}}``
        (the last key only when the no-cache decoder ran at two contexts or more).
    """
    timed = {r["backend"]: r for r in ladder if r["timed"]}
    out = {"steps": {}, "spread": {}, "iqr_over_median": {}}
    for r in timed.values():
        pts = [p for p in r["points"] if p["times_s"]]
        out["steps"][r["label"]] = sorted({len(p["times_s"]) for p in pts})
        q = {p["context"]: [float(x) * 1e3 for x in np.percentile(p["times_s"], [0, 25, 50, 75, 100])] for p in pts}
        out["spread"][r["label"]] = q
        out["iqr_over_median"][r["label"]] = max((v[3] - v[1]) / v[2] for v in q.values()) if q else None
    none = [p for p in timed["none"]["points"] if p["median_s"]] if "none" in timed else []
    if len(none) >= 2:
        factor = none[-1]["median_s"] / none[0]["median_s"]
        doublings = math.log2(none[-1]["context"] / none[0]["context"])
        out["no_cache_growth"] = {
            "first": (none[0]["context"], none[0]["median_s"] * 1e3),
            "last": (none[-1]["context"], none[-1]["median_s"] * 1e3),
            "factor": factor,
            "doublings": doublings,
            "per_doubling": factor ** (1 / doublings),
        }
    if base in timed and peer in timed:  # as `ratios_to` takes them: paired where the two took turns
        ratios = list(ratios_to(ladder, timed[base]["label"]).get(timed[peer]["label"], {}).values())
        out["peer_over_base"] = [min(ratios), max(ratios)] if ratios else None
    return out


def decoder_ranges(ladder: list[dict], base: str = "dynamic") -> dict:
    """``{label: {"ms": (min, max), "ratio": (min, max) or None for base}}`` per timed decoder over
    the contexts: its median ms per token and its ratio to ``base``'s median at the same context."""
    timed = {r["backend"]: r for r in ladder if r["timed"]}
    ratios = ratios_to(ladder, timed[base]["label"]) if base in timed else {}
    out = {}
    for r in timed.values():
        ms = [p["median_s"] * 1e3 for p in r["points"] if p["median_s"]]
        if not ms:
            continue
        rs = list(ratios.get(r["label"], {}).values())
        out[r["label"]] = {"ms": (min(ms), max(ms)), "ratio": (min(rs), max(rs)) if rs else None}
    return out


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _ms(seconds, digits: int) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def print_model_report(name: str, res: dict) -> None:
    """Print the tables of one model's results (latency, memory, batch, chat, sweep, allocation)."""
    m = res["model"]
    print(f"\n=== {name}: {m['note'] or m['name']} ({m['dtype']}, {m['params'] / 1e6:.0f}M parameters) ===")
    for what in res.get("skipped", []):
        print(f"  skipped (time budget): {what}")
    for err in res.get("errors", []):
        print(f"  ERROR: {err}")
    if res.get("ladder"):
        print("\nper-token decode latency, ms (median of timed steps; teacher-forced, batch 1)")
        timed = [r for r in res["ladder"] if r["timed"]]
        medians = [{p["context"]: p["median_s"] for p in r["points"]} for r in timed]
        contexts = sorted({c for m in medians for c in m})
        print_table(
            ["context"] + [r["label"] for r in timed], [[c] + [_ms(m.get(c), 2) for m in medians] for c in contexts]
        )
        if res.get("ratios"):
            print(f"  each decoder's step over {res['ratio_base']}'s ({res.get('ratio_kind', 'ratio of medians')}):")
        for label, pts in res.get("ratios", {}).items():
            print(f"  {label} / {res['ratio_base']}: " + ", ".join(f"{c}: {r:.2f}x" for c, r in pts.items()))
        for label, a in res.get("agreement", {}).items():
            print(f"  greedy predictions, {label} vs {a['against']}: {a['equal']}/{a['compared']} equal")
        print("\nKV memory held after the timed steps, MiB (peak device memory where CUDA)")
        rows = []
        for r in res["ladder"]:
            per_token = 0 if r["backend"] == "none" else res["kv_bytes_per_token"]  # the minimum: tokens x bytes
            for p in r["points"]:
                held = [p["kv_bytes"], p["tokens_held"] * per_token, p["peak_bytes"]]
                rows.append([r["label"], p["context"], p["tokens_held"], *map(_mib, held)])
        print_table(["decoder", "context", "tokens", "KV held", "minimum", "peak"], rows)
    if res.get("long"):
        print("\nlong sequence (paged only)")
        for r in res["long"]:
            for p in r["points"]:
                t = "not timed" if p["median_s"] is None else f"{p['median_s'] * 1e3:.2f} ms/token"
                print(
                    f"  {r['label']}: context {p['context']}: {t}, KV {_mib(p['kv_bytes'])} MiB, "
                    f"peak {_mib(p['peak_bytes'])} MiB"
                )
            if r["skipped"]:
                print(f"  {r['label']}: skipped {r['skipped']} (time budget)")
    b = res.get("batch")
    if b:
        fit = b["fit"]
        print(
            f"\nmixed-length batch: {b['num_requests']} requests drawn, mean length {b['mean_len']:.0f}, "
            f"max_len {b['max_len']}, KV budget {b['budget_tokens']} token slots, page size {b['page_size']}"
        )
        print(
            f"  admitted: contiguous max-length reservation {fit['max_len']}, paged {fit['paged_allocator']} "
            f"({fit['paged_allocator'] / max(fit['max_len'], 1):.2f}x)"
        )
        rows = []
        for r in ([b["contiguous"]] if "contiguous" in b else []) + list(b["paged"].values()):
            same = "-" if r is b.get("contiguous") else f"{r.get('same_batch_tokens_per_s', float('nan')):.1f}"
            rows.append(
                [r["label"], r["batch"], _ms(r["step_s"], 1), f"{r['tokens_per_s']:.1f}", same, _mib(r["kv_bytes"])]
            )
        print_table(["cache", "batch", "step ms", "tokens/s", "tokens/s same batch", "KV held MiB"], rows)
        o = b["overhead_ps16"]
        print(
            f"  paged overhead over the minimum at page size {o['page_size']}: {o['slots']} slots for "
            f"{o['tokens']} tokens = {100 * o['overhead']:.2f}% (bound <= 5%)"
        )
        w = b.get("overhead_ps16_workload")
        if w:
            print(
                f"  ... over all {b['num_requests']} requests of the workload: {w['slots']} slots for {w['tokens']} "
                f"tokens = {100 * w['overhead']:.2f}%"
            )
    if res.get("sweep"):
        print(
            "\npage-size sweep on the mixed batch (overhead counted; decode attention time of one layer, whole batch)"
        )
        names = list(res["sweep"][0]["attention_s"])
        rows = [
            [r["page_size"], f"{100 * r['overhead']:.2f}"] + [_ms(r["attention_s"][n], 3) for n in names]
            for r in res["sweep"]
        ]
        print_table(["page size", "overhead %"] + [f"{n} ms" for n in names], rows)
    if res.get("chat"):
        print("\ngrowing-context chat (one new request per turn holding the whole history)")
        rows = []
        for run in res["chat"]["runs"]:
            on = "on" if run["prefix_caching"] else "off"
            for t in run["turns"]:
                ms = _ms(t["latency_s"], 0)
                rows.append(
                    [on, t["turn"], t["context"], t["prefilled"], ms, t["pages_allocated"], t["prefix_pages_reused"]]
                )
        headers = ["prefix cache", "turn", "context", "prefilled", "latency ms", "pages allocated", "pages reused"]
        print_table(headers, rows)
        print(f"  replies identical with and without prefix caching: {res['chat']['replies_identical']}")
    if res.get("alloc"):
        print("\nallocator cost per page operation during the run (perf_counter_ns around each call)")
        keys = ["median_ns", "p99_ns", "median_ns_per_page", "p99_ns_per_page"]
        rows = [[op, s["calls"], s["pages"], *(f"{s[k]:.0f}" for k in keys)] for op, s in res["alloc"].items()]
        print_table(["op", "calls", "pages", "median ns", "p99 ns", "median ns/page", "p99 ns/page"], rows)
