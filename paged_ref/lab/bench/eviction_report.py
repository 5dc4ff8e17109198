"""The eviction benchmark's numbers (`python -m paged_ref.lab.bench eviction`), read from its JSON.

`load_results` reads the JSON, `provenance` says where it was measured, the ``*_table``
functions format exact numbers, and `ablation` compares the ratio with each ablated score
(paired; each verdict computed from a confidence interval or a test, never typed in).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..eviction_analysis import ABLATIONS, policy_order
from ..provenance import describe
from ..runmode import figures_dir
from ..stats import mcnemar_p, mean_ci, wilson
from .common import table

__all__ = ["ABLATIONS", "load_results", "provenance", "policy_order", "lm_table", "passkey_table", "speed_table"]
__all__ += ["lm_pairs", "paired_nll", "ablation", "ablation_table"]

# the printed tables: (header, format of a JSON summary row); C and bound print None as "-"
LM_COLUMNS = [
    ("B", "{page_size}"),
    ("C", "{C}"),
    ("policy", "{policy}"),
    ("texts", "{texts}"),
    ("NLL", "{nll:.4f}"),
    ("NLL 95% CI", "{nll_ci}"),
    ("PPL", "{ppl:.3f}"),
    ("PPL 95% CI", "{ppl_ci}"),
    ("KL vs full", "{kl_vs_full:.4f}"),
    ("max pages", "{max_pages_held}"),
    ("bound", "{bound}"),
    ("moved", "{tokens_moved:.0f}"),
]
PASSKEY_COLUMNS = [
    ("C", "{C}"),
    ("policy", "{policy}"),
    ("correct", "{correct}/{trials}"),
    ("accuracy", "{accuracy:.3f}"),
    ("Wilson 95%", "[{ci95[0]:.3f}, {ci95[1]:.3f}]"),
    ("key held", "{key_held}/{trials}"),
    ("correct|held", "{correct_when_held}"),
    ("correct|lost", "{correct_when_lost}"),
    ("readable", "{key_readable}/{trials}"),
    ("correct|unreadable", "{correct_when_unreadable}"),
    ("needle held", "{needle_held_mean:.2f}"),
    ("a number", "{answered_number}/{trials}"),
]
SPEED_COLUMNS = [
    ("context", "{context}"),
    ("batch", "{batch}"),
    ("policy", "{policy}"),
    ("C", "{C}"),
    ("ms/token", "{ms_per_token:.1f}"),
    ("vs full", "{time_per_token_vs_full:.3f}"),
    ("paired", "{time_per_token_vs_full_paired:.3f}"),
    ("tokens/s", "{tokens_per_s:.2f}"),
    ("min-max over rounds", "{slowest:.2f}-{fastest:.2f}"),
    ("vs full", "{ratio_vs_full:.3f}"),
    ("KV MiB", "{kv_mib:.2f}"),
]
# the pass-key line of `ablation_table`
PASSKEY_LINE = (
    "ratio {passkey_ratio[0]}/{passkey_ratio[1]} [{passkey_ratio_ci95[0]:.3f}, {passkey_ratio_ci95[1]:.3f}] vs "
    "{passkey_ablation[0]}/{passkey_ablation[1]} [{passkey_ablation_ci95[0]:.3f}, {passkey_ablation_ci95[1]:.3f}]; "
    "only ratio right {passkey_only_ratio}, only ablation right {passkey_only_ablation}, McNemar p = "
    "{passkey_mcnemar_p:.2g} -> {passkey_verdict} (Wilson intervals), {passkey_paired_verdict} (paired)"
)


def load_results(data_dir=None):
    """``(file name, dict)`` of ``eviction_full.json`` if present, else of ``eviction_quick.json``,
    in ``data_dir`` (default: the repository's ``figures/data/``); ``(None, None)`` if neither exists."""
    folder = Path(data_dir) if data_dir is not None else figures_dir() / "data"
    for name in ("eviction_full.json", "eviction_quick.json"):
        path = folder / name
        if path.exists():
            return name, json.loads(path.read_text())
    return None, None


def provenance(results: dict) -> str:
    """One line: which run it was (mode, model, seconds), then where, with what and when it ran."""
    run = f"{results.get('mode', '?')} run of `python -m paged_ref.lab.bench eviction`, {results.get('model', '?')}"
    where = describe({k: v for k, v in results.items() if k != "mode"})
    return f"{run}, {results.get('seconds', '?')} s. {where}"


def _table(columns, rows) -> str:
    return table(columns, [dict(r, C=r["budget"] or "-", bound=r.get("page_bound") or "-") for r in rows])


def lm_table(results: dict, task: str = "language_modelling") -> str:
    """An NLL task's summary (``"language_modelling"``, ``"long_context"`` or ``"retention"``), one
    row per (B, C, policy): the t interval of the mean NLL over texts, its ends exponentiated for PPL."""
    rows = sorted(results[task], key=lambda r: (r["page_size"], r["budget"] or 0, policy_order(r["policy"])))
    rows = [dict(r, nll_ci=_interval(r["nll_ci95"], 4), ppl_ci=_interval(r["ppl_ci95"], 3)) for r in rows]
    return _table(LM_COLUMNS, rows)


def _interval(ci, digits: int) -> str:
    if any(x is None or math.isnan(x) for x in ci):
        return "-"
    return f"{ci[0]:.{digits}f}-{ci[1]:.{digits}f}"


def passkey_table(results: dict) -> str:
    """Pass-key accuracy with its Wilson 95% interval, and what of the key was held: a whole mention
    ("key held"), every digit in some mention ("readable"), the needle sentence's tokens; and the
    answers that contain a number at all (a retrieval attempted, right or wrong)."""
    rows = sorted(results["passkey"], key=lambda r: (r["budget"] or 0, policy_order(r["policy"])))
    return _table(PASSKEY_COLUMNS, rows)


def speed_table(results: dict) -> str:
    """Decode speed per policy, context and batch: time per output token and tokens/s (median over
    rounds; min-max of tokens/s), each against the full cache (time also as the median of per-round
    ratios, "paired"), and the KV bytes one sequence holds."""
    rows = []
    for r in results.get("speed", []):
        tps = r["tokens_per_s_rounds"]
        rows.append(dict(r, slowest=min(tps), fastest=max(tps), kv_mib=r["kv_bytes_held"] / 2**20))
    return _table(SPEED_COLUMNS, rows)


def lm_pairs(results: dict, a: str, b: str, task: str = "language_modelling") -> list[dict]:
    """``[{"page_size", "budget", "nll_a", "nll_b", "ppl_a", "ppl_b"}]``: an NLL task's summary rows of
    policies ``a`` and ``b`` side by side, per (B, C) both ran, sorted by (B, C)."""
    rows = {(r["policy"], r["page_size"], r["budget"]): r for r in results.get(task, [])}
    out = []
    for (p, ps, c), ra in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2] or 0)):
        rb = rows.get((b, ps, c))
        if p == a and rb is not None:
            out.append(dict(page_size=ps, budget=c, nll_a=ra["nll"], nll_b=rb["nll"], ppl_a=ra["ppl"], ppl_b=rb["ppl"]))
    return out


def _verdict(better: bool, worse: bool) -> str:
    return "ratio better" if better else "ratio worse" if worse else "not resolved"


def ablation(results: dict, reference: str = "paged_eviction", ablations=ABLATIONS) -> list[dict]:
    """The reviewers' ablation: one dict per ablated score with the numbers and their verdicts.

    ``lm_*``, ``retention_*``: `paired_nll` against ``reference`` over every (text, B, C) cell both
    ran (the cells share texts: the interval is descriptive). Pass-key, the same trials pooled over
    budgets: ``passkey_verdict`` from the two accuracies' Wilson 95% intervals (resolved when they do
    not overlap); ``passkey_paired_verdict`` from the exact McNemar test at 5% on the trials only one
    of them answered (more sensitive; pooled budgets reuse prompts, so trials are not independent).
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
            p = mcnemar_p(b, c)
            row.update(
                passkey_ratio=[kr, n],
                passkey_ablation=[ka, n],
                passkey_ratio_ci95=list(ci_r),
                passkey_ablation_ci95=list(ci_a),
                passkey_only_ratio=b,
                passkey_only_ablation=c,
                passkey_mcnemar_p=p,
                passkey_verdict=_verdict(ci_r[0] > ci_a[1], ci_r[1] < ci_a[0]),
                passkey_paired_verdict=_verdict(p < 0.05 and b > c, p < 0.05 and c > b),
            )
        out.append(row)
    return out


def paired_nll(rows: list[dict], reference: str, other: str, prefix: str) -> dict:
    """NLL of ``other`` minus ``reference`` per (text, B, C) cell both ran, in per-text ``rows``:
    ``{prefix}_cells`` and, if any, ``{prefix}_mean_diff``, ``_ci95`` (95% t interval), ``_ratio_wins``
    (cells where ``reference`` is lower) and ``_verdict`` (``"ratio better"`` when the interval is above 0)."""
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
                f"{prefix}_verdict": _verdict(lo > 0, hi < 0),
            }
        )
    return out


def ablation_table(rows: list[dict]) -> str:
    """`ablation` output as text: every number the verdicts rest on."""
    lines = []
    for r in rows:
        lines.append(f"ratio vs {r['ablation']}:")
        for prefix, task in (("lm", "language modelling"), ("retention", "retention")):
            if not r.get(f"{prefix}_cells"):
                lines.append(f"  {task}: no cells")
                continue
            lo, hi = r[f"{prefix}_ci95"]
            ci = "no interval from 1 cell" if math.isnan(lo) else f"95% CI [{lo:+.4f}, {hi:+.4f}]"
            lines.append(
                f"  {task}: mean dNLL {r[f'{prefix}_mean_diff']:+.4f} nats/token, {ci}, ratio lower NLL in "
                f"{r[f'{prefix}_ratio_wins']}/{r[f'{prefix}_cells']} cells -> {r[f'{prefix}_verdict']}"
            )
        lines.append(f"  pass-key: {PASSKEY_LINE.format(**r) if r.get('passkey_trials') else 'no pass-key trials'}")
    return "\n".join(lines)
