// Small float helpers shared by pdserve's CPU kernels (engine/csrc/).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
// Sixteen horizontal sums at once: lane t of the result = the sum of v[t]'s 16 lanes. A
// transpose-and-add tree, 30 shuffles and 15 adds for all 16 (a horizontal sum each costs ~8
// instructions on a dependency chain). Used where a kernel holds 16 dot products' partial sums.
inline __m512 sum16(const __m512* v) {
  __m512 z[8], w[4], u[2];
  for (int i = 0; i < 8; ++i)  // halves: z[i] = v[2i]'s 8 partial sums, then v[2i+1]'s
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: w[i] quarter k = 4 partial sums of v[4i + k]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // u[i] quarter k: 2 sums of v[8i + k], then 2 of v[8i + 4 + k]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  // quarter k: the sums of v[k], v[4 + k], v[8 + k], v[12 + k]; lane 4k + j holds v[4j + k]'s
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}
#endif

}  // namespace pdserve
