// MLA (DeepSeek's Multi-head Latent Attention) decode for a whole step in one call
// (llmhal_cpu/kernels/mla_decode.py, used by the cpu_mla attention backend). "Decode" here is every
// short query run the step leads with: one-token decodes, draft verifications and short prompt
// chunks, each token attending causally to its request's cached tokens (memory-bound work, where
// the absorbed form reads the least).
//
// Through torch, the absorbed decode of one layer is ~15 ops (the W_UK bmm, a cat, a gather of the
// cached latents into a padded [B, S, L + R] tensor, two bmm, the mask, softmax, casts, the W_UV
// bmm) of a few microseconds of dispatch each, and none of them can be recorded in a CPU step
// graph. Here one call does the step's MLA work:
//
//   1. writes every new token's latent [kv_c, k_pe] at its slot (-1: padding, skipped);
//   2. absorbs each query row: q_lat[h] = q_nope[h] @ W_UK[h] (W_UK's rows are read once for
//      all rows; for bf16 on AVX512-BF16 hosts from a copy packed in pairs, see
//      llmhal_mla_pack_pairs), beside its rotated q_pe;
//   3. attends each (query row, group of heads) over the cached latents its position sees (those
//      of its request up to itself), read straight from
//      the paged blocks through the block table: every latent is widened to float32 once and
//      serves all the group's heads (an MQA with one 576-wide head), chunk by chunk with an online
//      softmax, so nothing is gathered or padded;
//   4. applies W_UV to the latent-space output (W_UV's rows read once for all rows).
//
// The step is read from memory (slots, query start offsets, block table, sequence lengths), never
// from the arguments'
// values, so a recorded step graph that replays this call sees each step's own values.
// Activations, weights and the cache share one dtype: float32 or bfloat16 (widened in registers,
// or multiplied on AVX512-BF16 dots: see kBf16Dots); every sum is float32, and without the dots
// every intermediate stays float32 (torch's bf16 path rounds the absorbed query, the probabilities
// and the latent output to bf16, as the dots path does), the output rounded to the model dtype.
//
// Parallel regions use the caller's team size (num_threads(threads)) and run serially through
// if(), as the other kernels here do (see attention/paged_attention.cpp).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "dot_rows.h"
#include "float_bits.h"
#include "simd_math.h"

namespace {

using llmhal_cpu::f32_to_bf16_bits;
using llmhal_cpu::hsum;
using llmhal_cpu::load_w;  // float32 or bf16 (widened) vectors, dot_rows.h
using llmhal_cpu::scalar_w;
using llmhal_cpu::vf;
using llmhal_cpu::vload;
using llmhal_cpu::vstore;
using llmhal_cpu::W;

// Heads attended together by one task: each cached latent is widened (float32) or packed in token
// pairs (bf16 dots) once for all of them. With the dots 32 (the packing is then done a quarter as
// often at 128 heads: 13.0 -> 12.0 ms a V3-shaped batch-8 layer); widened, 16, whose float32
// sums stay in L1.
template <bool kDots>
constexpr int kHeadGroup = kDots ? 32 : 16;
// Cached tokens widened and scored together before the softmax state is updated.
constexpr int kChunk = 32;
// Columns of a packed weight's tile (llmhal_mla_pack_pairs): pair_rows' widest step, so a tile's
// pair rows are one contiguous run that the absorption and W_UV product stream through.
constexpr int64_t kPackTile = 64;

inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = f32_to_bf16_bits(v); }

// dst[0, n) = src widened to float32.
template <typename T>
void widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(dst + i, load_w(src + i));
  for (; i < n; ++i) dst[i] = scalar_w(src[i]);
}

inline void scale_in_place(float a, float* y, int64_t n) {
  const vf av = vf{} + a;
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, vload(y + i) * av);
  for (; i < n; ++i) y[i] *= a;
}

// The two small products of the kernel, register-tiled: the absorption, the attention's
// accumulation and the scores each multiply a few rows (decode rows, heads) by a matrix of a few
// hundred columns, where a plain loop would load and store its accumulator for every multiply-add.

// c[r][0, n) += sum_k a[r][k] * b[k][0, n) for rows r < RB, TV vectors of columns: the RB x TV
// accumulators stay in registers over k. a[r][k] at a + r * a_r + k * a_k; b[k] at b + k * b_k.
template <int RB, int TV, typename TA, typename TB>
inline void mm_tile(const TA* a, int64_t a_r, int64_t a_k, int64_t kk, const TB* b, int64_t b_k,
                    float* c, int64_t c_r) {
  vf acc[RB][TV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < TV; ++v) acc[r][v] = vload(c + r * c_r + v * W);
  for (int64_t k = 0; k < kk; ++k) {
    vf bv[TV];
    for (int v = 0; v < TV; ++v) bv[v] = load_w(b + k * b_k + v * W);
    for (int r = 0; r < RB; ++r) {
      const vf av = vf{} + scalar_w(a[r * a_r + k * a_k]);
      for (int v = 0; v < TV; ++v) acc[r][v] += av * bv[v];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < TV; ++v) vstore(c + r * c_r + v * W, acc[r][v]);
}

template <int RB, typename TA, typename TB>
inline void mm_rows(const TA* a, int64_t a_r, int64_t a_k, int64_t kk, const TB* b, int64_t b_k,
                    int64_t n, float* c, int64_t c_r) {
  constexpr int kTV = W == 16 ? 4 : 2;  // RB x kTV accumulators fit the 32 (16) vector registers
  int64_t j = 0;
  for (; j + kTV * W <= n; j += kTV * W) mm_tile<RB, kTV>(a, a_r, a_k, kk, b + j, b_k, c + j, c_r);
  for (; j + W <= n; j += W) mm_tile<RB, 1>(a, a_r, a_k, kk, b + j, b_k, c + j, c_r);
  for (; j < n; ++j)
    for (int r = 0; r < RB; ++r) {
      float s = 0.f;
      for (int64_t k = 0; k < kk; ++k)
        s += scalar_w(a[r * a_r + k * a_k]) * scalar_w(b[k * b_k + j]);
      c[r * c_r + j] += s;
    }
}

// c[r][0, n) += sum_k a[r][k] * b[k][0, n) for rows r < rows.
template <typename TA, typename TB>
void mm_acc(const TA* a, int64_t a_r, int64_t a_k, int64_t rows, int64_t kk, const TB* b,
            int64_t b_k, int64_t n, float* c, int64_t c_r) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) mm_rows<4>(a + r * a_r, a_r, a_k, kk, b, b_k, n, c + r * c_r, c_r);
  switch (rows - r) {
    case 3: return mm_rows<3>(a + r * a_r, a_r, a_k, kk, b, b_k, n, c + r * c_r, c_r);
    case 2: return mm_rows<2>(a + r * a_r, a_r, a_k, kk, b, b_k, n, c + r * c_r, c_r);
    case 1: return mm_rows<1>(a + r * a_r, a_r, a_k, kk, b, b_k, n, c + r * c_r, c_r);
    default: return;
  }
}

// out[i][j] = scale * a[i] . b[j] (length kk) for i < RA, j < RB: each loaded vector of a row
// serves RB products and each of b RA.
template <int RA, int RB, typename TB>
inline void dot_tile(const float* a, int64_t a_r, const TB* b, int64_t b_r, int64_t kk,
                     float* out, int64_t o_r, float scale) {
  vf acc[RA][RB] = {};
  int64_t k = 0;
  for (; k + W <= kk; k += W) {
    vf av[RA];
    for (int i = 0; i < RA; ++i) av[i] = vload(a + i * a_r + k);
    for (int j = 0; j < RB; ++j) {
      const vf bv = load_w(b + j * b_r + k);
      for (int i = 0; i < RA; ++i) acc[i][j] += av[i] * bv;
    }
  }
  for (int i = 0; i < RA; ++i)
    for (int j = 0; j < RB; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t e = k; e < kk; ++e) s += a[i * a_r + e] * scalar_w(b[j * b_r + e]);
      out[i * o_r + j] = s * scale;
    }
}

// Calls tile.run<RA, RB>(i, j) over an na x nb grid: 4 x 4 tiles, then the edges.
template <typename Tile>
void over_tiles(const Tile& tile, int64_t na, int64_t nb) {
  int64_t i = 0;
  for (; i + 4 <= na; i += 4) {
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) tile.template run<4, 4>(i, j);
    for (; j < nb; ++j) tile.template run<4, 1>(i, j);
  }
  for (; i < na; ++i) {
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) tile.template run<1, 4>(i, j);
    for (; j < nb; ++j) tile.template run<1, 1>(i, j);
  }
}

#if defined(__AVX512BF16__)
template <int RA, int RB>  // the bf16 x bf16 form, defined with the other AVX512-BF16 code below
inline void dot_tile(const uint16_t* a, int64_t a_r, const uint16_t* b, int64_t b_r, int64_t kk,
                     float* out, int64_t o_r, float scale);
#endif

template <typename TA, typename TB>
struct DotTiles {
  const TA* a;
  int64_t a_r;
  const TB* b;
  int64_t b_r, kk;
  float* out;
  int64_t o_r;
  float scale;
  template <int RA, int RB>
  void run(int64_t i, int64_t j) const {
    dot_tile<RA, RB>(a + i * a_r, a_r, b + j * b_r, b_r, kk, out + i * o_r + j, o_r, scale);
  }
};

// out[i * o_r + j] = scale * a[i] . b[j] for i < na, j < nb (a float32, or with AVX512-BF16 both
// bf16: see the bf16 dot_tile below).
template <typename TA, typename TB>
void dots(const TA* a, int64_t a_r, int64_t na, const TB* b, int64_t b_r, int64_t nb,
          int64_t kk, float* out, int64_t o_r, float scale) {
  over_tiles(DotTiles<TA, TB>{a, a_r, b, b_r, kk, out, o_r, scale}, na, nb);
}

#if defined(__AVX512BF16__)
// bf16 x bf16 dot products on AVX512-BF16: 32 products an instruction, twice the widened float32
// multiply-adds. Where the host has them, a bf16 model's scores, attention sums and W_UV product
// use them, with the absorbed query, the probabilities and the latent output rounded to bf16 first
// (where torch's bf16 path rounds them too); sums stay float32. At DeepSeek-V3's shape (128 heads,
// 576-value latents) decode is compute-bound, and the widened float32 path ran at half torch's
// bf16 GEMM speed there.
constexpr bool kBf16Dots = true;

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// out[i][j] = scale * a[i] . b_row(j) over kk bf16 values, bf16 rows on both sides; b_row(j)
// is row j's address (strided rows, or rows gathered from the cache's blocks).
template <int RA, int RB, typename BRow>
inline void dot_tile_bf16(const uint16_t* a, int64_t a_r, BRow b_row, int64_t kk, float* out,
                          int64_t o_r, float scale) {
  __m512 acc[RA][RB];
  for (int i = 0; i < RA; ++i)
    for (int j = 0; j < RB; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= kk; k += 32) {
    __m512bh av[RA];
    for (int i = 0; i < RA; ++i) av[i] = as_bh(_mm512_loadu_si512(a + i * a_r + k));
    for (int j = 0; j < RB; ++j) {
      const __m512bh bv = as_bh(_mm512_loadu_si512(b_row(j) + k));
      for (int i = 0; i < RA; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av[i], bv);
    }
  }
  if constexpr (RA == 4 && RB == 4) {
    // The 16 sums at once (lane 4i + j of the result: acc[i][j]'s), 48 shuffles and adds for
    // what 16 separate reductions take ~110: these were ~8% of a V3-shaped batch-8 call.
    float sums[16];
    _mm512_storeu_ps(sums, llmhal_cpu::reduce16(&acc[0][0]));
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        float s = sums[4 * i + j];
        for (int64_t e = k; e < kk; ++e) s += scalar_w(a[i * a_r + e]) * scalar_w(b_row(j)[e]);
        out[i * o_r + j] = s * scale;
      }
    return;
  }
  for (int i = 0; i < RA; ++i)
    for (int j = 0; j < RB; ++j) {
      float s = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t e = k; e < kk; ++e) s += scalar_w(a[i * a_r + e]) * scalar_w(b_row(j)[e]);
      out[i * o_r + j] = s * scale;
    }
}

// dot_tile for bf16 rows on both sides: out[i][j] = scale * a[i] . b[j] over kk bf16 values.
template <int RA, int RB>
inline void dot_tile(const uint16_t* a, int64_t a_r, const uint16_t* b, int64_t b_r, int64_t kk,
                      float* out, int64_t o_r, float scale) {
  dot_tile_bf16<RA, RB>(a, a_r, [=](int j) { return b + j * b_r; }, kk, out, o_r, scale);
}

// dot_tile over cached latents read in place: b[j] is token j's row (the tokens of a chunk lie in
// different cache blocks), which saves copying every latent once per head group.
template <int RA, int RB>
inline void dot_tile_rows(const uint16_t* a, int64_t a_r, const uint16_t* const* b, int64_t kk,
                          float* out, int64_t o_r, float scale) {
  dot_tile_bf16<RA, RB>(a, a_r, [=](int j) { return b[j]; }, kk, out, o_r, scale);
}

struct DotRowTiles {
  const uint16_t* a;
  int64_t a_r;
  const uint16_t* const* b;
  int64_t kk;
  float* out;
  int64_t o_r;
  float scale;
  template <int RA, int RB>
  void run(int64_t i, int64_t j) const {
    dot_tile_rows<RA, RB>(a + i * a_r, a_r, b + j, kk, out + i * o_r + j, o_r, scale);
  }
};

// out[i * o_r + j] = scale * a[i] . b[j] for i < na, j < nb, b given by its rows.
void dots_rows(const uint16_t* a, int64_t a_r, int64_t na, const uint16_t* const* b, int64_t nb,
               int64_t kk, float* out, int64_t o_r, float scale) {
  over_tiles(DotRowTiles{a, a_r, b, kk, out, o_r, scale}, na, nb);
}

// A chunk's probabilities [nh][kChunk] as bf16 token pairs [nh][kChunk / 2] (an odd last token's
// pair has a zero high half). A full chunk converts 32 a head in one instruction (round to nearest
// even, as f32_to_bf16_bits; the scalar loop cost ~9% of a batch-8 call at the bench shape).
void prob_pairs(const float* probs, int64_t nh, int64_t nc, uint32_t* out) {
  static_assert(kChunk == 32, "one conversion a head");
  for (int64_t hh = 0; hh < nh; ++hh) {
    const float* p = probs + hh * kChunk;
    uint32_t* o = out + hh * (kChunk / 2);
    if (nc == kChunk) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
      _mm512_storeu_si512(o, (__m512i)v);
      continue;
    }
    for (int64_t jp = 0; 2 * jp < nc; ++jp) {
      const uint32_t hi = 2 * jp + 1 < nc ? f32_to_bf16_bits(p[2 * jp + 1]) : 0u;
      o[jp] = f32_to_bf16_bits(p[2 * jp]) | hi << 16;
    }
  }
}

// The attention sums over token pairs: c[r][0, n) += sum_jp p[r][jp] . lat[jp][0, n), where each
// uint32 holds two bf16 (tokens 2jp and 2jp + 1: the pair the dot instruction multiplies and adds).
template <int RB, int TV>
inline void pair_tile(const uint32_t* p, int64_t p_r, int64_t np, const uint32_t* lat,
                      int64_t lat_r, float* c, int64_t c_r) {
  __m512 acc[RB][TV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < TV; ++v) acc[r][v] = _mm512_loadu_ps(c + r * c_r + 16 * v);
  for (int64_t jp = 0; jp < np; ++jp) {
    __m512bh bv[TV];
    for (int v = 0; v < TV; ++v) bv[v] = as_bh(_mm512_loadu_si512(lat + jp * lat_r + 16 * v));
    for (int r = 0; r < RB; ++r) {
      const __m512bh av = as_bh(_mm512_set1_epi32(static_cast<int>(p[r * p_r + jp])));
      for (int v = 0; v < TV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < TV; ++v) _mm512_storeu_ps(c + r * c_r + 16 * v, acc[r][v]);
}

inline float pair_dot(uint32_t a, uint32_t b) {
  return scalar_w(static_cast<uint16_t>(a)) * scalar_w(static_cast<uint16_t>(b)) +
         scalar_w(static_cast<uint16_t>(a >> 16)) * scalar_w(static_cast<uint16_t>(b >> 16));
}

template <int RB>
inline void pair_rows(const uint32_t* p, int64_t p_r, int64_t np, const uint32_t* lat,
                      int64_t lat_r, int64_t n, float* c, int64_t c_r) {
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) pair_tile<RB, 4>(p, p_r, np, lat + j, lat_r, c + j, c_r);
  for (; j + 16 <= n; j += 16) pair_tile<RB, 1>(p, p_r, np, lat + j, lat_r, c + j, c_r);
  for (; j < n; ++j)
    for (int r = 0; r < RB; ++r) {
      float s = 0.f;
      for (int64_t jp = 0; jp < np; ++jp) s += pair_dot(p[r * p_r + jp], lat[jp * lat_r + j]);
      c[r * c_r + j] += s;
    }
}

void pair_acc(const uint32_t* p, int64_t p_r, int64_t rows, int64_t np, const uint32_t* lat,
              int64_t lat_r, int64_t n, float* c, int64_t c_r) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pair_rows<4>(p + r * p_r, p_r, np, lat, lat_r, n, c + r * c_r, c_r);
  switch (rows - r) {
    case 3: return pair_rows<3>(p + r * p_r, p_r, np, lat, lat_r, n, c + r * c_r, c_r);
    case 2: return pair_rows<2>(p + r * p_r, p_r, np, lat, lat_r, n, c + r * c_r, c_r);
    case 1: return pair_rows<1>(p + r * p_r, p_r, np, lat, lat_r, n, c + r * c_r, c_r);
    default: return;
  }
}

// out[jp][0, n) = the pairs of rows 2jp and 2jp + 1 of x (given by its rows; a missing last odd
// row reads as zeros), for nc rows.
void pack_pairs(const uint16_t* const* x, int64_t nc, int64_t n, uint32_t* out) {
  for (int64_t jp = 0; jp * 2 < nc; ++jp) {
    const uint16_t* lo = x[2 * jp];
    const uint16_t* hi = 2 * jp + 1 < nc ? x[2 * jp + 1] : nullptr;
    uint32_t* o = out + jp * n;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + j)));
      const __m512i b = hi ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + j)))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(o + j, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
    for (; j < n; ++j) o[j] = lo[j] | (hi ? static_cast<uint32_t>(hi[j]) << 16 : 0u);
  }
}

// c[r][0, n) += the products of rows r < rows of p (pairs, row stride p_r) with a weight packed by
// llmhal_mla_pack_pairs (column tiles of kPackTile, each np pair rows of its width).
void pair_acc_tiled(const uint32_t* p, int64_t p_r, int64_t rows, int64_t np, const uint32_t* w,
                    int64_t n, float* c, int64_t c_r) {
  for (int64_t j = 0; j < n; j += kPackTile) {
    const int64_t tw = std::min<int64_t>(kPackTile, n - j);
    pair_acc(p, p_r, rows, np, w + j * np, tw, tw, c + j, c_r);
  }
}
#else
constexpr bool kBf16Dots = false;
}  // namespace
// Declared only, with external linkage: the calls sit in branches discarded without AVX512-BF16.
void pair_acc(const uint32_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, int64_t,
              float*, int64_t);
void pair_acc_tiled(const uint32_t*, int64_t, int64_t, int64_t, const uint32_t*, int64_t, float*,
                    int64_t);
void pack_pairs(const uint16_t* const*, int64_t, int64_t, uint32_t*);
void prob_pairs(const float*, int64_t, int64_t, uint32_t*);
void dots_rows(const uint16_t*, int64_t, int64_t, const uint16_t* const*, int64_t, int64_t, float*,
               int64_t, float);
namespace {
#endif

// out[r][0, ceil(k / 2)) = rows r < rows of x (k bf16 values, row stride x_r) as pairs, the low
// half the even value (the order the dot instruction pairs them in); an odd k's last pair has a
// zero high half.
inline void row_pairs(const uint16_t* x, int64_t x_r, int64_t rows, int64_t k, uint32_t* out) {
  const int64_t np = (k + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* s = x + r * x_r;
    uint32_t* o = out + r * np;
    std::memcpy(o, s, (k / 2) * sizeof(uint32_t));  // little-endian: s[2j] is the low half
    if (k % 2) o[np - 1] = s[k - 1];
  }
}

// x rounded to bf16 (n values).
inline void round_bf16(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16_bits(x[i]);
}

}  // namespace

extern "C" {

// Mirrors MlaDecodeArgs in mla_decode.py. Element strides; q, kv_c, k_pe need contiguous rows,
// the cache, W_UK [H, nope, L], W_UV [H, v, L] and out are contiguous.
struct MlaDecodeArgs {
  const void* q;  // [q_rows >= qsl[reqs], H, nope + rope]: token stride q_s, head stride q_hs
  int64_t q_s, q_hs;
  const void* kv_c;  // [t, L], row stride c_s
  int64_t c_s;
  const void* k_pe;  // [t, rope], row stride pe_s
  int64_t pe_s;
  void* cache;  // [num_slots, L + rope]
  int64_t num_slots;
  const int64_t* slots;  // [t]; -1 = not written
  const int32_t* query_start_loc;  // [reqs + 1]: request r's query rows are [qsl[r], qsl[r+1])
  const int32_t* block_table;  // [>= reqs, bt_s]; a row's first ceil(seq_len / block_size) read
  int64_t bt_s;
  const int32_t* seq_lens;  // [>= reqs]: each request's tokens, this step's included
  const void* w_uk;
  const void* w_uv;
  // W_UK [H, nope, L] and W_UV's transpose [H, L, v] packed by llmhal_mla_pack_pairs (bf16 with
  // AVX512-BF16 only; null: the products read w_uk / w_uv).
  const uint32_t* w_uk_pairs;
  const uint32_t* w_uv_pairs;
  void* out;  // [out_rows >= qsl[reqs], H, v]
  int64_t t, reqs;
  int64_t q_rows, out_rows;  // the rows q and out hold (qsl[reqs] is checked against both)
  float scale;
  int32_t heads, nope, rope, v, lora, block_size, threads, bf16;
};

}  // extern "C"

namespace {

// Checks everything a call reads through an index before anything is written: returns -1 for a
// slot outside the cache, -2 for a sequence length outside [query rows, bt_s * block_size], -3 for
// a block id outside the cache, -4 for query start offsets that are not increasing from 0 or pass
// the step's tokens, -5 for query rows (qsl[reqs]) beyond the rows of q or of out.
int check(const MlaDecodeArgs& a) {
  for (int64_t i = 0; i < a.t; ++i)
    if (a.slots[i] < -1 || a.slots[i] >= a.num_slots) return -1;
  if (a.reqs > 0 && (a.query_start_loc[0] != 0 || a.query_start_loc[a.reqs] > a.t)) return -4;
  const int64_t rows = a.reqs > 0 ? a.query_start_loc[a.reqs] : 0;
  if (rows > a.q_rows || rows > a.out_rows) return -5;
  const int64_t num_blocks = a.num_slots / a.block_size;
  for (int64_t r = 0; r < a.reqs; ++r) {
    const int64_t q = a.query_start_loc[r + 1] - a.query_start_loc[r];
    if (q < 1) return -4;
    const int64_t s = a.seq_lens[r];
    if (s < q || s > a.bt_s * a.block_size) return -2;
    const int32_t* row = a.block_table + r * a.bt_s;
    for (int64_t k = 0; k < (s + a.block_size - 1) / a.block_size; ++k)
      if (row[k] < 0 || row[k] >= num_blocks) return -3;
  }
  return 0;
}

template <typename T>
int mla_decode(const MlaDecodeArgs& a) {
  if (const int rc = check(a)) return rc;
  const int64_t H = a.heads, L = a.lora, R = a.rope, D = L + R, NOPE = a.nope, V = a.v;
  // Query rows: the tokens of the leading short requests.
  const int64_t B = a.reqs > 0 ? a.query_start_loc[a.reqs] : 0;
  const int threads = a.threads > 1 ? a.threads : 1;
  const T* q = static_cast<const T*>(a.q);
  T* cache = static_cast<T*>(a.cache);

  // 1. The new latents (query rows read their own tokens').
  for (int64_t i = 0; i < a.t; ++i) {
    if (a.slots[i] < 0) continue;
    T* row = cache + a.slots[i] * D;
    std::memcpy(row, static_cast<const T*>(a.kv_c) + i * a.c_s, L * sizeof(T));
    std::memcpy(row + L, static_cast<const T*>(a.k_pe) + i * a.pe_s, R * sizeof(T));
  }
  if (B == 0) return 0;
  // Each row's request and how many cached tokens it sees (its position + 1).
  std::vector<int64_t> row_req(B), row_len(B);
  for (int64_t r = 0; r < a.reqs; ++r)
    for (int64_t i = a.query_start_loc[r]; i < a.query_start_loc[r + 1]; ++i) {
      row_req[i] = r;
      row_len[i] = a.seq_lens[r] - (a.query_start_loc[r + 1] - 1 - i);
    }

  // bf16 dot products where the host has them (see kBf16Dots).
  constexpr bool kDots = kBf16Dots && std::is_same_v<T, uint16_t>;
  // The absorption and W_UV product on them too when the weights come packed in pairs: exact bf16
  // products summed in float32, as the widened multiply-adds sum them (only the order of the sums
  // differs, ~1e-7 relative), at twice their rate and without widening W_UK. At DeepSeek-V3's
  // shape these products were a third of a batch-8 layer.
  const bool packed = kDots && a.w_uk_pairs != nullptr && a.w_uv_pairs != nullptr;

  // 2. Absorbed queries, float32 [B, H, D]: q_nope @ W_UK[h] for every row at once, then q_pe.
  std::vector<float> qlat(B * H * D, 0.f);
  const T* w_uk = static_cast<const T*>(a.w_uk);
#pragma omp parallel num_threads(threads) if (threads > 1 && H > 1)
  {
    const int64_t np = (NOPE + 1) / 2;
    std::vector<uint32_t> q_pairs(packed ? B * np : 0);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; ++h) {
      if (packed) {
        if constexpr (kDots) {
          row_pairs(q + h * a.q_hs, a.q_s, B, NOPE, q_pairs.data());
          pair_acc_tiled(q_pairs.data(), np, B, np, a.w_uk_pairs + h * np * L, L, &qlat[h * D],
                         H * D);
        }
      } else {
        mm_acc(q + h * a.q_hs, a.q_s, 1, B, NOPE, w_uk + h * NOPE * L, L, L, &qlat[h * D], H * D);
      }
      for (int64_t r = 0; r < B; ++r)
        widen(q + r * a.q_s + h * a.q_hs + NOPE, &qlat[(r * H + h) * D + L], R);
    }
  }

  // The absorbed queries rounded once for the dots.
  std::vector<uint16_t> qlat_b(kDots ? B * H * D : 0);
  if constexpr (kDots) round_bf16(qlat.data(), qlat_b.data(), B * H * D);

  // 3. Attention in latent space: olat [B, H, L], normalized.
  std::vector<float> olat(B * H * L);
  constexpr int64_t G = kHeadGroup<kDots>;
  const int64_t groups = (H + G - 1) / G;
#pragma omp parallel num_threads(threads) if (threads > 1 && B * groups > 1)
  {
    std::vector<float> lat(kDots ? 0 : kChunk * D), probs(G * kChunk);
    const uint16_t* lat_rows[kChunk];  // with the dots, the chunk's latents where they lie
    std::vector<uint32_t> lat_pairs(kDots ? kChunk / 2 * L : 0), p_pairs(G * kChunk / 2);
    float m[G], l[G];
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < B * groups; ++task) {
      const int64_t r = task / groups, h0 = (task % groups) * G;
      const int64_t nh = std::min<int64_t>(G, H - h0);
      const int64_t s = row_len[r];
      const int32_t* blocks = a.block_table + row_req[r] * a.bt_s;
      float* acc = &olat[(r * H + h0) * L];
      std::fill(acc, acc + nh * L, 0.f);
      std::fill(m, m + nh, -std::numeric_limits<float>::infinity());
      std::fill(l, l + nh, 0.f);
      for (int64_t j0 = 0; j0 < s; j0 += kChunk) {
        const int64_t nc = std::min<int64_t>(kChunk, s - j0);
        for (int64_t j = 0; j < nc; ++j) {
          const int64_t pos = j0 + j;
          const int64_t slot =
              static_cast<int64_t>(blocks[pos / a.block_size]) * a.block_size + pos % a.block_size;
          if constexpr (kDots)
            lat_rows[j] = cache + slot * D;
          else
            widen(cache + slot * D, &lat[j * D], D);
        }
        if constexpr (kDots)  // scores
          dots_rows(&qlat_b[(r * H + h0) * D], D, nh, lat_rows, nc, D, probs.data(), kChunk,
                    a.scale);
        else
          dots(&qlat[(r * H + h0) * D], D, nh, lat.data(), D, nc, D, probs.data(), kChunk,
               a.scale);
        // Online softmax: rescale what was summed under the old maximum.
        for (int64_t hh = 0; hh < nh; ++hh) {
          float* p = &probs[hh * kChunk];
          float best = m[hh];
          for (int64_t j = 0; j < nc; ++j) best = std::max(best, p[j]);
          const float corr = std::exp(m[hh] - best);
          if (corr != 1.f) scale_in_place(corr, acc + hh * L, L);
          // Vector exp (about 1 ulp, simd_math.h): libm's scalar expf was ~5% of a V3-shaped
          // batch-8 call (a chunk's 16 heads x 32 tokens each).
          const vf bv = vf{} + best;
          vf vsum = vf{};
          int64_t j = 0;
          for (; j + W <= nc; j += W) {
            const vf e = llmhal_cpu::exp_approx(vload(p + j) - bv);
            vstore(p + j, e);
            vsum += e;
          }
          float sum = l[hh] * corr + hsum(vsum);
          for (; j < nc; ++j) {
            p[j] = llmhal_cpu::exp_approx(p[j] - best);
            sum += p[j];
          }
          m[hh] = best;
          l[hh] = sum;
        }
        if constexpr (kDots) {
          const int64_t np = (nc + 1) / 2;
          prob_pairs(probs.data(), nh, nc, p_pairs.data());
          pack_pairs(lat_rows, nc, L, lat_pairs.data());
          pair_acc(p_pairs.data(), kChunk / 2, nh, np, lat_pairs.data(), L, L, acc, L);
        } else {
          mm_acc(probs.data(), kChunk, 1, nh, nc, lat.data(), D, L, acc, L);
        }
      }
      for (int64_t hh = 0; hh < nh; ++hh) scale_in_place(1.f / l[hh], acc + hh * L, L);
    }
  }

  // 4. out[r, h] = W_UV[h] @ olat[r, h], rounded to the model dtype once.
  const T* w_uv = static_cast<const T*>(a.w_uv);
  std::vector<float> outf(B * H * V);
  std::vector<uint16_t> olat_b(kDots ? B * H * L : 0);
  if constexpr (kDots) round_bf16(olat.data(), olat_b.data(), B * H * L);
  std::vector<uint32_t> olat_pairs(packed ? H * B * ((L + 1) / 2) : 0);
#pragma omp parallel for num_threads(threads) if (threads > 1 && H > 1) schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    if (packed) {
      if constexpr (kDots) {
        const int64_t np = (L + 1) / 2;
        // The rounded latent outputs of head h as pairs over L ([B, np], at olat_b's head rows).
        uint32_t* o_pairs = &olat_pairs[h * B * np];
        row_pairs(&olat_b[h * L], H * L, B, L, o_pairs);
        pair_acc_tiled(o_pairs, np, B, np, a.w_uv_pairs + h * np * V, V, &outf[h * V], H * V);
      }
    } else if constexpr (kDots)
      dots(&olat_b[h * L], H * L, B, reinterpret_cast<const uint16_t*>(w_uv) + h * V * L, L, V,
            L, &outf[h * V], H * V, 1.f);
    else
      dots(&olat[h * L], H * L, B, w_uv + h * V * L, L, V, L, &outf[h * V], H * V, 1.f);
  }
  T* out = static_cast<T*>(a.out);
  for (int64_t i = 0; i < B * H * V; ++i) store(out + i, outf[i]);
  return 0;
}

}  // namespace

extern "C" {

int llmhal_mla_decode_call(const void* p) {
  const auto& a = *static_cast<const MlaDecodeArgs*>(p);
  return a.bf16 ? mla_decode<uint16_t>(a) : mla_decode<float>(a);
}

int64_t llmhal_mla_decode_args_size() { return sizeof(MlaDecodeArgs); }

// Whether a bf16 call runs on AVX512-BF16 dots (and so reads packed weights when given them).
int32_t llmhal_mla_decode_bf16_dots() { return kBf16Dots ? 1 : 0; }

// Packs a bf16 weight for the absorption / W_UV product: for each of `heads` matrices of k x n
// (element (i, j) of head h at w[h * h_s + i * k_s + j * n_s]), rows 2i and 2i + 1 become pairs
// (one uint32, row 2i the low half; a missing last row zero), stored in column tiles of kPackTile:
// head h's tile at column j0 holds ceil(k / 2) pair rows of its width, at
// out + h * ceil(k / 2) * n + j0 * ceil(k / 2). Done once per weight (mla_decode.py keeps it).
void llmhal_mla_pack_pairs(const uint16_t* w, int64_t heads, int64_t h_s, int64_t k, int64_t k_s,
                           int64_t n, int64_t n_s, uint32_t* out) {
  const int64_t np = (k + 1) / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j0 = 0; j0 < n; j0 += kPackTile) {
      const int64_t tw = std::min<int64_t>(kPackTile, n - j0);
      uint32_t* tile = out + h * np * n + j0 * np;
      for (int64_t i = 0; i < np; ++i)
        for (int64_t j = 0; j < tw; ++j) {
          const uint16_t* e = w + h * h_s + 2 * i * k_s + (j0 + j) * n_s;
          const uint32_t hi = 2 * i + 1 < k ? e[k_s] : 0u;
          tile[i * tw + j] = e[0] | hi << 16;
        }
    }
}

}  // extern "C"
