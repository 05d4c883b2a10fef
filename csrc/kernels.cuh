// The kernels declared in kernels.h: each program's GEMM type and how its
// arguments, scratch partials and the small merge kernels after it fit
// together. Only the generated translation units (one per line of
// kernels/table.def) include this, each instantiating one kernel.
#pragma once

#include <cmath>

#include "dact_dbias.hpp"
#include "dact_dbias_rowdot.hpp"
#include "gemm.cuh"
#include "glu_dgrad_rowdot.hpp"
#include "linear_act.hpp"
#include "linear_ce_grad.hpp"
#include "linear_residual_stats.hpp"
#include "norm_dgrad.hpp"
#include "norm_glu_linear.hpp"
#include "norm_linear_act.hpp"
#include "rope.hpp"
#include "store.hpp"

namespace coda::kernels {

using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// Each program's GEMM. CUTLASS's B is (K, N): a row-major (N, K) weight is
// its column-major B (the forward); a row-major (K, N) weight is a row-major,
// N-major B (the dgrad); dYᵀ is a column-major A (the wgrad).
template <Program P>
struct ProgramGemm;
#define CODA_PROGRAM(E, name, pass, arguments, A, B, program) \
  template <>                                                  \
  struct ProgramGemm<Program::E> {                             \
    template <DType T, Config C>                               \
    using type = Gemm<T, A, B, C, epilogues::program>;         \
  };
#include "kernels/table.def"

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

// The public enum and the epilogues' share their values (coda.h).
inline epilogues::ActivationKind activation_kind(Activation a) {
  return static_cast<epilogues::ActivationKind>(static_cast<int>(a));
}

// The row stats' rstd at which a row's variance is below 2⁻¹⁹·eps: the rows a
// folded LayerNorm treats as constant (norm_ops.hpp).
inline float constant_row_rstd(float eps) {
  return eps > 0.f ? float((1.0 - std::ldexp(1.0, -20)) / std::sqrt(double(eps))) : __builtin_huge_valf();
}

// Per program, from the public arguments of its C++ function (coda.h):
// arguments(...) converts them to its epilogue's, scratch(...)
// lays out the fp32 partials of its reductions (and points the arguments at
// them; a null base only counts the bytes), finish(...) merges them after the
// GEMM.
template <Program P, DType T, Config C>
struct Steps;

template <DType T, Config C>
struct Steps<Program::kLinearAct, T, C> {
  using G = typename ProgramGemm<Program::kLinearAct>::template type<T, C>;
  using E = typename G::Element;
  using Args = typename G::EpilogueProgram::Arguments;
  static size_t scratch(const GemmProblem&, const LinearArgs&, char*, Args*) { return 0; }
  static Args arguments(const LinearArgs& e) {
    Args a;
    a.bias = static_cast<E const*>(e.bias);
    a.pre_act = static_cast<E*>(e.pre_act);
    a.ld_pre_act = e.ld_pre_act;
    a.activation = activation_kind(e.activation);
    a.residual = static_cast<E const*>(e.residual);
    a.ld_residual = e.ld_residual;
    return a;
  }
  static Status finish(const GemmProblem&, const LinearArgs&, const Args&) { return Status::kSuccess; }
};

template <DType T, Config C>
struct Steps<Program::kWgradStore, T, C> {
  using G = typename ProgramGemm<Program::kWgradStore>::template type<T, C>;
  using Args = typename G::EpilogueProgram::Arguments;
  static size_t scratch(const GemmProblem&, const WgradArgs&, char*, Args*) { return 0; }
  static Args arguments(const WgradArgs&) { return {}; }
  static Status finish(const GemmProblem&, const WgradArgs&, const Args&) { return Status::kSuccess; }
};

template <DType T, Config C>
struct Steps<Program::kDActDBias, T, C> {
  using G = typename ProgramGemm<Program::kDActDBias>::template type<T, C>;
  using E = typename G::Element;
  using Args = typename G::EpilogueProgram::Arguments;
  using Partial = typename G::EpilogueProgram::Partial;
  static size_t scratch(const GemmProblem& p, const DgradArgs& e, char* base, Args* a) {
    Scratch s(base);
    float* db = s.take(Partial::per_col_floats(p.m, p.n), e.dbias != nullptr);
    if (a != nullptr) a->dbias_partials = db;
    return s.used();
  }
  static Args arguments(const DgradArgs& e) {
    Args a;
    a.pre_act = static_cast<E const*>(e.pre_act);
    a.ld_pre_act = e.ld_pre_act;
    a.activation = activation_kind(e.activation);
    return a;
  }
  static Status finish(const GemmProblem& p, const DgradArgs& e, const Args& a) {
    if (e.dbias == nullptr) return Status::kSuccess;
    PartialSums m;
    m.cols = p.n; m.col_tiles = Partial::tiles_m(p.m); m.col_ld = Partial::cols_padded(p.n);
    m.col_partials[0] = a.dbias_partials; m.col_out[0] = e.dbias;
    return merge_partials(T, m, p.stream);
  }
};

template <DType T, Config C>
struct Steps<Program::kNormLinearAct, T, C> {
  using G = typename ProgramGemm<Program::kNormLinearAct>::template type<T, C>;
  using E = typename G::Element;
  using Args = typename G::EpilogueProgram::Arguments;
  static size_t scratch(const GemmProblem&, const NormLinearArgs&, char*, Args*) { return 0; }
  static Args arguments(const NormLinearArgs& e) {
    Args a;
    a.mean = e.mean;
    a.rstd = e.rstd;
    a.rstd_limit = e.mean != nullptr ? constant_row_rstd(e.eps) : __builtin_huge_valf();
    a.col_sum = e.col_sum;
    a.shift = e.shift;
    a.pre_act = static_cast<E*>(e.pre_act);
    a.ld_pre_act = e.ld_pre_act;
    a.activation = activation_kind(e.activation);
    return a;
  }
  static Status finish(const GemmProblem&, const NormLinearArgs&, const Args&) { return Status::kSuccess; }
};

// Σy and Σy² per row and N-tile, then mean / rstd.
template <DType T, Config C>
struct Steps<Program::kLinearResidualStats, T, C> {
  using G = typename ProgramGemm<Program::kLinearResidualStats>::template type<T, C>;
  using E = typename G::Element;
  using Args = typename G::EpilogueProgram::Arguments;
  using Partial = typename G::EpilogueProgram::Partial;
  static size_t scratch(const GemmProblem& p, const LinearResidualArgs& e, char* base, Args* a) {
    Scratch s(base);
    float* sum = s.take(Partial::per_row_floats(p.m, p.n), e.layernorm);
    float* sumsq = s.take(Partial::per_row_floats(p.m, p.n));
    if (a != nullptr) {
      a->sum_partials = sum;
      a->sumsq_partials = sumsq;
    }
    return s.used();
  }
  static Args arguments(const LinearResidualArgs& e) {
    Args a;
    a.bias = static_cast<E const*>(e.bias);
    a.residual = static_cast<E const*>(e.residual);
    a.ld_residual = e.ld_residual;
    return a;
  }
  static Status finish(const GemmProblem& p, const LinearResidualArgs& e, const Args& a) {
    return row_partials_stats(a.sum_partials, a.sumsq_partials, Partial::tiles_n(p.n), Partial::rows_padded(p.m), p.m,
                              p.n, e.eps, e.mean, e.rstd, p.stream);
  }
};

template <DType T, Config C>
struct Steps<Program::kDActRowDot, T, C> {
  using G = typename ProgramGemm<Program::kDActRowDot>::template type<T, C>;
  using E = typename G::Element;
  using Args = typename G::EpilogueProgram::Arguments;
  using Partial = typename G::EpilogueProgram::Partial;
  static size_t scratch(const GemmProblem& p, const DgradArgs& e, char* base, Args* a) {
    Scratch s(base);
    float* c1 = s.take(Partial::per_row_floats(p.m, p.n), e.norm_c1 != nullptr);
    float* c2 = s.take(Partial::per_row_floats(p.m, p.n), e.norm_c2 != nullptr);
    float* db = s.take(Partial::per_col_floats(p.m, p.n), e.dbias != nullptr);
    if (a != nullptr) {
      a->c1_partials = c1;
      a->c2_partials = c2;
      a->dbias_partials = db;
    }
    return s.used();
  }
  static Args arguments(const DgradArgs& e) {
    Args a;
    a.pre_act = static_cast<E const*>(e.pre_act);
    a.ld_pre_act = e.ld_pre_act;
    a.activation = activation_kind(e.activation);
    a.shift = e.norm_shift;
    a.col_sum = e.norm_col_sum;
    return a;
  }
  static Status finish(const GemmProblem& p, const DgradArgs& e, const Args& a) {
    PartialSums m;
    m.rows = p.m; m.row_tiles = Partial::tiles_n(p.n); m.row_ld = Partial::rows_padded(p.m); m.row_scale = e.norm_scale;
    m.row_partials[0] = e.norm_c1 != nullptr ? a.c1_partials : nullptr; m.row_out[0] = e.norm_c1;
    m.row_partials[1] = e.norm_c2 != nullptr ? a.c2_partials : nullptr; m.row_out[1] = e.norm_c2;
    m.cols = p.n; m.col_tiles = Partial::tiles_m(p.m); m.col_ld = Partial::cols_padded(p.n);
    m.col_partials[0] = e.dbias != nullptr ? a.dbias_partials : nullptr; m.col_out[0] = e.dbias;
    return merge_partials(T, m, p.stream);
  }
};

template <DType T, Config C>
struct Steps<Program::kNormDgrad, T, C> {
  using G = typename ProgramGemm<Program::kNormDgrad>::template type<T, C>;
  using E = typename G::Element;
  using Args = typename G::EpilogueProgram::Arguments;
  using Partial = typename G::EpilogueProgram::Partial;
  static size_t scratch(const GemmProblem& p, const NormDgradArgs& e, char* base, Args* a) {
    Scratch s(base);
    float* dg = s.take(Partial::per_col_floats(p.m, p.n), e.dgamma != nullptr);
    float* db = s.take(Partial::per_col_floats(p.m, p.n), e.dbeta != nullptr);
    if (a != nullptr) {
      a->dgamma_partials = dg;
      a->dbeta_partials = db;
    }
    return s.used();
  }
  static Args arguments(const NormDgradArgs& e) {
    Args a;
    a.x = static_cast<E const*>(e.x);
    a.ld_x = e.ldx;
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
    return a;
  }
  static Status finish(const GemmProblem& p, const NormDgradArgs& e, const Args& a) {
    PartialSums m;
    m.cols = p.n; m.col_tiles = Partial::tiles_m(p.m); m.col_ld = Partial::cols_padded(p.n);
    m.col_partials[0] = e.dgamma != nullptr ? a.dgamma_partials : nullptr; m.col_out[0] = e.dgamma;
    m.col_partials[1] = e.dbeta != nullptr ? a.dbeta_partials : nullptr; m.col_out[1] = e.dbeta;
    return merge_partials(T, m, p.stream);
  }
};

template <DType T, Config C>
struct Steps<Program::kNormGluLinear, T, C> {
  using G = typename ProgramGemm<Program::kNormGluLinear>::template type<T, C>;
  using E = typename G::Element;
  using Args = typename G::EpilogueProgram::Arguments;
  static size_t scratch(const GemmProblem&, const NormGluArgs&, char*, Args*) { return 0; }
  static Args arguments(const NormGluArgs& e) {
    Args a;
    a.rstd = e.rstd;
    a.act_out = static_cast<E*>(e.a);
    a.ld_act_out = e.lda;
    a.activation = activation_kind(e.activation);
    return a;
  }
  static Status finish(const GemmProblem&, const NormGluArgs&, const Args&) { return Status::kSuccess; }
};

// The c₁ partials per row and N-tile (N = F, one pair per column), merged to c₁.
template <DType T, Config C>
struct Steps<Program::kGluDgradRowDot, T, C> {
  using G = typename ProgramGemm<Program::kGluDgradRowDot>::template type<T, C>;
  using E = typename G::Element;
  using Args = typename G::EpilogueProgram::Arguments;
  using Partial = typename G::EpilogueProgram::Partial;
  static size_t scratch(const GemmProblem& p, const GluDgradArgs& e, char* base, Args* a) {
    Scratch s(base);
    float* c1 = s.take(Partial::per_row_floats(p.m, p.n), e.norm_c1 != nullptr);
    if (a != nullptr) a->c1_partials = c1;
    return s.used();
  }
  static Args arguments(const GluDgradArgs& e) {
    Args a;
    a.pre_act = static_cast<E const*>(e.h);
    a.ld_pre_act = e.ldh;
    a.activation = activation_kind(e.activation);
    return a;
  }
  static Status finish(const GemmProblem& p, const GluDgradArgs& e, const Args& a) {
    if (e.norm_c1 == nullptr) return Status::kSuccess;
    PartialSums m;
    m.rows = p.m; m.row_tiles = Partial::tiles_n(p.n); m.row_ld = Partial::rows_padded(p.m); m.row_scale = e.norm_scale;
    m.row_partials[0] = a.c1_partials; m.row_out[0] = e.norm_c1;
    return merge_partials(T, m, p.stream);
  }
};

template <DType T, Config C>
struct Steps<Program::kNormRopeLinear, T, C> {
  using G = typename ProgramGemm<Program::kNormRopeLinear>::template type<T, C>;
  using Args = typename G::EpilogueProgram::Arguments;
  static size_t scratch(const GemmProblem&, const NormRopeArgs&, char*, Args*) { return 0; }
  static Args arguments(const NormRopeArgs& e) {
    Args a;
    a.rstd = e.rstd;
    a.shift = e.shift;
    a.positions = e.positions;
    a.freq = e.freq;
    return a;
  }
  static Status finish(const GemmProblem&, const NormRopeArgs&, const Args&) { return Status::kSuccess; }
};

template <DType T, Config C>
struct Steps<Program::kLinearCeGrad, T, C> {
  using G = typename ProgramGemm<Program::kLinearCeGrad>::template type<T, C>;
  using E = typename G::Element;
  using Args = typename G::EpilogueProgram::Arguments;
  static size_t scratch(const GemmProblem&, const LinearCrossEntropyGradArgs&, char*, Args*) { return 0; }
  static Args arguments(const LinearCrossEntropyGradArgs& e) {
    Args a;
    a.bias = static_cast<E const*>(e.bias);
    a.classes = e.classes;
    a.lse = e.lse;
    a.target = e.target;
    a.scale = e.scale;
    a.grad = {e.softcap, e.label_smoothing / float(e.vocab), 1.f - e.label_smoothing, 2.f * e.z_loss};
    return a;
  }
  static Status finish(const GemmProblem&, const LinearCrossEntropyGradArgs&, const Args&) {
    return Status::kSuccess;
  }
};

template <Program P, DType T, Config C>
size_t workspace(const GemmProblem& p, const Epilogue<P>& e) {
  using S = Steps<P, T, C>;
  return workspace_with<typename S::G>(p, S::scratch(p, e, nullptr, nullptr));
}

template <Program P, DType T, Config C>
Status launch(const GemmProblem& p, const Epilogue<P>& e) {
  using S = Steps<P, T, C>;
  const size_t extra = S::scratch(p, e, nullptr, nullptr);
  return with_workspace<typename S::G>(p, extra, [&](const GemmProblem& q, char* scratch) {
    auto a = S::arguments(e);
    S::scratch(p, e, scratch, &a);
    Status s = S::G::run(q, a);
    return s == Status::kSuccess ? S::finish(p, e, a) : s;
  });
}

template <Program P, DType T, Config C>
KernelFacts facts() {
  using G = typename ProgramGemm<P>::template type<T, C>;
  using EpiTile = typename G::EpiTile;
  KernelFacts f;
  f.stages = int(G::Mainloop::DispatchPolicy::Stages);
  f.epilogue_bytes = int(sizeof(typename G::CollectiveEpilogue::SharedStorage));
  f.epilogue_tile_m = int(cute::size<0>(EpiTile{}));
  f.epilogue_tile_n = int(cute::size<1>(EpiTile{}));
  f.stages_c = G::EpilogueDescriptor::StagesC;
  f.stages_d = G::EpilogueDescriptor::StagesD;
  f.smem_bytes = int(G::Kernel::SharedStorageSize);
  return f;
}

}  // namespace coda::kernels

// The explicit instantiation of one CODA_KERNEL line of kernels/table.def (the generated
// translation units hold one each).
#define CODA_KERNEL(P, T, C)                                                                                      \
  template Status launch<Program::P, DType::T, Config::C>(const GemmProblem&, const Epilogue<Program::P>&);     \
  template size_t workspace<Program::P, DType::T, Config::C>(const GemmProblem&, const Epilogue<Program::P>&);   \
  template KernelFacts facts<Program::P, DType::T, Config::C>();
