"""Checkers for PagedEviction's token and page scores (exercise 4's first two functions).

`check_token_scores` checks a student's ``||V|| / ||K||`` token score and `check_page_scores`
the mean score of each page's tokens, both against `paged_ref.eviction.scores` on random
inputs (partial last pages included).
"""

from __future__ import annotations

import torch

from ...eviction.scores import page_scores, token_scores
from .report import DEFAULT_TIME_LIMIT_S, Failure, run_cases

__all__ = ["check_page_scores", "check_token_scores"]


def _kv_cases(seed: int):
    """(k, v) pairs ``[T, Hkv, D]``, smallest first, with norms that differ token to token."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for num_tokens, heads, dim in ((1, 1, 2), (3, 1, 4), (5, 2, 4), (16, 2, 8), (40, 3, 16), (64, 4, 8)):
        k = torch.randn(num_tokens, heads, dim, generator=gen) * torch.rand(num_tokens, heads, 1, generator=gen) * 4
        v = torch.randn(num_tokens, heads, dim, generator=gen) * torch.rand(num_tokens, heads, 1, generator=gen) * 4
        cases.append((k + 0.01, v + 0.01))  # no zero norms
    return cases


def _describe_kv(case) -> str:
    k, v = case
    lines = [f"k, v of shape {list(k.shape)} [num_tokens, num_kv_heads, head_dim]"]
    if k.numel() <= 8:
        lines += [f"k = {_round(k)}", f"v = {_round(v)}"]
    else:  # the per-head norms of the first tokens: what the score is made of
        shown = min(3, k.shape[0])
        lines += [
            f"||k|| per head, tokens 0..{shown - 1}: {_round(k[:shown].norm(dim=-1))}",
            f"||v|| per head, tokens 0..{shown - 1}: {_round(v[:shown].norm(dim=-1))}",
        ]
    return "\n".join(lines)


def _round(t: torch.Tensor) -> list:
    return torch.round(t.detach().float() * 1e4).div(1e4).tolist()


def _fmt(t: torch.Tensor) -> str:
    return str([round(x, 4) for x in t.flatten()[:6].tolist()]) + (" ..." if t.numel() > 6 else "")


def _score_tensor(out, n: int):
    """The student's scores as a float tensor, or a (got, hint) pair saying why not."""
    if out is None:
        return "None", "the function returned None: does it end without `return`?"
    if isinstance(out, torch.Tensor) and out.device.type == "meta":
        return "a tensor on the meta device", "compute the scores from the inputs: a meta tensor holds no numbers"
    if not isinstance(out, torch.Tensor):
        return f"a {type(out).__name__}", f"return a float tensor [{n}]"
    return out.detach().float().cpu()


def check_token_scores(fn, *, seed: int = 0, time_limit: float | None = DEFAULT_TIME_LIMIT_S):
    """Check ``fn(k, v) -> [num_tokens]``: PagedEviction's ||V|| / ||K|| per head, averaged over heads.

    Tolerance: relative 1e-4 (float32 inputs).
    """

    def one(case, run):
        k, v = case
        want = token_scores(k, v, "value_key_ratio")
        got = _score_tensor(run.call(fn, k.clone(), v.clone()), k.shape[0])
        if isinstance(got, tuple):
            return Failure(_describe_kv(case), _fmt(want), *got)
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-6):
            return None
        if got.shape == want.shape and torch.allclose(got, token_scores(v, k, "value_key_ratio"), rtol=1e-4):
            hint = "the ratio is inverted: the score is ||V|| / ||K|| (keep tokens with large values, small keys)"
        elif got.shape == want.shape and torch.allclose(
            got, v.norm(dim=(1, 2)) / k.norm(dim=(1, 2)).clamp_min(1e-12), rtol=1e-4
        ):
            hint = "take the norms per head (over head_dim), the ratio per head, then the mean over heads"
        elif got.shape != want.shape:
            hint = f"one score per token: shape [{k.shape[0]}]"
        else:
            hint = "per token and head: ||v|| / ||k|| over head_dim; then the mean over the heads"
        return Failure(_describe_kv(case), _fmt(want), _fmt(got), hint)

    return run_cases(
        "token_scores",
        _kv_cases(seed),
        one,
        _describe_kv,
        "fn(k, v) returns a [num_tokens] tensor",
        time_limit=time_limit,
    )


def check_page_scores(fn, *, seed: int = 0, time_limit: float | None = DEFAULT_TIME_LIMIT_S):
    """Check ``fn(token_scores, page_size) -> [num_pages]``: the mean score of the tokens each page holds.

    Tolerance: relative 1e-5 (float32 inputs).
    """
    gen = torch.Generator().manual_seed(seed)
    cases = [(torch.rand(n, generator=gen), p) for n, p in ((1, 1), (4, 2), (5, 2), (7, 4), (16, 4), (33, 8), (50, 16))]

    def describe(case):
        scores, page_size = case
        return f"token_scores={_fmt(scores)} ({scores.numel()} tokens), page_size={page_size}"

    def one(case, run):
        scores, page_size = case
        want = page_scores(scores, page_size)
        got = _score_tensor(run.call(fn, scores.clone(), page_size), want.shape[0])
        if isinstance(got, tuple):
            return Failure(describe(case), _fmt(want), *got)
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-7):
            return None
        if got.shape != want.shape:
            hint = "one score per page, ceil(num_tokens / page_size) pages (a partial last page counts)"
        else:
            hint = "average each page over the tokens it holds: the last page may hold fewer than page_size"
        return Failure(describe(case), _fmt(want), _fmt(got), hint)

    return run_cases(
        "page_scores",
        cases,
        one,
        describe,
        "fn(token_scores, page_size) returns a [num_pages] tensor",
        time_limit=time_limit,
    )
