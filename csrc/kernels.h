// The kernel instantiations the library holds, declared without CUTLASS so
// that the dispatch code compiles in seconds. Each is defined in exactly one
// .cu under kernels/ (one CUTLASS instantiation per translation unit).
#pragma once

#include <cstddef>
#include <cstdint>

#include "coda/coda.h"

namespace coda::kernels {

// Tile / cluster / schedule choices. Which fits depends on the shape class:
// ping-pong overlaps one warp group's epilogue with the other's mainloop,
// which pays when the epilogue writes a lot (aux stores) relative to K.
enum class Config : int {
  kCooperative128x256 = 0,  // 128x256x64 tile, 2x1 cluster, cooperative
  kPingpong128x128 = 1,     // 128x128x64 tile, 1x2 cluster, ping-pong
};

// D = epilogue(A·B) in CUTLASS's (M, N, K) terms, with leading dimensions.
struct GemmProblem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  int raster = 0;   // 0 heuristic, 1 along M, 2 along N
  int swizzle = 1;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
};

struct LinearActEpilogue {
  const void* bias = nullptr;
  void* pre_act = nullptr;
  int64_t ld_pre_act = 0;
  int activation = 0;
  const void* residual = nullptr;
  int64_t ld_residual = 0;
};

struct DActDBiasEpilogue {
  const void* pre_act = nullptr;
  int64_t ld_pre_act = 0;
  int activation = 0;
  void* dbias = nullptr;
};

// out[j] = Σ_r partials[r * ld + j] for j < n, rounded to the dtype; on `stream`.
Status column_sum(DType dtype, const float* partials, int64_t rows, int64_t n, int64_t ld, void* out,
                  cudaStream_t stream);

// A (M, K) row-major · B given as (N, K) row-major: the forward, Y = X·Wᵀ.
template <DType T, Config C>
Status linear_act(const GemmProblem& p, const LinearActEpilogue& e);
template <DType T, Config C>
size_t linear_act_workspace(const GemmProblem& p);

// A (M, K) row-major · B (K, N) row-major: the dgrad, dX = dY·W.
template <DType T, Config C>
Status dact_dbias(const GemmProblem& p, const DActDBiasEpilogue& e);
template <DType T, Config C>
size_t dact_dbias_workspace(const GemmProblem& p);

// A given as (K, M) row-major · B (K, N) row-major: the wgrad, dW = dYᵀ·X.
template <DType T, Config C>
Status wgrad_store(const GemmProblem& p);
template <DType T, Config C>
size_t wgrad_store_workspace(const GemmProblem& p);

}  // namespace coda::kernels
