// Epilogue program: the down projection's dgrad of a gated MLP, with the
// gate's backward and the RMSNorm row dot in front of the gate/up GEMM.
//
//   acc = dA = dY·W_down (M, F);  (g, u) = H[:, 2j], H[:, 2j+1]
//   du = dA ⊙ act(g),  dg = dA ⊙ u ⊙ act'(g),  D = dH = (dg, du) interleaved (M, 2F)
//   c₁ partials = Σ_n (dg·g + du·u)   (the RMSNorm's Σ dH ⊙ (H − t), t = 0)
//
// H (M, 2F) is loaded as (M, F) 32-bit lanes, one pair per accumulator
// element, and dH is D in the same lanes (ElementD = float: bits, never
// arithmetic). The gate's backward hands 2F values to its parent (the packed
// dH, then the row-dot terms from the unrounded dg, du): a tree, because
// Sm90TreeVisitor passes a child's value on as it is, where a DAG
// (Sm90TopologicalVisitor) would keep it as F floats.
//
//   D = ReduceUpperHalf(                 c₁ partials += Σ_n upper half; lower half on
//         GluBackward(acc, H32))         (packed (dg, du), dg·g + du·u)
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

#include "activation.hpp"
#include "glu_nodes.hpp"
#include "primitives.hpp"

namespace coda::epilogues {

template <class Element, class EpilogueDescriptor>
struct GluDgradRowDot {
  using ElementD = float;  // dH as (M, F) 32-bit lanes = (M, 2F) Element
  using P = Primitives<Element, EpilogueDescriptor>;
  using Partial = typename P::Partial;
  using EpiTile = typename P::EpilogueTile;
  using SmemAtom32 = decltype(cutlass::epilogue::collective::detail::sm90_get_epilogue_smem_swizzle_layout_atom<
                              typename P::StrideMN, float, EpiTile>());
  using H32 = fusion::Sm90AuxLoad<EpilogueDescriptor::AuxLoadStages, EpiTile, float, typename P::StrideMN, SmemAtom32,
                                  decltype(cutlass::epilogue::collective::detail::sm90_get_smem_load_op_for_source<
                                           typename P::StrideMN, float, EpiTile>()),
                                  4>;
  using Bwd = fusion::Sm90EVT<GluBackwardNode<Element>, fusion::Sm90AccFetch, H32>;
  using C1 = ReduceUpperHalf<typename P::template ReduceN<>>;
  using Callbacks = fusion::Sm90EVT<C1, Bwd>;

  struct Arguments {
    Element const* pre_act = nullptr;  // (M, 2F) H, (g, u) adjacent
    int64_t ld_pre_act = 0;            // in Elements, even
    ActivationKind activation = ActivationKind::kSiLU;
    float* c1_partials = nullptr;      // Partial::per_row_floats(M, F), or null
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    return {
        {                                                                          // GluBackward(acc, H32)
            {},                                                                    // acc
            {reinterpret_cast<float const*>(a.pre_act), 0.f, P::matrix(a.ld_pre_act / 2)},  // H as pairs
            {a.activation}},
        {a.c1_partials, 0.f, {}}};                                                 // c₁ partials
  }
};

}  // namespace coda::epilogues
