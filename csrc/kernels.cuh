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

template <DType T, Config C>
Status dact_dbias(const GemmProblem& p, const DActDBiasEpilogue& e) {
  using G = DActDBiasGemm<T, C>;
  using E = typename G::Element;
  typename G::EpilogueProgram::Arguments a;
  a.pre_act = static_cast<E const*>(e.pre_act);
  a.ld_pre_act = e.ld_pre_act;
  a.activation = static_cast<epilogues::ActivationKind>(e.activation);
  a.dbias = static_cast<E*>(e.dbias);
  return G::run(p, a);
}

template <DType T, Config C>
size_t dact_dbias_workspace(const GemmProblem& p) {
  return DActDBiasGemm<T, C>::workspace_size(p);
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
