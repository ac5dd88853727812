// RMSNorm for the CPU in one pass: out = weight * round(x * rsqrt(mean(x^2) + eps)), the
// sum of squares in float32, the normalized row rounded to the input dtype before the
// weight is applied (as kernels/norm.py and the Hugging Face implementations do).
// x: [N, H] or [N, M, H] with unit stride on the last dimension (the per-head q / k
// norms read their heads straight out of the fused qkv projection); weight [H] in x's
// dtype; returns a new contiguous tensor. One op instead of seven at decode batches,
// where each of those ops costs more than its arithmetic. Tested against
// kernels/norm.py in tests/kernels/test_cpu_ext.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename T>
void rms_kernel(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const bool three = x.dim() == 3;
  const int64_t N = x.size(0), M = three ? x.size(1) : 1, H = x.size(-1);
  const int64_t s0 = x.stride(0), s1 = three ? x.stride(1) : 0;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, N * M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + (r / M) * s0 + (r % M) * s1;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) {
        const float v = static_cast<float>(row[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      T* o = op + r * H;
      for (int64_t i = 0; i < H; ++i) {
        const T normed = static_cast<T>(static_cast<float>(row[i]) * inv);
        o[i] = static_cast<T>(static_cast<float>(wp[i]) * static_cast<float>(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "rms_norm: x [N, H] or [N, M, H], last dim contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(), "rms_norm: weight [H]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  switch (x.scalar_type()) {
    case at::kBFloat16: rms_kernel<c10::BFloat16>(x, weight, eps, out); break;
    case at::kHalf: rms_kernel<c10::Half>(x, weight, eps, out); break;
    case at::kFloat: rms_kernel<float>(x, weight, eps, out); break;
    default: TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(planaria, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(planaria, CPU, m) { m.impl("rms_norm", &rms_norm); }
