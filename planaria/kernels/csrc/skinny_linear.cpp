// y = x W^T (+ b) for a few rows of x (decode at small batches), for the CPU.
//
// x [M, K], W [N, K], b [N] or none, all contiguous and of one dtype (float32 / bfloat16 /
// float16) -> y [M, N] in that dtype; sums in float32, the bias added in float32, one
// rounding to the dtype at the end. At a few rows a linear is bound by reading W (each
// weight is used M times), and torch's GEMM streams it at a fraction of what the memory
// gives (tests/kernels/test_cpu_ext.py has the reference, bench/README.md the figures).
// Here each tile of 4 weight rows is read once from memory and held in L1 while it meets
// every row of x, 4 at a time (tile_dot.h: float32 accumulators in registers, AVX-512 or
// AVX2 FMA, or AVX512-BF16's dot instruction); tiles of rows run in parallel. Where
// tile_dot lacks the dtype (bfloat16 without AVX512-BF16, float16) each weight row is
// widened once and dotted with the widened rows of x (tile_dot.h's dot_many, plain C++
// the compiler vectorizes).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "onednn_linear.h"
#include "tile_dot.h"
#include "widen.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using planaria_cpu::kTileCols;
using planaria_cpu::kTileRows;

inline void store(float v, float* p) { *p = v; }
inline void store(float v, c10::BFloat16* p) { *p = c10::BFloat16(v); }
inline void store(float v, c10::Half* p) { *p = c10::Half(v); }

#if defined(PLANARIA_TILE_DOT)
// rows [n0, n0 + R) of y for every row of x, 4 rows of x per pass over the tile
template <typename T>
void row_tile(int R, const T* w, const T* xp, int64_t M, int64_t K, int64_t N, int64_t n0, const T* bias, T* y) {
  float sums[kTileRows][kTileCols];
  for (int64_t m0 = 0; m0 < M; m0 += kTileCols) {
    const int c = static_cast<int>(std::min<int64_t>(kTileCols, M - m0));
    const T* xs[kTileCols];
    for (int j = 0; j < c; ++j) xs[j] = xp + (m0 + j) * K;
    planaria_cpu::tile_dot_any<T>(R, c, w, K, xs, K, sums, w + R * K);  // prefetch the next tile
    for (int r = 0; r < R; ++r) {
      const float b = bias ? static_cast<float>(bias[n0 + r]) : 0.f;
      for (int j = 0; j < c; ++j) store(sums[r][j] + b, y + (m0 + j) * N + n0 + r);
    }
  }
}
#endif

template <typename T>
void linear_kernel(const at::Tensor& x, const at::Tensor& w, const T* bias, at::Tensor& y) {
  constexpr bool fast = planaria_cpu::tile_dot_fast<T>();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // the plain path: the rows of x widened once, each weight row widened once by dot_many
  std::vector<float> xf(fast ? 0 : M * K);
  std::vector<const float*> xs(fast ? 0 : M);
  planaria_cpu::widen(xp, xf.data(), static_cast<int64_t>(xf.size()));
  for (int64_t j = 0; j < static_cast<int64_t>(xs.size()); ++j) xs[j] = xf.data() + j * K;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  // a grain of ~32 KiB of weights per task: small linears stay on one thread
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, kTileRows * K * w.element_size()));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(fast ? 0 : K), col(fast ? 0 : M);
    std::vector<float*> outs(fast ? 0 : M);
    for (int64_t j = 0; j < static_cast<int64_t>(outs.size()); ++j) outs[j] = col.data() + j;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const int R = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
#if defined(PLANARIA_TILE_DOT)
      if constexpr (fast) row_tile<T>(R, wp + n0 * K, xp, M, K, N, n0, bias, yp);
#endif
      if constexpr (!fast) {
        for (int r = 0; r < R; ++r) {
          planaria_cpu::dot_many(wp + (n0 + r) * K, wf.data(), xs.data(), M, K, outs.data());
          const float b = bias ? static_cast<float>(bias[n0 + r]) : 0.f;
          for (int64_t j = 0; j < M; ++j) store(col[j] + b, yp + j * N + n0 + r);
        }
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

// F.linear with a weight packed by torch.ops.mkldnn._reorder_linear_weight
// (engine/models/packing.py): the same oneDNN call, under a name of our own. Inductor
// lowers mkldnn._linear_pointwise only for weights it packed itself (frozen constants),
// so a compiled forward (engine/compiled.py) calls this one, which it treats as opaque.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return planaria_cpu::onednn_linear(x, packed, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(planaria, m) {
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(planaria, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("packed_linear", &packed_linear);
}

// the packed weight is an opaque oneDNN tensor: its dispatch key wins over x's
TORCH_LIBRARY_IMPL(planaria, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear); }
