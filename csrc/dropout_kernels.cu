// GPT-2's residual dropout, Y = R + mask ⊙ X / keep, with the next norm's row
// statistics of Y, one warp per row; and its backward, dX = mask ⊙ dY / keep.
//
// Why a pass of its own rather than the GEMM's epilogue: the mask is a
// function of (seed, offset, element) (philox.cuh), which the epilogue's
// broadcast nodes cannot give per element without coordinates; this pass
// reads the GEMM's output once, adds the residual and reduces the row, as the
// residual epilogue would, and the backward regenerates the mask instead of
// reading a stored one. The mask of element (i, j) takes word (i·n + j) % 4 of
// the draw's Philox block (i·n + j) / 4, so it does not depend on the grid.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "block_sum.cuh"
#include "error.h"
#include "half_types.cuh"
#include "kernels.h"
#include "philox.cuh"
#include "small_kernels.cuh"

namespace coda::kernels {
namespace {

template <class T>
using Vec8 = Chunk<T, 8>;  // one 16-byte access

constexpr int kRowsPerBlock = 4;
constexpr int64_t kWarpStride = 32 * 8;
constexpr int kThreads = 256;

// An element is kept where its 32 random bits are below keep · 2^32.
__device__ inline uint64_t keep_threshold(float keep) {
  return keep >= 1.f ? (uint64_t(1) << 32) : uint64_t(double(keep) * 4294967296.0);
}

// Whether elements e .. e + 7 of the draw are kept (e a multiple of 8).
__device__ inline void kept8(uint64_t seed, uint64_t offset, uint64_t e, uint64_t threshold, bool (&kept)[8]) {
  const uint4 a = dropout_bits(seed, offset, e / 4), b = dropout_bits(seed, offset, e / 4 + 1);
  const uint32_t u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) kept[i] = uint64_t(u[i]) < threshold;
}

template <class T>
__global__ void dropout_residual_kernel(int64_t m, int64_t n, const T* __restrict__ x, int64_t ldx,
                                        const T* __restrict__ residual, int64_t ldr, float keep, DropoutRng rng,
                                        int64_t* __restrict__ rng_state, T* __restrict__ y, int64_t ldy, float eps,
                                        float* __restrict__ mean, float* __restrict__ rstd) {
  uint64_t seed, offset;
  unpack(rng, seed, offset);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    rng_state[0] = int64_t(seed);
    rng_state[1] = int64_t(offset);
  }
  const uint64_t threshold = keep_threshold(keep);
  const float scale = 1.f / keep;
  const int64_t first = int64_t(threadIdx.x % 32) * 8;
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; r < m;
       r += int64_t(gridDim.x) * kRowsPerBlock) {
    float sum = 0.f;
    for (int64_t j = first; j < n; j += kWarpStride) {
      const Vec8<T> xv = *reinterpret_cast<const Vec8<T>*>(x + r * ldx + j);
      const Vec8<T> rv = *reinterpret_cast<const Vec8<T>*>(residual + r * ldr + j);
      bool kept[8];
      kept8(seed, offset, uint64_t(r) * uint64_t(n) + uint64_t(j), threshold, kept);
      Vec8<T> out;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        out.v[i] = from_float<T>(to_float(rv.v[i]) + (kept[i] ? to_float(xv.v[i]) * scale : 0.f));
        sum += to_float(out.v[i]);  // the statistics of Y as stored, what the next norm reads
      }
      *reinterpret_cast<Vec8<T>*>(y + r * ldy + j) = out;
    }
    if (rstd != nullptr) {  // grid-uniform
      const float mu = mean != nullptr ? warp_sum(sum) / float(n) : 0.f;
      float q = 0.f;
      for (int64_t j = first; j < n; j += kWarpStride) {  // this thread's own stores, read back
        const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(y + r * ldy + j);
#pragma unroll
        for (int i = 0; i < 8; ++i) q += (to_float(v.v[i]) - mu) * (to_float(v.v[i]) - mu);
      }
      q = warp_sum(q);
      if (threadIdx.x % 32 == 0) {
        if (mean != nullptr) mean[r] = mu;
        rstd[r] = rsqrtf(q / float(n) + eps);
      }
    }
  }
}

template <class T>
__global__ void dropout_backward_kernel(int64_t m, int64_t n, const T* __restrict__ dy, int64_t lddy, float keep,
                                        const int64_t* __restrict__ rng_state, T* __restrict__ dx, int64_t lddx) {
  const uint64_t seed = uint64_t(rng_state[0]), offset = uint64_t(rng_state[1]);
  const uint64_t threshold = keep_threshold(keep);
  const float scale = 1.f / keep;
  const int64_t per_row = n / 8, chunks = m * per_row;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = c / per_row, j = (c % per_row) * 8;
    const Vec8<T> g = *reinterpret_cast<const Vec8<T>*>(dy + r * lddy + j);
    bool kept[8];
    kept8(seed, offset, uint64_t(r) * uint64_t(n) + uint64_t(j), threshold, kept);
    Vec8<T> out;
#pragma unroll
    for (int i = 0; i < 8; ++i) out.v[i] = from_float<T>(kept[i] ? to_float(g.v[i]) * scale : 0.f);
    *reinterpret_cast<Vec8<T>*>(dx + r * lddx + j) = out;
  }
}

unsigned capped(int64_t blocks) { return static_cast<unsigned>(blocks < (1 << 30) ? (blocks > 0 ? blocks : 1) : (1 << 30)); }

}  // namespace

Status dropout_residual(DType dtype, const DropoutResidualArgs& a, cudaStream_t stream) {
  // one block even for m = 0: the draw's state is written for the backward
  return with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    dropout_residual_kernel<T><<<capped((a.m + kRowsPerBlock - 1) / kRowsPerBlock), kRowsPerBlock * 32, 0, stream>>>(
        a.m, a.n, static_cast<const T*>(a.x), a.ldx, static_cast<const T*>(a.residual), a.ld_residual, a.keep, a.rng,
        a.rng_state, static_cast<T*>(a.y), a.ldy, a.eps, a.mean, a.rstd);
    return launched("dropout_residual");
  });
}

Status dropout_backward(DType dtype, const DropoutBackwardArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  return with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t chunks = a.m * (a.n / 8);
    const int64_t blocks = (chunks + kThreads - 1) / kThreads;
    dropout_backward_kernel<T><<<capped(blocks < 65536 ? blocks : 65536), kThreads, 0, stream>>>(
        a.m, a.n, static_cast<const T*>(a.dy), a.lddy, a.keep, a.rng_state, static_cast<T*>(a.dx), a.lddx);
    return launched("dropout_backward");
  });
}

}  // namespace coda::kernels
