// Finishes a bias gradient: sums the per-tile column partials that the dgrad
// epilogue wrote (a few hundred rows at most) and rounds once to the dtype.
// Deterministic: the same inputs give the same bits, unlike atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "error.h"
#include "half_types.cuh"
#include "kernels.h"

namespace coda::kernels {
namespace {

// A block sums 32 columns: a warp per eighth of the rows (each lane one
// column, so a warp reads 128 contiguous bytes per row), then the 8 warps'
// sums in a fixed order. One thread per column and all rows ran latency-bound
// with a few hundred rows of partials.
constexpr int kColumnsPerBlock = 32;
constexpr int kRowGroups = 8;

template <class T>
__global__ void column_sum_kernel(const float* __restrict__ partials, int64_t rows, int64_t n, int64_t ld,
                                  T* __restrict__ out) {
  __shared__ float sums[kRowGroups][kColumnsPerBlock];
  const int lane = threadIdx.x % kColumnsPerBlock, group = threadIdx.x / kColumnsPerBlock;
  const int64_t j = int64_t(blockIdx.x) * kColumnsPerBlock + lane;
  float acc = 0.f;
  if (j < n) {
#pragma unroll 8
    for (int64_t r = group; r < rows; r += kRowGroups) acc += partials[r * ld + j];
  }
  sums[group][lane] = acc;
  __syncthreads();
  if (group == 0 && j < n) {
    float total = 0.f;
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) total += sums[g][lane];
    out[j] = from_float<T>(total);
  }
}

}  // namespace

Status column_sum(DType dtype, const float* partials, int64_t rows, int64_t n, int64_t ld, void* out,
                  cudaStream_t stream) {
  constexpr int kThreads = kColumnsPerBlock * kRowGroups;
  dim3 grid(static_cast<unsigned>((n + kColumnsPerBlock - 1) / kColumnsPerBlock));
  if (dtype == DType::kBFloat16) {
    column_sum_kernel<<<grid, kThreads, 0, stream>>>(partials, rows, n, ld, static_cast<__nv_bfloat16*>(out));
  } else {
    column_sum_kernel<<<grid, kThreads, 0, stream>>>(partials, rows, n, ld, static_cast<__half*>(out));
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string("column_sum launch: ") + cudaGetErrorString(e));
  return Status::kSuccess;
}

}  // namespace coda::kernels
