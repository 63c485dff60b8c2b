// A few-row GEMM over FP8 weights, for the CPU: y = x @ (w * scale).T for a decode step's rows.
//
// Why a kernel: a decode step multiplies a handful of rows by every weight once, so it is bound
// by the bytes of weight it reads. oneDNN multiplies fp32 copies of the FP8 weights (4 bytes a
// weight: 0.54 GB a SmolLM2 step, read from DRAM every step); this kernel reads the FP8 bytes
// themselves (1 byte a weight) and widens them in registers, a few rows of weights at a time
// into a tile that stays in L1, where every row of x is multiplied by it.
//
// Arithmetic: each output is one fp32 dot product of x's row with the widened weight row, then
// times the row's scale, the same for any number of rows M (a row's result does not depend on
// its batch: no blocking over K that changes with M). Epilogues: none, + other (the residual),
// or SwiGLU over the [gate; up] halves, silu(gate) * up.
//
// FP8 (e4m3fn) to float32: the 7 exponent/mantissa bits and the sign, moved to float16's places,
// are float16's bits of the value / 256 (e4m3 subnormals land on float16 subnormals), which the
// F16C instruction widens to float32 exactly, subnormals included, at full speed; the 256 joins
// the row's scale. Without F16C the same value is computed in scalar code.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) || defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_SIMD 1
#endif

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_math.h"

namespace {

inline float fp8_over_256(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  const float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return ((b & 0x80) ? -v : v) / 256.0f;
}

#ifdef PDSERVE_SIMD
// FP8 bytes (as 16-bit lanes) -> float16 bits of value / 256: the 7 low bits go up by 7 (to
// float16's exponent and mantissa), the sign from bit 7 to bit 15: (b + (b & 0x80)) << 7 moves
// both at once (adding the sign bit to itself carries it to bit 8)
#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 lanes: AVX-512 (CPUs with two 512-bit FMA units multiply twice as fast as with AVX2)
struct Vec {
  using T = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMR = 4;  // rows of x per pass over a tile: 4 x 4 accumulators of 32 registers
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
  static T widen(const uint8_t* src) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m256i h = _mm256_slli_epi16(_mm256_add_epi16(b, _mm256_and_si256(b, _mm256_set1_epi16(0x80))), 7);
    return _mm512_cvtph_ps(h);
  }
};
#else
// 8 lanes: AVX2 with F16C and FMA
struct Vec {
  using T = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMR = 2;  // 4 x 2 accumulators + loads fit 16 registers
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static T widen(const uint8_t* src) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_add_epi16(b, _mm_and_si128(b, _mm_set1_epi16(0x80))), 7));
  }
};
#endif
constexpr int64_t kLanes = Vec::kLanes;
constexpr int64_t kMR = Vec::kMR;
#else
constexpr int64_t kLanes = 1;
constexpr int64_t kMR = 2;
#endif

constexpr int64_t kNR = 4;     // weight rows widened per tile (4 rows of K floats stay in L1)
constexpr int64_t kAhead = 4;  // tiles prefetched ahead (~9 KB of SmolLM2's weights)

// K FP8 bytes -> K floats of value / 256
inline void widen_row(const uint8_t* src, float* dst, int64_t K) {
  int64_t k = 0;
#ifdef PDSERVE_SIMD
  for (; k + kLanes <= K; k += kLanes) Vec::store(dst + k, Vec::widen(src + k));
#endif
  for (; k < K; ++k) dst[k] = fp8_over_256(src[k]);
}

// How a dot product reads NR rows of weights (each K long): floats already widened into a tile,
// or the FP8 bytes themselves, widened in registers as they are used (for one or two rows of x,
// storing a widened tile and reading it back costs more than widening again).
struct TileRows {
  const float* w;
  int64_t K;
#ifdef PDSERVE_SIMD
  Vec::T vec(int j, int64_t k) const { return Vec::load(w + j * K + k); }
#endif
  float at(int j, int64_t k) const { return w[j * K + k]; }
};

struct Fp8Rows {
  const uint8_t* w;
  int64_t K;
#ifdef PDSERVE_SIMD
  Vec::T vec(int j, int64_t k) const { return Vec::widen(w + j * K + k); }
#endif
  float at(int j, int64_t k) const { return fp8_over_256(w[j * K + k]); }
};

// dots[i * NR + j] = x[i] . w[j] for MR rows of x (stride ldx) and NR rows of w. Either way of reading
// w sums the same way (lane k % kLanes, in k order; then the lanes; then the tail), so a row's result
// is the same whichever path its batch size takes.
template <int NR, int MR, typename Rows>
inline void dot_rows(const float* x, int64_t ldx, const Rows& w, int64_t K, float* dots) {
  int64_t k = 0;
#ifdef PDSERVE_SIMD
  typename Vec::T acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec::zero();
  for (; k + kLanes <= K; k += kLanes) {
    typename Vec::T wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = w.vec(j, k);
    for (int i = 0; i < MR; ++i) {
      const auto xv = Vec::load(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = Vec::fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) dots[i * NR + j] = Vec::sum(acc[i][j]);
#else
  for (int i = 0; i < MR * NR; ++i) dots[i] = 0.f;
#endif
  for (; k < K; ++k)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) dots[i * NR + j] += x[i * ldx + k] * w.at(j, k);
}

template <int NR>
inline void rows_times_tile(const float* x, int64_t M, int64_t K, const float* w, float* dots) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) dot_rows<NR, kMR>(x + m * K, K, TileRows{w, K}, K, dots + m * NR);
  for (; m < M; ++m) dot_rows<NR, 1>(x + m * K, K, TileRows{w, K}, K, dots + m * NR);
}

inline float silu(float v) {
  const float e = pdserve::exp_nonpositive(-std::fabs(v));  // sigmoid from exp(-|v|): never overflows
  return v * (v >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
}

// x [M, K] f32; w [N, K] FP8 bytes (uint8); scale [N] f32; other [M, N] f32 (post 1);
// post: 0 none, 1 add other, 2 SwiGLU (N even; out [M, N / 2]).
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> other,
                         int64_t post) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be [N, K] uint8");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == w.size(0), "scale must be [N] float32");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(post >= 0 && post <= 2, "post must be 0 (none), 1 (add) or 2 (swiglu)");
  x = x.contiguous();
  scale = scale.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* op = nullptr;
  if (post == 1) {
    TORCH_CHECK(other.has_value() && other->sizes() == y.sizes() && other->scalar_type() == torch::kFloat32,
                "post add needs other [M, N] float32");
    *other = other->contiguous();
    op = other->data_ptr<float>();
  }
  TORCH_CHECK(post != 2 || N % 2 == 0, "swiglu needs an even N");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kNR - 1) / kNR;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kNR * K), dots(M * kNR);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kNR, nr = std::min(kNR, N - n0);
      // the weights stream from DRAM once per step: ask for the tile kAhead tiles on now, so its
      // bytes arrive while this one computes (without it one thread read ~4 GB/s, a third of
      // what the memory gives it)
      if (t + kAhead < end) {
        const uint8_t* next = wp + (n0 + kAhead * kNR) * K;
        for (int64_t b = 0; b < kNR * K; b += 64) __builtin_prefetch(next + b);
      }
      if (nr == kNR && M <= 2) {  // few rows: widen in registers, no tile
        if (M == 1) dot_rows<kNR, 1>(xp, K, Fp8Rows{wp + n0 * K, K}, K, dots.data());
        else dot_rows<kNR, 2>(xp, K, Fp8Rows{wp + n0 * K, K}, K, dots.data());
        goto epilogue;
      }
      for (int64_t j = 0; j < nr; ++j) widen_row(wp + (n0 + j) * K, tile.data() + j * K, K);
      if (nr == kNR) {
        rows_times_tile<kNR>(xp, M, K, tile.data(), dots.data());
      } else {  // the last rows of an N that is not a multiple of kNR, one at a time
        for (int64_t j = 0; j < nr; ++j) {
          std::vector<float> one(M);
          rows_times_tile<1>(xp, M, K, tile.data() + j * K, one.data());
          for (int64_t m = 0; m < M; ++m) dots[m * kNR + j] = one[m];
        }
      }
    epilogue:
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nr; ++j) {
          const int64_t n = n0 + j;
          const float v = dots[m * kNR + j] * (sp[n] * 256.0f);
          yp[m * N + n] = op ? op[m * N + n] + v : v;
        }
    }
  });
  if (post != 2) return y;
  const int64_t H = N / 2;
  torch::Tensor out = torch::empty({M, H}, x.options());
  float* outp = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < H; ++h) outp[m * H + h] = silu(yp[m * N + h]) * yp[m * N + H + h];
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("fp8_linear(Tensor x, Tensor w, Tensor scale, Tensor? other, int post) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("fp8_linear", &fp8_linear); }
