"""Widget for notebook 01: KV-cache size over model, dtype and length."""

from __future__ import annotations

from matplotlib.figure import Figure

from ..._validate import check_int
from ...memory import kv_cache_bytes
from ..sizing import DTYPE_BYTES, MODEL_PRESETS, dense_scores_bytes, dtype_bytes, model_preset
from ..viz.memory import kv_memory_figure
from . import with_static_figure

#: Lengths offered by the slider (powers of two, 128 .. 128k tokens).
LENGTHS = tuple(2**k for k in range(7, 18))


def kv_memory_numbers(model: str, dtype: str, num_tokens: int) -> dict[str, int]:
    """Byte counts the panel shows: KV per layer, KV in all layers, one layer's dense scores."""
    cfg, b = model_preset(model), dtype_bytes(dtype)
    num_tokens = check_int("num_tokens", num_tokens, min_value=1)
    per_layer = kv_cache_bytes(
        num_tokens, num_layers=1, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, bytes_per_elem=b
    )
    return {
        "kv_per_layer": per_layer,
        "kv_total": kv_cache_bytes(num_tokens, **cfg.kv_shape, bytes_per_elem=b),
        "scores_one_layer": dense_scores_bytes(num_tokens, num_heads=cfg.num_q_heads, bytes_per_elem=b),
    }


def kv_memory_view(model: str, dtype: str, num_tokens: int) -> Figure:
    """The panel's callback: a new Figure for this model, dtype and length (no side effects)."""
    check_int("num_tokens", num_tokens, min_value=1)
    return kv_memory_figure(model, dtype, num_tokens)


def kv_memory_panel():
    """Dropdowns for model and dtype and a length slider, redrawing :func:`kv_memory_view`."""
    import ipywidgets as w
    from IPython.display import display

    model = w.Dropdown(options=list(MODEL_PRESETS), value="LLaMA-7B", description="model")
    dtype = w.Dropdown(options=list(DTYPE_BYTES), value="float16", description="dtype")
    tokens = w.SelectionSlider(options=LENGTHS, value=2048, description="tokens", continuous_update=False)
    out = w.interactive_output(
        lambda model, dtype, num_tokens: display(kv_memory_view(model, dtype, num_tokens)),
        {"model": model, "dtype": dtype, "num_tokens": tokens},
    )
    return with_static_figure(
        w.VBox([w.HBox([model, dtype, tokens]), out]), kv_memory_view(model.value, dtype.value, tokens.value)
    )
