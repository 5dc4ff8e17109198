// Paged attention on the CPU, K/V read where they lie (paged_ref.attention.cpu_paged); vexp: paged_ref/csrc/vexp.h,
// compiled before this file (paged_ref.native.build).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
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
