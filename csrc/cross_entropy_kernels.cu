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

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include <cooperative_groups.h>

#include "block_sum.cuh"
#include "error.h"
#include "half_types.cuh"
#include "kernels.h"
#include "small_kernels.cuh"

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

// Folds 8 logits into a thread's running (max, Σexp) and Σz'.
template <class T>
__device__ inline void fold_chunk(const Chunk<T, kVec>& v, float cap, Lse& acc, float& zsum) {
  float z[kVec], mx = -INFINITY;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    z[e] = capped(to_float(v.v[e]), cap);
    mx = fmaxf(mx, z[e]);
    zsum += z[e];
  }
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) sum += __expf(z[e] - mx);
  acc = combine(acc, {mx, sum});
}

// The block's (max, Σexp) and Σz' from every thread's, complete in warp 0's
// lane 0 (warps' values through the shared sm / ss / sz, which the caller
// may rewrite after its next __syncthreads).
__device__ inline void block_stats(Lse& acc, float& zsum, float* sm, float* ss, float* sz) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  acc = warp_lse(acc);
  zsum = warp_sum(zsum);
  if (lane == 0) {
    sm[warp] = acc.m;
    ss[warp] = acc.s;
    sz[warp] = zsum;
  }
  __syncthreads();
  if (warp == 0) {
    acc = warp_lse(lane < kThreads / 32 ? Lse{sm[lane], ss[lane]} : Lse{-INFINITY, 0.f});
    zsum = warp_sum(lane < kThreads / 32 ? sz[lane] : 0.f);
  }
}

// d loss / d z of one logit of row r, from the row's lse; tc the target's
// column in the row (outside [0, n) when it lies in another slice).
struct GradOf {
  float lse, cap, scale, off, hit, zl;
  int64_t tc;
  __device__ GradOf(const CrossEntropyArgs& a, float lse_, int64_t tc_, bool bad, int64_t r, int64_t vocab)
      : lse(lse_), cap(a.softcap), off(a.label_smoothing / float(vocab)), hit(1.f - a.label_smoothing),
        zl(2.f * a.z_loss * lse_), tc(tc_) {
    scale = (a.grad_scale != nullptr ? *a.grad_scale : 1.f) * (a.row_grad != nullptr ? a.row_grad[r] : 1.f);
    if (bad) scale = NAN;
  }
  __device__ float operator()(float raw, int64_t j) const {
    const float z = capped(raw, cap);
    const float p = __expf(z - lse);
    float g = p * (1.f + zl) - off - (j == tc ? hit : 0.f);
    if (cap > 0.f) {
      const float th = z / cap;
      g *= 1.f - th * th;
    }
    return scale * g;
  }
};

// d loss / d z over the row's n columns in place, from its lse.
template <class T>
__device__ void write_grad_row(const CrossEntropyArgs& a, T* row, float lse, int64_t tc, bool bad, int64_t r,
                               int64_t vocab) {
  const int64_t n = a.n, full = n / kVec * kVec;
  const GradOf grad(a, lse, tc, bad, r, vocab);
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
      fold_chunk(*reinterpret_cast<const Chunk<T, kVec>*>(row + j), cap, acc, zsum);
    }
    for (int64_t j = full + threadIdx.x; j < n; j += kThreads) {
      const float z = capped(to_float(row[j]), cap);
      zsum += z;
      acc = combine(acc, {z, 1.f});
    }
    block_stats(acc, zsum, sm, ss, sz);
    if (threadIdx.x == 0) {
      row_max = acc.m;
      row_exp = acc.s;
      row_sum = zsum;
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

// The one-read variant of the kernel above for its statistics-and-gradient
// pass (write_grad, no lse_in, no partial): there each logit is read for the
// statistics and read again for its gradient, and ~500 rows of 250 KB in
// flight (LLaMA 3's vocabulary) are more than the L2 holds, so the second
// read goes to memory. Here a cluster of `ranks` CTAs holds one row in their
// shared memory, a slice each (kSliceBytes at most, so two CTAs fit an SM),
// and combines the slices' statistics through distributed shared memory:
// each logit is read from memory once and written once. Slices are multiples
// of 8 elements; the row's tail (n % 8) is the last slice's. The clusters
// loop over the rows; every CTA of a cluster takes the same branches.
constexpr int64_t kSliceBytes = 100 << 10;
constexpr int kMaxRanks = 8;  // the portable cluster size

std::atomic<bool> one_read{false};
std::atomic<int64_t> one_read_launches{0};

template <class T>
__global__ void __launch_bounds__(kThreads) cross_entropy_one_read_kernel(CrossEntropyArgs a, int64_t slice) {
  extern __shared__ __align__(16) unsigned char slice_bytes[];
  T* buf = reinterpret_cast<T*>(slice_bytes);
  // per rank: (max, Σexp, Σz', z'_t) of its slice, by row parity: a rank
  // rewrites its parity-p values two rows on, past the next row's cluster
  // barrier, which every rank reaches only after reading them
  __shared__ float part[2][4];
  __shared__ float sm[kThreads / 32], ss[kThreads / 32], sz[kThreads / 32];
  __shared__ float row_stats[4];
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int ranks = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n = a.n, full = n / kVec * kVec;
  const int64_t c0 = rank * slice, c1 = c0 + slice < n ? c0 + slice : n;
  const int64_t v_end = c1 < full ? c1 : full;  // the slice's 16-byte chunks end here
  const float cap = a.softcap, eps = a.label_smoothing;
  const int64_t clusters = gridDim.x / ranks;
  int parity = 0;
  for (int64_t r = blockIdx.x / ranks; r < a.m; r += clusters) {
    T* row = static_cast<T*>(a.logits) + r * a.ld;
    const int64_t t = a.target[r];
    if (t == a.ignore_index) {
      if (rank == 0 && threadIdx.x == 0) {
        a.loss[r] = 0.f;
        if (a.lse != nullptr) a.lse[r] = 0.f;
      }
      Chunk<T, kVec> zero;
#pragma unroll
      for (int e = 0; e < kVec; ++e) zero.v[e] = from_float<T>(0.f);
      for (int64_t j = c0 + int64_t(threadIdx.x) * kVec; j < v_end; j += int64_t(kThreads) * kVec) {
        *reinterpret_cast<Chunk<T, kVec>*>(row + j) = zero;
      }
      for (int64_t j = (c0 > full ? c0 : full) + threadIdx.x; j < c1; j += kThreads) row[j] = from_float<T>(0.f);
      continue;
    }
    const int64_t vocab = a.vocab > 0 ? a.vocab : n;
    const bool bad = t < 0 || t >= vocab;
    // the slice into shared memory, and its statistics on the way (unrolled:
    // several 16-byte loads in flight per thread)
    Lse acc{-INFINITY, 0.f};
    float zsum = 0.f;
#pragma unroll 4
    for (int64_t j = c0 + int64_t(threadIdx.x) * kVec; j < v_end; j += int64_t(kThreads) * kVec) {
      const Chunk<T, kVec> v = *reinterpret_cast<const Chunk<T, kVec>*>(row + j);
      *reinterpret_cast<Chunk<T, kVec>*>(buf + (j - c0)) = v;
      fold_chunk(v, cap, acc, zsum);
    }
    for (int64_t j = (c0 > full ? c0 : full) + threadIdx.x; j < c1; j += kThreads) {
      const T v = row[j];
      buf[j - c0] = v;
      const float z = capped(to_float(v), cap);
      zsum += z;
      acc = combine(acc, {z, 1.f});
    }
    block_stats(acc, zsum, sm, ss, sz);
    if (threadIdx.x == 0) {
      part[parity][0] = acc.m;
      part[parity][1] = acc.s;
      part[parity][2] = zsum;
      part[parity][3] = !bad && t >= c0 && t < c1 ? capped(to_float(buf[t - c0]), cap) : 0.f;
    }
    cluster.sync();
    if (warp == 0) {  // every rank's slice statistics, one lane a rank
      Lse b{-INFINITY, 0.f};
      float zs = 0.f, zt = 0.f;
      if (lane < ranks) {
        const float* p = cluster.map_shared_rank(&part[parity][0], lane);
        b = {p[0], p[1]};
        zs = p[2];
        zt = p[3];
      }
      b = warp_lse(b);
      zs = warp_sum(zs);
      zt = warp_sum(zt);
      if (lane == 0) {
        row_stats[0] = b.m + __logf(b.s);
        row_stats[1] = zs;
        row_stats[2] = zt;
      }
    }
    __syncthreads();
    const float lse = row_stats[0];
    if (rank == 0 && threadIdx.x == 0) {
      const float loss = (1.f - eps) * (lse - row_stats[2]) + eps * (lse - row_stats[1] / float(vocab)) +
                         a.z_loss * lse * lse;
      a.loss[r] = bad ? NAN : loss;
      if (a.lse != nullptr) a.lse[r] = lse;
    }
    // the gradient, from shared memory (each thread its own elements)
    const GradOf grad(a, lse, t, bad, r, vocab);
    for (int64_t j = c0 + int64_t(threadIdx.x) * kVec; j < v_end; j += int64_t(kThreads) * kVec) {
      Chunk<T, kVec> v = *reinterpret_cast<const Chunk<T, kVec>*>(buf + (j - c0));
#pragma unroll
      for (int e = 0; e < kVec; ++e) v.v[e] = from_float<T>(grad(to_float(v.v[e]), j + e));
      *reinterpret_cast<Chunk<T, kVec>*>(row + j) = v;
    }
    for (int64_t j = (c0 > full ? c0 : full) + threadIdx.x; j < c1; j += kThreads) {
      row[j] = from_float<T>(grad(to_float(buf[j - c0]), j));
    }
    parity ^= 1;
    __syncthreads();  // sm / ss / sz and row_stats are rewritten by the next row
  }
  cluster.sync();  // no rank leaves while another may still read its part
}

// The ranks a row takes in the one-read kernel (0: its row does not fit in
// kMaxRanks slices), and the slice, a multiple of 8 elements.
template <class T>
std::pair<int, int64_t> one_read_split(int64_t n) {
  const int64_t per = kSliceBytes / int64_t(sizeof(T)) / kVec * kVec;
  const int64_t ranks = (n + per - 1) / per;
  if (ranks > kMaxRanks) return {0, 0};
  return {int(ranks), ((n + ranks - 1) / ranks + kVec - 1) / kVec * kVec};
}

template <class T>
Status launch_one_read(const CrossEntropyArgs& a, int ranks, int64_t slice, cudaStream_t stream) {
  const auto kernel = cross_entropy_one_read_kernel<T>;
  const size_t bytes = size_t(slice) * sizeof(T);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(ranks);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = bytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  // clusters that fit on the device at once: the grid, the rows looping over it; asked once per device and shape
  static std::mutex mutex;
  static std::map<std::tuple<int, int, size_t>, int> resident_of;
  int device = 0, resident = 0;
  if (e == cudaSuccess) e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    std::lock_guard<std::mutex> lock(mutex);
    const auto key = std::make_tuple(device, ranks, bytes);
    auto it = resident_of.find(key);
    if (it == resident_of.end()) {
      cfg.gridDim = dim3(unsigned(ranks));
      e = cudaOccupancyMaxActiveClusters(&resident, kernel, &cfg);
      if (e == cudaSuccess) resident_of[key] = resident;
    } else {
      resident = it->second;
    }
  }
  if (e != cudaSuccess) {
    return detail::fail(Status::kCudaError, std::string("cross_entropy (one read) setup: ") + cudaGetErrorString(e));
  }
  const int64_t clusters = std::max<int64_t>(1, std::min<int64_t>(a.m, resident));
  cfg.gridDim = dim3(unsigned(clusters * ranks));
  e = cudaLaunchKernelEx(&cfg, kernel, a, slice);
  if (e != cudaSuccess) {
    return detail::fail(Status::kCudaError, std::string("cross_entropy (one read) launch: ") + cudaGetErrorString(e));
  }
  one_read_launches.fetch_add(1, std::memory_order_relaxed);
  return Status::kSuccess;
}

template <class T>
Status launch(const CrossEntropyArgs& a, cudaStream_t stream) {
  if (one_read.load(std::memory_order_relaxed) && a.write_grad && a.lse_in == nullptr && a.partial == nullptr &&
      a.loss != nullptr) {
    const auto [ranks, slice] = one_read_split<T>(a.n);
    if (ranks > 0) return launch_one_read<T>(a, ranks, slice, stream);
  }
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
  return launched("scale_round");
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
  if (Status st = launched("scale_round"); st != Status::kSuccess) return st;
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
  return with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    return in_place ? narrow_in_place<T>(const_cast<float*>(src), n, scale, stream)
                    : launch_scale_round<T>(src, dst, n, scale, stream);
  });
}

Status scale(DType dtype, void* x, int64_t n, const float* scale, cudaStream_t stream) {
  if (n == 0) return Status::kSuccess;
  if (dtype == DType::kBFloat16) return launch_scale<__nv_bfloat16>(x, n, scale, stream);
  if (dtype == DType::kFloat16) return launch_scale<__half>(x, n, scale, stream);
  return detail::fail(Status::kInvalidArgument, "scale: dtype must be bfloat16 or float16");
}

void set_cross_entropy_one_read(bool on) { one_read.store(on, std::memory_order_relaxed); }
int64_t cross_entropy_one_read_launches() { return one_read_launches.load(std::memory_order_relaxed); }

Status cross_entropy(DType dtype, const CrossEntropyArgs& a, cudaStream_t stream) {
  if (a.m == 0) return Status::kSuccess;
  if (dtype == DType::kBFloat16) return launch<__nv_bfloat16>(a, stream);
  if (dtype == DType::kFloat16) return launch<__half>(a, stream);
  return detail::fail(Status::kInvalidArgument, "cross_entropy: dtype must be bfloat16 or float16");
}

}  // namespace coda::kernels
