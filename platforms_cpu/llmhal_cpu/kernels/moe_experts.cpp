// The routed experts of one MoE layer in one call, for decode-sized batches (llmhal_cpu/moe.py).
//
// Through torch, a decode step of a MoE layer is ~10 ops of routing bookkeeping (argsort,
// bincount, a host sync, gathers, index_add) plus four tensor calls per active expert (two
// matmuls, the activation, a copy), each a few microseconds of dispatch around a matmul that at
// 1-8 rows is a matrix-vector product: the torch path read the experts' weights at 7-9 GB/s on one
// thread. Here the whole layer is one pass: the (token, choice) pairs are grouped by expert with a
// counting sort, and each active expert's weight rows are streamed once for all of its tokens
// (a dot product per token per row, float32 accumulation), gate/up -> silu(gate) * up -> down,
// each token's result added into its output row times its routing weight.
//
// Weights are float32, bfloat16 (widened to float32 in registers) or int8 with one float32 scale
// per output row (experts_int8); activations come in float32 (the caller widens bf16 once).
// Intermediates stay float32 (torch's bf16 path rounds gate/up and the activation to bf16: this
// is closer to the float32 result). The output is float32 [t, h]; the caller casts it.
//
// Rows of a projection are split over the caller's OpenMP team when there is enough work; the
// team size is always the caller's (num_threads(threads)) and serial runs go through if(), for
// the reason given in attention/paged_attention.cpp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "simd_math.h"

namespace {

using llmhal_cpu::exp_approx;
using llmhal_cpu::hsum;
using llmhal_cpu::vf;
using llmhal_cpu::vload;
using llmhal_cpu::W;

enum WeightType : int32_t { kF32 = 0, kBF16 = 1, kI8 = 2 };

// Tokens of one expert handled together: each weight row is read once per block.
constexpr int kBlock = 8;
// Below this many weight elements in an expert's gate/up projection a call runs on one thread.
constexpr int64_t kMinParallel = 1 << 15;

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

// dots[j] = w . x[j] for the n (<= kBlock) rows x[j] of length len.
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
    default: return dots_fixed<T, kBlock>(w, x, len, out);
  }
}

struct Layer {
  const float* x;  // [t, h] float32 (widened by the caller of run())
  const void* w13;
  const void* w2;
  const float* s13;  // [e, 2i] int8 scales or null
  const float* s2;   // [e, h]
  float* out;        // [t, h]
  int64_t h, inter;
  int threads;
};

// One expert's block of n tokens: rows[j] is the token, wts[j] its routing weight.
// act: [kBlock, inter] scratch for silu(gate) * up. Called by every thread of run()'s team: the
// loops over weight rows are shared among them (and end in barriers).
template <typename T>
void expert_block(const Layer& L, int64_t e, const int64_t* rows, const float* wts, int n,
                  float* act) {
  const int64_t h = L.h, inter = L.inter, two_i = 2 * inter;
  const T* w13 = static_cast<const T*>(L.w13) + e * two_i * h;
  const T* w2 = static_cast<const T*>(L.w2) + e * h * inter;
  const float* s13 = L.s13 ? L.s13 + e * two_i : nullptr;
  const float* s2 = L.s2 ? L.s2 + e * h : nullptr;
  const float* xs[kBlock];
  const float* as[kBlock];
  for (int j = 0; j < n; ++j) {
    xs[j] = L.x + rows[j] * h;
    as[j] = act + j * inter;
  }
  const int64_t groups = (inter + W - 1) / W;
  // W gate rows and their W up rows at a time, so silu(gate) * up runs on whole vectors
  // (exp_approx: about 1 ulp) straight into act.
#pragma omp for schedule(static)
  for (int64_t grp = 0; grp < groups; ++grp) {
    const int64_t r0 = grp * W, lanes = std::min<int64_t>(W, inter - r0);
    vf gate[kBlock] = {}, up[kBlock] = {};
    for (int64_t l = 0; l < lanes; ++l) {
      float g[kBlock], u[kBlock];
      dots(w13 + (r0 + l) * h, xs, n, h, g);
      dots(w13 + (inter + r0 + l) * h, xs, n, h, u);
      const float sg = s13 ? s13[r0 + l] : 1.f, su = s13 ? s13[inter + r0 + l] : 1.f;
      for (int j = 0; j < n; ++j) {
        gate[j][l] = g[j] * sg;
        up[j][l] = u[j] * su;
      }
    }
    for (int j = 0; j < n; ++j) {
      const vf a = gate[j] / (1.f + exp_approx(-gate[j])) * up[j];
      std::memcpy(act + j * inter + r0, &a, sizeof(float) * lanes);
    }
  }
#pragma omp for schedule(static)
  for (int64_t r = 0; r < h; ++r) {
    float d[kBlock];
    dots(w2 + r * inter, as, n, inter, d);
    const float s = s2 ? s2[r] : 1.f;
    for (int j = 0; j < n; ++j) L.out[rows[j] * h + r] += d[j] * s * wts[j];
  }
}

template <typename T>
void run(const Layer& L, const int64_t* ids, const float* weights, int64_t t, int k,
         int64_t experts) {
  // Counting sort of the (token, choice) pairs by expert; within an expert, token order.
  std::vector<int64_t> start(experts + 1, 0), rows(t * k);
  std::vector<float> wts(t * k);
  for (int64_t p = 0; p < t * k; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < t * k; ++p) {
    const int64_t slot = fill[ids[p]]++;
    rows[slot] = p / k;
    wts[slot] = weights[p];
  }
  std::vector<float> act(kBlock * L.inter);
  std::memset(L.out, 0, sizeof(float) * t * L.h);
  // One team for the whole layer (waking a team per expert cost more than a small expert's
  // product); serial when the projections are small.
  const bool par = L.threads > 1 && 2 * L.inter * L.h >= kMinParallel;
#pragma omp parallel num_threads(L.threads) if (par)
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t b = start[e]; b < start[e + 1]; b += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, start[e + 1] - b));
      expert_block<T>(L, e, rows.data() + b, wts.data() + b, n, act.data());
    }
  }
}

}  // namespace

extern "C" {

// x: [t, h] float32, contiguous; ids/weights: [t, k] (int64 expert ids, float32 weights),
// contiguous; w13 [experts, 2 * inter, h], w2 [experts, h, inter] contiguous, of wtype;
// s13/s2 the int8 row scales (null otherwise); out: [t, h] float32, contiguous.
// Returns 0, or -1 for an expert id out of range or an unknown wtype (nothing written).
int llmhal_moe_experts(const float* x, const int64_t* ids, const float* weights, int64_t t, int k,
                       const void* w13, const void* w2, const float* s13, const float* s2,
                       int32_t wtype, int64_t experts, int64_t h, int64_t inter, float* out,
                       int threads) {
  for (int64_t p = 0; p < t * k; ++p) {
    if (ids[p] < 0 || ids[p] >= experts) return -1;
  }
  const Layer L{x, w13, w2, s13, s2, out, h, inter, threads};
  switch (wtype) {
    case kF32: run<float>(L, ids, weights, t, k, experts); return 0;
    case kBF16: run<uint16_t>(L, ids, weights, t, k, experts); return 0;
    case kI8: run<int8_t>(L, ids, weights, t, k, experts); return 0;
    default: return -1;
  }
}

}  // extern "C"
