// The backward of the QKV projection's RoPE (cutlass_epilogues/rope.hpp),
// one elementwise pass over the rows of the output gradient; and the per-head
// RMSNorm + RoPE of Qwen3 and Gemma 3 (q_norm, k_norm between the projection
// and the rotation), forward and backward, one warp per (token, head).
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
#include "small_kernels.cuh"
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

// ---- Qwen3's / Gemma 3's per-head RMSNorm, then RoPE (HeadNormRopeArgs)
//
// One warp per (token, head), grid-strided; lane l holds the head's elements
// [l·V, l·V + V), V = head_dim / 32, whole pairs (2j, 2j+1) since V is even.
// The statistics are warp sums; nothing is shared between warps but, in the
// backward, each warp's running dγ partial (one row of dweight_partials).

constexpr int kHeadWarps = 8;          // warps per block
constexpr int kHeadMaxBlocks = 1024;   // the backward's partial rows are at most kHeadMaxBlocks · kHeadWarps

// V 16-bit elements in one access of 2V bytes (api.cpp: rows 16-byte aligned, head_dim ≥ 64).
template <class T, int V>
struct alignas(2 * V) Lanes {
  T v[V];
};

unsigned head_blocks(int64_t items) {
  const int64_t blocks = (items + kHeadWarps - 1) / kHeadWarps;
  return static_cast<unsigned>(blocks < kHeadMaxBlocks ? blocks : kHeadMaxBlocks);
}

// Each lane's V weights and V/2 rotation frequencies.
template <class T, int V>
__device__ void head_params(const T* weight, const float* inv_freq, int lane, float (&w)[V], float (&f)[V / 2]) {
#pragma unroll
  for (int e = 0; e < V; ++e) w[e] = to_float(weight[lane * V + e]);
#pragma unroll
  for (int e = 0; e < V / 2; ++e) f[e] = inv_freq[lane * V / 2 + e];
}

template <class T, int V>
__global__ void __launch_bounds__(kHeadWarps * 32) head_norm_rope_kernel(
    int64_t m, int64_t heads, const T* __restrict__ x, int64_t ldx, const T* __restrict__ weight,
    const int32_t* __restrict__ positions, const float* __restrict__ inv_freq, float eps, T* __restrict__ y,
    int64_t ldy) {
  constexpr int kHeadDim = 32 * V;
  const int lane = threadIdx.x % 32;
  float w[V], f[V / 2];
  head_params<T, V>(weight, inv_freq, lane, w, f);
  const int64_t items = m * heads, stride = int64_t(gridDim.x) * kHeadWarps;
  for (int64_t item = int64_t(blockIdx.x) * kHeadWarps + threadIdx.x / 32; item < items; item += stride) {
    const int64_t r = item / heads, h = item % heads;
    const Lanes<T, V> in = *reinterpret_cast<const Lanes<T, V>*>(x + r * ldx + h * kHeadDim + lane * V);
    float v[V], sq = 0.f;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      v[e] = to_float(in.v[e]);
      sq += v[e] * v[e];
    }
    const float rstd = rsqrtf(warp_sum(sq) / kHeadDim + eps);
    const float pos = float(positions[r]);
    Lanes<T, V> out;
#pragma unroll
    for (int e = 0; e < V; e += 2) {
      float s, c;
      sincosf(pos * f[e / 2], &s, &c);  // the float32 angle Hugging Face's rotary embedding computes
      const float n0 = v[e] * rstd * w[e], n1 = v[e + 1] * rstd * w[e + 1];
      out.v[e] = from_float<T>(n0 * c - n1 * s);
      out.v[e + 1] = from_float<T>(n1 * c + n0 * s);
    }
    *reinterpret_cast<Lanes<T, V>*>(y + r * ldy + h * kHeadDim + lane * V) = out;
  }
}

// dN = R(−φ)·dY; with n̂ = x·rstd and g = γ ⊙ dN: dx = rstd·(g − n̂·mean(g ⊙ n̂)), dγ = Σ dN ⊙ n̂.
template <class T, int V>
__global__ void __launch_bounds__(kHeadWarps * 32) head_norm_rope_backward_kernel(
    int64_t m, int64_t heads, const T* __restrict__ dy, int64_t lddy, const T* __restrict__ x, int64_t ldx,
    const T* __restrict__ weight, const int32_t* __restrict__ positions, const float* __restrict__ inv_freq,
    float eps, T* __restrict__ dx, int64_t lddx, float* __restrict__ dweight_partials) {
  constexpr int kHeadDim = 32 * V;
  const int lane = threadIdx.x % 32;
  float w[V], f[V / 2], dw[V];
  head_params<T, V>(weight, inv_freq, lane, w, f);
#pragma unroll
  for (int e = 0; e < V; ++e) dw[e] = 0.f;
  const int64_t warp = int64_t(blockIdx.x) * kHeadWarps + threadIdx.x / 32;
  const int64_t items = m * heads, stride = int64_t(gridDim.x) * kHeadWarps;
  for (int64_t item = warp; item < items; item += stride) {
    const int64_t r = item / heads, h = item % heads;
    const Lanes<T, V> xin = *reinterpret_cast<const Lanes<T, V>*>(x + r * ldx + h * kHeadDim + lane * V);
    const Lanes<T, V> gin = *reinterpret_cast<const Lanes<T, V>*>(dy + r * lddy + h * kHeadDim + lane * V);
    float xh[V], g[V], sq = 0.f;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      xh[e] = to_float(xin.v[e]);
      sq += xh[e] * xh[e];
    }
    const float rstd = rsqrtf(warp_sum(sq) / kHeadDim + eps);
    const float pos = float(positions[r]);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < V; e += 2) {
      float s, c;
      sincosf(pos * f[e / 2], &s, &c);
      const float d0 = to_float(gin.v[e]), d1 = to_float(gin.v[e + 1]);
      const float dn0 = d0 * c + d1 * s, dn1 = d1 * c - d0 * s;  // R(−φ)·dY
      xh[e] *= rstd;
      xh[e + 1] *= rstd;
      dw[e] += dn0 * xh[e];
      dw[e + 1] += dn1 * xh[e + 1];
      g[e] = dn0 * w[e];
      g[e + 1] = dn1 * w[e + 1];
      dot += g[e] * xh[e] + g[e + 1] * xh[e + 1];
    }
    dot = warp_sum(dot) / kHeadDim;
    Lanes<T, V> out;
#pragma unroll
    for (int e = 0; e < V; ++e) out.v[e] = from_float<T>(rstd * (g[e] - xh[e] * dot));
    *reinterpret_cast<Lanes<T, V>*>(dx + r * lddx + h * kHeadDim + lane * V) = out;
  }
  if (dweight_partials != nullptr) {
#pragma unroll
    for (int e = 0; e < V; ++e) dweight_partials[warp * kHeadDim + lane * V + e] = dw[e];
  }
}

template <class T, int V>
Status head_launch(const HeadNormRopeArgs& a, cudaStream_t stream) {
  head_norm_rope_kernel<T, V><<<head_blocks(a.m * a.heads), kHeadWarps * 32, 0, stream>>>(
      a.m, a.heads, static_cast<const T*>(a.x), a.ldx, static_cast<const T*>(a.weight), a.positions, a.inv_freq,
      a.eps, static_cast<T*>(a.y), a.ldy);
  return launched("head_norm_rope");
}

template <class T, int V>
Status head_launch(const HeadNormRopeBackwardArgs& a, cudaStream_t stream) {
  head_norm_rope_backward_kernel<T, V><<<head_blocks(a.m * a.heads), kHeadWarps * 32, 0, stream>>>(
      a.m, a.heads, static_cast<const T*>(a.dy), a.lddy, static_cast<const T*>(a.x), a.ldx,
      static_cast<const T*>(a.weight), a.positions, a.inv_freq, a.eps, static_cast<T*>(a.dx), a.lddx,
      a.dweight_partials);
  return launched("head_norm_rope_backward");
}

template <class T, class Args>
Status head_by_dim(const Args& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return head_launch<T, 2>(a, stream);
    case 128: return head_launch<T, 4>(a, stream);
    case 256: return head_launch<T, 8>(a, stream);
  }
  return detail::fail(Status::kInvalidArgument, "head_norm_rope: head_dim must be 64, 128 or 256");
}

template <class Args>
Status head_by_dtype(DType dtype, const Args& a, cudaStream_t stream) {
  if (dtype == DType::kBFloat16) return head_by_dim<__nv_bfloat16>(a, stream);
  if (dtype == DType::kFloat16) return head_by_dim<__half>(a, stream);
  return detail::fail(Status::kInvalidArgument, "head_norm_rope: dtype must be bfloat16 or float16");
}

}  // namespace

Status head_norm_rope(DType dtype, const HeadNormRopeArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  return head_by_dtype(dtype, a, stream);
}

Status head_norm_rope_backward(DType dtype, const HeadNormRopeBackwardArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  return head_by_dtype(dtype, a, stream);
}

// Every warp of the grid writes its row, those past the items a zero one.
int64_t head_norm_rope_partials(int64_t m, int64_t heads) {
  return m * heads > 0 ? int64_t(head_blocks(m * heads)) * kHeadWarps : 0;
}

Status rope_backward(DType dtype, const RopeBackwardArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  if (a.n % 2 != 0) return detail::fail(Status::kInvalidArgument, "rope_backward: n must be even (column pairs)");
  if (dtype == DType::kBFloat16) return launch<__nv_bfloat16>(a, stream);
  if (dtype == DType::kFloat16) return launch<__half>(a, stream);
  return detail::fail(Status::kInvalidArgument, "rope_backward: dtype must be bfloat16 or float16");
}

}  // namespace coda::kernels
