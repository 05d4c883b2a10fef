// Merges the fp32 partial sums an epilogue (or a row-dots pass) left per tile:
// bias, γ and β gradients summed over M-tiles, the norm's row dots summed over
// N-tiles. All of one GEMM's sums go in one launch: on a host that spends
// ~8 µs per launch, a block's backward had 12 of these. Deterministic: the
// same inputs give the same bits, unlike atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "error.h"
#include "half_types.cuh"
#include "kernels.h"

namespace coda::kernels {
namespace {

// A column block sums 32 columns: a warp per eighth of the tiles (each lane
// one column, so a warp reads 128 contiguous bytes per tile), then the 8
// warps' sums in a fixed order. One thread per column and all tiles ran
// latency-bound with a few hundred tiles of partials. A row block gives each
// of its 256 rows a thread, which reads that row's tiles (contiguous across
// the warp's rows).
constexpr int kColumnsPerBlock = 32;
constexpr int kRowGroups = 8;
constexpr int kThreads = kColumnsPerBlock * kRowGroups;

template <class T>
__global__ void merge_partials_kernel(PartialSums p, unsigned column_blocks) {
  if (blockIdx.x >= column_blocks) {
    const int64_t r = int64_t(blockIdx.x - column_blocks) * kThreads + threadIdx.x;
    if (r >= p.rows) return;
#pragma unroll
    for (int o = 0; o < 2; ++o) {
      if (p.row_partials[o] == nullptr) continue;
      float acc = 0.f;
      for (int64_t t = 0; t < p.row_tiles; ++t) acc += p.row_partials[o][t * p.row_ld + r];
      p.row_out[o][r] = p.row_scale * acc;
    }
    return;
  }
  __shared__ float sums[kRowGroups][kColumnsPerBlock];
  const int lane = threadIdx.x % kColumnsPerBlock, group = threadIdx.x / kColumnsPerBlock;
  const int64_t j = int64_t(blockIdx.x) * kColumnsPerBlock + lane;
#pragma unroll
  for (int o = 0; o < 2; ++o) {
    const float* part = p.col_partials[o];
    if (part == nullptr) continue;  // uniform over the block
    float acc = 0.f;
    if (j < p.cols) {
#pragma unroll 8
      for (int64_t r = group; r < p.col_tiles; r += kRowGroups) acc += part[r * p.col_ld + j];
    }
    __syncthreads();  // the previous output's sums are read
    sums[group][lane] = acc;
    __syncthreads();
    if (group == 0 && j < p.cols) {
      float total = 0.f;
#pragma unroll
      for (int g = 0; g < kRowGroups; ++g) total += sums[g][lane];
      static_cast<T*>(p.col_out[o])[j] = from_float<T>(total);
    }
  }
}

}  // namespace

Status merge_partials(DType dtype, const PartialSums& p, cudaStream_t stream) {
  const bool any_col = p.col_partials[0] != nullptr || p.col_partials[1] != nullptr;
  const bool any_row = p.row_partials[0] != nullptr || p.row_partials[1] != nullptr;
  const int64_t col_blocks = any_col ? (p.cols + kColumnsPerBlock - 1) / kColumnsPerBlock : 0;
  const int64_t row_blocks = any_row ? (p.rows + kThreads - 1) / kThreads : 0;
  if (col_blocks + row_blocks == 0) return Status::kSuccess;
  const dim3 grid(static_cast<unsigned>(col_blocks + row_blocks));
  if (dtype == DType::kBFloat16) {
    merge_partials_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p, static_cast<unsigned>(col_blocks));
  } else {
    merge_partials_kernel<__half><<<grid, kThreads, 0, stream>>>(p, static_cast<unsigned>(col_blocks));
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string("merge_partials launch: ") + cudaGetErrorString(e));
  return Status::kSuccess;
}

}  // namespace coda::kernels
