"""A Llama model's forward as one flat loop: transformers' operations, without its module calls.

transformers runs each decoder layer as nested modules (the layer, its attention, its MLP, two
norms), every call passing through ``nn.Module.__call__``, keyword plumbing and decorators. On a
CPU decode step of a small model that Python is a visible share of the step (`bench serve
--profile`); vLLM runs its own model code for the same reason. `FlatForward` does that for
Llama-architecture models (SmolLM2, Llama): within its ``with`` block the model's inner forward
(``model.model``) is `flat_forward`, one loop over the layers applying the same functions to the
same weights in the same order as transformers' ``LlamaModel`` (attention too: the function the
model's config names, ``"paged_ref"`` in a session's forward), so the logits are bit for bit the
same; outside it the model is untouched. Its layers' modules and norm weights are looked up when it is
built, and looked up again when the block is entered after one was replaced (a module, or a norm weight:
``load_state_dict(assign=True)``). The loop calls no module hooks and does the work of the layers, their attention,
MLP and norms itself: while a module of ``model.model`` has a forward hook or pre-hook (transformers' own output
capturing aside), one whose work the loop does (or ``model.model``) has a ``forward`` of its own on the instance, as
accelerate's hooks install, or a norm's weight is parametrized, the model's own forward runs, with one warning.
A model of another architecture (or activation) keeps its
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

import functools
import warnings
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cpu_ops import cpu_ops as load_cpu_ops

__all__ = ["EAGER", "FlatForward", "LayerParts", "flat_forward", "layer_parts"]

SUPPORTED = ("llama",)  # config.model_type values whose decoder layers are transformers' Llama layers


class FlatForward:
    """``model.model.forward`` as `flat_forward` within ``with``; ``flat`` is False when the model keeps its
    own. ``cpu_ops``: its norms, RoPE and SwiGLU through `paged_ref.fast.cpu_ops` where they can run
    (float32 on the CPU; elsewhere, or where they cannot be built, transformers' with one warning)."""

    def __init__(self, model, *, cpu_ops: bool = False):
        if not isinstance(cpu_ops, bool):
            raise TypeError(f"cpu_ops must be True or False, got {cpu_ops!r}")
        kind, act = getattr(model.config, "model_type", None), getattr(model.config, "hidden_act", None)
        self.flat = kind in SUPPORTED and act == "silu"
        self.ops, self._put, self._warned = EAGER, [], False
        if not self.flat:
            why = f"{type(model).__name__} ({kind!r}, {act!r}) keeps its own forward; the loop is for {SUPPORTED}, silu"
            warnings.warn(f"flat: {why}", RuntimeWarning, stacklevel=2)
            return
        self._inner = model.model
        weight = self._inner.norm.weight
        if cpu_ops and (weight.device.type, weight.dtype) != ("cpu", torch.float32):
            why = f"they take float32 on the CPU, the model is {weight.dtype} on {weight.device.type}"
            warnings.warn(f"flat: cpu_ops=True, transformers' operations run ({why})", RuntimeWarning, stacklevel=2)
        elif cpu_ops:
            self.ops = load_cpu_ops() or EAGER  # a failed build has warned
        self._look_up()

    def _look_up(self) -> None:
        self._layers, self._seen = layer_parts(self._inner), _looked_up(self._inner)
        inner = self._inner  # its own hooks and forward run as they would: its __call__ calls the loop
        self._hooks = [(m._forward_hooks, m._forward_pre_hooks) for m in inner.modules() if m is not inner]
        layers = inner.layers[: inner.config.num_hidden_layers]
        self._inlined = [inner.norm, *(m for layer in layers for m in _inlined(layer))]  # whose work the loop does

    def _why_not(self) -> str | None:
        """Why the loop would not run the model as its own forward does now, or None."""
        if "forward" in self._inner.__dict__:  # not this block's (`__enter__` asks only when none is entered)
            return "model.model has a forward of its own on the instance"
        if any(d.get(key) is not held for d, key, held in self._seen):  # a module or norm weight replaced
            self._look_up()
        if any(_GLOBAL_HOOKS) or any((hook and _acting(hook)) or (pre and _acting(pre)) for hook, pre in self._hooks):
            return "a module of model.model has a forward hook, which the loop would not call"
        if any("forward" in m.__dict__ for m in self._inlined):
            return "a layer, attention, MLP or norm module has a forward of its own, which the loop would not call"
        if any(weight is None for p in self._layers for weight, _ in (p.norm, p.post_norm)):
            return "a norm's weight is not a plain parameter (a parametrization), which the loop would read stale"
        return None

    def __enter__(self) -> FlatForward:
        put = self.flat and not any(self._put)  # a nested block leaves the outer one's loop in place
        why = self._why_not() if put else None
        if why is not None:
            put = False
            if not self._warned:
                self._warned = True
                warnings.warn(f"flat: the model's own forward runs while {why}", RuntimeWarning, stacklevel=2)
        if put:  # an instance attribute, shadowing the class's forward
            forward = functools.partial(flat_forward, self._inner, ops=self.ops, layers=self._layers)
            self._inner.__dict__["forward"] = forward
        self._put.append(put)
        return self

    def __exit__(self, *exc) -> None:
        if self._put.pop():
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


class LayerParts(NamedTuple):
    """One decoder layer's modules and norm weights (None: not a plain parameter), looked up once, and again after
    one was replaced (`FlatForward`; ``nn.Module.__getattr__`` is a Python call per submodule or parameter, 15 a
    layer on every step otherwise)."""

    attn: torch.nn.Module  # the layer's self_attn: what the attention function takes as its module
    q: torch.nn.Module
    k: torch.nn.Module
    v: torch.nn.Module
    o: torch.nn.Module
    gate: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module
    norm: tuple  # (weight, eps) of input_layernorm
    post_norm: tuple  # (weight, eps) of post_attention_layernorm


def layer_parts(inner) -> list[LayerParts]:
    """The `LayerParts` of ``inner``'s first ``num_hidden_layers`` layers (as ``LlamaModel.forward`` runs them)."""
    out = []
    for layer in inner.layers[: inner.config.num_hidden_layers]:
        attn, mlp, a, b = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        norms = (a._parameters.get("weight"), a.variance_epsilon), (b._parameters.get("weight"), b.variance_epsilon)
        projections = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj
        out.append(LayerParts(attn, *projections, *norms))
    return out


def _looked_up(inner) -> list[tuple[dict, str, object]]:
    """What the loop takes from ``inner`` (`layer_parts`, and the modules it calls on every forward), each as (the
    dict it lies in, its key, what lay there when looked up): one replaced since lies there no more."""
    out = [(inner._modules, n, inner._modules.get(n)) for n in ("embed_tokens", "rotary_emb", "norm", "layers")]
    for i, layer in enumerate(inner.layers[: inner.config.num_hidden_layers]):
        out.append((inner.layers._modules, str(i), layer))
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            child = layer._modules.get(name)
            out.append((layer._modules, name, child))
            out += [(child._modules, n, m) for n, m in child._modules.items()]  # projections
            out += [(child._parameters, "weight", child._parameters.get("weight"))] if "norm" in name else []
    return out


def _inlined(layer) -> list[torch.nn.Module]:
    """The modules of a decoder layer whose work the loop does itself (it calls only the projections' ``forward``)."""
    mlp = layer.mlp
    return [layer, layer.self_attn, mlp, layer.input_layernorm, layer.post_attention_layernorm, mlp.act_fn]


def _acting(hooks: dict) -> bool:
    """Whether ``hooks`` (a module's forward hooks or pre-hooks) holds one besides transformers' output capturing,
    which collects only inside the model's own forward (the loop replaces it) and does nothing else."""
    return any(getattr(h, "__module__", None) != "transformers.utils.output_capturing" for h in hooks.values())


#: torch's hooks on every module (``register_module_forward_hook``, ``..._pre_hook``)
_GLOBAL_HOOKS = (torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks)


def flat_forward(
    inner, *, input_ids, position_ids, paged_step, cache=None, past_key_values=None, ops=EAGER, layers=None, **unused
):
    """``LlamaModel.forward`` of a paged forward: ``input_ids [batch, tokens]`` -> the last hidden states
    ``[batch, tokens, hidden]``, K/V written through the cache, attention read from the pages; ``ops``:
    `EAGER` or `paged_ref.fast.cpu_ops.cpu_ops()`; ``layers``: ``layer_parts(inner)`` (None: looked up now)."""
    cache = cache if cache is not None else past_key_values  # the keyword's name in transformers < 5.24
    h = inner.embed_tokens.forward(input_ids)  # [batch, tokens, hidden]
    cos, sin = inner.rotary_emb.forward(h, position_ids=position_ids)  # each [batch, tokens, head_dim]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    attention = ALL_ATTENTION_FUNCTIONS[inner.config._attn_implementation]  # as each LlamaAttention looks it up
    add_norm, rotate, silu_mul = ops.add_norm, ops.rotate, ops.silu_mul
    y = None  # what the residual stream adds next
    for p in layer_parts(inner) if layers is None else layers:
        attn = p.attn
        h, x = add_norm(h, y, *p.norm)
        heads = (*x.shape[:-1], -1, attn.head_dim)  # [batch, tokens, heads, head_dim]
        q = rotate(p.q.forward(x).view(heads), cos, sin).transpose(1, 2)  # [batch, Hq, tokens, D]
        k = rotate(p.k.forward(x).view(heads), cos, sin).transpose(1, 2)  # [batch, Hkv, tokens, D]
        v = p.v.forward(x).view(heads).transpose(1, 2)
        k, v = cache.update(k, v, attn.layer_idx)
        dropout = attn.attention_dropout if attn.training else 0.0  # as LlamaAttention passes it
        o, _ = attention(attn, q, k, v, None, dropout=dropout, scaling=attn.scaling, paged_step=paged_step)
        y = p.o.forward(o.reshape(*heads[:-2], -1).contiguous())  # o: [batch, tokens, Hq, D]
        h, x = add_norm(h, y, *p.post_norm)
        y = p.down.forward(silu_mul(p.gate.forward(x), p.up.forward(x)))
    return BaseModelOutputWithPast(last_hidden_state=add_norm(h, y, inner.norm.weight, inner.norm.variance_epsilon)[1])
