// The cross-entropy rows of the fused LM head + loss: per row of a chunk of
// logits (written by the LM-head GEMM), the log-sum-exp, the loss, and the
// gradient of the loss with respect to the logits, in place.
//
// Why in place: the chunk of logits is the largest tensor of a training step
// with a large vocabulary, and each element is read for the statistics, read
// again for its gradient and never needed after, so the gradient takes its
// storage; the two GEMMs after (dX = dZ·W, dW += dZᵀ·X) read it from there.
// Per row r, with z' = cap·tanh(z/cap) when softcapping (else z), ε the label
// smoothing, V the vocabulary and t the target:
//   lse  = log Σ_j exp(z'_j)                 (online max and sum, one read)
//   loss = (1−ε)(lse − z'_t) + ε(lse − Σ_j z'_j / V) + z_loss·lse²
//   dz_j = s_r·[p_j − (1−ε)·[j = t] − ε/V + 2·z_loss·lse·p_j]·(1 − tanh²)
// with p = softmax(z') and s_r the row's scale (the upstream gradient, over the
// valid rows for a mean). A row may be a slice of the vocabulary's columns:
// with `partial` the slice's (max, Σexp, z'_t, Σz') fold into the row's
// running ones and the last slice writes the loss and lse; given the rows'
// lse (lse_in), only dz is written. So a forward and a recomputing backward
// can go by the same slices: the same GEMMs, bit for bit the same logits
// (a logit recomputed by another GEMM may round to a neighbour, and at
// |z| ~ 100 one bf16 step moves exp(z − lse) by e²). Rows whose target is
// ignore_index get zero loss and zero gradient; a target outside [0, V) gets
// NaN in both, so that a bad label never trains silently (torch raises a
// device assert there).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "block_sum.cuh"
#include "error.h"
#include "half_types.cuh"
#include "kernels.h"

namespace coda::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kVec = 8;  // 16-bit elements per 16-byte access

// (max, Σ exp(z − max)) pairs combine exactly as log-sum-exps do.
struct Lse {
  float m, s;
};

__device__ inline Lse combine(Lse a, Lse b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ inline Lse warp_lse(Lse v) {
  for (int o = 16; o > 0; o >>= 1) {
    v = combine(v, {__shfl_xor_sync(0xffffffff, v.m, o), __shfl_xor_sync(0xffffffff, v.s, o)});
  }
  return v;
}

__device__ inline float capped(float z, float cap) { return cap > 0.f ? cap * tanhf(z / cap) : z; }

// d loss / d z over the row's n columns in place, from its lse; tc the
// target's column in the row (outside [0, n) when it lies in another slice).
template <class T>
__device__ void write_grad_row(const CrossEntropyArgs& a, T* row, float lse, int64_t tc, bool bad, int64_t r,
                               int64_t vocab) {
  const int64_t n = a.n, full = n / kVec * kVec;
  const float cap = a.softcap;
  float scale = (a.grad_scale != nullptr ? *a.grad_scale : 1.f) * (a.row_grad != nullptr ? a.row_grad[r] : 1.f);
  if (bad) scale = NAN;
  const float off = a.label_smoothing / float(vocab), hit = 1.f - a.label_smoothing, zl = 2.f * a.z_loss * lse;
  auto grad = [&](float raw, int64_t j) {
    const float z = capped(raw, cap);
    const float p = __expf(z - lse);
    float g = p * (1.f + zl) - off - (j == tc ? hit : 0.f);
    if (cap > 0.f) {
      const float th = z / cap;
      g *= 1.f - th * th;
    }
    return scale * g;
  };
  for (int64_t j = int64_t(threadIdx.x) * kVec; j < full; j += int64_t(kThreads) * kVec) {
    Chunk<T, kVec> v = *reinterpret_cast<const Chunk<T, kVec>*>(row + j);
#pragma unroll
    for (int e = 0; e < kVec; ++e) v.v[e] = from_float<T>(grad(to_float(v.v[e]), j + e));
    *reinterpret_cast<Chunk<T, kVec>*>(row + j) = v;
  }
  for (int64_t j = full + threadIdx.x; j < n; j += kThreads) row[j] = from_float<T>(grad(to_float(row[j]), j));
}

// One block per row (the rows loop for grids past 2^31 − 1 blocks). Rows are
// 16-byte aligned (ld a multiple of 8, base aligned: api.cpp checks), so the
// first n/8·8 columns go in 16-byte accesses and the tail one by one.
template <class T>
__global__ void __launch_bounds__(kThreads) cross_entropy_kernel(CrossEntropyArgs a) {
  __shared__ float sm[kThreads / 32], ss[kThreads / 32], sz[kThreads / 32];
  __shared__ float row_max, row_exp, row_sum;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n = a.n, full = n / kVec * kVec;
  const float cap = a.softcap, eps = a.label_smoothing;
  for (int64_t r = blockIdx.x; r < a.m; r += gridDim.x) {
    T* row = static_cast<T*>(a.logits) + r * a.ld;
    const int64_t t = a.target[r];
    if (t == a.ignore_index) {
      if (threadIdx.x == 0 && a.loss != nullptr && (a.partial == nullptr || a.last)) {
        a.loss[r] = 0.f;
        if (a.lse != nullptr) a.lse[r] = 0.f;
      }
      if (a.write_grad) {
        Chunk<T, kVec> zero;
#pragma unroll
        for (int e = 0; e < kVec; ++e) zero.v[e] = from_float<T>(0.f);
        for (int64_t j = int64_t(threadIdx.x) * kVec; j < full; j += int64_t(kThreads) * kVec) {
          *reinterpret_cast<Chunk<T, kVec>*>(row + j) = zero;
        }
        for (int64_t j = full + threadIdx.x; j < n; j += kThreads) row[j] = from_float<T>(0.f);
      }
      continue;
    }
    const int64_t vocab = a.vocab > 0 ? a.vocab : n, tc = t - a.col0;  // tc: the target's column here
    const bool bad = t < 0 || t >= vocab;
    if (a.lse_in != nullptr) {
      write_grad_row(a, row, a.lse_in[r], tc, bad, r, vocab);
      continue;  // nothing shared was written
    }
    // z'_t, read before any barrier: past the second one the row's other
    // threads overwrite it with its gradient.
    const float zt_here = threadIdx.x == 0 && !bad && tc >= 0 && tc < n ? capped(to_float(row[tc]), cap) : 0.f;
    // Pass 1: the row's log-sum-exp and Σ z'.
    Lse acc{-INFINITY, 0.f};
    float zsum = 0.f;
    for (int64_t j = int64_t(threadIdx.x) * kVec; j < full; j += int64_t(kThreads) * kVec) {
      const Chunk<T, kVec> v = *reinterpret_cast<const Chunk<T, kVec>*>(row + j);
      float z[kVec], mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        z[e] = capped(to_float(v.v[e]), cap);
        mx = fmaxf(mx, z[e]);
        zsum += z[e];
      }
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) s += __expf(z[e] - mx);
      acc = combine(acc, {mx, s});
    }
    for (int64_t j = full + threadIdx.x; j < n; j += kThreads) {
      const float z = capped(to_float(row[j]), cap);
      zsum += z;
      acc = combine(acc, {z, 1.f});
    }
    acc = warp_lse(acc);
    zsum = warp_sum(zsum);
    if (lane == 0) {
      sm[warp] = acc.m;
      ss[warp] = acc.s;
      sz[warp] = zsum;
    }
    __syncthreads();
    if (warp == 0) {
      Lse b = lane < kThreads / 32 ? Lse{sm[lane], ss[lane]} : Lse{-INFINITY, 0.f};
      float zs = lane < kThreads / 32 ? sz[lane] : 0.f;
      b = warp_lse(b);
      zs = warp_sum(zs);
      if (lane == 0) {
        row_max = b.m;
        row_exp = b.s;
        row_sum = zs;
      }
    }
    __syncthreads();
    const float lse = row_max + __logf(row_exp);
    if (threadIdx.x == 0) {
      float zt = zt_here, lse_all = lse, zsum_all = row_sum;
      if (a.partial != nullptr) {  // fold this slice into the row's running statistics
        float* st = a.partial + 4 * r;
        Lse run{a.first ? -INFINITY : st[0], a.first ? 0.f : st[1]};
        run = combine(run, {row_max, row_exp});
        zt += a.first ? 0.f : st[2];
        zsum_all += a.first ? 0.f : st[3];
        st[0] = run.m;
        st[1] = run.s;
        st[2] = zt;
        st[3] = zsum_all;
        lse_all = run.m + __logf(run.s);
      }
      if (a.partial == nullptr || a.last) {
        const float loss = (1.f - eps) * (lse_all - zt) + eps * (lse_all - zsum_all / float(vocab)) +
                           a.z_loss * lse_all * lse_all;
        a.loss[r] = bad ? NAN : loss;
        if (a.lse != nullptr) a.lse[r] = lse_all;
      }
    }
    // Pass 2: the gradient, in place (a whole row). Every thread read its own
    // elements in pass 1 only, and the block synchronized since.
    if (a.write_grad) write_grad_row(a, row, lse, tc, bad, r, vocab);
    __syncthreads();  // the shared row values are rewritten by the next row
  }
}

template <class T>
Status launch(const CrossEntropyArgs& a, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(a.m < 0x7fffffff ? a.m : 0x7fffffff);
  cross_entropy_kernel<T><<<grid, kThreads, 0, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return detail::fail(Status::kCudaError, std::string("cross_entropy launch: ") + cudaGetErrorString(e));
  }
  return Status::kSuccess;
}

// x ← x·s in float, s read on the device (the upstream gradient: no sync), each
// element rounded once; 16-byte accesses where x is aligned, the rest one by one.
template <class T>
__global__ void __launch_bounds__(kThreads) scale_kernel(T* x, int64_t n, const float* scale) {
  const float s = *scale;
  const int64_t stride = int64_t(gridDim.x) * kThreads, first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t full = aligned ? n / kVec : 0;
  for (int64_t i = first; i < full; i += stride) {
    Chunk<T, kVec> v = reinterpret_cast<const Chunk<T, kVec>*>(x)[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) v.v[k] = from_float<T>(to_float(v.v[k]) * s);
    reinterpret_cast<Chunk<T, kVec>*>(x)[i] = v;
  }
  for (int64_t i = full * kVec + first; i < n; i += stride) x[i] = from_float<T>(to_float(x[i]) * s);
}

template <class T>
Status launch_scale(void* x, int64_t n, const float* scale, cudaStream_t stream) {
  const int64_t blocks = (n / kVec + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 1 ? 1 : blocks < 65536 ? blocks : 65536);
  scale_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T*>(x), n, scale);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string("scale launch: ") + cudaGetErrorString(e));
  return Status::kSuccess;
}

// dst ← src·s rounded once from float: a float32 gradient scaled and cast in
// one pass (two passes, mul_ then to(), read the float32 twice and write it once).
template <class T>
__global__ void __launch_bounds__(kThreads) scale_round_kernel(const float* src, T* dst, int64_t n,
                                                               const float* scale) {
  const float s = scale != nullptr ? *scale : 1.f;
  const int64_t stride = int64_t(gridDim.x) * kThreads, first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 32 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const int64_t full = aligned ? n / kVec : 0;
  for (int64_t i = first; i < full; i += stride) {
    const float4 lo = reinterpret_cast<const float4*>(src)[2 * i], hi = reinterpret_cast<const float4*>(src)[2 * i + 1];
    const float f[kVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    Chunk<T, kVec> v;
#pragma unroll
    for (int k = 0; k < kVec; ++k) v.v[k] = from_float<T>(f[k] * s);
    reinterpret_cast<Chunk<T, kVec>*>(dst)[i] = v;
  }
  for (int64_t i = full * kVec + first; i < n; i += stride) dst[i] = from_float<T>(src[i] * s);
}

template <class T>
Status launch_scale_round(const float* src, void* dst, int64_t n, const float* scale, cudaStream_t stream) {
  const int64_t blocks = (n / kVec + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 1 ? 1 : blocks < 65536 ? blocks : 65536);
  scale_round_kernel<T><<<grid, kThreads, 0, stream>>>(src, static_cast<T*>(dst), n, scale);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return detail::fail(Status::kCudaError, std::string("scale_round launch: ") + cudaGetErrorString(e));
  }
  return Status::kSuccess;
}

// In place, the 16-bit result of element i lands on bytes [2i, 2i + 2) of the
// float32 buffer, which held element i/2: it must not be written before that
// element is read. The first kHead elements go by one block (all read, then
// all written); then launch k takes [S, 2S), S = kHead·2^k: it reads bytes
// [4S, 8S) and writes [2S, 4S), disjoint, over elements [S/2, S) that the
// launches before it consumed. About log2(n / kHead) launches, each element
// still read and written once.
constexpr int64_t kHead = 4096;

template <class T>
__global__ void __launch_bounds__(kThreads) narrow_head_kernel(float* buf, int64_t n, const float* scale) {
  const float s = scale != nullptr ? *scale : 1.f;
  float v[kHead / kThreads];
#pragma unroll
  for (int k = 0; k < kHead / kThreads; ++k) {
    const int64_t i = threadIdx.x + int64_t(k) * kThreads;
    v[k] = i < n ? buf[i] : 0.f;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kHead / kThreads; ++k) {
    const int64_t i = threadIdx.x + int64_t(k) * kThreads;
    if (i < n) reinterpret_cast<T*>(buf)[i] = from_float<T>(v[k] * s);
  }
}

template <class T>
Status narrow_in_place(float* buf, int64_t n, const float* scale, cudaStream_t stream) {
  narrow_head_kernel<T><<<1, kThreads, 0, stream>>>(buf, n < kHead ? n : kHead, scale);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return detail::fail(Status::kCudaError, std::string("scale_round launch: ") + cudaGetErrorString(e));
  }
  for (int64_t first = kHead; first < n; first *= 2) {
    const int64_t end = first * 2 < n ? first * 2 : n;
    Status st = launch_scale_round<T>(buf + first, reinterpret_cast<T*>(buf) + first, end - first, scale, stream);
    if (st != Status::kSuccess) return st;
  }
  return Status::kSuccess;
}

}  // namespace

Status scale_round(DType dtype, const float* src, void* dst, int64_t n, const float* scale, cudaStream_t stream) {
  if (n == 0) return Status::kSuccess;
  const bool in_place = static_cast<const void*>(src) == dst;
  float* buf = const_cast<float*>(src);
  if (dtype == DType::kBFloat16) {
    return in_place ? narrow_in_place<__nv_bfloat16>(buf, n, scale, stream)
                    : launch_scale_round<__nv_bfloat16>(src, dst, n, scale, stream);
  }
  if (dtype == DType::kFloat16) {
    return in_place ? narrow_in_place<__half>(buf, n, scale, stream)
                    : launch_scale_round<__half>(src, dst, n, scale, stream);
  }
  return detail::fail(Status::kInvalidArgument, "scale_round: dtype must be bfloat16 or float16");
}

Status scale(DType dtype, void* x, int64_t n, const float* scale, cudaStream_t stream) {
  if (n == 0) return Status::kSuccess;
  if (dtype == DType::kBFloat16) return launch_scale<__nv_bfloat16>(x, n, scale, stream);
  if (dtype == DType::kFloat16) return launch_scale<__half>(x, n, scale, stream);
  return detail::fail(Status::kInvalidArgument, "scale: dtype must be bfloat16 or float16");
}

Status cross_entropy(DType dtype, const CrossEntropyArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  if (dtype == DType::kBFloat16) return launch<__nv_bfloat16>(a, stream);
  if (dtype == DType::kFloat16) return launch<__half>(a, stream);
  return detail::fail(Status::kInvalidArgument, "cross_entropy: dtype must be bfloat16 or float16");
}

}  // namespace coda::kernels
