// The greedy token straight from the lm_head: x [M, K], W [N, K] (contiguous, one dtype:
// float32 / bfloat16 / float16) -> [M] int64, argmax over j of (x W^T)[i, j], the answer
// argmax_rows would give on the full logits (argmax.h: first index of the maximum, NaN
// counting as the maximum, +0 == -0). The [M, N] logits are never written out: the vocab
// is cut into chunks of ``chunk`` weight rows, each thread takes a run of chunks and, for
// each, computes the [M, chunk] logits with torch's GEMM (at::mm_out, one thread inside a
// parallel region) into a buffer that stays in its cache, takes each row's argmax there,
// and keeps (index, value); the chunks' answers are merged in vocab order. A separate
// argmax re-reads the whole logits from memory after the GEMM has evicted them (64 x 49152
// float32 is 12.6 MB: 0.5-0.6 ms on a 2-vCPU AMD EPYC, bench/step_overhead.py). Tested
// against argmax_rows(x @ W^T) in tests/kernels/test_cpu_ext.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "argmax.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace planaria_cpu;

template <typename F>
void linear_argmax_kernel(const at::Tensor& x, const at::Tensor& w, int64_t chunk, at::Tensor& out) {
  using Bits = typename F::Bits;
  const int64_t M = x.size(0), N = w.size(0);
  const int64_t nchunks = (N + chunk - 1) / chunk;
  std::vector<int64_t> idx(nchunks * M);  // [chunk][row]: the chunk's argmax, a vocab index
  std::vector<Bits> val(nchunks * M);     // and its value's bits
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    at::Tensor buf;
    std::vector<float> scratch(argmax_scratch(chunk));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t c0 = c * chunk, n = std::min(chunk, N - c0);
      if (!buf.defined() || buf.size(1) != n) buf = at::empty({M, n}, x.options());
      at::mm_out(buf, x, w.narrow(0, c0, n).t());
      const Bits* yp = static_cast<const Bits*>(buf.data_ptr());
      for (int64_t r = 0; r < M; ++r) {
        const int64_t i = argmax_row_best<F>(yp + r * n, n, scratch.data());
        idx[c * M + r] = c0 + i;
        val[c * M + r] = yp[r * n + i];
      }
    }
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    int64_t best = idx[r];
    Bits bits = val[r];
    for (int64_t c = 1; c < nchunks && !F::nan(bits); ++c) {
      const Bits b = val[c * M + r];
      // a NaN wins (the first one: chunks in vocab order); otherwise only a larger value
      // (the first index on ties; +0 and -0 compare equal)
      if (F::nan(b) || F::value(b) > F::value(bits)) {
        best = idx[c * M + r];
        bits = b;
      }
    }
    op[r] = best;
  }
}

at::Tensor linear_argmax(const at::Tensor& x, const at::Tensor& w, int64_t chunk) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(),
              "linear_argmax: x [M, K] and w [N, K], contiguous");
  TORCH_CHECK(x.size(1) == w.size(1), "linear_argmax: x has ", x.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(w.size(0) > 0, "linear_argmax: w has no rows");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear_argmax: x and w of one dtype");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_argmax: CPU tensors");
  TORCH_CHECK(chunk > 0, "linear_argmax: chunk > 0");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.size(0) == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat: linear_argmax_kernel<F32>(x, w, chunk, out); break;
    case at::kBFloat16: linear_argmax_kernel<Bf16>(x, w, chunk, out); break;
    case at::kHalf: linear_argmax_kernel<F16>(x, w, chunk, out); break;
    default: TORCH_CHECK(false, "linear_argmax: float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(planaria, m) { m.def("linear_argmax(Tensor x, Tensor w, int chunk) -> Tensor"); }

TORCH_LIBRARY_IMPL(planaria, CPU, m) { m.impl("linear_argmax", &linear_argmax); }
