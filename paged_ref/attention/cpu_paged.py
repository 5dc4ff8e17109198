"""Paged attention on a CPU, K/V read where they lie: the CPU twin of the Triton kernel, in C++.

On a CPU, PyTorch has no attention op that takes a block table: `sdpa` copies every sequence's
pages out (``index_select``) and hands the copy to SDPA, so each K/V byte crosses memory three
times (read, written, read again) and rows shorter than the longest are padded. vLLM's CPU build
reads the pages in place with its own kernel (``cpu_attention_with_kv_cache``); this module is
such a kernel, small enough to read, compiled on first use with PyTorch's C++ extension loader
(``torch.utils.cpp_extension.load_inline``: a C++ compiler and ninja, ~20 s, then cached on disk,
compiled for the host's own instruction set: ``-march=native``).

Query token by query token (a decode row is one; a prefill chunk's tokens each see the sequence up
to themselves): every K row ``[Hkv, D]`` it sees is found through the block table (token ``t`` is
slot ``t % page_size`` of page ``block_table[b, t // page_size]``) and read once for all query
heads (GQA); a plain softmax of each head's scores (float32); then every V row is read once and
accumulated. Only the tokens a query sees are touched: no padding, no mask. The kernel takes a
packed forward's tokens as they lie, decode rows and prefill chunks side by side, in one call
(`cpu_paged_packed`, as vLLM's attention takes a mixed batch); `cpu_paged_decode` and
`cpu_paged_prefill` are the same kernel under the backends' contracts.

Where the kernel cannot run (a build that fails, no compiler; tensors not float32 on the CPU),
`cpu_paged_decode` and `cpu_paged_prefill` run `sdpa_paged_decode` and `sdpa_paged_prefill`
instead: the same numbers up to rounding. A failed build warns once, with its reason (`build`,
which `paged_ref.hf.cpu_ops` shares).

Example:
    >>> kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
    >>> q, bt, lens = torch.randn(2, 8, 64), torch.tensor([[3, 1], [0, 2]]), torch.tensor([20, 5])
    >>> from paged_ref.attention.reference import reference_paged_decode
    >>> torch.allclose(cpu_paged_decode(q, kc, vc, bt, lens), reference_paged_decode(q, kc, vc, bt, lens), atol=1e-5)
    True
"""

from __future__ import annotations

import functools
import warnings

import torch

from ._checks import check_paged_inputs, check_prefill_inputs
from .sdpa import sdpa_paged_decode, sdpa_paged_prefill

__all__ = ["EXP", "FLAGS", "SOURCE", "build", "cpu_paged_decode", "cpu_paged_packed", "cpu_paged_prefill"]
__all__ += ["kernel"]

#: ``vexp(x)``, a float exp the compiler vectorizes (``std::exp`` is a scalar call): ``2^n e^r``, ``n`` the
#: nearest integer to ``x / ln 2``, ``e^r`` to 1e-7 by its Taylor series (``|r| <= ln(2) / 2``).
EXP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
static inline float vexp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(x * 1.44269504f), r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.f / 5040;
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + c;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
"""

#: The kernel's C++ source (one function, ``paged_attention``), after `EXP`.
SOURCE = r"""
#include <numeric>
#include <vector>

// q [n, Hq, D]: the new tokens of B sequences, sequence b's q_lens[b] after those of the ones before;
// its token i is its token seq_lens[b] - q_lens[b] + i and sees the tokens up to itself (causal);
// caches [num_pages, P, Hkv, D], block_table int32 [B, max_pages], lens int32 [B], all contiguous
// float32. Returns out [n, Hq, D].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor q_lens, double scale) {
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), B = seq_lens.size(0);
  const int64_t P = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv, M = block_table.size(1);
  auto out = torch::empty_like(q);
  const float *qs = q.data_ptr<float>(), *ks = k_cache.data_ptr<float>(), *vs = v_cache.data_ptr<float>();
  const int32_t *table = block_table.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  const int32_t* new_lens = q_lens.data_ptr<int32_t>();
  float* os = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  TORCH_CHECK(std::accumulate(new_lens, new_lens + B, int64_t(0)) == n, "q_lens must add up to q's ", n, " tokens");
  std::vector<int64_t> seq(n), seen(n);  // each token's sequence and the tokens it sees
  for (int64_t b = 0, row = 0; b < B; ++b)
    for (int64_t i = 0; i < new_lens[b]; ++i, ++row) seq[row] = b, seen[row] = lens[b] - new_lens[b] + i + 1;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;  // [Hq, len]: scores, then probabilities
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = seq[row], len = seen[row];
      const int32_t* pages = table + b * M;
      const float* qb = qs + row * Hq * D;
      float* ob = os + row * Hq * D;
      std::fill(ob, ob + Hq * D, 0.f);
      if (len <= 0) continue;  // no token: a zero row (the checks refuse it before)
      s.resize(Hq * len);
      for (int64_t t = 0; t < len; ++t) {  // scores: token t's K row [Hkv, D], read in its page
        const float* k = ks + (int64_t(pages[t / P]) * P + t % P) * Hkv * D;
        for (int64_t g = 0; g < Hkv; ++g)
          for (int64_t h = g * G; h < (g + 1) * G; ++h) {  // query heads h of KV head g
            const float *qh = qb + h * D, *kh = k + g * D;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; ++d) acc += qh[d] * kh[d];
            s[h * len + t] = acc * sc;
          }
      }
      for (int64_t h = 0; h < Hq; ++h) {  // softmax of each head's scores
        float* r = s.data() + h * len;
        const float m = *std::max_element(r, r + len);
        float l = 0.f;
#pragma omp simd reduction(+ : l)
        for (int64_t t = 0; t < len; ++t) {
          r[t] = vexp(r[t] - m);
          l += r[t];
        }
        for (int64_t t = 0; t < len; ++t) r[t] /= l;
      }
      for (int64_t t = 0; t < len; ++t) {  // out = probabilities x V: token t's V row, read in its page
        const float* v = vs + (int64_t(pages[t / P]) * P + t % P) * Hkv * D;
        for (int64_t g = 0; g < Hkv; ++g)
          for (int64_t h = g * G; h < (g + 1) * G; ++h) {
            const float p = s[h * len + t], *vh = v + g * D;
            float* oh = ob + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) oh[d] += p * vh[d];
          }
      }
    }
  });
  return out;
}
"""

#: -O3 and the host's vector width; fast-math lets the compiler reassociate the sums, as any SIMD
#: reduction does; infinities stay IEEE.
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffast-math", "-fno-finite-math-only"]


def build(name: str, source: str, functions: list[str], instead: str):
    """``source`` (after `EXP`) compiled as the extension ``name``; None, with one warning saying why
    and what runs ``instead``, where it cannot be built (no compiler, no ninja, a compile error)."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name, cpp_sources=EXP + source, functions=functions, extra_cflags=FLAGS)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        warnings.warn(f"{name}: the C++ code could not be built ({why}); {instead}", RuntimeWarning, stacklevel=3)
        return None


@functools.cache
def kernel():
    """The compiled extension (its ``paged_attention``), built on first call, or None (`build`)."""
    return build("paged_ref_cpu_paged", SOURCE, ["paged_attention"], "attention runs through SDPA (sdpa_paged_*)")


def cpu_paged_decode(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, check_values=True) -> torch.Tensor:
    """Decode attention over the pages, the contract of `reference_paged_decode`, through `kernel`
    for float32 CPU tensors (else `sdpa_paged_decode`)."""
    scale = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values)
    if _module(q) is None:
        return sdpa_paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=False)
    ones = torch.ones_like(seq_lens, dtype=torch.int32)  # [batch]: one new token per sequence
    return _run(q, k_cache, v_cache, block_table, seq_lens, ones, scale)  # [batch, Hq, D]


def cpu_paged_prefill(
    q, k_cache, v_cache, block_table, seq_lens, q_lens, *, scale=None, check_values=True
) -> torch.Tensor:
    """Causal prefill over the pages, the contract of `reference_paged_prefill`, through `kernel` for
    float32 CPU tensors (else `sdpa_paged_prefill`): every row's own tokens, no padding, no copied page."""
    scale = check_prefill_inputs(
        q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=check_values
    )
    if _module(q) is None:
        return sdpa_paged_prefill(q, k_cache, v_cache, block_table, seq_lens, q_lens, scale=scale, check_values=False)
    valid = torch.arange(q.shape[2], device=q.device)[None, :] < q_lens[:, None]  # [batch, max_q_len]
    rows = q.transpose(1, 2)  # [batch, max_q_len, Hq, D]
    out = torch.zeros_like(rows)  # padding rows: zero
    out[valid] = _run(rows[valid], k_cache, v_cache, block_table, seq_lens, q_lens, scale)  # [num_new, Hq, D]
    return out.transpose(1, 2)  # [batch, Hq, max_q_len, D]


def cpu_paged_packed(q, k_cache, v_cache, block_table, seq_lens, q_lens, *, scale: float):
    """Decode rows and prefill chunks in one call, as a packed forward lays them out: ``q [num_new, Hq, D]``,
    row ``b``'s ``q_lens[b]`` tokens after those of the rows before it -> ``[num_new, Hq, D]``; the kernel's
    contract (values unchecked: they come from the cache), or None where `kernel` cannot run ``q``."""
    return None if _module(q) is None else _run(q, k_cache, v_cache, block_table, seq_lens, q_lens, scale)


def _module(q: torch.Tensor):
    """`kernel` where it can run ``q`` (float32 on the CPU), else None."""
    return kernel() if q.device.type == "cpu" and q.dtype == torch.float32 else None


def _run(q, k_cache, v_cache, block_table, seq_lens, q_lens, scale: float) -> torch.Tensor:
    """`kernel`'s ``paged_attention`` of the packed tokens ``q [num_new, Hq, D]`` -> ``[num_new, Hq, D]``."""
    tables = (t.to(torch.int32).contiguous() for t in (block_table, seq_lens, q_lens))
    return kernel().paged_attention(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), *tables, scale)
