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
//
// A bf16 lm_head packed for oneDNN (engine/models/packing.py pack_lm_head) is packed as
// such chunks, one packed tensor each: packed_linear_argmax does the same with oneDNN's
// GEMM per chunk (0.3-0.5 ms less than the whole packed GEMM and argmax_rows at 64 x 49152,
// bench/cpu_kernels.py), and packed_linear_chunked gives the whole logits from the same
// chunks for rows that sample (1-5% slower than the whole packed GEMM and its float32
// copy at 1-64 rows: the price of one packed copy of the head instead of two). Tested
// against the whole packed GEMM, bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "argmax.h"
#include "onednn_linear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace planaria_cpu;

// chunk_logits(c, c0, n, buf) -> a [M, n] tensor: the logits of vocab rows [c0, c0 + n)
// (in ``buf`` or a tensor of its own), called from inside a parallel region
template <typename F, typename ChunkLogits>
void chunked_argmax(int64_t M, int64_t N, int64_t chunk, ChunkLogits chunk_logits, at::Tensor& out) {
  using Bits = typename F::Bits;
  const int64_t nchunks = (N + chunk - 1) / chunk;
  std::vector<int64_t> idx(nchunks * M);  // [chunk][row]: the chunk's argmax, a vocab index
  std::vector<Bits> val(nchunks * M);     // and its value's bits
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    at::Tensor buf;
    std::vector<float> scratch(argmax_scratch(chunk));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t c0 = c * chunk, n = std::min(chunk, N - c0);
      const at::Tensor y = chunk_logits(c, c0, n, buf);
      const Bits* yp = static_cast<const Bits*>(y.data_ptr());
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

template <typename F>
void linear_argmax_kernel(const at::Tensor& x, const at::Tensor& w, int64_t chunk, at::Tensor& out) {
  chunked_argmax<F>(x.size(0), w.size(0), chunk, [&](int64_t, int64_t c0, int64_t n, at::Tensor& buf) {
    if (!buf.defined() || buf.size(1) != n) buf = at::empty({x.size(0), n}, x.options());
    at::mm_out(buf, x, w.narrow(0, c0, n).t());
    return buf;
  }, out);
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

// The lm_head's weight packed for oneDNN (engine/models/packing.py) as chunks of ``chunk``
// vocab rows (the last one shorter), each packed on its own: oneDNN's GEMM on a chunk
// (onednn_linear.h) runs on one thread inside the parallel region.
//
// chunked_rows: the rows of the chunks, checked: every chunk but the last ``chunk`` rows, the last 1..chunk
int64_t chunked_rows(const at::Tensor& x, at::TensorList packed, int64_t chunk, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), name, ": x [M, K], contiguous, on the CPU");
  TORCH_CHECK(chunk > 0, name, ": chunk > 0");
  TORCH_CHECK(!packed.empty(), name, ": no weight chunks");
  int64_t N = 0;
  for (size_t c = 0; c < packed.size(); ++c) {
    const at::Tensor& p = packed[c];
    TORCH_CHECK(p.dim() == 2 && p.size(1) == x.size(1), name, ": chunk ", c, " is not [rows, ", x.size(1), "]");
    TORCH_CHECK(p.scalar_type() == x.scalar_type(), name, ": x and the chunks of one dtype");
    const bool last = c + 1 == packed.size();
    TORCH_CHECK(last ? (p.size(0) > 0 && p.size(0) <= chunk) : p.size(0) == chunk, name, ": chunk ", c, " has ",
                p.size(0), " rows, not ", last ? "1.." : "", chunk);
    N += p.size(0);
  }
  return N;
}

at::Tensor packed_linear_argmax(const at::Tensor& x, at::TensorList packed, int64_t chunk) {
  const int64_t N = chunked_rows(x, packed, chunk, "packed_linear_argmax");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.size(0) == 0) return out;
  auto logits = [&](int64_t c, int64_t, int64_t, at::Tensor&) { return onednn_linear(x, packed[c], c10::nullopt); };
  switch (x.scalar_type()) {
    case at::kBFloat16: chunked_argmax<Bf16>(x.size(0), N, chunk, logits, out); break;
    case at::kFloat: chunked_argmax<F32>(x.size(0), N, chunk, logits, out); break;
    case at::kHalf: chunked_argmax<F16>(x.size(0), N, chunk, logits, out); break;
    default: TORCH_CHECK(false, "packed_linear_argmax: float32, bfloat16 or float16");
  }
  return out;
}

// the whole logits [M, N] from the same chunks, in x's dtype or float32 (what sampling
// reads): each thread computes its chunks and writes them into their columns while they
// are in its cache, widened there when ``float32`` (instead of a pass over the whole
// logits after the GEMM)
template <typename T, typename O>
void chunked_logits(const at::Tensor& x, at::TensorList packed, int64_t chunk, at::Tensor& out) {
  const int64_t M = x.size(0), N = out.size(1);
  O* op = static_cast<O*>(out.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(packed.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const at::Tensor y = onednn_linear(x, packed[c], c10::nullopt).contiguous();
      const int64_t n = y.size(1);
      const T* yp = static_cast<const T*>(y.data_ptr());
      for (int64_t r = 0; r < M; ++r) {
        const T* src = yp + r * n;
        O* dst = op + r * N + c * chunk;
        if constexpr (std::is_same_v<T, O>) {
          std::memcpy(dst, src, n * sizeof(T));
        } else {
          for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<O>(src[i]);
        }
      }
    }
  });
}

at::Tensor packed_linear_chunked(const at::Tensor& x, at::TensorList packed, int64_t chunk, bool float32) {
  const int64_t N = chunked_rows(x, packed, chunk, "packed_linear_chunked");
  at::Tensor out = at::empty({x.size(0), N}, float32 ? x.options().dtype(at::kFloat) : x.options());
  if (x.size(0) == 0) return out;
  switch (x.scalar_type()) {
    case at::kBFloat16:
      float32 ? chunked_logits<c10::BFloat16, float>(x, packed, chunk, out)
              : chunked_logits<c10::BFloat16, c10::BFloat16>(x, packed, chunk, out);
      break;
    case at::kHalf:
      float32 ? chunked_logits<c10::Half, float>(x, packed, chunk, out)
              : chunked_logits<c10::Half, c10::Half>(x, packed, chunk, out);
      break;
    case at::kFloat: chunked_logits<float, float>(x, packed, chunk, out); break;
    default: TORCH_CHECK(false, "packed_linear_chunked: float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(planaria, m) {
  m.def("linear_argmax(Tensor x, Tensor w, int chunk) -> Tensor");
  m.def("packed_linear_argmax(Tensor x, Tensor[] packed, int chunk) -> Tensor");
  m.def("packed_linear_chunked(Tensor x, Tensor[] packed, int chunk, bool float32) -> Tensor");
}

TORCH_LIBRARY_IMPL(planaria, CPU, m) {
  m.impl("linear_argmax", &linear_argmax);
  m.impl("packed_linear_argmax", &packed_linear_argmax);
  m.impl("packed_linear_chunked", &packed_linear_chunked);
}

// packed chunks are opaque oneDNN tensors: their dispatch key wins over x's
TORCH_LIBRARY_IMPL(planaria, MkldnnCPU, m) {
  m.impl("packed_linear_argmax", &packed_linear_argmax);
  m.impl("packed_linear_chunked", &packed_linear_chunked);
}
