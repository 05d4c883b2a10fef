// Epilogue program: the input gradient of a folded norm, from the dgrad GEMM
// of the Linear after it.
//
// With acc = dP·W (dP the gradient of that Linear's pre-activation, W its
// unfolded weight) the tile holds, per token m and input feature k,
//   x̂  = (x − mean) ⊙ rstd                             recomputed from x
//   dX = rstd ⊙ (γ ⊙ acc − x̂ ⊙ c₁ − c₂) + dR           the norm's backward
//   dγ = Σ_m acc ⊙ x̂,  dβ = Σ_m acc                     per-tile partials over M
//   N̂  = x̂ ⊙ γ + β                                      stored for dW = dPᵀ·N̂
// where c₁, c₂ (per row, fp32) were reduced over the Linear's output features
// where dP was produced (dact_dbias_rowdot.hpp), and dR is the gradient of a
// residual branch around the block (x + f(Norm(x))), added here instead of in
// another pass. RMSNorm: mean, β, c₂ null (0). The normalized input is
// recomputed here, not kept from the forward, which never wrote it.
//
//   0 acc          4 x̂ (1,2,3)      8 store N̂ (7)        12 c₁[m]
//   1 x[m,k]       5 γ[k]           9 acc ⊙ x̂ (0,4)      13 c₂[m]
//   2 mean[m]      6 β[k]          10 reduce_M(9) -> dγ  14 dR[m,k]
//   3 rstd[m]      7 x̂γ+β (4,5,6)  11 reduce_M(0) -> dβ  15 dX (0,4,5,3,12,13,14) -> D
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/functional.h>

#include "primitives.hpp"

namespace coda::epilogues {

template <class Element, class EpilogueDescriptor>
struct NormDgrad {
  using P = Primitives<Element, EpilogueDescriptor>;
  using Partial = typename P::Partial;
  template <template <class> class Fn, class Out = float>
  using Compute = typename P::template Compute<Fn, Out>;
  using Load = typename P::Load;
  using Store = typename P::Store;
  using PerRow = typename P::PerRowF32;
  using PerCol = typename P::PerCol;
  using ReduceM = typename P::ReduceM;

  using Edges = cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<1, 2, 3>, cute::seq<>,
                            cute::seq<>, cute::seq<4, 5, 6>, cute::seq<7>, cute::seq<0, 4>, cute::seq<9>,
                            cute::seq<0>, cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<0, 4, 5, 3, 12, 13, 14>>;
  using Callbacks = cutlass::epilogue::fusion::Sm90TopologicalVisitor<
      float, Edges,
      cutlass::epilogue::fusion::Sm90AccFetch,   // 0
      Load,                                      // 1 x
      PerRow,                                    // 2 mean
      PerRow,                                    // 3 rstd
      Compute<Standardize>,                      // 4 x̂
      PerCol,                                    // 5 γ
      PerCol,                                    // 6 β
      Compute<ScaleShift>,                       // 7
      Store,                                     // 8 N̂
      Compute<Product>,                          // 9
      ReduceM,                                   // 10 dγ
      ReduceM,                                   // 11 dβ
      PerRow,                                    // 12 c₁
      PerRow,                                    // 13 c₂
      Load,                                      // 14 dR
      Compute<NormInputGrad, Element>>;          // 15 dX

  struct Arguments {
    Element const* x = nullptr;          // (M, K) the norm's input
    int64_t ld_x = 0;
    float const* mean = nullptr;         // (M) or null (RMSNorm)
    float const* rstd = nullptr;         // (M)
    Element const* gamma = nullptr;      // (K)
    Element const* beta = nullptr;       // (K) or null
    float const* c1 = nullptr;           // (M)
    float const* c2 = nullptr;           // (M) or null (RMSNorm)
    Element const* residual_grad = nullptr;  // (M, K) or null
    int64_t ld_residual_grad = 0;
    Element* normalized = nullptr;       // (M, K) N̂ out, or null
    int64_t ld_normalized = 0;
    float* dgamma_partials = nullptr;    // Partial::per_col_floats(M, K), or null
    float* dbeta_partials = nullptr;     // Partial::per_col_floats(M, K), or null
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    using Args = typename Callbacks::Arguments;
    return Args{
        typename cutlass::epilogue::fusion::Sm90AccFetch::Arguments{},
        typename Load::Arguments{a.x, Element(0), P::matrix(a.ld_x)},
        typename PerRow::Arguments{a.mean, 0.f, {}},
        typename PerRow::Arguments{a.rstd, 1.f, {}},
        typename Compute<Standardize>::Arguments{},
        typename PerCol::Arguments{a.gamma, Element(1), {}},
        typename PerCol::Arguments{a.beta, Element(0), {}},
        typename Compute<ScaleShift>::Arguments{},
        typename Store::Arguments{a.normalized, P::matrix(a.ld_normalized)},
        typename Compute<Product>::Arguments{},
        typename ReduceM::Arguments{a.dgamma_partials, 0.f, {}},
        typename ReduceM::Arguments{a.dbeta_partials, 0.f, {}},
        typename PerRow::Arguments{a.c1, 0.f, {}},
        typename PerRow::Arguments{a.c2, 0.f, {}},
        typename Load::Arguments{a.residual_grad, Element(0), P::matrix(a.ld_residual_grad)},
        typename Compute<NormInputGrad, Element>::Arguments{}};
  }
};

}  // namespace coda::epilogues
