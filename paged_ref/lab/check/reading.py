"""Exercise 7's checkers (notebook 10): `check_merge_states` and `check_quest`.

**merge_states.** ``my_merge_states(o_a, lse_a, o_b, lse_b) -> (o, lse)``: two partial attention
results, each normalised (``o [..., head_dim]``) with the base-2 log-sum-exp of its scores
(``lse [...]``), merged into the result of attending to both parts. Checked in float64 against
attention over the whole key set (and so against `paged_ref.attention.cascade.merge_states`): random
splits, an empty part (``o = 0``, ``lse = -inf``), scores of +-1000 (``exp2`` of them overflows or
underflows), parts of very different weight.

**Quest.** A class with three methods:

* ``summaries(k, page_size) -> (k_min, k_max)``: ``k [seq_len, num_kv_heads, head_dim]`` the keys of
  one sequence; per page and channel the min and max of the page's keys, ``[num_pages, num_kv_heads,
  head_dim]`` each (the last page may hold fewer tokens);
* ``bound(q, k_min, k_max) -> [...]``: the largest ``q . k`` any key between ``k_min`` and ``k_max``
  can give (``[..., head_dim]`` broadcast), `paged_ref.attention.quest.page_bounds`;
* ``select(q, k_min, k_max, budget) -> int64 [num_kv_heads, n]``: for one decode query ``q
  [num_q_heads, head_dim]``, per KV head the ``n = min(budget, num_pages)`` pages with the largest
  bound over its query heads (query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``),
  the last page always among them, in increasing order (as `paged_ref.attention.quest.quest_paged_decode`
  chooses).

Each part is checked against `paged_ref.attention.quest`, and the bound also by its property: never
below the real score ``q . k`` of a key of the page.
"""

from __future__ import annotations

import math

import torch

from ..._arith import cdiv
from ...attention.quest import page_bounds, select_pages
from ...page_summaries import PageSummaries
from .report import DEFAULT_TIME_LIMIT_S, CheckReport, Failure, StudentError, raised_hint, run_cases

__all__ = ["check_merge_states", "check_quest"]

LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------- merge_states
def _part(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of scores ``s [..., n]`` (base 2) over values ``v [n, D]``: o = 0, lse = -inf when n = 0."""
    if s.shape[-1] == 0:
        return torch.zeros(*s.shape[:-1], v.shape[-1], dtype=s.dtype), torch.full(
            s.shape[:-1], -math.inf, dtype=s.dtype
        )
    lse = torch.logsumexp(s * LN2, -1) / LN2  # [...]
    return torch.exp2(s - lse[..., None]) @ v, lse


def _merge_cases():
    """(name, scores [..., n], v [n, D], cut) smallest and plainest first."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    cases = []
    for rows, n, d, scale in (((1,), 4, 2, 1.0), ((3,), 7, 4, 3.0), ((2, 3), 9, 3, 2.0), ((4,), 6, 4, 1.0)):
        for _ in range(3):
            cut = int(torch.randint(1, n, (1,), generator=g))
            cases.append(
                (
                    f"rows {rows}, {n} keys split at {cut}, scores ~ N(0, {scale:g})",
                    randn(*rows, n, scale=scale),
                    randn(n, d),
                    cut,
                )
            )
    cases.append(("an empty first part (lse_a = -inf, o_a = 0)", randn(3, 5), randn(5, 4), 0))
    cases.append(("an empty second part (lse_b = -inf, o_b = 0)", randn(3, 5), randn(5, 4), 5))
    cases.append(("scores around +1100 (exp2 of them overflows)", 1100 + randn(3, 6), randn(6, 4), 2))
    cases.append(("scores around -1100 (exp2 of them underflows to 0)", -1100 + randn(3, 6), randn(6, 4), 4))
    lopsided = torch.cat([randn(3, 3) + 60, randn(3, 3) - 60], -1)
    cases.append(("a part 2^120 times heavier than the other", lopsided, randn(6, 4), 3))
    mixed = torch.cat([randn(2, 4) + 1100, randn(2, 4) - 1100], -1)
    cases.append(("parts at +1100 and -1100 (one weighs nothing)", mixed, randn(8, 4), 4))
    return cases


def _merge_variants(o_a, lse_a, o_b, lse_b) -> dict[str, tuple]:
    """Wrong answers with a name: the mistakes the hints name."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp2(lse_a - m), torch.exp2(lse_b - m)
    ea, eb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    right_lse = m + torch.log2(wa + wb)
    right_o = (wa[..., None] * o_a + wb[..., None] * o_b) / (wa + wb)[..., None]
    return {
        "exp instead of exp2": (
            (ea[..., None] * o_a + eb[..., None] * o_b) / (ea + eb)[..., None],
            m + torch.log(ea + eb),
        ),
        "weights not normalised": (wa[..., None] * o_a + wb[..., None] * o_b, right_lse),
        "lse = max": (right_o, m),
        "lse = sum": (right_o, lse_a + lse_b),
        "natural log": (right_o, m + torch.log(wa + wb)),
        "mean": ((o_a + o_b) / 2, right_lse),
        "swapped": ((wb[..., None] * o_a + wa[..., None] * o_b) / (wa + wb)[..., None], right_lse),
    }


_MERGE_HINTS = {
    "exp instead of exp2": "lse is in base 2: a part's weight is exp2(lse - m), and the merged lse m + log2(...), "
    "not exp / log",
    "weights not normalised": "divide by the sum of the weights: o = (w_a o_a + w_b o_b) / (w_a + w_b)",
    "lse = max": "the merged lse is m + log2(w_a + w_b), not the larger lse alone",
    "lse = sum": "the merged lse is the log2 of the SUM of exp2(lse): m + log2(w_a + w_b), not lse_a + lse_b",
    "natural log": "the merged lse is in base 2: m + log2(w_a + w_b), not log",
    "mean": "weigh each part by its softmax mass exp2(lse): a plain mean of o_a and o_b is right only for equal lse",
    "swapped": "each part's output takes its own weight: w_a = exp2(lse_a - m) goes with o_a",
}


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=False))


def check_merge_states(fn, *, time_limit: float | None = DEFAULT_TIME_LIMIT_S) -> CheckReport:
    """Check ``fn(o_a, lse_a, o_b, lse_b) -> (o, lse)`` (see the module docstring) in float64."""

    def check_one(case, run):
        name, s, v, cut = case
        (o_a, lse_a), (o_b, lse_b) = _part(s[..., :cut], v[:cut]), _part(s[..., cut:], v[cut:])
        want_o, want_lse = _part(s, v)
        inputs = [t.clone() for t in (o_a, lse_a, o_b, lse_b)]
        where = _describe_merge(case, o_a, lse_a, o_b, lse_b)
        try:
            got = run.call(fn, *inputs)
        except StudentError as raised:
            hint = raised_hint(raised, "my_merge_states(o_a, lse_a, o_b, lse_b) -> (o, lse)")
            hint += "; o_a, o_b are [..., head_dim] and lse_a, lse_b [...]"
            if "must match the size" in str(raised) or "broadcast" in str(raised):
                hint = "a weight [...] multiplies o [..., head_dim]: unsqueeze it over head_dim (w[..., None] * o_a)"
            return Failure(where, "a result", f"raised {raised}", hint)
        if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
            return Failure(
                where,
                "a tuple (o, lse) of tensors",
                f"{type(got).__name__}: {got!r}"[:200],
                "return both the merged output and its lse: return o, lse",
            )
        o, lse = got
        if any(not torch.equal(a, b) for a, b in zip(inputs, (o_a, lse_a, o_b, lse_b)) if a.isfinite().all()):
            return Failure(
                where,
                "o_a, lse_a, o_b, lse_b unchanged",
                "the inputs were changed in place",
                "merge_states must only read its inputs: compute new tensors (no *=, no out=)",
            )
        if o.shape != want_o.shape or lse.shape != want_lse.shape:
            return Failure(
                where,
                f"o {tuple(want_o.shape)}, lse {tuple(want_lse.shape)}",
                f"o {tuple(o.shape)}, lse {tuple(lse.shape)}",
                "o has the shape of o_a and lse that of lse_a: each part's weight [...] is unsqueezed "
                "over head_dim (w[..., None] * o_a)",
            )
        if o.dtype != torch.float64 or lse.dtype != torch.float64:
            return Failure(
                where,
                "float64 o and lse (the inputs' dtype)",
                f"{o.dtype}, {lse.dtype}",
                "compute in the inputs' dtype: float64 in, float64 out",
            )
        if _close(o, want_o) and _close(lse, want_lse):
            return None
        expected = f"o = {want_o.flatten()[:4].tolist()}..., lse = {want_lse.flatten()[:3].tolist()}"
        shown = f"o = {o.flatten()[:4].tolist()}..., lse = {lse.flatten()[:3].tolist()}"
        if not (o.isfinite().all() and lse.isfinite().all()):
            hint = (
                "subtract the larger lse first: m = max(lse_a, lse_b), w = exp2(lse - m); exp2 of +-1000 "
                "overflows or underflows, and an empty part (lse = -inf) must weigh 0, not give nan"
            )
            return Failure(where, expected, shown + " (not finite)", hint)
        for variant, (vo, vl) in _merge_variants(o_a, lse_a, o_b, lse_b).items():
            if _close(o, vo) and (_close(lse, vl) or _close(lse, want_lse)) and not _close(o, want_o):
                return Failure(where, expected, shown, _MERGE_HINTS[variant])
            if _close(lse, vl) and not _close(lse, want_lse) and _close(o, want_o):
                return Failure(where, expected, shown, _MERGE_HINTS[variant])
        if s.dim() > 1 and o.shape[-1] == s.shape[-2] and not _close(o, want_o):
            hint = (
                "each row's weight multiplies its own output row: unsqueeze the weights over head_dim "
                "(w[..., None] * o_a), or they broadcast along head_dim"
            )
        else:
            hint = (
                "w_a = exp2(lse_a - m), w_b = exp2(lse_b - m) with m = max(lse_a, lse_b); o = (w_a o_a + w_b o_b) "
                "/ (w_a + w_b); lse = m + log2(w_a + w_b)"
            )
        return Failure(where, expected, shown, hint)

    return run_cases(
        "merge_states",
        _merge_cases(),
        check_one,
        lambda c: c[0],
        "called with float64 o [..., D] and lse [...] of two parts",
        time_limit=time_limit,
    )


def _describe_merge(case, o_a, lse_a, o_b, lse_b) -> str:
    name, s, v, cut = case
    return (
        f"{name}: scores {tuple(s.shape)}, keys 0..{cut - 1} in part a, {cut}..{s.shape[-1] - 1} in part b\n"
        f"lse_a = {lse_a.flatten()[:3].tolist()}, lse_b = {lse_b.flatten()[:3].tolist()}"
    )


# ---------------------------------------------------------------------------------------- Quest
def _quest_cases():
    g = torch.Generator().manual_seed(1)
    cases = []
    for seq_len, ps, hkv, hq, d, budget in (
        (8, 4, 1, 1, 2, 1),
        (13, 4, 1, 2, 3, 2),
        (23, 4, 2, 4, 4, 3),
        (30, 8, 2, 2, 4, 2),
        (41, 4, 2, 6, 8, 4),
        (17, 2, 1, 3, 2, 5),
        (6, 4, 2, 2, 4, 3),  # fewer pages than the budget: every page
        (64, 16, 4, 8, 8, 2),
    ):
        k = torch.randn(seq_len, hkv, d, generator=g, dtype=torch.float64)
        k = k + torch.randn(1, hkv, d, generator=g, dtype=torch.float64)  # keys of a head share an offset
        q = torch.randn(hq, d, generator=g, dtype=torch.float64) * 2
        cases.append((seq_len, ps, k, q, budget))
    return cases


def _ref_summaries(k, ps):
    """`paged_ref.page_summaries.PageSummaries` of keys ``k [seq_len, Hkv, D]`` written at slots 0, 1, ..."""
    seq_len, hkv, d = k.shape
    s = PageSummaries(
        num_layers=1, num_pages=cdiv(seq_len, ps), num_kv_heads=hkv, head_dim=d, page_size=ps, dtype=k.dtype
    )
    s.update(0, torch.arange(seq_len), k)
    return s.k_min[0], s.k_max[0]


def _ref_select(q, k_min, k_max, budget):
    hq, d = q.shape
    num_pages, hkv, _ = k_min.shape
    if num_pages <= budget:
        return torch.arange(num_pages).expand(hkv, num_pages)
    qg = q.view(hkv, hq // hkv, d)  # [Hkv, group, D]
    bounds = page_bounds(qg[:, :, None], k_min.transpose(0, 1)[:, None], k_max.transpose(0, 1)[:, None])
    return select_pages(bounds.amax(1), budget)  # [Hkv, budget]


def _summary_hint(k, ps, k_min, k_max, want_min, want_max) -> str:
    n = k.shape[0]
    if n % ps:
        padded = torch.cat([k, k.new_zeros(ps - n % ps, *k.shape[1:])])
        pmin, pmax = _ref_summaries(padded, ps)
        if torch.allclose(k_min, pmin) and torch.allclose(k_max, pmax):
            return (
                "the last page holds only its own tokens: min and max over them alone (padding it with zeros "
                "moves both towards 0)"
            )
    if torch.allclose(k_min, want_min.amin(-1, keepdim=True).expand_as(want_min)):
        return "per channel: each of the head_dim coordinates has its own min and max (reduce over tokens only)"
    if torch.allclose(k_min, want_min.amin(1, keepdim=True).expand_as(want_min)):
        return "per KV head: each head has its own keys and its own bounds (reduce over tokens only, not heads)"
    if torch.allclose(k_min, want_max) and torch.allclose(k_max, want_min):
        return "k_min is the smallest key coordinate, k_max the largest: they are swapped"
    return "k_min[p, h, i] = min over the tokens t of page p of k[t, h, i]; k_max the same with max"


def _bound_hint(q, lo, hi, got) -> str:
    if torch.allclose(got, (q * hi).sum(-1)):
        return "a negative q_i takes the key's smallest coordinate: sum over i of max(q_i * k_min_i, q_i * k_max_i)"
    if torch.allclose(got, (q * (lo + hi) / 2).sum(-1)):
        return "the centre of the box is not an upper bound: sum over i of max(q_i * k_min_i, q_i * k_max_i)"
    if torch.allclose(got, (q.abs() * torch.maximum(lo.abs(), hi.abs())).sum(-1)):
        return (
            "|q| . max(|k_min|, |k_max|) is a bound but not Quest's tightest one: sum over i of "
            "max(q_i * k_min_i, q_i * k_max_i)"
        )
    return "the bound is sum over i of max(q_i * k_min_i, q_i * k_max_i), each coordinate at its own best corner"


def _select_hint(q, k_min, k_max, budget, got, want) -> str:
    hq, d = q.shape
    num_pages, hkv, _ = k_min.shape
    if got.shape != want.shape:
        if got.shape[-1] == want.shape[-1] + 1:
            return "the newest page counts in the budget: budget pages in all, the last page one of them"
        if num_pages <= budget:
            return "when the sequence holds at most budget pages, every page is read"
        return f"one row per KV head with min(budget, num_pages) pages: [{hkv}, {min(budget, num_pages)}]"
    if torch.equal(got.sort(-1).values, want) and not torch.equal(got, want):
        return "return the chosen pages in increasing order (the order a kernel reads them): sort them"
    if (got[:, -1] != num_pages - 1).any() or not (got == num_pages - 1).any(-1).all():
        return "the last page holds the newest tokens and is always read, whatever its bound"
    qg = q.view(hkv, hq // hkv, d)
    bounds = page_bounds(qg[:, :, None], k_min.transpose(0, 1)[:, None], k_max.transpose(0, 1)[:, None])
    variants = {
        "mean": select_pages(bounds.mean(1), budget),
        "low": _lowest(bounds.amax(1), budget),
        "mod": select_pages(
            page_bounds(
                q.view(hq // hkv, hkv, d).transpose(0, 1)[:, :, None],
                k_min.transpose(0, 1)[:, None],
                k_max.transpose(0, 1)[:, None],
            ).amax(1),
            budget,
        ),
    }
    if torch.equal(got, variants["low"]):
        return "take the pages with the LARGEST bounds (the keys that may score highest), not the smallest"
    if torch.equal(got, variants["mod"]):
        return "query head h reads KV head h // (num_q_heads // num_kv_heads), not h % num_kv_heads"
    if torch.equal(got, variants["mean"]):
        return "a page's score for a KV head is the LARGEST bound among its query heads, not their sum or mean"
    return "per KV head: the budget pages with the largest bound over its query heads, the last page always"


def _lowest(bounds, budget):
    """The pages with the smallest bounds (and the last page): a wrong choice the hints name."""
    return select_pages(-bounds, budget)


def check_quest(cls, *, time_limit: float | None = DEFAULT_TIME_LIMIT_S) -> CheckReport:
    """Check exercise 7's Quest class (``summaries``, ``bound``, ``select``; see the module docstring)."""
    quest = None

    def check_one(case, run):
        nonlocal quest
        seq_len, ps, k, q, budget = case
        if quest is None:
            quest = run.call(cls)
        where = (
            f"seq_len={seq_len}, page_size={ps}, k [{seq_len}, {k.shape[1]}, {k.shape[2]}], "
            f"q [{q.shape[0]}, {q.shape[1]}], budget={budget}"
        )
        want_min, want_max = _ref_summaries(k, ps)
        try:
            got = run.call(lambda: quest.summaries(k.clone(), ps))
        except StudentError as raised:
            return Failure(
                f"summaries(k, {ps}); {where}",
                "a result",
                f"raised {raised}",
                raised_hint(raised, "summaries(k [seq_len, num_kv_heads, head_dim], page_size) -> (k_min, k_max)"),
            )
        if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
            return Failure(
                f"summaries(k, {ps}); {where}",
                "a tuple (k_min, k_max) of tensors",
                f"{type(got).__name__}"[:100],
                "summaries returns both bounds: return k_min, k_max",
            )
        k_min, k_max = got
        if k_min.shape != want_min.shape or k_max.shape != want_max.shape:
            return Failure(
                f"summaries(k, {ps}); {where}",
                f"k_min, k_max {tuple(want_min.shape)}",
                f"{tuple(k_min.shape)}, {tuple(k_max.shape)}",
                "one row per page, ceil(seq_len / page_size) pages (the last one may be partial), "
                "then [num_kv_heads, head_dim]",
            )
        if not (torch.allclose(k_min.double(), want_min) and torch.allclose(k_max.double(), want_max)):
            return Failure(
                f"summaries(k, {ps}); {where}",
                f"k_min[0, 0] = {want_min[0, 0].tolist()}",
                f"k_min[0, 0] = {k_min[0, 0].tolist()}",
                _summary_hint(k, ps, k_min.double(), k_max.double(), want_min, want_max),
            )
        # the bound: every query head against every page of its KV head
        hkv = k.shape[1]
        qg = q.view(hkv, -1, q.shape[-1])[:, :, None]  # [Hkv, group, 1, D]
        lo, hi = want_min.transpose(0, 1)[:, None], want_max.transpose(0, 1)[:, None]  # [Hkv, 1, P, D]
        want_bound = page_bounds(qg, lo, hi)  # [Hkv, group, P]
        call = f"bound(q, k_min, k_max) of each query head and page; {where}"
        try:
            bound = run.call(lambda: quest.bound(qg.clone(), lo.clone(), hi.clone()))
        except StudentError as raised:
            interface = "bound(q, k_min, k_max) with q [Hkv, group, 1, D] and k_min, k_max [Hkv, 1, P, D] here"
            return Failure(call, "a result", f"raised {raised}", raised_hint(raised, interface))
        if not isinstance(bound, torch.Tensor):
            return Failure(
                call,
                f"a tensor {tuple(want_bound.shape)}",
                type(bound).__name__,
                "bound returns a tensor (torch operations all the way: no .tolist(), .item() or Python loop "
                "building a list)",
            )
        if bound.shape != want_bound.shape:
            return Failure(
                call,
                f"a tensor {tuple(want_bound.shape)}",
                f"{tuple(bound.shape)}",
                "bound sums over the last dimension (head_dim) of the broadcast q, k_min, k_max",
            )
        scores = torch.einsum("hgd,thd->hgt", qg[:, :, 0], k)  # [Hkv, group, seq_len]: the real q . k
        page_of = torch.arange(seq_len) // ps
        below = scores > bound.double()[:, :, page_of] + 1e-9
        if below.any():
            h, g_, t = (int(x) for x in below.nonzero()[0])
            return Failure(
                call,
                f"bound >= every real score of the page (token {t}: q . k = {scores[h, g_, t]:.4f})",
                f"bound {float(bound[h, g_, t // ps]):.4f} on page {t // ps}",
                _bound_hint(qg, lo, hi, bound.double()),
            )
        if not torch.allclose(bound.double(), want_bound):
            return Failure(
                call,
                f"{want_bound.flatten()[:4].tolist()}...",
                f"{bound.flatten()[:4].tolist()}...",
                _bound_hint(qg, lo, hi, bound.double()),
            )
        want_sel = _ref_select(q, want_min, want_max, budget)
        call = f"select(q, k_min, k_max, budget={budget}) over {want_min.shape[0]} pages; {where}"
        try:
            sel = run.call(lambda: quest.select(q.clone(), want_min.clone(), want_max.clone(), budget))
        except StudentError as raised:
            hint = raised_hint(
                raised, "select(q [num_q_heads, head_dim], k_min, k_max [num_pages, num_kv_heads, head_dim], budget)"
            )
            if want_min.shape[0] <= budget:
                hint = "when the sequence holds at most budget pages, every page is read: return them all"
            return Failure(call, f"{want_sel.tolist()}", f"raised {raised}", hint)
        if not isinstance(sel, torch.Tensor) or sel.dtype != torch.int64:
            what = f"{sel.dtype} tensor" if isinstance(sel, torch.Tensor) else type(sel).__name__
            return Failure(
                call,
                f"an int64 tensor {tuple(want_sel.shape)}",
                what,
                "select returns int64 page indices, one row per KV head",
            )
        if sel.shape != want_sel.shape or not torch.equal(sel, want_sel):
            return Failure(
                call,
                f"{want_sel.tolist()}",
                f"{sel.tolist()}",
                _select_hint(q, want_min, want_max, budget, sel, want_sel),
            )
        return None

    return run_cases(
        "quest",
        _quest_cases(),
        check_one,
        lambda c: f"seq_len={c[0]}, page_size={c[1]}, budget={c[4]}",
        "summaries(k, page_size), bound(q, k_min, k_max) and select(q, k_min, k_max, "
        "budget) are called with float64 tensors; see the exercise for their shapes",
        time_limit=time_limit,
    )
