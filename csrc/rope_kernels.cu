// The backward of the QKV projection's RoPE (cutlass_epilogues/rope.hpp),
// one elementwise pass over the rows of the output gradient.
//
// No GEMM epilogue can host it: the inverse rotation acts on the QKV dgrad's
// A operand (dY, along its K), and dY comes from the attention backward. So
// per token m and column pair (2j, 2j+1), with φ = 2π·pos[m]·(hi + lo) from the
// same rope_sincos as the forward (bit-identical angles):
//   dP = R(−φ)·dY = (d0 cos φ + d1 sin φ, −d0 sin φ + d1 cos φ)
// and, for the RMSNorm folded into the projection, its row dot
//   c₁[m] = scale·Σ_n dP ⊙ (H − t),   H = R(−φ)·Y
// from the forward's rotated output Y (rotating back is cheaper than saving
// H: Y is kept anyway, it is attention's input). c₁ sums the unrounded fp32
// dP. Then the norm's dgrad (kNormDgrad) and the wgrad run on dP unchanged.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "block_sum.cuh"
#include "error.h"
#include "half_types.cuh"
#include "kernels.h"
#include "rope_angle.hpp"

namespace coda::kernels {
namespace {

constexpr int kThreads = 256;

// V consecutive floats of a per-column vector (0 where it is null); 16-byte
// loads when V = 8 (j is a multiple of 8, the vector 16-byte aligned).
template <int V>
__device__ void load_cols(const float* __restrict__ p, int64_t j, float (&out)[V]) {
  if (p == nullptr) {
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = 0.f;
  } else if constexpr (V % 4 == 0) {
#pragma unroll
    for (int e = 0; e < V; e += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + j + e);
      out[e] = f.x; out[e + 1] = f.y; out[e + 2] = f.z; out[e + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = p[j + e];
  }
}

// One block per row (the rows loop for grids past 2^31 − 1 blocks), a thread
// V columns at a time. dy and dp may be the same tensor: each thread reads
// its chunk of dY before it writes the same chunk of dP, and neither pointer
// is __restrict__.
template <class T, int V>
__global__ void __launch_bounds__(kThreads) rope_backward_kernel(
    int64_t m, int64_t n, const T* dy, int64_t lddy, const T* __restrict__ y, int64_t ldy,
    const int32_t* __restrict__ positions, const float* __restrict__ freq, const float* __restrict__ shift,
    float scale, T* dp, int64_t lddp, float* __restrict__ c1) {
  static_assert(V % 2 == 0, "a chunk holds whole column pairs");
  __shared__ float shared[kThreads / 32];
  const bool dots = c1 != nullptr;  // grid-uniform
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const float pos = float(positions[r]);  // exact below 2^24
    float acc = 0.f;
    for (int64_t j = int64_t(threadIdx.x) * V; j < n; j += int64_t(kThreads) * V) {
      const Chunk<T, V> g = *reinterpret_cast<const Chunk<T, V>*>(dy + r * lddy + j);
      Chunk<T, V> yv;
      if (dots) yv = *reinterpret_cast<const Chunk<T, V>*>(y + r * ldy + j);
      float fv[V], tv[V];
      load_cols<V>(freq, j, fv);
      if (dots) load_cols<V>(shift, j, tv);
      Chunk<T, V> out;
#pragma unroll
      for (int e = 0; e < V; e += 2) {
        float s, c;
        epilogues::rope_sincos(pos, fv[e], fv[e + 1], s, c);
        const float d0 = to_float(g.v[e]), d1 = to_float(g.v[e + 1]);
        const float p0 = d0 * c + d1 * s, p1 = d1 * c - d0 * s;  // R(−φ)·dY
        out.v[e] = from_float<T>(p0);
        out.v[e + 1] = from_float<T>(p1);
        if (dots) {
          const float y0 = to_float(yv.v[e]), y1 = to_float(yv.v[e + 1]);
          const float h0 = y0 * c + y1 * s, h1 = y1 * c - y0 * s;  // R(−φ)·Y = H
          acc += p0 * (h0 - tv[e]) + p1 * (h1 - tv[e + 1]);
        }
      }
      *reinterpret_cast<Chunk<T, V>*>(dp + r * lddp + j) = out;
    }
    if (dots) {
      acc = block_sum<kThreads>(acc, shared);
      if (threadIdx.x == 0) c1[r] = scale * acc;
    }
  }
}

Status launched(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string(what) + " launch: " + cudaGetErrorString(e));
  return Status::kSuccess;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class T>
Status launch(const RopeBackwardArgs& a, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(a.m < 0x7fffffff ? a.m : 0x7fffffff);
  const T* dy = static_cast<const T*>(a.dy);
  const T* y = static_cast<const T*>(a.y);
  T* dp = static_cast<T*>(a.dp);
  // 16-byte accesses where every row and vector allows them (api.cpp's
  // checks guarantee it); pairs of scalar accesses otherwise.
  const bool vec = a.n % 8 == 0 && a.lddy % 8 == 0 && a.lddp % 8 == 0 && aligned16(dy) && aligned16(dp) &&
                   aligned16(a.freq) && (a.c1 == nullptr || (a.ldy % 8 == 0 && aligned16(y))) &&
                   (a.shift == nullptr || aligned16(a.shift));
  if (vec) {
    rope_backward_kernel<T, 8><<<grid, kThreads, 0, stream>>>(a.m, a.n, dy, a.lddy, y, a.ldy, a.positions, a.freq,
                                                              a.shift, a.scale, dp, a.lddp, a.c1);
  } else {
    rope_backward_kernel<T, 2><<<grid, kThreads, 0, stream>>>(a.m, a.n, dy, a.lddy, y, a.ldy, a.positions, a.freq,
                                                              a.shift, a.scale, dp, a.lddp, a.c1);
  }
  return launched("rope_backward");
}

}  // namespace

Status rope_backward(DType dtype, const RopeBackwardArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  if (a.n % 2 != 0) return detail::fail(Status::kInvalidArgument, "rope_backward: n must be even (column pairs)");
  if (dtype == DType::kBFloat16) return launch<__nv_bfloat16>(a, stream);
  if (dtype == DType::kFloat16) return launch<__half>(a, stream);
  return detail::fail(Status::kInvalidArgument, "rope_backward: dtype must be bfloat16 or float16");
}

}  // namespace coda::kernels
