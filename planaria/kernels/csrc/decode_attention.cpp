// Decode attention read from the paged KV cache in place (no gather), for the CPU.
//
// One query token per sequence. q [B, Hq, D]; k_cache, v_cache [slots, Hkv, D] (slot =
// block * block_size + offset; each slot's Hkv * D values contiguous); block_tables
// [B, NB] int64; ctx_lens [B] int64 (tokens 0 .. ctx_len - 1 are attended to); out
// [B, Hq, D]. Query head h reads KV head h / (Hq / Hkv). Scores, softmax and the weighted
// sum run in float32; bfloat16 / float16 values are widened as they are read. Work is
// split over (sequence, KV head) pairs with at::parallel_for (torch's own thread pool);
// each pair reads its keys and values once for its whole group of query heads. With
// AVX-512 (float32) or AVX512-BF16 (bfloat16): scores for 16 keys at a time, each dot
// product left in a vector and the 16 summed by one transpose-and-add tree (bf16 keys
// read by the dot instruction as they are); the weighted values with up to 4 heads x 64
// values of float32 accumulators in registers over all the tokens; with AVX2 + FMA and no
// AVX-512 (float32) the same with 8 lanes (8 keys a tree, 3 heads x 32 or 4 heads x 16
// values in registers). Token slots are worked out once per pair, block by block (no
// division per token). float16 and builds without those instructions take the plain loops below.
// planaria/kernels/cpu_ext.py builds this file; the torch code in kernels/attention.py is
// the reference it is tested against (tests/kernels/test_cpu_ext.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "tile_dot.h"
#include "widen.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using planaria_cpu::widen;

#if defined(__AVX512F__)
// for a scores pass working on the group of ``n`` keys at t0 (``group`` keys a group): the
// next group's key rows, and this group's value rows for the pass after the softmax (the
// slots are scattered over the cache: the hardware prefetcher cannot guess them)
template <typename T>
inline void prefetch_rows(const T* kp, const T* vp, int64_t slot_stride, int64_t off, int64_t row_bytes,
                          const int64_t* slots, int64_t t0, int64_t group, int64_t n, int64_t ctx) {
  for (int64_t t = t0 + group; t < std::min(ctx, t0 + 2 * group); ++t)
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(kp + slots[t] * slot_stride + off) + b, _MM_HINT_T0);
  for (int64_t t = t0; t < t0 + n; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(vp + slots[t] * slot_stride + off) + b, _MM_HINT_T1);
}
#endif

#if defined(__AVX512F__)
// lane j of the result = the sum of v[j]'s 16 lanes (a transpose-and-add tree: 45
// instructions for 16 sums, where 16 separate reductions take about 160)
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  // each 128-bit lane of x[i] now holds 4 partial sums of sources 4i .. 4i + 3
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// the 16 lanes whose sum is a . b (length D), float32 FMA or AVX512-BF16's dot
template <typename T>
inline __m512 dot_lanes(const T* a, const T* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = planaria_cpu::tail_mask16(D - d);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
    }
  } else {
#if defined(__AVX512BF16__)
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 m = planaria_cpu::tail_mask32(D - d);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, a + d),
                             (__m512bh)_mm512_maskz_loadu_epi16(m, b + d));
    }
#endif
  }
  return acc;
}

// scores[g * ctx + t] = scale * q_g . k_t for G query heads, 16 keys at a time
template <typename T>
inline void scores_fast(const T* q, const T* kp, const T* vp, int64_t slot_stride, int64_t koff,
                        const int64_t* slots, int64_t ctx, int64_t G, int64_t D, float scale, float* scores) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const T* krow[16];
  __m512 v[16];
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, ctx - t0));
    prefetch_rows(kp, vp, slot_stride, koff, row_bytes, slots, t0, 16, n, ctx);
    for (int j = 0; j < n; ++j) krow[j] = kp + slots[t0 + j] * slot_stride + koff;
    const __mmask16 m = planaria_cpu::tail_mask16(n);
    for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) v[j] = j < n ? dot_lanes<T>(q + g * D, krow[j], D) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(scores + g * ctx + t0, m, _mm512_mul_ps(hsum16(v), vscale));
    }
  }
}
// 16 values of a row as float32 (masked tail)
template <typename T>
inline __m512 load16(const T* p, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// out_g[d0 .. d0 + 16 DC) = sum_t p_g[t] v_t[same] for GN query heads: GN x DC float32
// accumulators held in registers over all the tokens, each value row read once
template <typename T, int GN, int DC>
inline void weighted_values(const T* vp, int64_t slot_stride, int64_t voff, const int64_t* slots, int64_t ctx,
                            int64_t D, int64_t d0, const float* p, int64_t p_stride, float* out) {
  __mmask16 m[DC];
  for (int c = 0; c < DC; ++c) m[c] = planaria_cpu::tail_mask16(D - d0 - 16 * c);
  __m512 acc[GN][DC];
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    const T* row = vp + slots[t] * slot_stride + voff + d0;
    __m512 v[DC];
#pragma GCC unroll 4
    for (int c = 0; c < DC; ++c) v[c] = load16<T>(row + 16 * c, m[c]);
#pragma GCC unroll 4
    for (int g = 0; g < GN; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * p_stride + t]);
#pragma GCC unroll 4
      for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < DC; ++c) _mm512_mask_storeu_ps(out + g * D + d0 + 16 * c, m[c], acc[g][c]);
}

template <typename T, int GN>
inline void weighted_values_d(int dc, const T* vp, int64_t slot_stride, int64_t voff, const int64_t* slots,
                              int64_t ctx, int64_t D, int64_t d0, const float* p, int64_t p_stride, float* out) {
  switch (dc) {
    case 4: weighted_values<T, GN, 4>(vp, slot_stride, voff, slots, ctx, D, d0, p, p_stride, out); break;
    case 3: weighted_values<T, GN, 3>(vp, slot_stride, voff, slots, ctx, D, d0, p, p_stride, out); break;
    case 2: weighted_values<T, GN, 2>(vp, slot_stride, voff, slots, ctx, D, d0, p, p_stride, out); break;
    default: weighted_values<T, GN, 1>(vp, slot_stride, voff, slots, ctx, D, d0, p, p_stride, out); break;
  }
}

// acc_g = sum_t p_gt v_t for all G heads: blocks of up to 4 heads x 64 values
template <typename T>
inline void values_fast(const T* vp, int64_t slot_stride, int64_t voff, const int64_t* slots, int64_t ctx,
                        int64_t G, int64_t D, const float* p, float* acc) {
  for (int64_t g0 = 0; g0 < G; g0 += 4)
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int dc = static_cast<int>((std::min<int64_t>(64, D - d0) + 15) / 16);
      const float* pg = p + g0 * ctx;
      float* ag = acc + g0 * D;
      switch (std::min<int64_t>(4, G - g0)) {
        case 4: weighted_values_d<T, 4>(dc, vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
        case 3: weighted_values_d<T, 3>(dc, vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
        case 2: weighted_values_d<T, 2>(dc, vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
        default: weighted_values_d<T, 1>(dc, vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
      }
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA, float32 (a CPU without AVX-512): the same two passes with 8 lanes. Scores
// for 8 keys at a time (the 8 dot products side by side, each left in a vector, the 8
// summed by one hadd-and-permute tree); the weighted values with up to 3 heads x 32 values
// of accumulators in registers over all the tokens (4 heads x 16 where D is not a
// multiple of 32). Keys and values are prefetched by software, far enough ahead to cover a
// miss to memory: at 64 sequences the cache no longer fits in L3, and the first version
// (one group of keys ahead, 4 passes over the values) read it at 2-4 GB/s on an EPYC
// AVX2 host; this one at 6-8 GB/s (bench/README.md).
using planaria_cpu::tail_mask8;

// lane j of the result = the sum of v[j]'s 8 lanes
inline __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // low / high halves' sums
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// the 8 lanes whose sum is a . b (length D)
inline __m256 dot_lanes8(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  if (d < D) {
    const __m256i m = tail_mask8(D - d);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + d, m), _mm256_maskload_ps(b + d, m), acc);
  }
  return acc;
}

// prefetch rows [t0, t1) of a cache (head offset off), every cache line of each
inline void prefetch_span(const float* base, int64_t slot_stride, int64_t off, int64_t row_bytes,
                          const int64_t* slots, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(base + slots[t] * slot_stride + off) + b, _MM_HINT_T0);
}

// keys are prefetched this many groups of 8 ahead (the rows are scattered over the cache,
// so the hardware prefetcher cannot follow them; one group's sums take less time than a
// miss to memory, so one group ahead left most of it exposed)
constexpr int64_t kKeyGroupsAhead = 3;

// scores[g * ctx + t] = scale * q_g . k_t for G query heads, 8 keys at a time. Where D is
// a multiple of 8, the 8 keys' sums run side by side (8 independent FMA chains sharing
// each load of q: throughput-bound), not one key's chain after another (latency-bound);
// each lane adds the same products in the same order either way, so the scores are the
// same bits.
inline void scores_avx2(const float* q, const float* kp, int64_t slot_stride, int64_t koff,
                        const int64_t* slots, int64_t ctx, int64_t G, int64_t D, float scale, float* scores) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const float* krow[8];
  __m256 v[8];
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(float));
  prefetch_span(kp, slot_stride, koff, row_bytes, slots, 0, std::min(ctx, 8 * kKeyGroupsAhead));
  for (int64_t t0 = 0; t0 < ctx; t0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, ctx - t0));
    const int64_t ahead = t0 + 8 * kKeyGroupsAhead;
    if (ahead < ctx) prefetch_span(kp, slot_stride, koff, row_bytes, slots, ahead, std::min(ctx, ahead + 8));
    for (int j = 0; j < n; ++j) krow[j] = kp + slots[t0 + j] * slot_stride + koff;
    const __m256i m = tail_mask8(n);
    if (D % 8 == 0) {
      for (int j = n; j < 8; ++j) krow[j] = krow[0];  // a tail group: lanes past n are not stored
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) v[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + d);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) v[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krow[j] + d), v[j]);
        }
        _mm256_maskstore_ps(scores + g * ctx + t0, m, _mm256_mul_ps(hsum8x8(v), vscale));
      }
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) v[j] = j < n ? dot_lanes8(q + g * D, krow[j], D) : _mm256_setzero_ps();
      _mm256_maskstore_ps(scores + g * ctx + t0, m, _mm256_mul_ps(hsum8x8(v), vscale));
    }
  }
}

// value rows are prefetched this many tokens ahead, by the first pass over them
constexpr int64_t kValueRowsAhead = 16;

// out_g[d0 .. d0 + 32) for GN <= 3 heads (D a multiple of 32): GN x 4 accumulators, a
// token's GN weights broadcast once, each of its 4 value vectors loaded once and used GN
// times (all 16 registers); the pass at d0 = 0 prefetches whole rows ahead
template <int GN>
inline void weighted_values8x4(const float* vp, int64_t slot_stride, int64_t voff, const int64_t* slots, int64_t ctx,
                               int64_t D, int64_t d0, const float* p, int64_t p_stride, float* out) {
  __m256 acc[GN][4];
#pragma GCC unroll 3
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_setzero_ps();
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(float));
  if (d0 == 0) prefetch_span(vp, slot_stride, voff, row_bytes, slots, 0, std::min(ctx, kValueRowsAhead));
  for (int64_t t = 0; t < ctx; ++t) {
    if (d0 == 0 && t + kValueRowsAhead < ctx)
      prefetch_span(vp, slot_stride, voff, row_bytes, slots, t + kValueRowsAhead, t + kValueRowsAhead + 1);
    const float* row = vp + slots[t] * slot_stride + voff + d0;
    __m256 pg[GN];
#pragma GCC unroll 3
    for (int g = 0; g < GN; ++g) pg[g] = _mm256_broadcast_ss(p + g * p_stride + t);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256 v = _mm256_loadu_ps(row + 8 * c);
#pragma GCC unroll 3
      for (int g = 0; g < GN; ++g) acc[g][c] = _mm256_fmadd_ps(pg[g], v, acc[g][c]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + g * D + d0 + 8 * c, acc[g][c]);
}

// out_g[d0 .. d0 + 8 DC) = sum_t p_g[t] v_t[same] for GN query heads (GN x DC accumulators)
template <int GN, int DC>
inline void weighted_values8(const float* vp, int64_t slot_stride, int64_t voff, const int64_t* slots, int64_t ctx,
                             int64_t D, int64_t d0, const float* p, int64_t p_stride, float* out) {
  __m256i m[DC];
  for (int c = 0; c < DC; ++c) m[c] = tail_mask8(D - d0 - 8 * c);
  __m256 acc[GN][DC];
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 2
    for (int c = 0; c < DC; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    const float* row = vp + slots[t] * slot_stride + voff + d0;
    __m256 v[DC];
#pragma GCC unroll 2
    for (int c = 0; c < DC; ++c) v[c] = _mm256_maskload_ps(row + 8 * c, m[c]);
#pragma GCC unroll 4
    for (int g = 0; g < GN; ++g) {
      const __m256 pg = _mm256_broadcast_ss(p + g * p_stride + t);
#pragma GCC unroll 2
      for (int c = 0; c < DC; ++c) acc[g][c] = _mm256_fmadd_ps(pg, v[c], acc[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 2
    for (int c = 0; c < DC; ++c) _mm256_maskstore_ps(out + g * D + d0 + 8 * c, m[c], acc[g][c]);
}

template <int GN>
inline void weighted_values8_d(int dc, const float* vp, int64_t slot_stride, int64_t voff, const int64_t* slots,
                               int64_t ctx, int64_t D, int64_t d0, const float* p, int64_t p_stride, float* out) {
  if (dc == 2)
    weighted_values8<GN, 2>(vp, slot_stride, voff, slots, ctx, D, d0, p, p_stride, out);
  else
    weighted_values8<GN, 1>(vp, slot_stride, voff, slots, ctx, D, d0, p, p_stride, out);
}

// acc_g = sum_t p_gt v_t for all G heads: blocks of up to 4 heads x 16 values
inline void values_avx2(const float* vp, int64_t slot_stride, int64_t voff, const int64_t* slots, int64_t ctx,
                        int64_t G, int64_t D, const float* p, float* acc) {
  if (D % 32 == 0) {  // blocks of up to 3 heads x 32 values: half the passes over the rows
    for (int64_t g0 = 0; g0 < G; g0 += 3)
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const float* pg = p + g0 * ctx;
        float* ag = acc + g0 * D;
        switch (std::min<int64_t>(3, G - g0)) {
          case 3: weighted_values8x4<3>(vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
          case 2: weighted_values8x4<2>(vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
          default: weighted_values8x4<1>(vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
        }
      }
    return;
  }
  for (int64_t g0 = 0; g0 < G; g0 += 4)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const int dc = D - d0 > 8 ? 2 : 1;
      const float* pg = p + g0 * ctx;
      float* ag = acc + g0 * D;
      switch (std::min<int64_t>(4, G - g0)) {
        case 4: weighted_values8_d<4>(dc, vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
        case 3: weighted_values8_d<3>(dc, vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
        case 2: weighted_values8_d<2>(dc, vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
        default: weighted_values8_d<1>(dc, vp, slot_stride, voff, slots, ctx, D, d0, pg, ctx, ag); break;
      }
    }
}
#endif

template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& ctx_lens, int64_t block_size,
                   double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), G = Hq / Hkv, NB = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t slot_stride = Hkv * D;
  const float fscale = static_cast<float>(scale);
  int64_t max_ctx = 1;
  for (int64_t b = 0; b < B; ++b) max_ctx = std::max(max_ctx, lens[b]);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), row(D), scores(G * max_ctx), acc(G * D), denom(G);
    std::vector<int64_t> slots(max_ctx);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t ctx = lens[b];
      const int64_t* table = tables + b * NB;
      for (int64_t t = 0, i = 0; t < ctx; ++i) {  // slot of each token, block by block
        const int64_t base = table[i] * block_size, n = std::min(block_size, ctx - t);
        for (int64_t j = 0; j < n; ++j) slots[t++] = base + j;
      }
      if constexpr (planaria_cpu::avx512_fast<T>()) {
#if defined(__AVX512F__)
        scores_fast<T>(qp + (b * Hq + h * G) * D, kp, vp, slot_stride, h * D, slots.data(), ctx, G, D, fscale,
                       scores.data());
#endif
      } else if constexpr (planaria_cpu::avx2_fast<T>()) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        scores_avx2(qp + (b * Hq + h * G) * D, kp, slot_stride, h * D, slots.data(), ctx, G, D, fscale,
                    scores.data());
#endif
      } else {
        widen(qp + (b * Hq + h * G) * D, qf.data(), G * D);
        for (int64_t i = 0; i < G * D; ++i) qf[i] *= fscale;
        // scores[g * ctx + t] = q_g . k_t
        for (int64_t t = 0; t < ctx; ++t) {
          widen(kp + slots[t] * slot_stride + h * D, row.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
            scores[g * ctx + t] = s;
          }
        }
      }
      // softmax over t, per query head
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * ctx;
        float mx = sg[0];  // ctx >= 1; no infinities anywhere (built with -ffast-math)
        for (int64_t t = 1; t < ctx; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        denom[g] = sum > 0.f ? 1.f / sum : 0.f;
      }
      // acc_g = sum_t p_gt v_t
      if constexpr (planaria_cpu::avx512_fast<T>()) {
#if defined(__AVX512F__)
        values_fast<T>(vp, slot_stride, h * D, slots.data(), ctx, G, D, scores.data(), acc.data());
#endif
      } else if constexpr (planaria_cpu::avx2_fast<T>()) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        values_avx2(vp, slot_stride, h * D, slots.data(), ctx, G, D, scores.data(), acc.data());
#endif
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < ctx; ++t) {
          widen(vp + slots[t] * slot_stride + h * D, row.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * ctx + t];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
          }
        }
      }
      T* o = op + (b * Hq + h * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = static_cast<T>(acc[g * D + d] * denom[g]);
    }
  });
}

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& ctx_lens, int64_t block_size,
                      double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.sizes() == q.sizes(),
              "decode_attention: q/out [B, Hq, D], caches [slots, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "decode_attention: contiguous tensors only");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == q.size(2), "decode_attention: shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "decode_attention: Hq must be a multiple of Hkv");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(), "decode_attention: one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && ctx_lens.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && ctx_lens.numel() == q.size(0),
              "decode_attention: block_tables [B, NB] and ctx_lens [B], int64");
  TORCH_CHECK(block_size > 0, "decode_attention: block_size > 0");
  const int64_t slots = k_cache.size(0);
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {  // every slot read is inside the cache
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= block_tables.size(1) * block_size, "decode_attention: ctx_len");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t blk = tables[b * block_tables.size(1) + i];
      TORCH_CHECK(blk >= 0 && (blk + 1) * block_size <= slots, "decode_attention: block id outside the cache");
    }
  }
  switch (q.scalar_type()) {
    case at::kBFloat16:
      decode_kernel<c10::BFloat16>(q, k_cache, v_cache, block_tables, ctx_lens, block_size, scale, out);
      break;
    case at::kHalf:
      decode_kernel<c10::Half>(q, k_cache, v_cache, block_tables, ctx_lens, block_size, scale, out);
      break;
    case at::kFloat:
      decode_kernel<float>(q, k_cache, v_cache, block_tables, ctx_lens, block_size, scale, out);
      break;
    default:
      TORCH_CHECK(false, "decode_attention: float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY(planaria, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor ctx_lens, "
        "int block_size, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(planaria, CPU, m) { m.impl("decode_attention", &decode_attention); }
