"""The decode benchmark's summary of a GPU run: ratios between implementations and its goals."""

from __future__ import annotations

from .common import print_table

__all__ = ["summarize_gpu"]

RATIO_COLUMNS = [  # (header, key of a ratios row, format) after the paged kernel's time and bandwidth
    ("of copy", "paged_frac_of_copy", "{:.0%}"),
    ("graph of copy", "graph_frac_of_copy", "{:.0%}"),
    ("host us", "host_us", "{:.0f}"),
    ("paged/contig", "paged_over_contiguous", "{:.2f}"),
    ("flex step/paged", "flex_step_over_paged", "{:.2f}"),
    ("flex call/paged", "flex_over_paged", "{:.2f}"),
    ("sdpa/paged", "sdpa_over_paged", "{:.2f}"),
    ("fp8/paged", "fp8_over_paged", "{:.2f}"),
    ("rerun spread", "repeat_spread", "{:.1%}"),
]


def summarize_gpu(data):
    """Print and return ``(ratios, goals)`` for the rows `decode.run_gpu` measured.

    ``ratios``: per (batch, length, page size), the paged kernel's share of the copy bandwidth
    (called, and replayed from a CUDA graph), the host microseconds of one call, and each peer's
    time over its own; flex per step is the call with the mask reused plus the mask's build
    divided by ``config["layers"]`` (a model builds it once per step for all its layers);
    ``goals``: each target against those numbers (met or not).
    """
    layers = data.get("config", {}).get("layers", 1)
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
            reused = by.get((batch, seq_len, page, "flex_paged_decode (mask reused)"))
            graph = by.get((batch, seq_len, page, "paged_decode (CUDA graph)"))
            fp8 = by.get((batch, seq_len, page, "paged_decode fp8"))
            if paged is None:
                continue
            t = paged["median_s"]
            flex_step = reused["median_s"] + reused["block_mask_s"] / layers if reused else None
            row = dict(
                batch=batch,
                seq_len=seq_len,
                page_size=page,
                paged_frac_of_copy=paged["frac_of_copy"],
                graph_frac_of_copy=graph["frac_of_copy"] if graph else None,
                host_us=paged["host_s"] * 1e6 if "host_s" in paged else None,
                paged_over_contiguous=t / contig["median_s"] if contig else None,
                flex_step_over_paged=flex_step / t if reused else None,
                flex_reused_over_paged=reused["median_s"] / t if reused else None,
                flex_over_paged=flex["median_s"] / t if flex else None,
                sdpa_over_paged=sdpa["median_s"] / t if sdpa else None,
                fp8_over_paged=fp8["median_s"] / t if fp8 else None,
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
    one = [r for r in ratios if r["batch"] == 1]
    if one:
        worst = min(r["paged_frac_of_copy"] for r in one)
        goal(">= 85% of copy bandwidth at batch 1, every page size", f"{worst:.1%} (worst page size)", worst >= 0.85)
    big = [r["paged_frac_of_copy"] for r in ratios if r["batch"] >= 8]
    if big:
        goal(">= 90% of copy bandwidth at every batch >= 8", f"{min(big):.1%} (worst case)", min(big) >= 0.90)
    steps = [r["flex_step_over_paged"] for r in ratios if r["batch"] >= 8 and r["flex_step_over_paged"] is not None]
    if steps:
        measured = f"flex per step / paged_decode at most {max(steps):.2f} over {len(steps)} cases"
        goal("compiled flex, BlockMask once per step: <= 3x paged_decode at batch >= 8", measured, max(steps) <= 3)
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
