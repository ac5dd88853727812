// Fused MoE expert MLP for a few tokens (decode), for the CPU.
//
// x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, K]
// float32; topk_ids [T, K] int64 global expert ids; expert_offset: global id of local
// expert 0 (pairs routed to other experts are skipped: an expert-parallel rank's share);
// out [T, H] = sum over each token's local pairs of weight * w2[e] (silu(g) * u) where
// (g, u) = w13[e] x. bfloat16 / float16 / float32 weights and activations, every sum in
// float32, the intermediate in float32 (rounded to bf16 where AVX512-BF16 reads it). Two
// parallel phases over (expert, chunk of output rows): each tile of four weight rows is
// read once for all of that expert's tokens (tile_dot.h, 4 tokens per pass; a plain C++
// dot where the build lacks it), so the weights stream once per step (decode is bound
// by reading them). Per-pair outputs are
// summed per token in k order, so results do not depend on the thread count.
// planaria/kernels/moe.py calls it for small batches; its torch code is the reference
// (tests/kernels/test_cpu_ext.py).

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
#include <tuple>
#include <vector>

namespace {

using planaria_cpu::dot_many;

constexpr int64_t kRowChunk = 32;

// y[s, r] for the slots s of expert e (rows [r0, r1) of a weight [R, len]); inputs are
// the slots' vectors in A (T dtype, for tile_dot) or F (float32, for the plain path).
template <typename T>
void rows_times(const T* W, int64_t len, int64_t r0, int64_t r1, int64_t s0, int64_t s1,
                const std::vector<const T*>& in_t, const std::vector<const float*>& in_f,
                float* y, int64_t y_stride, std::vector<float>& wf, std::vector<float*>& outs) {
#if defined(PLANARIA_TILE_DOT)
  if constexpr (planaria_cpu::tile_dot_fast<T>()) {
    using planaria_cpu::kTileCols;
    using planaria_cpu::kTileRows;
    float sums[kTileRows][kTileCols];
    for (int64_t r = r0; r < r1; r += kTileRows) {
      const int R = static_cast<int>(std::min<int64_t>(kTileRows, r1 - r));
      for (int64_t s = s0; s < s1; s += kTileCols) {
        const int C = static_cast<int>(std::min<int64_t>(kTileCols, s1 - s));
        planaria_cpu::tile_dot_any<T>(R, C, W + r * len, len, in_t.data() + s, len, sums, W + (r + R) * len);
        for (int i = 0; i < R; ++i)
          for (int j = 0; j < C; ++j) y[(s + j) * y_stride + r + i] = sums[i][j];
      }
    }
    return;
  }
#endif
  const int64_t n = s1 - s0;
  outs.resize(n);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < n; ++j) outs[j] = y + (s0 + j) * y_stride + r;
    dot_many(W + r * len, wf.data(), in_f.data() + s0, n, len, outs.data());
  }
}

// out[t] = sum_k w[t, k] * rows[k] (rows[k] null: a pair computed nowhere here), in k
// order, in float32: the one combine of per-pair outputs, for the local kernel and for an
// expert-parallel rank combining the pairs its peers computed (elastic/shm_group.py), so
// both give the same bits.
template <typename T>
__attribute__((noinline)) void combine_row(const float* const* rows, const float* w, int64_t K, int64_t H, T* o) {
  for (int64_t c = 0; c < H; ++c) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k)
      if (rows[k] != nullptr) acc += w[k] * rows[k][c];
    o[c] = static_cast<T>(acc);
  }
}

// The per-pair outputs of the local experts: y [Pm, H] float32 for slot s, pair_of[s] the
// pair (token * K + k) of slot s; P slots.
struct PairOutputs {
  std::vector<float> y;
  std::vector<int64_t> pair_of;
  int64_t P = 0;
};

template <typename T>
PairOutputs moe_pairs(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_ids,
                      int64_t expert_offset) {
  const int64_t T_ = x.size(0), H = x.size(1), K = topk_ids.size(1);
  const int64_t E = w13.size(0), I2 = w13.size(1), I = I2 / 2;
  const T* xp = x.data_ptr<T>();
  const T* w13p = w13.data_ptr<T>();
  const T* w2p = w2.data_ptr<T>();
  const int64_t* idp = topk_ids.data_ptr<int64_t>();
  constexpr bool fast = planaria_cpu::tile_dot_fast<T>();  // inputs read as T by tile_dot

  // group pairs by local expert (pair p = token * K + k), in pair order
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t p = 0; p < T_ * K; ++p) {
    const int64_t e = idp[p] - expert_offset;
    if (e >= 0 && e < E) ++count[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];  // count[e] = first slot of expert e
  const int64_t P = count[E];
  PairOutputs res;
  res.P = P;
  std::vector<int64_t>& pair_of = res.pair_of;
  pair_of.resize(P);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t p = 0; p < T_ * K; ++p) {
    const int64_t e = idp[p] - expert_offset;
    if (e >= 0 && e < E) pair_of[fill[e]++] = p;
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) active.push_back(e);
  const int64_t A = static_cast<int64_t>(active.size());

  // per-slot inputs of phase 1: the token's row of x (as T, and widened to float)
  std::vector<float> xf(fast ? 0 : T_ * H);
  planaria_cpu::widen(xp, xf.data(), static_cast<int64_t>(xf.size()));
  std::vector<const T*> x_t(P);
  std::vector<const float*> x_f(P);
  for (int64_t s = 0; s < P; ++s) {
    x_t[s] = xp + (pair_of[s] / K) * H;
    x_f[s] = fast ? nullptr : xf.data() + (pair_of[s] / K) * H;
  }
  const int64_t Pm = std::max<int64_t>(P, 1);
  std::vector<float> gu(Pm * I2), hf(fast ? 0 : Pm * I);
  std::vector<float>& y = res.y;
  y.resize(Pm * H);
  std::vector<T> ht(fast ? Pm * I : 0);

  // phase 1: gu[s, r] = w13[e, r] . x[token of s]
  const int64_t chunks1 = (I2 + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, A * chunks1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(H);
    std::vector<float*> outs;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = active[item / chunks1];
      const int64_t r0 = (item % chunks1) * kRowChunk;
      rows_times<T>(w13p + e * I2 * H, H, r0, std::min(I2, r0 + kRowChunk), count[e], count[e + 1], x_t, x_f,
                    gu.data(), I2, wf, outs);
    }
  });
  // h = silu(gate) * up, rounded to T where tile_dot reads it
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int64_t i = 0; i < I; ++i) {
        const float g = gu[s * I2 + i];
        const float v = g / (1.f + std::exp(-g)) * gu[s * I2 + I + i];
        if constexpr (fast) ht[s * I + i] = static_cast<T>(v);
        else hf[s * I + i] = v;
      }
  });
  std::vector<const T*> h_t(P);
  std::vector<const float*> h_f(P);
  for (int64_t s = 0; s < P; ++s) {
    h_t[s] = fast ? ht.data() + s * I : nullptr;
    h_f[s] = fast ? nullptr : hf.data() + s * I;
  }
  // phase 2: y[s, c] = w2[e, c] . h[s]
  const int64_t chunks2 = (H + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, A * chunks2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(I);
    std::vector<float*> outs;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = active[item / chunks2];
      const int64_t c0 = (item % chunks2) * kRowChunk;
      rows_times<T>(w2p + e * H * I, I, c0, std::min(H, c0 + kRowChunk), count[e], count[e + 1], h_t, h_f,
                    y.data(), H, wf, outs);
    }
  });
  return res;
}

template <typename T>
void moe_kernel(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                const at::Tensor& topk_ids, int64_t expert_offset, at::Tensor& out) {
  const int64_t T_ = x.size(0), H = x.size(1), K = topk_ids.size(1);
  const PairOutputs res = moe_pairs<T>(x, w13, w2, topk_ids, expert_offset);
  const float* twp = topk_weights.data_ptr<float>();
  T* op = out.data_ptr<T>();
  // out[t] = sum_k weight * y[slot of pair (t, k)], in k order
  std::vector<const float*> rows(T_ * K, nullptr);
  for (int64_t s = 0; s < res.P; ++s) rows[res.pair_of[s]] = res.y.data() + s * H;
  for (int64_t t = 0; t < T_; ++t) combine_row<T>(rows.data() + t * K, twp + t * K, K, H, op + t * H);
}

// y [T, K, H] float32: the unweighted output of each pair (t, k) whose expert is local;
// the rows of other pairs are left as they are.
template <typename T>
void pairs_kernel(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_ids,
                  int64_t expert_offset, at::Tensor& y) {
  const int64_t H = x.size(1);
  const PairOutputs res = moe_pairs<T>(x, w13, w2, topk_ids, expert_offset);
  float* yp = y.data_ptr<float>();
  for (int64_t s = 0; s < res.P; ++s)
    std::memcpy(yp + res.pair_of[s] * H, res.y.data() + s * H, H * sizeof(float));
}

void fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
               const at::Tensor& topk_ids, int64_t expert_offset, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && topk_weights.dim() == 2 && topk_ids.dim() == 2,
              "fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, K]");
  TORCH_CHECK(x.is_contiguous() && w13.is_contiguous() && w2.is_contiguous() && topk_weights.is_contiguous() &&
                  topk_ids.is_contiguous() && out.is_contiguous(), "fused_moe: contiguous tensors only");
  const int64_t H = x.size(1), E = w13.size(0), I2 = w13.size(1);
  TORCH_CHECK(I2 % 2 == 0 && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I2 / 2,
              "fused_moe: weight shapes");
  TORCH_CHECK(topk_ids.sizes() == topk_weights.sizes() && topk_ids.size(0) == x.size(0), "fused_moe: topk shapes");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.scalar_type() == at::kFloat,
              "fused_moe: topk_ids int64, topk_weights float32");
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type() &&
                  x.scalar_type() == out.scalar_type() && out.sizes() == x.sizes(), "fused_moe: one dtype, out like x");
  switch (x.scalar_type()) {
    case at::kBFloat16: moe_kernel<c10::BFloat16>(x, w13, w2, topk_weights, topk_ids, expert_offset, out); break;
    case at::kHalf: moe_kernel<c10::Half>(x, w13, w2, topk_weights, topk_ids, expert_offset, out); break;
    case at::kFloat: moe_kernel<float>(x, w13, w2, topk_weights, topk_ids, expert_offset, out); break;
    default: TORCH_CHECK(false, "fused_moe: float32, bfloat16 or float16");
  }
}

void fused_moe_pairs(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_ids,
                     int64_t expert_offset, at::Tensor y) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && topk_ids.dim() == 2 && y.dim() == 3,
              "fused_moe_pairs: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, K], y [T, K, H]");
  TORCH_CHECK(x.is_contiguous() && w13.is_contiguous() && w2.is_contiguous() && topk_ids.is_contiguous() &&
                  y.is_contiguous(), "fused_moe_pairs: contiguous tensors only");
  const int64_t T_ = x.size(0), H = x.size(1), E = w13.size(0), I2 = w13.size(1), K = topk_ids.size(1);
  TORCH_CHECK(I2 % 2 == 0 && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I2 / 2,
              "fused_moe_pairs: weight shapes");
  TORCH_CHECK(topk_ids.size(0) == T_ && topk_ids.scalar_type() == at::kLong, "fused_moe_pairs: topk_ids [T, K] int64");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.size(0) == T_ && y.size(1) == K && y.size(2) == H,
              "fused_moe_pairs: y [T, K, H] float32");
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type(), "fused_moe_pairs: one dtype");
  switch (x.scalar_type()) {
    case at::kBFloat16: pairs_kernel<c10::BFloat16>(x, w13, w2, topk_ids, expert_offset, y); break;
    case at::kHalf: pairs_kernel<c10::Half>(x, w13, w2, topk_ids, expert_offset, y); break;
    case at::kFloat: pairs_kernel<float>(x, w13, w2, topk_ids, expert_offset, y); break;
    default: TORCH_CHECK(false, "fused_moe_pairs: float32, bfloat16 or float16");
  }
}

// out [T, H] = sum_k topk_weights[t, k] * rows[src[t, k]] in k order (src -1: skipped),
// rows [N, H] float32: the pairs' outputs wherever they were computed.
template <typename T>
void combine_kernel(const at::Tensor& rows, const int64_t* sp, int64_t T_, int64_t K, const at::Tensor& w,
                    at::Tensor& out) {
  const int64_t H = rows.size(1), N = rows.size(0);
  const float* rp = rows.data_ptr<float>();
  for (int64_t i = 0; i < T_ * K; ++i) TORCH_CHECK(sp[i] >= -1 && sp[i] < N, "moe_combine: src out of range");
  const float* wp = w.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    std::vector<const float*> ptrs(K);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < K; ++k) ptrs[k] = sp[t * K + k] < 0 ? nullptr : rp + sp[t * K + k] * H;
      combine_row<T>(ptrs.data(), wp + t * K, K, H, op + t * H);
    }
  });
}

void combine_checked(const at::Tensor& rows, const int64_t* sp, int64_t T_, int64_t K, const at::Tensor& topk_weights,
                     at::Tensor& out) {
  TORCH_CHECK(rows.dim() == 2 && topk_weights.dim() == 2 && topk_weights.size(0) == T_ && topk_weights.size(1) == K &&
                  out.dim() == 2 && out.size(0) == T_ && out.size(1) == rows.size(1),
              "moe_combine: rows [N, H], src [T, K], topk_weights [T, K], out [T, H]");
  TORCH_CHECK(rows.is_contiguous() && topk_weights.is_contiguous() && out.is_contiguous(),
              "moe_combine: contiguous tensors only");
  TORCH_CHECK(rows.scalar_type() == at::kFloat && topk_weights.scalar_type() == at::kFloat,
              "moe_combine: rows and weights float32");
  switch (out.scalar_type()) {
    case at::kBFloat16: combine_kernel<c10::BFloat16>(rows, sp, T_, K, topk_weights, out); break;
    case at::kHalf: combine_kernel<c10::Half>(rows, sp, T_, K, topk_weights, out); break;
    case at::kFloat: combine_kernel<float>(rows, sp, T_, K, topk_weights, out); break;
    default: TORCH_CHECK(false, "moe_combine: float32, bfloat16 or float16");
  }
}

void moe_combine(const at::Tensor& rows, const at::Tensor& src, const at::Tensor& topk_weights, at::Tensor out) {
  TORCH_CHECK(src.dim() == 2 && src.is_contiguous() && src.scalar_type() == at::kLong, "moe_combine: src [T, K] int64");
  combine_checked(rows, src.data_ptr<int64_t>(), src.size(0), src.size(1), topk_weights, out);
}

// moe_combine with src[t, k] = expert_rows[ids[t, k]] + base + t * K + k: where an
// expert-parallel rank's pairs sit in the shared segment (elastic/shm_group.py), the
// block of the rank that computed the expert, then the pair's row in it.
void moe_combine_routed(const at::Tensor& rows, const at::Tensor& ids, const at::Tensor& expert_rows, int64_t base,
                        const at::Tensor& topk_weights, at::Tensor out) {
  TORCH_CHECK(ids.dim() == 2 && ids.is_contiguous() && ids.scalar_type() == at::kLong, "moe_combine_routed: ids [T, K] int64");
  TORCH_CHECK(expert_rows.dim() == 1 && expert_rows.is_contiguous() && expert_rows.scalar_type() == at::kLong,
              "moe_combine_routed: expert_rows [E] int64");
  const int64_t T_ = ids.size(0), K = ids.size(1), E = expert_rows.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* er = expert_rows.data_ptr<int64_t>();
  std::vector<int64_t> src(T_ * K);
  for (int64_t i = 0; i < T_ * K; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < E, "moe_combine_routed: expert id out of range");
    src[i] = er[ip[i]] + base + i;
  }
  combine_checked(rows, src.data(), T_, K, topk_weights, out);
}

// Which rank computes each expert's pairs of one round of an expert-parallel layer, when
// every rank of the node can compute every expert (elastic/shm_group.py, whose
// ``assign_experts`` is the reference): the active experts, most pairs first (ties: lower
// id), each to the rank with the least load so far (ties: its owner, then the lower
// rank), an expert's load being expert_cost plus its pairs. ids [N, K]: every rank's
// expert ids of the round; owner [E]: each expert's owner. Returns (ids with the experts
// of other ranks set to -1: what this rank computes, and per expert block * its rank).
std::tuple<at::Tensor, at::Tensor> moe_share(const at::Tensor& ids, const at::Tensor& owner, int64_t world,
                                             int64_t rank, int64_t block, int64_t expert_cost) {
  TORCH_CHECK(ids.dim() == 2 && ids.is_contiguous() && ids.scalar_type() == at::kLong, "moe_share: ids [N, K] int64");
  TORCH_CHECK(owner.dim() == 1 && owner.is_contiguous() && owner.scalar_type() == at::kLong, "moe_share: owner [E] int64");
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "moe_share: rank outside the world");
  const int64_t E = owner.size(0), n = ids.numel();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* op = owner.data_ptr<int64_t>();
  std::vector<int64_t> pairs(E, 0), assign(op, op + E), load(world, 0), active;
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(op[e] >= 0 && op[e] < world, "moe_share: owner out of range");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < E, "moe_share: expert id out of range");
    ++pairs[ip[i]];
  }
  for (int64_t e = 0; e < E; ++e)
    if (pairs[e]) active.push_back(e);
  std::sort(active.begin(), active.end(),
            [&](int64_t a, int64_t b) { return pairs[a] != pairs[b] ? pairs[a] > pairs[b] : a < b; });
  for (int64_t e : active) {
    int64_t best = 0;
    for (int64_t q = 1; q < world; ++q) {
      const bool better = load[q] != load[best] ? load[q] < load[best] : (q == op[e]) > (best == op[e]);
      if (better) best = q;
    }
    assign[e] = best;
    load[best] += expert_cost + pairs[e];
  }
  at::Tensor mine = at::empty_like(ids);
  at::Tensor rows = at::empty({E}, owner.options());
  int64_t* mp = mine.data_ptr<int64_t>();
  int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) mp[i] = assign[ip[i]] == rank ? ip[i] : -1;
  for (int64_t e = 0; e < E; ++e) rp[e] = assign[e] * block;
  return {mine, rows};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(planaria, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, int expert_offset, "
        "Tensor(a!) out) -> ()");
  m.def("fused_moe_pairs(Tensor x, Tensor w13, Tensor w2, Tensor topk_ids, int expert_offset, Tensor(a!) y) -> ()");
  m.def("moe_combine(Tensor rows, Tensor src, Tensor topk_weights, Tensor(a!) out) -> ()");
  m.def("moe_combine_routed(Tensor rows, Tensor ids, Tensor expert_rows, int base, Tensor topk_weights, "
        "Tensor(a!) out) -> ()");
  m.def("moe_share(Tensor ids, Tensor owner, int world, int rank, int block, int expert_cost) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(planaria, CPU, m) {
  m.impl("fused_moe", &fused_moe);
  m.impl("fused_moe_pairs", &fused_moe_pairs);
  m.impl("moe_combine", &moe_combine);
  m.impl("moe_combine_routed", &moe_combine_routed);
  m.impl("moe_share", &moe_share);
}
