// y = x W^T (+ b) in bfloat16 whose result for a row of x does not depend on the other
// rows (how many, which), for the engine's batch-invariant mode (kernels/linear.py).
//
// x [M, K] bfloat16, contiguous; W packed by kernels/linear.py ``pack_invariant`` as
// [ceil(N / 16), ceil(K / 2), 16, 2] bfloat16: blocks of 16 output columns, each the
// column pairs (W[n, 2p], W[n, 2p + 1]) for p = 0, 1, ... in a row of 32 values (zeros
// past N and K); b [N] bfloat16 or none -> y [M, N] bfloat16.
//
// Every output y[m, n] is one float32 lane: AVX512-BF16's dot instruction adds
// x[m, 2p] W[n, 2p] + x[m, 2p + 1] W[n, 2p + 1] to it for p = 0, 1, ... in order (the
// last pair of an odd K with a zero), then the bias is added in float32 and the sum
// rounded once to bfloat16 (round to nearest even). Nothing else touches that lane: no
// split of K between threads, no reduction across lanes, and the register tile it sits
// in (up to 6 rows x 64 columns) and the thread that runs it change nothing in the
// sequence of instructions it sees. So the row's result is the same bits whatever M,
// the row's place in x, the thread count (tests/kernels/test_batch_invariance.py).
// oneDNN's GEMM gives none of that (its blocking, and so its order of sums, follows M);
// the register tile here is oneDNN's own shape (x values broadcast, 64 columns of W per
// load), so it runs at about its speed (bench/batch_invariance.py).
//
// Loops: the rows of x in chunks of kChunkRows (they stay in L2), the work being (chunk,
// 16-column block) items split evenly over threads (at::parallel_for); a thread takes its
// blocks four at a time and meets each group with the chunk's rows, kTileRows at a time;
// past kPairsPerPass pairs of K the pass is cut (the partial sums wait in float32 in a
// buffer, exactly: the order of the additions does not change) so a group's weights
// stay in L2 while every tile of the chunk reads them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int kTileRows = 6;            // rows of x per register tile
constexpr int kTileBlocks = 4;          // 16-column blocks per register tile (24 accumulators)
constexpr int64_t kChunkRows = 96;      // rows of x per chunk (a multiple of kTileRows)
constexpr int64_t kPairsPerPass = 512;  // pairs of K per pass: 4 blocks x 512 pairs = 128 KiB of weights
constexpr int64_t kPrefetchPairs = 16;  // how far ahead a weight stream is fetched

#if defined(__AVX512BF16__)
struct Job {
  const c10::BFloat16* w;  // the first block of the tile's group
  int64_t block_stride;    // values from one block to the next: ceil(K / 2) * 32
  const c10::BFloat16* x;  // the tile's first row
  int64_t K;
  c10::BFloat16* y;  // the tile's first row, column n0
  int64_t ldy, cols;  // y's row stride; columns of the group to write (<= 16 * blocks)
  const float* bias;  // the group's bias, float32 (16 * blocks, zero-padded), or nullptr
};

inline __m512bh pair_of(const c10::BFloat16* x, int64_t k, int64_t K) {
  int32_t bits;
  if (k + 1 < K) {
    std::memcpy(&bits, x + k, sizeof(bits));
  } else {  // the last pair of an odd K: (x[K - 1], 0)
    uint16_t lo;
    std::memcpy(&lo, x + k, sizeof(lo));
    bits = static_cast<int32_t>(lo);
  }
  return (__m512bh)_mm512_set1_epi32(bits);
}

// pairs [p0, p1) into the tile's accumulators (zeros when p0 == 0, else ``carry``), then
// back into ``carry`` or, on the last pass, out to y
template <int MR, int NB>
void tile(const Job& j, int64_t p0, int64_t p1, int64_t K2, float* carry) {
  __m512 acc[MR][NB];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) acc[m][b] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(carry + (m * NB + b) * 16);
  const int64_t full = std::min(p1, j.K / 2);  // pairs with two values of x
  for (int64_t p = p0; p < full; ++p) {
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      // a pair of a block is one cache line: fetch the line kPrefetchPairs ahead (past the
      // block's end it is the next block's start, which the next tile reads)
      _mm_prefetch(reinterpret_cast<const char*>(j.w + b * j.block_stride + (p + kPrefetchPairs) * 32), _MM_HINT_T0);
      wv[b] = (__m512bh)_mm512_loadu_si512(j.w + b * j.block_stride + p * 32);
    }
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      int32_t bits;
      std::memcpy(&bits, j.x + m * j.K + 2 * p, sizeof(bits));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(bits);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv[b], xv);
    }
  }
  for (int64_t p = full; p < p1; ++p) {  // at most one: the half pair of an odd K
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(j.w + b * j.block_stride + p * 32);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = pair_of(j.x + m * j.K, 2 * p, j.K);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], wv[b], xv);
    }
  }
  if (p1 < K2) {
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(carry + (m * NB + b) * 16, acc[m][b]);
    return;
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t left = j.cols - 16 * b;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    const __m512 bv = j.bias ? _mm512_loadu_ps(j.bias + 16 * b) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m512 v = j.bias ? _mm512_add_ps(acc[m][b], bv) : acc[m][b];
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(j.y + m * j.ldy + 16 * b, mask, h);
    }
  }
}

template <int MR>
void tile_blocks(int nb, const Job& j, int64_t p0, int64_t p1, int64_t K2, float* carry) {
  switch (nb) {
    case 4: tile<MR, 4>(j, p0, p1, K2, carry); break;
    case 3: tile<MR, 3>(j, p0, p1, K2, carry); break;
    case 2: tile<MR, 2>(j, p0, p1, K2, carry); break;
    default: tile<MR, 1>(j, p0, p1, K2, carry); break;
  }
}

void tile_any(int mr, int nb, const Job& j, int64_t p0, int64_t p1, int64_t K2, float* carry) {
  switch (mr) {
    case 6: tile_blocks<6>(nb, j, p0, p1, K2, carry); break;
    case 5: tile_blocks<5>(nb, j, p0, p1, K2, carry); break;
    case 4: tile_blocks<4>(nb, j, p0, p1, K2, carry); break;
    case 3: tile_blocks<3>(nb, j, p0, p1, K2, carry); break;
    case 2: tile_blocks<2>(nb, j, p0, p1, K2, carry); break;
    default: tile_blocks<1>(nb, j, p0, p1, K2, carry); break;
  }
}
#endif

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "invariant_linear: x [M, K] bfloat16, contiguous, on the CPU");
  const int64_t M = x.size(0), K = x.size(1), K2 = (K + 1) / 2, NB = (N + 15) / 16;
  TORCH_CHECK(N > 0 && K > 0, "invariant_linear: N and K must be positive");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(0) == NB && packed.size(1) == K2 && packed.size(2) == 16 && packed.size(3) == 2,
              "invariant_linear: packed must be [ceil(N / 16), ceil(K / 2), 16, 2] bfloat16 (pack_invariant), got ",
              packed.sizes(), " for N ", N, ", K ", K);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kBFloat16,
                "invariant_linear: bias [N] bfloat16");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(__AVX512BF16__)
  std::vector<float> bf(has_bias ? NB * 16 : 0, 0.f);
  if (has_bias) {
    const at::Tensor b = bias->contiguous();
    const c10::BFloat16* bp = b.data_ptr<c10::BFloat16>();
    for (int64_t n = 0; n < N; ++n) bf[n] = static_cast<float>(bp[n]);
  }
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t block_stride = K2 * 32;
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  // a grain of ~32 KiB of weights per task: small linears (the MoE router) stay on one thread
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (block_stride * 2));
  at::parallel_for(0, chunks * NB, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> carry(K2 > kPairsPerPass ? kChunkRows * kTileBlocks * 16 : 0);
    for (int64_t item = begin; item < end;) {
      const int64_t c = item / NB, b0 = item % NB, b1 = std::min(NB, b0 + (end - item));
      const int64_t m0 = c * kChunkRows, mc = std::min(kChunkRows, M - m0);
      for (int64_t g = b0; g < b1; g += kTileBlocks) {
        const int nb = static_cast<int>(std::min<int64_t>(kTileBlocks, b1 - g));
        for (int64_t p0 = 0; p0 < K2; p0 += kPairsPerPass) {
          const int64_t p1 = std::min(K2, p0 + kPairsPerPass);
          for (int64_t mt = 0; mt < mc; mt += kTileRows) {
            const int mr = static_cast<int>(std::min<int64_t>(kTileRows, mc - mt));
            const Job j{wp + g * block_stride, block_stride, xp + (m0 + mt) * K, K, yp + (m0 + mt) * N + g * 16,
                        N, std::min<int64_t>(16 * nb, N - g * 16), has_bias ? bf.data() + g * 16 : nullptr};
            tile_any(mr, nb, j, p0, p1, K2, carry.data() + mt * kTileBlocks * 16);
          }
        }
      }
      item += b1 - b0;
    }
  });
#else
  TORCH_CHECK(false, "invariant_linear: this build has no AVX512-BF16 (kernels/linear.py uses skinny_linear there)");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(planaria, m) {
  m.def("invariant_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(planaria, CPU, m) { m.impl("invariant_linear", &invariant_linear); }
