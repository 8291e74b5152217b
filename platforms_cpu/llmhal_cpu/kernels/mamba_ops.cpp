// Kernels of the state-space ops (llmhal/ops/mamba_ops.py has the definitions and signatures),
// compiled at run time for the host by native_build.py. The caller (llmhal_cpu/mamba_kernels.py)
// checks dtypes and shapes; these read strides as given, so the views the layers pass (a slice of
// a projection's output, Mamba-2's stride-0 expanded A/dt/D) need no copy. Every state row's last
// dimension (N, or dim for the conv) is contiguous.
//
// Dtypes: the activations (x, dt, B, C, z, the output; for the conv also its weights and state)
// are float32 or bfloat16 (`bf16` set), the SSM state (and lightning's) float32 or bfloat16
// (`st_bf16`, independent of `bf16`), A float32, D and dt_bias either (their own flags). Arithmetic is float32 and bf16 results round to nearest even, as torch casts.
//
// Why a kernel: a decode step through torch is ~10 tensor calls per op (gather the slots, exp,
// two products, a sum, the scatter back), each ~1-5 us of dispatch plus a temporary; here it is
// one pass that updates each state row in place. Prefill scans run the recurrence token by token
// on a [P, N] tile held in cache, which is what the chunked SSD algorithm computes (with more
// arithmetic and large temporaries); the sequential recurrence is the definition the tests use.
//
//   conv_update:  one token per request: out = act(bias + sum_k w[:, k] * window[k]), where window
//                 is (state rows, x); the state shifts by one row.
//   conv_varlen:  the same over each request's tokens, window preceded by its state (or zeros);
//                 the state becomes the last width - 1 rows of (state, inputs).
//   ssm_update:   h = exp(dt A) h + dt B x; y = C.h + D x; y *= silu(z) (one token per request).
//   scan_varlen:  Mamba-1 prefill, the same per token with A [d, n].
//   ssd_varlen:   Mamba-2 prefill: one decay per (token, head), groups shared by H / G heads.
//   lightning_decode: MiniMax's linear attention, one token per request (see below).
//   gated_norm:   Mamba-2's gated RMSNorm, per group: w * rnd(h / rms(h)), h = x * silu(z).
//
// Each call first checks every slot index (and query_start_loc) and returns -1 before writing
// anything when one is out of range, so the caller can fall back to the reference, which raises
// the error. Work is split over the caller's OpenMP team when there is enough of it (see
// fused_ops.cpp for the team-size rule).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include <omp.h>

#include "simd_math.h"

namespace {

using llmhal_cpu::exp_approx;
using llmhal_cpu::hsum;
using llmhal_cpu::vf;
using llmhal_cpu::vload;
using llmhal_cpu::vstore;
using llmhal_cpu::W;

constexpr int64_t kMinParallel = 1 << 15;

inline bool parallel(int64_t work, int threads) { return threads > 1 && work >= kMinParallel; }
inline int team(int threads) { return threads > 1 ? threads : 1; }

// torch's softplus (beta 1, threshold 20).
inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }
inline float silu(float v) { return v / (1.f + exp_approx(-v)); }

// Loads and stores of float32 or bfloat16 (the upper half of a float32) elements.
inline float ld(const float* p) { return *p; }
inline float ld(const uint16_t* p) {
  const uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
    return;
  }
  *p = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// A parameter element (D, dt_bias) of either dtype: read once per channel, not in inner loops.
inline float ld_param(const void* p, int64_t at, int bf16) {
  return bf16 ? ld(static_cast<const uint16_t*>(p) + at) : static_cast<const float*>(p)[at];
}
// n elements of a B or C row into float32 (the inner loops read float32 rows).
template <typename T>
inline const float* as_f32(const T* src, float* buf, int64_t n) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = ld(src + i);
    return buf;
  }
}
constexpr int64_t kMaxN = 1024;  // the longest B/C row converted on the stack (caller checks)
constexpr int64_t kMaxGroup = 16384;  // the widest gated-norm group held on the stack (64 KiB)

inline float delta(float dt, const void* bias, int64_t at, int bias_bf16, int sp, float lo,
                   float hi) {
  if (bias) dt += ld_param(bias, at, bias_bf16);
  if (sp) dt = softplus(dt);
  return dt < lo ? lo : (dt > hi ? hi : dt);
}

bool slots_ok(const int32_t* idx, int64_t n, int64_t slots) {
  for (int64_t i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= slots) return false;
  return true;
}

bool starts_ok(const int32_t* qsl, int64_t nseq, int64_t tokens) {
  if (qsl[0] < 0) return false;
  for (int64_t i = 0; i < nseq; ++i)
    if (qsl[i + 1] < qsl[i]) return false;
  return qsl[nseq] <= tokens;
}

// W bfloat16 state elements as float32 lanes and back (rounded to nearest even, a NaN kept quiet:
// put()'s rule, branch-free so that it stays in vector registers).
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
inline vf vload(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void vstore(uint16_t* p, vf v) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // One instruction on hosts with AVX512-BF16 (nearest even, NaN kept quiet: the same rule).
  const __m256bh h = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(v));
  std::memcpy(p, &h, sizeof h);
#else
  vu u;
  std::memcpy(&u, &v, sizeof u);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu out = (u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded;
  const vh h = __builtin_convertvector(out, vh);
  std::memcpy(p, &h, sizeof h);
#endif
}

// One state row update and its read-out over n: s = s * decay + u * b, returns sum(s * c). The
// decay is one scalar (Mamba-2, or Mamba-1 with a constant row) or a row of a stride-1 A times dt.
// The row is float32 or bfloat16 (a decode's bf16 state: widened and rounded back in registers;
// the output is read from the unrounded values).
template <typename S>
inline float ssm_row(S* s, const float* b, const float* c, int64_t n, float u, float dt,
                     const float* a, int64_t a_sn, float decay) {
  vf acc = {};
  float tail = 0.f;
  int64_t i = 0;
  if (a && a_sn == 1) {
    for (; i + W <= n; i += W) {
      const vf v = vload(s + i) * exp_approx(vload(a + i) * dt) + vload(b + i) * u;
      vstore(s + i, v);
      acc += v * vload(c + i);
    }
    for (; i < n; ++i) {
      const float v = ld(s + i) * exp_approx(a[i] * dt) + b[i] * u;
      put(s + i, v);
      tail += v * c[i];
    }
  } else if (a) {  // A with another n stride: gather it
    for (; i < n; ++i) {
      const float v = ld(s + i) * exp_approx(a[i * a_sn] * dt) + b[i] * u;
      put(s + i, v);
      tail += v * c[i];
    }
  } else {
    const vf dv = vf{} + decay;
    for (; i + W <= n; i += W) {
      const vf v = vload(s + i) * dv + vload(b + i) * u;
      vstore(s + i, v);
      acc += v * vload(c + i);
    }
    for (; i < n; ++i) {
      const float v = ld(s + i) * decay + b[i] * u;
      put(s + i, v);
      tail += v * c[i];
    }
  }
  return hsum(acc) + tail;
}

// States of float32 or bfloat16 elements (mamba_ssm_cache_dtype): the arithmetic is float32 either
// way. A decode updates each row once, so ssm_row rounds a bfloat16 row back as it goes (to
// nearest even, as torch's cast); a prefill widens its rows into a float32 block once, runs every
// token on it and rounds once at the end, as the reference and vLLM's kernels do (a state rounded
// after every token would drift from them).
// `rows` rows of n elements (row stride `stride`) as float32 rows: a float32 state itself (zeroed
// in place when `zero`), else `buf` (rows * n, stride n) filled from it or with zeros.
template <typename S>
inline float* widen_rows(S* st, int64_t rows, int64_t stride, int64_t n, bool zero,
                         std::vector<float>& buf, int64_t& out_stride) {
  if constexpr (sizeof(S) == sizeof(float)) {
    if (zero)
      for (int64_t r = 0; r < rows; ++r) std::memset(st + r * stride, 0, sizeof(float) * n);
    out_stride = stride;
    return st;
  } else {
    buf.assign(static_cast<size_t>(rows * n), 0.f);
    if (!zero)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < n; ++i) buf[r * n + i] = ld(st + r * stride + i);
    out_stride = n;
    return buf.data();
  }
}

template <typename S>
inline void narrow_rows(S* st, int64_t rows, int64_t stride, int64_t n, const float* buf) {
  if constexpr (sizeof(S) != sizeof(float))
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) put(st + r * stride + i, buf[r * n + i]);
}

}  // namespace

extern "C" {

struct ConvArgs {
  const void* x;  // [T, dim], row stride x_s
  int64_t x_s;
  void* out;  // [T, dim] contiguous
  void* states;  // [slots, width - 1, dim], strides st_slot, st_row, 1
  int64_t st_slot, st_row;
  const void* w;  // [dim, width], strides w_sd, w_sk
  int64_t w_sd, w_sk;
  const void* bias;  // [dim] contiguous, or null
  const int32_t* qsl;  // [nseq + 1], or null for the update (one token per request)
  const int32_t* idx;  // [nseq]
  const uint8_t* has_init;  // [nseq] bools, or null (update: always carried)
  int64_t nseq, tokens, dim, width, slots;
  int32_t silu, bf16, threads;
};

}  // extern "C"

namespace {

// Both conv forms: the update is the varlen form with request i owning token i and its state.
// T is the dtype of x, the output, the weights and the state.
template <typename T>
void conv(const ConvArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  T* states = static_cast<T*>(a.states);
  const int64_t k1 = a.width - 1;
  const int64_t blocks = (a.dim + 63) / 64;
  // The taps once per call as a [width][dim] float32 table, so the inner loops run over
  // contiguous channels. Requests are the outer loop: at decode each request's state rows are
  // one contiguous stretch, read and written in order (the hardware prefetches it); with blocks
  // outer, each block touched every request's rows in 256-byte pieces, and a state not in cache
  // (the weights streamed through since the last step) cost ~5x the arithmetic.
  std::vector<float> table(static_cast<size_t>(a.width * a.dim));
  for (int64_t k = 0; k < a.width; ++k)
    for (int64_t d = 0; d < a.dim; ++d) table[k * a.dim + d] = ld(w + d * a.w_sd + k * a.w_sk);
#pragma omp parallel for collapse(2) num_threads(team(a.threads)) \
    if (parallel(a.tokens * a.dim * a.width, a.threads)) schedule(static)
  for (int64_t r = 0; r < a.nseq; ++r) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t d0 = blk * 64, d1 = d0 + 64 < a.dim ? d0 + 64 : a.dim, nd = d1 - d0;
      float prev[8 * 64], acc[64];
      const int64_t s = a.qsl ? a.qsl[r] : r, e = a.qsl ? a.qsl[r + 1] : r + 1, len = e - s;
      T* st = states + a.idx[r] * a.st_slot + d0;
      const bool carried = a.has_init == nullptr || a.has_init[r] != 0;
      // Window rows: k1 of state (copied, as float32), then the request's inputs.
      for (int64_t j = 0; j < k1; ++j)
        for (int64_t c = 0; c < nd; ++c)
          prev[j * 64 + c] = carried ? ld(st + j * a.st_row + c) : 0.f;
      auto input = [&](int64_t j) { return x + (s + j - k1) * a.x_s + d0; };
      for (int64_t t = 0; t < len; ++t) {
        for (int64_t c = 0; c < nd; ++c) acc[c] = bias ? ld(bias + d0 + c) : 0.f;
        for (int64_t k = 0; k < a.width; ++k) {
          const float* wk = table.data() + k * a.dim + d0;
          if (t + k < k1) {
            const float* in = prev + (t + k) * 64;
            for (int64_t c = 0; c < nd; ++c) acc[c] += wk[c] * in[c];
          } else {
            const T* in = input(t + k);
            for (int64_t c = 0; c < nd; ++c) acc[c] += wk[c] * ld(in + c);
          }
        }
        int64_t c = 0;
        if (a.silu) {
          for (; c + W <= nd; c += W) {
            const vf v = vload(acc + c);
            vstore(acc + c, v / (1.f + exp_approx(-v)));
          }
          for (; c < nd; ++c) acc[c] = acc[c] / (1.f + exp_approx(-acc[c]));
        }
        T* o = out + (s + t) * a.dim + d0;
        for (c = 0; c < nd; ++c) put(o + c, acc[c]);
      }
      // New state: the last k1 window rows (the state's own rows move up when len < k1).
      for (int64_t j = 0; j < k1; ++j) {
        T* dst = st + j * a.st_row;
        if (len + j < k1) {
          for (int64_t c = 0; c < nd; ++c) put(dst + c, prev[(len + j) * 64 + c]);
        } else {
          const T* src = input(len + j);
          for (int64_t c = 0; c < nd; ++c) dst[c] = src[c];
        }
      }
    }
  }
}

}  // namespace

extern "C" {

int llmhal_conv_call(const void* p) {
  const auto& a = *static_cast<const ConvArgs*>(p);
  if (!slots_ok(a.idx, a.nseq, a.slots)) return -1;
  if (a.qsl && !starts_ok(a.qsl, a.nseq, a.tokens)) return -1;
  if (a.width < 2 || a.width > 9) return -1;
  a.bf16 ? conv<uint16_t>(a) : conv<float>(a);
  return 0;
}

struct SsmUpdateArgs {
  void* states;  // [slots, H, P, N]: strides st_slot, st_h, st_p, 1; float32 or bfloat16
  int64_t st_slot, st_h, st_p;
  const void* x;  // [B, H, P]
  int64_t x_b, x_h, x_p;
  const void* dt;
  int64_t dt_b, dt_h, dt_p;
  const float* A;  // [H, P, N]
  int64_t A_h, A_p, A_n;
  const void* Bm;  // [B, G, N], n stride 1
  int64_t B_b, B_g;
  const void* Cm;
  int64_t C_b, C_g;
  const void* D;  // [H, P] or null
  int64_t D_h, D_p;
  const void* z;  // [B, H, P] or null
  int64_t z_b, z_h, z_p;
  const void* dt_bias;  // [H, P] or null
  int64_t db_h, db_p;
  const int32_t* idx;  // [B]
  void* out;  // [B, H, P] contiguous
  int64_t nb, H, P, N, G, slots;
  int32_t softplus, bf16, D_bf16, db_bf16, threads, st_bf16;
};

}  // extern "C"

namespace {

template <typename T, typename S>
void ssm_update(const SsmUpdateArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* dtp = static_cast<const T*>(a.dt);
  const T* z = static_cast<const T*>(a.z);
  T* out = static_cast<T*>(a.out);
  const int64_t per_group = a.H / a.G;
  const float inf = INFINITY;
  // Tasks of (request, head, 16 channels): Mamba-1 decodes with one head of d_inner channels,
  // so (request, head) alone would leave a single request's step on one thread.
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (a.P + kBlock - 1) / kBlock;
#pragma omp parallel for collapse(3) num_threads(team(a.threads)) \
    if (parallel(a.nb * a.H * a.P * a.N, a.threads)) schedule(static)
  for (int64_t b = 0; b < a.nb; ++b) {
    for (int64_t h = 0; h < a.H; ++h) {
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t g = h / per_group, q0 = blk * kBlock;
        const int64_t q1 = q0 + kBlock < a.P ? q0 + kBlock : a.P;
        float bbuf[kMaxN], cbuf[kMaxN];
        const float* bv = as_f32(static_cast<const T*>(a.Bm) + b * a.B_b + g * a.B_g, bbuf, a.N);
        const float* cv = as_f32(static_cast<const T*>(a.Cm) + b * a.C_b + g * a.C_g, cbuf, a.N);
        S* st = static_cast<S*>(a.states) + a.idx[b] * a.st_slot + h * a.st_h;
        // Mamba-2 passes dt, dt_bias and A expanded along p (stride 0): then dt and the decay
        // are one softplus and one exp per head instead of per channel (~1536 of each a token).
        const bool head_dt = a.dt_p == 0 && (a.dt_bias == nullptr || a.db_p == 0);
        const bool head_decay = head_dt && a.A_p == 0 && a.A_n == 0;
        float dt = 0.f, decay = 0.f;
        for (int64_t q = q0; q < q1; ++q) {
          if (q == q0 || !head_dt)
            dt = delta(ld(dtp + b * a.dt_b + h * a.dt_h + q * a.dt_p), a.dt_bias,
                       h * a.db_h + q * a.db_p, a.db_bf16, a.softplus, -inf, inf);
          const float xv = ld(x + b * a.x_b + h * a.x_h + q * a.x_p);
          const float* arow = a.A + h * a.A_h + q * a.A_p;
          // A constant along n (Mamba-2's expanded per-head scalar): one exp for the row.
          const bool scalar_a = a.A_n == 0;
          if (scalar_a && (q == q0 || !head_decay)) decay = std::exp(arow[0] * dt);
          float y = ssm_row(st + q * a.st_p, bv, cv, a.N, dt * xv, dt,
                            scalar_a ? nullptr : arow, a.A_n, decay);
          if (a.D) y += xv * ld_param(a.D, h * a.D_h + q * a.D_p, a.D_bf16);
          if (z) y *= silu(ld(z + b * a.z_b + h * a.z_h + q * a.z_p));
          put(out + (b * a.H + h) * a.P + q, y);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

int llmhal_ssm_update_call(const void* p) {
  const auto& a = *static_cast<const SsmUpdateArgs*>(p);
  if (!slots_ok(a.idx, a.nb, a.slots) || a.N > kMaxN) return -1;
  if (a.st_bf16)
    a.bf16 ? ssm_update<uint16_t, uint16_t>(a) : ssm_update<float, uint16_t>(a);
  else
    a.bf16 ? ssm_update<uint16_t, float>(a) : ssm_update<float, float>(a);
  return 0;
}

struct ScanArgs {  // Mamba-1 prefill
  const void* x;  // [T, d]
  int64_t x_t, x_d;
  const void* dt;
  int64_t dt_t, dt_d;
  const float* A;  // [d, n]
  int64_t A_d, A_n;
  const void* Bm;  // [T, n], n stride 1
  int64_t B_t;
  const void* Cm;
  int64_t C_t;
  const void* D;  // [d] (stride D_s) or null
  int64_t D_s;
  const void* z;  // [T, d] or null
  int64_t z_t, z_d;
  const void* dt_bias;  // [d] or null
  int64_t db_s;
  void* states;  // [slots, d, n]: strides st_slot, st_d, 1; float32 or bfloat16
  int64_t st_slot, st_d;
  const int32_t* qsl;
  const int32_t* idx;
  const uint8_t* has_init;
  void* out;  // [T, d] contiguous
  int64_t nseq, tokens, d, n, slots;
  int32_t softplus, bf16, D_bf16, db_bf16, threads, st_bf16;
};

}  // extern "C"

namespace {

template <typename T, typename S>
void scan(const ScanArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* dtp = static_cast<const T*>(a.dt);
  const T* z = static_cast<const T*>(a.z);
  T* out = static_cast<T*>(a.out);
  const float inf = INFINITY;
  constexpr int64_t kBlock = 16;  // channels per task; B/C rows are converted once per block
  const int64_t blocks = (a.d + kBlock - 1) / kBlock;
#pragma omp parallel for collapse(2) num_threads(team(a.threads)) \
    if (parallel(a.tokens * a.d * a.n, a.threads)) schedule(dynamic)
  for (int64_t r = 0; r < a.nseq; ++r) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t s = a.qsl[r], e = a.qsl[r + 1];
      const int64_t c0 = blk * kBlock, c1 = c0 + kBlock < a.d ? c0 + kBlock : a.d;
      S* st_s = static_cast<S*>(a.states) + a.idx[r] * a.st_slot + c0 * a.st_d;
      std::vector<float> wide;
      int64_t st_d = 0;
      float* st0 = widen_rows(st_s, c1 - c0, a.st_d, a.n, a.has_init[r] == 0, wide, st_d);
      float bbuf[kMaxN], cbuf[kMaxN];
      for (int64_t t = s; t < e; ++t) {
        const float* bv = as_f32(static_cast<const T*>(a.Bm) + t * a.B_t, bbuf, a.n);
        const float* cv = as_f32(static_cast<const T*>(a.Cm) + t * a.C_t, cbuf, a.n);
        for (int64_t ch = c0; ch < c1; ++ch) {
          const float dt = delta(ld(dtp + t * a.dt_t + ch * a.dt_d), a.dt_bias, ch * a.db_s,
                                 a.db_bf16, a.softplus, -inf, inf);
          const float xv = ld(x + t * a.x_t + ch * a.x_d);
          float y = ssm_row(st0 + (ch - c0) * st_d, bv, cv, a.n, dt * xv, dt, a.A + ch * a.A_d,
                            a.A_n, 0.f);
          if (a.D) y += xv * ld_param(a.D, ch * a.D_s, a.D_bf16);
          if (z) y *= silu(ld(z + t * a.z_t + ch * a.z_d));
          put(out + t * a.d + ch, y);
        }
      }
      narrow_rows(st_s, c1 - c0, a.st_d, a.n, wide.data());
    }
  }
}

}  // namespace

extern "C" {

int llmhal_scan_call(const void* p) {
  const auto& a = *static_cast<const ScanArgs*>(p);
  if (!slots_ok(a.idx, a.nseq, a.slots) || !starts_ok(a.qsl, a.nseq, a.tokens)) return -1;
  if (a.n > kMaxN) return -1;
  if (a.st_bf16)
    a.bf16 ? scan<uint16_t, uint16_t>(a) : scan<float, uint16_t>(a);
  else
    a.bf16 ? scan<uint16_t, float>(a) : scan<float, float>(a);
  return 0;
}

struct SsdArgs {  // Mamba-2 prefill
  const void* x;  // [T, H, P]
  int64_t x_t, x_h, x_p;
  const void* dt;  // [T, H]
  int64_t dt_t, dt_h;
  const float* A;  // [H]
  int64_t A_s;
  const void* Bm;  // [T, G, N], n stride 1
  int64_t B_t, B_g;
  const void* Cm;
  int64_t C_t, C_g;
  const void* D;  // [H] or null
  int64_t D_s;
  const void* dt_bias;  // [H] or null
  int64_t db_s;
  void* states;  // [slots, H, P, N]: strides st_slot, st_h, st_p, 1; float32 or bfloat16
  int64_t st_slot, st_h, st_p;
  const int32_t* qsl;
  const int32_t* idx;
  const uint8_t* has_init;
  void* out;  // [T, H, P] contiguous
  int64_t nseq, tokens, H, P, N, G, slots;
  float dt_lo, dt_hi;
  int32_t softplus, bf16, D_bf16, db_bf16, threads, st_bf16;
};

}  // extern "C"

namespace {

template <typename T, typename S>
void ssd(const SsdArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* dtp = static_cast<const T*>(a.dt);
  T* out = static_cast<T*>(a.out);
  const int64_t per_group = a.H / a.G;
#pragma omp parallel for collapse(2) num_threads(team(a.threads)) \
    if (parallel(a.tokens * a.H * a.P * a.N, a.threads)) schedule(dynamic)
  for (int64_t r = 0; r < a.nseq; ++r) {
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t s = a.qsl[r], e = a.qsl[r + 1], g = h / per_group;
      S* st_s = static_cast<S*>(a.states) + a.idx[r] * a.st_slot + h * a.st_h;
      std::vector<float> wide;
      int64_t st_p = 0;
      float* st = widen_rows(st_s, a.P, a.st_p, a.N, a.has_init[r] == 0, wide, st_p);
      const float ah = a.A[h * a.A_s], dh = a.D ? ld_param(a.D, h * a.D_s, a.D_bf16) : 0.f;
      float bbuf[kMaxN], cbuf[kMaxN];
      for (int64_t t = s; t < e; ++t) {
        const float dt = delta(ld(dtp + t * a.dt_t + h * a.dt_h), a.dt_bias, h * a.db_s,
                               a.db_bf16, a.softplus, a.dt_lo, a.dt_hi);
        const float decay = std::exp(dt * ah);
        const float* bv = as_f32(static_cast<const T*>(a.Bm) + t * a.B_t + g * a.B_g, bbuf, a.N);
        const float* cv = as_f32(static_cast<const T*>(a.Cm) + t * a.C_t + g * a.C_g, cbuf, a.N);
        const T* xr = x + t * a.x_t + h * a.x_h;
        T* o = out + (t * a.H + h) * a.P;
        for (int64_t q = 0; q < a.P; ++q) {
          const float xv = ld(xr + q * a.x_p);
          put(o + q,
              ssm_row(st + q * st_p, bv, cv, a.N, dt * xv, dt, nullptr, 0, decay) + dh * xv);
        }
      }
      narrow_rows(st_s, a.P, a.st_p, a.N, wide.data());
    }
  }
}

}  // namespace

extern "C" {

int llmhal_ssd_call(const void* p) {
  const auto& a = *static_cast<const SsdArgs*>(p);
  if (!slots_ok(a.idx, a.nseq, a.slots) || !starts_ok(a.qsl, a.nseq, a.tokens)) return -1;
  if (a.N > kMaxN) return -1;
  if (a.st_bf16)
    a.bf16 ? ssd<uint16_t, uint16_t>(a) : ssd<float, uint16_t>(a);
  else
    a.bf16 ? ssd<uint16_t, float>(a) : ssd<float, float>(a);
  return 0;
}

// Lightning attention's decode step (llmhal/ops/linear_attn_ops.py; MiniMax): per request and
// head, S = exp(-decay) S + k^T v on the [D, Dv] state where it lies, then o = q S. Through torch
// this is three calls per request (scale, rank-1 update, product); here one pass over the state.
struct LightningDecodeArgs {
  const void* q;  // [B, H, D], strides q_b, q_h, 1
  int64_t q_b, q_h;
  const void* k;
  int64_t k_b, k_h;
  const void* v;  // [B, H, Dv]
  int64_t v_b, v_h;
  const float* factor;  // [H]: exp(-decay), computed by the caller
  void* states;  // [slots, H, D, Dv]: strides st_slot, st_h, st_d, 1; float32 or bfloat16
  int64_t st_slot, st_h, st_d;
  const int32_t* idx;  // [B]
  void* out;  // [B, H, Dv] contiguous
  int64_t nb, H, D, Dv, slots;
  int32_t bf16, threads, st_bf16;
};

}  // extern "C"

namespace {

template <typename T, typename S>
void lightning_decode(const LightningDecodeArgs& a) {
  T* out = static_cast<T*>(a.out);
#pragma omp parallel for collapse(2) num_threads(team(a.threads)) \
    if (parallel(a.nb * a.H * a.D * a.Dv, a.threads)) schedule(static)
  for (int64_t b = 0; b < a.nb; ++b) {
    for (int64_t h = 0; h < a.H; ++h) {
      const T* q = static_cast<const T*>(a.q) + b * a.q_b + h * a.q_h;
      const T* k = static_cast<const T*>(a.k) + b * a.k_b + h * a.k_h;
      float vbuf[kMaxN], acc[kMaxN], wide[kMaxN];
      const float* v = as_f32(static_cast<const T*>(a.v) + b * a.v_b + h * a.v_h, vbuf, a.Dv);
      S* st = static_cast<S*>(a.states) + a.idx[b] * a.st_slot + h * a.st_h;
      const vf f = vf{} + a.factor[h];
      for (int64_t e = 0; e < a.Dv; ++e) acc[e] = 0.f;
      for (int64_t d = 0; d < a.D; ++d) {
        // One token: each row is updated once, so a bfloat16 row is widened and rounded back here.
        float* row = wide;
        if constexpr (sizeof(S) == sizeof(float))
          row = st + d * a.st_d;
        else
          for (int64_t e = 0; e < a.Dv; ++e) wide[e] = ld(st + d * a.st_d + e);
        const float kd = ld(k + d), qd = ld(q + d);
        int64_t e = 0;
        for (; e + W <= a.Dv; e += W) {
          const vf s = vload(row + e) * f + vload(v + e) * kd;
          vstore(row + e, s);
          vstore(acc + e, vload(acc + e) + s * qd);
        }
        for (; e < a.Dv; ++e) {
          row[e] = row[e] * a.factor[h] + v[e] * kd;
          acc[e] += row[e] * qd;
        }
        if constexpr (sizeof(S) != sizeof(float))
          for (e = 0; e < a.Dv; ++e) put(st + d * a.st_d + e, row[e]);
      }
      T* o = out + (b * a.H + h) * a.Dv;
      for (int64_t e = 0; e < a.Dv; ++e) put(o + e, acc[e]);
    }
  }
}

}  // namespace

extern "C" {

int llmhal_lightning_decode_call(const void* p) {
  const auto& a = *static_cast<const LightningDecodeArgs*>(p);
  if (!slots_ok(a.idx, a.nb, a.slots) || a.Dv > kMaxN) return -1;
  if (a.st_bf16)
    a.bf16 ? lightning_decode<uint16_t, uint16_t>(a) : lightning_decode<float, uint16_t>(a);
  else
    a.bf16 ? lightning_decode<uint16_t, float>(a) : lightning_decode<float, float>(a);
  return 0;
}

// Mamba-2's gated RMSNorm (llmhal/ops/mamba_ops.py gated_rms_norm): per row and group of g
// channels, h = x * silu(z) in float32, out = w * rnd(h / sqrt(mean(h^2) + eps)), where rnd rounds
// to the activations' dtype and the product with the weight (of that dtype too) is rounded again,
// as torch computes HF's MambaRMSNormGated. Through torch that is ~10 calls with [T, d] float32
// temporaries; here one pass per row.
struct GatedNormArgs {
  const void* x;  // [t, d], row stride x_s
  int64_t x_s;
  const void* z;  // [t, d], row stride z_s, or null (no gate)
  int64_t z_s;
  const void* w;  // [d]
  void* out;      // [t, d] contiguous
  int64_t t, d, group;
  float eps;
  int32_t bf16, threads;
};

}  // extern "C"

namespace {

template <typename T>
void gated_norm(const GatedNormArgs& a) {
#pragma omp parallel for num_threads(team(a.threads)) if (parallel(a.t * a.d, a.threads)) \
    schedule(static)
  for (int64_t i = 0; i < a.t; ++i) {
    const T* x = static_cast<const T*>(a.x) + i * a.x_s;
    const T* z = a.z ? static_cast<const T*>(a.z) + i * a.z_s : nullptr;
    const T* w = static_cast<const T*>(a.w);
    T* o = static_cast<T*>(a.out) + i * a.d;
    float h[kMaxGroup];
    for (int64_t g0 = 0; g0 < a.d; g0 += a.group) {
      // A double sum: a serial float one over a 1536-wide group drifts ~1e-6 from torch's
      // vectorized reduction, which moves float32 parity tests; this one stays within ~1e-7.
      double ss = 0.0;
      for (int64_t c = 0; c < a.group; ++c) {
        float v = ld(x + g0 + c);
        if (z) v *= silu(ld(z + g0 + c));
        h[c] = v;
        ss += static_cast<double>(v) * v;
      }
      const float mean = static_cast<float>(ss / static_cast<double>(a.group));
      const float inv = 1.f / std::sqrt(mean + a.eps);
      for (int64_t c = 0; c < a.group; ++c) {
        T r;
        put(&r, h[c] * inv);  // the cast to the activations' dtype, then the weight's product
        put(o + g0 + c, ld(&r) * ld(w + g0 + c));
      }
    }
  }
}

}  // namespace

extern "C" {

int llmhal_gated_norm_call(const void* p) {
  const auto& a = *static_cast<const GatedNormArgs*>(p);
  if (a.group < 1 || a.group > kMaxGroup || a.d % a.group) return -1;
  a.bf16 ? gated_norm<uint16_t>(a) : gated_norm<float>(a);
  return 0;
}

// Sizes of the structs, so mamba_kernels.py can check its ctypes mirrors match.
int64_t llmhal_mamba_ops_args_size(int which) {
  switch (which) {
    case 0: return sizeof(ConvArgs);
    case 1: return sizeof(SsmUpdateArgs);
    case 2: return sizeof(ScanArgs);
    case 3: return sizeof(SsdArgs);
    case 4: return sizeof(LightningDecodeArgs);
    case 5: return sizeof(GatedNormArgs);
    default: return -1;
  }
}

}  // extern "C"
