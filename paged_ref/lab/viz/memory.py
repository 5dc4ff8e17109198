"""Figures for KV-cache memory arithmetic (notebook 01). Each returns a new Figure.

Every number drawn here is computed from the formulas in :mod:`paged_ref.memory` and
:mod:`paged_ref.lab.sizing`; nothing is measured on hardware, and the figures say so.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from ...memory import kv_bytes_per_token, kv_cache_bytes
from ..sizing import DTYPE_BYTES, MODEL_PRESETS, dense_scores_bytes, dtype_bytes, model_preset
from . import add_note

ARITHMETIC = "Arithmetic from paged_ref.memory (exact byte counts; no hardware measured)."
GiB = 2**30


def kv_vs_scores_figure(model: str = "LLaMA-7B", dtype: str = "float16", max_tokens: int = 32768) -> Figure:
    """One layer's KV cache (linear in N) next to one layer's dense score tensor.

    All three curves are *per layer*, so the axis compares like with like: the cache a layer
    keeps for the whole generation, the ``[heads, N, N]`` scores a naive prefill materializes in
    that layer (quadratic), and the ``[heads, 1, N]`` scores of one decode step (linear). The
    whole model's cache is ``num_layers`` times the first curve; only one layer's score tensor
    exists at a time. Prefill scores pass one layer's cache where
    ``N * num_q_heads > 2 * num_kv_heads * head_dim``.
    """
    cfg, b = model_preset(model), dtype_bytes(dtype)
    n = 2 ** np.arange(7, int(np.log2(max_tokens)) + 1)  # 128 .. max_tokens
    kv = [
        kv_cache_bytes(int(t), num_layers=1, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, bytes_per_elem=b)
        / GiB
        for t in n
    ]
    prefill = [dense_scores_bytes(int(t), num_heads=cfg.num_q_heads, bytes_per_elem=b) / GiB for t in n]
    decode = [dense_scores_bytes(int(t), num_heads=cfg.num_q_heads, bytes_per_elem=b, num_queries=1) / GiB for t in n]
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    ax.loglog(n, kv, "o-", base=2, label="KV cache, one layer (linear in N)")
    ax.loglog(n, prefill, "s--", base=2, label=f"prefill scores [{cfg.num_q_heads}, N, N], one layer (quadratic)")
    ax.loglog(n, decode, "^:", base=2, label=f"decode-step scores [{cfg.num_q_heads}, 1, N], one layer (linear)")
    ax.set_yscale("log", base=10)
    ax.set_xlabel("tokens N")
    ax.set_ylabel("GiB")
    ax.set_title(f"{model}, {dtype}, per layer: the cache and the score tensor")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    add_note(fig, ARITHMETIC + f" The whole model's cache is {cfg.num_layers}x the blue line.")
    return fig


def per_layer_claim_figure(num_tokens: int = 2048, claimed_mb_per_layer: float = 160.0) -> Figure:
    """LLaMA-7B fp16 KV cache per layer and in total: the arithmetic vs the IBM paper's claim."""
    cfg = MODEL_PRESETS["LLaMA-7B"]
    per_layer = kv_cache_bytes(num_tokens, num_layers=1, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim) / 1e6
    fig = Figure(figsize=(7.2, 3.4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for ax, scale, unit, title in (
        (ax1, 1, "MB", "per layer"),
        (ax2, cfg.num_layers / 1000, "GB", f"{cfg.num_layers} layers"),
    ):
        vals = [per_layer * scale, claimed_mb_per_layer * scale]
        bars = ax.bar(["2 x N x 4096 x 2 B", "paper: ~160 MB/layer"], vals, color=["tab:blue", "tab:gray"])
        ax.bar_label(bars, labels=[f"{v:.2f} {unit}" for v in vals], fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(f"LLaMA-7B, fp16, {num_tokens} tokens: {title}", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.15)
    add_note(fig, ARITHMETIC)
    return fig


def bytes_per_token_figure(dtype: str = "float16") -> Figure:
    """KV bytes per token of each preset model: GQA shrinks the cache by num_q / num_kv heads."""
    b = dtype_bytes(dtype)
    names = list(MODEL_PRESETS)
    kib = [kv_bytes_per_token(**MODEL_PRESETS[m].kv_shape, bytes_per_elem=b) / 1024 for m in names]
    fig = Figure(figsize=(6.4, 3.2), layout="constrained")
    ax = fig.add_subplot()
    bars = ax.barh(names, kib, color="tab:blue")
    ax.bar_label(
        bars,
        labels=[
            f"{k:.1f} KiB  ({MODEL_PRESETS[m].num_q_heads} q / {MODEL_PRESETS[m].num_kv_heads} kv heads)"
            for m, k in zip(names, kib)
        ],
        fontsize=8,
    )
    ax.set_xlabel(f"KV bytes per token ({dtype}), KiB (linear axis: bar length is size)")
    ax.invert_yaxis()
    ax.margins(x=0.6)
    ax.set_title("KV cache per token: 2 x layers x KV heads x head_dim x bytes")
    add_note(fig, ARITHMETIC)
    return fig


def kv_memory_figure(model: str, dtype: str, num_tokens: int) -> Figure:
    """One model, dtype and length: KV cache per layer and in total, and one layer's scores."""
    cfg, b = model_preset(model), dtype_bytes(dtype)
    per_layer = kv_cache_bytes(
        num_tokens, num_layers=1, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, bytes_per_elem=b
    )
    total = per_layer * cfg.num_layers
    scores = dense_scores_bytes(num_tokens, num_heads=cfg.num_q_heads, bytes_per_elem=b)
    fig = Figure(figsize=(6.4, 3.2), layout="constrained")
    ax = fig.add_subplot()
    labels = ["KV cache, one layer", f"KV cache, {cfg.num_layers} layers", "dense scores, one layer"]
    vals = [per_layer / GiB, total / GiB, scores / GiB]
    bars = ax.barh(labels, vals, color=["tab:blue", "tab:blue", "tab:orange"])
    ax.bar_label(bars, labels=[f"{v:.3g} GiB" for v in vals], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("GiB (log scale)")
    ax.invert_yaxis()
    ax.margins(x=0.4)
    ax.set_title(f"{model}, {dtype} ({DTYPE_BYTES[dtype]} B), {num_tokens:,} tokens")
    add_note(fig, ARITHMETIC)
    return fig
