// The small non-GEMM kernels of the norm fold: each is one pass over a
// vector-sized or weight-sized tensor, or over the rows of an activation only
// where no GEMM epilogue can do the work (the first layer's statistics; the
// backward of a lone norm-linear, whose output gradient comes from outside).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "activation.hpp"
#include "block_sum.cuh"
#include "error.h"
#include "half_types.cuh"
#include "kernels.h"
#include "small_kernels.cuh"

namespace coda::kernels {
namespace {

// 8 elements of a 16-bit type: one 16-byte access.
template <class T>
struct alignas(16) Vec8 {
  T v[8];
};

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n, int per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

// Merged in double: with |mean| = 10·std, Σy²/n − mean² cancels ~100x.
__global__ void row_partials_stats_kernel(const float* __restrict__ sum, const float* __restrict__ sumsq,
                                          int64_t tiles, int64_t ld, int64_t rows, int64_t n, float eps,
                                          float* __restrict__ mean, float* __restrict__ rstd) {
  int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  double s = 0.0, q = 0.0;
  for (int64_t t = 0; t < tiles; ++t) {
    if (sum != nullptr) s += sum[t * ld + r];
    q += sumsq[t * ld + r];
  }
  const double mu = sum != nullptr ? s / double(n) : 0.0;
  const double var = fmax(q / double(n) - mu * mu, 0.0);
  if (mean != nullptr) mean[r] = float(mu);
  rstd[r] = float(rsqrt(var + double(eps)));
}

// The weight fold and the row statistics give each row one warp, 4 rows a
// block: a whole row is in flight at once and its sums need no block
// barrier (faster than a 256-thread block per row: benchmarks/NOTES.md). Small blocks because the
// statistics hold a 4096-element row in up to 168 registers a lane (bf16):
// 12 warps fit an SM, three 4-warp blocks, where 8-warp blocks would fit one.
constexpr int kRowsPerBlock = 4;
constexpr int kRowThreads = kRowsPerBlock * 32;
constexpr int64_t kWarpStride = 32 * 8;  // elements a warp covers with one 16-byte access per lane

// W̃[n,:] = round(W[n,:] ⊙ γ), s[n] = Σ_k W̃[n,k] (of the rounded values, so
// mean·s cancels exactly what the GEMM multiplies), t[n] = Σ_k W[n,k]·β[k] + b[n].
template <class T>
__global__ void fold_norm_weight_kernel(const T* __restrict__ w, int64_t ldw, int64_t rows, int64_t k,
                                        const T* __restrict__ gamma, const T* __restrict__ beta,
                                        const T* __restrict__ bias, T* __restrict__ folded, int64_t ldf,
                                        float* __restrict__ col_sum, float* __restrict__ shift) {
  constexpr int kBatch = 4;  // 16-byte loads per lane issued before the first use
  const int64_t n = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (n >= rows) return;
  const T* row = w + n * ldw;
  float s = 0.f, t = 0.f;
  for (int64_t base = int64_t(threadIdx.x % 32) * 8; base < k; base += kBatch * kWarpStride) {
    Vec8<T> wv[kBatch], gv[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t j = base + b * kWarpStride;
      if (j < k) {
        wv[b] = *reinterpret_cast<const Vec8<T>*>(row + j);
        gv[b] = *reinterpret_cast<const Vec8<T>*>(gamma + j);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t j = base + b * kWarpStride;
      if (j >= k) continue;
      Vec8<T> out;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        out.v[i] = from_float<T>(to_float(wv[b].v[i]) * to_float(gv[b].v[i]));
        s += to_float(out.v[i]);
      }
      if (beta != nullptr) {
        const Vec8<T> bv = *reinterpret_cast<const Vec8<T>*>(beta + j);
#pragma unroll
        for (int i = 0; i < 8; ++i) t += to_float(wv[b].v[i]) * to_float(bv.v[i]);
      }
      if (folded != nullptr) *reinterpret_cast<Vec8<T>*>(folded + n * ldf + j) = out;
    }
  }
  s = warp_sum(s);
  t = warp_sum(t);
  if (threadIdx.x % 32 == 0) {
    if (col_sum != nullptr) col_sum[n] = s;
    if (shift != nullptr) shift[n] = t + (bias != nullptr ? to_float(bias[n]) : 0.f);
  }
}

// Mean (LayerNorm) and rstd of a row, two passes over it, so no E[x²] − mean²
// cancellation. Each lane keeps its first kCached 16-byte chunks in registers
// (rows up to 32·8·kCached = 4096 elements are read from memory once); the
// rest is read again, from L2.
template <class T>
__global__ void row_stats_kernel(const T* __restrict__ x, int64_t ldx, int64_t rows, int64_t n, bool layernorm,
                                 float eps, float* __restrict__ mean, float* __restrict__ rstd) {
  constexpr int kCached = 16;
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;
  const T* row = x + r * ldx;
  const int64_t first = int64_t(threadIdx.x % 32) * 8;
  Vec8<T> cached[kCached];
#pragma unroll
  for (int c = 0; c < kCached; ++c) {
    if (first + c * kWarpStride < n) cached[c] = *reinterpret_cast<const Vec8<T>*>(row + first + c * kWarpStride);
  }
  auto for_each = [&](auto&& fn) {
#pragma unroll
    for (int c = 0; c < kCached; ++c) {
      if (first + c * kWarpStride < n) {
#pragma unroll
        for (int i = 0; i < 8; ++i) fn(to_float(cached[c].v[i]));
      }
    }
    for (int64_t j = first + kCached * kWarpStride; j < n; j += kWarpStride) {
      Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(row + j);
#pragma unroll
      for (int i = 0; i < 8; ++i) fn(to_float(v.v[i]));
    }
  };
  float mu = 0.f;
  if (layernorm) {
    float s = 0.f;
    for_each([&](float v) { s += v; });
    mu = warp_sum(s) / float(n);
  }
  float q = 0.f;
  for_each([&](float v) { q += (v - mu) * (v - mu); });
  q = warp_sum(q);
  if (threadIdx.x % 32 == 0) {
    if (mean != nullptr) mean[r] = mu;
    rstd[r] = rsqrtf(q / float(n) + eps);
  }
}

// 8 consecutive floats (32-byte aligned: j is a multiple of 8) in two 16-byte loads.
__device__ void load8(const float* __restrict__ p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// The backward of a lone norm-linear, whose output gradient comes from
// outside: dP = dY ⊙ act'(H) (written when the activation is not identity),
// c₁ = scale·Σ_n dP ⊙ (H − t), c₂ = scale·Σ_n dP ⊙ s and, when wanted, the
// bias gradient Σ_m dP, in one read of dY and H. With identity, H is the
// output Y itself.
//
// 8 elements of it: returns the rounded dP and adds to the sums.
template <class T, epilogues::ActivationKind K>
__device__ Vec8<T> row_dots8(const Vec8<T>& g, const Vec8<T>& hv, const float (&tv)[8], const float (&sv)[8],
                             float& a1, float& a2, float (&db)[8]) {
  Vec8<T> out;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float hf = to_float(hv.v[e]);
    const float d = to_float(g.v[e]) * epilogues::detail::act_grad<K>(hf);
    out.v[e] = from_float<T>(d);
    // The GEMMs downstream read the rounded dP; reduce what they read.
    const float dr = K == epilogues::ActivationKind::kIdentity ? d : to_float(out.v[e]);
    a1 += dr * (hf - tv[e]);
    a2 += dr * sv[e];
    db[e] += dr;
  }
  return out;
}

// Without the bias gradient: one block per row, which streams whole rows
// (faster than the tiled kernel below when no column sums are needed).
template <class T, epilogues::ActivationKind K>
__global__ void norm_row_dots_kernel(const T* __restrict__ dy, int64_t lddy, const T* __restrict__ h, int64_t ldh,
                                     int64_t n, const float* __restrict__ shift, const float* __restrict__ col_sum,
                                     float scale, T* __restrict__ dp, int64_t lddp, float* __restrict__ c1,
                                     float* __restrict__ c2) {
  __shared__ float shared[kThreads / 32];
  const int64_t r = blockIdx.x;
  float a1 = 0.f, a2 = 0.f, unused[8] = {};
  for (int64_t j = int64_t(threadIdx.x) * 8; j < n; j += int64_t(kThreads) * 8) {
    const Vec8<T> g = *reinterpret_cast<const Vec8<T>*>(dy + r * lddy + j);
    const Vec8<T> hv = *reinterpret_cast<const Vec8<T>*>(h + r * ldh + j);
    float tv[8] = {}, sv[8] = {};
    if (shift != nullptr) load8(shift + j, tv);
    if (col_sum != nullptr) load8(col_sum + j, sv);
    const Vec8<T> out = row_dots8<T, K>(g, hv, tv, sv, a1, a2, unused);
    if (K != epilogues::ActivationKind::kIdentity) *reinterpret_cast<Vec8<T>*>(dp + r * lddp + j) = out;
  }
  if (c1 == nullptr) return;  // block-uniform
  a1 = block_sum<kThreads>(a1, shared);
  a2 = block_sum<kThreads>(a2, shared);
  if (threadIdx.x == 0) {
    c1[r] = scale * a1;
    if (c2 != nullptr) c2[r] = scale * a2;
  }
}

// With the bias gradient, which needs column sums too: a block covers
// kDotsRows rows × kDotsCols columns, a warp every 8th row, a lane kDotsVecs
// vectors of 8 columns 256 apart (512 contiguous bytes per warp access).
// Row sums are warp shuffles into per-(chunk, row) partials, column sums a
// pass over shared memory into per-(strip, column) partials: one pass, where
// the per-row kernel and a separate column sum read dY twice.
constexpr int kDotsVecs = 4;
constexpr int kDotsCols = 32 * 8 * kDotsVecs;
constexpr int kDotsRows = 64;
constexpr int kDotsWarps = kThreads / 32;

template <class T, epilogues::ActivationKind K>
__global__ void __launch_bounds__(kThreads, 2) norm_row_dots_bias_kernel(
    const T* __restrict__ dy, int64_t lddy, const T* __restrict__ h, int64_t ldh, int64_t m, int64_t n,
    const float* __restrict__ shift, const float* __restrict__ col_sum, T* __restrict__ dp, int64_t lddp,
    float* __restrict__ c1_partials, float* __restrict__ c2_partials, float* __restrict__ dbias_partials) {
  __shared__ float columns[kDotsWarps][kDotsCols];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t col0 = int64_t(blockIdx.x) * kDotsCols + lane * 8;
  const int64_t strips = (m + kDotsRows - 1) / kDotsRows;
  // grid.y is at most 65535 strips of 64 rows: larger problems loop.
  for (int64_t strip = blockIdx.y; strip < strips; strip += gridDim.y) {
    const int64_t row0 = strip * kDotsRows;
    float db[kDotsVecs][8] = {};
    for (int i = 0; i < kDotsRows / kDotsWarps; ++i) {
      const int64_t r = row0 + warp + int64_t(i) * kDotsWarps;
      if (r >= m) break;  // warp-uniform
      Vec8<T> g[kDotsVecs], hv[kDotsVecs] = {};
#pragma unroll
      for (int q = 0; q < kDotsVecs; ++q) {  // all loads of the row first
        const int64_t j = col0 + q * 256;
        if (j < n) {  // n is a multiple of 8
          g[q] = *reinterpret_cast<const Vec8<T>*>(dy + r * lddy + j);
          if (h != nullptr) hv[q] = *reinterpret_cast<const Vec8<T>*>(h + r * ldh + j);
        }
      }
      float a1 = 0.f, a2 = 0.f;
#pragma unroll
      for (int q = 0; q < kDotsVecs; ++q) {
        const int64_t j = col0 + q * 256;
        if (j >= n) continue;
        float tv[8] = {}, sv[8] = {};
        if (shift != nullptr) load8(shift + j, tv);  // L1-resident: every row reads them
        if (c2_partials != nullptr) load8(col_sum + j, sv);
        const Vec8<T> out = row_dots8<T, K>(g[q], hv[q], tv, sv, a1, a2, db[q]);
        if (K != epilogues::ActivationKind::kIdentity) *reinterpret_cast<Vec8<T>*>(dp + r * lddp + j) = out;
      }
      if (c1_partials != nullptr) {
        a1 = warp_sum(a1);
        a2 = warp_sum(a2);
        if (lane == 0) {
          c1_partials[int64_t(blockIdx.x) * m + r] = a1;
          if (c2_partials != nullptr) c2_partials[int64_t(blockIdx.x) * m + r] = a2;
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kDotsVecs; ++q) {
#pragma unroll
      for (int e = 0; e < 8; ++e) columns[warp][q * 256 + lane * 8 + e] = db[q][e];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < kDotsCols; c += kThreads) {
      const int64_t col = int64_t(blockIdx.x) * kDotsCols + c;
      if (col >= n) break;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kDotsWarps; ++w) sum += columns[w][c];
      dbias_partials[strip * n + col] = sum;
    }
    __syncthreads();  // `columns` is rewritten by the next strip
  }
}

// ---- Gemma's sandwich norms: Y = R + γ ⊙ X·rstd (RmsNormResidualArgs), a warp per row

constexpr int kResidualMaxBlocks = 1024;  // the backward's dγ partial rows, at most (the forward: a warp per row)

unsigned residual_blocks(int64_t m) {
  const int64_t b = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  return static_cast<unsigned>(b < kResidualMaxBlocks ? b : kResidualMaxBlocks);
}

template <class T>
__device__ void load_gamma8(const T* __restrict__ w, int64_t j, bool zero_centered, float (&g)[8]) {
  const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(w + j);
#pragma unroll
  for (int i = 0; i < 8; ++i) g[i] = to_float(v.v[i]) + (zero_centered ? 1.f : 0.f);
}

template <class T>
__global__ void rmsnorm_residual_kernel(int64_t m, int64_t n, const T* __restrict__ x, int64_t ldx,
                                        const T* __restrict__ weight, bool zero_centered, float eps,
                                        const T* __restrict__ residual, int64_t ldr, T* __restrict__ y, int64_t ldy,
                                        float* __restrict__ rstd_out) {
  const int64_t first = int64_t(threadIdx.x % 32) * 8;
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; r < m;
       r += int64_t(gridDim.x) * kRowsPerBlock) {
    const T* row = x + r * ldx;
    float q = 0.f;
    for (int64_t j = first; j < n; j += kWarpStride) {
      const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(row + j);
#pragma unroll
      for (int i = 0; i < 8; ++i) q += to_float(v.v[i]) * to_float(v.v[i]);
    }
    const float rstd = rsqrtf(warp_sum(q) / float(n) + eps);
    if (threadIdx.x % 32 == 0) rstd_out[r] = rstd;
    for (int64_t j = first; j < n; j += kWarpStride) {
      const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(row + j);  // again, from L1 / L2
      const Vec8<T> res = *reinterpret_cast<const Vec8<T>*>(residual + r * ldr + j);
      float g[8];
      load_gamma8(weight, j, zero_centered, g);
      Vec8<T> out;
#pragma unroll
      for (int i = 0; i < 8; ++i) out.v[i] = from_float<T>(to_float(res.v[i]) + g[i] * (to_float(v.v[i]) * rstd));
      *reinterpret_cast<Vec8<T>*>(y + r * ldy + j) = out;
    }
  }
}

// dγ accumulates in shared memory (n floats, shared atomics across the block's warps), one partial
// row per block.
template <class T>
__global__ void rmsnorm_residual_backward_kernel(int64_t m, int64_t n, const T* __restrict__ dy, int64_t lddy,
                                                 const T* __restrict__ x, int64_t ldx, const T* __restrict__ weight,
                                                 bool zero_centered, const float* __restrict__ rstd_in,
                                                 T* __restrict__ dx, int64_t lddx, float* __restrict__ partials) {
  extern __shared__ float dgamma[];
  const bool want_dgamma = partials != nullptr;  // grid-uniform
  if (want_dgamma) {
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dgamma[j] = 0.f;
    __syncthreads();
  }
  const int64_t first = int64_t(threadIdx.x % 32) * 8;
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; r < m;
       r += int64_t(gridDim.x) * kRowsPerBlock) {
    const T* xr = x + r * ldx;
    const T* gr = dy + r * lddy;
    const float rstd = rstd_in[r];
    float dot = 0.f;  // Σ g ⊙ x̂
    for (int64_t j = first; j < n; j += kWarpStride) {
      const Vec8<T> xv = *reinterpret_cast<const Vec8<T>*>(xr + j);
      const Vec8<T> dv = *reinterpret_cast<const Vec8<T>*>(gr + j);
      float g[8];
      load_gamma8(weight, j, zero_centered, g);
#pragma unroll
      for (int i = 0; i < 8; ++i) dot += to_float(dv.v[i]) * g[i] * (to_float(xv.v[i]) * rstd);
    }
    const float mean_dot = warp_sum(dot) / float(n);
    for (int64_t j = first; j < n; j += kWarpStride) {
      const Vec8<T> xv = *reinterpret_cast<const Vec8<T>*>(xr + j);
      const Vec8<T> dv = *reinterpret_cast<const Vec8<T>*>(gr + j);
      float g[8];
      load_gamma8(weight, j, zero_centered, g);
      Vec8<T> out;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float xh = to_float(xv.v[i]) * rstd, d = to_float(dv.v[i]);
        out.v[i] = from_float<T>(rstd * (d * g[i] - xh * mean_dot));
        if (want_dgamma) atomicAdd(&dgamma[j + i], d * xh);
      }
      *reinterpret_cast<Vec8<T>*>(dx + r * lddx + j) = out;
    }
  }
  if (want_dgamma) {
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) partials[int64_t(blockIdx.x) * n + j] = dgamma[j];
  }
}

}  // namespace

Status row_partials_stats(const float* sum, const float* sumsq, int64_t tiles, int64_t ld, int64_t rows, int64_t n,
                          float eps, float* mean, float* rstd, cudaStream_t stream) {
  if (rows == 0) return Status::kSuccess;
  row_partials_stats_kernel<<<blocks_for(rows, kThreads), kThreads, 0, stream>>>(sum, sumsq, tiles, ld, rows, n, eps,
                                                                                 mean, rstd);
  return launched("row_partials_stats");
}

Status fold_norm_weight(DType dtype, const FoldNormWeightArgs& a, cudaStream_t stream) {
  if (a.n == 0) return Status::kSuccess;
  return with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    fold_norm_weight_kernel<T><<<blocks_for(a.n, kRowsPerBlock), kRowThreads, 0, stream>>>(
        static_cast<const T*>(a.weight), a.ldw, a.n, a.k, static_cast<const T*>(a.gamma), static_cast<const T*>(a.beta),
        static_cast<const T*>(a.bias), static_cast<T*>(a.folded), a.ld_folded, a.col_sum, a.shift);
    return launched("fold_norm_weight");
  });
}

Status row_stats(DType dtype, const RowStatsArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  return with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    row_stats_kernel<T><<<blocks_for(a.m, kRowsPerBlock), kRowThreads, 0, stream>>>(
        static_cast<const T*>(a.x), a.ldx, a.m, a.n, a.layernorm, a.eps, a.mean, a.rstd);
    return launched("row_stats");
  });
}

int64_t rmsnorm_residual_partials(int64_t m) { return m > 0 ? int64_t(residual_blocks(m)) : 0; }

Status rmsnorm_residual(DType dtype, const RmsNormResidualArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  return with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t blocks = (a.m + kRowsPerBlock - 1) / kRowsPerBlock;
    rmsnorm_residual_kernel<T><<<static_cast<unsigned>(blocks < (1 << 30) ? blocks : (1 << 30)), kRowThreads, 0,
                                 stream>>>(
        a.m, a.n, static_cast<const T*>(a.x), a.ldx, static_cast<const T*>(a.weight), a.zero_centered, a.eps,
        static_cast<const T*>(a.residual), a.ld_residual, static_cast<T*>(a.y), a.ldy, a.rstd);
    return launched("rmsnorm_residual");
  });
}

Status rmsnorm_residual_backward(DType dtype, const RmsNormResidualBackwardArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  const size_t smem = a.dweight_partials != nullptr ? sizeof(float) * size_t(a.n) : 0;
  return with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (smem > 48 * 1024) {
      cudaError_t e = cudaFuncSetAttribute(rmsnorm_residual_backward_kernel<T>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (e != cudaSuccess) {
        return detail::fail(Status::kNotSupported, std::string("rmsnorm_residual_backward: rows of ") +
                                                       std::to_string(a.n) + " need " + std::to_string(smem) +
                                                       " bytes of shared memory: " + cudaGetErrorString(e));
      }
    }
    rmsnorm_residual_backward_kernel<T><<<residual_blocks(a.m), kRowThreads, smem, stream>>>(
        a.m, a.n, static_cast<const T*>(a.dy), a.lddy, static_cast<const T*>(a.x), a.ldx,
        static_cast<const T*>(a.weight), a.zero_centered, a.rstd, static_cast<T*>(a.dx), a.lddx, a.dweight_partials);
    return launched("rmsnorm_residual_backward");
  });
}

namespace {
struct RowDotsScratch {
  int64_t chunks, strips;
  size_t c1_bytes, c2_bytes, dbias_bytes;
  size_t total() const { return c1_bytes + c2_bytes + dbias_bytes; }
};

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Only the bias kernel needs partials.
RowDotsScratch row_dots_scratch(const NormRowDotsArgs& a) {
  RowDotsScratch s{};
  if (a.dbias == nullptr) return s;
  s.chunks = (a.n + kDotsCols - 1) / kDotsCols;
  s.strips = (a.m + kDotsRows - 1) / kDotsRows;
  s.c1_bytes = a.c1 != nullptr ? align256(sizeof(float) * s.chunks * a.m) : 0;
  s.c2_bytes = a.c2 != nullptr ? s.c1_bytes : 0;
  s.dbias_bytes = align256(sizeof(float) * s.strips * a.n);
  return s;
}
}  // namespace

size_t norm_row_dots_scratch_bytes(const NormRowDotsArgs& a) { return row_dots_scratch(a).total(); }

Status norm_row_dots(DType dtype, const NormRowDotsArgs& a, void* scratch, cudaStream_t stream) {
  if (a.m == 0) {
    if (a.dbias == nullptr) return Status::kSuccess;
    cudaError_t e = cudaMemsetAsync(a.dbias, 0, a.n * 2, stream);
    return e == cudaSuccess ? Status::kSuccess : detail::fail(Status::kCudaError, cudaGetErrorString(e));
  }
  const RowDotsScratch s = row_dots_scratch(a);
  char* base = static_cast<char*>(scratch);
  float* c1p = a.c1 != nullptr ? reinterpret_cast<float*>(base) : nullptr;
  float* c2p = a.c2 != nullptr ? reinterpret_cast<float*>(base + s.c1_bytes) : nullptr;
  float* dbp = reinterpret_cast<float*>(base + s.c1_bytes + s.c2_bytes);
  Status st = with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto k) {
      constexpr auto K = decltype(k)::value;
      const T* dy = static_cast<const T*>(a.dy);
      const T* h = static_cast<const T*>(a.pre_act);
      T* dp = static_cast<T*>(a.dp);
      if (a.dbias == nullptr) {
        if (K == epilogues::ActivationKind::kIdentity && a.c1 == nullptr) return Status::kSuccess;  // dP is dY
        norm_row_dots_kernel<T, K><<<static_cast<unsigned>(a.m), kThreads, 0, stream>>>(
            dy, a.lddy, h, a.ld_pre_act, a.n, a.shift, a.col_sum, a.scale, dp, a.lddp, a.c1, a.c2);
      } else {
        dim3 grid(static_cast<unsigned>(s.chunks), static_cast<unsigned>(s.strips < 65535 ? s.strips : 65535));
        norm_row_dots_bias_kernel<T, K><<<grid, kThreads, 0, stream>>>(dy, a.lddy, h, a.ld_pre_act, a.m, a.n, a.shift,
                                                                      a.col_sum, dp, a.lddp, c1p, c2p, dbp);
      }
      return launched("norm_row_dots");
    };
    using K = epilogues::ActivationKind;
    switch (static_cast<K>(a.activation)) {
      case K::kGeluTanh: return launch(std::integral_constant<K, K::kGeluTanh>{});
      case K::kGeluErf: return launch(std::integral_constant<K, K::kGeluErf>{});
      case K::kReLU: return launch(std::integral_constant<K, K::kReLU>{});
      case K::kSiLU: return launch(std::integral_constant<K, K::kSiLU>{});
      default: return launch(std::integral_constant<K, K::kIdentity>{});
    }
  });
  if (a.dbias == nullptr || st != Status::kSuccess) return st;
  PartialSums m;
  m.rows = a.m; m.row_tiles = s.chunks; m.row_ld = a.m; m.row_scale = a.scale;
  m.row_partials[0] = c1p; m.row_out[0] = a.c1;
  m.row_partials[1] = c2p; m.row_out[1] = a.c2;
  m.cols = a.n; m.col_tiles = s.strips; m.col_ld = a.n;
  m.col_partials[0] = dbp; m.col_out[0] = a.dbias;
  return merge_partials(dtype, m, stream);
}

}  // namespace coda::kernels
