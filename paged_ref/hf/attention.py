"""The attention function transformers calls, registered under the name ``"paged_ref"``.

transformers' attention modules end with
``attention_interface(module, query, key, value, attention_mask, scaling=..., **kwargs)``, where
the function is looked up by ``config._attn_implementation`` in `transformers.AttentionInterface`.
Registering `paged_attention_forward` there and setting the model's implementation to
``"paged_ref"`` routes every layer's attention to the paged kernels, without copying model code.

The function ignores ``key``/``value`` (only the new tokens) and the mask: the step plan, passed
as the extra keyword ``paged_step`` (transformers forwards unknown keywords from the model call
down to the attention function), says where each sequence's K/V live. Because
``"paged_ref"`` has no entry in `AttentionMaskInterface`, transformers builds no mask at all
(`masking_utils` returns early for any implementation without a mask function; written
against 5.24, the same early exit is in the 5.x sources): causality and sequence lengths are
the kernels' job.

Backends (decode = one new token per sequence, prefill = several):

=========== =============================== ===============================
backend     decode                          prefill
=========== =============================== ===============================
reference   paged_attention_reference       paged_prefill_reference
flex        flex_paged_decode               flex_paged_prefill
triton      paged_decode (Triton kernel)    sdpa_paged_prefill
sdpa        sdpa_paged_decode               sdpa_paged_prefill
auto        ``triton`` on CUDA, ``sdpa`` elsewhere (the default)
=========== =============================== ===============================

Two more, ``mistake_off_by_one`` and ``mistake_wrong_page``, are wrong on purpose: negative
controls that show how far a real bug moves the results (`paged_ref.hf.mistakes`).

Triton has no prefill kernel here: prefill is compute-bound and runs once per prompt, so the
``triton`` backend prefills through SDPA. ``sdpa`` (`paged_ref.hf.sdpa`) gathers the batch's
tokens by slot and calls PyTorch's SDPA: the fast path on a CPU, where the Triton kernel only
runs in the interpreter. ``reference`` is the oracle every other backend is tested against.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

__all__ = ["ATTN_IMPLEMENTATION", "AUTO", "BACKENDS", "auto_backend", "resolve_backend", "step_kwargs", "paged_attention_forward", "register"]

ATTN_IMPLEMENTATION = "paged_ref"

# backend -> ((module, decode function), (module, prefill function)); imported lazily so that a
# missing optional dependency (triton) only matters to the backend that needs it
BACKENDS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "reference": (("paged_ref.attention.reference", "paged_attention_reference"),
                  ("paged_ref.attention.reference", "paged_prefill_reference")),
    "flex": (("paged_ref.attention.flex", "flex_paged_decode"), ("paged_ref.attention.flex", "flex_paged_prefill")),
    "triton": (("paged_ref.attention.triton_decode", "paged_decode"),
               ("paged_ref.hf.sdpa", "sdpa_paged_prefill")),
    "sdpa": (("paged_ref.hf.sdpa", "sdpa_paged_decode"), ("paged_ref.hf.sdpa", "sdpa_paged_prefill")),
    # negative controls (`paged_ref.hf.mistakes`): wrong on purpose, to show what a real bug does
    "mistake_off_by_one": (("paged_ref.hf.mistakes", "off_by_one_decode"),
                           ("paged_ref.attention.reference", "paged_prefill_reference")),
    "mistake_wrong_page": (("paged_ref.hf.mistakes", "wrong_page_decode"),
                           ("paged_ref.attention.reference", "paged_prefill_reference")),
}


AUTO = "auto"


def auto_backend(device) -> str:
    """The backend ``"auto"`` stands for on ``device``: the fastest tested path there.

    Example:
        >>> auto_backend("cpu")
        'sdpa'
    """
    return "triton" if torch.device(device).type == "cuda" else "sdpa"


def resolve_backend(backend: str) -> tuple[Callable, Callable]:
    """The (decode, prefill) attention functions of a backend name.

    Example:
        >>> decode, prefill = resolve_backend("reference")
        >>> decode.__name__, prefill.__name__
        ('paged_attention_reference', 'paged_prefill_reference')
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    found = []
    for module_name, function_name in BACKENDS[backend]:
        module = importlib.import_module(module_name)
        found.append(getattr(module, function_name))
    return found[0], found[1]


def step_kwargs(backend: str, plan) -> dict:
    """Extra keywords for this step's attention calls, computed once and shared by every layer.

    The block table and lengths of a step are the same in all layers, so per-step work is done
    here instead of once per layer: FlexAttention's physical BlockMask and SDPA's slot map are
    built once (flex decode runs compiled, also on CPU), and the value checks that copy the block table to the host are skipped per layer
    (for flex, sdpa and triton; the reference backend, being the oracle, keeps all its checks). Skipping is safe
    because the block table and lengths come straight from `PagedKVCache.block_table`.
    """
    if backend == "flex":
        from paged_ref.attention.flex import paged_block_masks

        masks = paged_block_masks(
            plan.block_table, plan.seq_lens, plan.kv.num_pages, plan.kv.page_size,
            q_len=plan.max_q_len, q_lens=None if plan.is_decode else plan.q_lens,
        )
        # decode keeps its shapes from step to step: compiled flex (block sparse) pays for its
        # compile on CPU too (`bench scaling --cpu`: 83-108 ms per SmolLM2 step, 345-395 eager);
        # prefill shapes change with every prompt, so prefill stays eager on CPU
        return {"block_mask": masks.physical, "validate": False,
                "compiled": True if plan.is_decode else None}
    if backend == "sdpa" or (backend == "triton" and not plan.is_decode):
        from paged_ref.hf.sdpa import prepare

        q_lens = None if plan.is_decode else plan.q_lens
        gather = prepare(plan.block_table, plan.seq_lens, plan.kv.page_size, q_lens, plan.max_q_len)
        return {"gather": gather, "validate": False}
    if backend == "triton" and plan.is_decode:
        return {"check_values": False}
    return {}


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of the new tokens over their sequences' pages (the transformers attention signature).

    Args:
        module: the attention module; ``module.layer_idx`` picks the layer's pages.
        query: ``[batch, num_q_heads, max_q_len, head_dim]`` (after RoPE).
        key, value: the new tokens' K/V, already written to the pages by `PagedCache.update`; unused.
        attention_mask: unused (None: no mask is built for this implementation).
        scaling: softmax scale (``module.scaling``).
        dropout: must be 0 (inference only).
        **kwargs: must hold ``paged_step``, the `StepPlan` of this forward.

    Returns:
        ``(out, None)`` with ``out: [batch, max_q_len, num_q_heads, head_dim]``; rows past a
        sequence's ``q_lens`` are padding (zeros or garbage, never read back).
    """
    plan = kwargs.get("paged_step")
    if plan is None:
        raise RuntimeError(
            f"attn_implementation {ATTN_IMPLEMENTATION!r} reads K/V from paged_ref pages and needs a step plan; "
            "call the model through paged_ref.hf.generate / PagedSession (the model keeps this implementation "
            "only while a paged generation is running; finish or close that generator first)"
        )
    if dropout:
        raise NotImplementedError(f"paged attention is inference-only, got dropout={dropout}")
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"paged attention does not support {unsupported}={kwargs[unsupported]!r}")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("paged attention does not support attention sinks")
    layer = module.layer_idx
    k_cache, v_cache = plan.kv.k_cache[layer], plan.kv.v_cache[layer]  # [num_pages, page_size, Hkv, D]
    if plan.is_decode:
        q = query[:, :, 0, :].contiguous()  # [batch, Hq, D]
        out = plan.decode(q, k_cache, v_cache, plan.block_table, plan.seq_lens, scale=scaling,
                          **plan.attn_kwargs)  # [batch, Hq, D]
        return out.unsqueeze(1), None  # [batch, 1, Hq, D]
    out = plan.prefill(query, k_cache, v_cache, plan.block_table, plan.seq_lens, plan.q_lens, scale=scaling,
                       **plan.attn_kwargs)  # [batch, Hq, max_q_len, D]
    return out.transpose(1, 2), None  # [batch, max_q_len, Hq, D]


def register() -> str:
    """Register `paged_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
