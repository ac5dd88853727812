// Greedy sampling's argmax over the logits rows, read in their own dtype (the lm_head's
// bf16 output needs no float32 copy first): x [N, V] contiguous float32 / bfloat16 /
// float16 -> [N] int64, torch.argmax's answer on the CPU (argmax.h has the row code and
// its rules: ties, NaN, signed zeros). Rows run in parallel. Tested against torch.argmax
// in tests/kernels/test_cpu_ext.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "argmax.h"

#include <vector>

namespace {

using namespace planaria_cpu;

template <typename F>
void argmax_kernel(const at::Tensor& x, at::Tensor& out) {
  const int64_t N = x.size(0), V = x.size(1);
  const auto* xp = static_cast<const typename F::Bits*>(x.data_ptr());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk_max(argmax_scratch(V));
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row_best<F>(xp + r * V, V, chunk_max.data());
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "argmax_rows: x [N, V] contiguous, V > 0");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  switch (x.scalar_type()) {
    case at::kBFloat16: argmax_kernel<Bf16>(x, out); break;
    case at::kHalf: argmax_kernel<F16>(x, out); break;
    case at::kFloat: argmax_kernel<F32>(x, out); break;
    default: TORCH_CHECK(false, "argmax_rows: float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(planaria, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(planaria, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
