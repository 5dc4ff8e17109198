"""Notebook 11's figures (fewer bytes per token): the formats' grids against real values, the error of a
real model's K and V per layer, and the widget's bytes and page.

The numbers come from `paged_ref.lab.kv_bytes` and `paged_ref.lab.widgets.kv_bytes`; each function returns
a new ``Figure``.

Example:
    >>> import torch
    >>> from paged_ref.lab.kv_bytes import representable
    >>> fig = grid_figure({"int8 x 0.1": representable(torch.int8) * 0.1}, torch.rand(100) * 10, "random")
    >>> len(fig.axes)
    2
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure

from . import add_note

__all__ = ["error_figure", "grid_figure", "page_figure", "scales_figure"]

COLORS = {"float8_e4m3fn": "tab:blue", "float8_e5m2": "tab:orange", "int8": "tab:green", "bfloat16": "0.4"}
STYLES = {"one": ":", "layer": "--", "page": "-"}


def grid_figure(grids: dict, real: torch.Tensor, what: str, *, note: str = "") -> Figure:
    """Top: each format's positive values (``grids``: label -> ascending values) as ticks on a log axis;
    bottom: a histogram of ``real``'s magnitudes (``what`` names them) on the same axis."""
    fig = Figure(figsize=(9, 4.0))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1.2, 1])
    for i, values in enumerate(grids.values()):
        top.plot(values.tolist(), [i] * values.numel(), "|", ms=12, color=f"C{i}")
    top.set_yticks(range(len(grids)), list(grids))
    top.set_ylim(-0.7, len(grids) - 0.3)
    top.set_xscale("log")
    top.set_title("the positive values each format can store", fontsize=9)
    mag = real.abs().flatten()
    mag = mag[mag > 0]
    lo, hi = float(mag.min()), float(mag.max())
    bins = torch.logspace(torch.log10(torch.tensor(lo)), torch.log10(torch.tensor(hi)), 60)
    bottom.hist(mag.tolist(), bins=bins.tolist(), color="0.5")
    bottom.set_xscale("log")
    bottom.set_xlabel("magnitude")
    bottom.set_ylabel("values")
    bottom.set_title(what, fontsize=9)
    fig.tight_layout()
    if note:
        add_note(fig, note)
    return fig


def error_figure(rows: list[dict], *, note: str = "") -> Figure:
    """Relative error (``||stored - x|| / ||x||``) per layer, K left and V right, one line per format and
    scale granularity (``rows`` from `paged_ref.lab.kv_bytes.error_rows`)."""
    fig = Figure(figsize=(10, 3.6))
    axes = dict(zip("KV", fig.subplots(1, 2, sharey=True)))
    lines = sorted({(r["format"], r["granularity"]) for r in rows})
    for tensor, ax in axes.items():
        for fmt, gran in lines:
            pts = sorted(
                (r["layer"], r["rel_error"])
                for r in rows
                if (r["format"], r["granularity"], r["tensor"]) == (fmt, gran, tensor)
            )
            ax.plot(*zip(*pts), STYLES.get(gran, "-"), color=COLORS.get(fmt, "k"), label=f"{fmt}, scale: {gran}")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(f"{tensor}: relative error when stored", fontsize=9)
    axes["K"].set_ylabel("||stored - x|| / ||x||")
    axes["V"].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    if note:
        add_note(fig, note)
    return fig


def page_figure(stats: dict, page: torch.Tensor, back: torch.Tensor, *, note: str = "") -> Figure:
    """The widget's picture: left, bytes per token and sequences that fit against float32; right, one real
    page ``[page_size, head_dim]`` (one KV head) and the error ``back - page`` after storing it."""
    fig = Figure(figsize=(10, 3.4))
    bars, values, errors = fig.subplots(1, 3, width_ratios=[1, 1.3, 1.3])
    names = ["float32", stats["format"]]
    seqs = [stats["float32_sequences"], stats["sequences"]]
    bars.bar(names, seqs, color=["0.6", COLORS.get(stats["format"], "tab:blue")])
    for i, (n, b) in enumerate(zip(seqs, [stats["float32_bytes_per_token"], stats["bytes_per_token"]])):
        bars.text(i, n, f"{n} seqs\n{b / 1024:.1f} KiB/token", ha="center", va="bottom", fontsize=8)
    bars.set_ylim(0, max(seqs) * 1.35 + 1)
    bars.set_ylabel(f"sequences of {stats['context']} tokens in {stats['pool_mib']} MiB")
    top = float(page.abs().max())
    im = values.imshow(page.T.tolist(), aspect="auto", cmap="RdBu_r", vmin=-top, vmax=top)
    values.set_title("a real page of K (one KV head)", fontsize=9)
    values.set_xlabel("token in page")
    values.set_ylabel("channel")
    fig.colorbar(im, ax=values)
    err = (back - page).T
    worst = float(err.abs().max()) or 1.0
    im = errors.imshow(err.tolist(), aspect="auto", cmap="PuOr", vmin=-worst, vmax=worst)
    errors.set_title(f"stored - true: {stats['page_rel_error']:.2%} relative", fontsize=9)
    errors.set_xlabel("token in page")
    fig.colorbar(im, ax=errors)
    fig.tight_layout()
    if note:
        add_note(fig, note)
    return fig


def scales_figure(
    k_scale: torch.Tensor, v_scale: torch.Tensor, owners: dict, *, title: str = "", note: str = ""
) -> Figure:
    """A cache's page scales, one column per physical page: ``k_scale, v_scale: [num_pages, num_kv_heads]``
    (`paged_ref.cache.PagedKVCache.kv_scales`), rows K head 0.., V head 0..; ``owners``: page -> label
    written under its column. A page holding no token has scale 0 (left blank)."""
    grid = torch.cat([k_scale.T, v_scale.T])  # [2 * Hkv, num_pages]
    heads = k_scale.shape[1]
    fig = Figure(figsize=(9, 0.45 * 2 * heads + 1.6))
    ax = fig.subplots()
    shown = grid.masked_fill(grid == 0, float("nan"))
    im = ax.imshow(shown.tolist(), aspect="auto", cmap="viridis")
    for (r, c), value in zip(
        torch.cartesian_prod(torch.arange(grid.shape[0]), torch.arange(grid.shape[1])).tolist(), grid.flatten().tolist()
    ):
        if value:
            ax.text(c, r, f"{value:.3g}", ha="center", va="center", fontsize=6, color="w")
    ax.set_yticks(range(2 * heads), [f"K head {h}" for h in range(heads)] + [f"V head {h}" for h in range(heads)])
    ax.set_xticks(range(grid.shape[1]), [f"{p}\n{owners.get(p, '')}" for p in range(grid.shape[1])], fontsize=7)
    ax.set_xlabel("physical page (holder)")
    ax.set_title(title or "one float32 scale per page, KV head and K/V (blank: no token, scale 0)", fontsize=9)
    fig.colorbar(im, ax=ax, label="scale")
    fig.tight_layout()
    if note:
        add_note(fig, note)
    return fig
