"""Attention over a paged KV cache: one contract, four implementations.

Every entry point takes the same arguments, ``q``, ``k_cache`` / ``v_cache`` of shape
``[num_pages, page_size, num_kv_heads, head_dim]``, ``block_table`` ``[batch, max_pages]`` and
``seq_lens`` ``[batch]`` (plus ``q_lens`` for prefill), runs the same checks at the door
(`_checks`) and returns the same numbers up to rounding. They are named
``<backend>_paged_decode`` (one new query token per sequence) and ``<backend>_paged_prefill``
(several, causal).

Read them in this order:

1. :mod:`.reference`: gather each sequence's pages, then plain softmax attention
   (:func:`reference_paged_decode`, :func:`reference_paged_prefill`). The oracle every other
   path is checked against.
2. :mod:`.online_softmax`: the same decode computed tile by tile with a running max and sum,
   split over chunks and merged (:func:`paged_decode_spec`): the kernel's algorithm in PyTorch.
3. :mod:`.triton_decode`: that algorithm as a Triton kernel reading K/V straight from the pages
   (:func:`triton_paged_decode`; on CPU tensors it runs in Triton's interpreter), its split count
   picked by :mod:`.occupancy` (programs per SM, waves, bytes in flight).

and, from the reference on a second branch:

4. :mod:`.flex`: FlexAttention over the whole cache with a BlockMask translated from logical
   to physical pages (:func:`flex_paged_decode`, :func:`flex_paged_prefill`);
   `paged_ref.lab.flex_inspect` replays a BlockMask token by token to check and draw it.

:mod:`.cascade` reads fewer pages when requests share a prefix: the shared pages once for all
of the group's queries, each suffix alone, the two ``(output, lse)`` states merged with split-K's
rule (:func:`merge_states`, :func:`reference_cascade_decode`; in Triton
:func:`triton_cascade_decode`). :mod:`.quest` reads fewer pages per query: only the pages whose
key bounds promise the largest scores (:func:`quest_paged_decode`).

:mod:`.sdpa` is the CPU fast path: gather the batch's K/V by slot, then PyTorch's
``scaled_dot_product_attention`` (:func:`sdpa_paged_decode`, :func:`sdpa_paged_prefill`);
:func:`.sdpa.sdpa_fused_paged_decode` runs a batch's decode in one fused CPU kernel call.

:mod:`.triton_decode` and :mod:`.triton_cascade` import triton, so their names load on first use.

Example:
    >>> import torch
    >>> from paged_ref import attention
    >>> kc, vc = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    >>> q, bt, lens = torch.randn(2, 4, 16), torch.tensor([[3, 1], [0, 2]]), torch.tensor([12, 5])
    >>> ref = attention.reference_paged_decode(q, kc, vc, bt, lens)
    >>> all(torch.allclose(f(q, kc, vc, bt, lens), ref, atol=1e-5)
    ...     for f in (attention.flex_paged_decode, attention.sdpa_paged_decode,
    ...               attention.paged_decode_spec, attention.triton_paged_decode))
    True
"""

import importlib

from .cascade import merge_states, reference_cascade_decode
from .flex import flex_paged_decode, flex_paged_prefill, paged_block_masks
from .online_softmax import paged_decode_spec
from .quest import quest_paged_decode
from .reference import (
    gather_sequence,
    reference_paged_decode,
    reference_paged_prefill,
)
from .sdpa import sdpa_paged_decode, sdpa_paged_prefill

_LAZY = {"triton_paged_decode": "triton_decode", "triton_cascade_decode": "triton_cascade"}  # modules importing triton


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "flex_paged_decode",
    "flex_paged_prefill",
    "gather_sequence",
    "merge_states",
    "paged_block_masks",
    "paged_decode_spec",
    "quest_paged_decode",
    "reference_cascade_decode",
    "reference_paged_decode",
    "reference_paged_prefill",
    "sdpa_paged_decode",
    "sdpa_paged_prefill",
    "triton_cascade_decode",
    "triton_paged_decode",
]
