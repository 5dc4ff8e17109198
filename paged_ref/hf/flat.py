"""A Llama model's forward as one flat loop: transformers' operations, without its module calls.

transformers runs each decoder layer as nested modules (the layer, its attention, its MLP, two
norms), every call passing through ``nn.Module.__call__``, keyword plumbing and decorators. On a
CPU decode step of a small model that Python is a visible share of the step (`bench serve
--profile`); vLLM runs its own model code for the same reason. `FlatForward` does that for
Llama-architecture models (SmolLM2, Llama): within its ``with`` block the model's inner forward
(``model.model``) is `flat_forward`, one loop over the layers applying the same functions to the
same weights in the same order as transformers' ``LlamaModel``, so the logits are bit for bit the
same; outside it the model is untouched. A model of another architecture keeps its own forward,
with one warning (``flat`` says which happened).

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

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from .attention import paged_attention_forward

__all__ = ["FlatForward", "flat_forward"]

SUPPORTED = ("llama",)  # config.model_type values whose decoder layers are transformers' Llama layers


class FlatForward:
    """``model.model.forward`` as `flat_forward` within ``with``; ``flat`` is False when the model keeps its own."""

    def __init__(self, model):
        self._inner = model.model
        kind = getattr(model.config, "model_type", None)
        self.flat = kind in SUPPORTED
        if not self.flat:
            why = f"{type(model).__name__} (model_type {kind!r}) keeps its own forward; the loop is for {SUPPORTED}"
            warnings.warn(f"flat: {why}", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> FlatForward:
        if self.flat:  # an instance attribute, shadowing the class's forward
            self._inner.__dict__["forward"] = lambda **kwargs: flat_forward(self._inner, **kwargs)
        return self

    def __exit__(self, *exc) -> None:
        self._inner.__dict__.pop("forward", None)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, operation for operation: ``[..., hidden]`` -> the same."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor ``[batch, heads, tokens, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def flat_forward(inner, *, input_ids, position_ids, paged_step, cache=None, past_key_values=None, **unused):
    """``LlamaModel.forward`` of a paged forward: ``input_ids [batch, tokens]`` -> the last hidden states
    ``[batch, tokens, hidden]``, K/V written through the cache, attention read from the pages."""
    cache = cache if cache is not None else past_key_values  # the keyword's name in transformers < 5.24
    h = inner.embed_tokens.forward(input_ids)  # [batch, tokens, hidden]
    cos, sin = inner.rotary_emb.forward(h, position_ids=position_ids)  # each [batch, tokens, head_dim]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    for layer in inner.layers[: inner.config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms_norm(layer.input_layernorm, h)
        heads = (*x.shape[:-1], -1, attn.head_dim)  # [batch, tokens, heads, head_dim]
        q = attn.q_proj.forward(x).view(heads).transpose(1, 2)  # [batch, Hq, tokens, D]
        k = attn.k_proj.forward(x).view(heads).transpose(1, 2)  # [batch, Hkv, tokens, D]
        v = attn.v_proj.forward(x).view(heads).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = cache.update(k, v, attn.layer_idx)
        o, _ = paged_attention_forward(attn, q, k, v, None, scaling=attn.scaling, paged_step=paged_step)
        h = h + attn.o_proj.forward(o.reshape(*heads[:-2], -1).contiguous())  # o: [batch, tokens, Hq, D]
        x = _rms_norm(layer.post_attention_layernorm, h)
        h = h + mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
    return BaseModelOutputWithPast(last_hidden_state=_rms_norm(inner.norm, h))
