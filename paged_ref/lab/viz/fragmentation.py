"""Figures for fragmentation (notebook 03). Each returns a new Figure.

The numbers come from :mod:`paged_ref.lab.sizing` (arithmetic) and :mod:`paged_ref.lab.fragmentation`
(dry runs of the serving engine on a seeded workload); nothing is measured on hardware, and the
figures say so.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ...block_table import pages_needed
from ..fragmentation import CATEGORIES, DryRun
from ..sizing import reservation_report
from . import add_note

#: Colors of the memory categories (`paged_ref.lab.fragmentation.CATEGORIES`), shared by every figure.
COLORS = {"used": "tab:blue", "last_page": "tab:orange", "future": "#9ecae1", "waste": "tab:red", "free": "0.88"}
LABELS = {
    "used": "used (tokens stored)",
    "last_page": "empty end of last pages",
    "future": "committed, to be filled",
    "waste": "committed, never filled",
    "free": "free",
}
RESERVATION_NAMES = {
    "paged": "paged",
    "exact": "exact (commits prompt + output)",
    "max_len": "max_len (commits max_len)",
}
DRY_RUN = "Dry runs of paged_ref.serve.Engine (no model, seeded workload): slot counts, no hardware measured."


def slot_map_figure(lengths, *, page_size: int, reserved_per_request: int) -> Figure:
    """Each request's slots under a fixed reservation (top) and under paging (bottom).

    One row per request; a square per token slot: blue = holds a token, orange = held but
    empty. Page boundaries are drawn in the paged rows.
    """
    r = reservation_report(lengths, page_size=page_size, reserved_per_request=reserved_per_request)
    n = len(r.lengths)
    fig = Figure(figsize=(8.0, 0.9 + 0.5 * 2 * n), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    for ax, paged in zip(axes, (False, True)):
        for row, length in enumerate(r.lengths):
            held = pages_needed(length, page_size) * page_size if paged else reserved_per_request
            y = n - 1 - row
            ax.add_patch(Rectangle((0, y + 0.1), length, 0.8, color=COLORS["used"]))
            ax.add_patch(Rectangle((length, y + 0.1), held - length, 0.8, color=COLORS["last_page"]))
            if paged:
                for x in range(0, held + 1, page_size):
                    ax.plot([x, x], [y + 0.05, y + 0.95], color="k", lw=0.6)
            ax.text(held + 1, y + 0.5, f"{length} used / {held} held", va="center", fontsize=8)
        ax.set_ylim(0, n)
        ax.set_yticks(np.arange(n) + 0.5, [f"request {i}" for i in reversed(range(n))])
        slots = r.paged_slots if paged else r.reserved_slots
        ax.set_title(
            (f"paged, {page_size}-token pages" if paged else f"fixed reservation of {reserved_per_request} slots")
            + f": {slots} slots held for {r.used_slots} tokens",
            fontsize=9,
        )
    axes[1].set_xlim(0, max(reserved_per_request, max(r.lengths) + page_size) * 1.25)
    axes[1].set_xlabel("token slots")
    add_note(fig, "Slot arithmetic from paged_ref.lab.sizing.reservation_report (no hardware measured).")
    return fig


def timeline_figure(runs: list[DryRun]) -> Figure:
    """Per reservation, where the pool's slots were after every step (stacked shares)."""
    fig = Figure(figsize=(8.0, 2.2 * len(runs)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(runs), 1, sharex=True))
    for ax, run in zip(axes, runs):
        ax.stackplot(
            np.arange(len(run.used)),
            *[getattr(run, k) / run.pool_slots for k in CATEGORIES],
            colors=[COLORS[k] for k in CATEGORIES],
            labels=[LABELS[k] for k in CATEGORIES],
        )
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of pool")
        reservation, page = run.engine.scheduler.reservation, run.engine.kv.page_size
        ax.set_title(f"{RESERVATION_NAMES[reservation]}, {page}-token pages: done in {len(run.used)} steps", fontsize=9)
    axes[0].legend(loc="upper right", fontsize=7, ncol=3)
    axes[-1].set_xlabel("engine step (one forward)")
    add_note(fig, DRY_RUN)
    return fig


def reservation_bars_figure(summaries: list[dict]) -> Figure:
    """Mean split of the pool under memory pressure, and how many requests ran at once."""
    fig = Figure(figsize=(8.0, 3.4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    names = [RESERVATION_NAMES[s["reservation"]] + f" ({s['page_size']})" for s in summaries]
    left = np.zeros(len(summaries))
    for key in CATEGORIES:
        vals = np.array([s[key] for s in summaries])
        ax1.barh(names, vals, left=left, color=COLORS[key], label=LABELS[key])
        left += vals
    for i, s in enumerate(summaries):
        ax1.text(0.01, i, f"{s['used']:.0%} used", va="center", fontsize=8, color="w")
    ax1.set_xlim(0, 1)
    ax1.invert_yaxis()
    ax1.set_xlabel(f"share of a {summaries[0]['pool_slots']:,}-slot pool\n(mean under pressure)")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    bars = ax2.barh(names, [s["running_under_pressure"] for s in summaries], color="tab:green")
    ax2.bar_label(
        bars,
        labels=[f"{s['running_under_pressure']:.1f} ({s['tokens_per_step']:.1f} tok/step)" for s in summaries],
        fontsize=8,
    )
    ax2.set_yticks([])
    ax2.invert_yaxis()
    ax2.margins(x=0.6)
    ax2.set_xlabel("requests running at once")
    add_note(fig, DRY_RUN)
    return fig


def page_size_sweep_figure(sweep: list[dict]) -> Figure:
    """One reservation vs page size: empty ends of last pages, slots used, concurrency, preemptions."""
    ps = [s["page_size"] for s in sweep]
    fig = Figure(figsize=(8.0, 3.2), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    ax1.semilogx(
        ps, [s["last_page"] for s in sweep], "o-", base=2, color=COLORS["last_page"], label=LABELS["last_page"]
    )
    ax1.semilogx(ps, [s["used"] for s in sweep], "s-", base=2, color=COLORS["used"], label=LABELS["used"])
    ax1.set_ylim(0, 1)
    ax1.set_xlabel("page size (tokens)")
    ax1.set_ylabel("share of pool (mean under pressure)")
    ax1.legend(fontsize=8)
    ax2.semilogx(
        ps,
        [s["running_under_pressure"] for s in sweep],
        "o-",
        base=2,
        color="tab:green",
        label="requests running at once",
    )
    ax2.set_xlabel("page size (tokens)")
    ax2.set_ylabel("requests running at once")
    ax3 = ax2.twinx()
    ax3.semilogx(ps, [s["preemptions"] for s in sweep], "x:", base=2, color="0.4", label="preemptions")
    ax3.set_ylabel("preemptions (whole run)")
    ax2.legend(handles=ax2.get_lines() + ax3.get_lines(), fontsize=8, loc="center left")
    for ax in (ax1, ax2):
        ax.set_xticks(ps, [str(p) for p in ps])
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Page-size sweep ({sweep[0]['reservation']}), {sweep[0]['pool_slots']:,}-slot pool", fontsize=10)
    add_note(fig, DRY_RUN)
    return fig


def budget_sweep_figure(budgets, summaries_by_reservation: dict[str, list[dict]]) -> Figure:
    """Requests running at once and tokens per step vs pool size, one line per reservation."""
    fig = Figure(figsize=(8.0, 3.4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for reservation, summaries in summaries_by_reservation.items():
        label = RESERVATION_NAMES[reservation] + f" ({summaries[0]['page_size']})"
        ax1.plot(budgets, [s["running_under_pressure"] for s in summaries], "o-", label=label)
        ax2.plot(budgets, [s["tokens_per_step"] for s in summaries], "o-", label=label)
    ax1.set_ylabel("requests running at once\n(mean under pressure)")
    ax2.set_ylabel("generated tokens per step")
    for ax in (ax1, ax2):
        ax.set_xlabel("pool (token slots)")
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle("How many requests a pool serves at once, and how fast", fontsize=10)
    add_note(fig, DRY_RUN)
    return fig


def workload_figure(workload) -> Figure:
    """Histogram of the requests' final lengths, and arrivals over time."""
    fig = Figure(figsize=(8.0, 3.0), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    total = workload.total_len
    ax1.hist(total, bins=np.geomspace(max(1, total.min()), workload.max_len, 30), color="tab:blue")
    ax1.set_xscale("log")
    ax1.axvline(total.mean(), color="k", ls="--", lw=1, label=f"mean {total.mean():.0f}")
    ax1.axvline(workload.max_len, color="tab:orange", lw=1.5, label=f"max_len {workload.max_len}")
    ax1.set_xlabel("prompt + output tokens")
    ax1.set_ylabel("requests")
    ax1.legend(fontsize=8)
    ax2.plot(workload.arrival, np.arange(1, len(workload) + 1), color="tab:green")
    ax2.set_xlabel("arrival step")
    ax2.set_ylabel("requests arrived")
    fig.suptitle(f"{len(workload)} requests, lognormal lengths, Poisson arrivals", fontsize=10)
    add_note(fig, "Seeded workload (paged_ref.lab.fragmentation.make_workload); no hardware measured.")
    return fig
