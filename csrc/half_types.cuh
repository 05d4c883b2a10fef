// float <-> the 16-bit element types, and their vectors, for the small hand-written kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace coda::kernels {

template <class T>
__device__ inline float to_float(T v);
template <>
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ inline float to_float(__half v) { return __half2float(v); }

template <class T>
__device__ inline T from_float(float v);
template <>
__device__ inline __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ inline __half from_float(float v) { return __float2half_rn(v); }

// V consecutive 16-bit elements: one 16-byte access when V = 8, V separate
// ones otherwise (the fallback assumes no alignment beyond the element's).
template <class T, int V>
struct alignas(V == 8 ? 16 : sizeof(T)) Chunk {
  T v[V];
};

}  // namespace coda::kernels
