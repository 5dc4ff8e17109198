"""Eviction scores on real K/V, per layer: how the ratio relates to its parts, and what one
decision shared by all layers costs; the ablations' names and the order of policies in tables.

Every function takes per-layer K/V lists ``ks, vs`` with
``ks[layer], vs[layer]: [num_tokens, num_kv_heads, head_dim]`` (the model's cached K after RoPE
and V, e.g. from `paged_ref.lab.likelihood.prompt_kv`), so tests can pass synthetic ones.

Example:
    >>> import torch
    >>> ks = [torch.randn(64, 2, 8) for _ in range(3)]; vs = [torch.randn(64, 2, 8) for _ in range(3)]
    >>> layer_scores(ks, vs)["value_key_ratio"].shape     # [num_layers, num_tokens]
    torch.Size([3, 64])
"""

from __future__ import annotations

import numpy as np
import torch

from .._validate import check_int
from ..eviction.scores import token_scores
from .stats import jaccard, spearman

__all__ = [
    "ABLATIONS",
    "check_kv_lists",
    "layer_scores",
    "policy_order",
    "score_correlations",
    "top_mask",
    "layer_agreement",
    "swap_check",
]

#: The reviewers' ablation: the ratio against V only, K only (inverse norm), its opposite, the
#: swapped ratio ||K||/||V|| (what the authors' vLLM code computes) and random.
ABLATIONS = ("value_norm", "inverse_key_norm", "key_norm", "key_value_ratio", "random")


def policy_order(policy: str) -> int:
    """Where ``policy`` goes in tables and legends: the full cache, PagedEviction's variants, the
    ablations, then the token-level baselines; names not listed last."""
    known = [
        "full",
        "paged_eviction",
        "paged_eviction_literal",
        "paged_eviction_per_layer",
        "paged_eviction_literal_per_layer",
        *ABLATIONS,
        "streaming_llm",
        "token_topk",
        "token_inverse_key_norm",
    ]
    return known.index(policy) if policy in known else len(known)


def check_kv_lists(ks, vs) -> None:
    if not isinstance(ks, (list, tuple)) or not isinstance(vs, (list, tuple)) or not ks or len(ks) != len(vs):
        raise ValueError(
            f"ks and vs must be non-empty lists of per-layer tensors of equal length, got "
            f"{type(ks).__name__} of {len(ks) if hasattr(ks, '__len__') else '?'} and "
            f"{type(vs).__name__} of {len(vs) if hasattr(vs, '__len__') else '?'}"
        )
    shape = ks[0].shape
    for name, ts in (("ks", ks), ("vs", vs)):
        for i, t in enumerate(ts):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape != shape:
                raise ValueError(
                    f"{name}[{i}] must be a tensor [num_tokens, num_kv_heads, head_dim] shaped like "
                    f"ks[0] {list(shape)}, got {getattr(t, 'shape', type(t).__name__)}"
                )


def layer_scores(ks, vs, methods=("value_key_ratio", "inverse_key_norm", "value_norm", "key_norm")) -> dict:
    """Every requested `token_scores` method on every layer.

    Returns:
        ``{method: float32 [num_layers, num_tokens]}``.
    """
    check_kv_lists(ks, vs)
    return {m: torch.stack([token_scores(k, v, m) for k, v in zip(ks, vs)]) for m in methods}


_PAIRS = (
    ("value_key_ratio", "inverse_key_norm"),
    ("value_key_ratio", "value_norm"),
    ("inverse_key_norm", "value_norm"),
)


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


def top_mask(score: torch.Tensor, budget: int) -> torch.Tensor:
    """bool [n]: the ``budget`` highest scores (stable: among ties the older token wins)."""
    keep = torch.zeros(score.shape[0], dtype=torch.bool)
    keep[torch.sort(score, descending=True, stable=True).indices[:budget]] = True
    return keep


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
    own = [top_mask(s, budget) for s in scores]
    shared = top_mask(scores.mean(0), budget)
    n = len(own)
    pairwise = np.array([[jaccard(own[i], own[j]) for j in range(n)] for i in range(n)])
    means = scores.mean(1)
    return dict(
        pairwise=pairwise, vs_shared=np.array([jaccard(o, shared) for o in own]), weight=(means / means.sum()).numpy()
    )


def swap_check(ks, vs, budget: int) -> dict:
    """The public code's bug, ``||K|| / ||V||`` (arguments swapped), against the paper's ``||V|| / ||K||``.

    Returns per layer: the Spearman correlation of the swapped score with the correct one
    (-1: the order is exactly reversed) and the overlap (Jaccard) of the tokens each keeps at
    budget C; and ``values_replaced_by_keys``: True where scoring V := K gives one constant
    score for every token of a layer (||K|| / ||K|| = 1 carries no information).
    """
    check_kv_lists(ks, vs)
    out = dict(spearman=[], kept_overlap=[], values_replaced_by_keys=[])
    for k, v in zip(ks, vs):
        right, swapped = token_scores(k, v), token_scores(v, k)
        out["spearman"].append(spearman(right, swapped))
        out["kept_overlap"].append(jaccard(top_mask(right, budget), top_mask(swapped, budget)))
        same = token_scores(k, k)
        out["values_replaced_by_keys"].append(bool(torch.allclose(same, torch.ones_like(same))))
    return out
