"""Widget for notebook 04: logical vs physical BlockMask over page size, flex block size and lengths.

:func:`churned_cache` builds the small ragged batch the notebook and the widget draw: a real
:class:`~paged_ref.cache.PagedKVCache` after some serving churn, so its block table is
scattered the way a live server's is. :func:`mask_view` is the panel's pure callback.

Example:
    >>> cache, seqs = churned_cache([11, 5, 16], page_size=4, seed=0)
    >>> block_table, seq_lens = cache.block_table(seqs)
    >>> seq_lens.tolist(), cache.num_pages
    ([11, 5, 16], 11)
    >>> fig = mask_view(page_size=4, kv_block_size=8, lengths=(11, 5, 16))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from matplotlib.figure import Figure

from ..._validate import check_int
from ...attention.flex import paged_block_masks
from ...block_table import pages_needed
from ...cache import PagedKVCache
from ..flex_inspect import block_mask_visits, expected_visible
from ..viz.masks import block_masks_figure
from . import with_static_figure

#: Slider choices.
PAGE_SIZES = (1, 2, 4, 8, 16)
KV_BLOCK_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_LENGTHS = (11, 5, 16)
MAX_BATCH = 6
MAX_LEN = 64


def check_lengths(lengths) -> tuple[int, ...]:
    """``lengths`` as a tuple of 1..MAX_BATCH ints in ``[1, MAX_LEN]``; a string such as
    ``"11, 5, 16"`` is parsed. Raises ValueError/TypeError naming ``lengths``."""
    if isinstance(lengths, str):
        parts = [p for p in lengths.replace(",", " ").split() if p]
        try:
            lengths = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"lengths must be whole numbers separated by commas, got {lengths!r}") from None
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    if not isinstance(lengths, (list, tuple)):
        raise TypeError(f"lengths must be a sequence of ints or a string, got {type(lengths).__name__}")
    out = tuple(check_int(f"lengths[{i}]", n, min_value=1) for i, n in enumerate(lengths))
    if not 1 <= len(out) <= MAX_BATCH:
        raise ValueError(f"lengths must hold 1 to {MAX_BATCH} sequences, got {len(out)}")
    if max(out) > MAX_LEN:
        raise ValueError(f"lengths must each be <= {MAX_LEN}, got {max(out)}")
    return out


def churned_cache(
    lengths: Sequence[int],
    page_size: int,
    *,
    seed: int = 0,
    spare_pages: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 1,
    dtype: torch.dtype = torch.float32,
) -> tuple[PagedKVCache, list[int]]:
    """A one-layer cache holding ``len(lengths)`` sequences on scattered pages, with random K/V.

    The story, seeded: a short-lived request ``X`` and the first tokens of the others arrive in
    a random interleaving; ``X`` finishes and its pages return to the free list; the others
    then grow token by token in a random interleaving until they reach ``lengths``. The pool
    has exactly ``spare_pages`` pages more than the survivors need and ``X`` held more than
    that, so the survivors' last pages reuse some of ``X``'s (out of order); the pages left
    free hold zeros (`PagedKVCache` zeroes a page when it returns to the pool).

    Every token written is drawn from ``torch.randn`` (seeded), as ``k, v: [1, num_kv_heads,
    head_dim]`` per token. The page layout depends only on ``lengths``, ``page_size``, ``seed``
    and ``spare_pages``, not on the K/V shape.

    Args:
        lengths: final length of each surviving sequence (>= 1 each).
        page_size: tokens per page.
        seed: orders the story and draws the K/V.
        spare_pages: free pages left at the end.

    Returns:
        ``(cache, seq_ids)``, ``seq_ids`` in the order of ``lengths``.
    """
    lengths = [check_int(f"lengths[{i}]", n, min_value=1) for i, n in enumerate(lengths)]
    if not lengths:
        raise ValueError("lengths must hold at least one sequence, got none")
    page_size = check_int("page_size", page_size, min_value=1)
    spare_pages = check_int("spare_pages", spare_pages, min_value=0)
    order = torch.Generator().manual_seed(seed)  # the story: which token comes next
    values = torch.Generator().manual_seed(seed + 1)  # the K/V drawn for each token
    need = sum(pages_needed(n, page_size) for n in lengths)
    num_pages = need + spare_pages
    # X takes as many pages as fit next to everyone's first page, up to spare + 2.
    x_pages = min(spare_pages + 2, num_pages - len(lengths))
    cache = PagedKVCache(
        num_layers=1,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )

    def grow(seq_id: int) -> None:
        slots = cache.reserve(seq_id, 1)
        k = torch.randn(1, num_kv_heads, head_dim, generator=values, dtype=torch.float64)
        v = torch.randn(1, num_kv_heads, head_dim, generator=values, dtype=torch.float64)
        cache.write(0, slots, k.to(dtype), v.to(dtype))

    seq_ids = [cache.add_sequence() for _ in lengths]
    x = cache.add_sequence()
    # Phase 1: X's tokens and everyone's first token, interleaved.
    events = [x] * (x_pages * page_size) + seq_ids
    for i in torch.randperm(len(events), generator=order).tolist():
        grow(events[i])
    cache.free(x)
    # Phase 2: the survivors grow to their lengths, interleaved.
    events = [s for s, n in zip(seq_ids, lengths) for _ in range(n - 1)]
    for i in torch.randperm(len(events), generator=order).tolist():
        grow(events[i])
    return cache, seq_ids


def mask_view(
    page_size: int, kv_block_size: int, lengths=DEFAULT_LENGTHS, *, prefill: bool = False, seed: int = 0
) -> Figure:
    """The panel's callback: logical vs physical BlockMask of :func:`churned_cache`'s batch.

    Decode draws one query per sequence; ``prefill=True`` makes the last ``min(len, 4)`` tokens
    of each sequence new (causal). The figure title reports whether the physical block lists,
    replayed as a kernel reads them, match the ground truth exactly.

    Args:
        page_size: tokens per page (>= 1).
        kv_block_size: FlexAttention's KV tile, a power of two, independent of ``page_size``.
        lengths: sequence lengths (ints, or a string such as ``"11, 5, 16"``).
    """
    lengths = check_lengths(lengths)
    cache, seqs = churned_cache(lengths, page_size, seed=seed)
    block_table, seq_lens = cache.block_table(seqs)
    q_lens = torch.tensor([min(n, 4) for n in lengths], dtype=torch.int32) if prefill else None
    q_len = int(q_lens.max()) if prefill else 1
    masks = paged_block_masks(
        block_table, seq_lens, cache.num_pages, page_size, q_len=q_len, q_lens=q_lens, kv_block_size=kv_block_size
    )
    visits = block_mask_visits(masks.physical)[:, 0]
    truth = expected_visible(block_table, seq_lens, cache.num_pages, page_size, q_lens=q_lens, q_len=q_len)
    verdict = "exact" if torch.equal(visits, truth.int()) else "WRONG"
    title = (
        f"page size {page_size}, flex KV block {kv_block_size}, lengths "
        f"{', '.join(map(str, lengths))} ({'causal prefill' if prefill else 'decode'}): "
        f"physical block lists replayed = ground truth: {verdict}"
    )
    return block_masks_figure(masks, block_table, seq_lens, page_size, q_lens=q_lens, title=title)


def mask_panel(page_size: int = 4, kv_block_size: int = 8, lengths: str = "11, 5, 16"):
    """Sliders for page size and flex KV block size, a box for the lengths and a decode/prefill
    toggle, redrawing :func:`mask_view`. A bad lengths entry prints its error instead."""
    import ipywidgets as w
    from IPython.display import display

    style = {"description_width": "initial"}
    size = w.SelectionSlider(
        options=PAGE_SIZES, value=page_size, description="page size", continuous_update=False, style=style
    )
    block = w.SelectionSlider(
        options=KV_BLOCK_SIZES, value=kv_block_size, description="flex KV block", continuous_update=False, style=style
    )
    lens = w.Text(value=lengths, description="lengths", continuous_update=False, style=style)
    mode = w.ToggleButtons(options=["decode", "prefill"], value="decode", style=style)

    def show(page_size, kv_block_size, lengths, mode):
        try:
            fig = mask_view(page_size, kv_block_size, lengths, prefill=mode == "prefill")
        except (TypeError, ValueError) as err:
            print(err)
            return
        display(fig)

    out = w.interactive_output(show, {"page_size": size, "kv_block_size": block, "lengths": lens, "mode": mode})
    return with_static_figure(
        w.VBox([w.HBox([size, block]), w.HBox([lens, mode]), out]), mask_view(page_size, kv_block_size, lengths)
    )
