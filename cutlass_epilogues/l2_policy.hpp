// Which L2 eviction priority the epilogues' TMA stores carry (store_l2.hpp).
//
// An epilogue's stores go through the L2 like the mainloop's operand loads
// and push operand panels out of it. The aux outputs (H, N̂) are read by a
// later pass, never from L2 at these sizes, so they are marked evict-first;
// D keeps the normal priority, since the next GEMM may read it from L2 at
// small sizes (benchmarks/NOTES.md).
#pragma once

#include <cstdint>

namespace coda::epilogues {

// The cache-policy operand of `.L2::cache_hint`, as `createpolicy.fractional`
// with fraction 1.0 encodes it (CUTLASS's TMA::CacheHintSm90 has the same values).
constexpr uint64_t kL2EvictNormal = 0x1000000000000000ull;
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;

constexpr uint64_t kStoreL2D = kL2EvictNormal;   // the GEMM's output
constexpr uint64_t kStoreL2Aux = kL2EvictFirst;  // the programs' aux stores

}  // namespace coda::epilogues
