// argmax over one row of float32 / bfloat16 / float16 values, read as their bits: the
// first index of the maximum, NaN counting as the maximum (the first NaN wins), +0 and -0
// equal (torch.argmax's answer on the CPU). argmax_row: one pass takes the maximum of each
// chunk of 256 values (vectorized), a second looks only inside the first chunk that holds
// the row's maximum. With AVX512-BW, bfloat16 and float32 rows take the integer-key path
// (argmax_row_avx512). argmax_row_best picks. Shared by argmax.cpp (the sampler's argmax)
// and lm_head_argmax.cpp (the greedy token straight from the lm_head).
#pragma once

#include <c10/util/Half.h>

#include "tile_dot.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace planaria_cpu {


constexpr int64_t kChunk = 256;

// float value and "is NaN" from the raw bits: -ffast-math lets the compiler assume floats
// are never NaN, so the test is on the bits
inline float as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
struct Bf16 {
  using Bits = uint16_t;
  static float value(Bits b) { return as_float(static_cast<uint32_t>(b) << 16); }
  static bool nan(Bits b) { return (b & 0x7fffu) > 0x7f80u; }
};
struct F32 {
  using Bits = uint32_t;
  static float value(Bits b) { return as_float(b); }
  static bool nan(Bits b) { return (b & 0x7fffffffu) > 0x7f800000u; }
};
struct F16 {
  using Bits = uint16_t;
  static float value(Bits b) { return static_cast<float>(c10::Half(b, c10::Half::from_bits())); }
  static bool nan(Bits b) { return (b & 0x7fffu) > 0x7c00u; }
};

template <typename F>
int64_t argmax_row(const typename F::Bits* row, int64_t V, float* chunk_max) {
  const int64_t nchunks = (V + kChunk - 1) / kChunk;
  float best = 0.f;
  for (int64_t c = 0; c < nchunks; ++c) {
    const typename F::Bits* p = row + c * kChunk;
    const int64_t n = std::min(kChunk, V - c * kChunk);
    float m = F::value(p[0]);
    int any_nan = 0;
#pragma omp simd reduction(max : m) reduction(| : any_nan)
    for (int64_t i = 0; i < n; ++i) {
      const float v = F::value(p[i]);
      m = v > m ? v : m;
      any_nan |= static_cast<int>(F::nan(p[i]));
    }
    if (any_nan) {  // the first NaN is the answer
      for (int64_t i = 0; i < n; ++i)
        if (F::nan(p[i])) return c * kChunk + i;
    }
    chunk_max[c] = m;
    best = (c == 0 || m > best) ? m : best;
  }
  for (int64_t c = 0; c < nchunks; ++c) {
    if (chunk_max[c] == best) {
      const typename F::Bits* p = row + c * kChunk;
      const int64_t n = std::min(kChunk, V - c * kChunk);
      for (int64_t i = 0; i < n; ++i)
        if (F::value(p[i]) == best) return c * kChunk + i;
    }
  }
  return 0;  // unreachable: the maximum is in some chunk
}

#if defined(__AVX512BW__)
// The AVX-512 path for bfloat16 and float32: the bits of each value become an unsigned
// key that orders as the floats do (negative: all bits flipped; positive: the sign bit
// set), so one integer max per vector finds the row's maximum with no conversion; a
// second pass finds its first index (bits equal, or either zero when the maximum is a
// zero: +0 == -0). NaNs are looked for on the side (|bits| above infinity's), and a row
// with one takes the scalar code, which returns its first NaN.
template <typename Bits>
struct Lanes;
template <>
struct Lanes<uint16_t> {
  static constexpr int64_t n = 32;
  using Mask = __mmask32;
  static __m512i load(const uint16_t* p, Mask m) { return _mm512_maskz_loadu_epi16(m, p); }
  static Mask all(int64_t left) { return tail_mask32(left); }
  static __m512i key(__m512i b) {
    return _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi16(b, 15), _mm512_set1_epi16(int16_t(0x8000))));
  }
  static __m512i max(__m512i acc, Mask m, __m512i k) { return _mm512_mask_max_epu16(acc, m, acc, k); }
  static Mask nan(__m512i b, Mask m) {
    return _mm512_mask_cmpgt_epu16_mask(m, _mm512_and_si512(b, _mm512_set1_epi16(0x7fff)),
                                        _mm512_set1_epi16(0x7f80));
  }
  static uint16_t reduce_max(__m512i acc) {
    alignas(64) uint16_t v[32];
    _mm512_store_si512(v, acc);
    uint16_t m = 0;
    for (uint16_t x : v) m = std::max(m, x);
    return m;
  }
  static uint16_t unkey(uint16_t k) { return (k & 0x8000u) ? uint16_t(k ^ 0x8000u) : uint16_t(~k); }
  static Mask eq(__m512i b, uint16_t bits, Mask m) { return _mm512_mask_cmpeq_epi16_mask(m, b, _mm512_set1_epi16(int16_t(bits))); }
  static uint16_t abs_bits(uint16_t b) { return b & 0x7fffu; }
  static uint16_t neg_zero() { return 0x8000u; }
};
template <>
struct Lanes<uint32_t> {
  static constexpr int64_t n = 16;
  using Mask = __mmask16;
  static __m512i load(const uint32_t* p, Mask m) { return _mm512_maskz_loadu_epi32(m, p); }
  static Mask all(int64_t left) { return tail_mask16(left); }
  static __m512i key(__m512i b) {
    return _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi32(b, 31), _mm512_set1_epi32(int32_t(0x80000000u))));
  }
  static __m512i max(__m512i acc, Mask m, __m512i k) { return _mm512_mask_max_epu32(acc, m, acc, k); }
  static Mask nan(__m512i b, Mask m) {
    return _mm512_mask_cmpgt_epu32_mask(m, _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                        _mm512_set1_epi32(0x7f800000));
  }
  static uint32_t reduce_max(__m512i acc) { return _mm512_reduce_max_epu32(acc); }
  static uint32_t unkey(uint32_t k) { return (k & 0x80000000u) ? (k ^ 0x80000000u) : ~k; }
  static Mask eq(__m512i b, uint32_t bits, Mask m) { return _mm512_mask_cmpeq_epi32_mask(m, b, _mm512_set1_epi32(int32_t(bits))); }
  static uint32_t abs_bits(uint32_t b) { return b & 0x7fffffffu; }
  static uint32_t neg_zero() { return 0x80000000u; }
};

// -1: the row has a NaN (the caller's scalar code answers)
template <typename Bits>
int64_t argmax_row_avx512(const Bits* row, int64_t V) {
  using L = Lanes<Bits>;
  __m512i acc = _mm512_setzero_si512();  // key 0 is below every value's key
  typename L::Mask nan = 0;
  for (int64_t i = 0; i < V; i += L::n) {
    const typename L::Mask m = L::all(V - i);
    const __m512i b = L::load(row + i, m);
    acc = L::max(acc, m, L::key(b));
    nan |= L::nan(b, m);
  }
  if (nan) return -1;
  const Bits best = L::unkey(L::reduce_max(acc));
  const bool zero = L::abs_bits(best) == 0;
  for (int64_t i = 0; i < V; i += L::n) {
    const typename L::Mask m = L::all(V - i);
    const __m512i b = L::load(row + i, m);
    typename L::Mask hit = L::eq(b, best, m);
    if (zero) hit |= L::eq(b, Bits(best ^ L::neg_zero()), m);
    if (hit) return i + __builtin_ctzll(static_cast<unsigned long long>(hit));
  }
  return 0;  // unreachable: the maximum is in the row
}
#endif

// the answer for one row; chunk_max: scratch of (V + 255) / 256 floats
template <typename F>
inline int64_t argmax_row_best(const typename F::Bits* row, int64_t V, float* chunk_max) {
#if defined(__AVX512BW__)
  if constexpr (!std::is_same_v<F, F16>) {
    const int64_t i = argmax_row_avx512<typename F::Bits>(row, V);
    if (i >= 0) return i;
  }
#endif
  return argmax_row<F>(row, V, chunk_max);
}

inline int64_t argmax_scratch(int64_t V) { return (V + kChunk - 1) / kChunk; }

}  // namespace planaria_cpu
