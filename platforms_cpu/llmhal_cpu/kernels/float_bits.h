// Scalar float conversions shared by llmhal's native CPU kernels (cpu_attn, quant_gemm, fused_ops).
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

// bfloat16 (the upper half of a float32's bits) <-> float; to bf16 rounds to nearest even as torch's
// cast does, and a NaN stays a (quiet) NaN.
inline float bf16_bits_to_f32(uint16_t b) { return bits_to_f32(static_cast<uint32_t>(b) << 16); }
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t nan = static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

}  // namespace llmhal_cpu
