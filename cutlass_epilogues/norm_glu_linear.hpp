// Epilogue program: the gate/up GEMM of a gated MLP (SwiGLU, GeGLU), with an
// RMSNorm folded in as norm_linear_act.hpp folds it.
//
//   H = rstd ⊙ acc (+ t),  acc = X·W̃ᵀ,  W̃ = W_gu∘γ with gate and up rows interleaved
//   D = H (M, 2F), the backward's input;  A = act(g) ⊙ u (M, F), the down projection's input
//
// A is computed from H as stored (rounded), so the backward, which reloads H,
// differentiates exactly the A the forward wrote.
//
//   D = H = round(                                 stored as D (M, 2F)
//         NormAffine(acc, 0, rstd[m], 0, t[n]))    Sm90ColBroadcast fp32 (null: 1), Sm90RowBroadcast (null: 0)
//   A = act(H[:, 2j]) ⊙ H[:, 2j+1]                 GluNarrowStore (M, F), kind at run time
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>

#include "activation.hpp"
#include "glu_nodes.hpp"
#include "primitives.hpp"

namespace coda::epilogues {

template <class Element, class EpilogueDescriptor>
struct NormGluLinear {
  using P = Primitives<Element, EpilogueDescriptor>;
  template <template <class> class Fn, class Out = float>
  using Compute = typename P::template Compute<Fn, Out>;
  using PerRow = typename P::PerRowF32;
  using PerCol = typename P::PerColF32;
  using EpiTile = typename P::EpilogueTile;
  static constexpr int kEpiM = decltype(cute::size<0>(EpiTile{}))::value;
  static constexpr int kEpiN = decltype(cute::size<1>(EpiTile{}))::value;
  using NarrowTile = cute::Shape<cute::Int<kEpiM>, cute::Int<kEpiN / 2>>;
  using SmemAtomNarrow = decltype(cutlass::epilogue::collective::detail::sm90_get_epilogue_smem_swizzle_layout_atom<
                                  typename P::StrideMN, Element, NarrowTile>());
  using StoreA = GluNarrowStore<EpilogueDescriptor::AuxStoreStages, EpiTile, Element, SmemAtomNarrow>;

  using PreAct = fusion::Sm90EVT<Compute<NormAffine>, typename P::Acc, PerRow, PerRow, PerCol, PerCol>;
  using Rounded = fusion::Sm90EVT<Compute<cutlass::epilogue::thread::Identity, Element>, PreAct>;
  using GluA = fusion::Sm90EVT<StoreA, Rounded>;
  using Callbacks = fusion::Sm90EVT<Compute<cutlass::epilogue::thread::Identity, Element>, GluA>;

  struct Arguments {
    float const* rstd = nullptr;   // (M) or null (no norm)
    float const* shift = nullptr;  // (2F) t, or null
    Element* act_out = nullptr;    // (M, F) A
    int64_t ld_act_out = 0;
    ActivationKind activation = ActivationKind::kSiLU;
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    return {
        {                                          // A = act(g)·u, H passed on
            {                                      // round(H)
                {                                  // NormAffine(acc, mean, rstd, s, t)
                    {},                            // acc
                    {nullptr, 0.f, {}},            // mean: RMSNorm subtracts nothing
                    {a.rstd, 1.f, {}},             // rstd[m]
                    {nullptr, 0.f, {}},            // s
                    {a.shift, 0.f, {}},            // t[n]
                    {}},                           // rstd_limit: +inf
                {}},
            {a.act_out, a.ld_act_out, a.activation}},
        {}};                                       // D = H
  }
};

}  // namespace coda::epilogues
