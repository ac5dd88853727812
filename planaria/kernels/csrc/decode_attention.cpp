// Decode attention read from the paged KV cache in place (no gather), for the CPU.
//
// One query token per sequence. q [B, Hq, D]; k_cache, v_cache [slots, Hkv, D] (slot =
// block * block_size + offset; each slot's Hkv * D values contiguous); block_tables
// [B, NB] int64; ctx_lens [B] int64 (tokens 0 .. ctx_len - 1 are attended to); out
// [B, Hq, D]. Query head h reads KV head h / (Hq / Hkv). Scores, softmax and the weighted
// sum run in float32; bfloat16 / float16 values are widened as they are read. Work is
// split over (sequence, KV head) pairs with at::parallel_for (torch's own thread pool);
// each pair reads its keys and values once for its whole group of query heads.
// planaria/kernels/cpu_ext.py builds this file; the torch code in kernels/attention.py is
// the reference it is tested against (tests/kernels/test_cpu_ext.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "widen.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using planaria_cpu::widen;

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
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t ctx = lens[b];
      const int64_t* table = tables + b * NB;
      widen(qp + (b * Hq + h * G) * D, qf.data(), G * D);
      for (int64_t i = 0; i < G * D; ++i) qf[i] *= fscale;
      // scores[g * ctx + t] = q_g . k_t
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        widen(kp + slot * slot_stride + h * D, row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
          scores[g * ctx + t] = s;
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
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        widen(vp + slot * slot_stride + h * D, row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * ctx + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
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
