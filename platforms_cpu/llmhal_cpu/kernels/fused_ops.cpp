// Float32 kernels for the CPU platform's small custom ops (llmhal_cpu/ops.py), compiled at run
// time for the host (native_build.py). Each is one pass over its rows in one call: through torch,
// the same op is 3 to 8 tensor calls of ~1 us dispatch plus a temporary each, which at decode sizes
// ([32, 576] for SmolLM2) cost 15-30 us per op, ~2.7 ms of a batch-32 step (~1.3 ms this way,
// the Python side of the calls included). The caller (kernels/fused_ops.py) checks shapes.
//
//   rms_norm:      out = x / sqrt(mean(x^2) + eps) * w, after sum = x + residual when residual is
//                  given (sum is written out: the next layer's residual).
//   rotary:        rotates query and key rows in place with the cos/sin rows of each position
//                  (cache row: cos in the first half, sin in the second); neox (two halves) or
//                  interleaved pairs; the first rot_dim features of each head.
//   silu_and_mul:  out = silu(x[:, :d]) * x[:, d:], silu(v) = v / (1 + exp(-v)).
//
// Rows are split over the caller's OpenMP team when there is enough work; the team size is always
// the caller's (num_threads(threads)) and serial runs go through if(), for the reason given in
// attention/paged_attention.cpp.

#include <cmath>
#include <cstdint>

#include <omp.h>

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

// One row: the sum of squares of (x + r), written to s when r is given, then the scaled output.
void norm_row(const float* x, const float* r, float* s, float* out, const float* w, int64_t h,
              float eps) {
  vf acc = {};
  float tail = 0.f;
  int64_t d = 0;
  if (r) {
    for (; d + W <= h; d += W) {
      const vf v = vload(x + d) + vload(r + d);
      vstore(s + d, v);
      acc += v * v;
    }
    for (; d < h; ++d) {
      s[d] = x[d] + r[d];
      tail += s[d] * s[d];
    }
    x = s;
  } else {
    for (; d + W <= h; d += W) {
      const vf v = vload(x + d);
      acc += v * v;
    }
    for (; d < h; ++d) tail += x[d] * x[d];
  }
  const float inv = 1.f / std::sqrt((hsum(acc) + tail) / static_cast<float>(h) + eps);
  d = 0;
  for (; d + W <= h; d += W) vstore(out + d, vload(x + d) * inv * vload(w + d));
  for (; d < h; ++d) out[d] = x[d] * inv * w[d];
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

}  // namespace

extern "C" {

// t rows of h elements: row i of x starts at x + (i / inner) * x_s + (i % inner) * x_s2 (inner 1:
// a [t, h] matrix with row stride x_s; inner = heads: a [tokens, heads, h] view, e.g. per-head q/k
// norms on a slice of a fused projection). residual: [t, h] with row stride r_s, or null (then
// inner must be 1 to give it); sum: [t, h] contiguous, required (and written) when residual is
// given; out: [t, h] contiguous; w: [h].
int llmhal_rms_norm(const float* x, int64_t x_s, int64_t inner, int64_t x_s2,
                    const float* residual, int64_t r_s, float* sum, float* out, const float* w,
                    int64_t t, int64_t h, float eps, int threads) {
  if (inner < 1 || (residual && inner != 1)) return -1;
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) if (parallel(t * h, threads)) \
    schedule(static)
  for (int64_t i = 0; i < t; ++i)
    norm_row(x + (i / inner) * x_s + (i % inner) * x_s2, residual ? residual + i * r_s : nullptr,
             sum ? sum + i * h : nullptr, out + i * h, w, h, eps);
  return 0;
}

// q: [t, q_heads * head_size] with row stride q_s, k likewise; cache: [max_pos, rot] with row
// stride cache_s; positions: int64 [t]. Returns -1, touching nothing, when a position is outside
// [0, max_pos).
int llmhal_rotary(const int64_t* positions, float* q, int64_t q_s, int q_heads, float* k,
                  int64_t k_s, int k_heads, int head_size, const float* cache, int64_t cache_s,
                  int64_t max_pos, int rot, int neox, int64_t t, int threads) {
  for (int64_t i = 0; i < t; ++i)
    if (positions[i] < 0 || positions[i] >= max_pos) return -1;
  const int64_t work = t * static_cast<int64_t>(q_heads + k_heads) * rot;
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) if (parallel(work, threads)) \
    schedule(static)
  for (int64_t i = 0; i < t; ++i) {
    const float* cs = cache + positions[i] * cache_s;
    rotate_row(q + i * q_s, q_heads, head_size, cs, rot, neox != 0);
    rotate_row(k + i * k_s, k_heads, head_size, cs, rot, neox != 0);
  }
  return 0;
}

// x: [t, 2d] with row stride x_s; out: [t, d] contiguous.
int llmhal_silu_and_mul(const float* x, int64_t x_s, float* out, int64_t t, int64_t d,
                        int threads) {
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) if (parallel(t * d, threads)) \
    schedule(static)
  for (int64_t i = 0; i < t; ++i) {
    const float* g = x + i * x_s;
    const float* u = g + d;
    float* o = out + i * d;
    int64_t j = 0;
    for (; j + W <= d; j += W) {
      const vf v = vload(g + j);
      vstore(o + j, v / (1.f + exp_approx(-v)) * vload(u + j));
    }
    for (; j < d; ++j) o[j] = g[j] / (1.f + exp_approx(-g[j])) * u[j];
  }
  return 0;
}

// Struct forms of the calls above, `int name_call(const void* args)`: the one signature a recorded
// step (llmhal_cpu/step_graph.py) can replay from C. Python calls these forms too, so eager and
// replayed steps run the same code; each struct mirrors a ctypes Structure in fused_ops.py.
struct RmsNormArgs {
  const float* x;
  int64_t x_s;
  const float* residual;
  int64_t r_s;
  float* sum;
  float* out;
  const float* w;
  int64_t t, h, inner, x_s2;
  float eps;
  int32_t threads;
};
int llmhal_rms_norm_call(const void* p) {
  const auto& a = *static_cast<const RmsNormArgs*>(p);
  return llmhal_rms_norm(a.x, a.x_s, a.inner, a.x_s2, a.residual, a.r_s, a.sum, a.out, a.w, a.t,
                         a.h, a.eps, a.threads);
}

struct RotaryArgs {
  const int64_t* positions;
  float* q;
  int64_t q_s;
  float* k;
  int64_t k_s;
  const float* cache;
  int64_t cache_s, max_pos, t;
  int32_t q_heads, k_heads, head_size, rot, neox, threads;
};
int llmhal_rotary_call(const void* p) {
  const auto& a = *static_cast<const RotaryArgs*>(p);
  return llmhal_rotary(a.positions, a.q, a.q_s, a.q_heads, a.k, a.k_s, a.k_heads, a.head_size,
                       a.cache, a.cache_s, a.max_pos, a.rot, a.neox, a.t, a.threads);
}

struct SiluAndMulArgs {
  const float* x;
  int64_t x_s;
  float* out;
  int64_t t, d;
  int32_t threads;
};
int llmhal_silu_and_mul_call(const void* p) {
  const auto& a = *static_cast<const SiluAndMulArgs*>(p);
  return llmhal_silu_and_mul(a.x, a.x_s, a.out, a.t, a.d, a.threads);
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
