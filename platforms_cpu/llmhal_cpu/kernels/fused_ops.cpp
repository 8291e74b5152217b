// Kernels for the CPU platform's small custom ops (llmhal_cpu/ops.py), compiled at run time for the
// host (native_build.py). Each is one pass over its rows in one call: through torch, the same op is
// 3 to 8 tensor calls of ~1 us dispatch plus a temporary each, which at decode sizes ([32, 576] for
// SmolLM2) cost 15-30 us per op, ~2.7 ms of a batch-32 step (~1.3 ms this way, the Python side of
// the calls included). The caller (kernels/fused_ops.py) checks shapes.
//
//   rms_norm:      out = x / sqrt(mean(x^2) + eps) * w, after sum = x + residual when residual is
//                  given (sum is written out: the next layer's residual).
//   rotary:        rotates query and key rows in place with the cos/sin rows of each position
//                  (cache row: cos in the first half, sin in the second); neox (two halves) or
//                  interleaved pairs; the first rot_dim features of each head.
//   silu_and_mul:  out = silu(x[:, :d]) * x[:, d:], silu(v) = v / (1 + exp(-v)).
//
// Each also takes bfloat16 activations (`bf16`), computing in float32 and rounding where torch's
// bf16 path (HF's modules, the native definitions) rounds, so that results equal it up to the
// order of a row's sum and a 1-ulp exp: the norm rounds x / rms to bf16 before the weight
// multiplies it (in float32, rounded again); a fused add rounds x + residual; silu_and_mul rounds
// silu(gate) before the product; rotary rounds each product and sum (bit-identical). The norm's
// weight and the rotary cache may be float32 or bf16 (`w_bf16`, `cache_bf16`).
//
// Rows are split over the caller's OpenMP team when there is enough work; the team size is always
// the caller's (num_threads(threads)) and serial runs go through if(), for the reason given in
// attention/paged_attention.cpp.

#include <cmath>
#include <cstdint>

#include <omp.h>

#include "float_bits.h"
#include "simd_math.h"

namespace {

using llmhal_cpu::exp_approx;
using llmhal_cpu::hsum;
using llmhal_cpu::vf;
using llmhal_cpu::vload;
using llmhal_cpu::vstore;
using llmhal_cpu::W;

// Below this many elements a call runs on one thread (waking the team costs more).
constexpr int64_t kMinParallel = 1 << 16;

inline bool parallel(int64_t elements, int threads) { return threads > 1 && elements >= kMinParallel; }

// Loads and stores of float32 or bfloat16 elements, one at a time or a vector's worth. The bf16
// vector forms stay in registers (lane-wise integer operations on the bits, the same branch-free
// formulas as float_bits.h): going through a float buffer, as they first did, stored a vector in
// halves and read it back whole, a failed store-to-load forward per conversion that made SiLU and
// the norms ~5 ns an element (Zen 5, bf16; 442 us for SiLU on [64, 3072], torch's own: 1 ms).
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
inline vf bits_vf(vu u) {
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline vu vf_bits(vf f) {
  vu u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
// float32 -> bf16 bits in the upper half of each lane: round to nearest even, a NaN stays a quiet
// NaN (float_bits.h's f32_to_bf16_bits, lane-wise).
inline vu bf16_upper(vf v) {
  const vu u = vf_bits(v);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const vu nan = (u | 0x400000u) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}
inline float ld(const float* p) { return *p; }
inline float ld(const uint16_t* p) { return llmhal_cpu::bf16_bits_to_f32(*p); }
inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = llmhal_cpu::f32_to_bf16_bits(v); }
inline vf vld(const float* p) { return vload(p); }
inline vf vld(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return bits_vf(__builtin_convertvector(h, vu) << 16);
}
inline void vput(float* p, vf v) { vstore(p, v); }
inline void vput(uint16_t* p, vf v) {
  const vh h = __builtin_convertvector(bf16_upper(v) >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}
// What a float32 value becomes when torch stores it in T and reads it back.
inline float rnd(float v, const float*) { return v; }
inline float rnd(float v, const uint16_t*) {
  return llmhal_cpu::bf16_bits_to_f32(llmhal_cpu::f32_to_bf16_bits(v));
}
inline vf vrnd(vf v, const float*) { return v; }
inline vf vrnd(vf v, const uint16_t*) { return bits_vf(bf16_upper(v)); }

// One row: the sum of squares of (x + r), written to s when r is given, then the scaled output.
// T: the activations' type (x, r, s, out), TW: the weight's. For bf16, x + r and x / rms are
// rounded to bf16 before their next use, as torch's bf16 path rounds them.
template <typename T, typename TW>
void norm_row(const T* x, const T* r, T* s, T* out, const TW* w, int64_t h, float eps) {
  const T* tag = nullptr;
  vf acc = {};
  float tail = 0.f;
  int64_t d = 0;
  if (r) {
    for (; d + W <= h; d += W) {
      const vf v = vrnd(vld(x + d) + vld(r + d), tag);
      vput(s + d, v);
      acc += v * v;
    }
    for (; d < h; ++d) {
      const float v = rnd(ld(x + d) + ld(r + d), tag);
      put(s + d, v);
      tail += v * v;
    }
    x = s;
  } else {
    for (; d + W <= h; d += W) {
      const vf v = vld(x + d);
      acc += v * v;
    }
    for (; d < h; ++d) tail += ld(x + d) * ld(x + d);
  }
  const float inv = 1.f / std::sqrt((hsum(acc) + tail) / static_cast<float>(h) + eps);
  d = 0;
  for (; d + W <= h; d += W) vput(out + d, vrnd(vld(x + d) * inv, tag) * vld(w + d));
  for (; d < h; ++d) put(out + d, rnd(ld(x + d) * inv, tag) * ld(w + d));
}

// Rotate the first rot features of each of `heads` heads of one token's row. Without contraction
// into FMAs (simd_math.h): a * c - b * s is then rounded as torch (and HF, the parity reference)
// round it, so rotated queries and keys are bit-identical to theirs.
LLMHAL_NO_FMA_CONTRACTION void rotate_row(float* x, int heads, int head_size, const float* cs, int rot, bool neox) {
  LLMHAL_NO_FMA_CONTRACTION_BODY
  const int half = rot / 2;
  const float* cos = cs;
  const float* sin = cs + half;
  for (int hd = 0; hd < heads; ++hd) {
    float* v = x + static_cast<int64_t>(hd) * head_size;
    if (neox) {
      int i = 0;
      for (; i + W <= half; i += W) {
        const vf a = vload(v + i), b = vload(v + half + i), c = vload(cos + i), s = vload(sin + i);
        vstore(v + i, a * c - b * s);
        vstore(v + half + i, b * c + a * s);
      }
      for (; i < half; ++i) {
        const float a = v[i], b = v[half + i];
        v[i] = a * cos[i] - b * sin[i];
        v[half + i] = b * cos[i] + a * sin[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cos[i] - b * sin[i];
        v[2 * i + 1] = b * cos[i] + a * sin[i];
      }
    }
  }
}

// t rows of h elements: row i of x starts at x + (i / inner) * x_s + (i % inner) * x_s2 (inner 1:
// a [t, h] matrix with row stride x_s; inner = heads: a [tokens, heads, h] view, e.g. per-head q/k
// norms on a slice of a fused projection). residual: [t, h] with row stride r_s, or null (then
// inner must be 1 to give it); sum: [t, h] contiguous, required (and written) when residual is
// given; out: [t, h] contiguous; w: [h]. Strides count elements of x's type T.
template <typename T, typename TW>
int rms_norm(const T* x, int64_t x_s, int64_t inner, int64_t x_s2, const T* residual, int64_t r_s,
             T* sum, T* out, const TW* w, int64_t t, int64_t h, float eps, int threads) {
  if (inner < 1 || (residual && inner != 1)) return -1;
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) if (parallel(t * h, threads)) \
    schedule(static)
  for (int64_t i = 0; i < t; ++i)
    norm_row(x + (i / inner) * x_s + (i % inner) * x_s2, residual ? residual + i * r_s : nullptr,
             sum ? sum + i * h : nullptr, out + i * h, w, h, eps);
  return 0;
}

// x: [t, 2d] with row stride x_s; out: [t, d] contiguous. For bf16, silu(gate) is rounded to bf16
// before the product, as torch's F.silu(gate) * up rounds it.
template <typename T>
int silu_and_mul(const T* x, int64_t x_s, T* out, int64_t t, int64_t d, int threads) {
  const T* tag = nullptr;
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) if (parallel(t * d, threads)) \
    schedule(static)
  for (int64_t i = 0; i < t; ++i) {
    const T* g = x + i * x_s;
    const T* u = g + d;
    T* o = out + i * d;
    int64_t j = 0;
    for (; j + W <= d; j += W) {
      const vf v = vld(g + j);
      vput(o + j, vrnd(v / (1.f + exp_approx(-v)), tag) * vld(u + j));
    }
    for (; j < d; ++j) {
      const float v = ld(g + j);
      put(o + j, rnd(v / (1.f + exp_approx(-v)), tag) * ld(u + j));
    }
  }
  return 0;
}

// bfloat16 heads, cache rows float32 or bf16: each product and each sum rounded to bf16 as torch's
// bf16 ops round them (the products of bf16 values are exact in float32, so rounding them is too).
template <typename TC>
void rotate_row(uint16_t* x, int heads, int head_size, const TC* cs, int rot, bool neox) {
  const uint16_t* tag = nullptr;
  const int half = rot / 2;
  for (int hd = 0; hd < heads; ++hd) {
    uint16_t* v = x + static_cast<int64_t>(hd) * head_size;
    int i = 0;
    if (neox) {  // the two halves are contiguous: W pairs at a time, the same roundings
      for (; i + W <= half; i += W) {
        const vf a = vld(v + i), b = vld(v + half + i);
        const vf c = vrnd(vld(cs + i), tag), s = vrnd(vld(cs + half + i), tag);
        vput(v + i, vrnd(a * c, tag) - vrnd(b * s, tag));
        vput(v + half + i, vrnd(b * c, tag) + vrnd(a * s, tag));
      }
    }
    for (; i < half; ++i) {
      const int ia = neox ? i : 2 * i, ib = neox ? half + i : 2 * i + 1;
      const float a = ld(v + ia), b = ld(v + ib);
      const float c = rnd(ld(cs + i), tag), s = rnd(ld(cs + half + i), tag);
      put(v + ia, rnd(a * c, tag) - rnd(b * s, tag));
      put(v + ib, rnd(b * c, tag) + rnd(a * s, tag));
    }
  }
}

// q: [t, q_heads * head_size] with row stride q_s, k likewise; cache: [max_pos, rot] with row
// stride cache_s; positions: int64 [t]. Returns -1, touching nothing, when a position is outside
// [0, max_pos). T: q and k's type; TC: the cache's (float32 q and k need a float32 cache).
template <typename T, typename TC>
int rotary(const int64_t* positions, T* q, int64_t q_s, int q_heads, T* k, int64_t k_s,
           int k_heads, int head_size, const TC* cache, int64_t cache_s, int64_t max_pos, int rot,
           int neox, int64_t t, int threads) {
  for (int64_t i = 0; i < t; ++i)
    if (positions[i] < 0 || positions[i] >= max_pos) return -1;
  const int64_t work = t * static_cast<int64_t>(q_heads + k_heads) * rot;
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) if (parallel(work, threads)) \
    schedule(static)
  for (int64_t i = 0; i < t; ++i) {
    const TC* cs = cache + positions[i] * cache_s;
    rotate_row(q + i * q_s, q_heads, head_size, cs, rot, neox != 0);
    rotate_row(k + i * k_s, k_heads, head_size, cs, rot, neox != 0);
  }
  return 0;
}

}  // namespace

extern "C" {

// Struct forms of the calls above, `int name_call(const void* args)`: the one signature a recorded
// step (llmhal_cpu/step_graph.py) can replay from C. Python calls these forms too, so eager and
// replayed steps run the same code; each struct mirrors a ctypes Structure in fused_ops.py.
// x, residual, sum and out are float32, or bfloat16 when bf16 is set; w float32 or (w_bf16) bf16.
struct RmsNormArgs {
  const void* x;
  int64_t x_s;
  const void* residual;
  int64_t r_s;
  void* sum;
  void* out;
  const void* w;
  int64_t t, h, inner, x_s2;
  float eps;
  int32_t threads, bf16, w_bf16;
};
}  // extern "C"

namespace {
template <typename T, typename TW>
int rms_norm_as(const RmsNormArgs& a) {
  return rms_norm(static_cast<const T*>(a.x), a.x_s, a.inner, a.x_s2,
                  static_cast<const T*>(a.residual), a.r_s, static_cast<T*>(a.sum),
                  static_cast<T*>(a.out), static_cast<const TW*>(a.w), a.t, a.h, a.eps, a.threads);
}
}  // namespace

extern "C" {

int llmhal_rms_norm_call(const void* p) {
  const auto& a = *static_cast<const RmsNormArgs*>(p);
  if (!a.bf16) return a.w_bf16 ? -1 : rms_norm_as<float, float>(a);
  return a.w_bf16 ? rms_norm_as<uint16_t, uint16_t>(a) : rms_norm_as<uint16_t, float>(a);
}

// q and k float32 with a float32 cache, or (bf16) bfloat16 with a float32 or (cache_bf16) bf16 one.
struct RotaryArgs {
  const int64_t* positions;
  void* q;
  int64_t q_s;
  void* k;
  int64_t k_s;
  const void* cache;
  int64_t cache_s, max_pos, t;
  int32_t q_heads, k_heads, head_size, rot, neox, threads, bf16, cache_bf16;
};
int llmhal_rotary_call(const void* p) {
  const auto& a = *static_cast<const RotaryArgs*>(p);
  if (!a.bf16) {
    if (a.cache_bf16) return -2;
    return rotary(a.positions, static_cast<float*>(a.q), a.q_s, a.q_heads,
                  static_cast<float*>(a.k), a.k_s, a.k_heads, a.head_size,
                  static_cast<const float*>(a.cache), a.cache_s, a.max_pos, a.rot, a.neox, a.t,
                  a.threads);
  }
  auto* q = static_cast<uint16_t*>(a.q);
  auto* k = static_cast<uint16_t*>(a.k);
  if (a.cache_bf16)
    return rotary(a.positions, q, a.q_s, a.q_heads, k, a.k_s, a.k_heads, a.head_size,
                  static_cast<const uint16_t*>(a.cache), a.cache_s, a.max_pos, a.rot, a.neox,
                  a.t, a.threads);
  return rotary(a.positions, q, a.q_s, a.q_heads, k, a.k_s, a.k_heads, a.head_size,
                static_cast<const float*>(a.cache), a.cache_s, a.max_pos, a.rot, a.neox, a.t,
                a.threads);
}

// x and out float32, or bfloat16 when bf16 is set.
struct SiluAndMulArgs {
  const void* x;
  int64_t x_s;
  void* out;
  int64_t t, d;
  int32_t threads, bf16;
};
int llmhal_silu_and_mul_call(const void* p) {
  const auto& a = *static_cast<const SiluAndMulArgs*>(p);
  if (a.bf16)
    return silu_and_mul(static_cast<const uint16_t*>(a.x), a.x_s, static_cast<uint16_t*>(a.out),
                        a.t, a.d, a.threads);
  return silu_and_mul(static_cast<const float*>(a.x), a.x_s, static_cast<float*>(a.out), a.t, a.d,
                      a.threads);
}

// Sizes of the structs, so fused_ops.py can check its ctypes mirrors match.
int64_t llmhal_fused_ops_args_size(int which) {
  switch (which) {
    case 0: return sizeof(RmsNormArgs);
    case 1: return sizeof(RotaryArgs);
    case 2: return sizeof(SiluAndMulArgs);
    default: return -1;
  }
}

}  // extern "C"
