"""Pictures of the Triton paged decode kernel (notebook 05). Every function returns a new Figure.

* :func:`tile_map_figure`: how the kernel walks one sequence: split-K chunks, ``BLOCK_N``-token
  tiles, logical pages, and where each tile's tokens sit in the physical cache (block table).
* :func:`online_softmax_figure`: the running max and the rescaled running sum, tile by tile.
* :func:`split_reduction_figure`: each split's local max against the global one, and how much
  of the softmax mass each split carries after the log-sum-exp reduction.
* :func:`gqa_figure`: query heads grouped onto their KV head, one program per group, and the
  K/V bytes the programs request with and without the grouping (arithmetic).

The measured results (bandwidth, what the compiler made of the kernel) are drawn by
:mod:`paged_ref.lab.viz.kernel_results`; their names are importable from here too.

Example:
    >>> import torch
    >>> fig = tile_map_figure(torch.tensor([5, 0, 3, 1]), seq_len=13, page_size=4, block_n=8)
    >>> fig = gqa_figure(num_q_heads=8, num_kv_heads=2, seq_len=4096, head_dim=128)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Polygon, Rectangle

from ..._arith import cdiv
from ..._validate import check_int
from . import add_note
from .kernel_results import COMPILE_HEADERS, bandwidth_figure, compile_report_figure, compile_rows, provenance
from .pages import PALETTE

__all__ = [
    "tile_color",
    "tile_map_figure",
    "online_softmax_figure",
    "split_reduction_figure",
    "gqa_figure",
    "kv_bytes_requested",
    "provenance",
    "bandwidth_figure",
    "COMPILE_HEADERS",
    "compile_rows",
    "compile_report_figure",
]

NOTE = "Drawn from the kernel's indexing rules on CPU (no hardware measured)."
TILE_PALETTE = PALETTE  # the page maps' sequence colors, reused for tiles
SPLIT_SHADES = ("#dbe9f6", "#fde5cc", "#d9f0d3", "#f6d5d5", "#e7dcef", "#eadbd6", "#f9dcef", "#eeeecc")
UNUSED_COLOR = "0.9"  # a physical slot this sequence does not use


def tile_color(tile: int) -> str:
    """The color of tile ``tile`` in every kernel figure."""
    return TILE_PALETTE[tile % len(TILE_PALETTE)]


# --------------------------------------------------------------------------- tiles and pages
def tile_map_figure(
    block_table_row,
    seq_len: int,
    page_size: int,
    block_n: int,
    *,
    num_splits: int = 1,
    num_pages: int | None = None,
    title: str = "",
) -> Figure:
    """One sequence as the kernel walks it, from logical tokens down to physical slots.

    Rows, top to bottom: the split-K chunks (one program each); the tiles of ``block_n``
    tokens (one loop iteration each, colored); the logical pages with their block-table
    entries; the physical cache, every slot colored by the tile that reads it, joined to its
    logical page. A tile spanning several pages does several block-table lookups; a page
    longer than a tile is read by several tiles.

    Args:
        block_table_row: int ``[max_pages]`` (a tensor or list): logical page -> physical page;
            only the first ``ceil(seq_len / page_size)`` entries are read.
        seq_len: tokens in the sequence (>= 1).
        page_size, block_n: tokens per page and per tile (>= 1 each).
        num_splits: split-K chunks (>= 1), cut as the kernel cuts them.
        num_pages: physical pages to draw (default: up to the largest page used).
        title: figure title (default: a summary of the settings).
    """
    from ...attention.online_softmax import split_ranges

    seq_len = check_int("seq_len", seq_len, min_value=1)
    page_size = check_int("page_size", page_size, min_value=1)
    block_n = check_int("block_n", block_n, min_value=1)
    table = [
        int(p) for p in (block_table_row.tolist() if isinstance(block_table_row, torch.Tensor) else block_table_row)
    ]
    used = cdiv(seq_len, page_size)
    if len(table) < used:
        raise ValueError(
            f"block_table_row must list at least ceil(seq_len / page_size) = {used} pages, got {len(table)}"
        )
    table = table[:used]
    if min(table) < 0 or len(set(table)) != used:
        raise ValueError(f"block_table_row's used entries must be distinct page ids >= 0, got {table}")
    num_pages = max(table) + 1 if num_pages is None else check_int("num_pages", num_pages, min_value=max(table) + 1)
    ranges = split_ranges(seq_len, num_splits, block_n=block_n)

    logical_width = used * page_size
    physical_width = num_pages * page_size
    width = max(logical_width, physical_width)
    fig = Figure(figsize=(min(16.0, max(8.0, 0.06 * width + 3)), 4.4), layout="constrained")
    ax = fig.add_subplot()
    y_split, y_tile, y_logical, y_phys, h = 5.0, 3.9, 2.8, 0.0, 0.8
    text = dict(ha="center", va="center", fontsize=7, clip_on=True)

    for s, (a, b) in enumerate(ranges):  # split-K chunks
        if b > a:
            ax.add_patch(Rectangle((a, y_split), b - a, h, fc=SPLIT_SHADES[s % len(SPLIT_SHADES)], ec="k", lw=0.8))
            ax.text((a + b) / 2, y_split + h / 2, f"split {s}" if b - a >= 6 else str(s), **text)
    empty = sum(1 for a, b in ranges if a == b)
    if empty:  # trailing splits with no tokens
        ax.text(
            seq_len + 0.005 * width,
            y_split + h / 2,
            f" + {empty} empty split{'s' if empty > 1 else ''} (neutral partials)",
            ha="left",
            va="center",
            fontsize=7,
        )
    n_tiles = cdiv(seq_len, block_n)
    for t in range(n_tiles):  # tiles
        a, b = t * block_n, min((t + 1) * block_n, seq_len)
        ax.add_patch(Rectangle((a, y_tile), b - a, h, fc=tile_color(t), ec="k", lw=0.6, alpha=0.85))
        if b - a >= 4:
            ax.text((a + b) / 2, y_tile + h / 2, f"T{t}", color="white", **text)
    for i, p in enumerate(table):  # logical pages, block table
        a = i * page_size
        filled = min(page_size, seq_len - a)
        ax.add_patch(Rectangle((a, y_logical), filled, h, fc="0.97", ec="k", lw=0.6))
        if filled < page_size:  # the unwritten tail
            ax.add_patch(
                Rectangle((a + filled, y_logical), page_size - filled, h, fc="white", ec="0.6", lw=0.4, hatch="///")
            )
        if page_size >= 3:
            ax.text(a + page_size / 2, y_logical + h / 2, f"{i}→{p}", bbox=dict(fc="white", ec="none", pad=0.5), **text)
        # the block-table arrow: logical page i lands on physical page p
        ax.add_patch(
            Polygon(
                [
                    (a, y_logical),
                    (a + page_size, y_logical),
                    ((p + 1) * page_size, y_phys + h),
                    (p * page_size, y_phys + h),
                ],
                closed=True,
                fc="0.5",
                ec="none",
                alpha=0.12,
            )
        )
    owner = {p: i for i, p in enumerate(table)}
    for p in range(num_pages):  # physical cache
        for o in range(page_size):
            token = owner[p] * page_size + o if p in owner else None
            color = tile_color(token // block_n) if token is not None and token < seq_len else UNUSED_COLOR
            ax.add_patch(
                Rectangle(
                    (p * page_size + o, y_phys), 1, h, fc=color, ec="none", alpha=0.85, gid=f"slot {p * page_size + o}"
                )
            )
        ax.add_patch(Rectangle((p * page_size, y_phys), page_size, h, fc="none", ec="k", lw=0.7))
        if page_size >= 3:
            ax.text((p + 0.5) * page_size, y_phys - 0.3, f"P{p}", **text)
    for label, y in (
        ("splits (programs)", y_split),
        ("tiles of BLOCK_N", y_tile),
        ("logical pages i→block_table[i]", y_logical),
        ("physical cache", y_phys),
    ):
        ax.text(-0.01 * width, y + h / 2, label, ha="right", va="center", fontsize=8)
    ax.set_xlim(0, width)
    ax.set_ylim(-0.7, y_split + h + 0.2)
    ax.set_yticks([])
    ax.set_xlabel(
        "token position (logical, top rows) / physical slot = page * page_size + offset (bottom row)", fontsize=8
    )
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        title
        or f"seq_len {seq_len}, page size {page_size}, BLOCK_N {block_n}, "
        f"{num_splits} split{'s' if num_splits > 1 else ''}: {n_tiles} tiles over "
        f"{used} pages",
        fontsize=10,
    )
    add_note(fig, NOTE)
    return fig


# --------------------------------------------------------------------------- online softmax
def online_softmax_figure(scores, steps, *, row: int = 0) -> Figure:
    """The online softmax of one query row, tile by tile (from ``online_softmax_steps``).

    Left: the scores (base 2) with each tile shaded and the running max ``m`` after each tile.
    Right: the running sum ``l`` after each tile, as the old sum rescaled by ``alpha`` plus
    the tile's own ``sum 2^(s - m)``.

    Args:
        scores: ``[rows, n]`` the scores that were fed in (base 2).
        steps: the list of ``TileStep`` from ``online_softmax_steps(scores, ...)``.
        row: which query row to draw.
    """
    if not steps:
        raise ValueError("steps must hold at least one TileStep, got none")
    s = scores[row].double().numpy()
    fig = Figure(figsize=(10.5, 3.4), layout="constrained")
    ax_s, ax_l = fig.subplots(1, 2)
    for t, st in enumerate(steps):
        ax_s.axvspan(st.start - 0.5, st.end - 0.5, color=tile_color(t), alpha=0.15, lw=0)
        ax_s.hlines(
            float(st.m[row]),
            st.start - 0.5,
            st.end - 0.5,
            color="k",
            lw=2,
            label="running max m after the tile" if t == 0 else None,
        )
        ax_s.text(
            (st.start + st.end - 1) / 2,
            float(st.m[row]),
            f" α={float(st.alpha[row]):.3g}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_s.plot(np.arange(len(s)), s, "o", color="0.2", ms=4, label="score s (base 2)")
    ax_s.set_xlabel("token")
    ax_s.set_ylabel("score, base 2")
    ax_s.set_title("scores, tiles and the running max", fontsize=9)
    ax_s.legend(fontsize=7, loc="lower right")

    l_prev = 0.0
    for t, st in enumerate(steps):
        carried = l_prev * float(st.alpha[row])
        added = float(st.l[row]) - carried
        ax_l.bar(t, carried, color="0.6", label="old l × α" if t == 0 else None)
        ax_l.bar(t, added, bottom=carried, color=tile_color(t), label="this tile's Σ 2^(s-m)" if t == 0 else None)
        if l_prev > 0:
            ax_l.plot(
                [t - 0.4, t + 0.4], [l_prev, l_prev], "k:", lw=1, label="old l before rescaling" if t == 1 else None
            )
        ax_l.text(t, float(st.l[row]), f"{float(st.l[row]):.3g}", ha="center", va="bottom", fontsize=8)
        l_prev = float(st.l[row])
    ax_l.set_xticks(range(len(steps)), [f"T{t}\n{st.start}-{st.end - 1}" for t, st in enumerate(steps)])
    ax_l.set_ylabel("running sum l")
    ax_l.set_title("l = l_old · 2^(m_old - m) + Σ 2^(s - m)", fontsize=9)
    ax_l.legend(fontsize=7)
    fig.suptitle("online softmax, one query row, float32 as in the kernel", fontsize=10)
    add_note(fig, "Computed with paged_ref.attention.online_softmax on CPU (no hardware measured).")
    return fig


# --------------------------------------------------------------------------- split-K
def split_reduction_figure(scores, ranges: Sequence[tuple[int, int]], m, l) -> Figure:
    """Split-K for one query row: local maxima, and each split's share after the reduction.

    Args:
        scores: ``[n]`` one row's scores (base 2).
        ranges: the ``(start, end)`` of each split (``split_ranges``).
        m, l: ``[num_splits]`` each split's running max and sum (``-inf``/0 when empty).
    """
    s = torch.as_tensor(scores).double()
    m = torch.as_tensor(m).double()
    l = torch.as_tensor(l).double()
    if not (len(ranges) == m.numel() == l.numel()):
        raise ValueError(f"ranges, m and l must have one entry per split, got {len(ranges)}, {m.numel()}, {l.numel()}")
    m_global = float(m.max())
    w = torch.exp2(m - m_global)  # [S]
    share = (w * l) / (w * l).sum()  # [S]
    fig = Figure(figsize=(10.5, 3.4), layout="constrained")
    ax_s, ax_w = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=(3, 2)))
    for i, (a, b) in enumerate(ranges):
        if b <= a:
            continue
        shade = SPLIT_SHADES[i % len(SPLIT_SHADES)]
        ax_s.axvspan(a - 0.5, b - 0.5, color=shade, lw=0)
        ax_s.hlines(float(m[i]), a - 0.5, b - 0.5, color="k", lw=2, label="split's own max m_s" if i == 0 else None)
    ax_s.plot(np.arange(len(s)), s.numpy(), ".", color="0.25", ms=4, label="score (base 2)")
    ax_s.axhline(m_global, color="tab:red", ls="--", lw=1, label="global max M")
    ax_s.set_xlabel("token")
    ax_s.set_ylabel("score, base 2")
    ax_s.set_title("each split runs its own online softmax", fontsize=9)
    ax_s.legend(fontsize=7, loc="lower right")
    x = np.arange(len(ranges))
    ax_w.bar(x, share.numpy(), color=[SPLIT_SHADES[i % len(SPLIT_SHADES)] for i in x], ec="k")
    for i in x:
        text = "empty" if l[i] == 0 else f"w={float(w[i]):.2g}"
        ax_w.text(i, float(share[i]), text, ha="center", va="bottom", fontsize=8)
    ax_w.set_xticks(x, [f"split {i}" for i in x], fontsize=8)
    ax_w.set_ylabel("share of Σ 2^(s - M)")
    ax_w.set_title("reduction: w_s = 2^(m_s - M), share = w_s l_s / Σ w l", fontsize=9)
    fig.suptitle("split-K: partial (m, l, acc) per split, merged by log-sum-exp", fontsize=10)
    add_note(fig, "Computed with paged_ref.attention.online_softmax on CPU (no hardware measured).")
    return fig


# --------------------------------------------------------------------------- GQA
def kv_bytes_requested(
    num_q_heads: int, num_kv_heads: int, seq_len: int, head_dim: int, bytes_per_elem: int = 2
) -> dict[str, int]:
    """K/V bytes the programs of one decode step request for one sequence (arithmetic).

    ``per_query_head``: one program per query head, each loading its KV head's K and V (a KV
    head is loaded ``group`` times). ``per_kv_head``: one program per KV head serving all its
    query heads (``triton_paged_decode``): each byte once.

    Example:
        >>> kv_bytes_requested(32, 8, 1024, 128)
        {'per_query_head': 16777216, 'per_kv_head': 4194304}
    """
    for name, v in (
        ("num_q_heads", num_q_heads),
        ("num_kv_heads", num_kv_heads),
        ("seq_len", seq_len),
        ("head_dim", head_dim),
        ("bytes_per_elem", bytes_per_elem),
    ):
        check_int(name, v, min_value=1)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    one_head = 2 * seq_len * head_dim * bytes_per_elem  # K and V of one KV head
    return {"per_query_head": num_q_heads * one_head, "per_kv_head": num_kv_heads * one_head}


def gqa_figure(num_q_heads: int, num_kv_heads: int, seq_len: int, head_dim: int, *, bytes_per_elem: int = 2) -> Figure:
    """Query heads grouped onto their KV head (one program each), and the bytes it saves."""
    nbytes = kv_bytes_requested(num_q_heads, num_kv_heads, seq_len, head_dim, bytes_per_elem)
    group = num_q_heads // num_kv_heads
    fig = Figure(figsize=(10.5, 3.2), layout="constrained")
    ax, ax_b = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=(3, 1.4)))
    for h in range(num_kv_heads):
        c = tile_color(h)
        x0 = h * group
        ax.add_patch(Rectangle((x0 - 0.45, 1.55), group - 0.1, 1.0, fc="none", ec=c, lw=1.5, ls="--"))
        # one short label per program; the first one spells out what a program is
        label = f"program (b, kv_head={h}):\na [{group}, D] tile" if h == 0 else f"kv_head={h}"
        ax.text(x0 + group / 2 - 0.5, 2.62, label, ha="center", va="bottom", fontsize=6 if h else 7, color=c)
        for g in range(group):
            q = x0 + g
            ax.add_patch(Rectangle((q - 0.35, 1.7), 0.7, 0.6, fc=c, alpha=0.7))
            ax.text(q, 2.0, str(q), ha="center", va="center", fontsize=5 if q >= 10 else 6, color="white")
            ax.plot([q, x0 + group / 2 - 0.5], [1.7, 0.6], color=c, lw=0.8, alpha=0.6)
        ax.add_patch(Rectangle((x0 + group / 2 - 0.5 - 0.6, 0.0), 1.2, 0.6, fc=c))
        ax.text(x0 + group / 2 - 0.5, 0.3, f"KV {h}", ha="center", va="center", fontsize=6, color="white")
    ax.text(-0.9, 2.0, "query\nheads", ha="right", va="center", fontsize=7)
    ax.set_xlim(-2.2, num_q_heads)
    ax.set_ylim(-0.2, 3.4)
    ax.axis("off")
    ax.set_title(f"GQA {group}: query head h reads KV head h // {group}", fontsize=9)
    labels = ["one program\nper query head", "one program per\nKV head (paged_decode)"]
    vals = [nbytes["per_query_head"] / 2**20, nbytes["per_kv_head"] / 2**20]
    ax_b.bar(labels, vals, color=["0.6", "tab:red"])
    for i, v in enumerate(vals):
        ax_b.text(i, v, f"{v:,.1f} MiB", ha="center", va="bottom", fontsize=8)
    ax_b.set_ylabel("K/V bytes requested, MiB")
    ax_b.set_title(f"one sequence of {seq_len:,} tokens, head_dim {head_dim}, {bytes_per_elem} B/elem", fontsize=8)
    ax_b.tick_params(axis="x", labelsize=7)
    add_note(fig, "Arithmetic (no hardware measured).")
    return fig
