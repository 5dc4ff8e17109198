"""Looking inside a paged BlockMask: what a block-sparse kernel visits, token by token.

Eager FlexAttention on a CPU evaluates the mask_mod on every element and ignores the
BlockMask's block lists, so a wrong list would go unnoticed there. The functions here make the
lists visible and checkable without a GPU:

* :func:`block_mask_visits` replays a BlockMask the way a block-sparse kernel reads it (how
  often each (query, key) pair is added: 0 or 1 when the mask is right);
* :func:`expected_visible` is the ground truth it is checked against, built forward from the
  block table (logical -> physical, the direction the reference's gather uses);
* :func:`listed_blocks`, :func:`block_kinds` and :func:`page_owners` show the block lists and
  who owns each page; :func:`trace_position` walks one physical position through the
  mask_mod's translation step by step;
* :func:`untranslated_block_mask` builds the bug of forgetting to translate the block lists.

:func:`dense_masks` gives both pictures of a ``paged_block_masks(...)`` side by side;
:mod:`paged_ref.lab.viz.masks` draws all of this (notebook 04).

Example:
    >>> import torch
    >>> from paged_ref.attention.flex import paged_block_masks
    >>> bt, lens = torch.tensor([[3, 1], [0, 2]]), torch.tensor([6, 3])
    >>> masks = paged_block_masks(bt, lens, num_pages=4, page_size=4, kv_block_size=4)
    >>> visits = block_mask_visits(masks.physical)[:, 0]       # [batch, q_len, num_pages * page_size]
    >>> bool(visits.le(1).all()), torch.equal(visits > 0, expected_visible(bt, lens, 4, 4))
    (True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask

from .._arith import cdiv

__all__ = [
    "FULL",
    "PARTIAL",
    "SKIPPED",
    "VERDICTS",
    "PositionTrace",
    "block_kinds",
    "block_mask_visits",
    "dense_masks",
    "expected_visible",
    "format_traces",
    "listed_blocks",
    "page_owners",
    "trace_position",
    "untranslated_block_mask",
]

#: What :func:`trace_position` can conclude about a physical position.
VERDICTS = (
    "kept",
    "past seq_lens",
    "causal: after the query",
    "another sequence's page",
    "not in the batch",
    "padding query row",
)


def _lens(seq_lens) -> list[int]:
    return [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]


def page_owners(block_table: torch.Tensor, seq_lens, num_pages: int, page_size: int) -> list[tuple[int, ...]]:
    """For each physical page, the batch rows whose used block-table entries list it.

    Args:
        block_table: int ``[batch, max_pages]`` (padding entries ignored); seq_lens: int ``[batch]``.

    Returns:
        ``num_pages`` tuples of batch indices (empty: no sequence of the batch owns the page).
    """
    owners: list[list[int]] = [[] for _ in range(num_pages)]
    for b, n in enumerate(_lens(seq_lens)):
        for page in block_table[b, : cdiv(n, page_size)].tolist():
            owners[page].append(b)
    return [tuple(o) for o in owners]


def expected_visible(
    block_table: torch.Tensor, seq_lens, num_pages: int, page_size: int, *, q_lens=None, q_len: int = 1
) -> torch.Tensor:
    """Which physical cache slots each query must add into its softmax: the ground truth.

    Built *forward*, logical -> physical, by looking up each logical token of each sequence in
    the block table (the direction the reference's gather uses), so it shares nothing with the
    mask_mod (physical -> logical) or with the block lists it is used to check.

    Args:
        block_table: int ``[batch, max_pages]``; seq_lens: int ``[batch]``.
        q_lens: int ``[batch]`` new tokens per sequence (causal prefill), or None (decode).
        q_len: query rows per sequence (``max_q_len`` for prefill, 1 for decode).

    Returns:
        bool ``[batch, q_len, num_pages * page_size]``.
    """
    lens = _lens(seq_lens)
    out = torch.zeros(len(lens), q_len, num_pages * page_size, dtype=torch.bool)
    for b, n in enumerate(lens):
        pos = torch.arange(n)  # logical positions
        slots = block_table[b, pos // page_size].long() * page_size + pos % page_size  # [n]
        m = 1 if q_lens is None else int(q_lens[b])
        for i in range(min(m, q_len)):
            sees = n if q_lens is None else n - m + i + 1  # causal: keys up to itself
            out[b, i, slots[:sees]] = True
    return out


def listed_blocks(block_mask: BlockMask) -> torch.Tensor:
    """Token-level picture of the block lists alone: True where a (query, key) pair lies in a
    block the BlockMask lists (partial or full) for head 0.

    Returns:
        bool ``[batch, q_len, kv_len]``.
    """
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    dense = block_mask.to_dense()[:, 0].bool()  # [batch, q_blocks, kv_blocks]
    dense = dense.repeat_interleave(q_block, 1)[:, :q_len]
    return dense.repeat_interleave(kv_block, 2)[:, :, :kv_len]


@dataclass(frozen=True)
class PositionTrace:
    """One physical position walked through the mask_mod's translation (see :func:`trace_position`)."""

    physical: int  # position in the cache viewed as one long sequence
    page: int  # physical // page_size
    offset: int  # physical % page_size
    logical_page: int  # p2l[b, page]: the page's index in sequence b, or -1
    logical: int  # logical_page * page_size + offset (-1 when not b's page)
    verdict: str  # one of VERDICTS

    @property
    def kept(self) -> bool:
        return self.verdict == "kept"


def trace_position(
    block_table: torch.Tensor, seq_lens, page_size: int, b: int, physical: int, *, q_lens=None, q_idx: int = 0
) -> PositionTrace:
    """Follow physical position ``physical`` through the mask_mod of batch row ``b``, step by step.

    physical position -> physical page and offset -> logical page in sequence ``b`` (by
    inverting ``b``'s used block-table entries) -> logical position -> kept, or masked because
    it is past ``seq_lens[b]``, after the query (causal prefill), on a page another row of the
    batch owns, or on a page no row owns; a prefill query row ``q_idx >= q_lens[b]`` is padding
    and sees nothing.

    Example:
        >>> bt = torch.tensor([[2, 0], [1, 3]])
        >>> t = trace_position(bt, torch.tensor([6, 8]), page_size=4, b=0, physical=2)
        >>> (t.page, t.logical_page, t.logical, t.verdict)
        (0, 1, 6, 'past seq_lens')
    """
    lens = _lens(seq_lens)
    page, offset = divmod(int(physical), page_size)
    used = block_table[b, : cdiv(lens[b], page_size)].tolist()
    logical_page = used.index(page) if page in used else -1
    logical = logical_page * page_size + offset if logical_page >= 0 else -1
    if q_lens is not None and q_idx >= int(q_lens[b]):
        verdict = "padding query row"  # prefill rows past q_lens see nothing
    elif logical_page < 0:
        others = any(page in block_table[r, : cdiv(n, page_size)].tolist() for r, n in enumerate(lens) if r != b)
        verdict = "another sequence's page" if others else "not in the batch"
    elif logical >= lens[b]:
        verdict = "past seq_lens"
    elif q_lens is not None and logical > lens[b] - int(q_lens[b]) + q_idx:
        verdict = "causal: after the query"
    else:
        verdict = "kept"
    return PositionTrace(int(physical), page, offset, logical_page, logical, verdict)


def format_traces(traces: Sequence[PositionTrace]) -> str:
    """The traces as a fixed-width table, one row per position."""
    lines = [f"{'physical':>8}  {'page':>4}  {'offset':>6}  {'p2l[b, page]':>12}  {'logical':>7}  verdict"]
    for t in traces:
        logical = str(t.logical) if t.logical >= 0 else "-"
        lines.append(f"{t.physical:>8}  {t.page:>4}  {t.offset:>6}  {t.logical_page:>12}  {logical:>7}  {t.verdict}")
    return "\n".join(lines)


def block_mask_visits(block_mask: BlockMask) -> torch.Tensor:
    """How many times a block-sparse kernel adds each (query, key) pair into the softmax.

    Replays the BlockMask: every listed partial block contributes where its mask_mod is True,
    every listed full block contributes everywhere. A correct mask gives only 0 and 1; a block
    listed twice would show up as 2 (double counting), a missing block as 0.

    Returns:
        int32 ``[batch, heads, q_len, kv_len]`` (heads as stored in the mask, usually 1).
    """
    batch, heads, q_blocks, _ = block_mask.kv_indices.shape
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    n_kv_blocks = cdiv(kv_len, kv_block)

    def per_token(num, idx):  # int32 [batch, heads, q_len, kv_len]
        counts = torch.zeros(batch, heads, q_blocks, n_kv_blocks + 1, dtype=torch.int32, device=idx.device)
        listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        counts.scatter_add_(
            -1, torch.where(listed, idx.long().clamp(max=n_kv_blocks), n_kv_blocks), listed.to(torch.int32)
        )
        counts = counts[..., :n_kv_blocks]
        counts = counts.repeat_interleave(q_block, 2)[:, :, :q_len]
        return counts.repeat_interleave(kv_block, 3)[..., :kv_len]

    mask = create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device=block_mask.kv_indices.device)
    visits = per_token(block_mask.kv_num_blocks, block_mask.kv_indices) * mask
    if block_mask.full_kv_num_blocks is not None:
        visits = visits + per_token(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return visits


def dense_masks(masks) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level pictures of ``paged_block_masks(...)`` as a block-sparse kernel reads them, ready
    for ``imshow``: bool ``[batch, q_len, max_pages * page_size]`` (logical) and
    ``[batch, q_len, num_pages * page_size]`` (physical)."""
    return block_mask_visits(masks.logical)[:, 0] > 0, block_mask_visits(masks.physical)[:, 0] > 0


#: Block kinds in :func:`block_kinds`: not listed, listed with the mask_mod applied, listed full.
SKIPPED, PARTIAL, FULL = 0, 1, 2


def block_kinds(block_mask: BlockMask, b: int = 0) -> torch.Tensor:
    """What a block-sparse kernel does with each (query block, KV block) of sequence ``b``, head 0.

    ``kv_num_blocks`` / ``kv_indices`` list the *partial* blocks (the kernel applies the
    mask_mod to every element there); ``full_kv_num_blocks`` / ``full_kv_indices`` the *full*
    ones (every element kept: the mask_mod is skipped); any other block is never visited.

    Returns:
        int64 ``[q_blocks, kv_blocks]`` of :data:`SKIPPED`, :data:`PARTIAL`, :data:`FULL`.
    """
    kinds = block_mask.kv_num_blocks.new_zeros(block_mask.kv_indices.shape[-2:], dtype=torch.int64)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL))
    for num, idx, kind in lists:
        for qb in range(kinds.shape[0]):
            n = int(num[b, 0, qb])
            kinds[qb, idx[b, 0, qb, :n].long()] = kind
    return kinds[:, : cdiv(block_mask.seq_lengths[1], block_mask.BLOCK_SIZE[1])]


def untranslated_block_mask(masks) -> BlockMask:
    """A deliberately broken physical BlockMask: the physical mask_mod with the *logical* block
    lists, i.e. the bug of forgetting to translate ``kv_indices``. Eager FlexAttention cannot
    tell it from the right one (it evaluates the mask_mod everywhere); a block-sparse kernel
    would skip the sequences' real pages. For demonstrations and tests only.

    Args:
        masks: ``paged_block_masks(...)``.
    """
    lg, ph = masks.logical, masks.physical
    return BlockMask.from_kv_blocks(
        lg.kv_num_blocks,
        lg.kv_indices,
        BLOCK_SIZE=ph.BLOCK_SIZE,
        mask_mod=ph.mask_mod,
        seq_lengths=ph.seq_lengths,
        compute_q_blocks=False,
    )
