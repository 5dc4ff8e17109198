"""Figures of serving (notebook 09): the pool step by step, and the benchmark's latency and throughput.

- :func:`page_timeline_figure`: which request holds each page at every step of a run (one column
  per step): a whole run in one picture, from a `paged_ref.lab.page_trace.PageTrace`'s history;
- :func:`step_figure`: one step up close (the page map, the queues over time, what the forward fed);
- :func:`rate_figure`: latency and throughput vs request rate per admission policy (the vLLM paper's
  picture), from ``figures/data/serve_cpu.json``;
- :func:`pool_figure`: throughput and concurrency vs pool size;
- :func:`profile_figure`: where a step's time goes, per speed-up, and each speed-up's gain, from
  ``figures/data/serve_profile_cpu.json`` (``bench serve --profile``).

Example:
    >>> from paged_ref.serve import Engine
    >>> from paged_ref.lab.page_trace import PageTrace
    >>> engine = Engine(None, num_pages=6, page_size=2, max_batched_tokens=8)
    >>> trace = PageTrace(engine)
    >>> for n in (5, 3): _ = engine.add_request(list(range(n)), max_new_tokens=4)
    >>> _ = engine.run()
    >>> fig = page_timeline_figure(trace.history, title="two requests")
    >>> fig = step_figure(trace.history, 2)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from ..provenance import describe as provenance
from . import add_note
from .pages import PALETTE, seq_color

__all__ = ["POLICY_STYLE", "provenance", "page_timeline_figure", "step_figure", "rate_figure", "pool_figure"]
__all__ += ["PART_COLORS", "profile_figure"]

#: policy -> (color, marker, label)
POLICY_STYLE = {
    "paged": ("tab:blue", "o", "paged"),
    "exact": ("tab:green", "s", "exact (oracle reservation)"),
    "max_len": ("tab:red", "v", "max_len reservation"),
    "paged_eviction": ("tab:purple", "^", "paged + PagedEviction"),
}
_FREE = "0.93"


def _traced(history) -> list:
    steps = [h for h in history if getattr(h, "owners", None) is not None]
    if not steps:
        raise ValueError("history holds no page owners: draw a PageTrace's history (paged_ref.lab.page_trace)")
    return steps


def page_timeline_figure(history: Sequence, *, title: str = "", width: float = 9.0) -> Figure:
    """Pages (rows) by steps (columns), each cell colored by the request holding the page after that
    step's forward (light grey: free). Red ticks on top mark steps that preempted a request."""
    steps = _traced(history)
    owners = np.array([h.owners for h in steps]).T  # [num_pages, steps]
    num_pages = owners.shape[0]
    cmap = ListedColormap([_FREE, *PALETTE])
    index = np.where(owners < 0, 0, owners % len(PALETTE) + 1)
    fig = Figure(figsize=(width, min(6.0, 1.5 + 0.08 * num_pages)))
    ax = fig.add_subplot()
    ax.imshow(index, aspect="auto", cmap=cmap, vmin=0, vmax=len(PALETTE), interpolation="nearest")
    for x, h in enumerate(steps):
        if h.preempted:
            ax.plot([x], [-0.9], marker="v", color="red", markersize=5, clip_on=False)
    ax.set_xlabel("step")
    ax.set_ylabel("physical page")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title or f"who holds each of the {num_pages} pages, step by step (red: a preemption)")
    requests = sorted({int(o) for o in owners.flat if o >= 0})
    if len(requests) <= len(PALETTE):
        handles = [Patch(color=seq_color(r), label=f"R{r}") for r in requests]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        colors = "one color per request"
    else:
        colors = f"colors repeat every {len(PALETTE)} requests"
    fig.tight_layout()
    add_note(fig, f"Drawn from the engine's per-step page owners (a recorded run; {colors}).")
    return fig


def step_figure(history: Sequence, index: int, *, names: dict | None = None) -> Figure:
    """Step ``index`` up close: its page map (colored by request, the dark bar is tokens stored) and,
    below, requests running / waiting / swapped over the run with this step marked."""
    steps = _traced(history)
    n = len(steps)
    if isinstance(index, bool) or not isinstance(index, int) or not -n <= index < n:
        raise ValueError(f"index must be an int in [{-n}, {n}), got {index!r}")
    h = steps[index % n]
    num_pages = len(h.owners)
    page_size = max(max(s.fill) for s in steps) or 1
    cols = min(num_pages, 16)
    rows = -(-num_pages // cols)
    fig = Figure(figsize=(8, 1.8 + 0.45 * rows))
    grid = fig.add_gridspec(2, 1, height_ratios=[rows, 2.2], hspace=0.55)
    ax = fig.add_subplot(grid[0])
    for p, (owner, fill) in enumerate(zip(h.owners, h.fill)):
        x, y = p % cols, rows - 1 - p // cols
        color = _FREE if owner < 0 else seq_color(owner)
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=color, edgecolor="0.5", alpha=0.85))
        if owner >= 0:
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9 * fill / page_size, 0.12, facecolor="black"))
            label = (names or {}).get(owner, f"R{owner}")
            ax.text(x + 0.5, y + 0.55, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    events = []
    if h.admitted:
        events.append("admitted " + ", ".join(f"R{r}" for r in h.admitted))
    if h.preempted:
        events.append("preempted " + ", ".join(f"R{r}" for r in h.preempted))
    if h.finished:
        events.append("finished " + ", ".join(f"R{r}" for r in h.finished))
    ax.set_title(
        f"step {h.step}: {h.rows} rows ({h.decode_rows} decoding), {h.tokens} tokens fed, "
        f"{h.pages_used}/{num_pages} pages" + (f"\n{'; '.join(events)}" if events else ""),
        fontsize=9,
    )
    q = fig.add_subplot(grid[1])
    x = [s.step for s in steps]
    for key, color in (("running", "tab:blue"), ("waiting", "tab:orange"), ("swapped", "tab:gray")):
        q.plot(x, [getattr(s, key) for s in steps], color=color, label=key, drawstyle="steps-post")
    q.axvline(h.step, color="black", linewidth=1)
    q.set_xlabel("step")
    q.set_ylabel("requests")
    q.legend(fontsize=7, ncol=3, loc="upper right")
    add_note(fig, "Drawn from a recorded engine run (a PageTrace).")
    return fig


def _rates(data: dict):
    rows = data["rates"]
    if not rows:
        raise ValueError("the result holds no rate rows")
    return [r["rate"] for r in rows], rows


def rate_figure(data: dict) -> Figure:
    """Per policy vs request rate: normalized latency (s per generated token), TTFT (p50 solid, p90
    dashed) and generated tokens/s."""
    rates, rows = _rates(data)
    fig = Figure(figsize=(12, 3.6))
    axes = fig.subplots(1, 3)
    for policy, (color, marker, label) in POLICY_STYLE.items():
        if policy not in rows[0]["policies"]:
            continue
        res = [r["policies"][policy] for r in rows]
        axes[0].plot(rates, [x["normalized_latency_s"] for x in res], color=color, marker=marker, label=label)
        axes[1].plot(rates, [x["ttft_p50_s"] for x in res], color=color, marker=marker, label=label)
        axes[1].plot(rates, [x["ttft_p90_s"] for x in res], color=color, linestyle="--", alpha=0.7)
        axes[2].plot(rates, [x["tokens_per_s"] for x in res], color=color, marker=marker, label=label)
    for ax, ylabel in zip(
        axes, ("normalized latency (s / token)", "time to first token (s)\np50 solid, p90 dashed", "tokens / s")
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request rate (requests / s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    w = data["workload"]
    fig.suptitle(
        f"{w['requests']} requests on one pool of {data['config']['num_pages']} pages "
        f"({w['pool_bytes'] / 2**20:.0f} MiB of KV): latency and throughput vs request rate"
    )
    fig.tight_layout()
    add_note(fig, provenance(data))
    return fig


def pool_figure(data: dict) -> Figure:
    """Tokens/s and mean requests running vs pool size at the highest rate, per reservation policy."""
    if not data.get("pools"):
        raise ValueError("the result holds no pool sweep (bench serve ran with --skip-pools)")
    top = data["rates"][-1]
    points: dict[str, list] = {}
    for r in data["pools"]:
        if "skipped" not in r:
            points.setdefault(r["policy"], []).append((r["num_pages"], r["tokens_per_s"], r["mean_running"]))
    for policy, r in top["policies"].items():
        if policy in points:
            points[policy].append((data["config"]["num_pages"], r["tokens_per_s"], r["mean_running"]))
    fig = Figure(figsize=(9, 3.8))
    axes = fig.subplots(1, 2)
    page_mib = data["workload"]["pool_bytes"] / data["config"]["num_pages"] / 2**20
    for policy, pts in points.items():
        color, marker, label = POLICY_STYLE[policy]
        pts.sort()
        x = [p[0] for p in pts]
        axes[0].plot(x, [p[1] for p in pts], color=color, marker=marker, label=label)
        axes[1].plot(x, [p[2] for p in pts], color=color, marker=marker, label=label)
    sizes = sorted({p[0] for pts in points.values() for p in pts})
    for ax, ylabel in zip(axes, ("tokens / s", "requests running (mean)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{n}\n{n * page_mib:.0f} MiB" for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel(f"KV pool: pages of {data['config']['page_size']} tokens")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"throughput vs pool size at {top['rate']:g} requests / s")
    fig.tight_layout()
    add_note(fig, provenance(data))
    return fig


#: part of a step -> color (`paged_ref.lab.bench._serve_profile.GROUPS`, plus "other")
PART_COLORS = {
    "linear layers": "tab:blue",
    "attention": "tab:orange",
    "cache writes": "tab:green",
    "mlp activation": "tab:purple",
    "other": "0.7",
}


def profile_figure(data: dict) -> Figure:
    """Milliseconds of a decode step and of a mixed step by part (linear layers, attention, ...), one
    stacked bar per variant; then each variant's speed-up over the one before (median of per-step ratios)."""
    variants = list(data["variants"])
    fig = Figure(figsize=(12, 3.8))
    axes = fig.subplots(1, 3)
    x = np.arange(len(variants))
    for ax, kind in zip(axes, ("decode", "mixed")):
        tables = [data["variants"][v]["profile"].get(kind) for v in variants]
        bottom = np.zeros(len(variants))
        for part, color in PART_COLORS.items():
            ms = np.array([t["groups"][part]["ms_per_step"] if t else 0.0 for t in tables])
            ax.bar(x, ms, bottom=bottom, color=color, label=part, width=0.6)
            bottom += ms
        rows = sorted({r for t in tables if t for r in t["rows"]})
        ax.set_title(f"{kind} step ({'/'.join(map(str, rows))} rows)", fontsize=10)
        ax.set_ylabel("ms per step (CPU time of ops, profiled)")
    gains = [g for g in data["gains"] if (g["before"], g["after"]) != (variants[0], variants[-1])]
    width = 0.35
    for i, kind in enumerate(("decode", "mixed")):
        ratios = [g["step_ratio_median"][kind] or 0.0 for g in gains]
        axes[2].bar(np.arange(len(gains)) + (i - 0.5) * width, ratios, width, label=f"{kind} steps")
    axes[2].axhline(1.0, color="0.3", linewidth=0.8)
    axes[2].set_xticks(np.arange(len(gains)), [g["after"].replace("_", "\n") for g in gains], fontsize=8)
    axes[2].set_ylabel("speed-up over the bar before\n(median of per-step time ratios)")
    axes[2].set_title("each step's gain", fontsize=10)
    axes[2].legend(fontsize=7)
    for ax in axes[:2]:
        ax.set_xticks(x, [v.replace("_", "\n") for v in variants], fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"where a serving step's time goes: {data['model']['name']}, {data['torch_threads']} thread(s)")
    fig.tight_layout()
    add_note(fig, provenance(data))
    return fig
