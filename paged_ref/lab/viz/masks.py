"""Pictures of paged FlexAttention masks (notebook 04). Every figure function returns a new Figure.

FlexAttention over a paged cache treats the whole cache as one long physical K/V sequence of
``num_pages * page_size`` positions. Two objects decide what a query adds into its softmax:

* the **block lists** of the BlockMask (which ``kv_block_size``-wide blocks to visit), read by
  a compiled, block-sparse kernel;
* the **mask_mod**, evaluated element by element inside every visited block (and, in eager
  mode on CPU, on every element of the whole cache).

The functions here draw both, in logical and in physical coordinates:

* :func:`block_masks_figure`: the logical BlockMask next to its physical translation;
* :func:`mask_views_figure`: several physical pictures side by side, each checked against the
  ground truth :func:`expected_visible` (leaks in red, misses in black);
* :func:`translation_figure`: physical pages of the cache joined to the logical pages of the
  sequences that own them (the map the mask_mod inverts).

The data behind them lives in :mod:`paged_ref.lab.flex_inspect` (:func:`expected_visible`,
the ground truth; :func:`listed_blocks`, :func:`page_owners`, :func:`block_kinds`,
:func:`trace_position`, :func:`untranslated_block_mask`); this module re-exports those names.

Example:
    >>> import torch
    >>> from paged_ref.attention.flex import paged_block_masks
    >>> bt, lens = torch.tensor([[3, 1], [0, 2]]), torch.tensor([6, 3])
    >>> masks = paged_block_masks(bt, lens, num_pages=4, page_size=4, kv_block_size=4)
    >>> fig = block_masks_figure(masks, bt, lens, page_size=4)
    >>> trace_position(bt, lens, page_size=4, b=0, physical=13).verdict
    'kept'
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Polygon, Rectangle
from torch.nn.attention.flex_attention import BlockMask

from ..._arith import cdiv
from ..flex_inspect import (
    FULL,
    PARTIAL,
    SKIPPED,
    VERDICTS,
    PositionTrace,
    block_kinds,
    dense_masks,
    expected_visible,
    format_traces,
    listed_blocks,
    page_owners,
    trace_position,
    untranslated_block_mask,
)
from . import add_note
from .pages import seq_color

__all__ = [
    "FULL",
    "PARTIAL",
    "SKIPPED",
    "VERDICTS",
    "PositionTrace",
    "block_kinds",
    "block_mask_figure",
    "block_masks_figure",
    "expected_visible",
    "format_traces",
    "listed_blocks",
    "mask_views_figure",
    "page_owners",
    "trace_position",
    "translation_figure",
    "untranslated_block_mask",
]

NOTE = "Drawn from BlockMasks built on CPU (no hardware measured)."
LISTED_COLOR = "0.86"  # inside a visited block but masked out by the mask_mod
LEAK_COLOR = "red"  # added into the softmax although it is not the sequence's token
MISS_COLOR = "black"  # one of the sequence's tokens that is never added
FREE_COLOR = "0.8"  # a page no sequence of the batch owns


# --------------------------------------------------------------------------- drawing helpers
def _rows(x: torch.Tensor, q_lens, q_len: int) -> tuple[np.ndarray, list[int]]:
    """[batch, q_len, kv] -> rows shown (decode: 1 per sequence; prefill: q_lens[b] rows each,
    at least one) stacked as [rows, kv], and the batch index of each row."""
    owner, keep = [], []
    for b in range(x.shape[0]):
        m = 1 if q_lens is None else max(1, int(q_lens[b]))
        keep.extend(x[b, i].numpy() for i in range(min(m, q_len)))
        owner.extend([b] * min(m, q_len))
    return np.stack(keep), owner


def _image(
    counts: np.ndarray, owner: Sequence[int], listed: np.ndarray | None, expected: np.ndarray | None
) -> np.ndarray:
    """RGB image: the row's sequence color where counted once and expected, red where counted
    but not expected (or counted twice), black where expected and never counted, grey where a
    listed block was masked, white elsewhere."""
    img = np.ones(counts.shape + (3,))
    if listed is not None:
        img[listed & (counts == 0)] = to_rgb(LISTED_COLOR)
    for r, b in enumerate(owner):
        img[r, counts[r] == 1] = to_rgb(seq_color(b))
    if expected is not None:
        img[(counts > 0) & ~expected] = to_rgb(LEAK_COLOR)
        img[(counts == 0) & expected] = to_rgb(MISS_COLOR)
    img[counts > 1] = to_rgb(LEAK_COLOR)
    return img


def _grid(ax, n_rows: int, kv_len: int, page_size: int, kv_block_size: int | None, owner: Sequence[int]) -> None:
    """Page boundaries (thin), flex block boundaries (dashed), sequence separators."""
    if page_size > 1 and kv_len // page_size <= 64:  # page lines, unless they would be a wall
        for x in range(page_size, kv_len, page_size):
            ax.axvline(x - 0.5, color="0.55", lw=0.4)
    if kv_block_size:
        for x in range(kv_block_size, kv_len, kv_block_size):
            ax.axvline(x - 0.5, color="black", lw=1.1, ls=(0, (3, 2)))
    for r in range(1, n_rows):
        if owner[r] != owner[r - 1]:
            ax.axhline(r - 0.5, color="black", lw=0.8)
    ax.set_xlim(-0.5, kv_len - 0.5)
    ax.set_ylim(n_rows - 0.5, -0.5)


def _row_labels(ax, owner: Sequence[int], prefill: bool, names: Sequence[str] | None = None) -> None:
    ticks, labels = [], []
    for b in sorted(set(owner)):
        rows = [r for r, o in enumerate(owner) if o == b]
        ticks.append((rows[0] + rows[-1]) / 2)
        labels.append((names[b] if names else f"seq {b}") + (f" ({len(rows)} q)" if prefill else ""))
    ax.set_yticks(ticks, labels, fontsize=7)
    for tick, b in zip(ax.get_yticklabels(), sorted(set(owner))):
        tick.set_color(seq_color(b))


def _page_strip(ax, labels: Sequence[str], colors: Sequence[str], page_size: int, kv_len: int) -> None:
    """A strip of page cells above a panel, each labelled (page id or logical index)."""
    for i, (label, color) in enumerate(zip(labels, colors)):
        x0 = i * page_size - 0.5
        ax.add_patch(Rectangle((x0, 0), page_size, 1, facecolor=color, edgecolor="white", lw=0.8, alpha=0.85))
        if len(labels) <= 24:
            ax.text(
                x0 + page_size / 2,
                0.5,
                label,
                ha="center",
                va="center",
                fontsize=6 if len(labels) > 16 else 7,
                color="white",
                fontweight="bold",
            )
    ax.set_xlim(-0.5, kv_len - 0.5)
    ax.set_ylim(0, 1)
    ax.axis("off")


def _physical_strip(ax, owners: Sequence[tuple[int, ...]], page_size: int) -> None:
    colors = [seq_color(o[0]) if o else FREE_COLOR for o in owners]
    _page_strip(ax, [str(p) for p in range(len(owners))], colors, page_size, len(owners) * page_size)


def _legend(fig, *, listed: bool, checked: bool) -> None:
    handles = [Patch(facecolor=seq_color(0), label="added to the softmax (color = sequence)")]
    if listed:
        handles.append(Patch(facecolor=LISTED_COLOR, label="in a visited block, masked by mask_mod"))
    handles.append(Patch(facecolor="white", edgecolor="0.5", label="not visited"))
    if checked:
        handles += [
            Patch(facecolor=LEAK_COLOR, label="wrong: not this sequence's token, or added twice"),
            Patch(facecolor=MISS_COLOR, label="wrong: this sequence's token, never added"),
        ]
    fig.legend(handles=handles, loc="outside lower right", ncols=min(len(handles), 3), fontsize=7, frameon=False)


def _strip_axes(fig, n: int, width_ratios: Sequence[float], n_rows: int):
    grid = fig.add_gridspec(2, n, height_ratios=[1, max(3, min(n_rows, 24))], width_ratios=width_ratios)
    strips = [fig.add_subplot(grid[0, i]) for i in range(n)]
    panels = [fig.add_subplot(grid[1, i]) for i in range(n)]
    return strips, panels


# --------------------------------------------------------------------------- figures
def block_masks_figure(
    masks, block_table: torch.Tensor, seq_lens, page_size: int, *, q_lens=None, title: str | None = None
) -> Figure:
    """The logical BlockMask (left) next to its physical translation (right), token by token.

    Each row is one query (decode: one per sequence; prefill: each sequence's new tokens).
    A cell is colored where a block-sparse kernel adds the pair into the softmax (block lists
    replayed with :func:`~paged_ref.lab.flex_inspect.block_mask_visits`), grey where its block is
    visited but the mask_mod masks it. Thin lines are page boundaries, dashed ones flex block
    boundaries. The strips on top name the pages: logical page index on the left, physical page
    id colored by its owner on the right (grey: free or padding, owned by no row).

    Args:
        masks: ``paged_block_masks(block_table, seq_lens, num_pages, page_size, ...)``.
        block_table: int ``[batch, max_pages]``; seq_lens: int ``[batch]``; q_lens: int
            ``[batch]`` for prefill (as given to ``paged_block_masks``), None for decode.
    """
    logical, physical = dense_masks(masks)  # [B, Q, max_pages*P], [B, Q, N*P]
    q_len = logical.shape[1]
    kv_block = masks.logical.BLOCK_SIZE[1]
    num_pages = physical.shape[-1] // page_size
    max_pages = logical.shape[-1] // page_size
    prefill = q_lens is not None
    lc, owner = _rows(logical.int(), q_lens, q_len)
    ll, _ = _rows(listed_blocks(masks.logical), q_lens, q_len)
    pc, _ = _rows(physical.int(), q_lens, q_len)
    pl, _ = _rows(listed_blocks(masks.physical), q_lens, q_len)
    n_rows = len(owner)
    fig = Figure(figsize=(12.0, 1.9 + 0.16 * min(n_rows, 40)), layout="constrained")
    (ls, ps), (la, pa) = _strip_axes(fig, 2, [max_pages, max(num_pages, max_pages)], n_rows)
    _page_strip(ls, [f"L{i}" for i in range(max_pages)], ["0.45"] * max_pages, page_size, max_pages * page_size)
    _physical_strip(ps, page_owners(block_table, seq_lens, num_pages, page_size), page_size)
    for ax, counts, listed, kind, width in ((la, lc, ll, "logical", max_pages), (pa, pc, pl, "physical", num_pages)):
        ax.imshow(_image(counts, owner, listed, None), aspect="auto", interpolation="nearest")
        _grid(ax, n_rows, width * page_size, page_size, kv_block, owner)
        _row_labels(ax, owner, prefill)
        ax.set_xlabel(
            f"{kind} KV position"
            + (" (each sequence's own tokens)" if kind == "logical" else " (the whole cache as one sequence)"),
            fontsize=8,
        )
        ax.tick_params(labelsize=7)
    n_log = int(masks.logical.kv_num_blocks.sum() + _full(masks.logical))
    n_phys = int(masks.physical.kv_num_blocks.sum() + _full(masks.physical))
    la.set_title(f"logical BlockMask: {n_log} block visits", fontsize=9, loc="left")
    pa.set_title(f"physical BlockMask: {n_phys} block visits", fontsize=9, loc="left")
    fig.suptitle(
        title or f"page size {page_size}, flex KV block {kv_block}: {'causal prefill' if prefill else 'decode'}",
        fontsize=10,
    )
    _legend(fig, listed=True, checked=False)
    add_note(fig, NOTE)
    return fig


def _full(bm: BlockMask) -> int:
    return 0 if bm.full_kv_num_blocks is None else int(bm.full_kv_num_blocks.sum())


def mask_views_figure(
    views: Sequence[tuple[str, torch.Tensor]],
    block_table: torch.Tensor,
    seq_lens,
    page_size: int,
    *,
    expected: torch.Tensor,
    kv_block_size: int | None = None,
    q_lens=None,
    names: Sequence[str] | None = None,
    title: str = "",
) -> Figure:
    """Several physical pictures of one batch side by side, each checked against ``expected``.

    Args:
        views: ``(panel title, counts)`` pairs; counts int or bool ``[batch, q_len, num_pages *
            page_size]``: how often each (query, slot) pair is added into the softmax, e.g.
            ``block_mask_visits(bm)[:, 0]`` (what a block-sparse kernel adds) or
            ``create_mask(bm.mask_mod, ...)[:, 0]`` (what eager FlexAttention adds).
        expected: bool, same shape: :func:`expected_visible`.
        kv_block_size: draws the flex block boundaries when given.
        names: a label per batch row (default ``"seq <row>"``).

    Cells added once where expected take the sequence's color; added where not expected, or
    added twice, red; expected but never added, black.
    """
    if not views:
        raise ValueError("views must hold at least one (title, counts) pair")
    num_pages = expected.shape[-1] // page_size
    q_len = expected.shape[1]
    ex, owner = _rows(expected, q_lens, q_len)
    n_rows = len(owner)
    fig = Figure(figsize=(5.2 * len(views) + 0.6, 1.9 + 0.16 * min(n_rows, 40)), layout="constrained")
    strips, panels = _strip_axes(fig, len(views), [1] * len(views), n_rows)
    owners = page_owners(block_table, seq_lens, num_pages, page_size)
    for strip, ax, (name, counts) in zip(strips, panels, views):
        if tuple(counts.shape) != tuple(expected.shape):
            raise ValueError(
                f"counts of view {name!r} must have shape {tuple(expected.shape)}, got {tuple(counts.shape)}"
            )
        c, _ = _rows(counts.int(), q_lens, q_len)
        _physical_strip(strip, owners, page_size)
        ax.imshow(_image(c, owner, None, ex), aspect="auto", interpolation="nearest")
        _grid(ax, n_rows, num_pages * page_size, page_size, kv_block_size, owner)
        _row_labels(ax, owner, q_lens is not None, names)
        wrong = int(((c > 0) & ~ex).sum() + ((c == 0) & ex).sum() + (c > 1).sum())
        ax.set_title(
            f"{name}\n" + ("matches the ground truth" if wrong == 0 else f"{wrong} wrong cells"), fontsize=9, loc="left"
        )
        ax.set_xlabel("physical KV position", fontsize=8)
        ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    _legend(fig, listed=False, checked=True)
    add_note(fig, NOTE)
    return fig


def translation_figure(
    block_table: torch.Tensor, seq_lens, num_pages: int, page_size: int, *, title: str = ""
) -> Figure:
    """The block table drawn as a map, one panel per sequence: the physical cache on top (the
    sequence's own pages in its color, other rows' pages faint, free pages grey), the
    sequence's logical pages below, and a band joining each physical page to the logical page
    it is.

    The mask_mod follows the bands upwards: from a physical position to its page, along the
    band to the logical page, to a logical position. Hatched cells hold no token yet (past
    ``seq_lens``: the unwritten tail of a last page).
    """
    lens = [int(n) for n in torch.as_tensor(seq_lens).tolist()]
    owners = page_owners(block_table, seq_lens, num_pages, page_size)
    max_pages = max(cdiv(n, page_size) for n in lens)
    width = max(num_pages, max_pages) * page_size
    fig = Figure(figsize=(11.0, 0.6 + 1.25 * len(lens)), layout="constrained")
    axes = fig.subplots(len(lens), 1, squeeze=False)[:, 0]
    gap = 0.08 * page_size
    small = 7 if max(num_pages, max_pages) <= 32 else 5
    labels = max(num_pages, max_pages) <= 48  # no room for page numbers beyond that
    for b, (ax, n) in enumerate(zip(axes, lens)):
        used = block_table[b, : cdiv(n, page_size)].tolist()
        for p, o in enumerate(owners):  # the physical cache
            mine = b in o
            color = seq_color(b) if mine else (seq_color(o[0]) if o else FREE_COLOR)
            ax.add_patch(
                Rectangle(
                    (p * page_size, 2.2),
                    page_size - gap,
                    1,
                    facecolor=color,
                    alpha=0.9 if mine else 0.25,
                    edgecolor="none",
                )
            )
            if labels:
                ax.text(
                    p * page_size + (page_size - gap) / 2,
                    2.7,
                    str(p),
                    ha="center",
                    va="center",
                    fontsize=small,
                    color="white" if mine else "0.3",
                    fontweight="bold",
                )
        for i, p in enumerate(used):  # logical pages and bands
            x0, filled = i * page_size, min(page_size, n - i * page_size)
            ax.add_patch(Rectangle((x0, 0), page_size - gap, 1, facecolor=seq_color(b), alpha=0.9, edgecolor="none"))
            if filled < page_size:  # unwritten tail
                ax.add_patch(
                    Rectangle(
                        (x0 + filled, 0),
                        page_size - gap - filled,
                        1,
                        facecolor="white",
                        edgecolor=seq_color(b),
                        hatch="////",
                        lw=0.5,
                    )
                )
            if labels:
                ax.text(
                    x0 + min(filled, page_size - gap) / 2,
                    0.5,
                    f"L{i}",
                    ha="center",
                    va="center",
                    fontsize=small,
                    color="white",
                    fontweight="bold",
                )
            band = [(p * page_size, 2.2), (p * page_size + page_size - gap, 2.2), (x0 + page_size - gap, 1), (x0, 1)]
            ax.add_patch(Polygon(band, closed=True, facecolor=seq_color(b), alpha=0.2, edgecolor=seq_color(b), lw=0.5))
        ax.set_xlim(-0.5, width)
        ax.set_ylim(-0.1, 3.3)
        ax.set_yticks([0.5, 2.7], [f"seq {b}: logical", "physical"], fontsize=7)
        ax.get_yticklabels()[0].set_color(seq_color(b))
        ax.tick_params(labelsize=7, length=0)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        row = str(used) if len(used) <= 24 else f"[{used[0]}, {used[1]}, ..., {used[-1]}]"
        ax.set_title(f"seq {b}: {n} tokens, block table row {row}", fontsize=8, loc="left", color=seq_color(b))
    axes[-1].set_xlabel("KV position (physical cache on top, the sequence's logical positions below)", fontsize=8)
    fig.suptitle(title or f"the block table as a map (page size {page_size})", fontsize=10)
    fig.legend(
        handles=[
            Patch(facecolor="white", edgecolor="0.3", hatch="////", label="slot past seq_lens (no token yet)"),
            Patch(facecolor=FREE_COLOR, label="page no sequence of the batch owns"),
        ],
        loc="outside lower right",
        ncols=2,
        fontsize=7,
        frameon=False,
    )
    add_note(fig, NOTE)
    return fig


def block_mask_figure(block_mask: BlockMask, dense: torch.Tensor, title: str = "") -> Figure:
    """One sequence's BlockMask on a contiguous cache: each (query, key) element kept or masked
    by the mask_mod (``dense``, bool ``[q_len, kv_len]``), over the blocks the kernel skips,
    visits with the mask_mod (partial) or visits without it (full)."""
    q_len, kv_len = dense.shape
    qb, kb = block_mask.BLOCK_SIZE
    kinds = block_kinds(block_mask).numpy()
    kept = {FULL: "tab:green", PARTIAL: "tab:blue"}  # kept element, by its block's kind
    masked = {SKIPPED: "white", PARTIAL: "moccasin", FULL: "white"}
    img = np.ones((q_len, kv_len, 3))
    for i in range(q_len):
        for j in range(kv_len):
            kind = int(kinds[i // qb, j // kb])
            img[i, j] = to_rgb(kept.get(kind, "red") if dense[i, j] else masked[kind])
    fig = Figure(figsize=(4.6, 4.6), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(img, interpolation="nearest", extent=(0, kv_len, q_len, 0))
    for x in range(0, kv_len + 1, kb):
        ax.axvline(x, color="0.3", lw=0.8)
    for y in range(0, q_len + 1, qb):
        ax.axhline(y, color="0.3", lw=0.8)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title or f"BlockMask, blocks of {qb} x {kb}", fontsize=9)
    fig.legend(
        handles=[
            Patch(color="tab:green", label="full block: all kept, no mask_mod call"),
            Patch(color="tab:blue", label="partial block: kept by the mask_mod"),
            Patch(color="moccasin", label="partial block: masked by the mask_mod"),
            Patch(facecolor="white", edgecolor="0.3", label="block never visited"),
            Patch(color="red", label="kept but not visited (a bug)"),
        ],
        loc="outside lower center",
        ncol=2,
        fontsize=7,
    )
    add_note(fig, NOTE)
    return fig
