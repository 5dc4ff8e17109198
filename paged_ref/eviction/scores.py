"""Token and page importance scores read from cached K/V (no attention weights needed).

PagedEviction (arXiv 2509.04377) keeps a token with a small key norm (high attention, earlier
work) and a large value norm: ``S_i = ||V_i|| / ||K_i||``, ``"value_key_ratio"``. The ratio is
asserted, not derived, so `SCORE_METHODS` holds its ablations: ``"inverse_key_norm"`` (1/||K||,
the K-only baseline), ``"value_norm"`` (V only), ``"key_norm"`` (the K-only opposite),
``"key_value_ratio"`` (||K||/||V||: what the authors' vLLM code computes, its arguments swapped)
and ``"random"``. Norms are taken per KV head, then averaged over heads; a zero divisor is
clamped to ``EPS``. Higher scores are kept.

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


def token_scores(k: torch.Tensor, v: torch.Tensor, method: str = "value_key_ratio") -> torch.Tensor:
    """float32 ``[num_tokens]``: the importance of each token of one layer's cached
    ``k, v: [num_tokens, num_kv_heads, head_dim]`` (K after RoPE, as cached); higher = keep.
    ``"random"`` draws from torch's global RNG (a policy draws from its own generator instead).
    """
    _check_kv(k, v)
    check_choice("method", method, SCORE_METHODS)
    if method == "random":
        return torch.rand(k.shape[0]).to(k.device)  # [num_tokens]
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
    """``[ceil(num_tokens / page_size)]``: the mean (PagedEviction) or sum of the scores of each
    logical page's tokens, from ``token_scores: [num_tokens]`` in logical order. A partial last
    page counts its valid tokens only.
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
    counts = (n - torch.arange(num_pages, device=sums.device) * page_size).clamp(max=page_size)  # tokens per page
    return sums / counts
