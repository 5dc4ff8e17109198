"""Block-wise KV eviction (PagedEviction) with its baselines and ablations.

- `scores`: token scores from cached K/V (``value_key_ratio`` = ||V||/||K||, and the ablations)
  and page scores (mean or sum over a page's tokens).
- `policies`: eviction policies over a `PagedKVCache` sequence, with the hooks a generation loop
  calls (`after_prefill`, `after_append`), one shared decision per sequence for all layers;
  `Reserved` names the pages a policy never evicts (PagedEviction: the first and the newest).

Example:
    >>> from paged_ref.eviction import make_policy
    >>> make_policy("streaming_llm", budget=64)
    StreamingLLM(budget=64, sink_tokens=4)
"""

from .policies import (
    POLICY_NAMES,
    EvictionPolicy,
    EvictionStats,
    FullCache,
    PagedEviction,
    Reserved,
    StreamingLLM,
    TokenTopK,
    make_policy,
    max_pages_held,
    resolve_policy,
    sequence_scores,
)
from .scores import EPS, SCORE_METHODS, page_scores, token_scores

__all__ = [
    "EPS",
    "POLICY_NAMES",
    "SCORE_METHODS",
    "EvictionPolicy",
    "EvictionStats",
    "FullCache",
    "PagedEviction",
    "Reserved",
    "StreamingLLM",
    "TokenTopK",
    "make_policy",
    "max_pages_held",
    "page_scores",
    "resolve_policy",
    "sequence_scores",
    "token_scores",
]
