"""Paged attention on a CPU, K/V read where they lie: the CPU twin of the Triton kernel, in C++.

On a CPU, PyTorch has no attention op that takes a block table: `sdpa` copies every sequence's
pages out (``index_select``) and hands the copy to SDPA, so each K/V byte crosses memory three
times (read, written, read again) and rows shorter than the longest are padded. vLLM's CPU build
reads the pages in place with its own kernel (``cpu_attention_with_kv_cache``); this module is
such a kernel, small enough to read (``csrc/cpu_paged.cpp``), compiled on first use (`paged_ref.native.build`:
a C++ compiler and ninja, ~20 s, then cached on disk).

Query token by query token (a decode row is one; a prefill chunk's tokens each see the sequence up
to themselves): every K row ``[Hkv, D]`` it sees is found through the block table (token ``t`` is
slot ``t % page_size`` of page ``block_table[b, t // page_size]``) and read once for all query
heads (GQA); a plain softmax of each head's scores (float32); then every V row is read once and
accumulated. Only the tokens a query sees are touched: no padding, no mask. The kernel takes a
packed forward's tokens as they lie, decode rows and prefill chunks side by side, in one call
(`cpu_paged_packed`, as vLLM's attention takes a mixed batch); `cpu_paged_decode` and
`cpu_paged_prefill` are the same kernel under the backends' contracts. 8-bit pages are read a row at a
time: the row's bytes as floats times its page's scale for that KV head (``k_scale``, ``v_scale``, read
through their strides), the reference's product, then the same loops.

Where the kernel cannot run (a build that fails, no compiler; q not float32 on the CPU),
`cpu_paged_decode` and `cpu_paged_prefill` run `sdpa_paged_decode` and `sdpa_paged_prefill`
instead: the same numbers up to rounding. A failed build warns once, with its reason.

The kernel checks its own arguments before it reads a byte (``check_paged_attention`` in the
source: the dtypes and shapes, the page scales' too, every length, the page ids each sequence uses;
a ``RuntimeError`` naming the argument) and copies non-contiguous tensors, so no call reads or writes
outside its tensors, whatever ``check_values`` says. Softmax weights below ``e^-87.3`` (1.2e-38) of a row's
largest are 0.

Example:
    >>> kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
    >>> q, bt, lens = torch.randn(2, 8, 64), torch.tensor([[3, 1], [0, 2]]), torch.tensor([20, 5])
    >>> from paged_ref.attention.reference import reference_paged_decode
    >>> torch.allclose(cpu_paged_decode(q, kc, vc, bt, lens), reference_paged_decode(q, kc, vc, bt, lens), atol=1e-5)
    True
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..native import VEXP, build
from ._checks import check_paged_inputs, check_prefill_inputs
from .sdpa import sdpa_paged_decode, sdpa_paged_prefill

__all__ = ["SOURCE", "cpu_paged_decode", "cpu_paged_packed", "cpu_paged_prefill", "kernel"]

#: The kernel's C++ source (one function, ``paged_attention``), compiled after `paged_ref.native.VEXP`.
SOURCE = Path(__file__).parent / "csrc" / "cpu_paged.cpp"


@functools.cache
def kernel():
    """The compiled extension (its ``paged_attention``), built on first call, or None (`build`)."""
    instead = "attention runs through SDPA (sdpa_paged_*)"
    functions = ["paged_attention", "paged_attention_scaled", "paged_attention_checks"]
    return build("paged_ref_cpu_paged", [VEXP, SOURCE], functions, instead)


def cpu_paged_decode(
    q, k_cache, v_cache, block_table, seq_lens, *, scale=None, check_values=True, k_scale=None, v_scale=None
) -> torch.Tensor:
    """Decode attention over the pages, the contract of `reference_paged_decode`, through `kernel`
    for float32 CPU tensors (else `sdpa_paged_decode`).

    ``check_values=False`` skips the host reads of `check_paged_inputs` (the types and shapes are
    still checked): a page id listed twice in one row is then not refused (a wrong result). On the
    kernel's path the page ids and lengths are still refused where out of range (the kernel's own
    checks: a ``RuntimeError``); on SDPA's, PyTorch's indexing refuses an out-of-range page id."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_paged_inputs(
        q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values, **scales
    )
    if _module(q) is None:
        return sdpa_paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=False, **scales)
    ones = torch.ones_like(seq_lens, dtype=torch.int32)  # [batch]: one new token per sequence
    return _run(q, k_cache, v_cache, block_table, seq_lens, ones, scale, **scales)  # [batch, Hq, D]


def cpu_paged_prefill(
    q, k_cache, v_cache, block_table, seq_lens, q_lens, *, scale=None, check_values=True, k_scale=None, v_scale=None
) -> torch.Tensor:
    """Causal prefill over the pages, the contract of `reference_paged_prefill`, through `kernel` for
    float32 CPU tensors (else `sdpa_paged_prefill`): every row's own tokens, no padding, no copied page.

    ``check_values=False``: as `cpu_paged_decode`'s; ``q_lens`` out of range are then refused by the
    kernel (``RuntimeError``) or, on SDPA's path, not at all."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = check_prefill_inputs(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=check_values, **scales
    )
    if _module(q) is None:
        args = (q, k_cache, v_cache, block_table, seq_lens, q_lens)
        return sdpa_paged_prefill(*args, scale=scale, check_values=False, **scales)
    valid = torch.arange(q.shape[2], device=q.device)[None, :] < q_lens[:, None]  # [batch, max_q_len]
    rows = q.transpose(1, 2)  # [batch, max_q_len, Hq, D]
    out = torch.zeros_like(rows)  # padding rows: zero
    out[valid] = _run(rows[valid], k_cache, v_cache, block_table, seq_lens, q_lens, scale, **scales)  # [new, Hq, D]
    return out.transpose(1, 2)  # [batch, Hq, max_q_len, D]


def cpu_paged_packed(q, k_cache, v_cache, block_table, seq_lens, q_lens, *, scale: float, k_scale=None, v_scale=None):
    """Decode rows and prefill chunks in one call, as a packed forward lays them out: ``q [num_new, Hq, D]``,
    row ``b``'s ``q_lens[b]`` tokens after those of the rows before it -> ``[num_new, Hq, D]``; the kernel's
    contract and checks only (no Python check: a step's tables come from the cache), or None where `kernel`
    cannot run ``q``."""
    if _module(q) is None:
        return None
    return _run(q, k_cache, v_cache, block_table, seq_lens, q_lens, scale, k_scale=k_scale, v_scale=v_scale)


def _module(q: torch.Tensor):
    """`kernel` where it can run ``q`` (float32 on the CPU), else None."""
    return kernel() if q.device.type == "cpu" and q.dtype == torch.float32 else None


def _run(q, k_cache, v_cache, block_table, seq_lens, q_lens, scale: float, k_scale, v_scale) -> torch.Tensor:
    """`kernel`'s ``paged_attention_scaled`` of the packed tokens ``q [num_new, Hq, D]`` -> ``[num_new, Hq, D]``
    (the kernel checks its arguments and copies non-contiguous ones)."""
    return kernel().paged_attention_scaled(q, k_cache, v_cache, block_table, seq_lens, q_lens, scale, k_scale, v_scale)
