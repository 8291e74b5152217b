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

// dots[j] = w . x[j] for the N rows x[j] of length len; ahead > 0: each pass also prefetches the
// weight row that many bytes ahead into L2 (moe_experts.cpp; a prefetch cannot fault).
template <typename T, int N>
inline void dots_fixed(const T* w, const float* const* x, int64_t len, float* dots,
                       int64_t ahead = 0) {
  vf acc[N] = {};
  int64_t d = 0;
  for (; d + W <= len; d += W) {
    if (ahead) __builtin_prefetch(reinterpret_cast<const char*>(w + d) + ahead, 0, 1);  // to L2
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
inline void dots(const T* w, const float* const* x, int n, int64_t len, float* out,
                 int64_t ahead = 0) {
  switch (n) {
    case 1: return dots_fixed<T, 1>(w, x, len, out, ahead);
    case 2: return dots_fixed<T, 2>(w, x, len, out, ahead);
    case 3: return dots_fixed<T, 3>(w, x, len, out, ahead);
    case 4: return dots_fixed<T, 4>(w, x, len, out, ahead);
    case 5: return dots_fixed<T, 5>(w, x, len, out, ahead);
    case 6: return dots_fixed<T, 6>(w, x, len, out, ahead);
    case 7: return dots_fixed<T, 7>(w, x, len, out, ahead);
    default: return dots_fixed<T, kRowBlock>(w, x, len, out, ahead);
  }
}

#if defined(__AVX512BF16__)
// bf16 weight vectors for the dot instruction: bf16 rows as they are, int8 rows (experts_int8's)
// converted in registers (exactly: every int8 is a bf16; the caller applies the row scale to the
// sums). The tail forms load only the values m selects (the rest read as zeros).
inline __m512bh i8_to_bf16(__m256i q) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh(const int8_t* p) {
  return i8_to_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512bh load_bh_tail(const uint16_t* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
inline __m512bh load_bh_tail(const int8_t* p, __mmask32 m) {
  return i8_to_bf16(_mm256_maskz_loadu_epi8(m, p));
}

// Two bfloat16 weight rows (w0, w1: the same row twice for one) against N bfloat16 rows x[j]
// with AVX512-BF16's dot instruction: 32 products an instruction, twice the widened float32
// FMAs, and no widening of the weights (oneDNN's bf16 GEMM uses it too). Two weight rows at a
// time, so each activation load serves two dots: one row at a time, the loads bound the loop.
// acc0[j] / acc1[j] get 16 partial sums each (reduce them with reduce16 or
// _mm512_reduce_add_ps); a tail shorter than 32 is read with masked loads (zeros add nothing).
// ahead > 0: each pass also prefetches both weight streams that many bytes ahead, with hint Hint
// (rows_linear.cpp and moe_experts.cpp use _MM_HINT_T2: into L2 only, where it pays; see there); a
// prefetch past the end of a matrix touches nothing and cannot fault. Weight rows are bf16 or
// int8 (load_bh).
template <int N, int Hint = _MM_HINT_T0, typename Wt = uint16_t>
inline void dots2_bf16_fixed(const Wt* w0, const Wt* w1, const uint16_t* const* x,
                             int64_t len, __m512* acc0, __m512* acc1, int64_t ahead = 0) {
  __m512 a0[N], a1[N];
  for (int j = 0; j < N; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= len; d += 32) {
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + d) + ahead, (_mm_hint)Hint);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + d) + ahead, (_mm_hint)Hint);
    }
    const __m512bh a = load_bh(w0 + d);
    const __m512bh b = load_bh(w1 + d);
    for (int j = 0; j < N; ++j) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[j] + d);
      a0[j] = _mm512_dpbf16_ps(a0[j], a, xv);
      a1[j] = _mm512_dpbf16_ps(a1[j], b, xv);
    }
  }
  if (d < len) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (len - d)) - 1);
    const __m512bh a = load_bh_tail(w0 + d, m);
    const __m512bh b = load_bh_tail(w1 + d, m);
    for (int j = 0; j < N; ++j) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x[j] + d);
      a0[j] = _mm512_dpbf16_ps(a0[j], a, xv);
      a1[j] = _mm512_dpbf16_ps(a1[j], b, xv);
    }
  }
  for (int j = 0; j < N; ++j) {
    acc0[j] = a0[j];
    acc1[j] = a1[j];
  }
}

// The same for n (1 <= n <= kRowBlock) rows.
template <int Hint = _MM_HINT_T0, typename Wt = uint16_t>
inline void dots2_bf16_acc(const Wt* w0, const Wt* w1, const uint16_t* const* x,
                           int n, int64_t len, __m512* acc0, __m512* acc1, int64_t ahead = 0) {
  switch (n) {
    case 1: return dots2_bf16_fixed<1, Hint, Wt>(w0, w1, x, len, acc0, acc1, ahead);
    case 2: return dots2_bf16_fixed<2, Hint, Wt>(w0, w1, x, len, acc0, acc1, ahead);
    case 3: return dots2_bf16_fixed<3, Hint, Wt>(w0, w1, x, len, acc0, acc1, ahead);
    case 4: return dots2_bf16_fixed<4, Hint, Wt>(w0, w1, x, len, acc0, acc1, ahead);
    case 5: return dots2_bf16_fixed<5, Hint, Wt>(w0, w1, x, len, acc0, acc1, ahead);
    case 6: return dots2_bf16_fixed<6, Hint, Wt>(w0, w1, x, len, acc0, acc1, ahead);
    case 7: return dots2_bf16_fixed<7, Hint, Wt>(w0, w1, x, len, acc0, acc1, ahead);
    default: return dots2_bf16_fixed<kRowBlock, Hint, Wt>(w0, w1, x, len, acc0, acc1, ahead);
  }
}

// The dots themselves: out0[j] = w0 . x[j], out1[j] = w1 . x[j].
template <int Hint = _MM_HINT_T0, typename Wt = uint16_t>
inline void dots2_bf16(const Wt* w0, const Wt* w1, const uint16_t* const* x, int n,
                       int64_t len, float* out0, float* out1, int64_t ahead = 0) {
  __m512 acc0[kRowBlock], acc1[kRowBlock];
  dots2_bf16_acc<Hint, Wt>(w0, w1, x, n, len, acc0, acc1, ahead);
  for (int j = 0; j < n; ++j) {
    out0[j] = _mm512_reduce_add_ps(acc0[j]);
    out1[j] = _mm512_reduce_add_ps(acc1[j]);
  }
}

// Lane i of the result is the sum of v[i]'s 16 lanes: 16 reductions in 45 shuffles and adds
// instead of ~130 (one at a time they cost as much as the dots of a short row: a 512-wide
// DeepSeek-V2-Lite projection). Pairs, then quads within 128-bit lanes, then across lanes.
inline __m512 reduce16(const __m512* v) {
  __m512 p[8], q[4], c[2];
  for (int i = 0; i < 8; ++i)
    p[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(p[2 * i]), b = _mm512_castps_pd(p[2 * i + 1]);
    q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

#endif

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
