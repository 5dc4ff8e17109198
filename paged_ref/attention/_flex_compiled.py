"""Which flex_attention a call runs: eager (the CPU default, since a CPU compile costs seconds per
shape; it evaluates the mask_mod on every element) or compiled once per device and CPU thread count
(block sparse; on CUDA with a tile dividing the BlockMask's blocks, :func:`cuda_kernel_options`)."""

from __future__ import annotations

import threading
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .._arith import next_pow2

__all__ = ["COMPILE_LIMIT", "cuda_kernel_options", "run_flex"]

_COMPILED_FLEX = {}  # device type (and CPU thread count) -> torch.compile(flex_attention), built on first use
COMPILE_LIMIT = 256  # distinct shapes one process may compile flex_attention for


def _compile_key(device: torch.device) -> tuple:
    """The device type, and on CPU the thread count: inductor's CPU kernel sizes its scratch buffers
    for it, and torch 2.11 left it out of its on-disk cache key (a kernel loaded under another
    count corrupted the heap)."""
    return (device.type, torch.get_num_threads()) if device.type == "cpu" else (device.type,)


def _compiled_flex(device: torch.device):
    """torch.compile(flex_attention) for ``device``, built on first use."""
    key = _compile_key(device)
    if key not in _COMPILED_FLEX:
        # static shapes on CPU: the template's dynamic-shape code does not build (torch 2.13)
        if device.type == "cpu":
            compiled_flex = torch.compile(flex_attention, dynamic=False, options={"cpp.threads": key[1]})
        else:
            compiled_flex = torch.compile(flex_attention, dynamic=True)
        # Past 8 compiles dynamo silently falls back to eager (dense) flex: allow more shapes and
        # fail loudly instead. One config patch per thread, entered on every call (one per call
        # leaks in torch's config machinery; torch 2.11 refuses to enter one object twice at once).
        limits = threading.local()

        def call(*args, **kwargs):
            patch = getattr(limits, "patch", None)
            if patch is None:
                patch = limits.patch = torch._dynamo.config.patch(
                    recompile_limit=COMPILE_LIMIT, fail_on_recompile_limit_hit=True
                )
            with patch:
                return compiled_flex(*args, **kwargs)

        _COMPILED_FLEX[key] = call
    return _COMPILED_FLEX[key]


def cuda_kernel_options(
    dtype: torch.dtype, head_dim: int, q_len: int, group: int, block_size: tuple[int, int]
) -> dict[str, int]:
    """The query x key tile (``BLOCK_M`` x ``BLOCK_N``) compiled flex uses on CUDA: it must divide
    the BlockMask's ``(q_block, kv_block)``, which torch's default tiles (64 or 128 keys) do not
    for a 16-token KV block, and is never larger than those defaults (tests/test_flex_cuda_tiles.py).

    Example:
        >>> cuda_kernel_options(torch.bfloat16, 128, 1, 4, (128, 16))
        {'BLOCK_M': 16, 'BLOCK_N': 16}
        >>> cuda_kernel_options(torch.bfloat16, 64, 1024, 4, (128, 128))
        {'BLOCK_M': 128, 'BLOCK_N': 64}
    """
    q_block, kv_block = block_size
    wide = dtype.itemsize <= 2 and head_dim <= 128  # torch's defaults: 128-row tiles here
    cap_m = 128 if wide else 32
    cap_n = (64 if dtype.itemsize <= 2 else 32) // (2 if head_dim > 128 else 1)
    rows = min(next_pow2(q_len * group), cap_m)  # the query rows of one KV head, capped
    block_m = max(16, next_pow2(group), rows)  # 16: tl.dot's smallest; whole groups for decoding
    return {"BLOCK_M": min(q_block, block_m), "BLOCK_N": min(kv_block, cap_n)}


def eager_flex(*args, **kwargs):
    """flex_attention run eagerly on purpose (CPU), without its "use torch.compile" warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def run_flex(q, k, v, block_mask: BlockMask, scale: float, compiled: bool | None) -> torch.Tensor:
    """``flex_attention(q, k, v)`` with GQA, compiled (None: on CUDA) or eager; q ``[batch, Hq,
    q_len, D]``, k, v ``[1, Hkv, kv_len, D]``."""
    args = dict(block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if compiled is None:
        compiled = q.device.type == "cuda"
    if not compiled:
        return eager_flex(q, k, v, **args)
    if q.device.type == "cuda":
        group = q.shape[1] // k.shape[1]
        args["kernel_options"] = cuda_kernel_options(q.dtype, q.shape[-1], q.shape[2], group, block_mask.BLOCK_SIZE)
    return _compiled_flex(q.device)(q, k, v, **args)
