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

// One thread per column; consecutive threads read consecutive columns.
template <class T>
__global__ void column_sum_kernel(const float* __restrict__ partials, int64_t rows, int64_t n, int64_t ld,
                                  T* __restrict__ out) {
  int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float acc = 0.f;
  for (int64_t r = 0; r < rows; ++r) acc += partials[r * ld + j];
  out[j] = from_float<T>(acc);
}

}  // namespace

Status column_sum(DType dtype, const float* partials, int64_t rows, int64_t n, int64_t ld, void* out,
                  cudaStream_t stream) {
  constexpr int kThreads = 256;
  dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads));
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
