// The flat loop's small operations (paged_ref.fast.cpu_ops): RMSNorm with its residual add, RoPE in place,
// SwiGLU. vexp: paged_ref/csrc/vexp.h, compiled before this file (paged_ref.native.build).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <tuple>

// h [..., C] (contiguous) += y (when given): returns (h, w * h / rms(h)), the second a new tensor.
std::tuple<torch::Tensor, torch::Tensor> add_norm(torch::Tensor h, c10::optional<torch::Tensor> y, torch::Tensor w,
                                                  double eps) {
  const int64_t C = h.size(-1), N = h.numel() / C;
  TORCH_CHECK(!y || y->numel() == h.numel(), "add_norm: y must have h's shape ", h.sizes(), ", got ", y->sizes());
  auto out = torch::empty_like(h);
  auto ys = y ? y->contiguous().view({N, C}) : torch::Tensor();
  float *hp = h.view({N, C}).data_ptr<float>(), *op = out.data_ptr<float>();
  const float *yp = y ? ys.data_ptr<float>() : nullptr, *wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
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

// x [B, T, H, D] (any strides but the last) rotated in place by cos, sin [B, T, 1, D] (contiguous): the
// first half of each head's row pairs with the second, as transformers' rotate_half. Returns x.
torch::Tensor rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * x.size(1) * x.size(3) && sin.numel() == cos.numel(),
              "rotate: x [B, T, H, D] (last dimension contiguous) and contiguous cos, sin [B, T, 1, D]; got x ",
              x.sizes(), ", cos ", cos.sizes());
  const int64_t T = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, x.size(0) * T, 16, [&](int64_t begin, int64_t end) {
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

// silu(gate) * up: gate, up [..., I] (rows of any stride) -> a new [..., I].
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  const int64_t I = gate.size(-1), N = gate.numel() / I;
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up must have one shape, got ", gate.sizes(), up.sizes());
  auto g = gate.reshape({N, I}), u = up.reshape({N, I});
  auto out = torch::empty(gate.sizes(), gate.options());
  const float *gp = g.data_ptr<float>(), *upp = u.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = g.stride(0), us = u.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
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
}
