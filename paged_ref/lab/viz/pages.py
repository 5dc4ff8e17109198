"""The page map (notebook 02): every physical page of a cache as a cell, next to the block tables.

:func:`page_map` takes a snapshot of a :class:`~paged_ref.cache.PagedKVCache` as plain data
(:class:`PageMap`); :func:`page_map_figure` draws one snapshot and :func:`page_map_story` a
series of them, one row per step. How a cell reads:

- colored by the sequence holding the page; the dark bar is the tokens stored in it (a short
  bar is a partly filled last page: internal fragmentation), a pale cell with no bar is a page
  reserved ahead (``growth="pow2"``);
- a page held by several sequences (refcount > 1: fork, prefix sharing) is split into one band
  per holder, framed in black and labelled with its refcount (``x2``);
- a grey cell is a returned page waiting on the free list; a white dashed cell has never been
  handed out; the first of those carries the allocator's bump pointer (a black triangle).

Example:
    >>> from paged_ref.cache import PagedKVCache
    >>> cache = PagedKVCache(num_layers=1, num_pages=6, page_size=4, num_kv_heads=1, head_dim=1)
    >>> a = cache.add_sequence(); _ = cache.reserve(a, 6); b = cache.fork(a)
    >>> pm = page_map(cache, names={a: "A", b: "B"})
    >>> pm.status, pm.refcount, pm.fill
    (('used', 'used', 'never', 'never', 'never', 'never'), (2, 2, 0, 0, 0, 0), (4, 2, 0, 0, 0, 0))
    >>> fig = page_map_figure(pm, title="after fork")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from ..._arith import cdiv
from ...block_table import pages_needed
from . import add_note

#: Sequence colors, picked by ``seq_id % len(PALETTE)`` (grey is left out: it means "free").
PALETTE = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
)
RETURNED_COLOR = "0.78"
NOTE = "Drawn from a PagedKVCache's block tables and allocator state (no hardware measured)."


@dataclass(frozen=True)
class PageMap:
    """A cache's page-level state as plain data (what the drawing needs, nothing more).

    Per physical page ``p`` (tuples of length ``num_pages``): ``status[p]`` is ``"used"``
    (refcount >= 1), ``"returned"`` (free, on the free list) or ``"never"`` (free, never handed
    out); ``refcount[p]``; ``owners[p]``, the seq ids whose block tables list it; ``fill[p]``,
    the tokens stored in it (0 when free or reserved ahead).
    Per live sequence: ``tables[seq_id]`` (physical pages in logical order, including any
    reserved ahead), ``seq_lens[seq_id]`` and ``names[seq_id]``.
    """

    num_pages: int
    page_size: int
    status: tuple[str, ...]
    refcount: tuple[int, ...]
    owners: tuple[tuple[int, ...], ...]
    fill: tuple[int, ...]
    tables: Mapping[int, tuple[int, ...]]
    seq_lens: Mapping[int, int]
    names: Mapping[int, str]
    bump: int  # the allocator's bump pointer: pages >= bump have never been handed out
    prefix_hits: int = 0

    def count(self, status: str) -> int:
        """How many pages have this status (``"used"``, ``"returned"`` or ``"never"``)."""
        return self.status.count(status)

    @property
    def shared(self) -> tuple[int, ...]:
        """Physical pages with refcount > 1."""
        return tuple(p for p, r in enumerate(self.refcount) if r > 1)

    @property
    def stored_tokens(self) -> int:
        """Token slots holding data, each physical slot counted once (shared pages once)."""
        return sum(self.fill)

    @property
    def held_slots(self) -> int:
        """Token slots in pages that are allocated (``used`` pages x ``page_size``)."""
        return self.count("used") * self.page_size


def page_map(cache, names: Mapping[int, str] | None = None) -> PageMap:
    """Snapshot ``cache`` (a PagedKVCache) as a :class:`PageMap`.

    Args:
        cache: the cache to read (only its public inspection methods are used).
        names: optional seq_id -> display name (e.g. ``ScenarioPlayer.names``); by default
            ``"seq <id>"``.
    """
    alloc, ps, n = cache.allocator, cache.page_size, cache.num_pages
    names = dict(names or {})
    refcount = tuple(alloc.refcount(p) for p in range(n))
    returned = tuple(alloc.is_returned(p) for p in range(n))
    status = tuple("used" if r else ("returned" if back else "never") for r, back in zip(refcount, returned))
    owners: list[list[int]] = [[] for _ in range(n)]
    fill = [0] * n
    tables, lens = {}, {}
    for s in cache.seq_ids:
        pages, length = cache.pages(s), cache.seq_len(s)
        tables[s], lens[s] = tuple(pages), length
        names.setdefault(s, f"seq {s}")
        for i, p in enumerate(pages):
            owners[p].append(s)
            fill[p] = max(fill[p], min(ps, max(0, length - i * ps)))
    never = status.count("never")
    return PageMap(
        num_pages=n,
        page_size=ps,
        status=status,
        refcount=refcount,
        owners=tuple(tuple(sorted(o)) for o in owners),
        fill=tuple(fill),
        tables=tables,
        seq_lens=lens,
        names={s: names[s] for s in tables},
        bump=n - never,
        prefix_hits=int(getattr(cache, "prefix_hits", 0)),
    )


def seq_color(seq_id: int) -> str:
    """The color of sequence ``seq_id`` in every page-map figure."""
    return PALETTE[seq_id % len(PALETTE)]


def page_map_figure(pm: PageMap, *, title: str = "", cols: int | None = None) -> Figure:
    """Draw one snapshot: the page grid on the left, the block tables on the right.

    Args:
        pm: a :class:`PageMap` (from :func:`page_map`).
        title: drawn above the grid.
        cols: cells per grid row (default 16, or 32 for more than 128 pages).
    """
    cols = _cols(pm, cols)
    rows = cdiv(pm.num_pages, cols)
    fig = Figure(figsize=(11.0, 1.3 + 0.42 * rows * 16 / cols), layout="constrained")
    grid, text = fig.subplots(1, 2, width_ratios=[3, 2])
    _draw_grid(grid, pm, cols, title)
    _draw_tables(text, pm)
    fig.legend(handles=_legend_handles(), loc="outside upper center", ncols=5, fontsize=7, frameon=False)
    add_note(fig, NOTE)
    return fig


def page_map_story(maps: Sequence[PageMap], titles: Sequence[str], *, cols: int | None = None) -> Figure:
    """Several snapshots stacked top to bottom (one row per step of a scenario)."""
    if len(maps) != len(titles) or not maps:
        raise ValueError(f"maps and titles must be non-empty and of equal length, got {len(maps)} and {len(titles)}")
    cols = _cols(maps[0], cols)
    rows = cdiv(maps[0].num_pages, cols)
    fig = Figure(figsize=(11.0, 0.4 + len(maps) * (0.7 + 0.42 * rows * 16 / cols)), layout="constrained")
    axes = fig.subplots(len(maps), 2, width_ratios=[3, 2], squeeze=False)
    for (grid, text), pm, title in zip(axes, maps, titles):
        _draw_grid(grid, pm, cols, title)
        _draw_tables(text, pm)
    fig.legend(handles=_legend_handles(), loc="outside upper center", ncols=5, fontsize=7, frameon=False)
    add_note(fig, NOTE)
    return fig


# --------------------------------------------------------------------------- drawing helpers
def _cols(pm: PageMap, cols) -> int:
    if cols is None:
        return 16 if pm.num_pages <= 128 else 32
    if isinstance(cols, bool) or not isinstance(cols, int) or cols < 1:
        raise ValueError(f"cols must be a positive int, got {cols!r}")
    return cols


def _draw_grid(ax, pm: PageMap, cols: int, title: str) -> None:
    rows = cdiv(pm.num_pages, cols)
    gap, label = 0.08, cols <= 16
    for p in range(pm.num_pages):
        x, y = p % cols, rows - 1 - p // cols
        w = 1 - gap
        if pm.status[p] == "never":
            ax.add_patch(Rectangle((x, y), w, w, facecolor="white", edgecolor="0.6", lw=0.6, ls="--"))
        elif pm.status[p] == "returned":
            ax.add_patch(Rectangle((x, y), w, w, facecolor=RETURNED_COLOR, edgecolor="none"))
        else:
            owners = pm.owners[p] or (-1,)
            band = w / len(owners)
            for j, s in enumerate(owners):  # one band per holder, the first on top
                by = y + w - (j + 1) * band
                color = seq_color(s) if s >= 0 else "0.3"
                ax.add_patch(Rectangle((x, by), w, band, facecolor=color, alpha=0.25, edgecolor="none"))
                ax.add_patch(
                    Rectangle(
                        (x, by), w * pm.fill[p] / pm.page_size, band, facecolor=color, alpha=0.9, edgecolor="none"
                    )
                )
            if pm.refcount[p] > 1:
                ax.add_patch(Rectangle((x, y), w, w, facecolor="none", edgecolor="black", lw=1.6))
                ax.text(
                    x + w - 0.04,
                    y + w - 0.04,
                    f"x{pm.refcount[p]}",
                    ha="right",
                    va="top",
                    fontsize=6 if label else 4,
                    fontweight="bold",
                )
        if label:
            ax.text(x + 0.05, y + 0.05, str(p), ha="left", va="bottom", fontsize=6, color="0.15")
    if pm.bump < pm.num_pages:  # the bump pointer: the next never-used page
        bx, by = pm.bump % cols, rows - 1 - pm.bump // cols
        ax.plot([bx + 0.46], [by + 0.72], marker="v", color="black", ms=5)  # inside the cell
    ax.set_xlim(-0.1, cols)
    ax.set_ylim(-0.1, rows + 0.15)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")


def _draw_tables(ax, pm: PageMap) -> None:
    ax.axis("off")
    lines = [("block tables (logical -> physical page)", "black")]
    for s, pages in pm.tables.items():
        held = pages_needed(pm.seq_lens[s], pm.page_size)
        lines.append((f"{pm.names[s]:>4} len {pm.seq_lens[s]:>3}: {_format_table(pages, held)}", seq_color(s)))
    if not pm.tables:
        lines.append(("  (no live sequences)", "0.4"))
    lines.append(("", "black"))
    lines.append(
        (
            f"{pm.count('used')} used, {pm.count('returned')} on the free list, "
            f"{pm.count('never')} never used; bump pointer "
            + (f"at page {pm.bump}" if pm.bump < pm.num_pages else "at the end"),
            "0.25",
        )
    )
    lines.append(
        (
            f"{pm.stored_tokens} tokens in {pm.held_slots} held slots"
            + (f"; {len(pm.shared)} shared page(s)" if pm.shared else "")
            + (f"; prefix-cache hits {pm.prefix_hits}" if pm.prefix_hits else ""),
            "0.25",
        )
    )
    step = 1.0 / max(len(lines), 7)
    for i, (line, color) in enumerate(lines):
        ax.text(
            0.0,
            1.0 - i * step,
            line,
            transform=ax.transAxes,
            ha="left",
            va="top",
            fontsize=7.5,
            family="monospace",
            color=color,
        )


def _format_table(pages: Sequence[int], held: int, limit: int = 10) -> str:
    """``[0, 1, (2, 3)]``: pages reserved ahead of the tokens are in parentheses."""
    parts = [str(p) for p in pages[:held]]
    ahead = [str(p) for p in pages[held:]]
    if ahead:
        parts.append("(" + ", ".join(ahead) + ")")
    if len(parts) > limit:
        parts = parts[: limit - 2] + ["...", parts[-1]]
        return "[" + ", ".join(parts) + f"]  ({len(pages)} pages)"
    return "[" + ", ".join(parts) + "]"


def _legend_handles():
    return [
        Patch(facecolor="tab:blue", alpha=0.9, label="held by a sequence (bar = tokens stored)"),
        Patch(facecolor="white", edgecolor="black", lw=1.6, label="shared, refcount > 1 (x2)"),
        Patch(facecolor=RETURNED_COLOR, label="returned (free list)"),
        Patch(facecolor="white", edgecolor="0.6", ls="--", label="never used"),
        Line2D([], [], marker="v", color="black", ls="none", ms=5, label="bump pointer (next never-used page)"),
    ]
