"""Figures for fragmentation (notebook 03). Each returns a new Figure.

The numbers come from :mod:`paged_ref.memory` (arithmetic) and :mod:`paged_ref.lab.fragmentation`
(a seeded simulation); nothing is measured on hardware, and the figures say so.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ...block_table import pages_needed
from ...memory import reservation_report
from ..fragmentation import SimResult
from . import add_note

#: Colors of the memory categories, shared by every fragmentation figure.
COLORS = {"used": "tab:blue", "future": "#9ecae1", "internal": "tab:orange", "external": "tab:red", "free": "0.88"}
LABELS = {
    "used": "used (tokens stored)",
    "future": "reserved for future tokens",
    "internal": "internal fragmentation",
    "external": "external fragmentation",
    "free": "free",
}
POLICY_NAMES = {
    "reserve_max": "contiguous, max-length reservation",
    "exact": "contiguous, exact size (first fit)",
    "paged": "paged",
    "paged_pow2": "paged, power-of-two growth",
}
SIMULATED = "Simulation (paged_ref.lab.fragmentation, seeded); slot counts, no hardware measured."


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
            ax.add_patch(Rectangle((length, y + 0.1), held - length, 0.8, color=COLORS["internal"]))
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
    add_note(fig, "Slot arithmetic from paged_ref.memory.reservation_report (no hardware measured).")
    return fig


def timeline_figure(results: list[SimResult]) -> Figure:
    """Per policy, where the memory budget went at every step (stacked fractions)."""
    fig = Figure(figsize=(8.0, 2.2 * len(results)), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(results), 1, sharex=True))
    keys = list(COLORS)
    for ax, res in zip(axes, results):
        steps = np.arange(res.num_steps)
        ax.stackplot(
            steps,
            *[getattr(res, k) / res.budget_slots for k in keys],
            colors=[COLORS[k] for k in keys],
            labels=[LABELS[k] for k in keys],
        )
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of budget")
        extra = f", {res.page_size}-token pages" if res.policy.startswith("paged") else ""
        ax.set_title(f"{POLICY_NAMES[res.policy]}{extra}: all requests done at step {res.num_steps}", fontsize=9)
    axes[0].legend(loc="upper right", fontsize=7, ncol=3)
    axes[-1].set_xlabel("step (one token per running request)")
    add_note(fig, SIMULATED)
    return fig


def policy_bars_figure(summaries: list[dict]) -> Figure:
    """Mean split of the budget under memory pressure, and how many requests ran at once."""
    fig = Figure(figsize=(8.0, 3.4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    names = [
        POLICY_NAMES[s["policy"]] + (f" ({s['page_size']})" if s["policy"].startswith("paged") else "")
        for s in summaries
    ]
    left = np.zeros(len(summaries))
    for key in COLORS:
        vals = np.array([s["utilization" if key == "used" else key] for s in summaries])
        ax1.barh(names, vals, left=left, color=COLORS[key], label=LABELS[key])
        left += vals
    for i, s in enumerate(summaries):
        ax1.text(0.01, i, f"{s['utilization']:.0%} used", va="center", fontsize=8, color="w")
    ax1.set_xlim(0, 1)
    ax1.invert_yaxis()
    ax1.set_xlabel(f"share of a {summaries[0]['budget_slots']:,}-slot budget (mean under pressure)")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    bars = ax2.barh(names, [s["mean_running"] for s in summaries], color="tab:green")
    ax2.bar_label(bars, labels=[f"{s['mean_running']:.1f}" for s in summaries], fontsize=8)
    ax2.set_yticks([])
    ax2.invert_yaxis()
    ax2.margins(x=0.25)
    ax2.set_xlabel("requests running at once")
    add_note(fig, SIMULATED)
    return fig


def page_size_sweep_figure(sweep: list[dict]) -> Figure:
    """Paged policy vs page size: internal fragmentation, utilization, concurrency, preemptions."""
    ps = [s["page_size"] for s in sweep]
    fig = Figure(figsize=(8.0, 3.2), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    ax1.semilogx(
        ps, [s["internal"] for s in sweep], "o-", base=2, color=COLORS["internal"], label="internal fragmentation"
    )
    ax1.semilogx(ps, [s["utilization"] for s in sweep], "s-", base=2, color=COLORS["used"], label="utilization")
    ax1.set_ylim(0, 1)
    ax1.set_xlabel("page size (tokens)")
    ax1.set_ylabel("share of budget (mean under pressure)")
    ax1.legend(fontsize=8)
    ax2.semilogx(
        ps, [s["mean_running"] for s in sweep], "o-", base=2, color="tab:green", label="requests running at once"
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
    fig.suptitle(f"Page-size sweep, {sweep[0]['budget_slots']:,}-slot budget", fontsize=10)
    add_note(fig, SIMULATED)
    return fig


def budget_sweep_figure(budgets, summaries_by_policy: dict[str, list[dict]]) -> Figure:
    """Requests running at once vs memory budget, one line per policy."""
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.add_subplot()
    for policy, summaries in summaries_by_policy.items():
        ax.plot(
            budgets,
            [s["mean_running"] for s in summaries],
            "o-",
            label=POLICY_NAMES[policy] + (f" ({summaries[0]['page_size']})" if policy.startswith("paged") else ""),
        )
    ax.set_xlabel("memory budget (token slots)")
    ax.set_ylabel("requests running at once\n(mean under pressure)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("How many requests fit in a fixed budget")
    add_note(fig, SIMULATED)
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
    ax2.set_xlabel("step")
    ax2.set_ylabel("requests arrived")
    fig.suptitle(f"{len(workload)} requests, lognormal lengths, Poisson arrivals", fontsize=10)
    add_note(fig, SIMULATED)
    return fig
