// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011): a counter-based
// generator, so a dropout mask is a function of (seed, offset, element) that the backward regenerates
// instead of storing. Counter words: the element's group of 4 (0, 1), the draw's offset (2, 3), word 3's
// high bits set apart so no counter equals one of curand's (whose words 2, 3 hold a thread index).
#pragma once

#include <cstdint>

#include "coda/coda.h"

namespace coda::kernels {

struct PhiloxKey {
  uint32_t k0, k1;
};

__device__ inline uint4 philox4x32_10(uint4 c, PhiloxKey key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(kM0, c.x), lo0 = kM0 * c.x;
    const uint32_t hi1 = __umulhi(kM1, c.z), lo1 = kM1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ key.k0, lo1, hi0 ^ c.w ^ key.k1, lo0);
    key.k0 += kW0;
    key.k1 += kW1;
  }
  return c;
}

// The 4 random words of elements 4g .. 4g + 3 of one draw.
__device__ inline uint4 dropout_bits(uint64_t seed, uint64_t offset, uint64_t g) {
  const uint4 counter = make_uint4(uint32_t(g), uint32_t(g >> 32), uint32_t(offset),
                                   uint32_t(offset >> 32) ^ 0xC0DA0000u);
  return philox4x32_10(counter, {uint32_t(seed), uint32_t(seed >> 32)});
}

// The draw's (seed, offset) as coda::DropoutRng gives them (read from device memory under capture).
__device__ inline void unpack(const DropoutRng& r, uint64_t& seed, uint64_t& offset) {
  if (r.seed_ptr != nullptr) {
    seed = uint64_t(*r.seed_ptr);
    offset = uint64_t(*r.offset_ptr) + r.offset_intragraph;
  } else {
    seed = r.seed;
    offset = r.offset;
  }
}

}  // namespace coda::kernels
