"""Notebook 07's figures (PagedEviction): scores on real K/V, which pages go, and the evaluation.

The numbers come from elsewhere: `paged_ref.lab.eviction_analysis` (scores per layer),
`paged_ref.lab.eviction_replay` (which tokens a policy evicts) and `paged_ref.lab.bench.eviction_report`
(the evaluation's JSON). Every ``*_figure`` function returns a new
``matplotlib.figure.Figure`` and draws nothing it did not receive.

Example:
    >>> import torch
    >>> from paged_ref.lab.eviction_replay import replay
    >>> ks = [torch.randn(64, 2, 8) for _ in range(3)]; vs = [torch.randn(64, 2, 8) for _ in range(3)]
    >>> fig = page_map_figure([replay(ks, vs, "paged_eviction", budget=16, page_size=8, prompt_len=32)])
    >>> len(fig.axes) >= 1
    True
"""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from ..._arith import cdiv
from ..eviction_analysis import ABLATIONS, policy_order
from ..eviction_replay import Replay, layout_stats
from . import add_note

__all__ = [
    "SCORE_LABELS",
    "MAP_POLICIES",
    "policy_label",
    "policy_color",
    "score_distribution_figure",
    "score_positions_figure",
    "correlation_figure",
    "agreement_figure",
    "page_map_figure",
    "fragmentation_figure",
    "perplexity_figure",
    "passkey_figure",
    "cost_figure",
    "ablation_figure",
]

SCORE_LABELS = {
    "value_key_ratio": "||V|| / ||K||  (PagedEviction)",
    "inverse_key_norm": "1 / ||K||",
    "value_norm": "||V||",
    "key_norm": "||K||",
    "key_value_ratio": "||K|| / ||V||  (swapped)",
    "random": "random",
}


#: Policies drawn in the page map (names of `paged_ref.eviction.make_policy`).
MAP_POLICIES = (
    "paged_eviction",
    "paged_eviction_literal",
    "inverse_key_norm",
    "value_norm",
    "random",
    "streaming_llm",
    "token_topk",
)


def policy_color(name: str):
    """One color per policy, the same in every figure (tab20, in `policy_order`)."""
    return matplotlib.colormaps["tab20"](policy_order(name) % 20)


# page-map cell values and colors: 0 never written, 1 kept, 2 evicted at prefill, 3 evicted during decode
_MAP_COLORS = ListedColormap(["white", "tab:blue", "tab:orange", "tab:red"])


def score_distribution_figure(scores: dict, *, note: str = "") -> Figure:
    """Per layer: median, 25-75% and 5-95% bands of ratio, 1/||K|| and ||V||; token 0 marked."""
    methods = [m for m in ("value_key_ratio", "inverse_key_norm", "value_norm") if m in scores]
    fig = Figure(figsize=(12, 3.6), layout="constrained")
    axes = fig.subplots(1, len(methods))
    for ax, m in zip(np.atleast_1d(axes), methods):
        s = scores[m].numpy()  # [L, n]
        layers = np.arange(s.shape[0])
        q = np.quantile(s, [0.05, 0.25, 0.5, 0.75, 0.95], axis=1)
        ax.fill_between(layers, q[0], q[4], color="tab:blue", alpha=0.2, label="5-95%")
        ax.fill_between(layers, q[1], q[3], color="tab:blue", alpha=0.4, label="25-75%")
        ax.plot(layers, q[2], color="tab:blue", label="median")
        ax.plot(layers, s[:, 0], "x", color="tab:red", ms=4, label="token 0")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(SCORE_LABELS[m], fontsize=10)
    np.atleast_1d(axes)[0].legend(fontsize=7)
    add_note(fig, note)
    return fig


def score_positions_figure(
    scores: dict, method: str = "value_key_ratio", *, budget: int | None = None, note: str = ""
) -> Figure:
    """Top: each token's score rank within its layer (layers x positions). Bottom: the layer mean
    (what a shared decision ranks by), with the top-``budget`` threshold."""
    s = scores[method]  # [L, n]
    ranks = torch.argsort(torch.argsort(s, dim=1), dim=1).float() / (s.shape[1] - 1)  # 0 = lowest, 1 = highest
    fig = Figure(figsize=(12, 5), layout="constrained")
    a1, a2 = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.4])
    im = a1.imshow(ranks.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=a1, label="rank in layer (1 = keep first)")
    a1.set_ylabel("layer")
    a1.set_title(f"{SCORE_LABELS[method]}: rank of each token within its layer", fontsize=10)
    shared = s.mean(0).numpy()
    a2.plot(shared, lw=0.7, color="k")
    if budget is not None and budget < shared.shape[0]:
        cut = np.sort(shared)[::-1][budget - 1]
        a2.axhline(cut, color="tab:red", lw=1, label=f"top-{budget} threshold")
        a2.legend(fontsize=7, loc="upper right")
    a2.set_xlabel("token position")
    a2.set_ylabel("mean over layers")
    add_note(fig, note)
    return fig


def correlation_figure(corr: dict, *, note: str = "") -> Figure:
    """Spearman correlation per layer between the three scores (and for the layer mean)."""
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.subplots()
    for a, b in [key for key in corr if len(key) == 2]:  # the pairs `score_correlations` computed
        (line,) = ax.plot(corr[(a, b)], marker=".", label=f"{SCORE_LABELS[a].split('  ')[0]} vs {SCORE_LABELS[b]}")
        ax.axhline(corr[(a, b, "shared")], color=line.get_color(), ls=":", lw=1)
    ax.axhline(0, color="0.5", lw=0.6)
    ax.set_ylim(-1.05, 1.05)
    ax.set_xlabel("layer")
    ax.set_ylabel("Spearman rank correlation")
    ax.set_title("How much do the scores agree? (dotted: the layer-averaged scores a policy ranks by)", fontsize=10)
    ax.legend(fontsize=8)
    add_note(fig, note)
    return fig


def agreement_figure(agree: dict, budget: int, *, note: str = "") -> Figure:
    """Left: overlap of the layers' own top-C sets. Right: each layer against the shared decision."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    a1, a2 = fig.subplots(1, 2, width_ratios=[1, 1.4])
    im = a1.imshow(agree["pairwise"], vmin=0, vmax=1, cmap="magma")
    fig.colorbar(im, ax=a1, label="Jaccard overlap")
    a1.set_xlabel("layer")
    a1.set_ylabel("layer")
    a1.set_title(f"top-{budget} tokens: layer vs layer", fontsize=10)
    layers = np.arange(len(agree["vs_shared"]))
    a2.bar(layers, agree["vs_shared"], color="tab:blue", label="overlap with the shared top-C")
    a2.plot(
        layers,
        agree["weight"] * len(layers),
        "o-",
        color="tab:red",
        ms=3,
        label="layer's weight in the mean x num_layers (1 = equal)",
    )
    a2.set_xlabel("layer")
    a2.set_title("each layer's own choice vs the one shared decision", fontsize=10)
    a2.legend(fontsize=7)
    add_note(fig, note)
    return fig


def _page_grid(r: Replay) -> np.ndarray:
    """[pages, B] cell codes over original positions (see _MAP_COLORS)."""
    n = r.evicted_at.shape[0]
    cells = np.zeros(cdiv(n, r.page_size) * r.page_size, dtype=int)
    ev = r.evicted_at.numpy()
    cells[:n] = np.where(ev < 0, 1, np.where(ev == 0, 2, 3))
    return cells.reshape(-1, r.page_size)


def policy_label(r: Replay) -> str:
    """A short name for a replayed policy (the ablations read 'page eviction (<score>)')."""
    name = r.policy.name
    if name == "paged_eviction":
        short = {
            "inverse_key_norm": "1/||K||",
            "value_norm": "||V||",
            "key_norm": "||K||",
            "key_value_ratio": "||K||/||V||",
            "random": "random",
        }
        literal = not r.policy.reserved.first_pages  # the paper's text: page 0 not reserved
        if r.policy.method == "value_key_ratio":
            name = "paged_eviction_literal" if literal else "paged_eviction"
        else:
            name = f"page eviction ({short[r.policy.method]})" + (", literal" if literal else "")
    elif name == "token_topk":
        name = "token_topk (ratio)"
    return name + (", per layer" if r.policy.decision == "per_layer" else "")


def page_map_figure(replays: list[Replay], *, note: str = "") -> Figure:
    """Which tokens each policy kept, drawn over the original pages (row = B consecutive tokens).

    Blue kept, orange evicted at prefill (token level, before pages form), red evicted during
    decode. The dashed line is the end of the prompt. Page eviction removes whole red rows;
    token-level eviction leaves red cells scattered inside rows it cannot free.
    """
    fig = Figure(figsize=(2.1 * len(replays) + 1, 7), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(replays), sharey=True))
    for ax, r in zip(axes, replays):
        grid = _page_grid(r)
        ax.imshow(grid, aspect="auto", cmap=_MAP_COLORS, vmin=0, vmax=3, interpolation="nearest")
        ax.axhline(r.prompt_len / r.page_size - 0.5, color="k", ls="--", lw=1)
        ax.set_title(
            f"{policy_label(r)}\n{int(r.kept.sum())} kept, {r.stats.pages_dropped} pages dropped,\n"
            f"{r.stats.tokens_moved} tokens copied",
            fontsize=8,
        )
        ax.set_xticks([0, r.page_size - 1])
        ax.set_xlabel("offset in page")
    axes[0].set_ylabel(f"original page (B = {replays[0].page_size} tokens)")
    from matplotlib.patches import Patch

    fig.legend(
        handles=[
            Patch(color=c, label=lab)
            for c, lab in zip(_MAP_COLORS.colors[1:], ("kept", "evicted at prefill", "evicted during decode"))
        ],
        loc="outside right upper",
        fontsize=8,
    )
    fig.suptitle(
        f"Which tokens go: C = {replays[0].budget}, prompt {replays[0].prompt_len} tokens, "
        f"then {replays[0].evicted_at.shape[0] - replays[0].prompt_len} decoded",
        fontsize=10,
    )
    add_note(fig, note)
    return fig


def fragmentation_figure(replays: list[Replay], *, note: str = "") -> Figure:
    """Decode phase: pages the survivors occupy if nothing moves, vs dense pages; tokens copied."""
    labels = [policy_label(r) for r in replays]
    lay = [layout_stats(r.kept, r.page_size, r.prompt_len) for r in replays]
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    x = np.arange(len(replays))
    a1.bar(x - 0.2, [s["dense_pages"] for s in lay], 0.4, label="dense: ceil(kept / B)")
    a1.bar(x + 0.2, [s["pages_held"] for s in lay], 0.4, label="held if no token moves")
    a1.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    a1.set_ylabel("pages")
    a1.set_title("decode-phase tokens: pages needed without copying", fontsize=10)
    a1.legend(fontsize=8)
    a2.bar(x, [r.stats.tokens_moved for r in replays], color="tab:purple")
    a2.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    a2.set_ylabel("tokens copied (K and V, every layer)")
    a2.set_title("copies made by compaction (prefill + decode)", fontsize=10)
    add_note(fig, note)
    return fig


def perplexity_figure(results: dict, task: str = "language_modelling", policies=None, *, note: str = "") -> Figure:
    """Perplexity vs budget C with the 95% interval over texts, one panel per page size B (from the JSON).

    ``task``: ``"language_modelling"`` (the continuation), ``"long_context"`` (the same after a
    longer context) or ``"retention"`` (the passage's repeated part). ``policies``: the policies
    drawn (default: every one but the score ablations, which `ablation_figure` compares).
    """
    summary = results[task]
    sizes = sorted({r["page_size"] for r in summary})
    fig = Figure(figsize=(max(6 * len(sizes), 11), 4.2), layout="constrained")  # room for the note
    axes = np.atleast_1d(fig.subplots(1, len(sizes), sharey=True))
    if policies is None:
        policies = {r["policy"] for r in summary} - set(ABLATIONS) - {"random"}
    policies = sorted(set(policies) - {"full"}, key=policy_order)
    for ax, ps in zip(axes, sizes):
        rows = [r for r in summary if r["page_size"] == ps]
        full = [r for r in rows if r["policy"] == "full"]
        if full:
            ax.axhline(full[0]["ppl"], color="k", ls="--", lw=1, label="full cache")
        for j, name in enumerate(policies):
            pts = sorted((r["budget"], r["ppl"], r.get("ppl_ci95")) for r in rows if r["policy"] == name)
            if not pts:
                continue
            x = [c * 2 ** (0.03 * (j - len(policies) / 2)) for c, _, _ in pts]  # dodge the error bars
            y = [p for _, p, _ in pts]
            err = None
            if all(ci is not None and not math.isnan(ci[0]) for _, _, ci in pts):
                err = [[p - ci[0] for _, p, ci in pts], [ci[1] - p for _, p, ci in pts]]
            lw = 2.5 if name == "paged_eviction" else 1.2
            ax.errorbar(x, y, yerr=err, marker="o", ms=3, lw=lw, capsize=2, label=name, color=policy_color(name))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("budget C (tokens)")
        ax.set_title(f"page size B = {ps}", fontsize=10)
    what = {
        "language_modelling": "the continuation",
        "long_context": f"the continuation after {results.get('config', {}).get('long_context', '?')} tokens",
        "retention": "the passage's repeated part (retention)",
    }[task]
    axes[0].set_ylabel(f"perplexity of {what}\n(mean over texts, 95% t interval)")
    axes[-1].legend(fontsize=7)
    add_note(fig, note)
    return fig


def passkey_figure(results: dict, *, note: str = "") -> Figure:
    """Pass-key accuracy with Wilson 95% intervals, one panel per budget, one row per policy; and
    the share of trials whose key was held, as a table of numbers (policy x budget).

    One row per policy, named on the axis (not a legend of a dozen pale colors), so every policy
    can be read at every budget.
    """
    summary = results["passkey"]
    budgets = sorted({r["budget"] for r in summary if r["budget"] is not None})
    policies = sorted({r["policy"] for r in summary} - {"full"}, key=policy_order)
    full = next((r for r in summary if r["policy"] == "full"), None)
    cell = {(r["policy"], r["budget"]): r for r in summary}
    fig = Figure(figsize=(13, 0.3 * len(policies) + 2.2), layout="constrained")
    axes = fig.subplots(1, len(budgets) + 1, sharey=True, width_ratios=[1] * len(budgets) + [1.3])
    rows = np.arange(len(policies))
    for ax, c in zip(axes, budgets):
        if full is not None:
            ax.axvline(full["accuracy"], color="k", ls="--", lw=1, label="full cache")
        for y, name in zip(rows, policies):
            r = cell.get((name, c))
            if r is None:
                continue
            ax.errorbar(
                r["accuracy"],
                y,
                xerr=[[r["accuracy"] - r["ci95"][0]], [r["ci95"][1] - r["accuracy"]]],
                fmt="o",
                color=policy_color(name),
                ecolor="0.4",
                capsize=2,
                ms=5,
            )
        ax.set_xlim(-0.05, 1.05)
        ax.set_title(f"C = {c}", fontsize=9)
        ax.set_xlabel("accuracy")
        ax.grid(axis="x", color="0.9")
    axes[0].set_yticks(rows, policies, fontsize=8)
    axes[0].invert_yaxis()
    held = np.array([[cell[(p, c)]["key_held_rate"] if (p, c) in cell else np.nan for c in budgets] for p in policies])
    last = axes[-1]
    last.imshow(held, cmap="Greens", vmin=0, vmax=1, aspect="auto")
    for (i, j), v in np.ndenumerate(held):
        if not np.isnan(v):
            last.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v > 0.6 else "black")
    last.set_xticks(range(len(budgets)), [f"C={c}" for c in budgets], fontsize=8)
    last.set_title("key's tokens held when the answer starts", fontsize=9)
    n = full["trials"] if full else "?"
    extra = f"; dashed: the full cache, {full['accuracy']:.2f}" if full else ""
    fig.suptitle(f"pass-key accuracy ({n} trials per point, Wilson 95%){extra}", fontsize=10)
    add_note(fig, note)
    return fig


_ABLATION_LABELS = {
    "value_norm": "||V||\n(value_norm)",
    "inverse_key_norm": "1/||K||\n(inverse_key_norm)",
    "key_norm": "||K||\n(key_norm)",
    "key_value_ratio": "||K||/||V||\n(key_value_ratio)",
    "random": "random",
}


def ablation_figure(results: dict, rows: list[dict], reference: str = "paged_eviction", *, note: str = "") -> Figure:
    """Left: NLL difference (ablation - ratio) per cell, per ablation. Right: paired pass-key accuracies."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    lm = {(r["policy"], r["text"], r["page_size"], r["budget"]): r["nll"] for r in results.get("lm_rows", [])}
    for i, r in enumerate(rows):
        d = [
            lm[(r["ablation"],) + k[1:]] - v
            for k, v in lm.items()
            if k[0] == reference and (r["ablation"],) + k[1:] in lm
        ]
        if not d:
            continue
        a1.plot(np.full(len(d), i) + np.linspace(-0.2, 0.2, len(d)), d, "o", ms=4, alpha=0.6)
        if not math.isnan(r["lm_ci95"][0]):
            a1.errorbar(
                i,
                r["lm_mean_diff"],
                yerr=[[r["lm_mean_diff"] - r["lm_ci95"][0]], [r["lm_ci95"][1] - r["lm_mean_diff"]]],
                fmt="s",
                color="k",
                capsize=4,
            )
    a1.axhline(0, color="k", lw=0.8)
    a1.set_xticks(range(len(rows)), [_ABLATION_LABELS.get(r["ablation"], r["ablation"]) for r in rows], fontsize=8)
    a1.set_ylabel("NLL(ablation) - NLL(ratio), nats/token")
    a1.set_title(
        "language modelling: > 0 means the ratio is better\n(dots: (text, B, C) cells; black: mean, 95% t CI)",
        fontsize=9,
    )
    x = np.arange(len(rows))
    have = [r for r in rows if r.get("passkey_trials")]
    if have:
        for off, key, label in ((-0.2, "passkey_ratio", "ratio"), (0.2, "passkey_ablation", "ablation")):
            acc = [r[key][0] / r[key][1] for r in have]
            ci = [r[key + "_ci95"] for r in have]
            a2.bar(
                x[: len(have)] + off,
                acc,
                0.4,
                yerr=[[a - c[0] for a, c in zip(acc, ci)], [c[1] - a for a, c in zip(acc, ci)]],
                capsize=3,
                label=label,
            )
        a2.set_xticks(x[: len(have)], [_ABLATION_LABELS.get(r["ablation"], r["ablation"]) for r in have], fontsize=8)
        a2.set_ylim(0, 1.05)
        a2.legend(fontsize=8)
    a2.set_title("pass-key accuracy, same trials, pooled over budgets (Wilson 95%)", fontsize=9)
    add_note(fig, note)
    return fig


def cost_figure(results: dict, *, note: str = "") -> Figure:
    """Left: KV bytes held per budget (smallest page size). Right: decode tokens/s relative to the
    full cache of the same context and batch, median and min-max over the measured rounds."""
    lm, speed = results["language_modelling"], results["speed"]
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    ps = min(r["page_size"] for r in lm)
    full = next(r for r in lm if r["policy"] == "full" and r["page_size"] == ps)
    budgets = sorted({r["budget"] for r in lm if r["budget"] is not None})
    for name in ("paged_eviction", "token_topk"):
        pts = sorted(
            (r["budget"], r["kv_bytes_held"] / 2**20) for r in lm if r["policy"] == name and r["page_size"] == ps
        )
        if pts:
            a1.plot(
                *zip(*pts), marker="o", label=name + (" (and every page policy)" if name == "paged_eviction" else "")
            )
    a1.axhline(
        full["kv_bytes_held"] / 2**20,
        color="k",
        ls="--",
        lw=1,
        label=f"full cache ({full['kv_bytes_held'] / 2**20:.1f} MiB)",
    )
    a1.set_xscale("log", base=2)
    a1.set_xticks(budgets, [str(c) for c in budgets])
    a1.set_xlabel("budget C")
    a1.set_ylabel("KV MiB held after the continuation")
    a1.set_title(f"KV bytes held, B = {ps} (pages held x page bytes)", fontsize=10)
    a1.legend(fontsize=8)
    groups = sorted({(r.get("context", 0), r.get("batch", 1)) for r in speed})
    names = sorted({r["policy"] for r in speed}, key=policy_order)
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs, ratios, lo, hi = [], [], [], []
        for g, key in enumerate(groups):
            r = next(
                (r for r in speed if (r.get("context", 0), r.get("batch", 1)) == key and r["policy"] == name), None
            )
            if r is None:
                continue
            full_tps = r["tokens_per_s"] / r["ratio_vs_full"]  # the full cache's median in the same group
            xs.append(g + (j - len(names) / 2 + 0.5) * width)
            ratios.append(r["ratio_vs_full"])
            lo.append(max(0.0, r["ratio_vs_full"] - min(r["tokens_per_s_rounds"]) / full_tps))
            hi.append(max(0.0, max(r["tokens_per_s_rounds"]) / full_tps - r["ratio_vs_full"]))
        color = "k" if name == "full" else policy_color(name)
        a2.bar(xs, ratios, width, yerr=[lo, hi], capsize=2, label=name, color=color)
    a2.set_xticks(range(len(groups)), [f"context {c}\nbatch {b}" for c, b in groups])
    a2.axhline(1, color="k", lw=1)
    a2.set_ylabel("decode tokens/s / full cache's median")
    a2.set_title(
        f"decode speed, C = {speed[-1]['budget']}, B = 16\n"
        f"(median and min-max of {len(speed[0]['tokens_per_s_rounds'])} interleaved rounds)",
        fontsize=10,
    )
    a2.legend(fontsize=7)
    add_note(fig, note)
    return fig
