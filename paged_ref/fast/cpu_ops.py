"""The flat loop's small operations in C++: RMSNorm with its residual add, RoPE in place, SwiGLU.

Between its products a Llama layer runs a dozen small PyTorch ops (the residual add; the norm's
square, mean, rsqrt and products; RoPE's halves, neg, cat and products; silu and a product), each
a pass over its tensor and a dispatch. vLLM's CPU build runs each group as one kernel
(``fused_add_rms_norm``, ``rotary_embedding``, ``silu_and_mul``); `cpu_ops()` is
`paged_ref.fast.flat`'s loop's op set of the same three, built on first use (`paged_ref.native.build`)
from ``csrc/cpu_ops.cpp``. Logits differ from transformers' by rounding (the norm's sum is
reassociated).

Example:
    >>> h, y, norm = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.nn.RMSNorm(8, eps=1e-6)
    >>> h2, x = cpu_ops().add_norm(h.clone(), y, norm.weight.detach(), 1e-6)
    >>> torch.allclose(x, norm(h + y), atol=1e-5), torch.allclose(h2, h + y)
    (True, True)
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..native import VEXP, build

__all__ = ["SOURCE", "cpu_ops"]

#: The three operations, on float32 CPU tensors (after `paged_ref.native.VEXP`): `paged_ref.fast.flat`'s op set.
SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"


@functools.cache
def cpu_ops():
    """The op set ``torch.ops.paged_ref_cpu`` (``add_norm``, ``rotate``, ``silu_mul``), built on first call;
    None where it cannot be built (`paged_ref.native.build`)."""
    built = build("paged_ref_cpu_ops", [VEXP, SOURCE], [], "the flat loop runs transformers' operations")
    return None if built is None else torch.ops.paged_ref_cpu
