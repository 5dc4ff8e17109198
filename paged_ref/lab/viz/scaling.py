"""Figures of a scaling run (notebook 06), drawn from the JSON that `paged_ref.lab.bench.scaling` writes.

Each function takes the whole result dict (``data``, as loaded from
``figures/data/scaling_{cpu,gpu}.json``) and a model name, and returns a new Figure whose note
states the hardware, the versions and the date of the measurement.

Example:
    >>> data = {"environment": {"cpu": "x86_64", "gpu": None, "torch": "2.13.0", "transformers": "5.24.0",
    ...                         "date_utc": "2026-12-02T13:00:00+00:00"}, "device": "cpu", "quick": True,
    ...         "models": {}}
    >>> provenance(data)
    'Measured on CPU x86_64 (quick mode), torch 2.13.0, transformers 5.24.0, 2026-12-02 (UTC).'
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from ..provenance import describe as provenance
from . import add_note

__all__ = [
    "FIGURES",
    "provenance",
    "missing_section",
    "spread_ms",
    "latency_figure",
    "memory_figure",
    "batch_figure",
    "chat_figure",
    "page_size_figure",
    "alloc_figure",
]

MiB = 2**20
_STYLE = {  # decoder label -> (color, marker, linestyle)
    "no cache (recompute)": ("tab:gray", "x", ":"),
    "contiguous (DynamicCache)": ("tab:blue", "o", "-"),
    "contiguous (StaticCache)": ("tab:cyan", "s", "--"),
    "paged (reference)": ("tab:olive", "v", "-."),
    "paged (flex)": ("tab:orange", "^", "-"),
    "paged (triton)": ("tab:red", "D", "-"),
}


def spread_ms(point: dict) -> tuple[float, float]:
    """(min, max) of a point's timed steps in ms; the median twice where no steps were kept."""
    times = point.get("times_s") or [point["median_s"]]
    return min(times) * 1e3, max(times) * 1e3


def _model(data: dict, model: str) -> dict:
    if model not in data["models"]:
        raise ValueError(f"model must be one of {sorted(data['models'])} in this result, got {model!r}")
    return data["models"][model]


def missing_section(data: dict, model: str, section: str) -> str | None:
    """Why a model's result has no ``section`` (``ladder``, ``batch``, ``chat``, ``sweep``,
    ``alloc``): the error the run recorded for it, or that its time budget skipped it; None when
    the section is there.

    Example:
        >>> data = {"models": {"m": {"ladder": [], "skipped": ["chat"],
        ...                          "errors": ["batch: OutOfPagesError: 0 of the pool are free"]}}}
        >>> missing_section(data, "m", "batch"), missing_section(data, "m", "chat")
        ('failed in this run: OutOfPagesError: 0 of the pool are free', "skipped by the run's time budget")
    """
    res = _model(data, model)
    if res.get(section):
        return None
    failed = [e.split(": ", 1)[1] for e in res.get("errors", []) if e.split(":", 1)[0] == section]
    if failed:
        return "failed in this run: " + "; ".join(failed)
    if any(s.split(" ")[0] == section for s in res.get("skipped", [])):
        return "skipped by the run's time budget"
    return "not in this result"


def _section(data: dict, model: str, section: str):
    why = missing_section(data, model, section)
    if why is not None:
        raise ValueError(f"model {model!r} has no {section!r} section to draw: {why}")
    return data["models"][model][section]


def _title(res: dict) -> str:
    m = res["model"]
    return f"{m.get('note') or m['name']}, {m['dtype']}"


def latency_figure(data: dict, model: str) -> Figure:
    """Per-token decode latency vs context (log-log) per decoder, and each over the contiguous cache."""
    res = _model(data, model)
    _section(data, model, "ladder")
    fig = Figure(figsize=(10.5, 4.0), layout="constrained")
    ax, ax_ratio = fig.subplots(1, 2)
    runs = [r for r in res["ladder"] if r["timed"]] + [r for r in res.get("long", []) if r["timed"]]
    for r in runs:
        pts = [p for p in r["points"] if p["median_s"] is not None]
        if not pts:
            continue
        color, marker, ls = _STYLE.get(r["label"], ("k", "o", "-"))
        x = [p["context"] for p in pts]
        y = np.array([p["median_s"] * 1e3 for p in pts])
        lo, hi = np.array([spread_ms(p) for p in pts]).T
        long = r in res.get("long", [])
        ax.errorbar(
            x,
            y,
            yerr=[y - lo, hi - y],
            marker=marker,
            ls="none" if long else ls,
            color=color,
            label=None if long else r["label"],
            ms=9 if long else 6,
            capsize=2,
            elinewidth=0.8,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("ms per generated token (median, bars: min-max)")
    ax.set_title("decode latency vs context, batch 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    base = res.get("ratio_base")
    for label, pts in res.get("ratios", {}).items():
        if not pts:
            continue
        color, marker, ls = _STYLE.get(label, ("k", "o", "-"))
        x = sorted(int(c) for c in pts)
        y = [pts[c] if c in pts else pts[str(c)] for c in x]
        ax_ratio.plot(x, y, marker=marker, ls=ls, color=color, label=label)
    ax_ratio.axhline(1.0, color="tab:blue", lw=1)
    ax_ratio.axhspan(0.9, 1.1, color="tab:blue", alpha=0.08, label="within 10% of contiguous")
    ax_ratio.set_xscale("log", base=2)
    ax_ratio.set_yscale("log")
    ax_ratio.set_xlabel("context length (tokens)")
    ax_ratio.set_ylabel(f"latency / {base}")
    ax_ratio.set_title("relative to the contiguous cache")
    ax_ratio.grid(True, which="both", alpha=0.3)
    ax_ratio.legend(fontsize=7)
    fig.suptitle(_title(res), fontsize=10)
    add_note(fig, provenance(data))
    return fig


def memory_figure(data: dict, model: str) -> Figure:
    """KV bytes held per decoder vs context, against the minimum for the most tokens a decoder held there
    (tokens x bytes per token): decoders that took fewer steps hold fewer tokens and may sit below it."""
    res = _model(data, model)
    _section(data, model, "ladder")
    fig = Figure(figsize=(10.5, 4.0), layout="constrained")
    ax, ax_peak = fig.subplots(1, 2)
    per_token = res["kv_bytes_per_token"]
    minimum = {}
    for r in res["ladder"] + res.get("long", []):
        if r["backend"] == "none":
            continue
        pts = [(p["context"], p["kv_bytes"] / MiB) for p in r["points"]]
        for p in r["points"]:
            most = max(minimum.get(p["context"], 0.0), p["tokens_held"] * per_token / MiB)
            minimum[p["context"]] = most
        color, marker, ls = _STYLE.get(r["label"], ("k", "o", "-"))
        x, y = zip(*pts)
        ax.plot(x, y, marker=marker, ls=ls, color=color, label=r["label"], alpha=0.85)
    if minimum:
        x = sorted(minimum)
        ax.plot(x, [minimum[c] for c in x], color="k", lw=1, ls="--", label="minimum for the most tokens held")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV storage held, MiB")
    ax.set_title("KV cache memory (no cache: 0, recomputes instead)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    peaks = [r for r in res["ladder"] if any(p["peak_bytes"] for p in r["points"])]
    if peaks:
        for r in peaks:
            color, marker, ls = _STYLE.get(r["label"], ("k", "o", "-"))
            x = [p["context"] for p in r["points"]]
            y = [(p["peak_bytes"] - p["weights_bytes"]) / MiB for p in r["points"]]
            ax_peak.plot(x, y, marker=marker, ls=ls, color=color, label=r["label"])
        ax_peak.set_xscale("log", base=2)
        ax_peak.set_yscale("log")
        ax_peak.set_ylabel("peak device memory minus weights, MiB")
        ax_peak.set_title("peak device memory during decode")
        ax_peak.legend(fontsize=7)
    else:
        b = res.get("batch")
        if b:
            o = b["overhead_ps16"]
            ax_peak.bar(
                ["tokens held\n(minimum)", f"paged, page {o['page_size']}", "contiguous max-length\n(same requests)"],
                [o["tokens"], o["slots"], b["fit"]["paged_allocator"] * b["max_len"]],
                color=["0.5", "tab:orange", "tab:blue"],
            )
            ax_peak.set_ylabel("token slots")
            ax_peak.set_title(
                f"mixed batch of {b['fit']['paged_allocator']} requests: slots held "
                f"(paged overhead {100 * o['overhead']:.1f}%)",
                fontsize=9,
            )
    ax_peak.set_xlabel("context length (tokens)" if peaks else "")
    ax_peak.grid(True, which="both", alpha=0.3)
    fig.suptitle(_title(res), fontsize=10)
    add_note(fig, provenance(data))
    return fig


def batch_figure(data: dict, model: str) -> Figure:
    """Mixed batch under one KV budget: requests admitted, and tokens/s, contiguous vs paged."""
    res = _model(data, model)
    b = _section(data, model, "batch")
    fig = Figure(figsize=(11.5, 3.8), layout="constrained")
    ax_fit, ax_tps, ax_len = fig.subplots(1, 3, width_ratios=[0.8, 1.4, 1.1])
    fit = b["fit"]
    bars = ax_fit.bar(
        ["contiguous\nmax-length", "paged\n(page 16)"],
        [fit["max_len"], fit["paged_allocator"]],
        color=["tab:blue", "tab:orange"],
    )
    ax_fit.bar_label(bars)
    ax_fit.set_ylabel("requests held at once")
    ax_fit.set_title(f"admitted under {b['budget_tokens']} token slots", fontsize=9)
    labels, values, colors = [], [], []
    if "contiguous" in b:
        c = b["contiguous"]
        labels.append(f"contiguous, batch {c['batch']}")
        values.append(c["tokens_per_s"])
        colors.append("tab:blue")
    for p in b["paged"].values():
        name = p["label"].replace("paged ", "")
        if "same_batch_tokens_per_s" in p:
            labels.append(f"paged {name}, batch {fit['max_len']}")
            values.append(p["same_batch_tokens_per_s"])
            colors.append("navajowhite")
        labels.append(f"paged {name}, batch {p['batch']}")
        values.append(p["tokens_per_s"])
        colors.append(_STYLE.get(p["label"], ("tab:orange",))[0])
    # horizontal bars: one label per line, none overlapping whatever the backends' names
    rows = np.arange(len(labels))
    bars = ax_tps.barh(rows, values, color=colors)
    ax_tps.set_yticks(rows, labels, fontsize=8)
    ax_tps.invert_yaxis()
    ax_tps.bar_label(bars, labels=[f"{v:.1f}" for v in values], fontsize=8, padding=2)
    ax_tps.set_xlim(0, max(values) * 1.18)
    ax_tps.set_xlabel("generated tokens / s (whole batch)")
    ax_tps.set_title("decode throughput", fontsize=9)
    ax_len.hist(b["lengths"], bins=30, color="0.6")
    ax_len.axvline(b["max_len"], color="tab:blue", ls="--", label=f"max_len {b['max_len']} (reserved each)")
    ax_len.set_xlabel("request length (tokens)")
    ax_len.set_ylabel("requests")
    ax_len.set_title(f"{b['num_requests']} requests drawn, mean {b['mean_len']:.0f}", fontsize=9)
    ax_len.legend(fontsize=7)
    fig.suptitle(_title(res), fontsize=10)
    add_note(fig, provenance(data))
    return fig


def chat_figure(data: dict, model: str) -> Figure:
    """Growing chat: latency and pages allocated per turn, with and without prefix caching."""
    res = _model(data, model)
    _section(data, model, "chat")
    fig = Figure(figsize=(10.5, 3.6), layout="constrained")
    ax_lat, ax_pages = fig.subplots(1, 2)
    width = 0.38
    for i, run in enumerate(res["chat"]["runs"]):
        turns = np.array([t["turn"] for t in run["turns"]])
        label = "prefix caching on" if run["prefix_caching"] else "prefix caching off"
        color = "tab:green" if run["prefix_caching"] else "tab:purple"
        ax_lat.bar(
            turns + (i - 0.5) * width, [t["latency_s"] * 1e3 for t in run["turns"]], width, label=label, color=color
        )
        ax_pages.bar(
            turns + (i - 0.5) * width,
            [t["pages_allocated"] for t in run["turns"]],
            width,
            label=f"{label}: new pages",
            color=color,
        )
        if run["prefix_caching"]:
            ax_pages.plot(
                turns,
                [t["prefix_pages_reused"] for t in run["turns"]],
                "k.--",
                label="pages reused from the prefix cache",
            )
    ax_lat.set_xlabel("turn")
    ax_lat.set_ylabel("ms per turn (prefill + reply)")
    ax_lat.set_title(
        f"{res['chat']['user_tokens']} user tokens + {res['chat']['reply_tokens']} reply tokens per turn", fontsize=9
    )
    ax_lat.legend(fontsize=7)
    ax_pages.set_xlabel("turn")
    ax_pages.set_ylabel("pages")
    ax_pages.set_title("pages per request", fontsize=9)
    ax_pages.legend(fontsize=7)
    fig.suptitle(
        _title(res) + f" - paged ({res['chat']['runs'][0]['backend']}), page size "
        f"{res['chat']['runs'][0]['page_size']}",
        fontsize=10,
    )
    add_note(fig, provenance(data))
    return fig


def page_size_figure(data: dict, model: str) -> Figure:
    """Page-size sweep on the mixed batch: overhead over the minimum, and decode-attention time."""
    res = _model(data, model)
    rows = _section(data, model, "sweep")
    ps = [r["page_size"] for r in rows]
    fig = Figure(figsize=(10.5, 3.6), layout="constrained")
    ax_o, ax_t = fig.subplots(1, 2)
    ax_o.plot(ps, [100 * r["overhead"] for r in rows], "o-", color="tab:orange")
    ax_o.axhline(5, color="k", ls="--", lw=1, label="goal: 5%")
    ax_o.set_xscale("log", base=2)
    ax_o.set_xlabel("page size (tokens)")
    ax_o.set_ylabel("slots held / tokens held - 1, %")
    n = res["batch"]["fit"]["paged_allocator"] if res.get("batch") else None
    ax_o.set_title("overhead over the minimum" + (f", the {n} admitted requests" if n else ""), fontsize=9)
    ax_o.legend(fontsize=7)
    ax_o.grid(True, which="both", alpha=0.3)
    for name in rows[0]["attention_s"]:
        color = _STYLE.get(f"paged ({name})", ("k",))[0]
        pts = [(r["page_size"], r["attention_s"][name] * 1e3) for r in rows if r["attention_s"][name] is not None]
        if pts:
            ax_t.plot(*zip(*pts), "o-", color=color, label=name)
    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("page size (tokens)")
    ax_t.set_ylabel("ms per call (median)")
    ax_t.set_title("decode attention, one layer, whole batch", fontsize=9)
    ax_t.legend(fontsize=7)
    ax_t.grid(True, which="both", alpha=0.3)
    fig.suptitle(_title(res), fontsize=10)
    add_note(fig, provenance(data))
    return fig


def alloc_figure(data: dict, model: str) -> Figure:
    """Allocator cost per page operation during the run: median and p99 per call and per page."""
    res = _model(data, model)
    ops = list(_section(data, model, "alloc"))
    fig = Figure(figsize=(6.4, 3.4), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(ops))
    for i, (key, label) in enumerate(
        (
            ("median_ns", "median per call"),
            ("p99_ns", "p99 per call"),
            ("median_ns_per_page", "median per page"),
            ("p99_ns_per_page", "p99 per page"),
        )
    ):
        vals = [res["alloc"][op][key] / 1e3 for op in ops]
        ax.bar(x + (i - 1.5) * 0.2, vals, 0.2, label=label)
    ax.set_xticks(x, [f"{op}\n({res['alloc'][op]['calls']} calls)" for op in ops])
    ax.set_ylabel("microseconds")
    ax.set_yscale("log")
    ax.set_title("page operations timed during the whole run", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle(_title(res), fontsize=10)
    add_note(fig, provenance(data))
    return fig


#: Each figure of a model's run and the section of its result that it draws.
FIGURES = {
    "latency": ("ladder", latency_figure),
    "memory": ("ladder", memory_figure),
    "batch": ("batch", batch_figure),
    "chat": ("chat", chat_figure),
    "page_size": ("sweep", page_size_figure),
    "alloc": ("alloc", alloc_figure),
}
