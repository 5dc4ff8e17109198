"""Hugging Face transformers integration: a real model generates from the paged KV cache.

How it hooks into transformers (no model code is copied):

1. `PagedCache` (a `transformers.cache_utils.Cache`) is passed to the model as its cache. Every
   attention layer calls ``cache.update(k, v, layer_idx)`` after RoPE; `PagedCache` writes the
   new tokens' K/V into their pages of a `paged_ref.PagedKVCache`.
2. `paged_attention_forward` is registered in `transformers.AttentionInterface` as
   ``"paged_ref"`` and the model's ``attn_implementation`` is switched to it for the length of
   each paged forward. It reads each sequence's K/V from the pages with the chosen backend
   (``auto`` by default: ``triton`` on CUDA, ``sdpa`` elsewhere; or ``reference``, the oracle,
   ``flex``, ``triton``, ``sdpa``). No attention mask is built for it.
3. `PagedSession` lays out each forward (per-sequence lengths, explicit absolute
   ``position_ids``), builds the step plan both halves share, and frees pages.

Public entry points:

* `generate(model, input_ids, max_new_tokens=...)`: the same tokens as ``model.generate`` with the
  same arguments: greedy, seeded sampling (``do_sample``, ``temperature``, ``top_k``, ``top_p``,
  ``num_return_sequences``: the samples of a prompt share its pages) and beam search
  (``num_beams``: beams share pages copy-on-write); `stream` yields the tokens step by step.
* `beam_search(model, input_ids, num_beams=k, ...)`: beam search with its sequence scores and a
  record of every step's pages (`paged_ref.hf.beam`).

Example:
    >>> import torch
    >>> from paged_ref import hf
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> out = hf.generate(model, torch.tensor([[1, 5, 9]]), max_new_tokens=4, backend="reference")
    >>> out.shape
    torch.Size([1, 7])
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

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BACKENDS",
    "BeamSearchOutput",
    "BeamStep",
    "PagedCache",
    "PagedSession",
    "StepPlan",
    "beam_search",
    "generate",
    "paged_attention_forward",
    "register",
    "get_backend",
    "Backend",
    "register_backend",
    "auto_backend",
    "stream",
]
