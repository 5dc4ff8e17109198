"""Attention over a paged KV cache: one contract, several implementations.

Every entry point, ``<backend>_paged_decode`` (one new token per sequence) or
``<backend>_paged_prefill`` (several, causal), takes ``q``, ``k_cache`` / ``v_cache``
``[num_pages, page_size, num_kv_heads, head_dim]``, ``block_table [batch, max_pages]`` and
``seq_lens [batch]`` (plus ``q_lens``), runs the same checks (`_checks`) and returns the same
numbers up to rounding: :mod:`.reference` is the oracle the others are tested against (the README's
reading order says what each backend adds). The Triton names load on first use.

8-bit pages (`paged_ref.quant`'s formats) come with ``k_scale``, ``v_scale`` ``[num_pages,
num_kv_heads]``: byte ``x`` of page ``p``, KV head ``h`` is ``x.float() * scale[p, h]``. The reference,
SDPA, the C++ and Triton kernels, the spec, Quest and the reference cascade read them where they lie;
flex dequantizes the used pages first; the Triton cascade refuses them (`_checks.EIGHT_BIT_BACKENDS`).

Example:
    >>> import torch
    >>> from paged_ref import attention
    >>> kc, vc = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    >>> q, bt, lens = torch.randn(2, 4, 16), torch.tensor([[3, 1], [0, 2]]), torch.tensor([12, 5])
    >>> ref = attention.reference_paged_decode(q, kc, vc, bt, lens)
    >>> all(torch.allclose(f(q, kc, vc, bt, lens), ref, atol=1e-5)
    ...     for f in (attention.flex_paged_decode, attention.sdpa_paged_decode,
    ...               attention.paged_decode_spec, attention.triton_paged_decode, attention.cpu_paged_decode))
    True
    >>> k8, s = kc.to(torch.float8_e4m3fn), torch.full((4, 2), 0.5)  # 8-bit pages, a scale per page and KV head
    >>> ref8 = attention.reference_paged_decode(q, k8, k8, bt, lens, k_scale=s, v_scale=s)
    >>> all(torch.allclose(f(q, k8, k8, bt, lens, k_scale=s, v_scale=s), ref8, atol=1e-5)
    ...     for f in (attention.sdpa_paged_decode, attention.cpu_paged_decode, attention.triton_paged_decode))
    True
"""

import importlib

from .cascade import merge_states, reference_cascade_decode
from .cpu_paged import cpu_paged_decode, cpu_paged_prefill
from .flex import flex_paged_decode, flex_paged_prefill, paged_block_masks
from .online_softmax import paged_decode_spec
from .quest import quest_paged_decode
from .reference import gather_sequence, reference_paged_decode, reference_paged_prefill
from .sdpa import sdpa_paged_decode, sdpa_paged_prefill

_LAZY = {"triton_paged_decode": "triton_decode", "triton_cascade_decode": "triton_cascade"}  # modules importing triton


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["cpu_paged_decode", "cpu_paged_prefill", "flex_paged_decode", "flex_paged_prefill", "gather_sequence"]
__all__ += ["merge_states", "paged_block_masks", "paged_decode_spec", "quest_paged_decode", "reference_cascade_decode"]
__all__ += ["reference_paged_decode", "reference_paged_prefill", "sdpa_paged_decode", "sdpa_paged_prefill"]
__all__ += ["triton_cascade_decode", "triton_paged_decode"]
