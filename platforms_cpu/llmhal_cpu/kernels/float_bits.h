// Scalar float conversions shared by llmhal's native CPU kernels (cpu_attn, quant_gemm).
// Branch-free, so that conversion loops vectorize with any compiler. native_build hashes this header
// into every kernel's cache key, so editing it rebuilds both.
#pragma once

#include <cstdint>
#include <cstring>

namespace llmhal_cpu {

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE half (in the low 16 bits of h) -> float.
inline float half_bits_to_f32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t mag = h & 0x7fffu;
  const uint32_t exp = mag >> 10;
  // Normal and Inf/NaN: rebias the exponent (15 -> 127; 31 -> 255). Subnormal: mantissa * 2^-24.
  const uint32_t normal = sign | ((mag << 13) + (exp == 31 ? (224u << 23) : (112u << 23)));
  const float sub = static_cast<float>(static_cast<int32_t>(mag)) * 0x1p-24f;
  return exp == 0 ? (sign ? -sub : sub) : bits_to_f32(normal);
}

}  // namespace llmhal_cpu
