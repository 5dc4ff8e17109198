"""What a byte buys: quality against KV bytes per sequence, one line per method and cache format.

Reads the JSON of `python -m paged_ref.lab.bench kvbytes` (`paged_ref.lab.bench.kvbytes_report.load_results`).
Each method's line starts at the full cache of its format (budget share 1) and runs through its budgets;
Quest's points sit at the bytes a decode step read (it holds every page). Colour: the method; marker and
line style: the format.

Example (a made-up result of two formats):
    >>> def row(policy, fmt, c, nbytes, nll, correct):
    ...     return dict(policy=policy, kv_format=fmt, budget=c, bytes_per_seq=nbytes, nll=nll,
    ...                 nll_ci95=[nll - 0.1, nll + 0.1], dnll_vs_float32_full=nll - 2.5, dnll_ci95=[0.0, 0.1],
    ...                 correct=correct, trials=4, accuracy=correct / 4, ci95=[0.1, 0.9])
    >>> lm = [row("full", "float32", None, 4e6, 2.5, 4), row("full", "int8 page", None, 1e6, 2.6, 4),
    ...       row("paged_eviction", "float32", 64, 1e6, 2.9, 1)]
    >>> results = dict(language_modelling=lm, retention=lm, passkey=lm)
    >>> sorted(method_lines(lm, "nll"))
    [('full', 'float32'), ('full', 'int8 page'), ('paged_eviction', 'float32')]
    >>> len(quality_per_byte_figure(results).axes)
    3
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from . import add_note

__all__ = ["FORMAT_STYLES", "METHOD_COLORS", "METHOD_NAMES", "method_lines", "quality_per_byte_figure"]

METHOD_NAMES = {
    "full": "full cache",
    "paged_eviction": "PagedEviction",
    "streaming_llm": "StreamingLLM",
    "quest": "Quest",
}
METHOD_COLORS = {"full": "black", "paged_eviction": "tab:blue", "streaming_llm": "tab:orange", "quest": "tab:green"}
FORMAT_STYLES = {  # label -> (marker, line style)
    "float32": ("o", "-"),
    "bfloat16 values": ("*", "-"),
    "e4m3 layer 1.0": ("v", ":"),
    "e4m3 layer calibrated": ("^", "--"),
    "e4m3 page": ("s", "--"),
    "int8 layer calibrated": ("D", "-."),
    "int8 page": ("P", "-."),
}
_PANELS = [  # (task key, value, interval, y label)
    ("language_modelling", "dnll_vs_float32_full", "dnll_ci95", "continuation NLL - float32 full cache's"),
    ("retention", "dnll_vs_float32_full", "dnll_ci95", "retention NLL - float32 full cache's"),
    ("passkey", "accuracy", "ci95", "pass-key accuracy"),
]


def method_lines(summary: list[dict], value: str, interval: str = "nll_ci95") -> dict:
    """``{(policy, format): [(bytes, value, low, high)]}`` of one task's summary rows, by bytes descending:
    every method's line begins at its format's full cache (Quest's bytes: read per decode step); a full
    cache alone is a line of one point."""
    full = {r["kv_format"]: r for r in summary if r["policy"] == "full"}
    out = {}
    for r in summary:
        out.setdefault((r["policy"], r["kv_format"]), []).append(r)
    lines = {}
    for (policy, fmt), rs in out.items():
        start = full.get(fmt) if policy != "full" else None
        points = [(r.get("bytes_read_per_step", r["bytes_per_seq"]), r[value], *r[interval]) for r in rs]
        if start is not None:
            points.append((start["bytes_per_seq"], start[value], *start[interval]))
        lines[(policy, fmt)] = sorted(points, reverse=True)
    return lines


def quality_per_byte_figure(results: dict, *, note: str = "") -> Figure:
    """Three panels against MiB per sequence (log scale), one line per (method, format): continuation and
    retention NLL minus the float32 full cache's on the same text (error bars: the paired 95% t interval,
    none for a single text), pass-key accuracy (Wilson 95% interval)."""
    fig = Figure(figsize=(14, 4.4), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, (task, value, interval, ylabel) in zip(axes, _PANELS):
        lines = method_lines(results.get(task, []), value, interval)
        for (policy, fmt), points in sorted(lines.items(), key=lambda kv: kv[0][0] == "full"):  # full caches on top
            marker, style = FORMAT_STYLES.get(fmt, ("x", "-"))
            x = [p[0] / 2**20 for p in points]
            y = [p[1] for p in points]
            err = [[max(0.0, p[1] - p[2]) for p in points], [max(0.0, p[3] - p[1]) for p in points]]
            if any(v != v for p in points for v in p[2:]):  # nan: one text, no interval
                err = None
            full = policy == "full"
            style = dict(color=METHOD_COLORS.get(policy, "gray"), marker=marker, ls=style, ms=8 if full else 5)
            ax.errorbar(x, y, yerr=err, capsize=2, zorder=3 if full else 2, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV MiB per sequence (Quest: read per decode step)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=c, lw=2, label=METHOD_NAMES.get(p, p)) for p, c in METHOD_COLORS.items()]
    handles += [Line2D([], [], color="0.3", marker=m, ls=s, label=f) for f, (m, s) in FORMAT_STYLES.items()]
    fig.legend(handles=handles, loc="outside right center", fontsize=8)
    fig.suptitle("What a byte buys: 8-bit pages against eviction at the same KV bytes (SmolLM2-135M)")
    if note:
        add_note(fig, note)
    return fig
