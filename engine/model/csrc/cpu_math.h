// Small float helpers shared by pdserve's CPU kernels (engine/csrc/).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve {

// exp(x) for the softmax's x <= 0, in ops the compiler vectorizes (a scalar expf per score was
// half the kernel's time): Cephes' expf, x = n ln2 + r, exp(r) by a degree-6 polynomial, 2**n
// from the exponent bits; within 2 ulp of expf. Below -87 it returns ~1e-38 instead of 0 or a
// subnormal, which no softmax sum (at least 1, from the max's own term) can tell apart.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

}  // namespace pdserve
