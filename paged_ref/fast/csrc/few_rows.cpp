// x @ W.T for a few rows of x, each weight read once, in one stream (paged_ref.fast.prepack).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>

typedef float vec __attribute__((vector_size(64), aligned(4)));  // 16 floats, any alignment
constexpr int64_t L = 16, BLOCK = 64, V = BLOCK / L, MAX_ROWS = 6;

// MB rows of x [MB, K] times one block w [K, BLOCK]: MB * V vector sums over k, each weight read once
template <int MB>
static void rows(const float* x, const float* w, int64_t K, float* o, int64_t N, int64_t n) {
  vec acc[MB][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    vec wk[V];
    for (int v = 0; v < V; ++v) wk[v] = *reinterpret_cast<const vec*>(w + k * BLOCK + v * L);
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] += x[m * K + k] * wk[v];
  }
  for (int m = 0; m < MB; ++m)
    for (int64_t j = 0; j < n; ++j) o[m * N + j] = acc[m][j / L][j % L];  // the block's first n outputs
}
constexpr void (*ROWS[])(const float*, const float*, int64_t, float*, int64_t, int64_t) = {
    nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>};

torch::Tensor few_rows(torch::Tensor x, torch::Tensor w, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.is_contiguous() && w.size(1) == x.size(1) && w.size(2) == BLOCK &&
      N > (w.size(0) - 1) * BLOCK && N <= w.size(0) * BLOCK,
      "few_rows: x [M, K], contiguous w [ceil(N / 64), K, 64]; got x ", x.sizes(), ", w ", w.sizes(), ", N ", N);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, w.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)  // the block's weights come from memory once, then from cache
      for (int64_t m = 0, left = (M + MAX_ROWS - 1) / MAX_ROWS; left > 0; --left) {  // even row chunks
        const int64_t mb = (M - m) / left;
        ROWS[mb](xp + m * K, wp + b * K * BLOCK, K, op + m * N + b * BLOCK, N, std::min(BLOCK, N - b * BLOCK));
        m += mb;
      }
  });
  return out;
}

TORCH_LIBRARY(paged_ref_linear, m) { m.def("few_rows(Tensor x, Tensor w, int n) -> Tensor", &few_rows); }
