"""The model's linear layers through weights packed once for oneDNN: a CPU step's matmuls, faster.

A small model's decode step is mostly matrix products ``x @ W.T`` with few rows in ``x``. On a CPU
``F.linear`` hands each to the BLAS, which lays ``W`` out for its kernel again on every call; oneDNN
(what vLLM's CPU build calls for every linear layer) takes a weight laid out once ("prepacked").
`PackedLinears` packs every ``nn.Linear`` weight when it is built (a second copy: later changes to
the weights are not seen) and, inside its ``with`` block, runs those layers through
``torch.ops.mkldnn._linear_pointwise``; outside it the model is untouched. Where oneDNN cannot run
them, the layers stay eager and it warns once with the reason (``packed`` says which happened).

Example:
    >>> from paged_ref.models import tiny_llama
    >>> model = tiny_llama()
    >>> x = torch.randn(1, 3, model.config.hidden_size)
    >>> packs = PackedLinears(model)
    >>> with packs:
    ...     y = model.model.layers[0].mlp.gate_proj(x)
    >>> packs.packed, torch.allclose(y, model.model.layers[0].mlp.gate_proj(x), atol=1e-5)
    (True, True)
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["PackedLinears"]

_PACKABLE = (torch.float32, torch.bfloat16)


class PackedLinears:
    """Every ``nn.Linear`` of ``model`` (weights ``[out, in]``, CPU, float32 or bfloat16) run through its
    prepacked oneDNN weight within ``with``; ``packed`` is False when they stay eager."""

    def __init__(self, model: torch.nn.Module):
        self._layers: list[tuple[torch.nn.Module, object]] = []  # (layer, its forward through the pack)
        why = _why_not(model)
        if why is None:
            try:
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear):
                        self._layers.append((module, _packed_forward(module)))
            except RuntimeError as e:  # an op this build of torch lacks, a shape oneDNN refuses
                why = f"packing failed: {type(e).__name__}: {str(e).splitlines()[0]}"
                self._layers = []
        if why is not None:
            warnings.warn(f"prepack: the linear layers stay eager ({why})", RuntimeWarning, stacklevel=2)
        self.packed = why is None

    def __enter__(self) -> PackedLinears:
        for layer, forward in self._layers:
            layer.forward = forward  # an instance attribute: shadows the class's forward
        return self

    def __exit__(self, *exc) -> None:
        for layer, _ in self._layers:
            layer.__dict__.pop("forward", None)


def _why_not(model) -> str | None:
    """Why the layers of ``model`` cannot run packed, or None."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this build of torch has no oneDNN (mkldnn) linear"
    for name, p in model.named_parameters():
        if p.device.type != "cpu" or p.dtype not in _PACKABLE:
            return f"parameter {name} is {p.dtype} on {p.device.type}; packing needs float32 or bfloat16 on the CPU"
    return None


def _packed_forward(layer: torch.nn.Linear):
    """``layer``'s forward through a oneDNN weight packed now: ``x: [..., in] -> [..., out]``."""
    weight, bias = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)  # [out, in] in oneDNN's blocked layout
    out_features = weight.shape[0]

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [tokens, in]
        y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # [tokens, out]
        return y.view(*x.shape[:-1], out_features)

    forward(torch.zeros(1, weight.shape[1], dtype=weight.dtype))  # fails here, not in a forward
    return forward
