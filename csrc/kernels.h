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
// cuBLAS (CUDA 13.0, H200, the da83443 run's profile) runs these shapes with
// nvjet kernels of 192x192 tiles (the N-large forward, fc2's dgrad) and
// 320x128 tiles (the rest), "coopB": neither splits its two warp groups
// along M as CUTLASS's cooperative builder does (13 and 14 below split them
// along N, and lose).
enum class Config : int {
  kCooperative128x256 = 0,  // 128x256x64 tile, 2x1 cluster, cooperative
  kPingpong128x128 = 1,     // 128x128x64 tile, 1x2 cluster, ping-pong
  // Candidates that only a sweep build holds (-DCODA_SWEEP_CONFIGS=ON), for
  // the measurements that decide which configurations the library ships.
  // 2 asked whether the last wave's idle SMs cost time: four of the MLP's
  // six GEMMs run 2048 tiles of 128x256 on 132 SMs, 15.5 waves, and fc2's
  // dgrad 62.06. CUTLASS's heuristic decomposition is data-parallel wherever
  // the last wave is at least half full (so the ab7e44d sweep timed 0's
  // schedule there); built with stream-K always (gemm.cuh), the tiles past
  // the last full wave but one were shared along K by every CTA. It lost
  // everywhere (10b2e8a run, paired with cuBLAS, raster 1 / 2): fc1's dgrad
  // 1.036 / 1.015 against 0.998 / 0.969, fc2's wgrad 1.022 / 1.023 against
  // 0.979 / 0.993, fc1's wgrad 1.013 / 1.021 against 0.980 / 0.988, fc2's
  // dgrad with GELU' and db1 1.058 / 1.077 against 1.063 / 1.040; the MLP
  // forward + backward 20.67 against 19.86 ms interleaved, 20.58 against
  // 20.23 steady. At the power cap a half-empty last wave costs no time:
  // the clock makes up for it, and the split tiles' fixup is extra work.
  // The GPU tests passed on it (189). No longer built.
  kCooperativeStreamK128x256 = 2,  // as 0, with CUTLASS's stream-K scheduler, stream-K decomposition
  kCooperative128x256Cluster1 = 3,  // as 0, 1x1 cluster
  kCooperative256x128 = 4,          // 256x128x64 tile, 1x2 cluster, cooperative
  kPingpong128x128Cluster2x1 = 5,   // as 1, 2x1 cluster
  // A 192-column tile (quack's default on sm_90): 1.5x the MMA work per
  // epilogue of 128x128, and a 192-register accumulator per warp group,
  // which ping-pong still holds (with ~100 bytes of epilogue spills). The
  // 870930a sweep, paired with cuBLAS: 6 matched 1 on the fc1 forward
  // (1.04x) and lost 5-25% elsewhere; 7 and 8 (3 mainloop stages) lost
  // everywhere. None is shipped.
  kPingpong128x192Cluster2x1 = 6,   // 128x192x64 tile, 2x1 cluster, ping-pong
  kPingpong128x192 = 7,             // 128x192x64 tile, 1x2 cluster, ping-pong
  kCooperative256x192 = 8,          // 256x192x64 tile, 2x1 cluster, cooperative
  // Every smem byte an epilogue holds comes out of the mainloop's stages
  // (StageCountAutoCarveout), and an instantiation holds buffers for every
  // node of its program, null at run time or not: with 128x32 subtiles the
  // cooperative 128x256 linear_act (H store, residual load, D) and norm_dgrad
  // epilogues take ~50 and ~66 KB and leave 3 mainloop stages of 48 KB where
  // a plain GEMM gets 4. 128x16 subtiles halve those buffers (4 stages) at
  // twice the subtiles (Sm90RowReduction's smem needs 128x32: not for
  // dgrads); one buffer per tensor does too, at a wait for each subtile's
  // stores; 64x64 subtiles halve ping-pong's subtile count. 256x128 with a
  // 2x1 cluster is the cooperative tile quack once defaulted to on sm_90.
  // Paired with cuBLAS, over the da83443 and 41ee1be runs: 12 against 0 on
  // fc2's forward with the residual 0.998x against 1.004x (mean of 12
  // rounds each: noise), on o-proj's 1.067x against 1.044x, on the norm's
  // dgrad 1.05-1.07x against 1.03-1.05x. 9, 10 and 11 lost or tied
  // everywhere. The fourth stage does not pay for what it costs the
  // epilogue; none ships.
  kCooperative256x128Cluster2x1 = 9,  // 256x128x64 tile, 2x1 cluster, cooperative
  kCooperative128x256Epi16 = 10,      // as 0, 128x16 epilogue subtiles
  kPingpong128x128Epi64 = 11,         // as 1, 64x64 epilogue subtiles
  kCooperative128x256Epi1Stage = 12,  // as 0, one smem buffer per epilogue tensor
  // The tiles of cuBLAS's nvjet kernels on these shapes, with the two warp
  // groups splitting N (gemm.cuh, CooperativeSplitNTile): 192x192 with a 2x1
  // cluster (fc1's and QKV's forward, fc2's dgrad) and 320x128 with a 1x2
  // cluster (the rest). Full-width 64-row epilogue subtiles, one buffer each.
  // They pass every GPU test, and lose everywhere (the ec92be5 sweep, paired
  // with cuBLAS): 13 1.18-1.33x, 14 1.08-1.26x (1.24x on a wgrad, whose
  // epilogue only stores D), where the shipped kernels ran 1.00-1.08x. Each
  // warp group's wgmma is half as wide (64x96, 64x64 atoms), reading more
  // smem per MAC, and the 320-row tile leaves 3 mainloop stages. Whatever
  // cuBLAS's "coopB" does, this is not it.
  kSplitN192x192 = 13,  // 192x192x64 tile, 2x1 cluster, cooperative split along N
  kSplitN320x128 = 14,  // 320x128x64 tile, 1x2 cluster, cooperative split along N
  // Ping-pong's epilogue aux tensors (H, the residual) moved between
  // registers and global memory, no smem (PingpongTile in gemm.cuh): tied
  // with 1 where the epilogue loads nothing, lost where it loads.
  kPingpong128x128DirectAux = 15,  // as 1, aux loads and stores without smem
  // 16 was 0 with the epilogue's loads 3 stages deep and D through one
  // buffer (the same smem), asking whether fc2's dgrad epilogue (1.08-1.10x
  // cuBLAS's cycles at a higher clock) waits on its H loads. It lost: 1.114x
  // the cycles with GELU' and db1 where 0 took 1.078x, 1.043x plain against
  // 1.015x (a7c6072 power probe; the GPU tests passed on it). Removed with
  // the recipe parameters it needed (commit a7c6072 has them).
  // 17 was 0 with the epilogue's loads 4 deep and D's two buffers kept (3
  // mainloop stages), asking again whether the ~70 us fc2's dgrad waits on
  // its H loads (73a9d7a profile) is the buffers' depth. It is not: with
  // GELU' and db1 3.536 ms against 3.536 for 0 (c2bc99a run, interleaved;
  // loading H with db1 only 3.444 against 3.461); the third mainloop stage
  // dropped cost the plain dgrad nothing (3.347 against 3.352). Removed
  // after that run (commit c2bc99a has it).
  // 18 and 19 were 1 with a 2x2 cluster (both operands multicast) and with
  // none, asking whether fc1's forward spends more energy per MAC than
  // cuBLAS's kernel because its 128x128 tiles pull ~26 GB a launch through
  // L2 (cuBLAS's 192x192: ~17). Neither helped. The 2x2 cluster moved 20.7
  // GB, not half, and spent 1.073 of cuBLAS's energy plain, at 1.075x the
  // cycles; 2x1 (5) spent 1.031 and the shipped 1x2 1.001 in the same run
  // (d38d046 power probe). No cluster spent 1.011 against 1.004 (bba157b).
  // The GPU tests passed forced onto each; both were removed after their runs.
  // 20 was fc1's ping-pong forward with each warp group's tile 64x256 (one
  // m64n256 wgmma per k-step, where 128x128 issues two m64n128 that read B
  // twice): 17% fewer smem bytes per MAC at the same L2 bytes, with a 2x1
  // cluster multicasting B, run along N so that B is the streamed operand
  // (as A is for the shipped 1x2 cluster along M). It asked whether smem
  // traffic is what costs the shipped kernel energy. It is not: 1.039 of
  // cuBLAS's energy plain against 1.005, 1.058 storing H against 1.019, at
  // 2% more cycles (51bc3aa power probe); the GPU tests passed forced onto
  // it (189). Removed after that run (commit 51bc3aa has it).
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
  int alternate_k = 0;  // 1: each CTA's odd-numbered tiles load their k-blocks last to first (gemm.cuh)
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

// The epilogues of the norm-folding ops (cutlass_epilogues/norm_*.hpp,
// linear_residual_stats.hpp, dact_dbias_rowdot.hpp). Vectors named mean, rstd,
// c1, c2 are per row (fp32); col_sum (s) and shift (t) per column (fp32);
// gamma/beta, bias and dgamma/dbeta/dbias are in the GEMM's dtype.
struct NormLinearEpilogue {
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const float* col_sum = nullptr;
  const float* shift = nullptr;
  void* pre_act = nullptr;
  int64_t ld_pre_act = 0;
  int activation = 0;
};

struct LinearResidualStatsEpilogue {
  const void* bias = nullptr;
  const void* residual = nullptr;
  int64_t ld_residual = 0;
  bool layernorm = true;  // false: RMSNorm (mean not computed)
  float eps = 1e-5f;
  float* mean = nullptr;  // (M) out, or null
  float* rstd = nullptr;  // (M) out
};

struct DActRowDotEpilogue {
  const void* pre_act = nullptr;
  int64_t ld_pre_act = 0;
  int activation = 0;
  void* dbias = nullptr;
  const float* shift = nullptr;
  const float* col_sum = nullptr;
  float scale = 1.f;      // 1/d of the norm the row dots are for
  float* c1 = nullptr;    // (M) out: scale · Σ_n dH ⊙ (H − shift)
  float* c2 = nullptr;    // (M) out: scale · Σ_n dH ⊙ col_sum, or null
};

struct NormDgradEpilogue {
  const void* x = nullptr;
  int64_t ld_x = 0;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const void* gamma = nullptr;
  const void* beta = nullptr;
  const float* c1 = nullptr;
  const float* c2 = nullptr;
  const void* residual_grad = nullptr;
  int64_t ld_residual_grad = 0;
  void* normalized = nullptr;
  int64_t ld_normalized = 0;
  void* dgamma = nullptr;
  void* dbeta = nullptr;
};

// ---- small non-GEMM kernels (csrc/column_sum.cu, csrc/norm_kernels.cu)

// out[j] = Σ_r partials[r * ld + j] for j < n, rounded to the dtype; on `stream`.
Status column_sum(DType dtype, const float* partials, int64_t rows, int64_t n, int64_t ld, void* out,
                  cudaStream_t stream);

// Per-row partials (tile t of row r at partials[t * ld + r]) merged:
// out[r] = scale · Σ_t partials[t * ld + r].
Status row_partials_sum(const float* partials, int64_t tiles, int64_t ld, int64_t rows, float scale, float* out,
                        cudaStream_t stream);
// mean and rstd of rows of length n from per-row partials of Σy (null for
// RMSNorm: mean is not written) and Σy².
Status row_partials_stats(const float* sum, const float* sumsq, int64_t tiles, int64_t ld, int64_t rows, int64_t n,
                          float eps, float* mean, float* rstd, cudaStream_t stream);

// The bodies of the public coda::fold_norm_weight, row_stats, norm_row_dots
// (arguments already checked).
Status fold_norm_weight(DType dtype, const FoldNormWeightArgs& a, cudaStream_t stream);
Status row_stats(DType dtype, const RowStatsArgs& a, cudaStream_t stream);
// norm_row_dots runs on `scratch` of norm_row_dots_scratch_bytes(a) bytes.
Status norm_row_dots(DType dtype, const NormRowDotsArgs& a, void* scratch, cudaStream_t stream);
size_t norm_row_dots_scratch_bytes(const NormRowDotsArgs& a);

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

// The norm-folding GEMMs, bf16 only (other dtypes take the reference path).
// Layouts as linear_act (forward) and dact_dbias (dgrad).
template <DType T, Config C>
Status norm_linear_act(const GemmProblem& p, const NormLinearEpilogue& e);
template <DType T, Config C>
size_t norm_linear_act_workspace(const GemmProblem& p);
template <DType T, Config C>
Status linear_residual_stats(const GemmProblem& p, const LinearResidualStatsEpilogue& e);
template <DType T, Config C>
size_t linear_residual_stats_workspace(const GemmProblem& p, const LinearResidualStatsEpilogue& e);
template <DType T, Config C>
Status dact_rowdot(const GemmProblem& p, const DActRowDotEpilogue& e);
template <DType T, Config C>
size_t dact_rowdot_workspace(const GemmProblem& p, const DActRowDotEpilogue& e);
template <DType T, Config C>
Status norm_dgrad(const GemmProblem& p, const NormDgradEpilogue& e);
template <DType T, Config C>
size_t norm_dgrad_workspace(const GemmProblem& p, const NormDgradEpilogue& e);

}  // namespace coda::kernels
