"""Paged decode on a CPU, K/V read where they lie: the CPU twin of the Triton kernel, in C++.

On a CPU, PyTorch has no attention op that takes a block table: `sdpa` copies every sequence's
pages out (``index_select``) and hands the copy to SDPA, so each K/V byte crosses memory three
times (read, written, read again) and rows shorter than the longest are padded. vLLM's CPU build
reads the pages in place with its own kernel (``cpu_attention_with_kv_cache``); this module is
such a kernel, small enough to read, compiled on first use with PyTorch's C++ extension loader
(``torch.utils.cpp_extension.load_inline``: a C++ compiler and ninja, ~20 s, then cached on disk,
compiled for the host's own instruction set: ``-march=native``).

For each sequence, row by row: every token's K row ``[Hkv, D]`` is found through the block table
(token ``t`` is slot ``t % page_size`` of page ``block_table[b, t // page_size]``) and read once
for all query heads (GQA); a plain softmax of each head's scores (float32); then every V row is
read once and accumulated. Only the row's own ``seq_lens[b]`` tokens are touched: no padding.

Where the kernel cannot run (a build that fails, no compiler; tensors not float32 on the CPU),
`cpu_paged_decode` runs `sdpa_paged_decode` instead: the same numbers up to rounding. A failed
build warns once, with its reason (`build`, which `paged_ref.hf.cpu_ops` shares).

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

from ._checks import check_paged_inputs
from .sdpa import sdpa_paged_decode

__all__ = ["EXP", "FLAGS", "SOURCE", "build", "cpu_paged_decode", "kernel"]

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

#: The kernel's C++ source (one function, ``paged_decode``), after `EXP`.
SOURCE = r"""
#include <vector>

// q [B, Hq, D], caches [num_pages, P, Hkv, D], block_table int32 [B, max_pages], seq_lens int32 [B],
// all contiguous float32. Returns out [B, Hq, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t P = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv, M = block_table.size(1);
  auto out = torch::empty_like(q);
  const float *qs = q.data_ptr<float>(), *ks = k_cache.data_ptr<float>(), *vs = v_cache.data_ptr<float>();
  const int32_t *table = block_table.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  float* os = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;  // [Hq, len]: scores, then probabilities
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int32_t* pages = table + b * M;
      const float* qb = qs + b * Hq * D;
      float* ob = os + b * Hq * D;
      std::fill(ob, ob + Hq * D, 0.f);
      if (len <= 0) continue;  // no token: a zero row (the checks refuse it before)
      s.resize(Hq * len);
      for (int64_t t = 0; t < len; ++t) {  // scores: token t's K row [Hkv, D], read in its page
        const float* k = ks + (int64_t(pages[t / P]) * P + t % P) * Hkv * D;
        for (int64_t h = 0; h < Hq; ++h) {
          const float *qh = qb + h * D, *kh = k + (h / G) * D;  // query head h reads KV head h / G
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
        for (int64_t h = 0; h < Hq; ++h) {
          const float p = s[h * len + t], *vh = v + (h / G) * D;
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
    """The compiled extension (its ``paged_decode``), built on first call, or None (`build`)."""
    return build("paged_ref_cpu_paged", SOURCE, ["paged_decode"], "decode runs sdpa_paged_decode")


def cpu_paged_decode(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, check_values=True) -> torch.Tensor:
    """Decode attention over the pages, the contract of `reference_paged_decode`, through `kernel`
    for float32 CPU tensors (else `sdpa_paged_decode`)."""
    scale = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=check_values)
    native = q.device.type == "cpu" and q.dtype == torch.float32
    module = kernel() if native else None
    if module is None:
        return sdpa_paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale=scale, check_values=False)
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    return module.paged_decode(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), table, lens, scale)
