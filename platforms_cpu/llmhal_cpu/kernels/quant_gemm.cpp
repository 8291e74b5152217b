// Grouped-quantized matmul for llmhal's CPU quant_linear kernel, compiled at run time for the host
// (native_build.py: -march=native, or LLMHAL_CPU_KERNEL_ARCH).
//
//   y[M, N] = x[M, K] @ W^T (+ bias),   W[n, k] = scale[n, g] * q[n, k] + offset[n, g],  g = k / G
//
// with q unsigned 4-bit codes (0..15) or signed 8-bit codes, x in fp32, bf16 or fp16, y in fp32 or
// bf16. Products are exact integers or fp32; accumulation is fp32 across blocks.
//
// Packed weight (quant_gemm.py builds it): output channels in blocks of 16 (zero-padded to an even
// number of blocks), each block a run of 64-byte chunks along K; the 4 bytes of 32-bit lane i of a
// chunk belong to channel 16b + i, so one 512-bit register (or two 256-bit ones) holds 16 channels:
//   bits=4: chunk c covers k = 8c .. 8c+7; byte 4i+j = q[k=8c+j] | q[k=8c+4+j] << 4
//   bits=8: chunk c covers k = 4c .. 4c+3; byte 4i+j = q[k=4c+j]
// That is the operand layout of a 4-way byte dot product per lane (vpdpbusd, pmaddubsw+pmaddwd);
// the even and odd bytes of each lane are the int16 pairs of vpdpwssd/pmaddwd; and each code
// converts to float with one or two shifts. Scales: [block][group][scale, offset][16 lanes], fp16
// where that is exact (GGUF stores fp16), else fp32. K is zero-padded to a multiple of U (below).
//
// Three inner products (mode), all over U-wide K blocks (U = 32, or 16 for groups of 16):
//  * 0, fp32: codes converted to float, w = s * q + o (one FMA: the exact fp32 weight), y += x * w.
//    The dequantized weight's fp32 matmul, up to summation order.
//  * 2, int16: x quantized per row and U block to int16 with step d = max|x| / 32767, exact int32
//    dot products of codes and x codes over the block (vpdpwssd, or pmaddwd), then
//    y += s * d * sum(q * xq) + o * d * sum(xq). Relative error ~2e-5 (x's rounding, at most
//    d / 2 per element), from about half the instructions of mode 0: the default (measured in
//    llmhal.benchmarks.quant_kernels; SmolLM2's logits within 0.003 nats of the exact path).
//  * 1, int8: the same with int8 x (d = max|x| / 127, llama.cpp's scheme) and 4-way byte dot
//    products; 8-bit codes go in as q + 128 (xor 0x80) with -128 * sum(xq) up front under VNNI, or
//    as |q| against sign-adjusted x under pmaddubsw (whose int16 pair sums then cannot saturate).
//    Relative error ~5e-3: measured too coarse for SmolLM2 (its answers change), kept as an option.
// The offset term uses the quantized sum of x so that x's rounding errors meet the whole weight
// s * q + o (centred on zero for GGUF/GPTQ formats) rather than s * q alone.
//
// Register tiles of MR rows x NR blocks; with one or two rows, each output vector keeps several
// independent accumulators, or M=1 (decode) would wait on the latency of one chain of FMAs / dot
// products. Weight loads prefetch QG_PF bytes ahead: at M=1 the weights stream from memory once
// per call, several streams per thread, which the hardware prefetchers alone kept at half the
// memory bandwidth.
//
// Threads: tiles (NR channel blocks x a chunk of rows) are split statically over the caller's
// OpenMP team. Every parallel region asks for the caller's full team
// (num_threads(torch.get_num_threads())) and runs serially through if(): libgomp parks idle pool
// threads in a spin-wait, and alternating team sizes with torch's own regions made every later
// torch op wait out that spin (see attention/paged_attention.cpp).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include <omp.h>

#include "float_bits.h"
#include "simd_math.h"
#ifndef QG_PF
#define QG_PF 16384
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// ------------------------------------------------------------------------ conversions
using llmhal_cpu::bits_to_f32;
inline float half_to_f32(uint16_t h16) { return llmhal_cpu::half_bits_to_f32(h16); }
inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ------------------------------------------------------------------ 16-lane blocks per ISA
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QG_ISA "avx512_vnni"
constexpr int kMR = 4;   // rows per register tile, fp32 mode
constexpr int kMRI = 6;  // rows per register tile, integer modes
// Calls of up to this many rows run as one tile in the integer modes (a speculative verification
// of up to 7 drafts, a batch of 8 decodes): every weight chunk is unpacked once for all rows. From
// 7 rows the fp32 sums no longer fit the registers beside the int32 ones and live in memory
// (tile_int); more rows are split into tiles of kMRI.
constexpr int kMRI_ONE = 8;
constexpr int kNR = 2;   // 16-channel blocks per register tile
constexpr bool kXorBias = true;
struct BF { __m512 v; };
struct BI { __m512i v; };
inline BF f_zero() { return {_mm512_setzero_ps()}; }
inline BF f_set(float a) { return {_mm512_set1_ps(a)}; }
inline BF f_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline BF f_load(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void f_store(float* p, BF a) { _mm512_storeu_ps(p, a.v); }
inline BF f_fma(BF a, BF b, BF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline BF f_mul(BF a, BF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline BF f_add(BF a, BF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline BI i_add(BI a, BI b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline BI i_load(const uint8_t* p) {
  __builtin_prefetch(p + QG_PF);
  return {_mm512_loadu_si512(p)};
}
inline BI i_set(int32_t a) { return {_mm512_set1_epi32(a)}; }
inline BI i_zero() { return {_mm512_setzero_si512()}; }
inline BF i_to_f(BI a) { return {_mm512_cvtepi32_ps(a.v)}; }
template <int S> inline BF nibble(BI a) {
  const __m512i s = S ? _mm512_srli_epi32(a.v, S) : a.v;
  return {_mm512_cvtepi32_ps(S == 28 ? s : _mm512_and_si512(s, _mm512_set1_epi32(15)))};
}
template <int J> inline BF sbyte(BI a) {
  const __m512i s = J == 3 ? a.v : _mm512_slli_epi32(a.v, 24 - 8 * J);
  return {_mm512_cvtepi32_ps(_mm512_srai_epi32(s, 24))};
}
inline BI lo_nibbles(BI a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0f))}; }
inline BI hi_nibbles(BI a) {
  return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0f))};
}
inline BI prep8(BI a) { return {_mm512_xor_si512(a.v, _mm512_set1_epi8(char(0x80)))}; }
inline BI dot_u8(BI acc, BI u, BI s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }
inline BI dot_s8(BI acc, BI w, BI s) { return dot_u8(acc, w, s); }  // w from prep8
// int16 pairs: bytes 0 and 2 (even) or 1 and 3 (odd) of each lane as 16-bit values.
inline BI even_u16(BI a) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(0x00ff00ff))}; }
inline BI odd_u16(BI a) { return {_mm512_srli_epi16(a.v, 8)}; }
inline BI even_s16(BI a) { return {_mm512_srai_epi16(_mm512_slli_epi16(a.v, 8), 8)}; }
inline BI odd_s16(BI a) { return {_mm512_srai_epi16(a.v, 8)}; }
inline BI dot16(BI acc, BI w, BI x) { return {_mm512_dpwssd_epi32(acc.v, w.v, x.v)}; }
#elif defined(__AVX2__) && defined(__FMA__)
#ifdef __AVXVNNI__
#define QG_ISA "avx2_vnni"
constexpr bool kXorBias = true;
#else
#define QG_ISA "avx2"
constexpr bool kXorBias = false;
#endif
#define QG_HALF_TILES 1  // int16 mode: tile_i16_halves (16 ymm registers)
constexpr int kMR = 4;
constexpr int kMRI = 4;  // 3..6 measured alike on Zen 3 (tile_i16_halves)
constexpr int kMRI_ONE = kMRI;
constexpr int kNR = 1;
struct BF { __m256 a, b; };
struct BI { __m256i a, b; };
inline BF f_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline BF f_set(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline BF f_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
#ifdef __F16C__
inline __m256 h_load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
inline __m256 h_load8(const uint16_t* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = half_to_f32(p[i]);
  return _mm256_load_ps(f);
}
#endif
inline BF f_load(const uint16_t* p) { return {h_load8(p), h_load8(p + 8)}; }
inline void f_store(float* p, BF x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
inline BF f_fma(BF x, BF y, BF z) {
  return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
inline BF f_mul(BF x, BF y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline BF f_add(BF x, BF y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline BI i_add(BI x, BI y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline BI i_load(const uint8_t* p) {
  __builtin_prefetch(p + QG_PF);
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline BI i_set(int32_t x) { const __m256i v = _mm256_set1_epi32(x); return {v, v}; }
inline BI i_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline BF i_to_f(BI x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
template <int S> inline __m256 nibble1(__m256i x) {
  const __m256i s = S ? _mm256_srli_epi32(x, S) : x;
  return _mm256_cvtepi32_ps(S == 28 ? s : _mm256_and_si256(s, _mm256_set1_epi32(15)));
}
template <int S> inline BF nibble(BI x) { return {nibble1<S>(x.a), nibble1<S>(x.b)}; }
template <int J> inline __m256 sbyte1(__m256i x) {
  const __m256i s = J == 3 ? x : _mm256_slli_epi32(x, 24 - 8 * J);
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(s, 24));
}
template <int J> inline BF sbyte(BI x) { return {sbyte1<J>(x.a), sbyte1<J>(x.b)}; }
inline BI lo_nibbles(BI x) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  return {_mm256_and_si256(x.a, m), _mm256_and_si256(x.b, m)};
}
inline BI hi_nibbles(BI x) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  return {_mm256_and_si256(_mm256_srli_epi16(x.a, 4), m),
          _mm256_and_si256(_mm256_srli_epi16(x.b, 4), m)};
}
#ifdef __AVXVNNI__
inline __m256i dot1(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline BI prep8(BI x) {
  const __m256i m = _mm256_set1_epi8(char(0x80));
  return {_mm256_xor_si256(x.a, m), _mm256_xor_si256(x.b, m)};
}
inline BI dot_s8(BI acc, BI w, BI s) { return {dot1(acc.a, w.a, s.a), dot1(acc.b, w.b, s.b)}; }
#else
// |u * s| <= 255 * 128 per byte pair only when u <= 127 or |s| small; our u are 4-bit codes or |q|
// <= 128 against |xq| <= 127, so the int16 pair sums (at most 2 * 128 * 127) never saturate.
inline __m256i dot1(__m256i acc, __m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline BI prep8(BI x) { return x; }
inline BI dot_s8(BI acc, BI w, BI s) {
  return {dot1(acc.a, _mm256_sign_epi8(w.a, w.a), _mm256_sign_epi8(s.a, w.a)),
          dot1(acc.b, _mm256_sign_epi8(w.b, w.b), _mm256_sign_epi8(s.b, w.b))};
}
#endif
inline BI dot_u8(BI acc, BI u, BI s) { return {dot1(acc.a, u.a, s.a), dot1(acc.b, u.b, s.b)}; }
inline BI even_u16(BI x) {
  const __m256i m = _mm256_set1_epi32(0x00ff00ff);
  return {_mm256_and_si256(x.a, m), _mm256_and_si256(x.b, m)};
}
inline BI odd_u16(BI x) { return {_mm256_srli_epi16(x.a, 8), _mm256_srli_epi16(x.b, 8)}; }
// One register's signed bytes 0 and 2 (even) or 1 and 3 (odd) of each lane as int16 (also used
// on their own by tile_i16_halves).
inline __m256i even_s16_1(__m256i x) { return _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8); }
inline __m256i odd_s16_1(__m256i x) { return _mm256_srai_epi16(x, 8); }
inline BI even_s16(BI x) { return {even_s16_1(x.a), even_s16_1(x.b)}; }
inline BI odd_s16(BI x) { return {odd_s16_1(x.a), odd_s16_1(x.b)}; }
#ifdef __AVXVNNI__
inline __m256i dot16_1(__m256i acc, __m256i w, __m256i x) { return _mm256_dpwssd_avx_epi32(acc, w, x); }
#else
inline __m256i dot16_1(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
}
#endif
inline BI dot16(BI acc, BI w, BI x) { return {dot16_1(acc.a, w.a, x.a), dot16_1(acc.b, w.b, x.b)}; }
#else
// Portable fallback: plain loops over 16 lanes (the compiler vectorizes what it can).
#define QG_ISA "scalar"
constexpr int kMR = 2;
constexpr int kMRI = 2;
constexpr int kMRI_ONE = kMRI;
constexpr int kNR = 1;
constexpr bool kXorBias = true;
struct BF { float v[16]; };
struct BI { int32_t v[16]; };
inline BF f_zero() { BF r; for (int i = 0; i < 16; ++i) r.v[i] = 0.f; return r; }
inline BF f_set(float a) { BF r; for (int i = 0; i < 16; ++i) r.v[i] = a; return r; }
inline BF f_load(const float* p) { BF r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline BF f_load(const uint16_t* p) { BF r; for (int i = 0; i < 16; ++i) r.v[i] = half_to_f32(p[i]); return r; }
inline void f_store(float* p, BF a) { std::memcpy(p, a.v, sizeof a.v); }
inline BF f_fma(BF a, BF b, BF c) {
  for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline BF f_mul(BF a, BF b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
inline BF f_add(BF a, BF b) { for (int i = 0; i < 16; ++i) a.v[i] += b.v[i]; return a; }
inline BI i_add(BI a, BI b) { for (int i = 0; i < 16; ++i) a.v[i] += b.v[i]; return a; }
inline BI i_load(const uint8_t* p) { BI r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline BI i_set(int32_t a) { BI r; for (int i = 0; i < 16; ++i) r.v[i] = a; return r; }
inline BI i_zero() { return i_set(0); }
inline BF i_to_f(BI a) { BF r; for (int i = 0; i < 16; ++i) r.v[i] = float(a.v[i]); return r; }
template <int S> inline BF nibble(BI a) {
  BF r;
  for (int i = 0; i < 16; ++i) r.v[i] = float((uint32_t(a.v[i]) >> S) & 15u);
  return r;
}
template <int J> inline BF sbyte(BI a) {
  BF r;
  for (int i = 0; i < 16; ++i) r.v[i] = float(int8_t(uint32_t(a.v[i]) >> (8 * J)));
  return r;
}
inline BI lo_nibbles(BI a) { for (int i = 0; i < 16; ++i) a.v[i] &= 0x0f0f0f0f; return a; }
inline BI hi_nibbles(BI a) {
  for (int i = 0; i < 16; ++i) a.v[i] = int32_t((uint32_t(a.v[i]) >> 4) & 0x0f0f0f0fu);
  return a;
}
inline BI prep8(BI a) {
  for (int i = 0; i < 16; ++i) a.v[i] = int32_t(uint32_t(a.v[i]) ^ 0x80808080u);
  return a;
}
inline BI dot_u8(BI acc, BI u, BI s) {
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 4; ++j)
      acc.v[i] += int32_t((uint32_t(u.v[i]) >> (8 * j)) & 255u) *
                  int32_t(int8_t(uint32_t(s.v[i]) >> (8 * j)));
  return acc;
}
inline BI dot_s8(BI acc, BI w, BI s) { return dot_u8(acc, w, s); }
inline BI even_u16(BI a) { for (int i = 0; i < 16; ++i) a.v[i] &= 0x00ff00ff; return a; }
inline BI odd_u16(BI a) {
  for (int i = 0; i < 16; ++i) a.v[i] = int32_t((uint32_t(a.v[i]) >> 8) & 0x00ff00ffu);
  return a;
}
inline BI even_s16(BI a) {
  for (int i = 0; i < 16; ++i) {
    const uint32_t u = uint32_t(a.v[i]);
    a.v[i] = int32_t(uint32_t(uint16_t(int16_t(int8_t(u)))) |
                     (uint32_t(uint16_t(int16_t(int8_t(u >> 16)))) << 16));
  }
  return a;
}
inline BI odd_s16(BI a) {
  for (int i = 0; i < 16; ++i) {
    const uint32_t u = uint32_t(a.v[i]);
    a.v[i] = int32_t(uint32_t(uint16_t(int16_t(int8_t(u >> 8)))) |
                     (uint32_t(uint16_t(int16_t(int8_t(u >> 24)))) << 16));
  }
  return a;
}
inline BI dot16(BI acc, BI w, BI x) {
  for (int i = 0; i < 16; ++i)
    acc.v[i] += int32_t(int16_t(uint32_t(w.v[i]))) * int32_t(int16_t(uint32_t(x.v[i]))) +
                int32_t(int16_t(uint32_t(w.v[i]) >> 16)) * int32_t(int16_t(uint32_t(x.v[i]) >> 16));
  return acc;
}
#endif

// Row m of x as fp32, zero-padded to kpad.
inline void load_row(const void* x, int dtype, int64_t k, int64_t kpad, float* dst) {
  if (dtype == 0) {
    std::memcpy(dst, x, static_cast<size_t>(k) * sizeof(float));
  } else if (dtype == 1) {
    const uint16_t* s = static_cast<const uint16_t*>(x);
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) dst[i] = bits_to_f32(static_cast<uint32_t>(s[i]) << 16);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(x);
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) dst[i] = half_to_f32(s[i]);
  }
  for (int64_t i = k; i < kpad; ++i) dst[i] = 0.f;
}

// -------------------------------------------------------------------------- the kernel
struct Weight {
  const uint8_t* packed;  // [blocks][kpad / codes_per_chunk][64]
  const void* scales;     // [blocks][groups][1 + has_offset][16], fp32 or fp16 (half_scales)
  int64_t n, k, kpad;
  int32_t bits, group_size, groups, has_offset, unit;  // unit: U, 16 or 32
  int32_t half_scales;
};

struct Call {
  const Weight* w;
  int64_t m;
  const float* xf;   // fp32 mode: [m][xf_s] (kpad valid columns)
  int64_t xf_s;
  const int8_t* xq;  // int8 mode: [m][kpad]
  const int16_t* x16;  // int16 mode: [m][kpad]
  const float* xd;   // [m][blocks_k]: quantization step of each U block
  const float* xs;   // [m][blocks_k]: d * sum(xq) of each U block
  const int32_t* xi; // [m][blocks_k]: sum(xq)
  int64_t nu;        // U blocks along K
  int64_t units_per_group;  // U blocks per scale group (group g = u / units_per_group)
  const float* bias;
  void* y;
  int64_t y_s;
  int32_t y_dtype;   // 0 fp32, 1 bf16
};

template <int MR, int NR>
inline void store_tile(const Call& c, int64_t m0, int64_t b0, BF (&acc)[MR][NR]) {
  alignas(64) float tmp[16];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      f_store(tmp, acc[r][j]);
      const int64_t n0 = (b0 + j) * 16;
      const int64_t nn = std::min<int64_t>(16, c.w->n - n0);
      if (nn <= 0) continue;  // a padding block
      if (c.bias)
        for (int64_t i = 0; i < nn; ++i) tmp[i] += c.bias[n0 + i];
      if (c.y_dtype == 0) {
        float* y = static_cast<float*>(c.y) + (m0 + r) * c.y_s + n0;
        std::memcpy(y, tmp, static_cast<size_t>(nn) * sizeof(float));
      } else {
        uint16_t* y = static_cast<uint16_t*>(c.y) + (m0 + r) * c.y_s + n0;
        for (int64_t i = 0; i < nn; ++i) y[i] = f32_to_bf16(tmp[i]);
      }
    }
}

using TileFn = void (*)(const Call&, int64_t, int64_t);

// Scales and offsets of channel block b, group g: [scale x16, offset x16].
template <typename ST, bool OFF>
inline const ST* scale_ptr(const Weight& w, int64_t b, int64_t g) {
  return static_cast<const ST*>(w.scales) + (b * w.groups + g) * (OFF ? 2 : 1) * 16;
}

// Independent accumulators per output vector: with few rows, one chain of dependent FMAs or dot
// products per vector would leave the kernel waiting on their latency (M=1 is the decode case).
template <int MR>
constexpr int kSplit = MR == 1 ? 4 : MR == 2 ? 2 : 1;
template <int P>
inline BF reduce(const BF (&a)[P]) {
  BF r = a[0];
  for (int p = 1; p < P; ++p) r = f_add(r, a[p]);
  return r;
}
template <int P>
inline BI reduce(const BI (&a)[P]) {
  BI r = a[0];
  for (int p = 1; p < P; ++p) r = i_add(r, a[p]);
  return r;
}

// fp32 mode: MR rows from m0, NR channel blocks from b0.
template <int BITS, bool OFF, typename ST, int MR, int NR>
void tile_f32(const Call& c, int64_t m0, int64_t b0) {
  const Weight& w = *c.w;
  constexpr int KC = BITS == 4 ? 8 : 4;  // codes per lane per chunk
  constexpr int P = kSplit<MR>;
  const int64_t chunks = w.kpad / KC, per_unit = w.unit / KC;
  BF acc[MR][NR][P];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j)
      for (int p = 0; p < P; ++p) acc[r][j][p] = f_zero();
  const float* x = c.xf + m0 * c.xf_s;
  for (int64_t u = 0; u < c.nu; ++u) {
    const int64_t g = u / c.units_per_group;
    BF s[NR], o[NR];
    for (int j = 0; j < NR; ++j) {
      const ST* sp = scale_ptr<ST, OFF>(w, b0 + j, g);
      s[j] = f_load(sp);
      o[j] = OFF ? f_load(sp + 16) : f_zero();
    }
    for (int64_t cc = u * per_unit; cc < (u + 1) * per_unit; ++cc) {
      BI raw[NR];
      for (int j = 0; j < NR; ++j) raw[j] = i_load(w.packed + ((b0 + j) * chunks + cc) * 64);
      const float* xk = x + cc * KC;
      auto step = [&](auto q_of, int t) {
        BF wv[NR];
        for (int j = 0; j < NR; ++j) {
          const BF q = q_of(raw[j]);
          wv[j] = OFF ? f_fma(q, s[j], o[j]) : f_mul(q, s[j]);
        }
        for (int r = 0; r < MR; ++r) {
          const BF xv = f_set(xk[r * c.xf_s + t]);
          for (int j = 0; j < NR; ++j) acc[r][j][t % P] = f_fma(xv, wv[j], acc[r][j][t % P]);
        }
      };
      if constexpr (BITS == 4) {
        step([](BI a) { return nibble<0>(a); }, 0);
        step([](BI a) { return nibble<8>(a); }, 1);
        step([](BI a) { return nibble<16>(a); }, 2);
        step([](BI a) { return nibble<24>(a); }, 3);
        step([](BI a) { return nibble<4>(a); }, 4);
        step([](BI a) { return nibble<12>(a); }, 5);
        step([](BI a) { return nibble<20>(a); }, 6);
        step([](BI a) { return nibble<28>(a); }, 7);
      } else {
        step([](BI a) { return sbyte<0>(a); }, 0);
        step([](BI a) { return sbyte<1>(a); }, 1);
        step([](BI a) { return sbyte<2>(a); }, 2);
        step([](BI a) { return sbyte<3>(a); }, 3);
      }
    }
  }
  BF sum[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) sum[r][j] = reduce<P>(acc[r][j]);
  store_tile<MR, NR>(c, m0, b0, sum);
}

// The 4 bytes at p (4 int8 or 2 int16 x codes) in every 32-bit lane.
template <typename T>
inline BI bcast4(const T* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return i_set(v);
}

// End of a U block in the integer modes: acc += s * d * isum (+ o * d * sum(xq)). The fp32 sums
// are registers (RegSums) or, in tiles taller than kMRI, memory (MemSums): the same operations in
// the same order either way, so a row's result does not depend on the tile it ran in.
template <int MR, int NR>
struct RegSums {
  BF (&a)[MR][NR];
  BF get(int r, int j) const { return a[r][j]; }
  void set(int r, int j, BF v) const { a[r][j] = v; }
};
template <int MR, int NR>
struct MemSums {
  float (&a)[MR][NR][16];
  BF get(int r, int j) const { return f_load(a[r][j]); }
  void set(int r, int j, BF v) const { f_store(a[r][j], v); }
};
template <bool OFF, typename ST, int MR, int NR, int P, typename Sums>
inline void finish_block(const Call& c, int64_t m0, int64_t b0, int64_t u,
                         const BI (&ia)[MR][NR][P], const Sums& acc) {
  const Weight& w = *c.w;
  const int64_t g = u / c.units_per_group;
  for (int j = 0; j < NR; ++j) {
    const ST* sp = scale_ptr<ST, OFF>(w, b0 + j, g);
    const BF s = f_load(sp);
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * c.nu + u;
      BF a = f_fma(i_to_f(reduce<P>(ia[r][j])), f_mul(s, f_set(c.xd[i])), acc.get(r, j));
      if constexpr (OFF) a = f_fma(f_load(sp + 16), f_set(c.xs[i]), a);
      acc.set(r, j, a);
    }
  }
}

// The integer modes' work on one 64-byte chunk of one channel block: H weight operands, the
// offset (in x codes) of the x broadcast that meets operand h, and the dot product that takes them.
template <int BITS, bool X16>
struct Chunk;
template <>
struct Chunk<4, false> {  // int8 x, 4-bit codes: low and high nibbles against x[0..3], x[4..7]
  using T = int8_t;
  static constexpr int H = 2;
  static void ops(BI raw, BI (&p)[H]) { p[0] = lo_nibbles(raw), p[1] = hi_nibbles(raw); }
  static constexpr int x_off(int h) { return 4 * h; }
  static BI dot(BI a, BI w, BI x) { return dot_u8(a, w, x); }
};
template <>
struct Chunk<8, false> {  // int8 x, 8-bit codes (see prep8 / dot_s8)
  using T = int8_t;
  static constexpr int H = 1;
  static void ops(BI raw, BI (&p)[H]) { p[0] = prep8(raw); }
  static constexpr int x_off(int) { return 0; }
  static BI dot(BI a, BI w, BI x) { return dot_s8(a, w, x); }
};
// int16 x holds each group of 4 inputs in the order 0, 2, 1, 3, so one 32-bit broadcast meets the
// even (or odd) code pairs of every lane.
template <>
struct Chunk<4, true> {
  using T = int16_t;
  static constexpr int H = 4;
  static void ops(BI raw, BI (&p)[H]) {
    const BI lo = lo_nibbles(raw), hi = hi_nibbles(raw);
    p[0] = even_u16(lo), p[1] = odd_u16(lo), p[2] = even_u16(hi), p[3] = odd_u16(hi);
  }
  static constexpr int x_off(int h) { return 2 * h; }
  static BI dot(BI a, BI w, BI x) { return dot16(a, w, x); }
};
template <>
struct Chunk<8, true> {
  using T = int16_t;
  static constexpr int H = 2;
  static void ops(BI raw, BI (&p)[H]) { p[0] = even_s16(raw), p[1] = odd_s16(raw); }
  static constexpr int x_off(int h) { return 2 * h; }
  static BI dot(BI a, BI w, BI x) { return dot16(a, w, x); }
};

// Integer modes (int8 x, or int16 with X16): MR rows from m0, NR channel blocks from b0.
template <int BITS, bool OFF, typename ST, int MR, int NR, bool X16>
void tile_int(const Call& c, int64_t m0, int64_t b0) {
  using C = Chunk<BITS, X16>;
  const Weight& w = *c.w;
  constexpr int KC = BITS == 4 ? 8 : 4;
  constexpr int P = kSplit<MR>;
  constexpr bool kBias8 = BITS == 8 && !X16 && kXorBias;  // codes + 128: less 128 * sum(xq)
  const int64_t chunks = w.kpad / KC, per_unit = w.unit / KC;
  const typename C::T* x = X16 ? reinterpret_cast<const typename C::T*>(c.x16)
                               : reinterpret_cast<const typename C::T*>(c.xq);
  // Taller tiles than kMRI keep their fp32 sums in memory (touched once per U block), or they
  // would crowd the int32 sums of the inner loop out of the registers.
  constexpr bool kMemAcc = MR > kMRI;
  BF acc[kMemAcc ? 1 : MR][NR];
  alignas(64) float macc[kMemAcc ? MR : 1][NR][16];
  if constexpr (kMemAcc) {
    std::memset(macc, 0, sizeof macc);
  } else {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = f_zero();
  }
  for (int64_t u = 0; u < c.nu; ++u) {
    BI ia[MR][NR][P];
    for (int r = 0; r < MR; ++r) {
      const BI init = kBias8 ? i_set(-128 * c.xi[(m0 + r) * c.nu + u]) : i_zero();
      for (int j = 0; j < NR; ++j)
        for (int p = 0; p < P; ++p) ia[r][j][p] = p == 0 ? init : i_zero();
    }
    for (int64_t cc = u * per_unit; cc < (u + 1) * per_unit; ++cc) {
      BI ops[NR][C::H];
      for (int j = 0; j < NR; ++j) C::ops(i_load(w.packed + ((b0 + j) * chunks + cc) * 64), ops[j]);
      const typename C::T* xk = x + m0 * w.kpad + cc * KC;
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < C::H; ++h) {
          const BI xv = bcast4(xk + r * w.kpad + C::x_off(h));
          for (int j = 0; j < NR; ++j) {
            // h % P where it is the same (a compile-time index keeps ia in registers; the
            // running chunk index cc made it a stack array: batch-1 decode ~125 -> ~136 tok/s).
            BI& a = ia[r][j][C::H % P == 0 ? h % P : (C::H * cc + h) % P];
            a = C::dot(a, ops[j][h], xv);
          }
        }
    }
    if constexpr (kMemAcc)
      finish_block<OFF, ST, MR, NR, P>(c, m0, b0, u, ia, MemSums<MR, NR>{macc});
    else
      finish_block<OFF, ST, MR, NR, P>(c, m0, b0, u, ia, RegSums<MR, NR>{acc});
  }
  if constexpr (kMemAcc) {
    BF sum[MR][NR];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) sum[r][j] = f_load(macc[r][j]);
    store_tile<MR, NR>(c, m0, b0, sum);
  } else {
    store_tile<MR, NR>(c, m0, b0, acc);
  }
}

#ifdef QG_HALF_TILES
// int16 mode with 16 vector registers (AVX2). tile_int's 16-lane values are two ymm registers
// each, so its MR x 16-channel tile keeps 4 * MR accumulators plus the weight operands and spills
// them (seen in the generated code). Here each 16-channel block is done as two
// 8-channel halves (the low and high 32 bytes of every chunk), one ymm register per accumulator:
// 2 * MR int32 block sums and two weight operands at a time. Same arithmetic, in the same order, as
// tile_int: results are identical. Zen 3, one thread, SmolLM2 shapes: M=1 1.2-1.3x, M=32
// 1.0-1.1x tile_int (interleaved runs).

// Weight operand h (int16 code pairs, the order of Chunk<BITS, true>) straight from a raw chunk
// half: 4-bit lanes hold q[j] | q[4 + j] << 4 in byte j, so each 16-bit half's nibbles are, from
// the bottom, the codes of pairs h = 0, 2, 1, 3 (one shift and/or one mask each). h is a constant
// once the caller's loop is unrolled.
template <int BITS>
inline __m256i half_op(__m256i raw, int h) {
  if constexpr (BITS == 4) {
    const int shift = h == 0 ? 0 : h == 1 ? 8 : h == 2 ? 4 : 12;
    const __m256i v = shift ? _mm256_srli_epi16(raw, shift) : raw;
    return shift == 12 ? v : _mm256_and_si256(v, _mm256_set1_epi32(0x000f000f));
  } else {
    return h == 0 ? even_s16_1(raw) : odd_s16_1(raw);
  }
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return h_load8(p); }

// PU chunks per U block, a constant: with the chunk loop unrolled the int32 sums live only
// within one block, and GCC keeps them in registers (as a loop-carried array it spilled them).
template <int BITS, bool OFF, typename ST, int MR, int PU>
void tile_i16_halves_pu(const Call& c, int64_t m0, int64_t b0) {
  const Weight& w = *c.w;
  constexpr int KC = BITS == 4 ? 8 : 4;  // codes per lane per chunk
  constexpr int H = BITS == 4 ? 4 : 2;   // int16 operands per chunk
  const int64_t chunks = w.kpad / KC;
  const int16_t* x = c.x16 + m0 * w.kpad;
  const uint8_t* wp = w.packed + b0 * chunks * 64;
  // fp32 sums live in memory: touched once per block, they would only crowd out the int32 sums.
  alignas(64) float acc[MR][16] = {};
  for (int64_t u = 0; u < c.nu; ++u) {
    __m256i ia[MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) ia[r][0] = ia[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int cc = 0; cc < PU; ++cc) {
      const uint8_t* src = wp + (u * PU + cc) * 64;
      __builtin_prefetch(src + QG_PF);
      const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
      const int16_t* xk = x + (u * PU + cc) * KC;
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) {
        const __m256i w0 = half_op<BITS>(raw0, h), w1 = half_op<BITS>(raw1, h);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          int32_t pair;
          std::memcpy(&pair, xk + r * w.kpad + 2 * h, sizeof pair);
          const __m256i xv = _mm256_set1_epi32(pair);
          ia[r][0] = dot16_1(ia[r][0], w0, xv);
          ia[r][1] = dot16_1(ia[r][1], w1, xv);
          // Integer adds are associative, so GCC regroups the chains of sums into trees of
          // pmaddwd results that no longer fit the 16 registers. An empty asm on the sums keeps
          // each one a register updated in place.
          __asm__("" : "+x"(ia[r][0]), "+x"(ia[r][1]));
        }
      }
    }
    const ST* sp = scale_ptr<ST, OFF>(w, b0, u / c.units_per_group);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {  // unrolled: a variable index would put ia in memory
      const __m256 sc = load8(sp + 8 * half);
      const __m256 of = OFF ? load8(sp + 16 + 8 * half) : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const int64_t i = (m0 + r) * c.nu + u;
        __m256 a = _mm256_load_ps(acc[r] + 8 * half);
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][half]),
                            _mm256_mul_ps(sc, _mm256_set1_ps(c.xd[i])), a);
        if constexpr (OFF) a = _mm256_fmadd_ps(of, _mm256_set1_ps(c.xs[i]), a);
        _mm256_store_ps(acc[r] + 8 * half, a);
      }
    }
  }
  BF sum[MR][1];
  for (int r = 0; r < MR; ++r) sum[r][0] = f_load(acc[r]);
  store_tile<MR, 1>(c, m0, b0, sum);
}

template <int BITS, bool OFF, typename ST, int MR>
void tile_i16_halves(const Call& c, int64_t m0, int64_t b0) {
  constexpr int KC = BITS == 4 ? 8 : 4;
  switch (c.w->unit / KC) {  // U = 32 or 16
    case 32 / KC: return tile_i16_halves_pu<BITS, OFF, ST, MR, 32 / KC>(c, m0, b0);
    default: return tile_i16_halves_pu<BITS, OFF, ST, MR, 16 / KC>(c, m0, b0);
  }
}
#endif

template <template <int, bool, typename, int, int> class F, int BITS, bool OFF, typename ST,
          int... R>
constexpr auto table(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&F<BITS, OFF, ST, R + 1, kNR>::run...};
}
template <int B, bool O, typename ST, int MR, int NR>
struct F32 { static void run(const Call& c, int64_t m, int64_t b) { tile_f32<B, O, ST, MR, NR>(c, m, b); } };
template <int B, bool O, typename ST, int MR, int NR>
struct I8 { static void run(const Call& c, int64_t m, int64_t b) { tile_int<B, O, ST, MR, NR, false>(c, m, b); } };
template <int B, bool O, typename ST, int MR, int NR>
struct I16 {
  static void run(const Call& c, int64_t m, int64_t b) {
#ifdef QG_HALF_TILES
    tile_i16_halves<B, O, ST, MR>(c, m, b);
#else
    tile_int<B, O, ST, MR, NR, true>(c, m, b);
#endif
  }
};

// Tile functions by [rows - 1] for one (bits, offset, scale type), per mode.
struct Tiles {
  std::array<TileFn, kMR> f32;
  std::array<TileFn, kMRI_ONE> i8, i16;
  const TileFn* get(int mode) const {
    return mode == 0 ? f32.data() : mode == 1 ? i8.data() : i16.data();
  }
};
template <int BITS, bool OFF, typename ST>
Tiles make_tiles() {
  return {table<F32, BITS, OFF, ST>(std::make_integer_sequence<int, kMR>{}),
          table<I8, BITS, OFF, ST>(std::make_integer_sequence<int, kMRI_ONE>{}),
          table<I16, BITS, OFF, ST>(std::make_integer_sequence<int, kMRI_ONE>{})};
}
const Tiles& tiles(int bits, bool off, bool half) {
  using H = uint16_t;
  static const Tiles t[8] = {
      make_tiles<4, false, float>(), make_tiles<4, false, H>(), make_tiles<4, true, float>(),
      make_tiles<4, true, H>(),      make_tiles<8, false, float>(), make_tiles<8, false, H>(),
      make_tiles<8, true, float>(),  make_tiles<8, true, H>()};
  return t[(bits == 8 ? 4 : 0) + (off ? 2 : 0) + (half ? 1 : 0)];
}

// qmax / amax: the factor from x to codes. 0 where that is not a finite number: amax 0 or NaN,
// or a block so small (|x| < ~1e-34) that the quotient overflows; such a block quantizes to zeros
// (converting x * inf to an integer is undefined).
inline float code_factor(float qmax, float amax) {
  const float inv = amax > 0.f ? qmax / amax : 0.f;
  return inv <= std::numeric_limits<float>::max() ? inv : 0.f;
}

// Each group of 4 codes as 0, 2, 1, 3: the order tile_int broadcasts int16 codes in.
template <std::size_t... J>
inline llmhal_cpu::vi order_0213(llmhal_cpu::vi c, std::index_sequence<J...>) {
  constexpr int kPerm[4] = {0, 2, 1, 3};
  return __builtin_shufflevector(c, c, (static_cast<int>(J) & ~3) | kPerm[J & 3]...);
}

// Quantize one row (fp32, kpad wide) per U block with the step amax / qmax: codes q (int8, or
// int16 stored in the 0, 2, 1, 3 order), steps d, s = d * sum(codes), and the integer sums si
// (int8 only). A NaN or infinity in a block makes its step (and so its outputs) NaN, as a float
// matmul would; a max alone would skip NaNs. Whole vectors at a time, in three passes over the
// blocks (steps, factors, codes) so that one block's lane folds and division do not stall the
// next: called for every row of every call, the scalar form cost ~0.3 us a row (SmolLM2: ~9 us of
// a 32-row call). Rounding is to nearest even by adding 1.5 * 2^23 (|x * factor| <= qmax), with no
// FMA contraction: the codes of every build equal std::nearbyint's, so results are identical
// across builds.
template <typename Code>
LLMHAL_NO_FMA_CONTRACTION void quantize_row(const float* x, int64_t kpad, int unit, float qmax,
                                            Code* q, float* d, float* s, int32_t* si) {
  LLMHAL_NO_FMA_CONTRACTION_BODY
  using llmhal_cpu::vf;
  using llmhal_cpu::vi;
  using llmhal_cpu::W;
  typedef Code vc __attribute__((vector_size(W * sizeof(Code))));
  const vf magic = vf{} + 12582912.f;
  const int64_t nu = kpad / unit;
  for (int64_t u = 0; u < nu; ++u) {
    const float* xb = x + u * unit;
    vf mx = {}, poison = {};
    for (int i = 0; i < unit; i += W) {
      const vf v = llmhal_cpu::vload(xb + i);
      const vf a = v < 0.f ? -v : v;
      mx = a > mx ? a : mx;
      poison += v * 0.f;
    }
    d[u] = llmhal_cpu::hmax(mx) + llmhal_cpu::hsum(poison);  // amax for now
  }
  for (int64_t u = 0; u < nu; ++u) {
    const float amax = d[u];
    s[u] = code_factor(qmax, amax);  // the block's factor for now
    d[u] = amax / qmax;
  }
  for (int64_t u = 0; u < nu; ++u) {
    const float* xb = x + u * unit;
    const float inv = s[u];
    vi sum = {};
    Code* qb = q + u * unit;
    for (int i = 0; i < unit; i += W) {
      const vf p = llmhal_cpu::vload(xb + i) * inv;
      vi c = __builtin_convertvector((p + magic) - magic, vi);
      sum += c;
      if constexpr (sizeof(Code) == 2) c = order_0213(c, std::make_index_sequence<W>{});
      const vc narrow = __builtin_convertvector(c, vc);
      std::memcpy(qb + i, &narrow, sizeof narrow);
    }
    // Code sums are exact in float (|sum| <= 32 * 32767 < 2^24).
    const float total = llmhal_cpu::hsum(__builtin_convertvector(sum, vf));
    s[u] = d[u] * total;
    if (si) si[u] = static_cast<int32_t>(total);
  }
}

// Per-thread scratch that only grows (a decode step calls the kernel ~200 times).
struct Scratch {
  std::vector<char> buf;
  char* get(size_t n) {
    if (buf.size() < n + 64) buf.resize(n + 64);
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  }
};
Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

inline size_t align64(size_t n) { return (n + 63) & ~size_t(63); }

}  // namespace

extern "C" {

const char* llmhal_qgemm_isa() { return QG_ISA; }
int64_t llmhal_qgemm_weight_size() { return sizeof(Weight); }
int32_t llmhal_qgemm_rows_per_tile(int32_t mode) { return mode == 0 ? kMR : kMRI; }

// y = x @ W^T (+ bias). x: [m] rows of k elements, row stride x_s (dtype 0 fp32, 1 bf16, 2 fp16);
// y: [m] rows of n, row stride y_s (dtype 0 fp32, 1 bf16); bias: n fp32 or null. mode 0 fp32,
// 1 int8, 2 int16 (see the header). Runs on `threads` OpenMP threads when the work is at least
// `min_parallel` multiply-adds. Returns 0, or -1 for arguments it does not take.
int llmhal_qgemm(const Weight* w, const void* x, int64_t m, int64_t x_s, int32_t x_dtype,
                 void* y, int64_t y_s, int32_t y_dtype, const float* bias, int32_t mode,
                 int32_t threads, int64_t min_parallel) {
  if (m <= 0) return 0;
  if ((w->bits != 4 && w->bits != 8) || mode < 0 || mode > 2 || x_dtype < 0 || x_dtype > 2 ||
      y_dtype < 0 || y_dtype > 1 || w->kpad % w->unit)
    return -1;
  const int64_t nu = w->kpad / w->unit;
  const int64_t blocks = (w->n + 31) / 32 * 2;  // the packing pads to a multiple of kNR <= 2
  const size_t kp = static_cast<size_t>(w->kpad);
  const size_t row_bytes = align64(kp * sizeof(float));
  const int team = std::max(1, threads);
  // x is converted (fp32) or quantized (int8/int16) first; fp32 rows without padding are read in
  // place. Bytes per converted element:
  const int64_t xb = mode == 0 ? 4 : mode;
  const bool direct = mode == 0 && x_dtype == 0 && w->kpad == w->k;
  size_t bytes = 0;
  if (mode == 0 && !direct) bytes = align64(m * kp * 4);
  if (mode != 0) bytes = row_bytes * team + align64(m * kp * xb) + 3 * align64(m * nu * 4);
  char* base = scratch().get(bytes);
  Call c{};
  c.w = w;
  c.m = m;
  c.nu = nu;
  // A U block never straddles two groups (unit_for in quant_gemm.py): a group is a whole number
  // of blocks, or the whole row. A division per block would cost ~40 cycles.
  c.units_per_group = w->groups == 1 ? nu : w->group_size / w->unit;
  c.bias = bias;
  c.y = y;
  c.y_s = y_s;
  c.y_dtype = y_dtype;
  float* xf = reinterpret_cast<float*>(base);  // fp32 mode: converted rows
  float* xrow = xf;                             // integer modes: one fp32 row per thread
  char* xq = base + row_bytes * team;
  float* xd = reinterpret_cast<float*>(xq + align64(m * kp * xb));
  float* xs = xd + align64(m * nu * 4) / 4;
  int32_t* xi = reinterpret_cast<int32_t*>(xs + align64(m * nu * 4) / 4);
  if (mode == 0) {
    c.xf = direct ? static_cast<const float*>(x) : xf;
    c.xf_s = direct ? x_s : w->kpad;
  } else {
    c.xq = reinterpret_cast<int8_t*>(xq);
    c.x16 = reinterpret_cast<int16_t*>(xq);
    c.xd = xd;
    c.xs = xs;
    c.xi = xi;
  }
  const int esize = x_dtype == 0 ? 4 : 2;
  const int mr = mode == 0 ? kMR : kMRI;
  const int one_tile = mode == 0 ? kMR : kMRI_ONE;  // rows that run as one tile
  // Row chunks: enough rows to reuse each weight tile, few enough to keep x in the L2 cache.
  const int64_t chunk_rows = std::max<int64_t>(mr, (int64_t(1) << 17) / (w->kpad * xb) / mr * mr);
  const int64_t row_chunks = (m + chunk_rows - 1) / chunk_rows;
  const int64_t ntiles = (blocks + kNR - 1) / kNR;
  const int64_t items = ntiles * row_chunks;
  const TileFn* tile = tiles(w->bits, w->has_offset != 0, w->half_scales != 0).get(mode);
  const bool parallel = threads > 1 && m * w->n * w->k >= min_parallel && items > 1;
  // Row r of x, converted or quantized, by thread `thread` (its own fp32 staging row).
  auto prepare = [&](int64_t r, int thread) {
    const void* src = static_cast<const char*>(x) + r * x_s * esize;
    if (mode == 0) {
      load_row(src, x_dtype, w->k, w->kpad, xf + r * w->kpad);
      return;
    }
    float* row = xrow + thread * (row_bytes / sizeof(float));
    load_row(src, x_dtype, w->k, w->kpad, row);
    if (mode == 1)
      quantize_row(row, w->kpad, w->unit, 127.f, reinterpret_cast<int8_t*>(xq) + r * w->kpad,
                   xd + r * nu, xs + r * nu, xi + r * nu);
    else
      quantize_row(row, w->kpad, w->unit, 32767.f, reinterpret_cast<int16_t*>(xq) + r * w->kpad,
                   xd + r * nu, xs + r * nu, nullptr);
  };
  // A few rows are prepared before the team starts: one synchronisation per call instead of two
  // (on a busy machine each one can wait out a descheduled thread's time slice). From 4096
  // elements (SmolLM2: 8 rows) the team shares the work: a 32x576 o_proj call 42.6 -> 39 us.
  const bool prep_in_team = parallel && !direct && m * w->kpad >= (int64_t(1) << 12);
  if (!direct && !prep_in_team)
    for (int64_t r = 0; r < m; ++r) prepare(r, 0);
  auto run_item = [&](int64_t it) {
    const int64_t rc = it / ntiles, t = it % ntiles;
    const int64_t r_begin = rc * chunk_rows;
    const int64_t rows = std::min(m, r_begin + chunk_rows) - r_begin;
    // Tiles of near-equal height (32 rows: 6+6+5+5+5+5, not 6x5+2): a short tile reuses each
    // weight load for few rows, and its rows cost up to twice as much.
    const int64_t nt = rows <= one_tile ? 1 : (rows + mr - 1) / mr;
    const int64_t base_rows = rows / nt, extra = rows % nt;
    for (int64_t i = 0, r0 = r_begin; i < nt; ++i) {
      const int64_t h = base_rows + (i < extra);
      tile[h - 1](c, r0, t * kNR);
      r0 += h;
    }
  };
  // Items are handed out one at a time once a call has a full tile of rows (compute-bound): on a
  // shared host one core often runs slower, and equal static halves made the other wait at the
  // closing barrier (2 threads, M=32, SmolLM2 shapes: 2-11% faster, both orders of an interleaved
  // A/B). Fewer rows are memory-bound: each thread then streams one contiguous half of the weight,
  // which the hardware prefetchers follow (interleaved items were up to 6% slower at M=1).
  const bool dynamic = m >= mr;
#pragma omp parallel num_threads(team) if (parallel)
  {
    if (prep_in_team) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < m; ++r) prepare(r, omp_get_thread_num());
    }
    if (dynamic) {
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t it = 0; it < items; ++it) run_item(it);
    } else {
#pragma omp for schedule(static) nowait
      for (int64_t it = 0; it < items; ++it) run_item(it);
    }
  }
  return 0;
}

// The struct form of llmhal_qgemm for recorded steps (see fused_ops.cpp's *_call functions);
// mirrored by QgemmArgs in quant_gemm.py.
struct QgemmArgs {
  const Weight* w;
  const void* x;
  int64_t m, x_s;
  void* y;
  int64_t y_s;
  const float* bias;
  int64_t min_parallel;
  int32_t x_dtype, y_dtype, mode, threads;
};
int llmhal_qgemm_call(const void* p) {
  const auto& a = *static_cast<const QgemmArgs*>(p);
  return llmhal_qgemm(a.w, a.x, a.m, a.x_s, a.x_dtype, a.y, a.y_s, a.y_dtype, a.bias, a.mode,
                      a.threads, a.min_parallel);
}
int64_t llmhal_qgemm_args_size() { return sizeof(QgemmArgs); }

// Exact fp32 rows of the weight: out[i][0..k) = q * scale (+ offset) for row ids[i], rounded as
// the reference dequantization rounds (a product, then a sum: no FMA contraction). For the
// embedding lookups of a tied or quantized table. Returns -1, writing nothing, if an id is not
// in [0, n).
struct RowsArgs {
  const Weight* w;
  const int64_t* ids;
  int64_t count;
  float* out;
};
int llmhal_qgemm_rows_call(const void* p) {
  const auto& a = *static_cast<const RowsArgs*>(p);
  const Weight& w = *a.w;
  for (int64_t i = 0; i < a.count; ++i)
    if (a.ids[i] < 0 || a.ids[i] >= w.n) return -1;
  const int parts = 1 + (w.has_offset != 0);
  const int per_chunk = w.bits == 4 ? 8 : 4;  // codes of one lane in a 64-byte chunk
  const int64_t chunks = w.kpad / per_chunk;
  for (int64_t i = 0; i < a.count; ++i) {
    const int64_t r = a.ids[i], b = r / 16, lane = r % 16;
    const uint8_t* lane_bytes = w.packed + (b * chunks * 16 + lane) * 4;
    float* o = a.out + i * w.k;
    for (int64_t k = 0; k < w.k; ++k) {
      const int64_t c = k / per_chunk, within = k % per_chunk;
      const uint8_t byte = lane_bytes[c * 64 + within % 4];
      const float q = w.bits == 4 ? static_cast<float>(within < 4 ? byte & 15 : byte >> 4)
                                  : static_cast<float>(static_cast<int8_t>(byte));
      const int64_t at = ((b * w.groups + k / w.group_size) * parts) * 16 + lane;
      auto scale = [&](int64_t idx) {
        return w.half_scales ? half_to_f32(static_cast<const uint16_t*>(w.scales)[idx])
                             : static_cast<const float*>(w.scales)[idx];
      };
      volatile float v = q * scale(at);  // stored: the product keeps its rounding (no FMA)
      o[k] = parts == 2 ? v + scale(at + 16) : v;
    }
  }
  return 0;
}
int64_t llmhal_qgemm_rows_args_size() { return sizeof(RowsArgs); }

}  // extern "C"
