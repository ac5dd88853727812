// tile_dot: the register tile the linear kernels share (skinny_linear.cpp, fused_moe.cpp).
// sums[r][c] = w_r . x_c for R <= 4 weight rows (w, w + ldw, ...) and C <= 4 vectors xs[c]
// of length K: 16 float32 accumulators held in registers over one pass along K, filled
// with FMA (float32) or AVX512-BF16's dot instruction (bfloat16, 32 products each); the K
// tail is a masked load. A weight tile is read from memory once and stays in L1 while
// further calls meet it with the next vectors. ``prefetch``: the next tile's start, read
// ahead R cache lines per step (what this tile reads per step), or nullptr.
// tile_dot_fast<T>() says whether this build has it for T (AVX-512 for float32,
// AVX512-BF16 for bfloat16, and AVX2 + FMA for float32: 8 lanes, the tile's columns two at
// a time, since 16 accumulators would fill all 16 AVX2 registers);
// dot_many is the plain C++ path for the rest. tail_mask16/32: the load mask for the last,
// partial vector of a row (all lanes when 16/32 are left). avx512_fast<T>(): the AVX-512
// part alone, avx2_fast<T>() the AVX2 one (decode attention has a fast path for each).
#pragma once

#include <c10/util/BFloat16.h>

#include "widen.h"

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// tile_dot / tile_dot_any are defined (see tile_dot_fast for which dtypes)
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PLANARIA_TILE_DOT 1
#endif

namespace planaria_cpu {

constexpr int kTileRows = 4;
constexpr int kTileCols = 4;

template <typename T>
constexpr bool avx512_fast() {
#if defined(__AVX512BF16__)
  if (std::is_same_v<T, c10::BFloat16>) return true;
#endif
#if defined(__AVX512F__)
  if (std::is_same_v<T, float>) return true;
#endif
  return false;
}

// the AVX2 + FMA part alone (float32 on a CPU without AVX-512: decode attention's
// 8-lane fast path)
template <typename T>
constexpr bool avx2_fast() {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (std::is_same_v<T, float>) return true;
#endif
  return false;
}

template <typename T>
constexpr bool tile_dot_fast() {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (std::is_same_v<T, float>) return true;
#endif
  return avx512_fast<T>();
}

// out[j] = w . xs[j] for n float32 vectors of length len; w is widened once into wf
// (scratch of len floats)
template <typename T>
inline void dot_many(const T* w, float* wf, const float* const* xs, int64_t n, int64_t len, float* const* out) {
  widen(w, wf, len);
  for (int64_t j = 0; j < n; ++j) {
    const float* x = xs[j];
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < len; ++i) s += wf[i] * x[i];
    *out[j] = s;
  }
}

#if defined(__AVX512F__)
inline __mmask16 tail_mask16(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }
inline __mmask32 tail_mask32(int64_t left) {
  return left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1);
}

template <typename T, int R, int C>
inline void tile_dot(const T* w, int64_t ldw, const T* const* xs, int64_t K, float (*sums)[kTileCols],
                     const T* prefetch) {
  constexpr int64_t step = std::is_same_v<T, float> ? 16 : 32;
  // GCC keeps the accumulator array in registers only when these loops are unrolled early
  __m512 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const char* pf = reinterpret_cast<const char*>(prefetch);
  for (int64_t k = 0; k < K; k += step) {
    const int64_t left = K - k;
    if (pf) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm_prefetch(pf + (k * R + r * step) * sizeof(T), _MM_HINT_T0);
    }
    if constexpr (std::is_same_v<T, float>) {
      const __mmask16 m = tail_mask16(left);
      __m512 xv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) xv[c] = _mm512_maskz_loadu_ps(m, xs[c] + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 wv = _mm512_maskz_loadu_ps(m, w + r * ldw + k);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
      }
    } else {
#if defined(__AVX512BF16__)
      const __mmask32 m = tail_mask32(left);
      __m512bh xv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) xv[c] = (__m512bh)_mm512_maskz_loadu_epi16(m, xs[c] + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * ldw + k);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv, xv[c]);
      }
#endif
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) sums[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <typename T, int R>
inline void tile_dot_cols(int C, const T* w, int64_t ldw, const T* const* xs, int64_t K, float (*sums)[kTileCols],
                          const T* prefetch) {
  switch (C) {
    case 4: tile_dot<T, R, 4>(w, ldw, xs, K, sums, prefetch); break;
    case 3: tile_dot<T, R, 3>(w, ldw, xs, K, sums, prefetch); break;
    case 2: tile_dot<T, R, 2>(w, ldw, xs, K, sums, prefetch); break;
    default: tile_dot<T, R, 1>(w, ldw, xs, K, sums, prefetch); break;
  }
}

#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA, float32 only: sums[r][c] for R <= 4 weight rows and C <= 2 vectors in one
// pass along K (8 accumulators, 2 x and 1 w register); tile_dot takes C = 3, 4 as two
// passes, the second reading the tile from L1.
inline __m256i tail_mask8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left < 8 ? left : 8)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R, int C>
inline void tile_dot_avx2(const float* w, int64_t ldw, const float* const* xs, int64_t K, float (*sums)[kTileCols],
                          int c0, const float* prefetch) {
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const char* pf = reinterpret_cast<const char*>(prefetch);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (pf && (k & 15) == 0) {  // one cache line (16 floats) per weight row every other step
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm_prefetch(pf + (k * R + r * 16) * sizeof(float), _MM_HINT_T0);
    }
    __m256 xv[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(xs[c0 + c] + k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 wv = _mm256_loadu_ps(w + r * ldw + k);
      // held in a register: GCC otherwise folds the load into each of the C FMAs, and
      // C loads of a weight vector make the loop load-bound (10 loads per 8 FMAs at
      // C = 2; 6 with this): the fused MoE at 8-16 tokens an expert 10-15% faster
      if constexpr (C > 1) __asm__("" : "+x"(wv));
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const __m256i m = tail_mask8(K - k);
    __m256 xv[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) xv[c] = _mm256_maskload_ps(xs[c0 + c] + k, m);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_maskload_ps(w + r * ldw + k, m);
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) sums[r][c0 + c] = hsum8(acc[r][c]);
}

template <typename T, int R>
inline void tile_dot_cols(int C, const T* w, int64_t ldw, const T* const* xs, int64_t K, float (*sums)[kTileCols],
                          const T* prefetch) {
  static_assert(std::is_same_v<T, float>, "the AVX2 tile is float32 only");
  switch (C) {
    case 4:
      tile_dot_avx2<R, 2>(w, ldw, xs, K, sums, 0, prefetch);
      tile_dot_avx2<R, 2>(w, ldw, xs, K, sums, 2, nullptr);
      break;
    case 3:
      tile_dot_avx2<R, 2>(w, ldw, xs, K, sums, 0, prefetch);
      tile_dot_avx2<R, 1>(w, ldw, xs, K, sums, 2, nullptr);
      break;
    case 2: tile_dot_avx2<R, 2>(w, ldw, xs, K, sums, 0, prefetch); break;
    default: tile_dot_avx2<R, 1>(w, ldw, xs, K, sums, 0, prefetch); break;
  }
}
#endif

#if defined(PLANARIA_TILE_DOT)
// tile_dot with R and C known at run time (each 1..4)
template <typename T>
inline void tile_dot_any(int R, int C, const T* w, int64_t ldw, const T* const* xs, int64_t K,
                         float (*sums)[kTileCols], const T* prefetch) {
  switch (R) {
    case 4: tile_dot_cols<T, 4>(C, w, ldw, xs, K, sums, prefetch); break;
    case 3: tile_dot_cols<T, 3>(C, w, ldw, xs, K, sums, prefetch); break;
    case 2: tile_dot_cols<T, 2>(C, w, ldw, xs, K, sums, prefetch); break;
    default: tile_dot_cols<T, 1>(C, w, ldw, xs, K, sums, prefetch); break;
  }
}
#endif

}  // namespace planaria_cpu
