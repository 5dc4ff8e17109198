"""Two deliberately wrong decode functions: negative controls for the equivalence checks.

A check that compares paged results with the plain model (`paged_ref.lab.likelihood.log_likelihood`
against `reference_log_likelihood`) is only as good as its power to fail. These decoders make the
mistakes a real implementation makes, on top of the reference, so a notebook or test can show
how far a real bug moves the numbers. `MISTAKES` holds them as backends (decode only; their
prefill is the reference's), to pass as ``backend=``; they are not registered by name.

Example:
    >>> import torch
    >>> kc, vc = torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8)
    >>> bt, lens = torch.tensor([[0, 3]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    >>> q = torch.randn(1, 2, 8)
    >>> bool(torch.allclose(off_by_one_decode(q, kc, vc, bt, lens),
    ...                     reference_paged_decode(q, kc, vc, bt, lens - 1)))
    True
    >>> sorted(MISTAKES)
    ['mistake_off_by_one', 'mistake_wrong_page']
"""

from __future__ import annotations

import torch

from ..attention.reference import reference_paged_decode
from ..hf.attention import Backend

__all__ = ["MISTAKES", "off_by_one_decode", "wrong_page_decode"]


def off_by_one_decode(q, k_cache, v_cache, block_table, seq_lens, **kwargs) -> torch.Tensor:
    """Decode that misses each sequence's newest token (lengths one short, as from an
    exclusive/inclusive mix-up); a sequence of one token keeps it. Shapes as the reference's."""
    return reference_paged_decode(q, k_cache, v_cache, block_table, (seq_lens - 1).clamp(min=1), **kwargs)


def wrong_page_decode(q, k_cache, v_cache, block_table, seq_lens, **kwargs) -> torch.Tensor:
    """Decode that reads each sequence's first two logical pages in swapped order (a block-table
    indexing bug); sequences of one page are unaffected. Shapes as the reference's."""
    page_size = k_cache.shape[1]
    swapped = block_table.clone()  # [batch, max_pages]
    two = (seq_lens > page_size) & (block_table.shape[1] > 1)  # [batch]
    if block_table.shape[1] > 1:
        swapped[two, 0], swapped[two, 1] = block_table[two, 1], block_table[two, 0]
    return reference_paged_decode(q, k_cache, v_cache, swapped, seq_lens, **kwargs)


_PREFILL = ("paged_ref.attention.reference", "reference_paged_prefill")

#: The wrong backends by name: pass one as ``backend=`` (`log_likelihood`, `PagedSession`, `generate`).
MISTAKES: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("mistake_off_by_one", ("paged_ref.lab.mistakes", "off_by_one_decode"), _PREFILL),
        Backend("mistake_wrong_page", ("paged_ref.lab.mistakes", "wrong_page_decode"), _PREFILL),
    )
}
