// Small helpers shared by the CPU kernels: scalar conversion and a branch-free exp that GCC/Clang
// auto-vectorise at -O3 (no -ffast-math, no target flags, no runtime dispatch).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace saguaro {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// exp(x) for x <= 0 (softmax arguments after subtracting the row max); -inf and very negative x give 0.
// Cody-Waite range reduction + degree-6 polynomial: relative error ~2e-7 in fp32.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;  // also maps -inf to -87 (exp = 1.6e-38, below any softmax resolution)
  // Round to nearest with the 1.5*2^23 trick (vectorises on plain SSE2, unlike nearbyint/floor).
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return x <= -87.0f ? 0.0f : p * scale;
}

}  // namespace saguaro
