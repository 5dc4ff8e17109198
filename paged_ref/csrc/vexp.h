// vexp(x), a float exp the compiler vectorizes (std::exp is a scalar call): 2^n e^r, n the nearest integer
// to x / ln 2, e^r to 1e-7 by its Taylor series (|r| <= ln(2) / 2); 0 below -87.3 (where e^x leaves float's
// normal range, 1.2e-38: a softmax weight that small is 0), +inf from 88.377 on (n = 128; float's own e^x is finite
// up to 88.72: silu_mul's silu(g) is -0 for g <= -88.377, where torch's is about -3.7e-37), NaN for NaN.
// paged_ref.native.build compiles it before a source that names it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float vexp(float x) {
  const float y = std::max(-87.3f, std::min(88.7f, x));  // a NaN x: 88.7 here (a defined cast below), NaN out
  const float n = std::nearbyint(y * 1.44269504f), r = (y - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.f / 5040;
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + c;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3f ? 0.f : x == x ? p * scale : x;
}
