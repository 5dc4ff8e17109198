"""What a byte buys (`python -m paged_ref.lab.bench kvbytes`), read from its JSON: one row per method,
format and budget, its bytes per sequence and its quality on the three tasks.

Example (two rows of a made-up result):
    >>> lm = [dict(policy="full", kv_format="float32", budget=None, share="1", bytes_per_seq=2**20, texts=2,
    ...            nll=2.5, nll_ci95=[2.4, 2.6], kl_vs_full=0.0),
    ...       dict(policy="full", kv_format="int8 page", budget=None, share="1", bytes_per_seq=2**18, texts=2,
    ...            nll=2.6, nll_ci95=[2.5, 2.7], kl_vs_full=0.01)]
    >>> rows = method_rows({"language_modelling": lm, "retention": [], "passkey": []})
    >>> [(r["method"], r["format"], r["scales"], r["vs_float32"]) for r in rows]
    [('full cache', 'float32', '-', 1.0), ('full cache', 'int8', 'per page', 0.25)]
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..runmode import figures_dir
from .common import table

__all__ = ["METHOD_NAMES", "bytes_table", "describe", "load_results", "method_rows", "split_format"]

METHOD_NAMES = {"full": "full cache", "paged_eviction": "PagedEviction", "streaming_llm": "StreamingLLM"}
METHOD_NAMES["quest"] = "Quest"
COLUMNS = [
    ("method", "{method}"),
    ("format", "{format}"),
    ("scales", "{scales}"),
    ("budget", "{share}"),
    ("C", "{budget}"),
    ("MiB/seq", "{mib:.2f}"),
    ("vs f32 full", "{vs_float32:.3f}"),
    ("NLL", "{nll:.4f}"),
    ("NLL 95% CI", "{nll_ci}"),
    ("dNLL vs f32 full", "{dnll_vs_float32_full:+.4f}"),
    ("dNLL 95% CI", "{dnll_ci}"),
    ("KL vs full", "{kl_vs_full:.4f}"),
    ("retention NLL", "{retention_nll:.4f}"),
    ("retention 95% CI", "{retention_ci}"),
    ("retention dNLL", "{retention_dnll:+.4f}"),
    ("retention dNLL 95% CI", "{retention_dci}"),
    ("pass-key C", "{passkey_budget}"),
    ("pass-key", "{passkey_correct}/{passkey_trials}"),
    ("Wilson 95%", "[{passkey_ci95[0]:.2f}, {passkey_ci95[1]:.2f}]"),
]


def load_results(data_dir=None):
    """``(file name, dict)`` of ``kv_bytes_full.json`` if present, else of ``kv_bytes_quick.json``, in
    ``data_dir`` (default: the repository's ``figures/data/``); ``(None, None)`` if neither exists."""
    folder = Path(data_dir) if data_dir is not None else figures_dir() / "data"
    for name in ("kv_bytes_full.json", "kv_bytes_quick.json"):
        path = folder / name
        if path.exists():
            return name, json.loads(path.read_text())
    return None, None


def split_format(label: str) -> tuple[str, str]:
    """``(format, scales)`` of a format label.

    Example:
        >>> split_format("e4m3 layer 1.0"), split_format("bfloat16 values")
        (('e4m3', 'per layer 1.0'), ('bfloat16', '- (in float32 pages)'))
    """
    dtype, _, rest = label.partition(" ")
    scales = {"": "-", "page": "per page", "layer 1.0": "per layer 1.0", "layer calibrated": "per layer, calibrated"}
    scales["values"] = "- (in float32 pages)"
    return dtype, scales.get(rest, rest)


def method_rows(results: dict) -> list[dict]:
    """One dict per (method, format, budget share) of the language-modelling summary, with the retention
    and pass-key rows of the same method, format and share; ``mib``: its bytes per sequence in MiB (Quest:
    the bytes its last decode step read; it holds the full cache's); ``vs_float32``: those bytes over the
    float32 full cache's. Sorted: the full caches, then each method by format and share."""

    def key(r):
        return r["policy"], r["kv_format"], r["share"]

    ret = {key(r): r for r in results.get("retention", [])}
    pk = {key(r): r for r in results.get("passkey", [])}
    base = next(r["bytes_per_seq"] for r in results["language_modelling"] if key(r) == ("full", "float32", "1"))
    out = []
    for r in results["language_modelling"]:
        fmt, scales = split_format(r["kv_format"])
        nbytes = r.get("bytes_read_per_step", r["bytes_per_seq"])
        row = dict(r, method=METHOD_NAMES.get(r["policy"], r["policy"]), format=fmt, scales=scales, bytes=nbytes)
        row.update(mib=nbytes / 2**20, vs_float32=nbytes / base, budget=r["budget"] or "-", nll_ci=_ci(r["nll_ci95"]))
        if "dnll_ci95" in r:
            row["dnll_ci"] = _ci(r["dnll_ci95"], sign="+")
        if key(r) in ret:
            q = ret[key(r)]
            row.update(retention_nll=q["nll"], retention_ci=_ci(q["nll_ci95"]))
            row.update(
                retention_dnll=q.get("dnll_vs_float32_full"), retention_dci=_ci(q.get("dnll_ci95", [math.nan] * 2), "+")
            )
        if key(r) in pk:
            p = pk[key(r)]
            row.update(passkey_budget=p["budget"] or "-", passkey_correct=p["correct"], passkey_trials=p["trials"])
            row["passkey_ci95"] = p["ci95"]
            row.update(zip(("passkey_gained", "passkey_lost"), passkey_flips(results, p)))
        if key(r) in ret:
            held = [x.get("region_held") for x in _rows_of(results.get("retention_rows", []), ret[key(r)])]
            row["passage_held"] = sum(held) / len(held) if held and None not in held else None
        out.append(row)
    order = list(METHOD_NAMES)
    return sorted(out, key=lambda r: (order.index(r["policy"]), r["format"] != "float32", r["kv_format"], -r["bytes"]))


def _rows_of(rows: list[dict], summary: dict) -> list[dict]:
    """The per-text or per-trial rows behind one summary row (its method, format and budget)."""
    want = (summary["policy"], summary["kv_format"], summary["budget"])
    return [r for r in rows if (r["policy"], r.get("kv_format", "float32"), r["budget"]) == want]


def passkey_flips(results: dict, summary: dict) -> tuple[int, int]:
    """``(gained, lost)``: of the pass-key trials behind ``summary`` (one row of ``results["passkey"]``), those
    it answered that the float32 full cache missed, and those it missed that the float32 full cache answered:
    the same prompts on both sides (paired), where two accuracies' intervals do not compare them.

    Example:
        >>> rows = [dict(policy="full", budget=None, trial=t, correct=c) for t, c in enumerate([1, 1, 0])]
        >>> rows += [dict(policy="full", kv_format="int8 page", budget=None, trial=t, correct=c)
        ...          for t, c in enumerate([1, 0, 1])]
        >>> passkey_flips({"passkey_rows": rows}, dict(policy="full", kv_format="int8 page", budget=None))
        (1, 1)
    """
    rows = results.get("passkey_rows", [])
    base = {r["trial"]: r["correct"] for r in _rows_of(rows, dict(policy="full", kv_format="float32", budget=None))}
    mine = {r["trial"]: r["correct"] for r in _rows_of(rows, summary)}
    both = mine.keys() & base.keys()
    return sum(mine[t] and not base[t] for t in both), sum(base[t] and not mine[t] for t in both)


def _ci(ci, sign: str = "") -> str:
    """A 95% interval as text; ``-`` where there is none (one text)."""
    return "-" if any(x != x for x in ci) else f"[{ci[0]:{sign}.4f}, {ci[1]:{sign}.4f}]"


def bytes_table(results: dict) -> str:
    """`method_rows` as text; a missing interval (one text) prints as ``-``."""
    return table(COLUMNS, method_rows(results))


def describe(results: dict) -> str:
    """What the table shows: the run, the sizes and how bytes are counted."""
    cfg, n = results["config"], results.get("full_cache_tokens", {})
    return (
        f"{results.get('mode', '?')} run of `python -m paged_ref.lab.bench kvbytes`, {results.get('model', '?')}, "
        f"{results.get('seconds', '?')} s. Continuation NLL over {cfg['texts']} text(s) (context {cfg['context']}, "
        f"{cfg['continuation']} tokens), retention over {cfg['retention_texts']} ({n.get('retention', '?')} tokens), "
        f"pass-key {cfg['passkey_trials']} trial(s) ({n.get('passkey', '?')} tokens); B = {cfg['page_size']}; "
        "budgets as shares of the full cache's pages (C: the continuation's; pass-key C: the pass-key's); "
        "MiB/seq and 'vs f32 full': the continuation task's. Bytes: " + results["bytes_basis"]
    )
