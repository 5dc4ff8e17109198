"""What notebook 06 reports from `python -m paged_ref.bench scaling`: batch-fit counts and a run's tables.

The counts hold a mixed-length batch in a fixed KV budget on a real `PagedKVCache`:
:func:`mixed_lengths` draws the lengths, :func:`fit_counts` counts the requests that fit under
max-length reservation and under paging, :func:`paged_overhead` counts the slots paging holds
beyond the tokens. The summaries (:func:`alloc_summary`, :func:`ratios_to`,
:func:`noise_summary`, :func:`decoder_ranges`) and :func:`print_model_report` are pure
functions over the benchmark's result dicts.

Examples:
    >>> lengths = mixed_lengths(40, max_len=1024, mean_len=256, seed=0)
    >>> fit = fit_counts(lengths, budget_tokens=4096, max_len=1024, page_size=16)
    >>> fit["reserve_max"], fit["paged"] > fit["reserve_max"]
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

from ..block_table import pages_needed
from ..cache import PagedKVCache
from ..fragmentation import make_workload, requests_that_fit
from ..texttable import format_table

__all__ = [
    "mixed_lengths",
    "fit_counts",
    "paged_overhead",
    "alloc_summary",
    "decoder_ranges",
    "latency_table",
    "ratios_to",
    "noise_summary",
    "print_model_report",
]


def mixed_lengths(num: int, *, max_len: int, mean_len: float, seed: int = 0) -> list[int]:
    """Final lengths (prompt + output) of ``num`` requests; mean about ``mean_len``, each <= ``max_len``."""
    wl = make_workload(num, seed=seed, mean_prompt=mean_len / 2, mean_output=mean_len / 2, max_len=max_len)
    return [int(n) for n in wl.total_len]


def fit_counts(lengths, *, budget_tokens: int, max_len: int, page_size: int) -> dict:
    """Requests (taken in order) that fit in ``budget_tokens`` slots: max-length reservation vs paged.

    Returns ``{"reserve_max", "exact", "paged"}`` counts (:func:`requests_that_fit`) and the
    paged count confirmed on a real `PagedKVCache` of ``budget_tokens // page_size`` pages
    (``"paged_allocator"``, reserve until the pool says no).
    """
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
    """Slots a real `PagedKVCache` holds for ``lengths`` vs the tokens themselves (counts, not bytes).

    Returns ``{"page_size", "tokens", "pages", "slots", "overhead"}`` with
    ``overhead = slots / tokens - 1`` (the same ratio in bytes: every slot costs the same).
    """
    total_pages = sum(pages_needed(n, page_size) for n in lengths)
    kv = PagedKVCache(num_layers=1, num_pages=total_pages, page_size=page_size, num_kv_heads=1, head_dim=1)
    for n in lengths:
        kv.reserve(kv.add_sequence(), n)
    pages = kv.allocator.num_pages - kv.allocator.num_free
    tokens = sum(lengths)
    return {
        "page_size": page_size,
        "tokens": tokens,
        "pages": pages,
        "slots": pages * page_size,
        "overhead": pages * page_size / tokens - 1,
    }


def alloc_summary(calls) -> dict:
    """Per page operation: calls, pages, median and p99 nanoseconds per call and per page.

    Args:
        calls: ``(op, nanoseconds, pages)`` tuples as recorded by `AllocationTimer`.
    """
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


def ratios_to(ladder: list[dict], base: str) -> dict:
    """``{label: {context: median / base median}}`` for every timed decoder against ``base``."""
    by_label = {r["label"]: {p["context"]: p["median_s"] for p in r["points"]} for r in ladder if r["timed"]}
    ref = next((v for k, v in by_label.items() if k == base), None)
    if ref is None:
        return {}
    return {
        label: {c: t / ref[c] for c, t in pts.items() if c in ref and t is not None}
        for label, pts in by_label.items()
        if label != base
    }


def latency_table(ladder: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: ms per token of each decoder (columns) at each context (rows)."""
    timed = [r for r in ladder if r["timed"]]
    contexts = sorted({p["context"] for r in timed for p in r["points"]})
    headers = ["context"] + [r["label"] for r in timed]
    rows = []
    for c in contexts:
        row = [str(c)]
        for r in timed:
            t = next((p["median_s"] for p in r["points"] if p["context"] == c), None)
            row.append("-" if t is None else f"{t * 1e3:.2f}")
        rows.append(row)
    return headers, rows


def noise_summary(ladder: list[dict], base: str = "dynamic", peer: str = "static") -> dict:
    """What a run's timings can tell apart: the spread of each point and two baselines' own gap.

    Args:
        ladder: the ``ladder`` list of a scaling result.
        base, peer: backends of two contiguous caches (DynamicCache, StaticCache): their ratio
            is a difference no paging causes, i.e. a floor on what the run resolves.

    Returns:
        ``{"steps": {label: timed steps per point}, "spread": {label: {context: [min, p25,
        median, p75, max] ms}}, "peer_over_base": [min, max] of peer median / base median over
        contexts, "iqr_over_median": {label: largest (p75 - p25) / median over contexts},
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
    if base in timed and peer in timed:
        b = {p["context"]: p["median_s"] for p in timed[base]["points"]}
        ratios = [p["median_s"] / b[p["context"]] for p in timed[peer]["points"] if p["context"] in b]
        out["peer_over_base"] = [min(ratios), max(ratios)] if ratios else None
    return out


def decoder_ranges(ladder: list[dict], base: str = "dynamic") -> dict:
    """Per timed decoder over the contexts: the range of its median ms per token and of its
    ratio to ``base``'s median at the same context.

    Returns:
        ``{label: {"ms": (min, max), "ratio": (min, max) or None (for base itself)}}``.
    """
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


def _print_table(headers, rows) -> None:
    print(format_table(headers, rows))


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def print_model_report(name: str, res: dict) -> None:
    """Print the tables of one model's results (latency, memory, batch, chat, sweep, allocation)."""
    print(
        f"\n=== {name}: {res['model']['note'] or res['model']['name']} ({res['model']['dtype']}, "
        f"{res['model']['params'] / 1e6:.0f}M parameters) ==="
    )
    for what in res.get("skipped", []):
        print(f"  skipped (time budget): {what}")
    for err in res.get("errors", []):
        print(f"  ERROR: {err}")
    if res.get("ladder"):
        print("\nper-token decode latency, ms (median of timed steps; teacher-forced, batch 1)")
        _print_table(*latency_table(res["ladder"]))
        for label, pts in res.get("ratios", {}).items():
            print(f"  {label} / {res['ratio_base']}: " + ", ".join(f"{c}: {r:.2f}x" for c, r in pts.items()))
        for label, a in res.get("agreement", {}).items():
            print(f"  greedy predictions, {label} vs {a['against']}: {a['equal']}/{a['compared']} equal")
        print("\nKV memory held after the timed steps, MiB (peak device memory where CUDA)")
        rows = []
        for r in res["ladder"]:
            for p in r["points"]:
                rows.append(
                    [
                        r["label"],
                        p["context"],
                        p["tokens_held"],
                        _mib(p["kv_bytes"]),
                        _mib(p["tokens_held"] * res["kv_bytes_per_token"] if r["backend"] != "none" else 0),
                        _mib(p["peak_bytes"]),
                    ]
                )
        _print_table(["decoder", "context", "tokens", "KV held", "minimum", "peak"], rows)
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
            f"  admitted: contiguous max-length reservation {fit['reserve_max']}, paged {fit['paged_allocator']} "
            f"({fit['paged_allocator'] / max(fit['reserve_max'], 1):.2f}x)"
        )
        rows = []
        if "contiguous" in b:
            c = b["contiguous"]
            rows.append(
                [
                    c["label"],
                    c["batch"],
                    f"{c['step_s'] * 1e3:.1f}",
                    f"{c['tokens_per_s']:.1f}",
                    "-",
                    _mib(c["kv_bytes"]),
                ]
            )
        for p in b["paged"].values():
            rows.append(
                [
                    p["label"],
                    p["batch"],
                    f"{p['step_s'] * 1e3:.1f}",
                    f"{p['tokens_per_s']:.1f}",
                    f"{p.get('same_batch_tokens_per_s', float('nan')):.1f}",
                    _mib(p["kv_bytes"]),
                ]
            )
        _print_table(["cache", "batch", "step ms", "tokens/s", "tokens/s same batch", "KV held MiB"], rows)
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
            [r["page_size"], f"{100 * r['overhead']:.2f}"]
            + ["-" if r["attention_s"][n] is None else f"{r['attention_s'][n] * 1e3:.3f}" for n in names]
            for r in res["sweep"]
        ]
        _print_table(["page size", "overhead %"] + [f"{n} ms" for n in names], rows)
    if res.get("chat"):
        print("\ngrowing-context chat (one new request per turn holding the whole history)")
        rows = []
        for mode in res["chat"]["runs"]:
            for t in mode["turns"]:
                rows.append(
                    [
                        "on" if mode["prefix_caching"] else "off",
                        t["turn"],
                        t["context"],
                        t["prefilled"],
                        f"{t['latency_s'] * 1e3:.0f}",
                        t["pages_allocated"],
                        t["prefix_pages_reused"],
                    ]
                )
        _print_table(
            ["prefix cache", "turn", "context", "prefilled", "latency ms", "pages allocated", "pages reused"], rows
        )
        print(f"  replies identical with and without prefix caching: {res['chat']['replies_identical']}")
    if res.get("alloc"):
        print("\nallocator cost per page operation during the run (perf_counter_ns around each call)")
        rows = [
            [
                op,
                s["calls"],
                s["pages"],
                f"{s['median_ns']:.0f}",
                f"{s['p99_ns']:.0f}",
                f"{s['median_ns_per_page']:.0f}",
                f"{s['p99_ns_per_page']:.0f}",
            ]
            for op, s in res["alloc"].items()
        ]
        _print_table(["op", "calls", "pages", "median ns", "p99 ns", "median ns/page", "p99 ns/page"], rows)
