"""The decode benchmark's summary of a GPU run: ratios between implementations and its goals.

`summarize_gpu` reads the rows `decode.run_gpu` measured and returns ``(ratios, goals)``: per
(batch, length, page size) the paged kernel's share of the copy bandwidth and each peer's time
over its own, and each target of the benchmark against those numbers (met or not, computed).
"""

from __future__ import annotations

from .common import print_table

__all__ = ["summarize_gpu"]


def summarize_gpu(data):
    """Ratios between implementations per case, and the benchmark's targets against the numbers."""
    by = {(r["batch"], r["seq_len"], r["page_size"], r["impl"]): r for r in data["results"]}
    ratios, table = [], []
    shapes = sorted({(r["batch"], r["seq_len"]) for r in data["results"]}, key=lambda s: s[0])
    for batch, seq_len in shapes:
        pages = sorted(
            {
                r["page_size"]
                for r in data["results"]
                if (r["batch"], r["seq_len"]) == (batch, seq_len) and r["page_size"]
            }
        )
        sdpa = by.get((batch, seq_len, None, "sdpa contiguous"))
        for page in pages:
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
            fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
            table.append(
                [
                    f"({batch}, {seq_len})",
                    page,
                    f"{t * 1e6:.1f}",
                    f"{paged['bandwidth_GBps']:.0f}",
                    fmt(paged["frac_of_copy"], "{:.0%}"),
                    fmt(row["paged_over_contiguous"]),
                    fmt(row["flex_over_paged"]),
                    fmt(row["sdpa_over_paged"]),
                    fmt(row["repeat_spread"], "{:.1%}"),
                ]
            )
    print()
    print_table(
        [
            "batch x len",
            "page",
            "paged us",
            "GB/s",
            "of copy",
            "paged/contig",
            "flex/paged",
            "sdpa/paged",
            "rerun spread",
        ],
        table,
    )

    goals = []
    head = [r for r in ratios if (r["batch"], r["seq_len"]) == (8, 32768)]
    if head:
        worst = min(r["paged_frac_of_copy"] for r in head)
        goals.append(
            dict(
                goal=">= 85% of copy bandwidth at (8, 32768)",
                measured=f"{worst:.1%} (worst page size)",
                met=worst >= 0.85,
            )
        )
    within = [r["paged_over_contiguous"] for r in ratios if r["paged_over_contiguous"]]
    if within:
        goals.append(
            dict(
                goal="paged within 5% of its own contiguous run",
                measured=f"worst paged/contiguous {max(within):.3f}",
                met=max(within) <= 1.05,
            )
        )
    spreads = []
    for batch, seq_len in shapes:
        times = [
            r["median_s"]
            for r in data["results"]
            if (r["batch"], r["seq_len"], r["impl"]) == (batch, seq_len, "paged_decode")
        ]
        if len(times) > 1:
            spreads.append(max(times) / min(times))
    if spreads:
        goals.append(
            dict(
                goal="page sizes 16..128 within 5% of each other",
                measured=f"worst slowest/fastest {max(spreads):.3f}",
                met=max(spreads) <= 1.05,
            )
        )
    for peer, key in (("compiled flex paged", "flex_over_paged"), ("SDPA on a contiguous cache", "sdpa_over_paged")):
        vals = [r[key] for r in ratios if r[key] is not None]
        if vals:
            goals.append(
                dict(
                    goal=f"faster than {peer}",
                    measured=f"{peer} / paged_decode from {min(vals):.2f} to {max(vals):.2f}",
                    met=min(vals) > 1.0,
                )
            )
    print()
    for g in goals:
        print(f"{'met    ' if g['met'] else 'NOT met'}  {g['goal']}: {g['measured']}")
    return ratios, goals
