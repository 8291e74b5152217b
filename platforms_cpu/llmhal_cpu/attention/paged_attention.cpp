// Paged attention for llmhal's cpu_attn backend, compiled at run time for the host CPU
// (native.py builds it with -march=native, so AVX2, AVX-512 or NEON is whatever the host has).
//
// One call serves every request of a step that is routed here (the decodes, and short query
// chunks): a work item is (new token, key split) over all heads, items run on OpenMP threads, and
// each item walks the token's visible keys block by block straight out of the paged cache, so no
// context is ever gathered into a contiguous copy. The query heads that share a KV head (GQA) are
// processed together so each key/value row is read from memory once. Each tile of keys is read from
// memory front to back before it is computed on (see Worker::touch), and the next tile is
// prefetched a little at a time while the current one is computed.
//
// The same call first stores the step's new keys and values when asked (caches in the model
// dtype; the caller quantizes fp8 ones), so a decode step costs one call per layer.
//
// Cache layout, per K and V: [num_blocks, block_size, num_kv_heads, head_size] with arbitrary
// strides (given in elements); the last dimension must be contiguous. Element types: fp32, bf16,
// fp16, fp8 e4m3fn, fp8 e5m2, converted to fp32 per tile with integer arithmetic that any compiler
// vectorizes, or through the hardware half conversion where F16C exists. Queries arrive as fp32,
// output is fp32; the caller converts.
//
// Semantics (the contract in llmhal/attention/backend.py): query token i of request r sits at
// position p = seq_len[r] - q_len[r] + i and sees keys lo <= k <= p, lo = max(0, p - window + 1)
// when window > 0. Scores are (q . k) * scale * k_scale, optionally c * tanh(s / c); the output
// is softmax(scores) @ v * v_scale.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include <omp.h>

#include "../kernels/float_bits.h"
#include "../kernels/simd_math.h"
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// ------------------------------------------------------------------------------ vectors
using llmhal_cpu::exp_approx;
using llmhal_cpu::hsum;
using llmhal_cpu::lane_index;
using llmhal_cpu::vf;
using llmhal_cpu::vi;
using llmhal_cpu::vload;
using llmhal_cpu::vstore;
using llmhal_cpu::W;
// Vectors of one accumulator row kept in registers: 32 registers with AVX-512, else 16.
constexpr int kChunk = W == 16 ? 4 : 2;

// ------------------------------------------------------------------------- conversions
using llmhal_cpu::bits_to_f32;
using llmhal_cpu::half_bits_to_f32;

// On x86 with F16C (every AVX2 CPU) `load8` converts eight elements at a time through the
// hardware's half-to-float instruction instead of half_bits_to_f32: fp16 directly, fp8 after
// widening to a half.
#if defined(__F16C__) && defined(__AVX2__)
#define LLMHAL_HW_HALF 1
inline void store8(float* dst, __m128i halves) { _mm256_storeu_ps(dst, _mm256_cvtph_ps(halves)); }
inline __m128i widen8(const uint8_t* src) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
}
#endif

struct F32 {
  using T = float;
  static constexpr bool kDirect = true;
  static constexpr bool kHw8 = false;
  static inline float load(T x) { return x; }
};

struct BF16 {
  using T = uint16_t;
  static constexpr bool kDirect = false;
  static constexpr bool kHw8 = false;  // a shift: the plain loop vectorizes well
  static inline float load(T x) { return bits_to_f32(static_cast<uint32_t>(x) << 16); }
};

struct F16 {
  using T = uint16_t;
  static constexpr bool kDirect = false;
  static constexpr bool kHw8 = true;
  static inline float load(T x) { return half_bits_to_f32(x); }
#ifdef LLMHAL_HW_HALF
  static inline void load8(const T* src, float* dst) {
    store8(dst, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
#endif
};

struct E4M3 {  // float8_e4m3fn: bias 7, no infinities, 0x7f/0xff are NaN
  using T = uint8_t;
  static constexpr bool kDirect = false;
  static constexpr bool kHw8 = true;
  static inline float load(T x) {
    const uint32_t sign = (static_cast<uint32_t>(x) & 0x80u) << 24;
    const uint32_t mag = x & 0x7fu;
    const float sub = static_cast<float>(static_cast<int32_t>(mag)) * 0x1p-9f;
    const float normal = bits_to_f32(sign | ((mag << 20) + (120u << 23)));
    const float v = (mag >> 3) == 0 ? (sign ? -sub : sub) : normal;
    return mag == 0x7fu ? std::numeric_limits<float>::quiet_NaN() : v;
  }
#ifdef LLMHAL_HW_HALF
  // The e4m3 bits placed in a half (sign, then exponent and mantissa shifted by 7) read as the
  // value times 2^-8, subnormals included; only the NaN code needs a fix-up.
  static inline void load8(const T* src, float* dst) {
    const __m128i x = widen8(src);
    const __m128i mag = _mm_and_si128(x, _mm_set1_epi16(0x7f));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
    const __m256 f = _mm256_mul_ps(
        _mm256_cvtph_ps(_mm_or_si128(sign, _mm_slli_epi16(mag, 7))), _mm256_set1_ps(256.f));
    const __m256 nan = _mm256_castsi256_ps(
        _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
    _mm256_storeu_ps(dst, _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan));
  }
#endif
};

struct E5M2 {  // float8_e5m2 is the high byte of an IEEE half
  using T = uint8_t;
  static constexpr bool kDirect = false;
  static constexpr bool kHw8 = true;
  static inline float load(T x) { return half_bits_to_f32(static_cast<uint32_t>(x) << 8); }
#ifdef LLMHAL_HW_HALF
  static inline void load8(const T* src, float* dst) {
    store8(dst, _mm_slli_epi16(widen8(src), 8));
  }
#endif
};

template <typename C>
inline void convert_row(const typename C::T* src, float* dst, int D) {
  int d = 0;
#ifdef LLMHAL_HW_HALF
  if constexpr (C::kHw8)
    for (; d + 8 <= D; d += 8) C::load8(src + d, dst + d);
#endif
#pragma omp simd
  for (int e = d; e < D; ++e) dst[e] = C::load(src[e]);
}

// ------------------------------------------------------------------------------ kernel
// Keys of one item are processed in tiles of at most this many tokens (bounded scratch).
constexpr int kTile = 32;

struct Args {
  const void* q;  // float32, or bf16 when q_bf16

  int64_t q_s_tok, q_s_head;
  const void* k_cache;
  const void* v_cache;
  int64_t c_s_block, c_s_tok, c_s_head;
  const int32_t* block_table;
  int64_t bt_s;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int32_t num_reqs;
  void* out;  // float32, or bf16 when o_bf16 (each value rounded once, as torch's cast rounds)
  int64_t o_s_tok, o_s_head;
  int32_t num_heads, num_kv_heads, head_size, block_size;
  float scale, soft_cap, k_scale, v_scale;
  int32_t window;
  int32_t num_threads;
  int32_t min_split_tokens;
  // The step's new keys/values to store first (num_new tokens; 0: the caller stored them), in
  // the cache's element type, with the slot of each token (-1: padding, not stored).
  const void* new_k;
  const void* new_v;
  int64_t nk_s_tok, nk_s_head, nv_s_tok, nv_s_head;
  const int64_t* slot_mapping;
  int64_t num_new;
  // A bf16 model's query and output are read and written as they are: no float32 copies around
  // the call, so a bf16 decode step records as a step graph (step_graph.py).
  int32_t q_bf16, o_bf16;
};

// One output row: v[0:D] * inv, stored as float32 or bf16.
inline void store_out(const Args& a, int64_t tok, int g, const float* v, float inv, int D) {
  const int64_t at = tok * a.o_s_tok + static_cast<int64_t>(g) * a.o_s_head;
  if (a.o_bf16) {
    uint16_t* o = static_cast<uint16_t*>(a.out) + at;
    for (int d = 0; d < D; ++d) o[d] = llmhal_cpu::f32_to_bf16_bits(v[d] * inv);
    return;
  }
  float* o = static_cast<float*>(a.out) + at;
#pragma omp simd
  for (int d = 0; d < D; ++d) o[d] = v[d] * inv;
}

// Stores the step's keys and values at their slots: one row of head_size elements per token and
// KV head, copied as bytes (the cache holds the model dtype here; fp8 is quantized by the caller).
template <typename C>
void store_new_kv(const Args& a) {
  using T = typename C::T;
  const int Hkv = a.num_kv_heads;
  const size_t row = static_cast<size_t>(a.head_size) * sizeof(T);
  const int threads = a.num_new * Hkv >= 256 ? std::max(1, a.num_threads) : 1;
// Always ask for the caller's full team and serialise with if(): libgomp parks idle pool threads
// in a spin-wait, and alternating team sizes with torch's own regions made every later torch op
// wait out that spin (decode fell from ~110 to ~3 tokens/s with 2 threads).
#pragma omp parallel for num_threads(std::max(1, a.num_threads)) if (threads > 1) schedule(static)
  for (int64_t t = 0; t < a.num_new; ++t) {
    const int64_t slot = a.slot_mapping[t];
    if (slot < 0) continue;
    const int64_t dst = (slot / a.block_size) * a.c_s_block + (slot % a.block_size) * a.c_s_tok;
    for (int h = 0; h < Hkv; ++h) {
      std::memcpy(static_cast<T*>(const_cast<void*>(a.k_cache)) + dst + h * a.c_s_head,
                  static_cast<const T*>(a.new_k) + t * a.nk_s_tok + h * a.nk_s_head, row);
      std::memcpy(static_cast<T*>(const_cast<void*>(a.v_cache)) + dst + h * a.c_s_head,
                  static_cast<const T*>(a.new_v) + t * a.nv_s_tok + h * a.nv_s_head, row);
    }
  }
}

// Sums of the lanes of W vectors at once: v[t] holds partial sums of score t; the result's lane t
// is their total. A lane-by-lane horizontal sum per score (a chain of W dependent adds) cost
// several times the dot product itself; folding pairs of vectors (two shuffles and an add each)
// costs W - 1 folds for W scores. Fold level H pairs blocks of H lanes: even output blocks take
// a's two halves of a 2H-lane block, odd ones b's.
constexpr int fold_src(int h, int j, bool second) {
  const int blk = j / h, w = j % h;
  if (blk % 2 == 0) return (second ? blk + 1 : blk) * h + w;
  return W + (second ? blk : blk - 1) * h + w;
}

template <int H, std::size_t... J>
inline vf fold_pair(vf a, vf b, std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, fold_src(H, static_cast<int>(J), false)...) +
         __builtin_shufflevector(a, b, fold_src(H, static_cast<int>(J), true)...);
}

template <int H>
inline void fold_levels(vf* v) {  // 2H vectors in, H out
  for (int p = 0; p < H; ++p) v[p] = fold_pair<H>(v[2 * p], v[2 * p + 1], std::make_index_sequence<W>{});
  if constexpr (H > 1) fold_levels<H / 2>(v);
}

// Which lane of the folded vector holds score t (the folds interleave them): worked out at
// compile time by running the folds on labels.
struct FoldOrder {
  int lane_of[W];
  constexpr FoldOrder() : lane_of() {
    int v[W][W] = {};
    for (int t = 0; t < W; ++t)
      for (int j = 0; j < W; ++j) v[t][j] = t;
    for (int h = W / 2; h >= 1; h /= 2)
      for (int p = 0; p < h; ++p) {
        int out[W] = {};
        for (int j = 0; j < W; ++j) {
          const int blk = j / h, w = j % h;
          out[j] = blk % 2 == 0 ? v[2 * p][blk * h + w] : v[2 * p + 1][(blk - 1) * h + w];
        }
        for (int j = 0; j < W; ++j) v[p][j] = out[j];
      }
    for (int j = 0; j < W; ++j) lane_of[v[0][j]] = j;
  }
};
constexpr FoldOrder kFoldOrder{};

template <std::size_t... J>
inline vf in_order(vf r, std::index_sequence<J...>) {
  return __builtin_shufflevector(r, r, kFoldOrder.lane_of[J]...);
}

// s[t] = q . k_t for one query row and n key rows (stride ks), W keys at a time; D % W == 0.
inline void row_scores(const float* q, int D, const float* k, int64_t ks, int n, float* s) {
  for (int t0 = 0; t0 < n; t0 += W) {
    const int m = std::min(W, n - t0);
    // W independent accumulators (one chain of FMAs per key would wait on the FMA latency);
    // past the last key the rows repeat it, and those lanes are not stored.
    const float* rows[W];
    for (int t = 0; t < W; ++t) rows[t] = k + (t0 + std::min(t, m - 1)) * ks;
    vf acc[W] = {};
    for (int d = 0; d < D; d += W) {
      const vf qv = vload(q + d);
      for (int t = 0; t < W; ++t) acc[t] += qv * vload(rows[t] + d);
    }
    fold_levels<W / 2>(acc);
    const vf r = in_order(acc[0], std::make_index_sequence<W>{});
    if (m == W) {
      vstore(s + t0, r);
    } else {
      for (int t = 0; t < m; ++t) s[t0 + t] = r[t];
    }
  }
}

// s[i * kTile + t] = q_i . k_t for GB query rows (stride D) and n key rows (stride ks); two keys
// at a time so each query load feeds two FMAs.
template <int GB>
inline void tile_scores(const float* q, int D, const float* k, int64_t ks, int n, float* s) {
  int t = 0;
  for (; t + 2 <= n; t += 2) {
    const float* k0 = k + t * ks;
    const float* k1 = k0 + ks;
    vf a0[GB] = {}, a1[GB] = {};
    int d = 0;
    for (; d + W <= D; d += W) {
      const vf x0 = vload(k0 + d), x1 = vload(k1 + d);
      for (int i = 0; i < GB; ++i) {
        const vf qv = vload(q + i * D + d);
        a0[i] += qv * x0;
        a1[i] += qv * x1;
      }
    }
    for (int i = 0; i < GB; ++i) {
      float s0 = hsum(a0[i]), s1 = hsum(a1[i]);
      for (int e = d; e < D; ++e) {
        s0 += q[i * D + e] * k0[e];
        s1 += q[i * D + e] * k1[e];
      }
      s[i * kTile + t] = s0;
      s[i * kTile + t + 1] = s1;
    }
  }
  for (; t < n; ++t) {
    const float* k0 = k + t * ks;
    vf a0[GB] = {};
    int d = 0;
    for (; d + W <= D; d += W) {
      const vf x0 = vload(k0 + d);
      for (int i = 0; i < GB; ++i) a0[i] += vload(q + i * D + d) * x0;
    }
    for (int i = 0; i < GB; ++i) {
      float s0 = hsum(a0[i]);
      for (int e = d; e < D; ++e) s0 += q[i * D + e] * k0[e];
      s[i * kTile + t] = s0;
    }
  }
}

// acc_i += sum_t p[i * kTile + t] * v_t for GB accumulator rows (stride D); a chunk of each
// accumulator row stays in registers across the whole tile.
template <int GB, int C>
inline int tile_accumulate_chunks(
    float* acc, int D, int d, const float* p, const float* v, int64_t vs, int n) {
  for (; d + C * W <= D; d += C * W) {
    vf a[GB][C];
    for (int i = 0; i < GB; ++i)
      for (int j = 0; j < C; ++j) a[i][j] = vload(acc + i * D + d + j * W);
    for (int t = 0; t < n; ++t) {
      vf x[C];
      for (int j = 0; j < C; ++j) x[j] = vload(v + t * vs + d + j * W);
      for (int i = 0; i < GB; ++i) {
        const vf pb = vf{} + p[i * kTile + t];
        for (int j = 0; j < C; ++j) a[i][j] += pb * x[j];
      }
    }
    for (int i = 0; i < GB; ++i)
      for (int j = 0; j < C; ++j) vstore(acc + i * D + d + j * W, a[i][j]);
  }
  return d;
}

template <int GB>
inline void tile_accumulate(float* acc, int D, const float* p, const float* v, int64_t vs, int n) {
  int d = tile_accumulate_chunks<GB, kChunk>(acc, D, 0, p, v, vs, n);
  d = tile_accumulate_chunks<GB, 1>(acc, D, d, p, v, vs, n);
  for (; d < D; ++d)
    for (int i = 0; i < GB; ++i) {
      float s = acc[i * D + d];
      for (int t = 0; t < n; ++t) s += p[i * kTile + t] * v[t * vs + d];
      acc[i * D + d] = s;
    }
}

// Per-thread scratch that only grows: a decode step calls the kernel once per layer, and
// allocating a worker's buffers on every call costs as much as a short context's attention.
struct Scratch {
  std::vector<float> buf;
  float* get(size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
};
inline Scratch& scratch(int i) {
  static thread_local Scratch s[2];  // 0: the worker's buffers, 1: the caller's
  return s[i];
}

template <typename C>
struct Worker {
  using T = typename C::T;
  const Args& a;
  int G, D, HG;  // query heads per KV head, head size, KV heads
  size_t rows;  // query rows (all heads)
  float *qs, *acc, *scores, *kbuf, *vbuf, *m, *l;

  // Whether a token's rows for all KV heads are one contiguous run (the usual layout): then a
  // tile is one span of memory, touched and prefetched in address order.
  bool spans;
  // The next tile's spans, prefetched pf_lines lines at a time between pieces of work.
  const char *pf_k = nullptr, *pf_v = nullptr;
  int64_t pf_end = 0, pf_pos = 0, pf_lines = 0;

  explicit Worker(const Args& args)
      : a(args), G(args.num_heads / args.num_kv_heads), D(args.head_size), HG(args.num_kv_heads),
        spans(args.c_s_head == args.head_size &&
              args.c_s_tok == static_cast<int64_t>(args.num_kv_heads) * args.head_size) {
    rows = static_cast<size_t>(HG) * G;
    const size_t tile = static_cast<size_t>(kTile) * D;
    // m and l lead so that [m, l, acc] is exactly a split's partial result, copied in one go.
    m = scratch(0).get(rows * (2 + 2 * D + kTile) + 2 * tile);
    l = m + rows;
    acc = l + rows;
    qs = acc + rows * D;
    scores = qs + rows * D;
    kbuf = scores + rows * kTile;
    vbuf = kbuf + tile;
  }

  // Rows of a tile: direct pointers into an fp32 cache, or converted into a scratch buffer.
  inline const float* tile_rows(const T* base, int n, float* buf) {
    if constexpr (C::kDirect) {
      (void)n;
      (void)buf;
      return reinterpret_cast<const float*>(base);
    } else {
      for (int t = 0; t < n; ++t) {
        convert_row<C>(base + t * a.c_s_tok, buf + static_cast<size_t>(t) * D, D);
      }
      return buf;
    }
  }

  // Reads one byte of every cache line of a tile's span (n token rows, all KV heads), in address
  // order, before the tile is computed on. The computation walks the tile one KV head at a time,
  // i.e. strided through memory; from DRAM that order ran at about half the speed of reading the
  // same bytes front to back, which the hardware prefetcher streams (Zen 3, 2 threads, 32
  // decodes of 96 keys, SmolLM2's heads: reading alone 550 vs 300 us a layer). Software
  // prefetches of the whole span in address order did not help; real loads do. With
  // prefetch_next, the whole call went from ~550 to ~340 us a layer on that workload, and from
  // ~400 to ~220 us for one decode of 2000 keys (medians of interleaved runs, fp32 cache).
  inline int64_t span_bytes(int n) const {  // n token rows of all KV heads (when spans)
    return static_cast<int64_t>(n) * a.c_s_tok * static_cast<int64_t>(sizeof(T));
  }

  __attribute__((always_inline)) inline void touch(const T* base, int n) const {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(base);
    const int64_t bytes = span_bytes(n);
    unsigned sum = 0;
    for (int64_t b = 0; b < bytes; b += 64) sum += p[b];
    __asm__ volatile("" : : "r"(sum));  // keeps the loads
  }

  // Starts prefetching the next tile (n token rows at K and V offset `next`), spread over the
  // current tile's work: pf_step is called HG * G + HG times per tile. Issued in one burst,
  // the prefetches stalled the core (a burst of hundreds of lines) and gained nothing; spread out
  // they overlap the loads with the computation (same workload: 460 -> 390 us a layer, median of
  // interleaved runs). Always inlined: GCC deems an out-of-line prefetch-only function free of
  // effects and drops the call.
  __attribute__((always_inline)) inline void prefetch_next(const T* kc, const T* vc, int64_t next,
                                                            int n) {
    pf_k = reinterpret_cast<const char*>(kc + next);
    pf_v = reinterpret_cast<const char*>(vc + next);
    pf_end = span_bytes(n);
    pf_pos = 0;
    const int64_t lines = (pf_end + 63) / 64, calls = static_cast<int64_t>(HG) * (G + 1);
    pf_lines = (lines + calls - 1) / calls;
  }
  __attribute__((always_inline)) inline void pf_step() {
    for (int64_t i = 0; i < pf_lines && pf_pos < pf_end; ++i, pf_pos += 64) {
      __builtin_prefetch(pf_k + pf_pos, 0, 1);
      __builtin_prefetch(pf_v + pf_pos, 0, 1);
    }
  }

  // Software prefetch of one head's rows of a tile, for layouts whose token rows are not one span.
  __attribute__((always_inline)) inline void prefetch_rows(const T* base, int n, int h) const {
    const int64_t row = static_cast<int64_t>(D) * sizeof(T);
    for (int t = 0; t < n; ++t) {
      const char* p = reinterpret_cast<const char*>(base + t * a.c_s_tok + h * a.c_s_head);
      for (int64_t b = 0; b < row; b += 64) __builtin_prefetch(p + b, 0, 3);
    }
  }

  inline int tile_len(int64_t pos, int64_t end) const {
    const int64_t off = pos % a.block_size;
    return static_cast<int>(std::min<int64_t>({end - pos, a.block_size - off, kTile}));
  }

  inline int64_t tile_base(const int32_t* bt, int64_t pos) const {
    return bt[pos / a.block_size] * a.c_s_block + (pos % a.block_size) * a.c_s_tok;
  }

  // Scores of the G query rows starting at `row` against n key rows.
  void scores_group(int row, const float* krow, int64_t ks, int n) {
    float* q = qs + static_cast<size_t>(row) * D;
    float* s = scores + static_cast<size_t>(row) * kTile;
    if (D % W == 0) {
      for (int g = 0; g < G; ++g) {
        pf_step();
        row_scores(q + g * D, D, krow, ks, n, s + g * kTile);
      }
      return;
    }
    for (int g = 0; g < G; ++g) pf_step();
    int g = 0;
    for (; g + 4 <= G; g += 4) tile_scores<4>(q + g * D, D, krow, ks, n, s + g * kTile);
    for (; g + 2 <= G; g += 2) tile_scores<2>(q + g * D, D, krow, ks, n, s + g * kTile);
    for (; g < G; ++g) tile_scores<1>(q + g * D, D, krow, ks, n, s + g * kTile);
  }

  void accumulate_group(int row, const float* vrow, int64_t vs, int n) {
    float* ac = acc + static_cast<size_t>(row) * D;
    const float* p = scores + static_cast<size_t>(row) * kTile;
    pf_step();
    int g = 0;
    for (; g + 4 <= G; g += 4) tile_accumulate<4>(ac + g * D, D, p + g * kTile, vrow, vs, n);
    for (; g + 2 <= G; g += 2) tile_accumulate<2>(ac + g * D, D, p + g * kTile, vrow, vs, n);
    for (; g < G; ++g) tile_accumulate<1>(ac + g * D, D, p + g * kTile, vrow, vs, n);
  }

  // Online softmax over one tile: scores become weights, running max/sum/accumulator rescaled.
  void softmax_update(int n) {
    for (int g = 0; g < HG * G; ++g) {
      float* sg = scores + g * kTile;
      if (a.soft_cap > 0.f) {
        const float c = a.soft_cap, inv = 1.f / a.soft_cap;
        for (int t = 0; t < n; ++t) sg[t] = c * std::tanh(sg[t] * inv);
      }
      // W lanes at a time; a partial last chunk is masked by lane index (the row has room for
      // kTile scores, a multiple of W, so the whole chunk can be read and written).
      const vf lanes = lane_index(), neg_inf = vf{} - std::numeric_limits<float>::infinity();
      vf mx = neg_inf;
      for (int t = 0; t < n; t += W) {
        const vf x = vload(sg + t);
        mx = lanes < static_cast<float>(n - t) && x > mx ? x : mx;
      }
      float mt = m[g];
      for (int i = 0; i < W; ++i) mt = std::max(mt, mx[i]);
      vf sums = {};
      for (int t = 0; t < n; t += W) {
        const vf e = exp_approx(vload(sg + t) - mt);
        const vf kept = lanes < static_cast<float>(n - t) ? e : vf{};
        vstore(sg + t, kept);
        sums += kept;
      }
      const float sum = hsum(sums);
      if (mt != m[g]) {
        const float corr = exp_approx(m[g] - mt);
        float* ag = acc + static_cast<size_t>(g) * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ag[d] *= corr;
        l[g] *= corr;
        m[g] = mt;
      }
      l[g] += sum;
    }
  }

  // Attend query token `tok` of request r (all heads) over keys [k0, k1).
  void run(int r, int64_t tok, int64_t k0, int64_t k1) {
    const float qscale = a.scale * a.k_scale;
    for (int g = 0; g < HG * G; ++g) {
      const int64_t at = tok * a.q_s_tok + static_cast<int64_t>(g) * a.q_s_head;
      float* dst = qs + static_cast<size_t>(g) * D;
      if (a.q_bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(a.q) + at;
        for (int d = 0; d < D; ++d) dst[d] = llmhal_cpu::bf16_bits_to_f32(src[d]) * qscale;
      } else {
        const float* src = static_cast<const float*>(a.q) + at;
#pragma omp simd
        for (int d = 0; d < D; ++d) dst[d] = src[d] * qscale;
      }
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
    }
    std::fill(acc, acc + rows * D, 0.f);
    const T* kc = static_cast<const T*>(a.k_cache);
    const T* vc = static_cast<const T*>(a.v_cache);
    const int32_t* bt = a.block_table + static_cast<int64_t>(r) * a.bt_s;
    const int64_t rs = C::kDirect ? a.c_s_tok : D;  // row stride of what rows() returns
    if (k0 < k1 && !spans) {
      const int n0 = tile_len(k0, k1);
      const int64_t b0 = tile_base(bt, k0);
      for (int h = 0; h < HG; ++h) prefetch_rows(kc + b0, n0, h);
      for (int h = 0; h < HG; ++h) prefetch_rows(vc + b0, n0, h);
    }
    for (int64_t pos = k0; pos < k1;) {
      const int n = tile_len(pos, k1);
      const int64_t base = tile_base(bt, pos);
      const int64_t npos = pos + n;
      const int n_next = npos < k1 ? tile_len(npos, k1) : 0;
      const int64_t next = n_next ? tile_base(bt, npos) : 0;
      if (spans) {
        prefetch_next(kc, vc, next, n_next);
        touch(kc + base, n);
      }
      for (int h = 0; h < HG; ++h) {
        if (!spans) prefetch_rows(kc + next, n_next, h);
        scores_group(h * G, tile_rows(kc + base + h * a.c_s_head, n, kbuf), rs, n);
      }
      softmax_update(n);
      if (spans) touch(vc + base, n);
      for (int h = 0; h < HG; ++h) {
        if (!spans) prefetch_rows(vc + next, n_next, h);
        accumulate_group(h * G, tile_rows(vc + base + h * a.c_s_head, n, vbuf), rs, n);
      }
      pos = npos;
    }
  }
};

template <typename C>
void paged_attention(const Args& a) {
  if (a.num_new > 0) store_new_kv<C>(a);
  if (a.num_reqs <= 0) return;
  const int Hkv = a.num_kv_heads;
  const int G = a.num_heads / Hkv;
  const int D = a.head_size;
  const int64_t T = a.query_start_loc[a.num_reqs] - a.query_start_loc[0];
  if (T <= 0) return;
  static thread_local std::vector<int32_t> req_of_buf;
  if (req_of_buf.size() < static_cast<size_t>(T)) req_of_buf.resize(T);
  int32_t* req_of = req_of_buf.data();
  int64_t max_keys = 0;
  for (int r = 0; r < a.num_reqs; ++r) {
    const int64_t s0 = a.query_start_loc[r] - a.query_start_loc[0];
    const int64_t s1 = a.query_start_loc[r + 1] - a.query_start_loc[0];
    for (int64_t t = s0; t < s1; ++t) req_of[t] = r;
    int64_t keys = a.seq_lens[r];
    if (a.window > 0) keys = std::min<int64_t>(keys, a.window);
    max_keys = std::max(max_keys, keys);
  }
  // A work item covers every KV head of its token: a block's rows are then read front to back
  // (one token's heads are adjacent), which streams markedly faster than one head at a time.
  // Split each token's keys (flash-decoding) only when there are too few tokens to keep every
  // thread busy, and never into pieces shorter than min_split_tokens.
  const int threads = std::max(1, a.num_threads);
  const int64_t units = T;
  int64_t nsplit = 1;
  if (units < 2 * threads) {
    const int64_t want = (2 * threads + units - 1) / units;
    const int64_t most = std::max<int64_t>(1, max_keys / std::max(1, a.min_split_tokens));
    nsplit = std::min(want, most);
  }
  const int64_t chunk = (max_keys + nsplit - 1) / nsplit;
  const int64_t items = units * nsplit;
  const int64_t rows = static_cast<int64_t>(Hkv) * G;  // query rows per item
  // Per item of a split: m[rows], l[rows], acc[rows * D], as laid out in a worker's scratch.
  const int64_t part_stride = rows * (D + 2);
  float* part = nsplit > 1 ? scratch(1).get(static_cast<size_t>(items * part_stride)) : nullptr;

// Full team, serial when there is one item: see store_new_kv for why the team size is constant.
#pragma omp parallel num_threads(static_cast<int>(threads)) if (std::min<int64_t>(threads, items) > 1)
  {
    Worker<C> w(a);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t tok = it / nsplit;
      const int64_t split = it % nsplit;
      const int r = req_of[tok];
      const int64_t q_len = a.query_start_loc[r + 1] - a.query_start_loc[r];
      const int64_t qi = tok - (a.query_start_loc[r] - a.query_start_loc[0]);
      const int64_t p = a.seq_lens[r] - q_len + qi;
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
      const int64_t k0 = std::min(p + 1, lo + split * chunk);
      const int64_t k1 = std::min(p + 1, lo + (split + 1) * chunk);
      w.run(r, tok, k0, k1);
      if (nsplit == 1) {
        for (int g = 0; g < rows; ++g)
          store_out(a, tok, g, w.acc + static_cast<size_t>(g) * D, a.v_scale / w.l[g], D);
      } else {
        float* dst = part + it * part_stride;
        std::copy(w.m, w.m + part_stride, dst);
      }
    }
    if (nsplit > 1) {
      // Merge the splits of each token: rescale every partial sum to the global max.
#pragma omp for schedule(static)
      for (int64_t tok = 0; tok < units; ++tok) {
        for (int g = 0; g < rows; ++g) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t s = 0; s < nsplit; ++s)
            mx = std::max(mx, part[(tok * nsplit + s) * part_stride + g]);
          // The row's sum in the worker's accumulators (free once its items are done).
          float* o = w.acc;
          std::fill(o, o + D, 0.f);
          float denom = 0.f;
          for (int64_t s = 0; s < nsplit; ++s) {
            const float* src = part + (tok * nsplit + s) * part_stride;
            if (src[rows + g] == 0.f) continue;  // an empty split
            const float wgt = std::exp(src[g] - mx);
            denom += src[rows + g] * wgt;
            const float* ag = src + 2 * rows + static_cast<int64_t>(g) * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) o[d] += ag[d] * wgt;
          }
          store_out(a, tok, g, o, a.v_scale / denom, D);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// Stores the step's new keys/values when args->num_new > 0, then attends for the first
// args->num_reqs requests (0: store only). cache_type: 0 fp32, 1 bf16, 2 fp16, 3 fp8 e4m3fn,
// 4 fp8 e5m2. Returns 0, or -1 for a bad type.
int llmhal_paged_attention(const Args* args, int cache_type) {
  switch (cache_type) {
    case 0: paged_attention<F32>(*args); return 0;
    case 1: paged_attention<BF16>(*args); return 0;
    case 2: paged_attention<F16>(*args); return 0;
    case 3: paged_attention<E4M3>(*args); return 0;
    case 4: paged_attention<E5M2>(*args); return 0;
    default: return -1;
  }
}

// The layout of Args, so the Python side can check it matches its ctypes mirror.
int64_t llmhal_paged_attention_args_size() { return static_cast<int64_t>(sizeof(Args)); }

// The struct form for recorded steps (see kernels/fused_ops.cpp's *_call functions): the
// arguments and the cache type, mirrored by CallArgs in native.py.
struct CallArgs {
  const Args* args;
  int32_t cache_type;
};
int llmhal_paged_attention_call(const void* p) {
  const auto& a = *static_cast<const CallArgs*>(p);
  return llmhal_paged_attention(a.args, a.cache_type);
}

}  // extern "C"
