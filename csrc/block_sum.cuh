// Row reductions of the small non-GEMM kernels (norm_kernels.cu,
// rope_kernels.cu): one block of Threads per row.
#pragma once

namespace coda::kernels {

// Sum of `v` over the warp; every lane gets it.
__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

// Sum of `v` over the block; every thread gets it. `shared` holds Threads/32 floats.
template <int Threads>
__device__ inline float block_sum(float v, float* shared) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  return warp_sum(lane < Threads / 32 ? shared[lane] : 0.f);
}

}  // namespace coda::kernels
