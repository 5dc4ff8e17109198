// Paged attention on the CPU, K/V read where they lie (paged_ref.attention.cpu_paged); vexp: paged_ref/csrc/vexp.h,
// check_tensor: paged_ref/csrc/checks.h, both compiled before this file (paged_ref.native.build).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

// An int32 or int64 tensor [B] (seq_lens, q_lens) as int64 values, its dtype and shape checked.
static std::vector<int64_t> lengths(const char* name, const torch::Tensor& t, int64_t B) {
  TORCH_CHECK(t.defined() && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong), "paged_attention: ",
              name, " must be an int32 or int64 tensor, got ", t.defined() ? toString(t.scalar_type()) : "None");
  check_tensor("paged_attention", name, t, t.scalar_type(), 1, "[B]");
  TORCH_CHECK(t.size(0) == B, "paged_attention: ", name, " must have B = ", B, " entries (seq_lens'), got ", t.size(0));
  auto c = t.contiguous();  // t itself where it is contiguous
  if (c.scalar_type() == at::kInt) return std::vector<int64_t>(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + B);
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + B);
}

// The pages a sequence of len tokens uses: ceil(len / P), len up to 2^63 - 1.
static inline int64_t pages_used(int64_t len, int64_t P) { return len / P + (len % P != 0); }

// Page ids of the used entries (the first ceil(lens[b] / P) of row b) within [0, num_pages): one pass over them;
// block_table contiguous (check_paged_attention's copy).
template <typename T>
static void check_pages(const torch::Tensor& block_table, const std::vector<int64_t>& lens, int64_t P, int64_t pages) {
  const T* table = block_table.data_ptr<T>();
  const int64_t M = block_table.size(1);
  for (size_t b = 0; b < lens.size(); ++b) {
    const T* row = table + b * M;
    const int64_t used = pages_used(lens[b], P);
    const auto [lo, hi] = std::minmax_element(row, row + used);
    TORCH_CHECK(used == 0 || (*lo >= 0 && *hi < pages), "paged_attention: block_table[", b,
                "] must hold page ids in [0, num_pages = ", pages, ") in its first ", used, " entries (seq_lens[", b,
                "] = ", lens[b], ", page_size ", P, "), got ids in [", int64_t(*lo), ", ", int64_t(*hi), "]");
  }
}

using Scale = std::optional<torch::Tensor>;

// 8-bit pages: k_cache's dtype is one of these (float32 pages have none).
static bool is_8bit(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kChar; }

// k_scale, v_scale: with 8-bit pages float32 CPU tensors [num_pages, Hkv], any strides (0 too: one value
// expanded); with float32 pages None.
static void check_scales(const char* op, const torch::Tensor& k_cache, const Scale& k_scale, const Scale& v_scale) {
  const bool q8 = is_8bit(k_cache.scalar_type());
  for (auto [name, t] : {std::pair{"k_scale", &k_scale}, std::pair{"v_scale", &v_scale}}) {
    TORCH_CHECK(t->has_value() == q8, op, ": ", name, q8 ? " must be a float32 tensor with " : " must be None with ",
                k_cache.scalar_type(), " pages");
    if (!q8) continue;
    check_tensor(op, name, **t, at::kFloat, 2, "[num_pages, Hkv]");
    TORCH_CHECK((*t)->size(0) == k_cache.size(0) && (*t)->size(1) == k_cache.size(2), op, ": ", name,
                " must be [num_pages, Hkv] = [", k_cache.size(0), ", ", k_cache.size(2), "], got ", (*t)->sizes());
  }
}

// What check_paged_attention read and checked: seq_lens and q_lens as int64 values, and a copy of the block table's
// columns that some row uses (contiguous), their page ids in range. The kernel reads these, not the caller's
// tensors: another thread writing those after the checks (a torch op releases the GIL) cannot move a page id out of
// range. (Values another thread writes in q or the pages, or a storage it shrinks meanwhile, are beyond any check.)
struct Checked {
  std::vector<int64_t> lens, new_lens;
  torch::Tensor table;
};

// Everything paged_attention relies on, checked: dtypes, devices, ranks, sizes that must agree, lengths and
// page ids in range (Checked). The tensors' strides are free (copies are made, the scales are read through theirs).
static Checked check_paged_attention(
    const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
    const torch::Tensor& block_table, const torch::Tensor& seq_lens, const torch::Tensor& q_lens,
    const Scale& k_scale = {}, const Scale& v_scale = {}) {
  const char* op = "paged_attention";
  check_tensor(op, "q", q, at::kFloat, 3, "[n, Hq, D]");
  const auto dtype = k_cache.defined() ? k_cache.scalar_type() : at::kFloat;
  TORCH_CHECK(dtype == at::kFloat || is_8bit(dtype), op, ": k_cache must be float32, float8_e4m3fn, float8_e5m2 or ",
              "int8, got ", dtype);
  check_tensor(op, "k_cache", k_cache, dtype, 4, "[num_pages, page_size, Hkv, D]");
  check_tensor(op, "v_cache", v_cache, dtype, 4, "[num_pages, page_size, Hkv, D]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have k_cache's shape ", k_cache.sizes(),
              ", got ", v_cache.sizes());
  const int64_t Hq = q.size(1), num_pages = k_cache.size(0), P = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(P >= 1, op, ": k_cache page_size (dim 1) must be at least 1, got ", P);
  TORCH_CHECK(Hkv >= 1, op, ": k_cache Hkv (dim 2) must be at least 1, got ", Hkv);
  TORCH_CHECK(q.size(2) == k_cache.size(3), op, ": q head_dim (dim 2) must equal k_cache's ", k_cache.size(3),
              ", got ", q.size(2));
  TORCH_CHECK(Hq % Hkv == 0, op, ": q Hq (dim 1) must be a multiple of k_cache's Hkv = ", Hkv, ", got ", Hq);
  check_scales(op, k_cache, k_scale, v_scale);
  TORCH_CHECK(block_table.defined() &&
                  (block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong),
              op, ": block_table must be an int32 or int64 tensor, got ",
              block_table.defined() ? toString(block_table.scalar_type()) : "None");
  check_tensor(op, "block_table", block_table, block_table.scalar_type(), 2, "[B, max_pages]");
  check_tensor(op, "seq_lens", seq_lens, seq_lens.scalar_type(), 1, "[B]");
  const int64_t B = seq_lens.size(0), M = block_table.size(1);
  TORCH_CHECK(block_table.size(0) == B, op, ": block_table must have a row per sequence (B = ", B,
              " seq_lens), got ", block_table.size(0), " rows");
  auto lens = lengths("seq_lens", seq_lens, B), new_lens = lengths("q_lens", q_lens, B);
  constexpr int64_t most = std::numeric_limits<int64_t>::max();
  const int64_t capacity = M > most / P ? most : M * P;  // max_pages * page_size (saturated: P of a size-0 k_cache)
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= capacity, op, ": seq_lens[", b,
                "] must be in [0, max_pages * page_size = ", M, " * ", P, "], got ", lens[b]);
    TORCH_CHECK(new_lens[b] >= 0 && new_lens[b] <= lens[b], op, ": q_lens[", b, "] must be in [0, seq_lens[", b,
                "] = ", lens[b], "], got ", new_lens[b]);
    TORCH_CHECK(new_lens[b] <= q.size(0) - total, op, ": q_lens must add up to q's n (dim 0) = ", q.size(0),
                " tokens, got more by q_lens[", b, "] = ", new_lens[b]);  // total stays <= n: no overflow
    TORCH_CHECK(lens[b] <= most / std::max<int64_t>(Hq, 1), op, ": seq_lens[", b, "] times q's Hq (a row's scores)",
                " must be below 2^63, got ", lens[b], " * ", Hq);
    total += new_lens[b];
  }
  TORCH_CHECK(total == q.size(0), op, ": q_lens must add up to q's n (dim 0) = ", q.size(0), " tokens, got ", total);
  int64_t used = 0;  // the most pages a row uses: the columns of the table the kernel reads
  for (const int64_t len : lens) used = std::max(used, pages_used(len, P));
  auto table = block_table.narrow(1, 0, used).clone(at::MemoryFormat::Contiguous);  // the ids checked, then read
  if (table.scalar_type() == at::kInt)
    check_pages<int32_t>(table, lens, P, num_pages);
  else
    check_pages<int64_t>(table, lens, P, num_pages);
  return {lens, new_lens, table};
}

// The checks alone, `times` times over (bench serve --profile times them against the whole call).
void paged_attention_checks(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, torch::Tensor q_lens, int64_t times) {
  repeat_checks(times, [&] { check_paged_attention(q, k_cache, v_cache, block_table, seq_lens, q_lens); });
}

// A page scale read through its strides (any, 0 too); none for float32 pages.
struct PageScale {
  const float* p = nullptr;
  int64_t s0 = 0, s1 = 0;
  PageScale(const Scale& t) {
    if (t) p = t->data_ptr<float>(), s0 = t->stride(0), s1 = t->stride(1);
  }
  float at(int64_t page, int64_t g) const { return p[page * s0 + g * s1]; }
};

// The K or V row [D] of KV head g in slot `slot` of page `page`: float32 pages where it lies; 8-bit bytes as
// floats times the page's scale for g (one float32 multiply, the reference's product), into buf [D].
template <typename C>
static inline const float* kv_row(const C* cache, int64_t slot, int64_t page, int64_t g, int64_t Hkv, int64_t D,
                                  const PageScale& scale, float* buf) {
  const C* r = cache + (slot * Hkv + g) * D;
  if constexpr (std::is_same_v<C, float>) {
    return r;
  } else {
    const float s = scale.at(page, g);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(r[d]) * s;
    return buf;
  }
}

// C: the pages' element type (float, or an 8-bit one read through kv_row); T: the block table's.
template <typename T, typename C>
static void attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_table, const std::vector<int64_t>& lens,
                   const std::vector<int64_t>& new_lens, float sc, const PageScale& k_scale,
                   const PageScale& v_scale, torch::Tensor& out) {
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), B = int64_t(lens.size());
  const int64_t P = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv, M = block_table.size(1);
  const float* qs = q.data_ptr<float>();
  const C *ks = static_cast<const C*>(k_cache.data_ptr()), *vs = static_cast<const C*>(v_cache.data_ptr());
  const T* table = block_table.data_ptr<T>();
  float* os = out.data_ptr<float>();
  std::vector<int64_t> seq(n), seen(n);  // each token's sequence and the tokens it sees
  for (int64_t b = 0, row = 0; b < B; ++b)
    for (int64_t i = 0; i < new_lens[b]; ++i, ++row) seq[row] = b, seen[row] = lens[b] - new_lens[b] + i + 1;
  // The rows, longest first, each taken by whichever thread is free (their lengths differ: a split into equal
  // ranges of rows leaves one thread with the long ones, a prefill chunk's tokens all on the last).
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return seen[a] > seen[b]; });
  std::atomic<int64_t> next{0};  // the next entry of order not yet taken
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    std::vector<float> s, buf(D);  // [Hq, len]: scores, then probabilities; [D]: one dequantized row
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      const int64_t row = order[i], b = seq[row], len = seen[row];  // 1 <= len <= seq_lens[b] (checked)
      const T* pages = table + b * M;
      const float* qb = qs + row * Hq * D;
      float* ob = os + row * Hq * D;
      std::fill(ob, ob + Hq * D, 0.f);
      s.resize(Hq * len);
      for (int64_t t = 0; t < len; ++t) {  // scores: token t's K row [Hkv, D], read in its page
        const int64_t page = pages[t / P], slot = page * P + t % P;
        for (int64_t g = 0; g < Hkv; ++g) {
          const float* kh = kv_row(ks, slot, page, g, Hkv, D, k_scale, buf.data());
          for (int64_t h = g * G; h < (g + 1) * G; ++h) {  // query heads h of KV head g
            const float* qh = qb + h * D;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; ++d) acc += qh[d] * kh[d];
            s[h * len + t] = acc * sc;
          }
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
        const int64_t page = pages[t / P], slot = page * P + t % P;
        for (int64_t g = 0; g < Hkv; ++g) {
          const float* vh = kv_row(vs, slot, page, g, Hkv, D, v_scale, buf.data());
          for (int64_t h = g * G; h < (g + 1) * G; ++h) {
            const float p = s[h * len + t];
            float* oh = ob + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) oh[d] += p * vh[d];
          }
        }
      }
    }
  });
}

// attend<T, C> for the pages' dtype (checked: float32 or 8-bit).
template <typename T>
static void attend_pages(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& block_table, const std::vector<int64_t>& lens,
                         const std::vector<int64_t>& new_lens, float sc, const Scale& k_scale, const Scale& v_scale,
                         torch::Tensor& out) {
  const PageScale ks(k_scale), vs(v_scale);
  switch (k_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return attend<T, c10::Float8_e4m3fn>(q, k_cache, v_cache, block_table, lens, new_lens, sc, ks, vs, out);
    case at::kFloat8_e5m2:
      return attend<T, c10::Float8_e5m2>(q, k_cache, v_cache, block_table, lens, new_lens, sc, ks, vs, out);
    case at::kChar:
      return attend<T, int8_t>(q, k_cache, v_cache, block_table, lens, new_lens, sc, ks, vs, out);
    default:
      return attend<T, float>(q, k_cache, v_cache, block_table, lens, new_lens, sc, ks, vs, out);
  }
}

// q [n, Hq, D]: the new tokens of B sequences, sequence b's q_lens[b] after those of the ones before;
// its token i is its token seq_lens[b] - q_lens[b] + i and sees the tokens up to itself (causal);
// caches [num_pages, P, Hkv, D] float32 or 8-bit (float8_e4m3fn, float8_e5m2, int8: then k_scale, v_scale float32
// [num_pages, Hkv], byte x of page p, KV head h standing for float(x) * scale[p, h]), block_table [B, max_pages],
// seq_lens and q_lens [B] (int32 or int64), any strides (non-contiguous ones are copied, the scales read through
// theirs). Returns out [n, Hq, D]. check_paged_attention says what it refuses.
torch::Tensor paged_attention_scaled(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor q_lens,
                                     double scale, Scale k_scale, Scale v_scale) {
  auto [lens, new_lens, table] =
      check_paged_attention(q, k_cache, v_cache, block_table, seq_lens, q_lens, k_scale, v_scale);
  if (q.numel() == 0) return torch::empty(q.sizes(), q.options());  // no token, head or dimension: nothing to read
  q = q.contiguous(), k_cache = k_cache.contiguous(), v_cache = v_cache.contiguous();
  auto out = torch::empty_like(q);
  const float sc = static_cast<float>(scale);
  if (table.scalar_type() == at::kInt)
    attend_pages<int32_t>(q, k_cache, v_cache, table, lens, new_lens, sc, k_scale, v_scale, out);
  else
    attend_pages<int64_t>(q, k_cache, v_cache, table, lens, new_lens, sc, k_scale, v_scale, out);
  return out;
}

// paged_attention_scaled on float32 pages (no scales).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor q_lens, double scale) {
  return paged_attention_scaled(q, k_cache, v_cache, block_table, seq_lens, q_lens, scale, {}, {});
}
