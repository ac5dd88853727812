// Sequence flags in shared memory for the collectives of expert-parallel ranks on one node
// (planaria/elastic/shm_group.py): each rank publishes a counter after writing its data
// (release: its writes are visible before the counter is), and waits until every rank's
// counter reaches a target (acquire: their data is visible after). The wait spins for a
// bounded time and returns, so the caller can look at its peers' liveness and deadlines
// between calls; it never blocks for longer than spin_us.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <sched.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

int64_t* flag_ptr(const at::Tensor& flags, int64_t i, int64_t stride) {
  return flags.data_ptr<int64_t>() + i * stride;
}

void check(const at::Tensor& flags, int64_t n, int64_t stride) {
  TORCH_CHECK(flags.scalar_type() == at::kLong && flags.is_contiguous() && flags.dim() == 1,
              "shm flags: a contiguous int64 tensor");
  TORCH_CHECK(n > 0 && stride > 0 && n * stride <= flags.numel(), "shm flags: n x stride past the tensor");
}

void shm_publish(const at::Tensor& flags, int64_t index, int64_t stride, int64_t value) {
  check(flags, index + 1, stride);
#if defined(__x86_64__) || defined(_M_X64)
  _mm_sfence();  // streaming stores of a large copy are not ordered by the release below
#endif
  __atomic_store_n(flag_ptr(flags, index, stride), value, __ATOMIC_RELEASE);
}

// Whether every flag i in [0, n) reached ``target`` within about spin_us microseconds
// (sched_yield between looks when ``yield``: other processes of the node may need the core).
bool shm_wait_all(const at::Tensor& flags, int64_t n, int64_t stride, int64_t target, int64_t spin_us,
                  bool yield) {
  check(flags, n, stride);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  int64_t next = 0;  // ranks before it have reached the target (counters only grow)
  for (int64_t round = 0;; ++round) {
    while (next < n && __atomic_load_n(flag_ptr(flags, next, stride), __ATOMIC_ACQUIRE) >= target) ++next;
    if (next == n) return true;
    if ((round & 63) == 63 && std::chrono::steady_clock::now() >= deadline) return false;
    if (yield) sched_yield();
    else cpu_relax();
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(planaria, m) {
  m.def("shm_publish(Tensor(a!) flags, int index, int stride, int value) -> ()");
  m.def("shm_wait_all(Tensor flags, int n, int stride, int target, int spin_us, bool yield_) -> bool");
}

TORCH_LIBRARY_IMPL(planaria, CPU, m) {
  m.impl("shm_publish", &shm_publish);
  m.impl("shm_wait_all", &shm_wait_all);
}
