// Which L2 eviction priority the epilogues' TMA stores carry (store_l2.hpp).
// No CUTLASS here: api.cpp sets it from the tuning override.
//
// Why: an epilogue's stores (D, and an aux output such as H) go through the
// L2 like the mainloop's operand loads, and push operand panels out of it.
// Nsight Compute counted 2.15 GB of DRAM reads for fc1's plain forward and
// 3.47 GB when it also stores H (785da3f): the operands were read again. A
// store marked evict-first is the first line L2 gives up.
#pragma once

#include <atomic>
#include <cstdint>

namespace coda::epilogues {

// The cache-policy operand of `.L2::cache_hint`, as `createpolicy.fractional`
// with fraction 1.0 encodes it (CUTLASS's TMA::CacheHintSm90 has the same values).
constexpr uint64_t kL2EvictNormal = 0x1000000000000000ull;
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;

// Which stores are marked evict-first, as bits: 1 D, 2 the aux stores.
// Tuning::store_l2 overrides it (benchmarks). The aux outputs (H, N̂) are
// read by a later pass, never from L2 at these sizes, so they go first. In
// the ca9cce1 power probe fc1's forward storing H spent 1.030 of cuBLAS's
// energy so (1.033 without hints; 1.026 with D evict-first too, which the
// next GEMM may want from L2 at small sizes; DRAM reads 3.32 -> 3.26 GB).
constexpr int kStoreL2EvictFirstDefault = 2;

constexpr uint64_t store_l2_policy_of(int evict_first_bits, int bit) {
  return (evict_first_bits & bit) ? kL2EvictFirst : kL2EvictNormal;
}

struct StoreL2Policy {
  std::atomic<uint64_t> d{store_l2_policy_of(kStoreL2EvictFirstDefault, 1)};    // the GEMM's output
  std::atomic<uint64_t> aux{store_l2_policy_of(kStoreL2EvictFirstDefault, 2)};  // the programs' aux stores (H, N̂)
};

// One per process: read on the host when a kernel's parameters are built.
inline StoreL2Policy& store_l2_policy() {
  static StoreL2Policy policy;
  return policy;
}

}  // namespace coda::epilogues
