// Paged decode attention over FP8 KV pages, for the CPU: the decode rows of a step in one call.
//
// Why a kernel: in torch ops a decode step's attention gathers each row's pages, widens every
// FP8 byte to float32 in a new tensor, multiplies [3 x 64] queries by [64 x T] keys as a batch
// of tiny matrices and writes the probabilities back out: a third of a batch-8 SmolLM2 step on
// the dev VM (~30 of ~100 ms, torch profiler). Here each decode row streams its pages once,
// a 16-token block at a time: the block's K and V bytes (all KV heads: one contiguous run) are
// widened into a tile that stays in L1, scored against every query head, and folded into the output.
//
// Semantics are engine/cpu_attention.py's `_decode` (and engine/attention.py's reference):
// score = (q . k_fp8) * k_scale * softmax_scale over the row's first context_len keys, softmax,
// out = sum_t p_t * v_scale_t * v_fp8_t. Only the float summation order differs.
//
// FP8 (e4m3fn) to float32 without a table: the 7 exponent/mantissa bits, shifted to float32's
// bits 20..26, read as a float32 of 2**-120 times the FP8 value (e4m3 subnormals land on
// float32 normals' or subnormals' bits alike), so one multiply by 2**120 gives the value
// exactly; the sign goes to bit 31. Integer and float ops only: the compiler vectorizes it.
// The pool never holds NaN (writes clamp), so e4m3's NaN encoding is not handled.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

namespace {

constexpr float kTwoPow120 = 1.329227995784916e36f;  // 2**120

inline void widen_fp8(const uint8_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    uint32_t b = src[d];
    uint32_t bits = (b & 0x7Fu) << 20;
    float f;
    std::memcpy(&f, &bits, 4);
    f *= kTwoPow120;
    uint32_t out;
    std::memcpy(&out, &f, 4);
    out |= (b & 0x80u) << 24;
    std::memcpy(&dst[d], &out, 4);
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
  const int64_t G = Hq / H, W = tables.size(1);
  const int64_t page_stride = pages.stride(0), scale_stride = scales.stride(0);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const uint8_t* pp = pages.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(softmax_scale);

  // one job per row: a block's K (then V) bytes for all KV heads are one contiguous 3 KB run
  // (SmolLM2), widened into a tile once and read from L1 by every head
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(bs * H * D), scores, acc(Hq * D);
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
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qi + (h * G + g) * D;
            float* s = scores.data() + (h * G + g) * ctx + t0;
            for (int64_t t = 0; t < m; ++t) {
              const float* kt = tile.data() + (t * H + h) * D;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
              s[t] = dot * ks[t * H + h] * fscale;
            }
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
        const float inv = 1.f / sum;
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
            for (int64_t t = 0; t < m; ++t) {
              const float w = s[t] * vs[t * H + h];
              const float* vt = tile.data() + (t * H + h) * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += w * vt[d];
            }
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
