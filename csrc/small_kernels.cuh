// What the host sides of the hand-written kernels (norm_kernels.cu, rope_kernels.cu,
// dropout_kernels.cu) share: the launch check and the switch over the 16-bit dtypes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "error.h"
#include "kernels.h"

namespace coda::kernels {

// kCudaError naming `what` where the launch before it failed.
inline Status launched(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string(what) + " launch: " + cudaGetErrorString(e));
  return Status::kSuccess;
}

// fn(T{}) for the element type of `dtype` (bf16 or fp16; the API checked it is one of them).
template <class Fn>
Status with_type(DType dtype, Fn&& fn) {
  if (dtype == DType::kBFloat16) return fn(__nv_bfloat16{});
  return fn(__half{});
}

}  // namespace coda::kernels
