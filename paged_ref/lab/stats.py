"""The statistics the benchmarks and notebooks report, each answering one question.

* `spearman`: do two scores put items in the same order (rank correlation)?
* `jaccard`: how much do two kept sets share?
* `wilson`: which true success rates is k successes out of n compatible with (95%)?
* `mean_ci`: the mean of paired differences and its 95% Student t interval.
* `mcnemar_p`: exact McNemar test on the discordant pairs of two paired binary outcomes.

Plain Python and torch; no SciPy.

Example:
    >>> [round(x, 3) for x in wilson(6, 10)]
    [0.313, 0.832]
    >>> round(mcnemar_p(8, 1), 4)
    0.0391
"""

from __future__ import annotations

import math

import torch

__all__ = ["spearman", "jaccard", "wilson", "mean_ci", "mcnemar_p"]

# two-sided 95% Student t quantiles for 1..30 degrees of freedom (beyond: the normal's 1.96)
_T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]
_Z975 = 1.959964


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


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a & b| / |a | b| of two bool masks of one shape (two empty sets give 0.0).

    Example:
        >>> jaccard(torch.tensor([True, True, False]), torch.tensor([True, False, True]))
        0.3333333333333333
    """
    if a.dtype != torch.bool or b.dtype != torch.bool or a.shape != b.shape:
        raise ValueError(
            f"a and b must be bool masks of one shape, got {a.dtype} {list(a.shape)} and {b.dtype} {list(b.shape)}"
        )
    return float((a & b).sum()) / max(1, int((a | b).sum()))


def wilson(successes: int, n: int, z: float = _Z975) -> tuple[float, float]:
    """Wilson score interval (95% by default) for ``successes`` out of ``n`` trials.

    Unlike p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and is not empty at 0/n or n/n.
    With no trials it is (0, 1): nothing is known.
    """
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, center - half), min(1.0, center + half))


def mean_ci(xs) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``xs`` and its 95% Student t interval (nan for one value).

    Example:
        >>> [round(x, 3) for x in mean_ci([1.0, 2.0, 3.0])]
        [2.0, -0.484, 4.484]
    """
    n = len(xs)
    if n == 0:
        raise ValueError("xs must hold at least one value")
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else _Z975) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def mcnemar_p(b: int, c: int) -> float:
    """Exact McNemar test: the two-sided binomial p-value of a ``b`` : ``c`` split of the
    discordant pairs (trials only one of two paired methods got right), if each went either
    way with probability 1/2."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)
