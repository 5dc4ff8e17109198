"""Quest as a `paged_ref.hf` backend: each decode step reads only the pages that can matter.

Quest (Tang et al., 2024) keeps the min and max of every page's keys (the cache's
``page_summaries=True``); a query's scores over a page are bounded from them, and decode reads
the ``budget`` pages per sequence and KV head whose bounds are highest
(`paged_ref.attention.quest`). Prefill reads every page, through SDPA. `bench pages` runs
SmolLM2 with it.

Example:
    >>> quest_backend(8).name, quest_backend(8, dense_layers=2).name
    ('quest_8', 'quest_8_dense_2')
"""

from __future__ import annotations

import functools

from .._validate import check_int
from ..attention.quest import quest_paged_decode
from ..hf.attention import BACKENDS, Backend

__all__ = ["quest_backend", "quest_layer_decode"]


def quest_backend(budget: int, *, dense_layers: int = 0) -> Backend:
    """A backend decoding with Quest over ``budget`` pages per sequence and KV head (the first
    ``dense_layers`` layers read every page, as Quest's paper keeps its first two); pass it as ``backend=``."""
    budget = check_int("budget", budget, min_value=1)
    dense_layers = check_int("dense_layers", dense_layers, min_value=0)
    return Backend(
        f"quest_{budget}" + (f"_dense_{dense_layers}" if dense_layers else ""),
        (__name__, "quest_layer_decode"),
        BACKENDS["sdpa"].prefill,
        functools.partial(_prepare, budget=budget, dense_layers=dense_layers),
    )


def _prepare(plan, *, budget: int, dense_layers: int) -> dict:
    summaries = getattr(plan.kv, "summaries", None)
    if summaries is None:
        raise ValueError(
            "the quest backend reads page key summaries: make the cache with "
            "PagedKVCache(..., page_summaries=True) (or PagedKVCache.for_model(..., page_summaries=True))"
        )
    if not plan.is_decode:
        return BACKENDS["sdpa"].prepare(plan)
    # each layer's call finds its summaries by its K cache
    by_cache = {
        k.data_ptr(): (lo, hi, layer < dense_layers)
        for layer, (k, lo, hi) in enumerate(zip(plan.kv.k_cache, summaries.k_min, summaries.k_max))
    }
    return {"summaries": by_cache, "budget": budget, "check_values": False}


def quest_layer_decode(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    summaries,
    budget,
    scale=None,
    check_values=True,
    k_scale=None,
    v_scale=None,
):
    """`quest_paged_decode` with the summaries of the layer whose ``k_cache`` this is (8-bit pages: with their
    ``k_scale`` and ``v_scale``)."""
    k_min, k_max, dense = summaries[k_cache.data_ptr()]
    budget = block_table.shape[1] if dense else min(budget, block_table.shape[1])  # narrower: every page
    return quest_paged_decode(
        q, k_cache, v_cache, block_table, seq_lens, k_min, k_max, budget=budget, scale=scale,
        check_values=check_values, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
