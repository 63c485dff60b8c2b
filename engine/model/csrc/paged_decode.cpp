// Paged decode attention over FP8 KV pages, for the CPU: the decode rows of a step in one call.
//
// Why a kernel: in torch ops a decode step's attention gathers each row's pages, widens every
// FP8 byte to float32 in a new tensor, multiplies [3 x 64] queries by [64 x T] keys as a batch
// of tiny matrices and writes the probabilities back out: a third of a batch-8 SmolLM2 step on
// the dev VM (~30 of ~100 ms, torch profiler). Here each decode row streams its pages once,
// a 16-token block at a time: the block's K and V bytes (all KV heads: one contiguous run) are
// widened into a tile that stays in L1, scored against every query head, and folded into the output.
//
// Semantics are engine/model/cpu_attention.py's `_decode` (and engine/model/attention.py's
// reference): score = (q . k_fp8) * k_scale * softmax_scale over the row's first context_len
// keys, softmax, out = sum_t p_t * v_scale_t * v_fp8_t. Only the float summation order differs.
//
// FP8 (e4m3fn) to float32: as in fp8_linear.cpp, the byte's bits moved to float16's places are
// float16's bits of value / 256, which F16C widens exactly (the 256 joins the scales); without
// AVX-512, exponent and mantissa are placed in float32's bits directly (normals) or the mantissa
// converted and scaled (subnormals). Neither makes a subnormal float, so the kernel runs with
// subnormals flushed to zero (x86's FTZ and DAZ, for this call's threads only): an earlier
// widening made float32 subnormals of every e4m3 subnormal, and a tiny probability is one too;
// each cost a microcode assist, and a block with a few of them ran 4.5x slower (1.8 ms against
// 0.4 a layer at 8 rows x 272 tokens on the dev VM). What is flushed is below 1e-38: nothing a
// softmax-weighted sum of values can show.
//
// Scores, AVX-512: 16 tokens' dot products at once, each as 16-lane partial sums, folded into one
// vector by a transpose-and-add tree (30 shuffles for 16 sums, against a horizontal sum each).
// The pool never holds NaN (writes clamp), so e4m3's NaN encoding is not handled.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PDSERVE_AVX512 1
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "cpu_math.h"

namespace {

// x86: subnormals flushed to zero (FTZ, DAZ) while a job runs on this thread, the old mode put back
struct FlushSubnormals {
#if defined(__SSE__)
  unsigned old = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(old | 0x8040u); }
  ~FlushSubnormals() { _mm_setcsr(old); }
#endif
};

#ifdef PDSERVE_AVX512
constexpr float kWiden = 256.0f;  // widened values are value / 256

inline __m512 widen16(const uint8_t* src) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i h = _mm256_slli_epi16(_mm256_add_epi16(b, _mm256_and_si256(b, _mm256_set1_epi16(0x80))), 7);
  return _mm512_cvtph_ps(h);
}

inline void widen_fp8(const uint8_t* src, float* dst, int64_t n) {  // n: a multiple of 16
  for (int64_t d = 0; d < n; d += 16) _mm512_storeu_ps(dst + d, widen16(src + d));
}

// s[t] = (q . k_t) * scale[t] for the block's m <= 16 tokens; k_t = tile + t * ld, DC chunks of 16
template <int DC>
inline void block_scores(const float* q, const float* tile, int64_t ld, int64_t m, const float* scale, float* s) {
  __m512 qv[DC], acc[16];
  for (int c = 0; c < DC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int t = 0; t < 16; ++t) {
    acc[t] = _mm512_setzero_ps();
    if (t < m)
      for (int c = 0; c < DC; ++c) acc[t] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(tile + t * ld + 16 * c), acc[t]);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << m) - 1u);
  _mm512_mask_storeu_ps(s, keep, _mm512_mul_ps(pdserve::sum16(acc), _mm512_maskz_loadu_ps(keep, scale)));
}

// a += sum_t w[t] * v_t for the block's m tokens; v_t = tile + t * ld, DC chunks of 16
template <int DC>
inline void block_values(const float* w, const float* tile, int64_t ld, int64_t m, float* a) {
  __m512 acc[DC];
  for (int c = 0; c < DC; ++c) acc[c] = _mm512_loadu_ps(a + 16 * c);
  for (int64_t t = 0; t < m; ++t) {
    const __m512 wt = _mm512_set1_ps(w[t]);
    for (int c = 0; c < DC; ++c) acc[c] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(tile + t * ld + 16 * c), acc[c]);
  }
  for (int c = 0; c < DC; ++c) _mm512_storeu_ps(a + 16 * c, acc[c]);
}
#else
constexpr float kWiden = 1.0f;

inline void widen_fp8(const uint8_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    const uint32_t b = src[d], e = (b >> 3) & 0xFu, m = b & 7u;
    // normals: exponent rebiased (7 -> 127) into float32's bits; subnormals: m * 2**-9
    const uint32_t bits = ((e + 120u) << 23) | (m << 20);
    float normal;
    std::memcpy(&normal, &bits, 4);
    const float v = e ? normal : static_cast<float>(m) * 0.001953125f;
    dst[d] = (b & 0x80u) ? -v : v;
  }
}
#endif

// the block's m scores of query head q against KV head h's keys (generic: any D)
inline void scores_generic(const float* q, const float* tile, int64_t ld, int64_t D, int64_t m, const float* scale,
                           float* s) {
  for (int64_t t = 0; t < m; ++t) {
    const float* kt = tile + t * ld;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kt[d];
    s[t] = dot * scale[t];
  }
}

inline void values_generic(const float* w, const float* tile, int64_t ld, int64_t D, int64_t m, float* a) {
  for (int64_t t = 0; t < m; ++t) {
    const float wt = w[t];
    const float* vt = tile + t * ld;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] += wt * vt[d];
  }
}

// q [n, Hq, D] f32; pages [blocks, 2, bs, H, D] fp8 bytes (uint8, any block stride, the rest
// contiguous); scales [blocks, 2, bs, H] f32 (any block stride, the rest contiguous);
// tables [n, W] int64; lens [n] int32. Returns out [n, Hq, D] f32.
torch::Tensor paged_decode_fp8(torch::Tensor q, torch::Tensor pages, torch::Tensor scales, torch::Tensor tables,
                               torch::Tensor lens, double softmax_scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [n, Hq, D] float32");
  TORCH_CHECK(pages.dim() == 5 && pages.scalar_type() == torch::kUInt8, "pages must be [blocks, 2, bs, H, D] uint8");
  TORCH_CHECK(scales.dim() == 4 && scales.scalar_type() == torch::kFloat32, "scales must be [blocks, 2, bs, H] f32");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt32, "tables int64, lens int32");
  q = q.contiguous();
  tables = tables.contiguous();
  lens = lens.contiguous();
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = pages.size(2), H = pages.size(3);
  TORCH_CHECK(pages.size(4) == D && Hq % H == 0, "head shapes disagree");
  TORCH_CHECK(pages.stride(4) == 1 && pages.stride(3) == D && pages.stride(2) == H * D && pages.stride(1) == bs * H * D,
              "pages must be contiguous within a block");
  TORCH_CHECK(scales.stride(3) == 1 && scales.stride(2) == H && scales.stride(1) == bs * H,
              "scales must be contiguous within a block");
  const int64_t G = Hq / H, W = tables.size(1), ld = H * D;
  const int64_t page_stride = pages.stride(0), scale_stride = scales.stride(0);
#ifdef PDSERVE_AVX512
  // the vector paths: 16-token blocks, heads of 64 or 128 (the widening runs 16 bytes at a time)
  const bool vec = bs == 16 && (D == 64 || D == 128);
#else
  const bool vec = false;
#endif
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const uint8_t* pp = pages.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float kscale = static_cast<float>(softmax_scale) * kWiden;

  // one job per row: a block's K (then V) bytes for all KV heads are one contiguous 3 KB run
  // (SmolLM2), widened into a tile once and read from L1 by every head
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    FlushSubnormals ftz;
    std::vector<float> tile(bs * H * D), scores, acc(Hq * D), scale(H * bs), weight(bs);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t ctx = lp[i];
      TORCH_CHECK(ctx >= 1 && (ctx + bs - 1) / bs <= W, "context length outside the block table");
      scores.assign(Hq * ctx, 0.f);
      const float* qi = qp + i * Hq * D;  // query head h*G + g uses KV head h
      for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
        const int64_t blk = tp[i * W + t0 / bs], m = std::min(bs, ctx - t0);
        if (t0 + bs < ctx) {
          // the next block is anywhere in the pool (and a cold decode step reads the pool from
          // DRAM): ask for all its K and V lines and its scales now, while this block computes;
          // the V pass below finds them in L2
          const int64_t nb = tp[i * W + t0 / bs + 1];
          const uint8_t* next = pp + nb * page_stride;
          for (int64_t b = 0; b < 2 * bs * H * D; b += 64) __builtin_prefetch(next + b);
          const float* next_s = sp + nb * scale_stride;
          for (int64_t b = 0; b < 2 * bs * H; b += 16) __builtin_prefetch(next_s + b);
        }
        const uint8_t* kb = pp + blk * page_stride;  // K: [bs, H, D]
        const float* ks = sp + blk * scale_stride;   // K scales: [bs, H]
        widen_fp8(kb, tile.data(), m * H * D);
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t t = 0; t < m; ++t) scale[h * bs + t] = ks[t * H + h] * kscale;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qi + (h * G + g) * D;
            float* s = scores.data() + (h * G + g) * ctx + t0;
#ifdef PDSERVE_AVX512
            if (vec) {
              if (D == 64) block_scores<4>(qg, tile.data() + h * D, ld, m, scale.data() + h * bs, s);
              else block_scores<8>(qg, tile.data() + h * D, ld, m, scale.data() + h * bs, s);
              continue;
            }
#endif
            scores_generic(qg, tile.data() + h * D, ld, D, m, scale.data() + h * bs, s);
          }
        }
      }
      // softmax per query head (max-subtracted, as torch's)
      for (int64_t j = 0; j < Hq; ++j) {
        float* s = scores.data() + j * ctx;
        float mx = s[0];
        for (int64_t t = 1; t < ctx; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; ++t) {
          s[t] = pdserve::exp_nonpositive(s[t] - mx);
          sum += s[t];
        }
        const float inv = kWiden / sum;  // the values' widening scale folded in here
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
      }
      // out = sum_t p_t * v_scale_t * v_t, one block of values at a time
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
        const int64_t blk = tp[i * W + t0 / bs], m = std::min(bs, ctx - t0);
        const uint8_t* vb = pp + blk * page_stride + bs * H * D;  // V: [bs, H, D]
        const float* vs = sp + blk * scale_stride + bs * H;       // V scales: [bs, H]
        widen_fp8(vb, tile.data(), m * H * D);
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t g = 0; g < G; ++g) {
            float* a = acc.data() + (h * G + g) * D;
            const float* s = scores.data() + (h * G + g) * ctx + t0;
            for (int64_t t = 0; t < m; ++t) weight[t] = s[t] * vs[t * H + h];
#ifdef PDSERVE_AVX512
            if (vec) {
              if (D == 64) block_values<4>(weight.data(), tile.data() + h * D, ld, m, a);
              else block_values<8>(weight.data(), tile.data() + h * D, ld, m, a);
              continue;
            }
#endif
            values_generic(weight.data(), tile.data() + h * D, ld, D, m, a);
          }
        }
      }
      std::memcpy(op + i * Hq * D, acc.data(), Hq * D * sizeof(float));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_decode_fp8(Tensor q, Tensor pages, Tensor scales, Tensor tables, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_decode_fp8", &paged_decode_fp8); }
