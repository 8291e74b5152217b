// Portable float vectors and the vector math shared by llmhal's native CPU kernels (cpu_attn,
// the fused ops). GCC/Clang vector extensions: the same source becomes AVX-512, AVX2 or NEON code
// under -march=native. native_build hashes this header into every kernel's cache key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

namespace llmhal_cpu {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// One lane from all W by halving: log2(W) shuffles and ops (a lane-by-lane loop is a chain of W
// dependent ops that the compiler may not reorder for floats).
template <int N, typename Op, std::size_t... J>
inline vf fold_half(vf v, Op op, std::index_sequence<J...>) {
  return op(v, __builtin_shufflevector(v, v, (static_cast<int>(J) + N) % W...));
}
template <int N = W / 2, typename Op>
inline float fold_lanes(vf v, Op op) {
  v = fold_half<N>(v, op, std::make_index_sequence<W>{});
  if constexpr (N > 1) {
    return fold_lanes<N / 2>(v, op);
  } else {
    return v[0];
  }
}

inline float hsum(vf v) {
  return fold_lanes(v, [](vf a, vf b) { return a + b; });
}
// Largest lane (a NaN lane gives an unspecified result: callers pass none).
inline float hmax(vf v) {
  return fold_lanes(v, [](vf a, vf b) { return b > a ? b : a; });
}

inline vf lane_index() {
  vi idx;
  for (int i = 0; i < W; ++i) idx[i] = i;
  return __builtin_convertvector(idx, vf);
}

// A function whose a * b + c must round twice, as torch (and the scalar code it must match bit
// for bit) rounds it: the build's -ffp-contract=fast would otherwise fuse them into one FMA.
// GCC takes a function attribute, Clang a pragma at the top of the body.
#if defined(__clang__)
#define LLMHAL_NO_FMA_CONTRACTION
#define LLMHAL_NO_FMA_CONTRACTION_BODY _Pragma("clang fp contract(off)")
#else
#define LLMHAL_NO_FMA_CONTRACTION __attribute__((optimize("fp-contract=off")))
#define LLMHAL_NO_FMA_CONTRACTION_BODY
#endif

// exp via Cody-Waite range reduction and the Cephes single-precision polynomial (about 1 ulp), on
// W lanes. x * log2(e) is rounded by adding and subtracting 1.5 * 2^23 (round to nearest), so no
// lane leaves the vector unit, and the rounded integer is read back from the sum's low mantissa
// bits. Inputs are clamped to [-87.3, 88.3]: exp(-inf) becomes ~1e-38, harmless as a weight.
inline vf exp_approx(vf x) {
  const vf lo = vf{} - 87.3f, hi = vf{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = vf{} + 12582912.f;
  const vf big = x * 1.44269504088896341f + magic;
  const vf n = big - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi e;
  std::memcpy(&e, &big, sizeof e);
  vi bias;
  std::memcpy(&bias, &magic, sizeof bias);
  e = (e - bias + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

inline float exp_approx(float x) { return exp_approx(vf{} + x)[0]; }

}  // namespace llmhal_cpu
