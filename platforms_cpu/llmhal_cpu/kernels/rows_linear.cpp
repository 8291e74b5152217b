// y = x @ W.T (+ bias) for the few rows of a decode step (llmhal_cpu/kernels/rows_linear.py).
//
// At 1-8 rows a linear layer is a matrix-vector product bound by reading its weight; a GEMM
// library adds a per-call cost (and oneDNN needs its weight in a packed layout that only its own
// calls can read). Here each weight row is streamed once for all rows of x (dot_rows.h: float32
// accumulation, bfloat16 widened in registers) and the result is rounded once to the output's
// dtype, as a GEMM with float32 accumulation rounds it. Being a plain C call, it is launched
// through step_graph.launch, so a decode step made of such calls can be recorded.
//
// Output rows are split over the caller's OpenMP team when there is enough work (the team size is
// always the caller's, serial runs go through if(); see attention/paged_attention.cpp).

#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "dot_rows.h"
#include "float_bits.h"

namespace {

using llmhal_cpu::dots;
#if defined(__AVX512BF16__)
using llmhal_cpu::dots2_bf16_acc;
using llmhal_cpu::reduce16;
#endif
using llmhal_cpu::f32_to_bf16_bits;
using llmhal_cpu::kRowBlock;
using llmhal_cpu::scalar_w;
using llmhal_cpu::widen_rows;

// Below this many weight elements a call runs on one thread.
constexpr int64_t kMinParallel = 1 << 16;
#if defined(__AVX512BF16__)
// How far ahead of each weight stream the bf16 dots prefetch (bytes), into L2 only (prefetcht2).
// Prefetching into L1 2 KiB ahead was no faster than none; into L2 8 KiB ahead, a cold [1536,
// 1024] + [1024, 1024] pair (16 of them, caches flushed between) read at 1.23-1.25x the rate at 1
// token and 1.51-1.58x at 4-8 (8 tokens: 10 -> 16 GB/s, one thread); [768, 512] + [1536, 512]
// 1.29x and 1.45-1.66x. 16 KiB measured alike.
constexpr int64_t kPrefetchAhead = 8192;
#endif

inline float bias_at(const void* bias, int bias_bf16, int64_t r) {
  if (!bias) return 0.f;
  return bias_bf16 ? scalar_w(static_cast<const uint16_t*>(bias)[r])
                   : static_cast<const float*>(bias)[r];
}

inline void store(void* out, int out_bf16, int64_t i, float v) {
  if (out_bf16)
    static_cast<uint16_t*>(out)[i] = f32_to_bf16_bits(v);
  else
    static_cast<float*>(out)[i] = v;
}


template <typename T>
void linear(const float* x, int64_t t, int64_t k, const T* w, int64_t n, const void* bias,
            int bias_bf16, void* out, int out_bf16, int threads) {
  const bool par = threads > 1 && n * k >= kMinParallel;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
  for (int64_t r = 0; r < n; ++r) {
    const float b = bias_at(bias, bias_bf16, r);
    for (int64_t t0 = 0; t0 < t; t0 += kRowBlock) {
      const int m = static_cast<int>(std::min<int64_t>(kRowBlock, t - t0));
      const float* xs[kRowBlock];
      for (int j = 0; j < m; ++j) xs[j] = x + (t0 + j) * k;
      float d[kRowBlock];
      dots(w + r * k, xs, m, k, d);
      for (int j = 0; j < m; ++j) store(out, out_bf16, (t0 + j) * n + r, d[j] + b);
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 x bf16 on AVX512-BF16 dots (dot_rows.h), 16 output rows a group: their per-token partial
// sums are reduced together (reduce16) and stored as one vector. Two groups a pass, p and
// p + half, their rows read in pairs (row r of each): two weight streams half the matrix apart,
// each prefetched kPrefetchAhead bytes ahead into L2, instead of one stream (rows r and r + 1 of
// one group). At 8 tokens with cold weights (a decode step's: the model is larger than the L3) one
// thread read 5-6.5 GB/s with one stream, 8-11.5 with two ([1536, 512]: 244 -> 150 us; before the
// prefetch into L2, see kPrefetchAhead); each row's sum is the same, bit for bit (its dots and its
// reduction are unchanged, only the order of the rows).
void linear_bf16(const uint16_t* x, int64_t x_s, int64_t t, int64_t k, const uint16_t* w,
                 int64_t n, const void* bias, int bias_bf16, void* out, int out_bf16,
                 int threads) {
  const bool par = threads > 1 && n * k >= kMinParallel;
  const int64_t groups = (n + 15) / 16, half = (groups + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
  for (int64_t p = 0; p < half; ++p) {
    const int64_t g[2] = {p, p + half};
    const int ng = g[1] < groups ? 2 : 1;
    int64_t r0[2], rows[2];
    __m512 bv[2];
    for (int i = 0; i < ng; ++i) {
      r0[i] = g[i] * 16;
      rows[i] = std::min<int64_t>(16, n - r0[i]);
      float b[16] = {};
      for (int64_t r = 0; r < rows[i]; ++r) b[r] = bias_at(bias, bias_bf16, r0[i] + r);
      bv[i] = _mm512_loadu_ps(b);
    }
    for (int64_t t0 = 0; t0 < t; t0 += kRowBlock) {
      const int m = static_cast<int>(std::min<int64_t>(kRowBlock, t - t0));
      const uint16_t* xs[kRowBlock];
      for (int j = 0; j < m; ++j) xs[j] = x + (t0 + j) * x_s;
      __m512 acc[2][16][kRowBlock];
      for (int64_t r = 0; r < 16; ++r) {
        const bool a = r < rows[0], b = ng == 2 && r < rows[1];
        if (!a) {
          for (int i = 0; i < 2; ++i)
            for (int j = 0; j < m; ++j) acc[i][r][j] = _mm512_setzero_ps();
          continue;
        }
        const uint16_t* w0 = w + (r0[0] + r) * k;
        dots2_bf16_acc<_MM_HINT_T2>(w0, b ? w + (r0[1] + r) * k : w0, xs, m, k, acc[0][r],
                                    acc[1][r], kPrefetchAhead);
        if (!b)
          for (int j = 0; j < m; ++j) acc[1][r][j] = _mm512_setzero_ps();
      }
      for (int i = 0; i < ng; ++i) {
        const __mmask16 mask = static_cast<__mmask16>((1u << rows[i]) - 1);
        for (int j = 0; j < m; ++j) {
          __m512 v[16];
          for (int r = 0; r < 16; ++r) v[r] = acc[i][r][j];
          const __m512 y = _mm512_add_ps(reduce16(v), bv[i]);
          if (out_bf16)
            _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + (t0 + j) * n + r0[i], mask,
                                     (__m256i)_mm512_cvtneps_pbh(y));
          else
            _mm512_mask_storeu_ps(static_cast<float*>(out) + (t0 + j) * n + r0[i], mask, y);
        }
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

// x: [t, k] rows of stride x_s, float32 or (x_bf16) bfloat16; w: [n, k] contiguous, float32 or
// (w_bf16) bfloat16; bias: [n] float32 or (bias_bf16) bf16, or null; out: [t, n] contiguous,
// float32 or (out_bf16) bf16. Mirrors RowsLinearArgs in rows_linear.py. Returns 0.
struct RowsLinearArgs {
  const void* x;
  int64_t x_s;
  const void* w;
  const void* bias;
  void* out;
  int64_t t, k, n;
  int32_t x_bf16, w_bf16, bias_bf16, out_bf16, threads;
};

int llmhal_rows_linear_call(const void* p) {
  const auto& a = *static_cast<const RowsLinearArgs*>(p);
#if defined(__AVX512BF16__)
  if (a.x_bf16 && a.w_bf16) {
    linear_bf16(static_cast<const uint16_t*>(a.x), a.x_s, a.t, a.k,
                static_cast<const uint16_t*>(a.w), a.n, a.bias, a.bias_bf16, a.out, a.out_bf16,
                a.threads);
    return 0;
  }
#endif
  std::vector<float> x(a.t * a.k);
  widen_rows(a.x, a.x_s, a.x_bf16, a.t, a.k, x.data());
  if (a.w_bf16)
    linear(x.data(), a.t, a.k, static_cast<const uint16_t*>(a.w), a.n, a.bias, a.bias_bf16,
           a.out, a.out_bf16, a.threads);
  else
    linear(x.data(), a.t, a.k, static_cast<const float*>(a.w), a.n, a.bias, a.bias_bf16, a.out,
           a.out_bf16, a.threads);
  return 0;
}

int64_t llmhal_rows_linear_args_size() { return sizeof(RowsLinearArgs); }

}  // extern "C"
