"""Block-wise KV eviction (PagedEviction) with its baselines and ablations: `scores` reads token and
page scores from cached K/V, `base` holds the hooks a generation loop calls, `policies` decides.

Example:
    >>> from paged_ref.eviction import make_policy
    >>> make_policy("streaming_llm", budget=64)
    StreamingLLM(budget=64, sink_tokens=4)
"""

from .base import EvictionPolicy, EvictionStats, Reserved, max_pages_held, sequence_scores
from .policies import POLICY_NAMES, FullCache, PagedEviction, StreamingLLM, TokenTopK, make_policy, resolve_policy
from .scores import SCORE_METHODS, page_scores, token_scores

__all__ = ["POLICY_NAMES", "SCORE_METHODS", "EvictionPolicy", "EvictionStats", "FullCache", "PagedEviction"]
__all__ += ["Reserved", "StreamingLLM", "TokenTopK", "make_policy", "max_pages_held", "page_scores", "resolve_policy"]
__all__ += ["sequence_scores", "token_scores"]
