"""Token and page importance scores read from cached K/V (no attention weights needed).

PagedEviction (arXiv 2509.04377) scores a cached token ``i`` by ``S_i = ||V_i||_2 / ||K_i||_2``:
a small key norm goes with high attention (earlier work), a large value norm with content
that changes the output. The ratio is asserted, not derived, so the other scores here exist
to ablate it:

==================== ====================================== =============================
method               score of token i (higher = keep)        role
==================== ====================================== =============================
``value_key_ratio``  mean over KV heads of ||V_ih|| / ||K_ih||  PagedEviction
``inverse_key_norm`` mean over KV heads of 1 / ||K_ih||          baseline (K only)
``value_norm``       mean over KV heads of ||V_ih||              ablation (V only)
``key_norm``         mean over KV heads of ||K_ih||              opposite of the K-only score
``key_value_ratio``  mean over KV heads of ||K_ih|| / ||V_ih||  the authors' vLLM code (swapped)
``random``           uniform in [0, 1), seeded                   ablation (no information)
==================== ====================================== =============================

Norms are taken per KV head (each head has its own K/V vector) and then averaged over the
KV heads, so every head weighs the same. A zero key norm is clamped to ``EPS`` so the ratio
stays finite (a zero value norm likewise for ``key_value_ratio``). Note the direction: public
code of the method computes ``||K||/||V||`` (its arguments are passed swapped); here
``value_key_ratio`` is V over K, a test checks that swapping K and V changes the winner, and the
swapped score is kept as its own ablation, ``key_value_ratio``.

Example:
    >>> import torch
    >>> k = torch.ones(3, 1, 4)                        # [num_tokens, num_kv_heads, head_dim]
    >>> v = torch.tensor([1., 3., 2.]).view(3, 1, 1).expand(3, 1, 4)
    >>> token_scores(k, v, "value_key_ratio")          # ||V|| = 2, 6, 4 ; ||K|| = 2
    tensor([1., 3., 2.])
    >>> page_scores(torch.tensor([1., 3., 2., 5., 7.]), page_size=2)   # last page partial
    tensor([2.0000, 3.5000, 7.0000])
"""

from __future__ import annotations

import torch

from .._arith import cdiv
from .._validate import check_choice, check_int

__all__ = ["SCORE_METHODS", "EPS", "token_scores", "page_scores"]

SCORE_METHODS = ("value_key_ratio", "inverse_key_norm", "value_norm", "key_norm", "key_value_ratio", "random")
EPS = 1e-6  # floor on a key norm before dividing by it


def _check_kv(k, v) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor [num_tokens, num_kv_heads, head_dim], got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape [num_tokens, num_kv_heads, head_dim], got {list(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {list(k.shape)} and v {list(v.shape)}")


def token_scores(
    k: torch.Tensor,
    v: torch.Tensor,
    method: str = "value_key_ratio",
    *,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """Importance of each cached token; higher = keep.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, one layer's cached keys (after RoPE,
            as they sit in the cache) and values.
        method: one of ``SCORE_METHODS`` (see the module docstring).
        generator, seed: for ``"random"`` only (give at most one); ``seed`` makes a fresh
            generator, ``generator`` continues an existing one. Neither: torch's global RNG.

    Returns:
        float32 ``[num_tokens]`` on the device of ``k``.

    Example:
        >>> k = torch.tensor([[[3., 4.]], [[0., 1.]]])   # ||K|| = 5, 1
        >>> token_scores(k, k, "inverse_key_norm")
        tensor([0.2000, 1.0000])
    """
    _check_kv(k, v)
    check_choice("method", method, SCORE_METHODS)
    if method != "random" and (generator is not None or seed is not None):
        raise ValueError(f"generator/seed apply to method='random' only, got method={method!r}")
    if method == "random":
        if generator is not None and seed is not None:
            raise ValueError("give generator or seed, not both")
        if seed is not None:
            generator = torch.Generator().manual_seed(check_int("seed", seed, min_value=0))
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        return torch.rand(k.shape[0], generator=generator).to(k.device)  # [num_tokens]
    k_norm = k.float().norm(dim=-1)  # [num_tokens, num_kv_heads]
    v_norm = v.float().norm(dim=-1)  # [num_tokens, num_kv_heads]
    if method == "value_key_ratio":
        per_head = v_norm / k_norm.clamp_min(EPS)
    elif method == "inverse_key_norm":
        per_head = 1.0 / k_norm.clamp_min(EPS)
    elif method == "value_norm":
        per_head = v_norm
    elif method == "key_value_ratio":
        per_head = k_norm / v_norm.clamp_min(EPS)
    else:  # key_norm
        per_head = k_norm
    return per_head.mean(dim=1)  # [num_tokens]


def page_scores(token_scores: torch.Tensor, page_size: int, reduce: str = "mean") -> torch.Tensor:
    """Score of each page: mean (or sum) of the scores of the tokens it holds.

    Logical page ``j`` holds tokens ``j * page_size .. (j + 1) * page_size - 1``; the last page
    may be partial and then only its valid tokens count (its mean is over fewer tokens; its
    sum is smaller, which is one reason ``"mean"`` is the default).

    Args:
        token_scores: ``[num_tokens]`` in the sequence's logical order.
        page_size: tokens per page (the paper's B).
        reduce: ``"mean"`` (PagedEviction) or ``"sum"``.

    Returns:
        ``[ceil(num_tokens / page_size)]`` float tensor.
    """
    if not isinstance(token_scores, torch.Tensor) or token_scores.dim() != 1:
        raise ValueError(
            f"token_scores must be a 1-D tensor [num_tokens], got "
            f"{list(token_scores.shape) if isinstance(token_scores, torch.Tensor) else type(token_scores).__name__}"
        )
    page_size = check_int("page_size", page_size, min_value=1)
    check_choice("reduce", reduce, {"mean", "sum"})
    n = token_scores.shape[0]
    num_pages = cdiv(n, page_size)
    padded = token_scores.new_zeros(num_pages * page_size)
    padded[:n] = token_scores
    sums = padded.view(num_pages, page_size).sum(dim=1)  # [num_pages]
    if reduce == "sum":
        return sums
    counts = torch.full((num_pages,), float(page_size), device=sums.device, dtype=sums.dtype)
    if num_pages and n % page_size:
        counts[-1] = n % page_size
    return sums / counts
