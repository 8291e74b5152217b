// MLA (DeepSeek's Multi-head Latent Attention) decode for a whole step in one call
// (llmhal_cpu/kernels/mla_decode.py, used by the cpu_mla attention backend).
//
// Through torch, the absorbed decode of one layer is ~15 ops (the W_UK bmm, a cat, a gather of the
// cached latents into a padded [B, S, L + R] tensor, two bmm, the mask, softmax, casts, the W_UV
// bmm) of a few microseconds of dispatch each, and none of them can be recorded in a CPU step
// graph. Here one call does the step's MLA work:
//
//   1. writes every new token's latent [kv_c, k_pe] at its slot (-1: padding, skipped);
//   2. absorbs each decode query: q_lat[h] = q_nope[h] @ W_UK[h] (W_UK's rows are read once for
//      all decode rows), beside its rotated q_pe;
//   3. attends each (decode row, group of heads) over the row's cached latents, read straight from
//      the paged blocks through the block table: every latent is widened to float32 once and
//      serves all the group's heads (an MQA with one 576-wide head), chunk by chunk with an online
//      softmax, so nothing is gathered or padded;
//   4. applies W_UV to the latent-space output (W_UV's rows read once for all decode rows).
//
// The step is read from memory (slots, block table, sequence lengths), never from the arguments'
// values, so a recorded step graph that replays this call sees each step's own values.
// Activations, weights and the cache share one dtype: float32 or bfloat16 (widened in registers);
// every intermediate stays float32 (torch's bf16 path rounds the absorbed query, the probabilities
// and the latent output to bf16), and only the output is rounded to the model dtype.
//
// Parallel regions use the caller's team size (num_threads(threads)) and run serially through
// if(), as the other kernels here do (see attention/paged_attention.cpp).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "float_bits.h"
#include "simd_math.h"

namespace {

using llmhal_cpu::bf16_bits_to_f32;
using llmhal_cpu::f32_to_bf16_bits;
using llmhal_cpu::hsum;
using llmhal_cpu::vf;
using llmhal_cpu::vload;
using llmhal_cpu::vstore;
using llmhal_cpu::W;

// Heads attended together by one task: each cached latent is widened once for all of them.
constexpr int kHeadGroup = 16;
// Cached tokens widened and scored together before the softmax state is updated.
constexpr int kChunk = 32;

typedef uint16_t vu16 __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(W * sizeof(uint32_t))));

inline vf load(const float* p) { return vload(p); }
// bfloat16 is the high half of a float32: widen and shift.
inline vf load(const uint16_t* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  const vu32 u = __builtin_convertvector(h, vu32) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float scalar(float v) { return v; }
inline float scalar(uint16_t v) { return bf16_bits_to_f32(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = f32_to_bf16_bits(v); }

// dst[0, n) = src widened to float32.
template <typename T>
void widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(dst + i, load(src + i));
  for (; i < n; ++i) dst[i] = scalar(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  vf acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) acc += vload(a + i) * vload(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
inline float dot(const T* w, const float* x, int64_t n) {
  vf acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) acc += load(w + i) * vload(x + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += scalar(w[i]) * x[i];
  return s;
}

// y[0, n) += a * x (x widened from T).
template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
  const vf av = vf{} + a;
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, vload(y + i) + av * load(x + i));
  for (; i < n; ++i) y[i] += a * scalar(x[i]);
}

inline void scale_in_place(float a, float* y, int64_t n) {
  const vf av = vf{} + a;
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, vload(y + i) * av);
  for (; i < n; ++i) y[i] *= a;
}

}  // namespace

extern "C" {

// Mirrors MlaDecodeArgs in mla_decode.py. Element strides; q, kv_c, k_pe need contiguous rows,
// the cache, W_UK [H, nope, L], W_UV [H, v, L] and out [>= b, H, v] are contiguous.
struct MlaDecodeArgs {
  const void* q;  // [>= b, H, nope + rope]: token stride q_s, head stride q_hs
  int64_t q_s, q_hs;
  const void* kv_c;  // [t, L], row stride c_s
  int64_t c_s;
  const void* k_pe;  // [t, rope], row stride pe_s
  int64_t pe_s;
  void* cache;  // [num_slots, L + rope]
  int64_t num_slots;
  const int64_t* slots;  // [t]; -1 = not written
  const int32_t* block_table;  // [>= b, bt_s]; a row's first ceil(seq_len / block_size) are read
  int64_t bt_s;
  const int32_t* seq_lens;  // [>= b]: cached tokens of each decode row, its new one included
  const void* w_uk;
  const void* w_uv;
  void* out;
  int64_t t, b;
  float scale;
  int32_t heads, nope, rope, v, lora, block_size, threads, bf16;
};

}  // extern "C"

namespace {

// Checks everything a call reads through an index before anything is written: returns -1 for a
// slot outside the cache, -2 for a sequence length outside [1, bt_s * block_size], -3 for a block
// id outside the cache.
int check(const MlaDecodeArgs& a) {
  for (int64_t i = 0; i < a.t; ++i)
    if (a.slots[i] < -1 || a.slots[i] >= a.num_slots) return -1;
  const int64_t num_blocks = a.num_slots / a.block_size;
  for (int64_t r = 0; r < a.b; ++r) {
    const int64_t s = a.seq_lens[r];
    if (s < 1 || s > a.bt_s * a.block_size) return -2;
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
  const int64_t B = a.b;
  const int threads = a.threads > 1 ? a.threads : 1;
  const T* q = static_cast<const T*>(a.q);
  T* cache = static_cast<T*>(a.cache);

  // 1. The new latents (decodes read their own token's).
  for (int64_t i = 0; i < a.t; ++i) {
    if (a.slots[i] < 0) continue;
    T* row = cache + a.slots[i] * D;
    std::memcpy(row, static_cast<const T*>(a.kv_c) + i * a.c_s, L * sizeof(T));
    std::memcpy(row + L, static_cast<const T*>(a.k_pe) + i * a.pe_s, R * sizeof(T));
  }
  if (B == 0) return 0;

  // 2. Absorbed queries, float32 [B, H, D]: latent part from W_UK, then q_pe.
  std::vector<float> qlat(B * H * D, 0.f);
  const T* w_uk = static_cast<const T*>(a.w_uk);
#pragma omp parallel for num_threads(threads) if (threads > 1 && H > 1) schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t n = 0; n < NOPE; ++n) {
      const T* w = w_uk + (h * NOPE + n) * L;
      for (int64_t r = 0; r < B; ++r)
        axpy(scalar(q[r * a.q_s + h * a.q_hs + n]), w, &qlat[(r * H + h) * D], L);
    }
    for (int64_t r = 0; r < B; ++r) widen(q + r * a.q_s + h * a.q_hs + NOPE, &qlat[(r * H + h) * D + L], R);
  }

  // 3. Attention in latent space: olat [B, H, L], normalized.
  std::vector<float> olat(B * H * L);
  const int64_t groups = (H + kHeadGroup - 1) / kHeadGroup;
#pragma omp parallel num_threads(threads) if (threads > 1 && B * groups > 1)
  {
    std::vector<float> lat(kChunk * D), scores(kHeadGroup * kChunk);
    float m[kHeadGroup], l[kHeadGroup];
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < B * groups; ++task) {
      const int64_t r = task / groups, h0 = (task % groups) * kHeadGroup;
      const int64_t nh = std::min<int64_t>(kHeadGroup, H - h0);
      const int64_t s = a.seq_lens[r];
      const int32_t* blocks = a.block_table + r * a.bt_s;
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
          widen(cache + slot * D, &lat[j * D], D);
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
          const float* qh = &qlat[(r * H + h0 + hh) * D];
          float* sc = &scores[hh * kChunk];
          float best = m[hh];
          for (int64_t j = 0; j < nc; ++j) {
            sc[j] = dot(qh, &lat[j * D], D) * a.scale;
            best = std::max(best, sc[j]);
          }
          // Online softmax: rescale what was summed under the old maximum.
          const float corr = std::exp(m[hh] - best);
          float* acc_h = acc + hh * L;
          if (corr != 1.f) scale_in_place(corr, acc_h, L);
          float sum = l[hh] * corr;
          for (int64_t j = 0; j < nc; ++j) {
            const float p = std::exp(sc[j] - best);
            sum += p;
            axpy(p, &lat[j * D], acc_h, L);
          }
          m[hh] = best;
          l[hh] = sum;
        }
      }
      for (int64_t hh = 0; hh < nh; ++hh) scale_in_place(1.f / l[hh], acc + hh * L, L);
    }
  }

  // 4. out[r, h] = W_UV[h] @ olat[r, h], rounded to the model dtype.
  const T* w_uv = static_cast<const T*>(a.w_uv);
  T* out = static_cast<T*>(a.out);
#pragma omp parallel for num_threads(threads) if (threads > 1 && H > 1) schedule(static)
  for (int64_t h = 0; h < H; ++h)
    for (int64_t e = 0; e < V; ++e) {
      const T* w = w_uv + (h * V + e) * L;
      for (int64_t r = 0; r < B; ++r) store(out + (r * H + h) * V + e, dot(w, &olat[(r * H + h) * L], L));
    }
  return 0;
}

}  // namespace

extern "C" {

int llmhal_mla_decode_call(const void* p) {
  const auto& a = *static_cast<const MlaDecodeArgs*>(p);
  return a.bf16 ? mla_decode<uint16_t>(a) : mla_decode<float>(a);
}

int64_t llmhal_mla_decode_args_size() { return sizeof(MlaDecodeArgs); }

}  // extern "C"
