// Greedy sampling's argmax over the logits rows, read in their own dtype (the lm_head's
// bf16 output needs no float32 copy first): x [N, V] contiguous float32 / bfloat16 /
// float16 -> [N] int64, the first index of the maximum, NaN counting as the maximum (the
// first NaN wins), +0 and -0 equal: torch.argmax's answer on the CPU. One pass takes the
// maximum of each chunk of 64 values (vectorized), a second looks only inside the first
// chunk that holds the row's maximum. Rows run in parallel. Tested against torch.argmax
// in tests/kernels/test_cpu_ext.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

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

template <typename F>
void argmax_kernel(const at::Tensor& x, at::Tensor& out) {
  const int64_t N = x.size(0), V = x.size(1);
  const auto* xp = static_cast<const typename F::Bits*>(x.data_ptr());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk_max((V + kChunk - 1) / kChunk);
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row<F>(xp + r * V, V, chunk_max.data());
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
