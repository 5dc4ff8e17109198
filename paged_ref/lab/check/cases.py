"""Random paged caches the way a serving cache ends up after churn: one generator for the checkers and the tests.

`scatter_sequences` writes random K/V of each sequence over the shuffled pages of a fresh cache:

* pages of all sequences are scattered over a shuffled pool, with spare pages nobody owns;
* every slot no sequence owns (spare pages, the unwritten tail of each last page) holds large
  finite garbage, so reading one by mistake moves the output far off;
* block-table padding (entries past a sequence's pages) holds either junk (``padding="junk"``:
  -1, ids past the end of the pool, other sequences' pages: what the attention functions must
  ignore) or only valid page ids of other sequences (``padding="pages"``: a student's gather
  that reads padding gets wrong numbers instead of an index error).

It also returns each sequence's *logical* K/V in float64 (the values written, after rounding to
``dtype``), which an oracle can use without looking at pages.

Example:
    >>> g = torch.Generator().manual_seed(0)
    >>> k, v, table, kl, vl = scatter_sequences([5, 1], page_size=4, num_kv_heads=1, head_dim=2, generator=g)
    >>> k.shape, table.shape, [x.shape[0] for x in kl]
    (torch.Size([6, 4, 1, 2]), torch.Size([2, 4]), [5, 1])
    >>> bool((k[table[0, 1], 0] == kl[0][4].float()).all())     # token 4 sits on logical page 1, offset 0
    True
"""

from __future__ import annotations

import torch

from ..._arith import cdiv
from ..._validate import check_choice

__all__ = ["scatter_sequences"]


def scatter_sequences(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    spare_pages: int = 3,
    pad_cols: int = 2,
    garbage: float = 100.0,
    value_scale: float = 1.0,
    padding: str = "junk",
):
    """Scatter random K/V of sequences of ``seq_lens`` tokens over shuffled pages.

    Args:
        seq_lens: tokens of each sequence (>= 1 each).
        page_size, num_kv_heads, head_dim: the cache geometry.
        generator: the source of every random number (same generator state, same case).
        dtype: dtype of the caches and of the logical values' rounding.
        spare_pages: pages nobody owns; pad_cols: block-table columns past the longest sequence.
        garbage: scale of the random values in every slot no sequence owns.
        value_scale: scale of the sequences' own K/V (standard normal times this).
        padding: ``"junk"`` or ``"pages"`` (see the module docstring).

    Returns:
        ``(k_cache, v_cache, block_table, k_logical, v_logical)``: caches ``[num_pages, page_size,
        Hkv, D]`` of ``dtype``, block_table int32 ``[batch, max_pages]``, and per sequence float64
        ``[seq_len, Hkv, D]``.
    """
    check_choice("padding", padding, {"junk", "pages"})
    used = [cdiv(n, page_size) for n in seq_lens]
    num_pages = sum(used) + spare_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=generator, dtype=torch.float64) * garbage).to(dtype)
    v_cache = (torch.randn(shape, generator=generator, dtype=torch.float64) * garbage).to(dtype)
    perm = torch.randperm(num_pages, generator=generator)
    max_pages = max(used) + pad_cols
    table = torch.empty(len(seq_lens), max_pages, dtype=torch.int32)  # [batch, max_pages]
    junk = torch.tensor([-1, num_pages + 7, int(perm[0]), int(perm[-1])], dtype=torch.int32)
    k_logical, v_logical, start = [], [], 0
    for b, (n, u) in enumerate(zip(seq_lens, used)):
        pages = perm[start : start + u]
        start += u
        if padding == "junk":
            pad = junk[torch.randint(0, len(junk), (max_pages - u,), generator=generator)]
        else:  # someone else's (or a spare) page
            pad = perm[torch.randint(0, num_pages, (max_pages - u,), generator=generator)].to(torch.int32)
        table[b] = torch.cat([pages.to(torch.int32), pad])
        k = (torch.randn(n, num_kv_heads, head_dim, generator=generator, dtype=torch.float64) * value_scale).to(dtype)
        v = (torch.randn(n, num_kv_heads, head_dim, generator=generator, dtype=torch.float64) * value_scale).to(dtype)
        pos = torch.arange(n)
        k_cache[pages[pos // page_size], pos % page_size] = k
        v_cache[pages[pos // page_size], pos % page_size] = v
        k_logical.append(k.to(torch.float64))
        v_logical.append(v.to(torch.float64))
    return k_cache, v_cache, table, k_logical, v_logical
