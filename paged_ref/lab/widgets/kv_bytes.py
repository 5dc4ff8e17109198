"""Widget for notebook 11: a KV format, a scale granularity and a pool budget, against a real page.

`bytes_view`, the sliders' callback, is a pure function of a `paged_ref.lab.kv_bytes.RealKV` (a real
model's K and V in pages) and the choices: the bytes one token takes in every layer, how many
sequences of ``context`` tokens fit in ``pool_mib`` MiB (whole pages, as a paged pool holds them)
against float32, and one real K page stored in the format and read back.

Example:
    >>> import torch
    >>> from paged_ref.lab.kv_bytes import RealKV
    >>> g = torch.Generator().manual_seed(0)
    >>> ks = [torch.randn(40, 2, 8, generator=g) for _ in range(2)]
    >>> kv = RealKV.from_tokens(ks, ks, page_size=16, note="random")
    >>> fig, stats = bytes_view(kv, "int8", "page", pool_mib=1, context=100, layer=1, page=0)
    >>> stats["bytes_per_token"], stats["float32_bytes_per_token"], stats["sequences"], stats["float32_sequences"]
    (66.0, 256.0, 141, 36)
"""

from __future__ import annotations

import torch

from ..._arith import cdiv
from ..._validate import check_choice, check_int
from ..kv_bytes import FLOAT_FORMATS, GRANULARITIES, RealKV, stored, token_bytes
from . import with_static_figure

__all__ = ["FORMAT_NAMES", "bytes_panel", "bytes_view"]

FORMAT_NAMES = {str(f).removeprefix("torch."): f for f in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)}
FORMAT_NAMES |= {str(f).removeprefix("torch."): f for f in FLOAT_FORMATS}


def bytes_view(kv: RealKV, fmt: str, granularity: str, *, pool_mib: int, context: int, layer: int = 15, page: int = 0):
    """The panel's callback: ``(Figure, stats)`` for storing ``kv`` in ``fmt`` (a name of `FORMAT_NAMES`) at
    ``granularity`` (`paged_ref.lab.kv_bytes.GRANULARITIES`; ignored by 16/32-bit formats).

    ``stats``: ``bytes_per_token`` and ``float32_bytes_per_token`` (every layer, K and V, scales included),
    ``sequences`` and ``float32_sequences`` (of ``context`` tokens in whole pages, in ``pool_mib`` MiB), and
    for K page ``page`` of ``layer``: ``page_rel_error`` and ``saturated`` (all of its KV heads)."""
    check_choice("fmt", fmt, FORMAT_NAMES)
    check_choice("granularity", granularity, GRANULARITIES)
    pool = check_int("pool_mib", pool_mib, min_value=1) * 2**20
    context = check_int("context", context, min_value=1)
    layer = _index("layer", layer, len(kv.ks))
    pages = kv.ks[layer]  # [num_pages, page_size, Hkv, D]
    page = _index("page", page, pages.shape[0])
    _, page_size, heads, dim = pages.shape
    geo = dict(num_layers=len(kv.ks), num_kv_heads=heads, head_dim=dim, page_size=page_size)
    per_token = token_bytes(FORMAT_NAMES[fmt], granularity, **geo)
    f32 = token_bytes(torch.float32, "one", **geo)
    seq_bytes = cdiv(context, page_size) * page_size  # tokens a sequence's pages hold
    # the page's own scale at "page"; the layer's at "layer" (calibrated over the whole layer)
    one = stored(pages, FORMAT_NAMES[fmt], granularity)
    back, true = one["values"][page], pages[page]  # [page_size, Hkv, D]
    stats = dict(
        format=fmt,
        granularity=granularity,
        pool_mib=pool_mib,
        context=context,
        bytes_per_token=per_token,
        float32_bytes_per_token=f32,
        sequences=int(pool // (seq_bytes * per_token)),
        float32_sequences=int(pool // (seq_bytes * f32)),
        page_rel_error=float((back - true).norm() / true.norm()) if true.norm() > 0 else 0.0,
        saturated=_saturated(true, one["scale"], page, FORMAT_NAMES[fmt]),
    )
    from ..viz.kv_bytes import page_figure

    note = f"{kv.note}; layer {layer}, page {page}, KV head 0"
    return page_figure(stats, true[:, 0], back[:, 0], note=note), stats


def _index(name: str, value, n: int) -> int:
    if not 0 <= check_int(name, value, min_value=0) < n:
        raise ValueError(f"{name} must be in [0, {n}), got {value}")
    return int(value)


def _saturated(true: torch.Tensor, scale: torch.Tensor, page: int, fmt) -> int:
    """Values of one page beyond ``fmt``'s range at its scale (``scale`` as `stored` returns it)."""
    from ... import quant

    if fmt in FLOAT_FORMATS:
        return int((true.abs() > torch.finfo(fmt).max).sum())
    s = scale[page] if scale.dim() == 4 else scale  # [1, Hkv, 1] for per-page scales
    return quant.count_saturated(true, s, fmt)


def bytes_panel(kv: RealKV, *, pool_mib: int = 256, context: int = 1024):
    """Dropdowns for the format and the scale granularity, sliders for the pool and the sequence length,
    redrawing `bytes_view` (``continuous_update=False``)."""
    import ipywidgets as w
    from IPython.display import display

    controls = dict(
        fmt=w.Dropdown(options=list(FORMAT_NAMES), value="float8_e4m3fn", description="format"),
        granularity=w.Dropdown(options=list(GRANULARITIES), value="page", description="scales"),
        pool_mib=w.IntSlider(
            value=pool_mib, min=8, max=1024, step=8, description="pool (MiB)", continuous_update=False
        ),
        context=w.IntSlider(value=context, min=16, max=8192, step=16, description="tokens", continuous_update=False),
    )
    out = w.interactive_output(lambda **c: display(bytes_view(kv, **c)[0]), controls)
    first = bytes_view(kv, **{k: c.value for k, c in controls.items()})[0]
    return with_static_figure(
        w.VBox([w.HBox(list(controls.values())[:2]), w.HBox(list(controls.values())[2:]), out]), first
    )
