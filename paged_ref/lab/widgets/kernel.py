"""Widget for notebook 05: how the decode kernel tiles one paged sequence.

:func:`tiling_numbers` counts what the kernel does for one sequence (tiles, block-table
lookups, pages per tile, the split ranges) and checks that the result does not depend on the
tiling: the plain-PyTorch spec of the kernel, run with these very settings on random K/V,
against the reference. :func:`tiling_view` is the panel's pure callback (a new Figure).

Example:
    >>> numbers = tiling_numbers(page_size=4, block_n=16, num_splits=2, seq_len=45)
    >>> numbers["tiles"], numbers["pages"], numbers["max_pages_per_tile"], numbers["splits"]
    (3, 12, 4, [(0, 32), (32, 45)])
    >>> fig = tiling_view(page_size=4, block_n=16, num_splits=2, seq_len=45)
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure

from ..._arith import cdiv
from ..._validate import check_int
from ...attention.online_softmax import paged_decode_spec, split_ranges
from ...attention.reference import reference_paged_decode
from ..viz.kernel import tile_map_figure
from . import with_static_figure

#: Slider choices.
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)
BLOCK_NS = (4, 8, 16, 32, 64)
SPLITS = (1, 2, 3, 4, 6, 8)
MAX_LEN = 160
SPARE_PAGES = 1


def shuffled_table(seq_len: int, page_size: int, *, seed: int = 0) -> tuple[torch.Tensor, int]:
    """A scattered block table for one sequence: its pages drawn at random from a pool with
    ``SPARE_PAGES`` page(s) left over.

    Returns:
        ``(block_table_row int32 [pages], num_pages)``.
    """
    seq_len = check_int("seq_len", seq_len, min_value=1)
    page_size = check_int("page_size", page_size, min_value=1)
    used = cdiv(seq_len, page_size)
    num_pages = used + SPARE_PAGES
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    return perm[:used].to(torch.int32), num_pages


def _check(page_size, block_n, num_splits, seq_len) -> None:
    check_int("page_size", page_size, min_value=1)
    check_int("block_n", block_n, min_value=1)
    check_int("num_splits", num_splits, min_value=1)
    seq_len = check_int("seq_len", seq_len, min_value=1)
    if seq_len > MAX_LEN:
        raise ValueError(f"seq_len must be <= {MAX_LEN} for the picture, got {seq_len}")


def tiling_numbers(page_size: int, block_n: int, num_splits: int, seq_len: int = 100, *, seed: int = 0) -> dict:
    """What the kernel does for one sequence of ``seq_len`` tokens with these settings.

    Returns a dict: ``tiles`` (loop iterations in all splits), ``pages`` (pages the sequence
    uses), ``max_pages_per_tile`` (distinct block-table entries one tile reads: its tokens
    look up their pages one by one, tokens of one page hit the same entry), ``splits`` (each
    split's ``(start, end)``), ``empty_splits``, and ``rel_err``: the spec of the kernel
    (``paged_decode_spec``, 4 query heads over 2 KV heads, head_dim 8, float64) with these
    settings against ``reference_paged_decode`` on the same random inputs.
    """
    _check(page_size, block_n, num_splits, seq_len)
    table, num_pages = shuffled_table(seq_len, page_size, seed=seed)
    splits = split_ranges(seq_len, num_splits, block_n=block_n)
    tile_pages = [
        {(t // page_size) for t in range(a, min(a + block_n, b))} for a0, b in splits for a in range(a0, b, block_n)
    ]
    gen = torch.Generator().manual_seed(seed + 1)
    k_cache = torch.randn(num_pages, page_size, 2, 8, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(num_pages, page_size, 2, 8, generator=gen, dtype=torch.float64)
    q = torch.randn(1, 4, 8, generator=gen, dtype=torch.float64)  # [batch, Hq, D]: GQA 2
    bt, lens = table[None], torch.tensor([seq_len], dtype=torch.int32)
    out = paged_decode_spec(q, k_cache, v_cache, bt, lens, num_splits=num_splits, block_n=block_n)
    ref = reference_paged_decode(q, k_cache, v_cache, bt, lens)
    return {
        "tiles": len(tile_pages),
        "pages": len(table),
        "max_pages_per_tile": max(len(p) for p in tile_pages),
        "splits": splits,
        "empty_splits": sum(1 for a, b in splits if a == b),
        "rel_err": float((out - ref).norm() / ref.norm()),
    }


def tiling_view(page_size: int, block_n: int, num_splits: int, seq_len: int = 100, *, seed: int = 0) -> Figure:
    """The panel's callback: :func:`~paged_ref.lab.viz.kernel.tile_map_figure` of one scattered
    sequence, titled with :func:`tiling_numbers` (including the spec-vs-reference check)."""
    numbers = tiling_numbers(page_size, block_n, num_splits, seq_len, seed=seed)
    table, num_pages = shuffled_table(seq_len, page_size, seed=seed)
    empty = f", {numbers['empty_splits']} empty" if numbers["empty_splits"] else ""
    title = (
        f"seq_len {seq_len}, page {page_size}, BLOCK_N {block_n}, {num_splits} split(s){empty}: "
        f"{numbers['tiles']} tiles, up to {numbers['max_pages_per_tile']} page(s) per tile; "
        f"spec vs reference rel. error {numbers['rel_err']:.1e}"
    )
    return tile_map_figure(table, seq_len, page_size, block_n, num_splits=num_splits, num_pages=num_pages, title=title)


def tiling_panel(page_size: int = 4, block_n: int = 16, num_splits: int = 2, seq_len: int = 45):
    """Sliders for page size, BLOCK_N, splits and length, redrawing :func:`tiling_view`."""
    import ipywidgets as w
    from IPython.display import display

    style = {"description_width": "initial"}
    size = w.SelectionSlider(
        options=PAGE_SIZES, value=page_size, description="page size", continuous_update=False, style=style
    )
    tile = w.SelectionSlider(
        options=BLOCK_NS, value=block_n, description="BLOCK_N", continuous_update=False, style=style
    )
    splits = w.SelectionSlider(
        options=SPLITS, value=num_splits, description="num_splits", continuous_update=False, style=style
    )
    length = w.IntSlider(value=seq_len, min=1, max=MAX_LEN, description="seq_len", continuous_update=False, style=style)
    out = w.interactive_output(
        lambda page_size, block_n, num_splits, seq_len: display(tiling_view(page_size, block_n, num_splits, seq_len)),
        {"page_size": size, "block_n": tile, "num_splits": splits, "seq_len": length},
    )
    return with_static_figure(
        w.VBox([w.HBox([size, tile]), w.HBox([splits, length]), out]),
        tiling_view(page_size, block_n, num_splits, seq_len),
    )
