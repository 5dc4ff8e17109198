"""A Llama model's forward as one flat loop: transformers' operations, without its module calls.

transformers runs each decoder layer as nested modules (the layer, its attention, its MLP, two
norms), every call passing through ``nn.Module.__call__``, keyword plumbing and decorators. On a
CPU decode step of a small model that Python is a visible share of the step (`bench serve
--profile`); vLLM runs its own model code for the same reason. `FlatForward` does that for
Llama-architecture models (SmolLM2, Llama): within its ``with`` block the model's inner forward
(``model.model``) is `flat_forward`, one loop over the layers applying the same functions to the
same weights in the same order as transformers' ``LlamaModel`` (attention too: the function the
model's config names, ``"paged_ref"`` in a session's forward), so the logits are bit for bit the
same; outside it the model is untouched. A model of another architecture (or activation) keeps its
own forward, with one warning (``flat`` says which happened). The loop's small operations (norms,
RoPE, SwiGLU) are an op set: `EAGER` is transformers' own; ``cpu_ops=True`` runs them as vLLM's CPU
build does, in C++ (`paged_ref.fast.cpu_ops`), the same up to rounding.

Example:
    >>> from paged_ref.models import tiny_llama
    >>> from paged_ref import hf
    >>> model, ids = tiny_llama(), torch.tensor([[5, 9, 3, 7]])
    >>> with FlatForward(model) as flat:
    ...     out = hf.generate(model, ids, max_new_tokens=4, num_pages=8, page_size=4)
    >>> flat.flat, torch.equal(out, hf.generate(model, ids, max_new_tokens=4, num_pages=8, page_size=4))
    (True, True)
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cpu_ops import cpu_ops as load_cpu_ops

__all__ = ["EAGER", "FlatForward", "flat_forward"]

SUPPORTED = ("llama",)  # config.model_type values whose decoder layers are transformers' Llama layers


class FlatForward:
    """``model.model.forward`` as `flat_forward` within ``with``; ``flat`` is False when the model keeps its
    own. ``cpu_ops``: its norms, RoPE and SwiGLU through `paged_ref.fast.cpu_ops` where they can run
    (float32 on the CPU; elsewhere, or where they cannot be built, transformers' with one warning)."""

    def __init__(self, model, *, cpu_ops: bool = False):
        self._inner = model.model
        kind, act = getattr(model.config, "model_type", None), getattr(model.config, "hidden_act", None)
        self.flat = kind in SUPPORTED and act == "silu"
        if not self.flat:
            why = f"{type(model).__name__} ({kind!r}, {act!r}) keeps its own forward; the loop is for {SUPPORTED}, silu"
            warnings.warn(f"flat: {why}", RuntimeWarning, stacklevel=2)
        self.ops = EAGER
        weight = self._inner.norm.weight
        if cpu_ops and self.flat and (weight.device.type, weight.dtype) != ("cpu", torch.float32):
            why = f"they take float32 on the CPU, the model is {weight.dtype} on {weight.device.type}"
            warnings.warn(f"flat: cpu_ops=True, transformers' operations run ({why})", RuntimeWarning, stacklevel=2)
        elif cpu_ops and self.flat:
            self.ops = load_cpu_ops() or EAGER  # a failed build has warned

    def __enter__(self) -> FlatForward:
        if self.flat:  # an instance attribute, shadowing the class's forward
            self._inner.__dict__["forward"] = lambda **kwargs: flat_forward(self._inner, ops=self.ops, **kwargs)
        return self

    def __exit__(self, *exc) -> None:
        self._inner.__dict__.pop("forward", None)


def _add_norm(h, y, weight, eps):
    """``(h + y, RMSNorm(h + y))``, ``LlamaRMSNorm.forward``'s operations (``y=None``: no add)."""
    h = h if y is None else h + y
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * x.to(h.dtype)


def _rotate(x, cos, sin):
    """transformers' ``apply_rotary_pos_emb`` for one tensor ``[batch, tokens, heads, head_dim]``."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


#: transformers' own operations, one for one (its logits bit for bit); `paged_ref.fast.cpu_ops` has the same three.
EAGER = SimpleNamespace(add_norm=_add_norm, rotate=_rotate, silu_mul=lambda gate, up: F.silu(gate) * up)


def flat_forward(inner, *, input_ids, position_ids, paged_step, cache=None, past_key_values=None, ops=EAGER, **unused):
    """``LlamaModel.forward`` of a paged forward: ``input_ids [batch, tokens]`` -> the last hidden states
    ``[batch, tokens, hidden]``, K/V written through the cache, attention read from the pages; ``ops``:
    `EAGER` or `paged_ref.fast.cpu_ops.cpu_ops()`."""
    cache = cache if cache is not None else past_key_values  # the keyword's name in transformers < 5.24
    h = inner.embed_tokens.forward(input_ids)  # [batch, tokens, hidden]
    cos, sin = inner.rotary_emb.forward(h, position_ids=position_ids)  # each [batch, tokens, head_dim]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    attention = ALL_ATTENTION_FUNCTIONS[inner.config._attn_implementation]  # as each LlamaAttention looks it up
    y = None  # what the residual stream adds next
    for layer in inner.layers[: inner.config.num_hidden_layers]:
        attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
        h, x = ops.add_norm(h, y, norm.weight, norm.variance_epsilon)
        heads = (*x.shape[:-1], -1, attn.head_dim)  # [batch, tokens, heads, head_dim]
        q = ops.rotate(attn.q_proj.forward(x).view(heads), cos, sin).transpose(1, 2)  # [batch, Hq, tokens, D]
        k = ops.rotate(attn.k_proj.forward(x).view(heads), cos, sin).transpose(1, 2)  # [batch, Hkv, tokens, D]
        v = attn.v_proj.forward(x).view(heads).transpose(1, 2)
        k, v = cache.update(k, v, attn.layer_idx)
        o, _ = attention(attn, q, k, v, None, scaling=attn.scaling, paged_step=paged_step)
        y = attn.o_proj.forward(o.reshape(*heads[:-2], -1).contiguous())  # o: [batch, tokens, Hq, D]
        norm = layer.post_attention_layernorm
        h, x = ops.add_norm(h, y, norm.weight, norm.variance_epsilon)
        y = mlp.down_proj.forward(ops.silu_mul(mlp.gate_proj.forward(x), mlp.up_proj.forward(x)))
    return BaseModelOutputWithPast(
        last_hidden_state=ops.add_norm(h, y, inner.norm.weight, inner.norm.variance_epsilon)[1]
    )
