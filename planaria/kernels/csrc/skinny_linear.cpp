// y = x W^T (+ b) for a few rows of x (decode at small batches), for the CPU.
//
// x [M, K], W [N, K], b [N] or none, all contiguous and of one dtype (float32 / bfloat16 /
// float16) -> y [M, N] in that dtype; sums in float32, the bias added in float32, one
// rounding to the dtype at the end. At a few rows a linear is bound by reading W (each
// weight is used M times), and torch's GEMM streams it at a fraction of what the memory
// gives (tests/kernels/test_cpu_ext.py has the reference, bench/README.md the figures).
// Here each tile of 4 weight rows is read once from memory and held in L1 while it meets
// every row of x, 4 at a time: 16 float32 accumulators in registers, filled with FMA
// (float32) or AVX512-BF16's dot instruction (bfloat16, 32 products each); tiles of rows
// run in parallel. The K tail is a masked load, so any K works. Without AVX-512 (or for
// float16) the same tiling runs on widened rows in plain C++ the compiler vectorizes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "widen.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 4;  // weight rows per tile
constexpr int kCols = 4;  // rows of x per pass over the tile
constexpr int64_t kPrefetch = 1;  // software prefetch: tiles ahead

inline void store(float v, float* p) { *p = v; }
inline void store(float v, c10::BFloat16* p) { *p = c10::BFloat16(v); }
inline void store(float v, c10::Half* p) { *p = c10::Half(v); }

#if defined(__AVX512F__)
// One tile: R weight rows (R <= 4) against C rows of x (C <= 4), sums into acc[r][c].
template <typename T, int R, int C>
inline void tile(const T* w, const T* x, int64_t K, float (*sums)[kCols]) {
  constexpr int64_t step = std::is_same_v<T, float> ? 16 : 32;
  __m512 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
  #pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  // the tile kPrefetch tiles ahead, R cache lines per step (what this tile reads per step)
  const char* pf = reinterpret_cast<const char*>(w + kPrefetch * R * K);
  for (int64_t k = 0; k < K; k += step) {
    const int64_t left = K - k;
  #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) _mm_prefetch(pf + (k * R + r * step) * sizeof(T), _MM_HINT_T0);
    if constexpr (std::is_same_v<T, float>) {
      const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      __m512 xv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) xv[c] = _mm512_maskz_loadu_ps(m, x + c * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 wv = _mm512_maskz_loadu_ps(m, w + r * K + k);
  #pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
      }
    } else {
#if defined(__AVX512BF16__)
      const __mmask32 m = left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1);
      __m512bh xv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) xv[c] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + c * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * K + k);
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
#endif

// The same tile on float32 copies (wf: R widened weight rows, xf: the C widened x rows).
template <int R, int C>
inline void tile_plain(const float* wf, const float* xf, int64_t K, float (*sums)[kCols]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float* a = wf + r * K;
      const float* b = xf + c * K;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += a[k] * b[k];
      sums[r][c] = s;
    }
}

template <typename T>
constexpr bool fast_path() {
#if defined(__AVX512BF16__)
  if (std::is_same_v<T, c10::BFloat16>) return true;
#endif
#if defined(__AVX512F__)
  if (std::is_same_v<T, float>) return true;
#endif
  return false;
}

template <typename T, int R, int C>
inline void run_tile(const T* w, const T* x, const float* wf, const float* xf, int64_t K, float (*sums)[kCols]) {
#if defined(__AVX512F__)
  if constexpr (fast_path<T>()) {
    tile<T, R, C>(w, x, K, sums);
    return;
  }
#endif
  tile_plain<R, C>(wf, xf, K, sums);
}

template <typename T, int R>
void row_tile(const T* w, const T* xp, const std::vector<float>& xf_all, std::vector<float>& wf, int64_t M,
              int64_t K, int64_t N, int64_t n0, const T* bias, T* y) {
  if constexpr (!fast_path<T>()) {
    for (int r = 0; r < R; ++r) planaria_cpu::widen(w + r * K, wf.data() + r * K, K);
  }
  float sums[kRows][kCols];
  for (int64_t m0 = 0; m0 < M; m0 += kCols) {
    const int64_t c = std::min<int64_t>(kCols, M - m0);
    const T* x = xp + m0 * K;
    const float* xf = fast_path<T>() ? nullptr : xf_all.data() + m0 * K;
    switch (c) {
      case 4: run_tile<T, R, 4>(w, x, wf.data(), xf, K, sums); break;
      case 3: run_tile<T, R, 3>(w, x, wf.data(), xf, K, sums); break;
      case 2: run_tile<T, R, 2>(w, x, wf.data(), xf, K, sums); break;
      default: run_tile<T, R, 1>(w, x, wf.data(), xf, K, sums); break;
    }
    for (int r = 0; r < R; ++r) {
      const float b = bias ? static_cast<float>(bias[n0 + r]) : 0.f;
      for (int64_t j = 0; j < c; ++j) store(sums[r][j] + b, y + (m0 + j) * N + n0 + r);
    }
  }
}

template <typename T>
void linear_kernel(const at::Tensor& x, const at::Tensor& w, const T* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  std::vector<float> xf_all;
  if (!fast_path<T>()) {
    xf_all.resize(M * K);
    planaria_cpu::widen(xp, xf_all.data(), M * K);
  }
  const int64_t tiles = (N + kRows - 1) / kRows;
  // a grain of ~32 KiB of weights per task: small linears stay on one thread
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, kRows * K * w.element_size()));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(fast_path<T>() ? 0 : kRows * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows;
      const T* wt = wp + n0 * K;
      switch (std::min<int64_t>(kRows, N - n0)) {
        case 4: row_tile<T, 4>(wt, xp, xf_all, wf, M, K, N, n0, bias, yp); break;
        case 3: row_tile<T, 3>(wt, xp, xf_all, wf, M, K, N, n0, bias, yp); break;
        case 2: row_tile<T, 2>(wt, xp, xf_all, wf, M, K, N, n0, bias, yp); break;
        default: row_tile<T, 1>(wt, xp, xf_all, wf, M, K, N, n0, bias, yp); break;
      }
    }
  });
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(),
              "skinny_linear: x [M, K] and w [N, K], contiguous");
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_linear: x has ", x.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "skinny_linear: x and w of one dtype");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "skinny_linear: CPU tensors");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == w.scalar_type(),
                "skinny_linear: bias [N], contiguous, of w's dtype");
  }
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0 || w.size(0) == 0) return y;
  switch (x.scalar_type()) {
    case at::kFloat:
      linear_kernel<float>(x, w, has_bias ? bias->data_ptr<float>() : nullptr, y);
      break;
    case at::kBFloat16:
      linear_kernel<c10::BFloat16>(x, w, has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr, y);
      break;
    case at::kHalf:
      linear_kernel<c10::Half>(x, w, has_bias ? bias->data_ptr<c10::Half>() : nullptr, y);
      break;
    default: TORCH_CHECK(false, "skinny_linear: float32, bfloat16 or float16");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(planaria, m) { m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(planaria, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
