"""Block tables: each sequence's logical page -> physical page map, as kernels want it.

A sequence of ``n`` tokens in pages of ``page_size`` occupies ``ceil(n / page_size)`` logical
pages; token ``t`` lives in logical page ``t // page_size`` at offset ``t % page_size``, and
the block table says which physical page that is. Its flat *slot* in the cache is
``physical_page * page_size + offset``.

Two batch formats:
- padded: ``block_table: int32 [batch, max_pages]`` + ``seq_lens: int32 [batch]`` (vLLM,
  FlashAttention's ``block_table`` argument); entries past a sequence's pages are padding;
- CSR (FlashInfer): ``kv_indptr: int32 [batch+1]``, ``kv_indices: int32 [total_pages]``,
  ``kv_last_page_len: int32 [batch]`` (tokens in each sequence's last page, 1..page_size).

Example:
    >>> bt, lens = pad_block_tables([[7, 2], [5]], [20, 3])
    >>> bt.tolist(), lens.tolist()
    ([[7, 2], [5, 0]], [20, 3])
    >>> [t.tolist() for t in to_csr([[7, 2], [5]], [20, 3], page_size=16)]
    [[0, 2, 3], [7, 2, 5], [4, 3]]
    >>> slot_mapping([7, 2], start=15, num_tokens=2, page_size=16).tolist()
    [127, 32]
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._validate import check_int


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Number of pages that hold ``num_tokens`` tokens: ceil(num_tokens / page_size)."""
    return -(-num_tokens // page_size)


def _check_tables(tables: Sequence[Sequence[int]], seq_lens: Sequence[int], page_size=None):
    if len(tables) != len(seq_lens):
        raise ValueError(
            f"tables and seq_lens must have the same length, got {len(tables)} and {len(seq_lens)}"
        )
    for i, (pages, n) in enumerate(zip(tables, seq_lens)):
        check_int(f"seq_lens[{i}]", n, min_value=0)
        if page_size is not None and pages_needed(n, page_size) > len(pages):
            raise ValueError(
                f"seq_lens[{i}]={n} needs {pages_needed(n, page_size)} pages of {page_size}, "
                f"but tables[{i}] has {len(pages)}"
            )


def pad_block_tables(
    tables: Sequence[Sequence[int]], seq_lens: Sequence[int], *, device=None, pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack per-sequence page lists into ``(block_table int32 [batch, max_pages], seq_lens int32 [batch])``.

    Padding entries hold ``pad`` (0 by default: a valid page id, so a kernel that reads one by
    mistake reads real memory; attention masks everything past ``seq_lens``).
    """
    _check_tables(tables, seq_lens)
    max_pages = max((len(p) for p in tables), default=0)
    block_table = torch.full((len(tables), max(max_pages, 1)), pad, dtype=torch.int32)  # [batch, max_pages]
    for i, pages in enumerate(tables):
        if pages:
            block_table[i, : len(pages)] = torch.as_tensor(list(pages), dtype=torch.int32)
    lens = torch.as_tensor(list(seq_lens), dtype=torch.int32)  # [batch]
    return block_table.to(device), lens.to(device)


def to_csr(
    tables: Sequence[Sequence[int]], seq_lens: Sequence[int], *, page_size: int, device=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR form of a batch: ``(kv_indptr, kv_indices, kv_last_page_len)``, int32.

    Only the pages that hold tokens are listed (a sequence reserved ahead lists fewer pages
    than it owns). An empty sequence has zero pages and ``kv_last_page_len`` 0.
    """
    page_size = check_int("page_size", page_size, min_value=1)
    _check_tables(tables, seq_lens, page_size)
    counts = [pages_needed(n, page_size) for n in seq_lens]
    indptr = torch.zeros(len(tables) + 1, dtype=torch.int32)  # [batch + 1]
    indptr[1:] = torch.cumsum(torch.as_tensor(counts, dtype=torch.int64), 0).to(torch.int32)
    flat = [p for pages, c in zip(tables, counts) for p in list(pages)[:c]]
    indices = torch.as_tensor(flat, dtype=torch.int32)  # [total_pages]
    last = torch.as_tensor(
        [n - (c - 1) * page_size if c else 0 for n, c in zip(seq_lens, counts)], dtype=torch.int32
    )  # [batch]
    return indptr.to(device), indices.to(device), last.to(device)


def from_csr(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *, page_size: int
) -> tuple[list[list[int]], list[int]]:
    """Inverse of :func:`to_csr`: per-sequence page lists and token counts."""
    indptr = kv_indptr.tolist()
    indices = kv_indices.tolist()
    tables = [indices[a:b] for a, b in zip(indptr[:-1], indptr[1:])]
    lens = [(len(t) - 1) * page_size + last if t else 0 for t, last in zip(tables, kv_last_page_len.tolist())]
    return tables, lens


def slot_mapping(pages: Sequence[int], *, start: int, num_tokens: int, page_size: int) -> torch.Tensor:
    """Flat slots ``page * page_size + offset`` of tokens ``start .. start+num_tokens-1``.

    Returns ``int64 [num_tokens]``.
    """
    end = start + num_tokens
    if num_tokens and (end - 1) // page_size >= len(pages):
        raise ValueError(
            f"token {end - 1} needs logical page {(end - 1) // page_size}, "
            f"but the sequence holds {len(pages)} page(s)"
        )
    # plain Python then one tensor: a decode step reserves one token, where torch ops per call
    # would cost more than the arithmetic
    slots = [pages[t // page_size] * page_size + t % page_size for t in range(start, end)]
    return torch.tensor(slots, dtype=torch.int64)  # [num_tokens]
