// Epilogue program: dH = acc ⊙ act'(H), dbias = Σ_m dH, and the two per-row
// dot products a folded norm's backward needs, in one pass.
//
// In a LayerNormMLP the fc2 dgrad GEMM produces dH, fc1's pre-activation
// gradient, while H (loaded for act') is on chip. The norm in front of fc1
// needs, per token m,
//   c₁ = (1/d) Σ_n dH[m,n] ⊙ (H[m,n] − t[n])     t = W₁·β + b₁
//   c₂ = (1/d) Σ_n dH[m,n] ⊙ s[n]                 s = Σ_k W̃₁[n, k]
// (H − t = x̂γ·W₁ᵀ, so c₁ = mean_k(g ⊙ x̂) and c₂ = mean_k(g) for g = γ ⊙ dH·W₁),
// sums over fc1's output features, i.e. over this GEMM's N. Reducing them here
// leaves the norm's backward no pass over X or g: norm_dgrad.hpp applies them
// in fc1's dgrad epilogue. Both are reduced in fp32 from the unrounded dH.
//
// dH feeds four consumers, so this program is a DAG (Sm90TopologicalVisitor):
//
//   0 acc            4 s[n]                          8 reduce_N(7) -> c₂ partials
//   1 H[m,n]         5 dH ⊙ (H − t)   (2, 1, 3)      9 reduce_M(2) -> dbias partials
//   2 dH = act'(0,1) 6 reduce_N(5) -> c₁ partials   10 convert(9)  -> D = dH
//   3 t[n]           7 dH ⊙ s         (2, 4)
//
// Null c₁/c₂/dbias pointers skip those reductions; CUTLASS's Sm90ColReduction
// reduces over N (per row), Sm90RowReduction over M (per column).
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/functional.h>

#include "activation.hpp"
#include "primitives.hpp"

namespace coda::epilogues {

template <class Element, class EpilogueDescriptor>
struct DActDBiasRowDot {
  using P = Primitives<Element, EpilogueDescriptor>;
  using Partial = typename P::Partial;
  template <template <class> class Fn, class Out = float>
  using Compute = typename P::template Compute<Fn, Out>;
  using H = typename P::Load;
  using PerCol = typename P::PerColF32;
  using ReduceN = typename P::template ReduceN<>;
  using ReduceM = typename P::ReduceM;

  using Edges = cute::tuple<cute::seq<>, cute::seq<>, cute::seq<0, 1>, cute::seq<>, cute::seq<>, cute::seq<2, 1, 3>,
                            cute::seq<5>, cute::seq<2, 4>, cute::seq<7>, cute::seq<2>, cute::seq<9>>;
  using Callbacks = cutlass::epilogue::fusion::Sm90TopologicalVisitor<
      float, Edges,
      cutlass::epilogue::fusion::Sm90AccFetch,   // 0
      H,                                         // 1
      Compute<RuntimeActivationGrad>,            // 2
      PerCol,                                    // 3 t
      PerCol,                                    // 4 s
      Compute<ProductWithShifted>,               // 5
      ReduceN,                                   // 6 c₁
      Compute<Product>,                          // 7
      ReduceN,                                   // 8 c₂
      ReduceM,                                   // 9 dbias
      Compute<First, Element>>;                  // 10

  struct Arguments {
    Element const* pre_act = nullptr;  // (M, N) H
    int64_t ld_pre_act = 0;
    ActivationKind activation = ActivationKind::kIdentity;
    float const* shift = nullptr;      // (N) t
    float const* col_sum = nullptr;    // (N) s, or null
    float* c1_partials = nullptr;      // Partial::per_row_floats(M, N), or null
    float* c2_partials = nullptr;      // Partial::per_row_floats(M, N), or null
    float* dbias_partials = nullptr;   // Partial::per_col_floats(M, N), or null
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    using Args = typename Callbacks::Arguments;
    return Args{
        typename cutlass::epilogue::fusion::Sm90AccFetch::Arguments{},
        typename H::Arguments{a.pre_act, Element(0), P::matrix(a.ld_pre_act)},
        typename Compute<RuntimeActivationGrad>::Arguments{a.activation},
        typename PerCol::Arguments{a.shift, 0.f, {}},
        typename PerCol::Arguments{a.col_sum, 0.f, {}},
        typename Compute<ProductWithShifted>::Arguments{},
        typename ReduceN::Arguments{a.c1_partials, 0.f, {}},
        typename Compute<Product>::Arguments{},
        typename ReduceN::Arguments{a.c2_partials, 0.f, {}},
        typename ReduceM::Arguments{a.dbias_partials, 0.f, {}},
        typename Compute<First, Element>::Arguments{}};
  }
};

}  // namespace coda::epilogues
