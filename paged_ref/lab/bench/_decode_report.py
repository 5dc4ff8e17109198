"""The decode benchmark's summary of a GPU run: ratios between implementations and its goals."""

from __future__ import annotations

from .common import print_table

__all__ = ["summarize_gpu"]

RATIO_COLUMNS = [  # (header, key of a ratios row, format) after the paged kernel's time and bandwidth
    ("of copy", "paged_frac_of_copy", "{:.0%}"),
    ("paged/contig", "paged_over_contiguous", "{:.2f}"),
    ("flex/paged", "flex_over_paged", "{:.2f}"),
    ("sdpa/paged", "sdpa_over_paged", "{:.2f}"),
    ("rerun spread", "repeat_spread", "{:.1%}"),
]


def summarize_gpu(data):
    """Print and return ``(ratios, goals)`` for the rows `decode.run_gpu` measured.

    ``ratios``: per (batch, length, page size), the paged kernel's share of the copy bandwidth
    and each peer's time over its own; ``goals``: each target against those numbers (met or not).
    """
    by = {(r["batch"], r["seq_len"], r["page_size"], r["impl"]): r for r in data["results"]}
    ratios, table, spreads = [], [], []
    shapes = sorted({(r["batch"], r["seq_len"]) for r in data["results"]}, key=lambda s: s[0])
    for batch, seq_len in shapes:
        same = [r for r in data["results"] if (r["batch"], r["seq_len"]) == (batch, seq_len)]
        times = [r["median_s"] for r in same if r["impl"] == "paged_decode"]
        if len(times) > 1:
            spreads.append(max(times) / min(times))
        sdpa = by.get((batch, seq_len, None, "sdpa contiguous"))
        for page in sorted({r["page_size"] for r in same if r["page_size"]}):
            paged = by.get((batch, seq_len, page, "paged_decode"))
            again = by.get((batch, seq_len, page, "paged_decode (again)"))
            contig = by.get((batch, seq_len, page, "paged_decode contiguous"))
            flex = by.get((batch, seq_len, page, "flex_paged_decode"))
            if paged is None:
                continue
            t = paged["median_s"]
            row = dict(
                batch=batch,
                seq_len=seq_len,
                page_size=page,
                paged_frac_of_copy=paged["frac_of_copy"],
                paged_over_contiguous=t / contig["median_s"] if contig else None,
                flex_over_paged=flex["median_s"] / t if flex else None,
                sdpa_over_paged=sdpa["median_s"] / t if sdpa else None,
                repeat_spread=abs(again["median_s"] - t) / t if again else None,
            )
            ratios.append(row)
            cells = ["-" if row[key] is None else fmt.format(row[key]) for _, key, fmt in RATIO_COLUMNS]
            table.append([f"({batch}, {seq_len})", page, f"{t * 1e6:.1f}", f"{paged['bandwidth_GBps']:.0f}", *cells])
    print()
    print_table(["batch x len", "page", "paged us", "GB/s", *(header for header, _, _ in RATIO_COLUMNS)], table)

    goals = []

    def goal(text, measured, met):
        goals.append(dict(goal=text, measured=measured, met=met))

    head = [r["paged_frac_of_copy"] for r in ratios if (r["batch"], r["seq_len"]) == (8, 32768)]
    if head:
        goal(">= 85% of copy bandwidth at (8, 32768)", f"{min(head):.1%} (worst page size)", min(head) >= 0.85)
    within = [r["paged_over_contiguous"] for r in ratios if r["paged_over_contiguous"]]
    if within:
        worst = max(within)
        goal("paged within 5% of its own contiguous run", f"worst paged/contiguous {worst:.3f}", worst <= 1.05)
    if spreads:
        worst = max(spreads)
        goal("page sizes 16..128 within 5% of each other", f"worst slowest/fastest {worst:.3f}", worst <= 1.05)
    for peer, key in (("compiled flex paged", "flex_over_paged"), ("SDPA on a contiguous cache", "sdpa_over_paged")):
        vals = [r[key] for r in ratios if r[key] is not None]
        if vals:
            measured = f"{peer} / paged_decode from {min(vals):.2f} to {max(vals):.2f}"
            goal(f"faster than {peer}", measured, min(vals) > 1.0)
    print()
    for g in goals:
        print(f"{'met    ' if g['met'] else 'NOT met'}  {g['goal']}: {g['measured']}")
    return ratios, goals
