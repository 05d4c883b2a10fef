// Definitions of the kernel templates declared in kernels.h. Only the .cu
// files under kernels/ include this, each instantiating exactly one.
#pragma once

#include "dact_dbias.hpp"
#include "dact_dbias_rowdot.hpp"
#include "gemm.cuh"
#include "linear_act.hpp"
#include "linear_residual_stats.hpp"
#include "norm_dgrad.hpp"
#include "norm_linear_act.hpp"
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
using NormLinearActGemm = Gemm<T, RowMajor, ColumnMajor, C, epilogues::NormLinearAct>;
template <DType T, Config C>
using LinearResidualStatsGemm = Gemm<T, RowMajor, ColumnMajor, C, epilogues::LinearResidualStats>;
template <DType T, Config C>
using DActRowDotGemm = Gemm<T, RowMajor, RowMajor, C, epilogues::DActDBiasRowDot>;
template <DType T, Config C>
using NormDgradGemm = Gemm<T, RowMajor, RowMajor, C, epilogues::NormDgrad>;

// Carves 256-byte-aligned fp32 buffers out of an op's scratch bytes, or,
// called with a null base, only counts them (the workspace-size query).
class Scratch {
 public:
  explicit Scratch(char* base) : base_(base) {}
  float* take(int64_t floats, bool wanted = true) {
    if (!wanted) return nullptr;
    char* at = base_ == nullptr ? nullptr : base_ + used_;
    used_ += align_up(size_t(floats) * sizeof(float));
    return reinterpret_cast<float*>(at);
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

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
  return with_workspace<G>(p, 0, [&](const GemmProblem& q, char*) { return G::run(q, a); });
}

template <DType T, Config C>
size_t linear_act_workspace(const GemmProblem& p) {
  return workspace_with<LinearActGemm<T, C>>(p, 0);
}

// The dbias partials come after what the GEMM needs.
template <DType T, Config C>
size_t dact_dbias_partials_bytes(const GemmProblem& p) {
  using P = typename DActDBiasGemm<T, C>::EpilogueProgram::Partial;
  return align_up(size_t(P::per_col_floats(p.m, p.n)) * sizeof(float));
}

template <DType T, Config C>
size_t dact_dbias_workspace(const GemmProblem& p) {
  return workspace_with<DActDBiasGemm<T, C>>(p, dact_dbias_partials_bytes<T, C>(p));
}

template <DType T, Config C>
Status dact_dbias(const GemmProblem& p, const DActDBiasEpilogue& e) {
  using G = DActDBiasGemm<T, C>;
  using E = typename G::Element;
  using P = typename G::EpilogueProgram::Partial;
  const size_t extra = e.dbias != nullptr ? dact_dbias_partials_bytes<T, C>(p) : 0;
  return with_workspace<G>(p, extra, [&](const GemmProblem& q, char* scratch) {
    typename G::EpilogueProgram::Arguments a;
    a.pre_act = static_cast<E const*>(e.pre_act);
    a.ld_pre_act = e.ld_pre_act;
    a.activation = static_cast<epilogues::ActivationKind>(e.activation);
    a.dbias_partials = e.dbias != nullptr ? reinterpret_cast<float*>(scratch) : nullptr;
    Status s = G::run(q, a);
    if (s == Status::kSuccess && e.dbias != nullptr) {
      s = column_sum(T, a.dbias_partials, P::tiles_m(p.m), p.n, P::cols_padded(p.n), e.dbias, p.stream);
    }
    return s;
  });
}

template <DType T, Config C>
Status wgrad_store(const GemmProblem& p) {
  using G = WgradGemm<T, C>;
  return with_workspace<G>(p, 0, [&](const GemmProblem& q, char*) { return G::run(q, {}); });
}

template <DType T, Config C>
size_t wgrad_store_workspace(const GemmProblem& p) {
  return workspace_with<WgradGemm<T, C>>(p, 0);
}

// ---- the norm-folding GEMMs

template <DType T, Config C>
Status norm_linear_act(const GemmProblem& p, const NormLinearEpilogue& e) {
  using G = NormLinearActGemm<T, C>;
  using E = typename G::Element;
  typename G::EpilogueProgram::Arguments a;
  a.mean = e.mean;
  a.rstd = e.rstd;
  a.col_sum = e.col_sum;
  a.shift = e.shift;
  a.pre_act = static_cast<E*>(e.pre_act);
  a.ld_pre_act = e.ld_pre_act;
  a.activation = static_cast<epilogues::ActivationKind>(e.activation);
  return with_workspace<G>(p, 0, [&](const GemmProblem& q, char*) { return G::run(q, a); });
}

template <DType T, Config C>
size_t norm_linear_act_workspace(const GemmProblem& p) {
  return workspace_with<NormLinearActGemm<T, C>>(p, 0);
}

// Σy and Σy² per row and N-tile, then mean / rstd.
template <DType T, Config C>
size_t linear_residual_stats_scratch(const GemmProblem& p, const LinearResidualStatsEpilogue& e, char* base,
                                     typename LinearResidualStatsGemm<T, C>::EpilogueProgram::Arguments* a) {
  using P = typename LinearResidualStatsGemm<T, C>::EpilogueProgram::Partial;
  Scratch s(base);
  float* sum = s.take(P::per_row_floats(p.m, p.n), e.layernorm);
  float* sumsq = s.take(P::per_row_floats(p.m, p.n));
  if (a != nullptr) {
    a->sum_partials = sum;
    a->sumsq_partials = sumsq;
  }
  return s.used();
}

template <DType T, Config C>
size_t linear_residual_stats_workspace(const GemmProblem& p, const LinearResidualStatsEpilogue& e) {
  using G = LinearResidualStatsGemm<T, C>;
  return workspace_with<G>(p, linear_residual_stats_scratch<T, C>(p, e, nullptr, nullptr));
}

template <DType T, Config C>
Status linear_residual_stats(const GemmProblem& p, const LinearResidualStatsEpilogue& e) {
  using G = LinearResidualStatsGemm<T, C>;
  using E = typename G::Element;
  using P = typename G::EpilogueProgram::Partial;
  const size_t extra = linear_residual_stats_scratch<T, C>(p, e, nullptr, nullptr);
  return with_workspace<G>(p, extra, [&](const GemmProblem& q, char* scratch) {
    typename G::EpilogueProgram::Arguments a;
    a.bias = static_cast<E const*>(e.bias);
    a.residual = static_cast<E const*>(e.residual);
    a.ld_residual = e.ld_residual;
    linear_residual_stats_scratch<T, C>(p, e, scratch, &a);
    Status s = G::run(q, a);
    if (s != Status::kSuccess) return s;
    return row_partials_stats(a.sum_partials, a.sumsq_partials, P::tiles_n(p.n), P::rows_padded(p.m), p.m, p.n,
                              e.eps, e.layernorm ? e.mean : nullptr, e.rstd, p.stream);
  });
}

template <DType T, Config C>
size_t dact_rowdot_scratch(const GemmProblem& p, const DActRowDotEpilogue& e, char* base,
                           typename DActRowDotGemm<T, C>::EpilogueProgram::Arguments* a) {
  using P = typename DActRowDotGemm<T, C>::EpilogueProgram::Partial;
  Scratch s(base);
  float* c1 = s.take(P::per_row_floats(p.m, p.n), e.c1 != nullptr);
  float* c2 = s.take(P::per_row_floats(p.m, p.n), e.c2 != nullptr);
  float* db = s.take(P::per_col_floats(p.m, p.n), e.dbias != nullptr);
  if (a != nullptr) {
    a->c1_partials = c1;
    a->c2_partials = c2;
    a->dbias_partials = db;
  }
  return s.used();
}

template <DType T, Config C>
size_t dact_rowdot_workspace(const GemmProblem& p, const DActRowDotEpilogue& e) {
  return workspace_with<DActRowDotGemm<T, C>>(p, dact_rowdot_scratch<T, C>(p, e, nullptr, nullptr));
}

template <DType T, Config C>
Status dact_rowdot(const GemmProblem& p, const DActRowDotEpilogue& e) {
  using G = DActRowDotGemm<T, C>;
  using E = typename G::Element;
  using P = typename G::EpilogueProgram::Partial;
  const size_t extra = dact_rowdot_scratch<T, C>(p, e, nullptr, nullptr);
  return with_workspace<G>(p, extra, [&](const GemmProblem& q, char* scratch) {
    typename G::EpilogueProgram::Arguments a;
    a.pre_act = static_cast<E const*>(e.pre_act);
    a.ld_pre_act = e.ld_pre_act;
    a.activation = static_cast<epilogues::ActivationKind>(e.activation);
    a.shift = e.shift;
    a.col_sum = e.col_sum;
    dact_rowdot_scratch<T, C>(p, e, scratch, &a);
    Status s = G::run(q, a);
    const int64_t tiles = P::tiles_n(p.n), ld = P::rows_padded(p.m);
    if (s == Status::kSuccess && e.c1 != nullptr) s = row_partials_sum(a.c1_partials, tiles, ld, p.m, e.scale, e.c1, p.stream);
    if (s == Status::kSuccess && e.c2 != nullptr) s = row_partials_sum(a.c2_partials, tiles, ld, p.m, e.scale, e.c2, p.stream);
    if (s == Status::kSuccess && e.dbias != nullptr) {
      s = column_sum(T, a.dbias_partials, P::tiles_m(p.m), p.n, P::cols_padded(p.n), e.dbias, p.stream);
    }
    return s;
  });
}

template <DType T, Config C>
size_t norm_dgrad_scratch(const GemmProblem& p, const NormDgradEpilogue& e, char* base,
                          typename NormDgradGemm<T, C>::EpilogueProgram::Arguments* a) {
  using P = typename NormDgradGemm<T, C>::EpilogueProgram::Partial;
  Scratch s(base);
  float* dg = s.take(P::per_col_floats(p.m, p.n), e.dgamma != nullptr);
  float* db = s.take(P::per_col_floats(p.m, p.n), e.dbeta != nullptr);
  if (a != nullptr) {
    a->dgamma_partials = dg;
    a->dbeta_partials = db;
  }
  return s.used();
}

template <DType T, Config C>
size_t norm_dgrad_workspace(const GemmProblem& p, const NormDgradEpilogue& e) {
  return workspace_with<NormDgradGemm<T, C>>(p, norm_dgrad_scratch<T, C>(p, e, nullptr, nullptr));
}

template <DType T, Config C>
Status norm_dgrad(const GemmProblem& p, const NormDgradEpilogue& e) {
  using G = NormDgradGemm<T, C>;
  using E = typename G::Element;
  using P = typename G::EpilogueProgram::Partial;
  const size_t extra = norm_dgrad_scratch<T, C>(p, e, nullptr, nullptr);
  return with_workspace<G>(p, extra, [&](const GemmProblem& q, char* scratch) {
    typename G::EpilogueProgram::Arguments a;
    a.x = static_cast<E const*>(e.x);
    a.ld_x = e.ld_x;
    a.mean = e.mean;
    a.rstd = e.rstd;
    a.gamma = static_cast<E const*>(e.gamma);
    a.beta = static_cast<E const*>(e.beta);
    a.c1 = e.c1;
    a.c2 = e.c2;
    a.residual_grad = static_cast<E const*>(e.residual_grad);
    a.ld_residual_grad = e.ld_residual_grad;
    a.normalized = static_cast<E*>(e.normalized);
    a.ld_normalized = e.ld_normalized;
    norm_dgrad_scratch<T, C>(p, e, scratch, &a);
    Status s = G::run(q, a);
    const int64_t tiles = P::tiles_m(p.m), ld = P::cols_padded(p.n);
    if (s == Status::kSuccess && e.dgamma != nullptr) s = column_sum(T, a.dgamma_partials, tiles, p.n, ld, e.dgamma, p.stream);
    if (s == Status::kSuccess && e.dbeta != nullptr) s = column_sum(T, a.dbeta_partials, tiles, p.n, ld, e.dbeta, p.stream);
    return s;
  });
}

}  // namespace coda::kernels

// One instantiation of an op's kernel and its workspace query, for the .cu
// files that a sweep build generates (CMakeLists.txt, CODA_SWEEP_CONFIGS).
#define CODA_INSTANTIATE_linear_act(T, C)                                                  \
  template Status linear_act<T, C>(const GemmProblem&, const LinearActEpilogue&); \
  template size_t linear_act_workspace<T, C>(const GemmProblem&);
#define CODA_INSTANTIATE_dact_dbias(T, C)                                                  \
  template Status dact_dbias<T, C>(const GemmProblem&, const DActDBiasEpilogue&); \
  template size_t dact_dbias_workspace<T, C>(const GemmProblem&);
#define CODA_INSTANTIATE_wgrad_store(T, C)                    \
  template Status wgrad_store<T, C>(const GemmProblem&); \
  template size_t wgrad_store_workspace<T, C>(const GemmProblem&);
#define CODA_INSTANTIATE_linear_residual_stats(T, C)                                                     \
  template Status linear_residual_stats<T, C>(const GemmProblem&, const LinearResidualStatsEpilogue&); \
  template size_t linear_residual_stats_workspace<T, C>(const GemmProblem&, const LinearResidualStatsEpilogue&);
#define CODA_INSTANTIATE_norm_dgrad(T, C)                                                  \
  template Status norm_dgrad<T, C>(const GemmProblem&, const NormDgradEpilogue&); \
  template size_t norm_dgrad_workspace<T, C>(const GemmProblem&, const NormDgradEpilogue&);
