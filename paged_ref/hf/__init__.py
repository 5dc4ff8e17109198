"""Hugging Face transformers integration: a real model generates from the paged KV cache.

No model code is copied. `PagedCache` (a transformers `Cache`) writes each layer's new K/V into the
pages; `paged_attention_forward`, registered in `transformers.AttentionInterface` as ``"paged_ref"``,
reads them back through a chosen backend; `PagedSession` lays out each forward and frees pages.
`generate` (and its iterator form `stream`) returns ``model.generate``'s tokens for the same
arguments: greedy, seeded sampling (the samples of a prompt share its pages) and beam search (the
beams share pages copy-on-write); `beam_search` also returns the scores and each step's pages.
"""

from .attention import (
    ATTN_IMPLEMENTATION,
    BACKENDS,
    Backend,
    auto_backend,
    get_backend,
    paged_attention_forward,
    register,
    register_backend,
)
from .beam import BeamSearchOutput, BeamStep, beam_search
from .cache import PagedCache, StepPlan
from .generate import generate, stream
from .session import PagedSession

__all__ = ["ATTN_IMPLEMENTATION", "BACKENDS", "Backend", "auto_backend", "get_backend", "register_backend"]
__all__ += ["BeamSearchOutput", "BeamStep", "PagedCache", "PagedSession", "StepPlan", "beam_search", "generate"]
__all__ += ["paged_attention_forward", "register", "stream"]
