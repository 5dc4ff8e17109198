// x @ W.T for a few rows of x, each weight read once, block by block (paged_ref.fast.prepack); check_tensor:
// paged_ref/csrc/checks.h, compiled before this file (paged_ref.native.build).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>

// The vector registers decide the tiles. With AVX-512 a register holds 16 floats and there are 32: a pass sums
// a whole block (4 registers an output row) for up to 6 rows at once. With 16 registers of 8 floats (AVX2, and
// any other target) a pass sums half a block (4 registers a row) for up to 3 rows, and a block takes two passes:
// a tile of AVX-512's shape would not fit in the registers, and the compiler moves it through memory at every k.
#ifdef __AVX512F__
constexpr int64_t L = 16, MAX_ROWS = 6;
#else
constexpr int64_t L = 8, MAX_ROWS = 3;
#endif
typedef float vec __attribute__((vector_size(L * 4), aligned(4)));  // L floats, any alignment
constexpr int64_t BLOCK = 64;

// MB rows of x [MB, K] times NB consecutive blocks w [NB, K, BLOCK] (of the last block its first n outputs),
// PART * L outputs of each block a pass: MB * NB * PART vector sums over k; NB blocks are NB streams from memory
// at once; a pass over whole blocks (PART * L = BLOCK) reads them in memory order. Each output is summed over k in
// order, whatever the tile.
template <int MB, int NB, int PART = 4>
static void rows(const float* x, const float* w, int64_t K, float* o, int64_t N, int64_t n) {
  constexpr int64_t PASSES = BLOCK / (PART * L);
  for (int64_t p = 0; p < PASSES; ++p) {
    vec acc[MB][NB][PART] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int s = 0; s < NB; ++s) {
        vec wk[PART];
        for (int v = 0; v < PART; ++v)
          wk[v] = *reinterpret_cast<const vec*>(w + (s * K + k) * BLOCK + (p * PART + v) * L);
        for (int m = 0; m < MB; ++m)
          for (int v = 0; v < PART; ++v) acc[m][s][v] += x[m * K + k] * wk[v];
      }
    for (int m = 0; m < MB; ++m)
      for (int s = 0; s < NB; ++s)
        for (int64_t j = p * PART * L, end = std::min((p + 1) * PART * L, s == NB - 1 ? n : BLOCK); j < end; ++j)
          o[m * N + s * BLOCK + j] = acc[m][s][(j / L) % PART][j % L];
  }
}
typedef void (*Rows)(const float*, const float*, int64_t, float*, int64_t, int64_t);
#ifdef __AVX512F__
constexpr Rows ROWS[] = {nullptr, rows<1, 1>, rows<2, 1>, rows<3, 1>, rows<4, 1>, rows<5, 1>, rows<6, 1>};
// Up to 3 rows, one stream at a time leaves a core's memory reads idle: GROUP[M] blocks at once (at most as many
// sums as ROWS[6] keeps in registers), each output summed over k in the same order as in ROWS[M]
constexpr int64_t GROUP[] = {1, 4, 2, 2};
constexpr Rows GROUPED[] = {nullptr, rows<1, 4>, rows<2, 2>, rows<3, 2>};
#else  // one row: a whole block a pass (8 sums), the weights read in memory order as a plain read reads them (two
// half-block passes, even over two blocks at once, read each row of 64 weights in two halves and stream slower);
// two or three rows fill the registers with one block's half
constexpr Rows ROWS[] = {nullptr, rows<1, 1, 8>, rows<2, 1>, rows<3, 1>};
constexpr int64_t GROUP[] = {1, 1, 1, 1};
constexpr const Rows* GROUPED = ROWS;  // GROUP: one block at a time
#endif

// x float32 [M, K], any strides; w float32 [ceil(N / 64), K, 64] (stream_layout), any strides (a copy where not
// contiguous); N >= 0.
void check_few_rows(const torch::Tensor& x, const torch::Tensor& w, int64_t N) {
  check_tensor("few_rows", "x", x, at::kFloat, 2, "[M, K]");
  check_tensor("few_rows", "w", w, at::kFloat, 3, "[ceil(N / 64), K, 64]");
  TORCH_CHECK(N >= 0, "few_rows: n must be >= 0, got ", N);
  TORCH_CHECK(w.size(0) == N / BLOCK + (N % BLOCK != 0) && w.size(1) == x.size(1) && w.size(2) == BLOCK,
              "few_rows: w must be [ceil(n / 64), K, 64] = [", N / BLOCK + (N % BLOCK != 0), ", ", x.size(1),
              ", 64] (n = ", N, ", x's K), got ", w.sizes());
}

// x @ W.T [M, N] for w = stream_layout(W).
torch::Tensor few_rows(torch::Tensor x, torch::Tensor w, int64_t N) {
  check_few_rows(x, w, N);
  x = x.contiguous(), w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, w.size(0), 1, [&](int64_t begin, int64_t end) {
    int64_t b = begin;
    for (const int64_t g = M < 4 ? GROUP[M] : 1; g > 1 && b + g <= end; b += g)
      GROUPED[M](xp, wp + b * K * BLOCK, K, op + b * BLOCK, N, std::min(BLOCK, N - (b + g - 1) * BLOCK));
    for (; b < end; ++b)  // the block's weights come from memory once, then from cache
      for (int64_t m = 0, left = (M + MAX_ROWS - 1) / MAX_ROWS; left > 0; --left) {  // even row chunks
        const int64_t mb = (M - m) / left;
        ROWS[mb](xp + m * K, wp + b * K * BLOCK, K, op + m * N + b * BLOCK, N, std::min(BLOCK, N - b * BLOCK));
        m += mb;
      }
  });
  return out;
}

TORCH_LIBRARY(paged_ref_linear, m) {
  m.def("few_rows(Tensor x, Tensor w, int n) -> Tensor", &few_rows);
  m.def("vector_floats() -> int", [] { return L; });  // the tile this build runs: 16 (AVX-512) or 8
  m.def("few_rows_checks(Tensor x, Tensor w, int n, int times) -> ()",  // the checks alone, for bench serve --profile
        [](torch::Tensor x, torch::Tensor w, int64_t n, int64_t times) {
          repeat_checks(times, [&] { check_few_rows(x, w, n); });
        });
}
