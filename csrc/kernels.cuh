// Definitions of the kernel templates declared in kernels.h. Only the .cu
// files under kernels/ include this, each instantiating exactly one.
#pragma once

#include "dact_dbias.hpp"
#include "gemm.cuh"
#include "linear_act.hpp"
#include "store.hpp"

namespace coda::kernels {

using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// CUTLASS's B is (K, N): a row-major (N, K) weight is its column-major B.
template <DType T, Config C>
using LinearActGemm = Gemm<T, RowMajor, ColumnMajor, C, epilogues::LinearAct>;
// A row-major (K, N) weight is a row-major B: N-major, which wgmma reads transposed.
template <DType T, Config C>
using DActDBiasGemm = Gemm<T, RowMajor, RowMajor, C, epilogues::DActDBias>;
// dYᵀ: a row-major (K, M) tensor is a column-major A.
template <DType T, Config C>
using WgradGemm = Gemm<T, ColumnMajor, RowMajor, C, epilogues::Store>;

template <DType T, Config C>
Status linear_act(const GemmProblem& p, const LinearActEpilogue& e) {
  using G = LinearActGemm<T, C>;
  using E = typename G::Element;
  typename G::EpilogueProgram::Arguments a;
  a.bias = static_cast<E const*>(e.bias);
  a.pre_act = static_cast<E*>(e.pre_act);
  a.ld_pre_act = e.ld_pre_act;
  a.activation = static_cast<epilogues::ActivationKind>(e.activation);
  a.residual = static_cast<E const*>(e.residual);
  a.ld_residual = e.ld_residual;
  return G::run(p, a);
}

template <DType T, Config C>
size_t linear_act_workspace(const GemmProblem& p) {
  return LinearActGemm<T, C>::workspace_size(p);
}

// The bias-gradient partials live in the workspace, after what the GEMM needs.
template <DType T, Config C>
size_t dact_dbias_partials_bytes(const GemmProblem& p) {
  using P = typename DActDBiasGemm<T, C>::EpilogueProgram;
  return size_t(P::partial_rows(p.m) * P::partial_cols(p.n)) * sizeof(float);
}

inline size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

template <DType T, Config C>
size_t dact_dbias_workspace(const GemmProblem& p) {
  return align_up(DActDBiasGemm<T, C>::workspace_size(p)) + dact_dbias_partials_bytes<T, C>(p);
}

template <DType T, Config C>
Status dact_dbias(const GemmProblem& p, const DActDBiasEpilogue& e) {
  using G = DActDBiasGemm<T, C>;
  using E = typename G::Element;
  using P = typename G::EpilogueProgram;
  const size_t need = dact_dbias_workspace<T, C>(p);
  GemmProblem q = p;
  bool owned = false;
  if (e.dbias != nullptr && p.workspace_bytes < need) {
    if (p.workspace != nullptr) {
      return detail::fail(Status::kWorkspaceTooSmall, "workspace has " + std::to_string(p.workspace_bytes) +
                                                          " bytes, needs " + std::to_string(need));
    }
    cudaError_t err = cudaMallocAsync(&q.workspace, need, p.stream);
    if (err != cudaSuccess) return detail::fail(Status::kCudaError, std::string("cudaMallocAsync: ") + cudaGetErrorString(err));
    q.workspace_bytes = need;
    owned = true;
  }
  typename P::Arguments a;
  a.pre_act = static_cast<E const*>(e.pre_act);
  a.ld_pre_act = e.ld_pre_act;
  a.activation = static_cast<epilogues::ActivationKind>(e.activation);
  float* partials = nullptr;
  if (e.dbias != nullptr) {
    size_t gemm_bytes = align_up(G::workspace_size(p));
    partials = reinterpret_cast<float*>(static_cast<char*>(q.workspace) + gemm_bytes);
    a.dbias_partials = partials;
    q.workspace_bytes = gemm_bytes;
  }
  Status s = G::run(q, a);
  if (s == Status::kSuccess && e.dbias != nullptr) {
    s = column_sum(T, partials, P::partial_rows(p.m), p.n, P::partial_cols(p.n), e.dbias, p.stream);
  }
  if (owned) cudaFreeAsync(q.workspace, p.stream);
  return s;
}

template <DType T, Config C>
Status wgrad_store(const GemmProblem& p) {
  return WgradGemm<T, C>::run(p, {});
}

template <DType T, Config C>
size_t wgrad_store_workspace(const GemmProblem& p) {
  return WgradGemm<T, C>::workspace_size(p);
}

}  // namespace coda::kernels
