"""FlashInfer's CSR batch read back into page lists (notebooks 02 and 08): the inverse of
`paged_ref.block_table.to_csr`, checking FlashInfer's rules on the way.

Example:
    >>> from paged_ref.block_table import to_csr
    >>> from_csr(*to_csr([[7, 2], [5]], [20, 3], page_size=16), page_size=16)
    ([[7, 2], [5]], [20, 3])
"""

from __future__ import annotations

import torch

from .._validate import check_int

__all__ = ["from_csr"]


def from_csr(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *, page_size: int
) -> tuple[list[list[int]], list[int]]:
    """``(tables, seq_lens)``: per-sequence page lists and token counts. FlashInfer's rules:
    ``kv_indptr`` rises from 0 to ``len(kv_indices)``; page ids >= 0; ``kv_last_page_len`` in
    1..page_size for a sequence with pages, 0 for one without."""
    page_size = check_int("page_size", page_size, min_value=1)
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex():
            what = f"a {t.dim()}-D {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a 1-D integer torch.Tensor, got {what}")
    indptr, indices, last = kv_indptr.tolist(), kv_indices.tolist(), kv_last_page_len.tolist()
    if not indptr or indptr[0] != 0 or indptr[-1] != len(indices):
        raise ValueError(f"kv_indptr must start at 0 and end at len(kv_indices) = {len(indices)}, got {indptr}")
    if any(b < a for a, b in zip(indptr, indptr[1:])):
        raise ValueError(f"kv_indptr must not decrease, got {indptr}")
    if len(last) != len(indptr) - 1:
        raise ValueError(
            f"kv_last_page_len must have batch = len(kv_indptr) - 1 = {len(indptr) - 1} entries, got {len(last)}"
        )
    if any(p < 0 for p in indices):
        raise ValueError(f"kv_indices must be page ids >= 0, got {indices}")
    tables = [indices[a:b] for a, b in zip(indptr[:-1], indptr[1:])]
    for i, (t, n) in enumerate(zip(tables, last)):
        lo, hi = (1, page_size) if t else (0, 0)
        if not lo <= n <= hi:
            raise ValueError(
                f"kv_last_page_len[{i}] must be in [{lo}, {hi}] for a sequence of "
                f"{len(t)} page(s) of {page_size}, got {n}"
            )
    lens = [(len(t) - 1) * page_size + n if t else 0 for t, n in zip(tables, last)]
    return tables, lens
