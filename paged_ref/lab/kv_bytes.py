"""What one byte of K or V can hold (notebook 11): the 8-bit formats' grids, a real model's K and V
stored at each scale granularity, and the bytes a token takes.

- `format_facts`: a format's bits (sign, exponent, mantissa), its largest value, its smallest normal
  and subnormal, and the relative step between neighbouring normal values (a float's; int8 has
  evenly spaced values instead, 1 apart at scale 1);
- `representable`: every positive value a format stores at scale 1;
- `real_kv`: SmolLM2-135M's K (after RoPE) and V of English prose, as a paged cache holds them;
- `stored`: a tensor of pages ``[num_pages, page_size, num_kv_heads, head_dim]`` stored in a format at a
  scale granularity and read back, with its relative error and the values that saturated;
- `error_rows`: that for every layer of K and V, per format and granularity;
- `token_bytes`: the bytes a token takes in every layer (K and V), scales included.

Granularities (`GRANULARITIES`): ``"one"`` (scale 1.0, vLLM's default ``k_scale``), ``"layer"`` (one
scale per layer and K/V, `paged_ref.quant.calibrate` over the layer) and ``"page"`` (one per page and
KV head). 16- and 32-bit formats take no scale: they are a plain cast.

Example:
    >>> facts = format_facts(torch.float8_e4m3fn)
    >>> facts["exponent_bits"], facts["mantissa_bits"], facts["max"], facts["relative_step"]
    (4, 3, 448.0, 0.125)
    >>> pages = torch.linspace(-2, 2, 2 * 4 * 1 * 8).reshape(2, 4, 1, 8)
    >>> s = stored(pages, torch.int8, "page")
    >>> s["values"].shape, s["saturated"], s["rel_error"] < 0.01
    (torch.Size([2, 4, 1, 8]), 0, True)
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .. import quant
from .._validate import check_choice, check_int
from ..memory import kv_bytes_per_token

__all__ = ["FLOAT_FORMATS", "GRANULARITIES", "RealKV", "error_rows", "format_facts", "real_kv"]
__all__ += ["representable", "stored", "token_bytes"]

GRANULARITIES = ("one", "layer", "page")
FLOAT_FORMATS = (torch.float32, torch.bfloat16, torch.float16)  # stored as a plain cast, no scale


def format_facts(fmt: torch.dtype) -> dict:
    """Bits and range of ``fmt`` (an 8-bit format of `paged_ref.quant.FORMATS` or a 16/32-bit float)."""
    if fmt == torch.int8:
        return dict(
            format="int8",
            bits=8,
            exponent_bits=0,
            mantissa_bits=7,
            max=127.0,
            min_normal=1.0,
            min_subnormal=1.0,
            relative_step=None,
        )
    if fmt not in quant.FORMATS and fmt not in FLOAT_FORMATS:
        raise ValueError(f"fmt must be one of {[*quant.FORMATS, *FLOAT_FORMATS]}, got {fmt!r}")
    info = torch.finfo(fmt)
    mantissa = round(-torch.log2(torch.tensor(info.eps)).item())  # eps = 2^-mantissa_bits
    bits = info.bits
    return dict(
        format=str(fmt).removeprefix("torch."),
        bits=bits,
        exponent_bits=bits - 1 - mantissa,
        mantissa_bits=mantissa,
        max=float(info.max),
        min_normal=float(info.tiny),
        min_subnormal=float(info.tiny) * float(info.eps),
        relative_step=float(info.eps),
    )


def representable(fmt: torch.dtype) -> torch.Tensor:
    """float32 ``[n]``: every positive finite value an 8-bit ``fmt`` stores at scale 1, ascending."""
    quant.check_format(fmt)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).float()  # all 256 bytes
    return codes[torch.isfinite(codes) & (codes > 0)].unique()


def _scale(pages: torch.Tensor, fmt: torch.dtype, granularity: str) -> torch.Tensor:
    """The scale of ``pages`` at ``granularity``, shaped to broadcast against them."""
    if granularity == "one":
        return torch.ones(())
    if granularity == "layer":
        return quant.calibrate(pages, fmt)
    return quant.calibrate(pages, fmt, dim=(1, 3))[:, None, :, None]  # [num_pages, 1, num_kv_heads, 1]


def stored(pages: torch.Tensor, fmt: torch.dtype, granularity: str = "page", *, rounding: str = "nearest") -> dict:
    """``pages: [num_pages, page_size, num_kv_heads, head_dim]`` stored in ``fmt`` and read back.

    Returns ``values`` (what the cache holds, float32, same shape), ``rel_error`` (``||stored - x|| /
    ||x||``), ``max_abs_error``, ``saturated`` (values beyond the format's range at the scale) and
    ``scale`` (the scales, broadcastable; 1.0 for a plain cast)."""
    if not isinstance(pages, torch.Tensor) or pages.dim() != 4 or not pages.dtype.is_floating_point:
        raise ValueError(
            f"pages must be a floating tensor [num_pages, page_size, num_kv_heads, head_dim], got {pages!r}"
        )
    check_choice("granularity", granularity, GRANULARITIES)
    x = pages.float()
    if fmt in FLOAT_FORMATS:
        scale, saturated = torch.ones(()), int((x.abs() > torch.finfo(fmt).max).sum())
        values = x.to(fmt).float()
    else:
        scale = _scale(x, quant.check_format(fmt), granularity)
        saturated = quant.count_saturated(x, scale, fmt)
        values = quant.dequantize(quant.quantize(x, scale, fmt, rounding=rounding), scale)
    err = values - x
    return dict(
        values=values,
        rel_error=float(err.norm() / x.norm()) if x.norm() > 0 else 0.0,
        max_abs_error=float(err.abs().max()),
        saturated=saturated,
        scale=scale,
    )


class RealKV:
    """A real model's K and V per layer, ``ks[layer], vs[layer]: [num_pages, page_size, num_kv_heads, head_dim]``
    (the last page padded with zeros), and where they came from (``note``)."""

    def __init__(self, ks: list[torch.Tensor], vs: list[torch.Tensor], page_size: int, num_tokens: int, note: str):
        self.ks, self.vs, self.page_size, self.num_tokens, self.note = ks, vs, page_size, num_tokens, note

    @classmethod
    def from_tokens(cls, ks, vs, page_size: int, note: str = "") -> RealKV:
        """From per-layer ``[n, num_kv_heads, head_dim]`` tensors, cut into pages of ``page_size``."""
        n, h, d = ks[0].shape
        pages = -(-n // page_size)

        def paged(x):
            out = torch.zeros(pages * page_size, h, d, dtype=torch.float32)
            out[:n] = x
            return out.view(pages, page_size, h, d)

        return cls([paged(k) for k in ks], [paged(v) for v in vs], page_size, n, note)


@lru_cache(maxsize=2)
def real_kv(num_tokens: int = 512, page_size: int = 16) -> RealKV:
    """SmolLM2-135M's K (after RoPE) and V of ``num_tokens`` tokens of English prose, every layer, as its paged
    cache holds them in float32 (`paged_ref.lab.likelihood.prompt_kv`; loads the model on first use)."""
    from ..models import load_smollm2
    from .likelihood import prompt_kv
    from .textdata import english_text

    num_tokens = check_int("num_tokens", num_tokens, min_value=1)
    model, tok = load_smollm2()
    ids = tok(english_text(int(num_tokens * 1.3) + 8), return_tensors="pt", add_special_tokens=False).input_ids
    ks, vs = prompt_kv(model, ids[0, :num_tokens], page_size=page_size)
    note = f"SmolLM2-135M, {num_tokens} tokens of English prose, float32"
    return RealKV.from_tokens(ks, vs, page_size, note)


def error_rows(kv: RealKV, formats, granularities=GRANULARITIES) -> list[dict]:
    """One row per (format, granularity, K or V, layer): ``rel_error``, ``max_abs_error``, ``saturated``,
    the layer's largest magnitude ``amax``; 16/32-bit formats at granularity ``"one"`` only."""
    rows = []
    for fmt in formats:
        for granularity in ("one",) if fmt in FLOAT_FORMATS else granularities:
            for name, layers in (("K", kv.ks), ("V", kv.vs)):
                for layer, pages in enumerate(layers):
                    s = stored(pages, fmt, granularity)
                    rows.append(
                        dict(
                            format=format_facts(fmt)["format"],
                            granularity=granularity,
                            tensor=name,
                            layer=layer,
                            amax=float(pages.abs().max()),
                            **{k: s[k] for k in ("rel_error", "max_abs_error", "saturated")},
                        )
                    )
    return rows


def token_bytes(
    fmt: torch.dtype, granularity: str, *, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int
):
    """Bytes one token takes in every layer (K and V): its values, plus its share of its page's scales for
    ``"page"`` (per-layer scales belong to the pool: 0 per token)."""
    check_choice("granularity", granularity, GRANULARITIES)
    geo = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if fmt in FLOAT_FORMATS:
        return float(kv_bytes_per_token(**geo, bytes_per_elem=torch.finfo(fmt).bits // 8))
    scales = "page" if granularity == "page" else "layer"
    return quant.page_bytes(fmt, page_size=page_size, scales=scales, **geo) / page_size
