"""Notebook 07 (PagedEviction): scores on real K/V, which pages go, and the evaluation's numbers.

Three groups of functions; the first two take per-layer K/V lists ``ks, vs`` with
``ks[layer], vs[layer]: [num_tokens, num_kv_heads, head_dim]`` (the model's cached K after RoPE
and V, e.g. from `paged_ref.eviction.lm.PagedLM.prompt_kv`), so tests can pass synthetic ones.

* Scores: `layer_scores` (every `paged_ref.eviction.token_scores` method, per layer),
  `score_correlations` (Spearman per layer), `layer_agreement` (what one shared decision per
  sequence costs: each layer's own top-C tokens against the layer-averaged top-C),
  `swap_check` (the public code's ||K||/||V||).
* Which pages go: `replay` runs a `paged_ref.eviction` policy over the K/V in a real
  `PagedKVCache` (prefill, then one token at a time) and records when each token left;
  `layout_stats` counts the holes token eviction would leave in pages it could not free.
* The evaluation (`python -m paged_ref.bench eviction`): `load_results` reads its JSON,
  `lm_table` / `passkey_table` format exact numbers, `ablation` compares the ratio with each
  ablated score (paired; a verdict from the confidence intervals, not from prose).

Figure functions (``*_figure``) return new ``matplotlib.figure.Figure`` objects.

Example:
    >>> import torch
    >>> ks = [torch.randn(64, 2, 8) for _ in range(3)]; vs = [torch.randn(64, 2, 8) for _ in range(3)]
    >>> s = layer_scores(ks, vs)
    >>> s["value_key_ratio"].shape                     # [num_layers, num_tokens]
    torch.Size([3, 64])
    >>> r = replay(ks, vs, "paged_eviction", budget=16, page_size=8, prompt_len=32)
    >>> int(r.kept.sum()), r.stats.pages_dropped        # 16 after prefill, then 32 more, 4 pages dropped
    (16, 4)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from .._arith import cdiv
from .._validate import check_int
from ..cache import PagedKVCache
from ..eviction import EvictionPolicy, EvictionStats, make_policy, token_scores
from . import add_note

__all__ = [
    "SCORE_LABELS", "ABLATIONS", "MAP_POLICIES",
    "layer_scores", "spearman", "score_correlations", "layer_agreement", "swap_check",
    "Replay", "replay", "layout_stats", "policy_label",
    "load_results", "provenance", "lm_table", "passkey_table", "speed_table", "lm_pairs", "ablation", "ablation_table",
    "score_distribution_figure", "score_positions_figure", "correlation_figure", "agreement_figure",
    "page_map_figure", "fragmentation_figure", "perplexity_figure", "passkey_figure", "ablation_figure",
]

SCORE_LABELS = {"value_key_ratio": "||V|| / ||K||  (PagedEviction)", "inverse_key_norm": "1 / ||K||",
                "value_norm": "||V||", "key_norm": "||K||", "random": "random"}
#: The reviewers' ablation: the ratio against V only, K only (inverse norm), its opposite and random.
ABLATIONS = ("value_norm", "inverse_key_norm", "key_norm", "random")
#: Policies drawn in the page map (names of `paged_ref.eviction.make_policy`).
MAP_POLICIES = ("paged_eviction", "inverse_key_norm", "value_norm", "random", "streaming_llm", "token_topk")
# page-map cell values and colors: 0 never written, 1 kept, 2 evicted at prefill, 3 evicted during decode
_MAP_COLORS = ListedColormap(["white", "tab:blue", "tab:orange", "tab:red"])


def _check_kv_lists(ks, vs) -> None:
    if not isinstance(ks, (list, tuple)) or not isinstance(vs, (list, tuple)) or not ks or len(ks) != len(vs):
        raise ValueError(f"ks and vs must be non-empty lists of per-layer tensors of equal length, got "
                         f"{type(ks).__name__} of {len(ks) if hasattr(ks, '__len__') else '?'} and "
                         f"{type(vs).__name__} of {len(vs) if hasattr(vs, '__len__') else '?'}")
    shape = ks[0].shape
    for name, ts in (("ks", ks), ("vs", vs)):
        for i, t in enumerate(ts):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape != shape:
                raise ValueError(f"{name}[{i}] must be a tensor [num_tokens, num_kv_heads, head_dim] shaped like "
                                 f"ks[0] {list(shape)}, got {getattr(t, 'shape', type(t).__name__)}")


# ============================================================================ scores
def layer_scores(ks, vs, methods=("value_key_ratio", "inverse_key_norm", "value_norm", "key_norm")) -> dict:
    """Every requested `token_scores` method on every layer.

    Returns:
        ``{method: float32 [num_layers, num_tokens]}``.
    """
    _check_kv_lists(ks, vs)
    return {m: torch.stack([token_scores(k, v, m) for k, v in zip(ks, vs)]) for m in methods}


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (ties broken by position).

    Eviction keeps the top-C by score, so only the order of the scores matters: two scores
    with rank correlation 1 evict exactly the same tokens.

    Example:
        >>> round(spearman(torch.tensor([1., 2., 3.]), torch.tensor([10., 30., 20.])), 6)
        0.5
    """
    if a.dim() != 1 or a.shape != b.shape or a.numel() < 2:
        raise ValueError(f"a and b must be 1-D of the same length >= 2, got {list(a.shape)} and {list(b.shape)}")
    ra = torch.argsort(torch.argsort(a, stable=True)).double()
    rb = torch.argsort(torch.argsort(b, stable=True)).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


_PAIRS = (("value_key_ratio", "inverse_key_norm"), ("value_key_ratio", "value_norm"),
          ("inverse_key_norm", "value_norm"))


def score_correlations(scores: dict) -> dict:
    """Spearman correlation per layer of the three pairs among ratio, 1/||K|| and ||V||.

    Args:
        scores: `layer_scores` output (needs the three methods).

    Returns:
        ``{(a, b): [num_layers] floats}`` plus ``{(a, b, "shared"): float}``: the same pair for
        the layer-averaged score a policy actually ranks by (`paged_ref.eviction.sequence_scores`).
    """
    out = {}
    for a, b in _PAIRS:
        out[(a, b)] = [spearman(x, y) for x, y in zip(scores[a], scores[b])]
        out[(a, b, "shared")] = spearman(scores[a].mean(0), scores[b].mean(0))
    return out


def _top(score: torch.Tensor, budget: int) -> torch.Tensor:
    """bool [n]: the ``budget`` highest scores (stable: among ties the older token wins)."""
    keep = torch.zeros(score.shape[0], dtype=torch.bool)
    keep[torch.sort(score, descending=True, stable=True).indices[:budget]] = True
    return keep


def _jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a & b).sum()) / max(1, int((a | b).sum()))


def layer_agreement(scores: torch.Tensor, budget: int) -> dict:
    """What one shared eviction decision for all layers costs, at prefill with budget C.

    Args:
        scores: ``[num_layers, num_tokens]`` token scores of one method.
        budget: C, tokens kept.

    Returns:
        dict with ``pairwise`` (``[L, L]`` Jaccard overlap of the layers' own top-C sets),
        ``vs_shared`` (``[L]`` overlap of each layer's top-C with the top-C of the layer mean,
        the set a shared decision keeps), ``weight`` (``[L]`` each layer's share of the layer
        mean: mean score of the layer / sum over layers; layers with large scores dominate).
    """
    budget = check_int("budget", budget, min_value=1)
    own = [_top(s, budget) for s in scores]
    shared = _top(scores.mean(0), budget)
    n = len(own)
    pairwise = np.array([[_jaccard(own[i], own[j]) for j in range(n)] for i in range(n)])
    means = scores.mean(1)
    return dict(pairwise=pairwise, vs_shared=np.array([_jaccard(o, shared) for o in own]),
                weight=(means / means.sum()).numpy())


def swap_check(ks, vs, budget: int) -> dict:
    """The public code's bug, ``||K|| / ||V||`` (arguments swapped), against the paper's ``||V|| / ||K||``.

    Returns per layer: the Spearman correlation of the swapped score with the correct one
    (-1: the order is exactly reversed) and the overlap (Jaccard) of the tokens each keeps at
    budget C; and ``values_replaced_by_keys``: True where scoring V := K gives one constant
    score for every token of a layer (||K|| / ||K|| = 1 carries no information).
    """
    _check_kv_lists(ks, vs)
    out = dict(spearman=[], kept_overlap=[], values_replaced_by_keys=[])
    for k, v in zip(ks, vs):
        right, swapped = token_scores(k, v), token_scores(v, k)
        out["spearman"].append(spearman(right, swapped))
        out["kept_overlap"].append(_jaccard(_top(right, budget), _top(swapped, budget)))
        same = token_scores(k, k)
        out["values_replaced_by_keys"].append(bool(torch.allclose(same, torch.ones_like(same))))
    return out


# ============================================================================ which pages go
@dataclass
class Replay:
    """One policy run over given K/V (see `replay`).

    Attributes:
        policy: the policy object (its repr names every option).
        page_size: B; budget: C (None for the full cache); prompt_len: tokens prefilled.
        evicted_at: int64 ``[num_tokens]``: -1 still held at the end, 0 evicted at prefill, t >= 1
            evicted by the hook after decode token t (t = 1 is the first token after the prompt).
        stats: the policy's `EvictionStats` for the sequence.
        max_pages: most pages the sequence held after the prefill eviction (the whole prompt is
            held once, before it), counting a newly added page before the hook runs.
    """

    policy: EvictionPolicy
    page_size: int
    budget: int | None
    prompt_len: int
    evicted_at: torch.Tensor
    stats: EvictionStats
    max_pages: int

    @property
    def kept(self) -> torch.Tensor:
        """bool ``[num_tokens]``: held at the end."""
        return self.evicted_at < 0


def replay(ks, vs, policy, *, budget: int | None = None, page_size: int, prompt_len: int,
           chunk: int | None = None) -> Replay:
    """Run an eviction policy over precomputed K/V in a real `PagedKVCache`.

    The first ``prompt_len`` tokens are prefilled, then ``after_prefill`` runs; the rest are
    appended one token at a time (or in chunks no longer than the policy's
    `tokens_until_action`, which gives the same result) with ``after_append`` after each.
    The K/V of the later tokens are the ones given, i.e. computed with the full cache (under
    eviction a real decode would compute slightly different K/V in layers >= 1; the
    evaluation in `paged_ref.bench.eviction` decodes for real). The allocator is checked to be
    all free again at the end. It runs with one torch thread (restored afterwards): every
    step is a handful of small tensor ops, which extra threads slow down on a busy machine
    (measured on 2 shared cores: 119 s with the default threads vs about 6 s with one, for the
    six policies of notebook 07 on 512 tokens).

    Args:
        ks, vs: per-layer ``[num_tokens, num_kv_heads, head_dim]``.
        policy: a policy name (``make_policy(policy, budget)``) or an `EvictionPolicy`.
        budget: C, for a policy name.
        page_size: B.
        prompt_len: tokens in the prefill (1 <= prompt_len <= num_tokens).
        chunk: largest chunk appended between hook calls (default: whatever the policy allows).
    """
    _check_kv_lists(ks, vs)
    page_size = check_int("page_size", page_size, min_value=1)
    n = ks[0].shape[0]
    prompt_len = check_int("prompt_len", prompt_len, min_value=1)
    if prompt_len > n:
        raise ValueError(f"prompt_len must be <= num_tokens={n}, got {prompt_len}")
    if isinstance(policy, str):
        policy = make_policy(policy, budget)
    elif not isinstance(policy, EvictionPolicy):
        raise TypeError(f"policy must be a policy name or an EvictionPolicy, got {type(policy).__name__}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small per-token ops: extra threads only wait on a busy core
    try:
        return _replay(ks, vs, policy, page_size, prompt_len, chunk)
    finally:
        torch.set_num_threads(threads)


def _replay(ks, vs, policy, page_size, prompt_len, chunk) -> Replay:
    n = ks[0].shape[0]
    num_layers, (_, hkv, d) = len(ks), ks[0].shape
    cache = PagedKVCache(num_layers=num_layers, num_pages=cdiv(n, page_size) + 2, page_size=page_size,
                         num_kv_heads=hkv, head_dim=d, dtype=ks[0].dtype)
    seq = cache.add_sequence()
    evicted_at = torch.full((n,), -1, dtype=torch.int64)  # [num_tokens]

    def append(lo, hi):
        slots = cache.reserve(seq, hi - lo)  # int64 [hi - lo]
        for layer in range(num_layers):
            cache.write(layer, slots, ks[layer][lo:hi], vs[layer][lo:hi])

    def mark(before: torch.Tensor, step: int):
        gone = before[~torch.isin(before, policy.positions(seq))]
        evicted_at[gone] = step

    append(0, prompt_len)
    policy.after_prefill(cache, seq)
    max_pages = len(cache.pages(seq))
    mark(torch.arange(prompt_len), 0)
    pos = prompt_len
    while pos < n:
        m = min(n - pos, policy.tokens_until_action(cache, seq), chunk or n)
        before = torch.cat([policy.positions(seq), torch.arange(pos, pos + m)])
        append(pos, pos + m)
        max_pages = max(max_pages, len(cache.pages(seq)))
        policy.after_append(cache, seq)
        pos += m
        mark(before, pos - prompt_len)
    stats = policy.stats(seq)
    cache.free(seq)
    policy.release(seq)
    assert cache.allocator.num_free == cache.num_pages, "every page goes back to the allocator"
    return Replay(policy=policy, page_size=page_size, budget=policy.budget, prompt_len=prompt_len,
                  evicted_at=evicted_at, stats=stats, max_pages=max_pages)


def layout_stats(kept: torch.Tensor, page_size: int, lo: int = 0, hi: int | None = None) -> dict:
    """Pages the surviving tokens need if no token ever moves, for positions ``lo:hi``.

    Each token stays in the slot it was written to (token ``p`` on page ``p // page_size``),
    as a paged cache without compaction keeps it; a page is held while any of its tokens
    survives. Page eviction frees whole pages and leaves no hole; unstructured token eviction
    leaves holes that hold memory until a compaction copies the survivors.

    Returns:
        dict ``kept`` (tokens), ``dense_pages`` (ceil(kept / B): the least possible),
        ``pages_held`` (pages with a survivor), ``holes`` (evicted slots inside held pages),
        ``hole_fraction`` (holes / slots of held pages).

    Example:
        >>> layout_stats(torch.tensor([1, 0, 1, 0, 0, 0, 1, 1], dtype=torch.bool), 4)
        {'kept': 4, 'dense_pages': 1, 'pages_held': 2, 'holes': 4, 'hole_fraction': 0.5}
    """
    page_size = check_int("page_size", page_size, min_value=1)
    if kept.dtype != torch.bool or kept.dim() != 1:
        raise ValueError(f"kept must be a 1-D bool tensor, got {kept.dtype} {list(kept.shape)}")
    hi = kept.shape[0] if hi is None else hi
    pos = torch.arange(lo, hi)[kept[lo:hi]]
    pages = torch.unique(pos // page_size)
    slots = sum(min(hi, (int(p) + 1) * page_size) - max(lo, int(p) * page_size) for p in pages)
    holes = slots - pos.numel()
    return dict(kept=int(pos.numel()), dense_pages=cdiv(int(pos.numel()), page_size), pages_held=int(pages.numel()),
                holes=int(holes), hole_fraction=round(holes / slots, 4) if slots else 0.0)


# ============================================================================ the evaluation's JSON
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
    return (f"{results.get('mode', '?')} run of `python -m paged_ref.bench eviction`: {results.get('model', '?')} "
            f"on {hw}, {env.get('platform', '?')}; Python {env.get('python', '?')}, torch {env.get('torch', '?')}, "
            f"transformers {env.get('transformers', '?')}; {env.get('date_utc', '?')}; "
            f"{results.get('seconds', '?')} s")


def _fmt_rows(headers, rows) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _order(policy: str) -> int:
    known = ["full", "paged_eviction", "paged_eviction_first_page", *ABLATIONS, "streaming_llm", "token_topk"]
    return known.index(policy) if policy in known else len(known)


def lm_table(results: dict) -> str:
    """The language-modelling summary (mean over texts), one row per (B, C, policy), exact numbers."""
    rows = sorted(results["language_modelling"], key=lambda r: (r["page_size"], r["budget"] or 0, _order(r["policy"])))
    return _fmt_rows(["B", "C", "policy", "NLL", "PPL", "KL vs full", "max pages", "bound", "tokens moved"],
                     [[r["page_size"], r["budget"] or "-", r["policy"], f"{r['nll']:.4f}", f"{r['ppl']:.3f}",
                       f"{r['kl_vs_full']:.4f}", r["max_pages_held"], r["page_bound"] or "-", r["tokens_moved"]]
                      for r in rows])


def passkey_table(results: dict) -> str:
    """Pass-key accuracy with its Wilson 95% interval, and what of the key was held.

    Columns: a whole mention held ("key held") and the correct answers with/without it; every
    digit held in some mention ("readable") and the correct answers without it; the mean share
    of the needle sentence's tokens held.
    """
    rows = sorted(results["passkey"], key=lambda r: (r["budget"] or 0, _order(r["policy"])))
    return _fmt_rows(["C", "policy", "correct", "accuracy", "Wilson 95%", "key held", "correct|held",
                      "correct|lost", "readable", "correct|unreadable", "needle held"],
                     [[r["budget"] or "-", r["policy"], f"{r['correct']}/{r['trials']}", f"{r['accuracy']:.3f}",
                       f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]", f"{r['key_held']}/{r['trials']}",
                       r["correct_when_held"], r["correct_when_lost"], f"{r['key_readable']}/{r['trials']}",
                       r["correct_when_unreadable"], f"{r['needle_held_mean']:.2f}"] for r in rows])


def speed_table(results: dict) -> str:
    """Decode tokens/s per policy (one sequence, CPU): median and min-max over the rounds, the
    ratio of medians to the full cache, and the KV bytes held."""
    return _fmt_rows(["policy", "C", "tokens/s", "min-max over rounds", "vs full", "KV MiB held"],
                     [[r["policy"], r["budget"] or "-", f"{r['tokens_per_s']:.2f}",
                       f"{min(r['tokens_per_s_rounds']):.2f}-{max(r['tokens_per_s_rounds']):.2f}",
                       f"{r['ratio_vs_full']:.3f}", f"{r['kv_bytes_held'] / 2**20:.2f}"]
                      for r in results.get("speed", [])])


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


# two-sided 95% Student t quantiles by degrees of freedom (beyond 30: the normal's 1.96)
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def _mean_ci(xs) -> tuple[float, float, float]:
    """Mean and 95% t interval of paired differences (nan interval for fewer than 2)."""
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.959964) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _binom_two_sided(b: int, c: int) -> float:
    """Exact McNemar test: two-sided binomial p-value of b successes in b + c fair trials."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def _wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, center - half), min(1.0, center + half)


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
        diffs = [lm[(abl,) + key[1:]] - nll for key, nll in lm.items() if key[0] == reference and (abl,) + key[1:] in lm]
        row = dict(ablation=abl, lm_cells=len(diffs))
        if diffs:
            mean, lo, hi = _mean_ci(diffs)
            row.update(lm_mean_diff=mean, lm_ci95=[lo, hi], lm_ratio_wins=sum(d > 0 for d in diffs),
                       lm_verdict="ratio better" if lo > 0 else "ratio worse" if hi < 0 else "not resolved")
        pairs = [(ok, pk[(abl,) + key[1:]]) for key, ok in pk.items() if key[0] == reference and (abl,) + key[1:] in pk]
        row["passkey_trials"] = len(pairs)
        if pairs:
            b = sum(r and not a for r, a in pairs)
            c = sum(a and not r for r, a in pairs)
            kr, ka, n = sum(r for r, _ in pairs), sum(a for _, a in pairs), len(pairs)
            ci_r, ci_a = _wilson(kr, n), _wilson(ka, n)
            row.update(passkey_ratio=[kr, n], passkey_ablation=[ka, n], passkey_ratio_ci95=list(ci_r),
                       passkey_ablation_ci95=list(ci_a), passkey_only_ratio=b, passkey_only_ablation=c,
                       passkey_mcnemar_p=_binom_two_sided(b, c),
                       passkey_verdict="ratio better" if ci_r[0] > ci_a[1] else
                       "ratio worse" if ci_r[1] < ci_a[0] else "not resolved")
            p = row["passkey_mcnemar_p"]
            row["passkey_paired_verdict"] = ("ratio better" if p < 0.05 and b > c else
                                             "ratio worse" if p < 0.05 and c > b else "not resolved")
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
        lm = (f"mean dNLL {r['lm_mean_diff']:+.4f} nats/token, {ci}, "
              f"ratio lower NLL in {r['lm_ratio_wins']}/{r['lm_cells']} cells -> {r['lm_verdict']}"
              if r.get("lm_cells") else "no language-modelling cells")
        pk = (f"ratio {r['passkey_ratio'][0]}/{r['passkey_ratio'][1]} "
              f"[{r['passkey_ratio_ci95'][0]:.3f}, {r['passkey_ratio_ci95'][1]:.3f}] vs "
              f"{r['passkey_ablation'][0]}/{r['passkey_ablation'][1]} "
              f"[{r['passkey_ablation_ci95'][0]:.3f}, {r['passkey_ablation_ci95'][1]:.3f}]; only ratio right "
              f"{r['passkey_only_ratio']}, only ablation right {r['passkey_only_ablation']}, McNemar p = "
              f"{r['passkey_mcnemar_p']:.2g} -> {r['passkey_verdict']} (Wilson intervals), {r['passkey_paired_verdict']} (paired)"
              if r.get("passkey_trials") else "no pass-key trials")
        lines.append(f"ratio vs {r['ablation']}:\n  language modelling: {lm}\n  pass-key: {pk}")
    return "\n".join(lines)


# ============================================================================ figures
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


def score_positions_figure(scores: dict, method: str = "value_key_ratio", *, budget: int | None = None,
                           note: str = "") -> Figure:
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
    for a, b in _PAIRS:
        line, = ax.plot(corr[(a, b)], marker=".", label=f"{SCORE_LABELS[a].split('  ')[0]} vs {SCORE_LABELS[b]}")
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
    a2.plot(layers, agree["weight"] * len(layers), "o-", color="tab:red", ms=3,
            label="layer's weight in the mean x num_layers (1 = equal)")
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
        short = {"inverse_key_norm": "1/||K||", "value_norm": "||V||", "key_norm": "||K||", "random": "random"}
        name = "paged_eviction" if r.policy.method == "value_key_ratio" else f"page eviction ({short[r.policy.method]})"
    elif name == "token_topk":
        name = "token_topk (ratio)"
    return name


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
        ax.set_title(f"{policy_label(r)}\n{int(r.kept.sum())} kept, {r.stats.pages_dropped} pages dropped,\n"
                     f"{r.stats.tokens_moved} tokens copied", fontsize=8)
        ax.set_xticks([0, r.page_size - 1])
        ax.set_xlabel("offset in page")
    axes[0].set_ylabel(f"original page (B = {replays[0].page_size} tokens)")
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=c, label=lab) for c, lab in zip(_MAP_COLORS.colors[1:], (
        "kept", "evicted at prefill", "evicted during decode"))], loc="outside right upper", fontsize=8)
    fig.suptitle(f"Which tokens go: C = {replays[0].budget}, prompt {replays[0].prompt_len} tokens, "
                 f"then {replays[0].evicted_at.shape[0] - replays[0].prompt_len} decoded", fontsize=10)
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


def perplexity_figure(results: dict, *, note: str = "") -> Figure:
    """Perplexity of the continuation vs budget C, one panel per page size B (from the JSON)."""
    summary = results["language_modelling"]
    sizes = sorted({r["page_size"] for r in summary})
    fig = Figure(figsize=(6 * len(sizes), 4.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(sizes), sharey=True))
    policies = sorted({r["policy"] for r in summary} - {"full"}, key=_order)
    for ax, ps in zip(axes, sizes):
        rows = [r for r in summary if r["page_size"] == ps]
        full = [r for r in rows if r["policy"] == "full"]
        if full:
            ax.axhline(full[0]["ppl"], color="k", ls="--", lw=1, label="full cache")
        for name in policies:
            pts = sorted((r["budget"], r["ppl"]) for r in rows if r["policy"] == name)
            if pts:
                ax.plot(*zip(*pts), marker="o", lw=2.5 if name == "paged_eviction" else 1.2, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("budget C (tokens)")
        ax.set_title(f"page size B = {ps}", fontsize=10)
    axes[0].set_ylabel("perplexity of the continuation")
    axes[-1].legend(fontsize=7)
    add_note(fig, note)
    return fig


def passkey_figure(results: dict, *, note: str = "") -> Figure:
    """Pass-key accuracy with Wilson 95% intervals, and the share of trials whose key was held."""
    summary = results["passkey"]
    budgets = sorted({r["budget"] for r in summary if r["budget"] is not None})
    policies = sorted({r["policy"] for r in summary} - {"full"}, key=_order)
    full = [r for r in summary if r["policy"] == "full"]
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    width = 0.8 / max(1, len(policies))
    for ax, key in zip(axes, ("accuracy", "key_held_rate")):
        if full:
            ax.axhline(full[0][key], color="k", ls="--", lw=1, label="full cache")
        for j, name in enumerate(policies):
            rows = sorted((r for r in summary if r["policy"] == name), key=lambda r: r["budget"])
            x = [budgets.index(r["budget"]) + (j - len(policies) / 2 + 0.5) * width for r in rows]
            y = [r[key] for r in rows]
            err = None
            if key == "accuracy":
                err = [[r["accuracy"] - r["ci95"][0] for r in rows], [r["ci95"][1] - r["accuracy"] for r in rows]]
            ax.bar(x, y, width, yerr=err, capsize=2, label=name)
        ax.set_xticks(range(len(budgets)), [f"C = {c}" for c in budgets])
        ax.set_ylim(0, 1.05)
    n = full[0]["trials"] if full else "?"
    axes[0].set_title(f"pass-key accuracy ({n} trials per bar, Wilson 95%)", fontsize=10)
    axes[1].set_title("key's tokens still held when the answer starts", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7)
    add_note(fig, note)
    return fig


def ablation_figure(results: dict, rows: list[dict], reference: str = "paged_eviction", *, note: str = "") -> Figure:
    """Left: NLL difference (ablation - ratio) per cell, per ablation. Right: paired pass-key accuracies."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    lm = {(r["policy"], r["text"], r["page_size"], r["budget"]): r["nll"] for r in results.get("lm_rows", [])}
    for i, r in enumerate(rows):
        d = [lm[(r["ablation"],) + k[1:]] - v for k, v in lm.items() if k[0] == reference and (r["ablation"],) + k[1:] in lm]
        if not d:
            continue
        a1.plot(np.full(len(d), i) + np.linspace(-0.2, 0.2, len(d)), d, "o", ms=4, alpha=0.6)
        if not math.isnan(r["lm_ci95"][0]):
            a1.errorbar(i, r["lm_mean_diff"], yerr=[[r["lm_mean_diff"] - r["lm_ci95"][0]], [r["lm_ci95"][1] - r["lm_mean_diff"]]],
                        fmt="s", color="k", capsize=4)
    a1.axhline(0, color="k", lw=0.8)
    a1.set_xticks(range(len(rows)), [r["ablation"] for r in rows])
    a1.set_ylabel("NLL(ablation) - NLL(ratio), nats/token")
    a1.set_title("language modelling: > 0 means the ratio is better\n(dots: (text, B, C) cells; black: mean, 95% t CI)",
                 fontsize=9)
    x = np.arange(len(rows))
    have = [r for r in rows if r.get("passkey_trials")]
    if have:
        for off, key, label in ((-0.2, "passkey_ratio", "ratio"), (0.2, "passkey_ablation", "ablation")):
            acc = [r[key][0] / r[key][1] for r in have]
            ci = [r[key + "_ci95"] for r in have]
            a2.bar(x[:len(have)] + off, acc, 0.4, yerr=[[a - c[0] for a, c in zip(acc, ci)], [c[1] - a for a, c in zip(acc, ci)]],
                   capsize=3, label=label)
        a2.set_xticks(x[:len(have)], [r["ablation"] for r in have])
        a2.set_ylim(0, 1.05)
        a2.legend(fontsize=8)
    a2.set_title("pass-key accuracy, same trials, pooled over budgets (Wilson 95%)", fontsize=9)
    add_note(fig, note)
    return fig
