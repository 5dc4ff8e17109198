"""The eviction evaluation's numbers (`python -m paged_ref.bench eviction`), read from its JSON.

`load_results` reads the JSON, `provenance` says where it was measured, the ``*_table``
functions format exact numbers, and `ablation` compares the ratio with each ablated score
(paired; each verdict computed from a confidence interval or a test, never typed in).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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
    "ablation",
    "ablation_table",
]


#: The reviewers' ablation: the ratio against V only, K only (inverse norm), its opposite and random.
ABLATIONS = ("value_norm", "inverse_key_norm", "key_norm", "random")


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
    """One line: how and where the numbers were measured (mode, model, hardware, versions, date)."""
    env = results.get("environment", {})
    hw = env.get("gpu") or f"CPU ({env.get('cpu', '?')}, {env.get('torch_threads', '?')} torch thread(s))"
    return (
        f"{results.get('mode', '?')} run of `python -m paged_ref.bench eviction`: {results.get('model', '?')} "
        f"on {hw}, {env.get('platform', '?')}; Python {env.get('python', '?')}, torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}; {env.get('date_utc', '?')}; "
        f"{results.get('seconds', '?')} s"
    )


def policy_order(policy: str) -> int:
    known = ["full", "paged_eviction", "paged_eviction_first_page", *ABLATIONS, "streaming_llm", "token_topk"]
    return known.index(policy) if policy in known else len(known)


def lm_table(results: dict) -> str:
    """The language-modelling summary (mean over texts), one row per (B, C, policy), exact numbers."""
    rows = sorted(
        results["language_modelling"], key=lambda r: (r["page_size"], r["budget"] or 0, policy_order(r["policy"]))
    )
    return format_table(
        ["B", "C", "policy", "NLL", "PPL", "KL vs full", "max pages", "bound", "tokens moved"],
        [
            [
                r["page_size"],
                r["budget"] or "-",
                r["policy"],
                f"{r['nll']:.4f}",
                f"{r['ppl']:.3f}",
                f"{r['kl_vs_full']:.4f}",
                r["max_pages_held"],
                r["page_bound"] or "-",
                r["tokens_moved"],
            ]
            for r in rows
        ],
    )


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
    """Decode tokens/s per policy (one sequence, CPU): median and min-max over the rounds, the
    ratio of medians to the full cache, and the KV bytes held."""
    return format_table(
        ["policy", "C", "tokens/s", "min-max over rounds", "vs full", "KV MiB held"],
        [
            [
                r["policy"],
                r["budget"] or "-",
                f"{r['tokens_per_s']:.2f}",
                f"{min(r['tokens_per_s_rounds']):.2f}-{max(r['tokens_per_s_rounds']):.2f}",
                f"{r['ratio_vs_full']:.3f}",
                f"{r['kv_bytes_held'] / 2**20:.2f}",
            ]
            for r in results.get("speed", [])
        ],
    )


def lm_pairs(results: dict, a: str, b: str) -> list[dict]:
    """Language-modelling summary rows of policies ``a`` and ``b`` side by side, per (B, C) both ran.

    Returns:
        ``[{"page_size", "budget", "nll_a", "nll_b", "ppl_a", "ppl_b"}]`` sorted by (B, C).
    """
    rows = {(r["policy"], r["page_size"], r["budget"]): r for r in results["language_modelling"]}
    out = []
    for (p, ps, c), ra in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2] or 0)):
        rb = rows.get((b, ps, c))
        if p == a and rb is not None:
            out.append(dict(page_size=ps, budget=c, nll_a=ra["nll"], nll_b=rb["nll"], ppl_a=ra["ppl"], ppl_b=rb["ppl"]))
    return out


def ablation(results: dict, reference: str = "paged_eviction", ablations=ABLATIONS) -> list[dict]:
    """The reviewers' ablation, computed from the per-text and per-trial rows of the JSON.

    Language modelling: for each ablated score, the paired difference of NLL per token
    (ablation - ratio; > 0 means the ratio predicts the text better) over every (text, B, C)
    cell both ran, its mean and 95% t interval. The cells share texts, so the interval is
    descriptive rather than a test over independent samples.

    Pass-key: the same trials run under every policy, so the comparison is paired: ``b`` trials
    only the ratio answered, ``c`` only the ablation; exact McNemar p-value; and each one's
    accuracy with a Wilson 95% interval, pooled over budgets.

    Returns:
        one dict per ablation with the numbers and three verdicts, ``lm_verdict`` and
        ``passkey_verdict``: ``"ratio better"`` / ``"ratio worse"`` when the interval excludes
        no difference (LM: the t interval of the mean difference; pass-key: the two Wilson
        intervals do not overlap), else ``"not resolved"``; and ``passkey_paired_verdict``, the
        same from the paired McNemar test at the 5% level (more sensitive than two separate
        intervals; pooled budgets reuse the same prompts, so the trials are not independent).
    """
    out = []
    lm = {(r["policy"], r["text"], r["page_size"], r["budget"]): r["nll"] for r in results.get("lm_rows", [])}
    pk = {(r["policy"], r["trial"], r["budget"]): bool(r["correct"]) for r in results.get("passkey_rows", [])}
    for abl in ablations:
        diffs = [
            lm[(abl,) + key[1:]] - nll for key, nll in lm.items() if key[0] == reference and (abl,) + key[1:] in lm
        ]
        row = dict(ablation=abl, lm_cells=len(diffs))
        if diffs:
            mean, lo, hi = mean_ci(diffs)
            row.update(
                lm_mean_diff=mean,
                lm_ci95=[lo, hi],
                lm_ratio_wins=sum(d > 0 for d in diffs),
                lm_verdict="ratio better" if lo > 0 else "ratio worse" if hi < 0 else "not resolved",
            )
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


def ablation_table(rows: list[dict]) -> str:
    """`ablation` output as text: every number the verdicts rest on."""
    lines = []
    for r in rows:
        ci = ""
        if r.get("lm_cells"):
            lo, hi = r["lm_ci95"]
            ci = "no interval from 1 cell" if math.isnan(lo) else f"95% CI [{lo:+.4f}, {hi:+.4f}]"
        lm = (
            f"mean dNLL {r['lm_mean_diff']:+.4f} nats/token, {ci}, "
            f"ratio lower NLL in {r['lm_ratio_wins']}/{r['lm_cells']} cells -> {r['lm_verdict']}"
            if r.get("lm_cells")
            else "no language-modelling cells"
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
        lines.append(f"ratio vs {r['ablation']}:\n  language modelling: {lm}\n  pass-key: {pk}")
    return "\n".join(lines)
