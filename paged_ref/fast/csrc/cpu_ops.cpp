// The flat loop's small operations (paged_ref.fast.cpu_ops): RMSNorm with its residual add, RoPE in place,
// SwiGLU. vexp: paged_ref/csrc/vexp.h, check_tensor: paged_ref/csrc/checks.h, both compiled before this file
// (paged_ref.native.build). Each op checks its arguments first (check_*: also registered alone, as *_checks
// running them a given number of times, for bench serve --profile to time).
#include <torch/extension.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <tuple>

// Rows per thread's share of a loop of rows of ``row`` elements: at least 32,768 elements (ATen's GRAIN_SIZE, as
// torch's own ops), so that a decode step's few short rows run on the calling thread, not in a parallel region.
static int64_t grain(int64_t row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row)); }

// t contiguous (t itself where it is), or a contiguous copy where it shares memory with `written`, an argument
// the op writes in place: the op reads t's values as they were when it was called.
static torch::Tensor apart(const torch::Tensor& t, const torch::Tensor& written) {
  const bool shared = t.is_alias_of(written) && at::get_overlap_status(t, written) != at::MemOverlapStatus::No;
  return shared ? t.clone(at::MemoryFormat::Contiguous) : t.contiguous();
}

// t, written in place: its version counter bumped, as torch's in-place ops do, so that autograd refuses a backward
// through a value of t it saved before the write (an inference tensor has none).
static void written(const torch::Tensor& t) {
  auto* impl = t.unsafeGetTensorImpl();
  if (impl->version_counter().enabled()) impl->bump_version();
}

// h float32 [..., C], contiguous (written in place); y (when given) h's shape, any strides; w float32 [C].
void check_add_norm(const torch::Tensor& h, const c10::optional<torch::Tensor>& y, const torch::Tensor& w) {
  check_tensor("add_norm", "h", h, at::kFloat, -1, "");
  TORCH_CHECK(h.dim() >= 1, "add_norm: h must be [..., C] (at least 1 dimension), got shape ", h.sizes());
  TORCH_CHECK(h.is_contiguous(), "add_norm: h is written in place and must be contiguous, got shape ", h.sizes(),
              ", strides ", h.strides());
  if (y) {
    check_tensor("add_norm", "y", *y, at::kFloat, -1, "");
    TORCH_CHECK(y->sizes() == h.sizes(), "add_norm: y must have h's shape ", h.sizes(), ", got ", y->sizes());
  }
  check_tensor("add_norm", "w", w, at::kFloat, 1, "[C]");
  TORCH_CHECK(w.size(0) == h.size(-1), "add_norm: w must have h's C = ", h.size(-1), " entries, got ", w.size(0));
}

// h [..., C] += y (when given): returns (h, w * h / rms(h)), the second a new tensor; y and w read as they were when
// called, where they share h's memory too.
std::tuple<torch::Tensor, torch::Tensor> add_norm(torch::Tensor h, c10::optional<torch::Tensor> y, torch::Tensor w,
                                                  double eps) {
  check_add_norm(h, y, w);
  written(h);
  auto out = torch::empty_like(h);
  const int64_t C = h.size(-1), N = C ? h.numel() / C : 0;
  if (N == 0) return {h, out};  // no row, or rows of no element (their norm is empty too)
  auto ys = y ? apart(*y, h) : torch::Tensor();
  auto ws = apart(w, h);
  float *hp = h.data_ptr<float>(), *op = out.data_ptr<float>();
  const float *yp = y ? ys.data_ptr<float>() : nullptr, *wp = ws.data_ptr<float>();
  at::parallel_for(0, N, grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float *r = hp + n * C, *o = op + n * C;
      if (yp) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) r[c] += yp[n * C + c];
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < C; ++c) ss += r[c] * r[c];
      const float inv = 1.f / std::sqrt(ss / C + static_cast<float>(eps));
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = wp[c] * (r[c] * inv);
    }
  });
  return {h, out};
}

// x float32 [B, T, H, D], D even, unit last stride and no two elements in one place (any other strides: it is
// written in place); cos, sin float32 [B, T, 1, D], any strides (read as they were when called, where they share x's
// memory too).
void check_rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_tensor("rotate", "x", x, at::kFloat, 4, "[B, T, H, D]");
  TORCH_CHECK(x.size(3) % 2 == 0, "rotate: x head_dim D (dim 3) must be even, got ", x.size(3));
  TORCH_CHECK(x.numel() == 0 || x.size(3) == 1 || x.stride(3) == 1,
              "rotate: x is written in place and must have a unit last stride, got strides ", x.strides());
  check_no_overlap("rotate", "x", x);
  const std::vector<int64_t> shape = {x.size(0), x.size(1), 1, x.size(3)};
  for (auto [name, t] : {std::pair<const char*, const torch::Tensor&>{"cos", cos}, {"sin", sin}}) {
    check_tensor("rotate", name, t, at::kFloat, 4, "[B, T, 1, D]");
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "rotate: ", name, " must be [B, T, 1, D] = ", shape,
                " (x's B, T and D), got ", t.sizes());
  }
}

// x [B, T, H, D] rotated in place by cos, sin [B, T, 1, D]: the first half of each head's row pairs with the
// second, as transformers' rotate_half. Returns x.
torch::Tensor rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_rotate(x, cos, sin);
  written(x);
  auto cs = apart(cos, x), ss = apart(sin, x);
  const int64_t T = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  if (x.numel() == 0) return x;
  float* xp = x.data_ptr<float>();
  const float *cp = cs.data_ptr<float>(), *sp = ss.data_ptr<float>();
  at::parallel_for(0, x.size(0) * T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float *c = cp + n * D, *s = sp + n * D;
      for (int64_t h = 0; h < H; ++h) {
        float* r = xp + (n / T) * sb + (n % T) * st + h * sh;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = r[d], b = r[d + half];
          r[d] = a * c[d] - b * s[d];
          r[d + half] = b * c[d + half] + a * s[d + half];
        }
      }
    }
  });
  return x;
}

// gate, up float32 [..., I] of one shape, any strides.
void check_silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  check_tensor("silu_mul", "gate", gate, at::kFloat, -1, "");
  check_tensor("silu_mul", "up", up, at::kFloat, -1, "");
  TORCH_CHECK(gate.dim() >= 1, "silu_mul: gate must be [..., I] (at least 1 dimension), got shape ", gate.sizes());
  TORCH_CHECK(up.sizes() == gate.sizes(), "silu_mul: up must have gate's shape ", gate.sizes(), ", got ", up.sizes());
}

// silu(gate) * up -> a new [..., I].
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  check_silu_mul(gate, up);
  auto out = torch::empty(gate.sizes(), gate.options());
  const int64_t I = gate.size(-1), N = I ? gate.numel() / I : 0;
  if (N == 0) return out;
  auto g = gate.reshape({N, I}), u = up.reshape({N, I});  // views where the strides allow
  if (g.stride(1) != 1) g = g.contiguous();
  if (u.stride(1) != 1) u = u.contiguous();
  const float *gp = g.data_ptr<float>(), *upp = u.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = g.stride(0), us = u.stride(0);
  at::parallel_for(0, N, grain(I), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) op[n * I + i] = gp[n * gs + i] / (1.f + vexp(-gp[n * gs + i])) * upp[n * us + i];
    }
  });
  return out;
}

TORCH_LIBRARY(paged_ref_cpu, m) {  // dispatcher ops: a profile sees them (paged_ref_cpu::add_norm, ...)
  m.def("add_norm(Tensor(a!) h, Tensor? y, Tensor w, float eps) -> (Tensor(a!), Tensor)", &add_norm);
  m.def("rotate(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)", &rotate);
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor", &silu_mul);
  m.def("add_norm_checks(Tensor h, Tensor? y, Tensor w, int times) -> ()",
        [](torch::Tensor h, c10::optional<torch::Tensor> y, torch::Tensor w, int64_t times) {
          repeat_checks(times, [&] { check_add_norm(h, y, w); });
        });
  m.def("rotate_checks(Tensor x, Tensor cos, Tensor sin, int times) -> ()",
        [](torch::Tensor x, torch::Tensor c, torch::Tensor s, int64_t times) {
          repeat_checks(times, [&] { check_rotate(x, c, s); });
        });
  m.def("silu_mul_checks(Tensor gate, Tensor up, int times) -> ()",
        [](torch::Tensor g, torch::Tensor u, int64_t times) { repeat_checks(times, [&] { check_silu_mul(g, u); }); });
}
