// widen(src, dst, n): n values of float32 / bfloat16 / float16 into float32, vectorized
// for bfloat16 (a shift of the bits). Shared by the CPU kernels in this folder.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace planaria_cpu {

inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}
inline void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace planaria_cpu
