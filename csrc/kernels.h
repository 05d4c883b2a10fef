// The kernels the library holds, declared without CUTLASS so that the API and
// the torch bindings compile in seconds. kernels/table.def declares every
// configuration, program and kernel; CMake makes one translation unit of each
// kernel, and the dispatch (dispatch.cpp) finds them from the same list.
#pragma once

#include <cstddef>
#include <cstdint>

#include "coda/coda.h"
#include "coda/registry.h"

namespace coda::kernels {

// Tile, cluster and schedule of a GEMM (kernels/table.def's CODA_CONFIG lines; gemm.cuh's
// TileConfig). Ping-pong overlaps one warp group's epilogue with the other's mainloop.
enum class Config : int {
#define CODA_CONFIG(E, ...) E,
#include "kernels/table.def"
};
constexpr int kConfigCount = 0
#define CODA_CONFIG(...) +1
#include "kernels/table.def"
    ;

constexpr const char* config_name(Config c) {
  switch (c) {
#define CODA_CONFIG(E, name, ...) \
  case Config::E:                 \
    return #name;
#include "kernels/table.def"
  }
  return "unknown";
}

// A configuration's output tile and cluster, in CTAs: what the kernel choice needs to
// count a problem's tiles.
struct TileShape2 {
  int tile_m, tile_n, cluster_m, cluster_n;
};
constexpr TileShape2 tile_shape(Config c) {
  switch (c) {
#define CODA_CONFIG(E, name, schedule, tm, tn, cm, cn) \
  case Config::E:                                      \
    return {tm, tn, cm, cn};
#include "kernels/table.def"
  }
  return {0, 0, 1, 1};
}

// The epilogue programs (kernels/table.def's CODA_PROGRAM lines; cutlass_epilogues/),
// one kernel family each, and the pass each runs in: the kernel choice has one rule
// per pass, so a program cannot be declared without the rule it takes.
enum class Pass : int { kForward, kDgrad, kWgrad };
enum class Program : int {
#define CODA_PROGRAM(E, ...) E,
#include "kernels/table.def"
};
constexpr int kProgramCount = 0
#define CODA_PROGRAM(...) +1
#include "kernels/table.def"
    ;

constexpr const char* program_name(Program p) {
  switch (p) {
#define CODA_PROGRAM(E, name, ...) \
  case Program::E:                 \
    return #name;
#include "kernels/table.def"
  }
  return "unknown";
}

constexpr Pass pass_of(Program p) {
  switch (p) {
#define CODA_PROGRAM(E, name, pass, ...) \
  case Program::E:                       \
    return Pass::pass;
#include "kernels/table.def"
  }
  return Pass::kWgrad;
}

// D = epilogue(A·B) in CUTLASS's (M, N, K) terms, with leading dimensions.
struct GemmProblem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  int raster = 0;       // 0 CUTLASS's heuristic, 1 along M, 2 along N
  int swizzle = 1;
  int alternate_k = 1;  // each CTA's odd-numbered tiles load their k-blocks last to first (gemm.cuh)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
};

// Each program's run-time arguments are the public struct of its C++ function
// (coda.h; kernels/table.def's arguments column): its Steps (kernels.cuh)
// read the epilogue's fields from it, api.cpp its GEMM's operands.
template <Program P>
struct EpilogueOf;
#define CODA_PROGRAM(E, name, pass, arguments, ...) \
  template <>                                      \
  struct EpilogueOf<Program::E> {                  \
    using type = arguments;                        \
  };
#include "kernels/table.def"
template <Program P>
using Epilogue = typename EpilogueOf<P>::type;

// One kernel and the workspace it needs (the GEMM's own bytes, then the fp32
// partials of its reductions): defined in kernels.cuh, instantiated once per
// line of kernels/table.def.
template <Program P, DType T, Config C>
Status launch(const GemmProblem& p, const Epilogue<P>& e);
template <Program P, DType T, Config C>
size_t workspace(const GemmProblem& p, const Epilogue<P>& e);

// What a kernel's types come to (kernels.cuh's facts<P, T, C>): its mainloop
// stages, the epilogue's shared memory, subtile and load / store stages, the
// kernel's shared memory in all. Every epilogue byte is carved out of the
// mainloop's stages.
using KernelFacts = registry::KernelFacts;
template <Program P, DType T, Config C>
KernelFacts facts();
// Of a built kernel (dispatch.cpp); false where (P, dtype, config) is not built.
bool kernel_facts(Program p, DType t, Config c, KernelFacts* out);

// A tile configuration, raster order and swizzle for one GEMM (choice.cpp).
struct Choice {
  Config config = Config::kCooperative128x256;
  int raster = 0;
  int swizzle = 8;
};

// The kernel choice by problem shape: the rule, then a test or benchmark
// override (set_override) where that configuration is built.
Choice choose(Program p, DType t, int64_t m, int64_t n, int64_t k);

// Whether a plain GEMM of program P (no epilogue work: the wgrad, or a dgrad
// with no activation and no bias gradient) is better left to the vendor
// library (cuBLAS) on a device of `sms` multiprocessors.
bool prefer_vendor_gemm(Program p, int64_t m, int64_t n, int64_t k, int sms);

// The listed kernel of (P, dtype, config), counted (launch_count); an
// unlisted combination is kNotSupported (dispatch.cpp).
template <Program P>
Status run(DType t, Config c, const GemmProblem& p, const Epilogue<P>& e);
template <Program P>
size_t workspace_size(DType t, Config c, const GemmProblem& p, const Epilogue<P>& e);
bool is_built(Program p, DType t, Config c);

// For tests and benchmarks, not the public API: every later choice takes this
// configuration (where built), raster and swizzle; -1 leaves one to the rule.
void set_override(int config, int raster, int swizzle);
// Launches of each (program, config) since the process started.
int64_t launch_count(Program p, Config c);

// ---- small non-GEMM kernels (csrc/partial_sums.cu, csrc/norm_kernels.cu)

// The fp32 partial sums one pass left, merged in one launch: up to two per-row
// sums, row_out[o][r] = row_scale · Σ_t row_partials[o][t · row_ld + r]
// (r < rows, t < row_tiles), and up to two per-column sums rounded to the
// dtype, col_out[o][j] = Σ_t col_partials[o][t · col_ld + j] (j < cols,
// t < col_tiles). A null partials pointer leaves that sum out.
struct PartialSums {
  int64_t rows = 0, row_tiles = 0, row_ld = 0;
  float row_scale = 1.f;
  const float* row_partials[2] = {nullptr, nullptr};
  float* row_out[2] = {nullptr, nullptr};
  int64_t cols = 0, col_tiles = 0, col_ld = 0;
  const float* col_partials[2] = {nullptr, nullptr};
  void* col_out[2] = {nullptr, nullptr};
};
Status merge_partials(DType dtype, const PartialSums& p, cudaStream_t stream);

// mean and rstd of rows of length n from per-row partials of Σy (null for
// RMSNorm, whose mean, when asked for, is written as 0) and Σy².
Status row_partials_stats(const float* sum, const float* sumsq, int64_t tiles, int64_t ld, int64_t rows, int64_t n,
                          float eps, float* mean, float* rstd, cudaStream_t stream);

// The bodies of the public coda::fold_norm_weight, row_stats, norm_row_dots
// (arguments already checked).
Status fold_norm_weight(DType dtype, const FoldNormWeightArgs& a, cudaStream_t stream);
Status row_stats(DType dtype, const RowStatsArgs& a, cudaStream_t stream);
// norm_row_dots runs on `scratch` of norm_row_dots_scratch_bytes(a) bytes.
Status norm_row_dots(DType dtype, const NormRowDotsArgs& a, void* scratch, cudaStream_t stream);
size_t norm_row_dots_scratch_bytes(const NormRowDotsArgs& a);

// The body of the public coda::rope_backward (csrc/rope_kernels.cu).
Status rope_backward(DType dtype, const RopeBackwardArgs& a, cudaStream_t stream);
// The bodies of the public coda::dropout_residual and dropout_backward (csrc/dropout_kernels.cu).
Status dropout_residual(DType dtype, const DropoutResidualArgs& a, cudaStream_t stream);
Status dropout_backward(DType dtype, const DropoutBackwardArgs& a, cudaStream_t stream);

// The bodies of the public coda::rmsnorm_residual, its backward and
// rmsnorm_residual_partials (csrc/norm_kernels.cu).
Status rmsnorm_residual(DType dtype, const RmsNormResidualArgs& a, cudaStream_t stream);
Status rmsnorm_residual_backward(DType dtype, const RmsNormResidualBackwardArgs& a, cudaStream_t stream);
int64_t rmsnorm_residual_partials(int64_t m);

// The bodies of the public coda::head_norm_rope, head_norm_rope_backward and
// head_norm_rope_partials (csrc/rope_kernels.cu).
Status head_norm_rope(DType dtype, const HeadNormRopeArgs& a, cudaStream_t stream);
Status head_norm_rope_backward(DType dtype, const HeadNormRopeBackwardArgs& a, cudaStream_t stream);
int64_t head_norm_rope_partials(int64_t m, int64_t heads);

// The body of the public coda::cross_entropy (csrc/cross_entropy_kernels.cu).
Status cross_entropy(DType dtype, const CrossEntropyArgs& a, cudaStream_t stream);
// The one-read cross-entropy kernel for the statistics-and-gradient pass, off
// by default until measured (registry.h's set_cross_entropy_one_read), and its launches.
void set_cross_entropy_one_read(bool on);
int64_t cross_entropy_one_read_launches();
// The body of the public coda::scale (csrc/cross_entropy_kernels.cu).
Status scale(DType dtype, void* x, int64_t n, const float* scale, cudaStream_t stream);
// The body of the public coda::scale_round (csrc/cross_entropy_kernels.cu).
Status scale_round(DType dtype, const float* src, void* dst, int64_t n, const float* scale, cudaStream_t stream);

}  // namespace coda::kernels
