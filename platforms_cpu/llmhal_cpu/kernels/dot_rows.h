// Dot products of one weight row with a few activation rows (up to kRowBlock), the inner loop of
// the kernels that stream weights once for a decode step's few tokens (moe_experts.cpp,
// rows_linear.cpp). Weights are float32, bfloat16 (widened in registers) or int8 (the caller
// applies the row's scale); activations are float32 rows; accumulation is float32. At 1-8 rows
// the product reads each weight once and is bound by memory, not arithmetic.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "simd_math.h"

namespace llmhal_cpu {

// Activation rows handled together: each weight row is read once per block.
constexpr int kRowBlock = 8;

typedef uint16_t vu16 __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(W * sizeof(uint32_t))));
typedef int8_t vi8 __attribute__((vector_size(W * sizeof(int8_t))));
typedef int32_t vi32 __attribute__((vector_size(W * sizeof(int32_t))));

inline vf load_w(const float* p) { return vload(p); }

// bfloat16 is the high half of a float32: widen and shift.
inline vf load_w(const uint16_t* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  vu32 u = __builtin_convertvector(h, vu32) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// int8 -> float32: GCC scalarizes __builtin_convertvector from a char vector (4x slower than
// the weights' bfloat16 form on a Mixtral-sized layer), so the x86 forms use the intrinsics.
inline vf load_w(const int8_t* p) {
#if defined(__AVX512F__)
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  vf v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#elif defined(__AVX2__)
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  vf v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  vi8 q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
#endif
}

inline float scalar_w(float v) { return v; }
inline float scalar_w(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float scalar_w(int8_t v) { return static_cast<float>(v); }

// dots[j] = w . x[j] for the N rows x[j] of length len.
template <typename T, int N>
inline void dots_fixed(const T* w, const float* const* x, int64_t len, float* dots) {
  vf acc[N] = {};
  int64_t d = 0;
  for (; d + W <= len; d += W) {
    const vf wv = load_w(w + d);
    for (int j = 0; j < N; ++j) acc[j] += wv * vload(x[j] + d);
  }
  for (int j = 0; j < N; ++j) {
    float s = hsum(acc[j]);
    for (int64_t e = d; e < len; ++e) s += scalar_w(w[e]) * x[j][e];
    dots[j] = s;
  }
}

// The same for n (1 <= n <= kRowBlock) rows.
template <typename T>
inline void dots(const T* w, const float* const* x, int n, int64_t len, float* out) {
  switch (n) {
    case 1: return dots_fixed<T, 1>(w, x, len, out);
    case 2: return dots_fixed<T, 2>(w, x, len, out);
    case 3: return dots_fixed<T, 3>(w, x, len, out);
    case 4: return dots_fixed<T, 4>(w, x, len, out);
    case 5: return dots_fixed<T, 5>(w, x, len, out);
    case 6: return dots_fixed<T, 6>(w, x, len, out);
    case 7: return dots_fixed<T, 7>(w, x, len, out);
    default: return dots_fixed<T, kRowBlock>(w, x, len, out);
  }
}

// Rows of float32 or bfloat16 (bf16 set) values, row stride `stride` elements, widened into the
// contiguous float32 [rows, cols] `out`.
inline void widen_rows(const void* src, int64_t stride, int bf16, int64_t rows, int64_t cols,
                       float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    if (bf16) {
      const uint16_t* s = static_cast<const uint16_t*>(src) + r * stride;
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = scalar_w(s[c]);
    } else {
      std::memcpy(out + r * cols, static_cast<const float*>(src) + r * stride,
                  sizeof(float) * cols);
    }
  }
}

}  // namespace llmhal_cpu
