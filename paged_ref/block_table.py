"""Block tables: each sequence's logical page -> physical page map, as kernels want it.

Token ``t`` of a sequence lives in logical page ``t // page_size`` at offset ``t % page_size``;
the block table says which physical page that is, and its flat *slot* in the cache is
``physical_page * page_size + offset``. A batch comes in two formats:

- padded (vLLM, FlashAttention): ``block_table: int32 [batch, max_pages]`` + ``seq_lens: int32 [batch]``;
- CSR (FlashInfer): ``kv_indptr: int32 [batch+1]``, ``kv_indices: int32 [total_pages]``,
  ``kv_last_page_len: int32 [batch]`` (tokens in each sequence's last page, 1..page_size).

Example:
    >>> bt, lens = pad_block_tables([[7, 2], [5]], [20, 3], page_size=16)
    >>> bt.tolist(), lens.tolist()
    ([[7, 2], [5, 0]], [20, 3])
    >>> [t.tolist() for t in to_csr([[7, 2], [5]], [20, 3], page_size=16)]
    [[0, 2, 3], [7, 2, 5], [4, 3]]
    >>> slot_mapping([7, 2], start=15, num_tokens=2, page_size=16).tolist()
    [127, 32]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._arith import cdiv
from ._validate import INT32_MAX, check_int, check_list


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Number of pages that hold ``num_tokens`` tokens: ceil(num_tokens / page_size)."""
    num_tokens = check_int("num_tokens", num_tokens, min_value=0)
    page_size = check_int("page_size", page_size, min_value=1)
    return cdiv(num_tokens, page_size)


# ----------------------------------------------------------------- unchecked, for the cache's own tables
def flat_slots(pages: list[int], start: int, num_tokens: int, page_size: int) -> torch.Tensor:
    """``int64 [num_tokens]``: the flat slots of tokens ``start .. start+num_tokens-1`` (see `slot_mapping`)."""
    # plain Python then one tensor: a decode step reserves one token, where torch ops would cost more
    slots = [pages[t // page_size] * page_size + t % page_size for t in range(start, start + num_tokens)]
    return torch.tensor(slots, dtype=torch.int64)  # [num_tokens]


def pack_padded(tables: list[list[int]], seq_lens: list[int], *, device=None):
    """The padded batch of `pad_block_tables`, from well-formed page lists."""
    block_table = torch.zeros(len(tables), max([1, *map(len, tables)]), dtype=torch.int32)  # [batch, max_pages]
    for i, pages in enumerate(tables):
        block_table[i, : len(pages)] = torch.as_tensor(list(pages), dtype=torch.int32)
    lens = torch.as_tensor(list(seq_lens), dtype=torch.int32)  # [batch]
    return block_table.to(device), lens.to(device)


def pack_csr(tables: list[list[int]], seq_lens: list[int], *, page_size: int, device=None):
    """The CSR batch of `to_csr`, from well-formed page lists."""
    counts = [cdiv(n, page_size) for n in seq_lens]
    indptr = torch.zeros(len(tables) + 1, dtype=torch.int32)  # [batch + 1]
    indptr[1:] = torch.cumsum(torch.as_tensor(counts, dtype=torch.int64), 0).to(torch.int32)
    flat = [p for pages, c in zip(tables, counts) for p in list(pages)[:c]]
    indices = torch.as_tensor(flat, dtype=torch.int32)  # [total_pages]
    last = torch.as_tensor(
        [n - (c - 1) * page_size if c else 0 for n, c in zip(seq_lens, counts)], dtype=torch.int32
    )  # [batch]
    return indptr.to(device), indices.to(device), last.to(device)


# ----------------------------------------------------------------- checked entry points
def _check_tables(tables: Sequence[Sequence[int]], seq_lens: Sequence[int], page_size=None):
    """The page lists and lengths as lists, checked: page ids, no page twice in a row, and with
    ``page_size`` enough pages for each length."""
    tables = [
        check_list(f"tables[{i}]", t, "page ids") for i, t in enumerate(check_list("tables", tables, "page lists"))
    ]
    seq_lens = check_list("seq_lens", seq_lens, "token counts")
    if len(tables) != len(seq_lens):
        raise ValueError(f"tables and seq_lens must have the same length, got {len(tables)} and {len(seq_lens)}")
    for i, (pages, n) in enumerate(zip(tables, seq_lens)):
        check_int(f"seq_lens[{i}]", n, min_value=0, max_value=INT32_MAX)
        if not all(type(p) is int and 0 <= p <= INT32_MAX for p in pages):  # the fast path: plain ints
            for j, page in enumerate(pages):
                check_int(f"tables[{i}][{j}]", page, min_value=0, max_value=INT32_MAX)
        if len(set(pages)) != len(pages):
            dup = sorted({p for p in pages if list(pages).count(p) > 1})
            raise ValueError(
                f"tables[{i}] must not list a page twice, got page(s) {dup} more than once in {list(pages)}"
            )
        if page_size is not None and cdiv(n, page_size) > len(pages):
            raise ValueError(
                f"seq_lens[{i}]={n} needs {cdiv(n, page_size)} pages of {page_size}, but tables[{i}] has {len(pages)}"
            )
    return tables, seq_lens


def pad_block_tables(tables: Sequence[Sequence[int]], seq_lens: Sequence[int], *, page_size: int | None = None):
    """Per-sequence page lists as ``(block_table int32 [batch, max_pages], seq_lens int32 [batch])``,
    padded with page 0 (attention masks past ``seq_lens``). With ``page_size`` every row must list
    the pages its length needs; without it the lengths are unchecked."""
    if page_size is not None:
        page_size = check_int("page_size", page_size, min_value=1)
    return pack_padded(*_check_tables(tables, seq_lens, page_size))


def to_csr(tables: Sequence[Sequence[int]], seq_lens: Sequence[int], *, page_size: int):
    """FlashInfer's CSR form of a batch: ``(kv_indptr, kv_indices, kv_last_page_len)``, int32, listing
    only the pages that hold tokens (an empty sequence: no page, ``kv_last_page_len`` 0)."""
    page_size = check_int("page_size", page_size, min_value=1)
    return pack_csr(*_check_tables(tables, seq_lens, page_size), page_size=page_size)


def slot_mapping(pages: Sequence[int], *, start: int, num_tokens: int, page_size: int) -> torch.Tensor:
    """``int64 [num_tokens]``: the flat slots ``page * page_size + offset`` of tokens
    ``start .. start+num_tokens-1``, in the sequence holding ``pages``."""
    start = check_int("start", start, min_value=0)
    num_tokens = check_int("num_tokens", num_tokens, min_value=0)
    page_size = check_int("page_size", page_size, min_value=1, max_value=INT32_MAX)
    pages = check_list("pages", pages, "page ids")
    end = start + num_tokens
    if num_tokens and (end - 1) // page_size >= len(pages):
        raise ValueError(
            f"token {end - 1} needs logical page {(end - 1) // page_size}, but the sequence holds {len(pages)} page(s)"
        )
    used = range(start // page_size, cdiv(end, page_size)) if num_tokens else ()  # the pages the tokens land in
    if not all(type(pages[j]) is int and 0 <= pages[j] <= INT32_MAX for j in used):  # the fast path: plain ints
        for j in used:
            check_int(f"pages[{j}]", pages[j], min_value=0, max_value=INT32_MAX)
    return flat_slots(pages, start, num_tokens, page_size)
