"""Notebook 10's figures (reading fewer pages): the merge rule, bytes read with cascade, Quest's bound.

The numbers come from elsewhere (`paged_ref.attention.cascade`, `paged_ref.lab.widgets.reading`, the
JSON of ``python -m paged_ref.lab.bench pages``); each function returns a new ``Figure``.

Example:
    >>> import torch
    >>> fig = merge_figure(torch.tensor([1.0, 3.0, 2.0, 0.5, 2.5]), cut=3)
    >>> len(fig.axes)
    2
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure

from . import add_note

__all__ = ["bound_figure", "bytes_figure", "merge_figure", "quality_figure"]

COLORS = {"full": "0.3", "quest": "tab:green", "paged_eviction": "tab:blue", "streaming_llm": "tab:orange"}


def merge_figure(scores: torch.Tensor, cut: int, *, note: str = "") -> Figure:
    """One query's softmax over ``scores: [n]`` (base 2) computed as two parts, keys ``< cut`` (the
    prefix) and ``>= cut`` (the suffix), then merged with ``2^(lse_part - lse)``."""
    parts = [scores[:cut], scores[cut:]]
    lse = [torch.log2(torch.exp2(p).sum()) for p in parts]  # each part's log-sum-exp, base 2
    total = torch.log2(torch.exp2(scores).sum())
    fig = Figure(figsize=(9, 3.2))
    left, right = fig.subplots(1, 2)
    x = list(range(scores.numel()))
    for i, (p, color) in enumerate(zip(parts, ("tab:purple", "tab:cyan"))):
        xs = x[:cut] if i == 0 else x[cut:]
        own = torch.exp2(p - lse[i])  # the part's own softmax
        left.bar(xs, own.tolist(), color=color, label=f"{'prefix' if i == 0 else 'suffix'}: lse = {float(lse[i]):.2f}")
        right.bar(xs, (own * torch.exp2(lse[i] - total)).tolist(), color=color)
    right.plot(x, torch.exp2(scores - total).tolist(), "k.", label="softmax over all keys")
    left.set_title("each part's own softmax (sums to 1 per part)", fontsize=9)
    right.set_title(f"rescaled by 2^(lse_part - lse), lse = {float(total):.2f}", fontsize=9)
    for ax in (left, right):
        ax.axvline(cut - 0.5, color="0.5", lw=0.8, ls="--")
        ax.set_xlabel("key")
        ax.legend(fontsize=7)
    left.set_ylabel("weight")
    fig.tight_layout()
    if note:
        add_note(fig, note)
    return fig


def bytes_figure(rows: list[dict], *, note: str = "") -> Figure:
    """K/V bytes one decode step and layer reads against the requests sharing the prompt: counted
    (plain reference and sdpa, cascade) and the whole-page formulas."""
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    n = [r["requests"] for r in rows]
    for key, label, style in (
        ("reference", "plain (reference), counted", "o-"),
        ("sdpa", "plain (sdpa), counted", "x"),
        ("cascade", "cascade, counted", "s-"),
    ):
        ax.plot(n, [r["bytes_counted"][key] / 1e6 for r in rows], style, label=label)
    for key, label in (("plain", "formulas (whole pages): n (P + s) and P + n s"), ("cascade", None)):
        ax.plot(n, [r["bytes_formula"][key] / 1e6 for r in rows], "k:", lw=0.8, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests sharing the prompt")
    ax.set_ylabel("MB read per step and layer")
    ax.set_title(f"K/V read: a {rows[0]['prompt']}-token shared prompt, float32, SmolLM2 geometry", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    if note:
        add_note(fig, note)
    return fig


def bound_figure(stats: dict, chosen: torch.Tensor, page_size: int, summary: dict, *, note: str = "") -> Figure:
    """Quest's bound per page against the largest true score there, the pages chosen, and the share of
    the attention weight on each page (``stats`` from `paged_ref.lab.widgets.reading.page_statistics`)."""
    fig = Figure(figsize=(9, 4.2))
    top, bottom = fig.subplots(2, 1, sharex=True)
    pages = list(range(stats["bound"].numel()))
    picked = torch.zeros(len(pages), dtype=torch.bool)
    picked[chosen] = True
    colors = ["tab:green" if p else "0.75" for p in picked.tolist()]
    top.bar(pages, stats["bound"].tolist(), color=colors, label="Quest bound")
    top.plot(pages, stats["max_score"].tolist(), "k_", ms=9, label="largest q.k on the page")
    top.set_ylabel("score (q . k)")
    top.legend(fontsize=7, loc="lower left")
    top.set_title(
        f"{summary['pages_read']} of {summary['pages_held']} pages of {page_size} read (green): "
        f"{summary['attention_mass_read']:.1%} of the attention weight, output error {summary['output_rel_error']:.2e}",
        fontsize=9,
    )
    bottom.bar(pages, stats["mass"].tolist(), color=colors)
    bottom.set_ylabel("attention weight")
    bottom.set_xlabel("page")
    fig.tight_layout()
    if note:
        add_note(fig, note)
    return fig


def quality_figure(results: dict, *, note: str = "") -> Figure:
    """Continuation and retention NLL (95% t intervals) and pass-key accuracy (Wilson) against the
    budget, Quest beside PagedEviction, StreamingLLM and the full cache."""
    fig = Figure(figsize=(11, 3.4))
    axes = fig.subplots(1, 3)
    for ax, task, title in zip(
        axes, ("language_modelling", "retention", "passkey"), ("continuation", "retention", "pass-key")
    ):
        rows = results[task]
        budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
        for policy in ("quest", "paged_eviction", "streaming_llm", "full"):
            rs = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["budget"] or 0)
            if not rs:
                continue
            if task == "passkey":
                y = [r["accuracy"] for r in rs]
                err = [[a - r["ci95"][0] for a, r in zip(y, rs)], [r["ci95"][1] - a for a, r in zip(y, rs)]]
            else:
                y = [r["nll"] for r in rs]
                lo_hi = [r["nll_ci95"] for r in rs]
                err = (
                    None
                    if any(v != v for pair in lo_hi for v in pair)
                    else [[a - lh[0] for a, lh in zip(y, lo_hi)], [lh[1] - a for a, lh in zip(y, lo_hi)]]
                )
            if policy == "full":
                ax.axhline(y[0], color=COLORS[policy], ls="--", lw=1, label="full cache")
                continue
            ax.errorbar([r["budget"] for r in rs], y, yerr=err, fmt="o-", capsize=3, color=COLORS[policy], label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (tokens)")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("accuracy" if task == "passkey" else "mean NLL (nats/token)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    if note:
        add_note(fig, note)
    return fig
