"""The eviction evaluation's numbers (`python -m paged_ref.bench eviction`), read from its JSON.

`load_results` reads the JSON, `provenance` says where it was measured, the ``*_table``
functions format exact numbers, and `ablation` compares the ratio with each ablated score
(paired; each verdict computed from a confidence interval or a test, never typed in).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..eviction.policies import ABLATIONS, policy_order
from ..provenance import describe
from ..stats import mcnemar_p, mean_ci, wilson
from ..texttable import format_table

__all__ = [
    "ABLATIONS",
    "load_results",
    "provenance",
    "policy_order",
    "lm_table",
    "passkey_table",
    "speed_table",
    "lm_pairs",
    "paired_nll",
    "ablation",
    "ablation_table",
]


#: The tasks whose summaries are NLL tables: key in the JSON -> its per-text rows.
NLL_TASKS = {"language_modelling": "lm_rows", "long_context": "long_context_rows", "retention": "retention_rows"}


def load_results(data_dir=None):
    """The evaluation's results: ``eviction_full.json`` if present, else ``eviction_quick.json``.

    Args:
        data_dir: folder to look in (default: ``figures/data/`` of the repository).

    Returns:
        ``(file name, dict)``, or ``(None, None)`` when neither file exists.
    """
    from ..runmode import figures_dir

    folder = Path(data_dir) if data_dir is not None else figures_dir() / "data"
    for name in ("eviction_full.json", "eviction_quick.json"):
        path = folder / name
        if path.exists():
            return name, json.loads(path.read_text())
    return None, None


def provenance(results: dict) -> str:
    """One line: which run it was (mode, model, seconds), then where, with what and when it ran."""
    run = f"{results.get('mode', '?')} run of `python -m paged_ref.bench eviction`, {results.get('model', '?')}"
    where = describe({k: v for k, v in results.items() if k != "mode"})
    return f"{run}, {results.get('seconds', '?')} s. {where}"


def lm_table(results: dict, task: str = "language_modelling") -> str:
    """An NLL task's summary (mean over texts), one row per (B, C, policy), exact numbers.

    ``task``: ``"language_modelling"``, ``"long_context"`` or ``"retention"``. The 95% interval is the t interval of
    the mean NLL over texts, and the perplexity interval its ends exponentiated.
    """
    rows = sorted(results[task], key=lambda r: (r["page_size"], r["budget"] or 0, policy_order(r["policy"])))
    return format_table(
        [
            "B",
            "C",
            "policy",
            "texts",
            "NLL",
            "NLL 95% CI",
            "PPL",
            "PPL 95% CI",
            "KL vs full",
            "max pages",
            "bound",
            "moved",
        ],
        [
            [
                r["page_size"],
                r["budget"] or "-",
                r["policy"],
                r.get("texts", "-"),
                f"{r['nll']:.4f}",
                _interval(r.get("nll_ci95"), 4),
                f"{r['ppl']:.3f}",
                _interval(r.get("ppl_ci95"), 3),
                f"{r['kl_vs_full']:.4f}",
                r["max_pages_held"],
                r["page_bound"] or "-",
                f"{r['tokens_moved']:.0f}",
            ]
            for r in rows
        ],
    )


def _interval(ci, digits: int) -> str:
    if ci is None or any(x is None or math.isnan(x) for x in ci):
        return "-"
    return f"{ci[0]:.{digits}f}-{ci[1]:.{digits}f}"


def passkey_table(results: dict) -> str:
    """Pass-key accuracy with its Wilson 95% interval, and what of the key was held.

    Columns: a whole mention held ("key held") and the correct answers with/without it; every
    digit held in some mention ("readable") and the correct answers without it; the mean share
    of the needle sentence's tokens held; and the answers that contain a number at all (right
    or wrong: the model attempted a retrieval rather than describing what a pass key is).
    """
    rows = sorted(results["passkey"], key=lambda r: (r["budget"] or 0, policy_order(r["policy"])))
    return format_table(
        [
            "C",
            "policy",
            "correct",
            "accuracy",
            "Wilson 95%",
            "key held",
            "correct|held",
            "correct|lost",
            "readable",
            "correct|unreadable",
            "needle held",
            "a number",
        ],
        [
            [
                r["budget"] or "-",
                r["policy"],
                f"{r['correct']}/{r['trials']}",
                f"{r['accuracy']:.3f}",
                f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
                f"{r['key_held']}/{r['trials']}",
                r["correct_when_held"],
                r["correct_when_lost"],
                f"{r['key_readable']}/{r['trials']}",
                r["correct_when_unreadable"],
                f"{r['needle_held_mean']:.2f}",
                f"{r['answered_number']}/{r['trials']}",
            ]
            for r in rows
        ],
    )


def speed_table(results: dict) -> str:
    """Decode speed per policy, context and batch (CPU): time per output token and tokens/s
    (median over the rounds, min-max of tokens/s), both as ratios to the full cache of the same
    context and batch, and the KV bytes one sequence holds."""
    return format_table(
        [
            "context",
            "batch",
            "policy",
            "C",
            "ms/token",
            "vs full",
            "tokens/s",
            "min-max over rounds",
            "vs full",
            "KV MiB",
        ],
        [
            [
                r.get("context", "-"),
                r.get("batch", 1),
                r["policy"],
                r["budget"] or "-",
                f"{r['ms_per_token']:.1f}" if "ms_per_token" in r else "-",
                f"{r['time_per_token_vs_full']:.3f}" if "time_per_token_vs_full" in r else "-",
                f"{r['tokens_per_s']:.2f}",
                f"{min(r['tokens_per_s_rounds']):.2f}-{max(r['tokens_per_s_rounds']):.2f}",
                f"{r['ratio_vs_full']:.3f}",
                f"{r['kv_bytes_held'] / 2**20:.2f}",
            ]
            for r in results.get("speed", [])
        ],
    )


def lm_pairs(results: dict, a: str, b: str, task: str = "language_modelling") -> list[dict]:
    """An NLL task's summary rows of policies ``a`` and ``b`` side by side, per (B, C) both ran.

    Returns:
        ``[{"page_size", "budget", "nll_a", "nll_b", "ppl_a", "ppl_b"}]`` sorted by (B, C).
    """
    rows = {(r["policy"], r["page_size"], r["budget"]): r for r in results.get(task, [])}
    out = []
    for (p, ps, c), ra in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2] or 0)):
        rb = rows.get((b, ps, c))
        if p == a and rb is not None:
            out.append(dict(page_size=ps, budget=c, nll_a=ra["nll"], nll_b=rb["nll"], ppl_a=ra["ppl"], ppl_b=rb["ppl"]))
    return out


def ablation(results: dict, reference: str = "paged_eviction", ablations=ABLATIONS) -> list[dict]:
    """The reviewers' ablation, computed from the per-text and per-trial rows of the JSON.

    Language modelling and retention (keys ``lm_*`` and ``retention_*``): for each ablated score,
    the paired difference of NLL per token (ablation - ratio; > 0 means the ratio predicts the
    text better) over every (text, B, C) cell both ran, its mean and 95% t interval. The cells
    share texts, so the interval is descriptive rather than a test over independent samples.

    Pass-key: the same trials run under every policy, so the comparison is paired: ``b`` trials
    only the ratio answered, ``c`` only the ablation; exact McNemar p-value; and each one's
    accuracy with a Wilson 95% interval, pooled over budgets.

    Returns:
        one dict per ablation with the numbers and four verdicts, ``lm_verdict``,
        ``retention_verdict`` and ``passkey_verdict``: ``"ratio better"`` / ``"ratio worse"``
        when the interval excludes no difference (NLL: the t interval of the mean difference; pass-key: the two Wilson
        intervals do not overlap), else ``"not resolved"``; and ``passkey_paired_verdict``, the
        same from the paired McNemar test at the 5% level (more sensitive than two separate
        intervals; pooled budgets reuse the same prompts, so the trials are not independent).
    """
    out = []
    pk = {(r["policy"], r["trial"], r["budget"]): bool(r["correct"]) for r in results.get("passkey_rows", [])}
    for abl in ablations:
        row = dict(ablation=abl)
        for prefix, key in (("lm", "lm_rows"), ("retention", "retention_rows")):
            row.update(paired_nll(results.get(key, []), reference, abl, prefix))
        pairs = [(ok, pk[(abl,) + key[1:]]) for key, ok in pk.items() if key[0] == reference and (abl,) + key[1:] in pk]
        row["passkey_trials"] = len(pairs)
        if pairs:
            b = sum(r and not a for r, a in pairs)
            c = sum(a and not r for r, a in pairs)
            kr, ka, n = sum(r for r, _ in pairs), sum(a for _, a in pairs), len(pairs)
            ci_r, ci_a = wilson(kr, n), wilson(ka, n)
            row.update(
                passkey_ratio=[kr, n],
                passkey_ablation=[ka, n],
                passkey_ratio_ci95=list(ci_r),
                passkey_ablation_ci95=list(ci_a),
                passkey_only_ratio=b,
                passkey_only_ablation=c,
                passkey_mcnemar_p=mcnemar_p(b, c),
                passkey_verdict="ratio better"
                if ci_r[0] > ci_a[1]
                else "ratio worse"
                if ci_r[1] < ci_a[0]
                else "not resolved",
            )
            p = row["passkey_mcnemar_p"]
            row["passkey_paired_verdict"] = (
                "ratio better" if p < 0.05 and b > c else "ratio worse" if p < 0.05 and c > b else "not resolved"
            )
        out.append(row)
    return out


def paired_nll(rows: list[dict], reference: str, other: str, prefix: str) -> dict:
    """NLL of ``other`` minus ``reference`` per (text, B, C) cell both ran: mean, t interval, verdict.

    ``rows``: per-text rows of the JSON (e.g. ``results["lm_rows"]``, or those of one budget).
    Returns ``{prefix}_cells``, and when there are any ``{prefix}_mean_diff``, ``{prefix}_ci95``
    (95% t interval), ``{prefix}_ratio_wins`` (cells where ``reference`` has the lower NLL) and
    ``{prefix}_verdict``: ``"ratio better"`` (``reference`` lower, interval above 0), ``"ratio
    worse"`` or ``"not resolved"``.
    """
    nll = {(r["policy"], r["text"], r["page_size"], r["budget"]): r["nll"] for r in rows}
    diffs = [nll[(other,) + k[1:]] - v for k, v in nll.items() if k[0] == reference and (other,) + k[1:] in nll]
    out = {f"{prefix}_cells": len(diffs)}
    if diffs:
        mean, lo, hi = mean_ci(diffs)
        out.update(
            {
                f"{prefix}_mean_diff": mean,
                f"{prefix}_ci95": [lo, hi],
                f"{prefix}_ratio_wins": sum(d > 0 for d in diffs),
                f"{prefix}_verdict": "ratio better" if lo > 0 else "ratio worse" if hi < 0 else "not resolved",
            }
        )
    return out


def ablation_table(rows: list[dict]) -> str:
    """`ablation` output as text: every number the verdicts rest on."""
    lines = []
    for r in rows:
        nll = {}
        for prefix in ("lm", "retention"):
            if not r.get(f"{prefix}_cells"):
                nll[prefix] = "no cells"
                continue
            lo, hi = r[f"{prefix}_ci95"]
            ci = "no interval from 1 cell" if math.isnan(lo) else f"95% CI [{lo:+.4f}, {hi:+.4f}]"
            nll[prefix] = (
                f"mean dNLL {r[f'{prefix}_mean_diff']:+.4f} nats/token, {ci}, ratio lower NLL in "
                f"{r[f'{prefix}_ratio_wins']}/{r[f'{prefix}_cells']} cells -> {r[f'{prefix}_verdict']}"
            )
        pk = (
            f"ratio {r['passkey_ratio'][0]}/{r['passkey_ratio'][1]} "
            f"[{r['passkey_ratio_ci95'][0]:.3f}, {r['passkey_ratio_ci95'][1]:.3f}] vs "
            f"{r['passkey_ablation'][0]}/{r['passkey_ablation'][1]} "
            f"[{r['passkey_ablation_ci95'][0]:.3f}, {r['passkey_ablation_ci95'][1]:.3f}]; only ratio right "
            f"{r['passkey_only_ratio']}, only ablation right {r['passkey_only_ablation']}, McNemar p = "
            f"{r['passkey_mcnemar_p']:.2g} -> {r['passkey_verdict']} (Wilson intervals), "
            f"{r['passkey_paired_verdict']} (paired)"
            if r.get("passkey_trials")
            else "no pass-key trials"
        )
        lines.append(
            f"ratio vs {r['ablation']}:\n  language modelling: {nll['lm']}\n  retention: {nll['retention']}\n"
            f"  pass-key: {pk}"
        )
    return "\n".join(lines)
