// Epilogue program: Y = act(acc + bias) + residual, optionally storing H = acc + bias
// or act'(H) for the backward.
//
// The forward of a Linear (+ activation) (+ residual add). What the
// backward's act' needs is stored here, while the tile is on chip, instead of
// re-read from Y later: H itself, or act'(H) (RuntimeSavedForBackward, see
// activation.hpp), which leaves the dgrad's epilogue a multiply. Every leaf
// is optional at run time (a null pointer turns it off), so one instantiation
// covers linear, linear+bias, +activation, +residual, and training (H or
// act'(H) stored) or inference (nothing stored).
//
// H feeds two trees (CUTLASS's split-tree visitor: the input tree once, its
// value handed to each output tree as their "accumulator"):
//
//   H = plus(acc, bias[n])                     Sm90RowBroadcast (null: 0)
//   store(saved(H))                            Sm90AuxStore (null: skipped), H or act'(H)
//   Y = plus(                                  root, converted to Element
//         act(H),                              RuntimeActivation, kind at run time
//         residual[m, n])                      Sm90AuxLoad (null: 0, no loads)
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/functional.h>

#include "activation.hpp"
#include "primitives.hpp"

namespace coda::epilogues {

template <class Element, class EpilogueDescriptor>
struct LinearAct {
  using P = Primitives<Element, EpilogueDescriptor>;
  template <template <class> class Fn, class Out = float>
  using Compute = typename P::template Compute<Fn, Out>;

  using PreAct = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus>, typename P::Acc, typename P::PerCol>;
  using H = cutlass::epilogue::fusion::Sm90SplitTreeFetch;
  using Save = cutlass::epilogue::fusion::Sm90EVT<
      typename P::Store, cutlass::epilogue::fusion::Sm90EVT<Compute<RuntimeSavedForBackward>, H>>;
  using Output = cutlass::epilogue::fusion::Sm90EVT<
      Compute<cutlass::plus, Element>, cutlass::epilogue::fusion::Sm90EVT<Compute<RuntimeActivation>, H>,
      typename P::Load>;
  using Callbacks = cutlass::epilogue::fusion::Sm90SplitTreeVisitor<PreAct, Output, Save>;

  // The run-time leaves, in the order the tree reads them.
  struct Arguments {
    Element const* bias = nullptr;         // (N) or null
    Element* pre_act = nullptr;            // (M, N) H or act'(H), or null
    int64_t ld_pre_act = 0;
    ActivationKind activation = ActivationKind::kIdentity;
    bool save_derivative = false;          // pre_act receives act'(H)
    Element const* residual = nullptr;     // (M, N) or null
    int64_t ld_residual = 0;
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    // Nothing stored: saved() passes H through (no act' computed).
    const bool derivative = a.save_derivative && a.pre_act != nullptr;
    // The split tree's arguments: the input tree, the aux output trees, the output tree.
    return {
        {{}, {a.bias, Element(0), {}}, {}},      // H = acc + bias
        {                                        // store(saved(H))
            {{}, {a.activation, derivative}},    // saved(H)
            {a.pre_act, P::matrix(a.ld_pre_act)}},  // store
        {                                        // Y = act(H) + residual
            {{}, {a.activation}},                // act(H)
            {a.residual, Element(0), P::matrix(a.ld_residual)},  // residual
            {}}};                                // plus
  }
};

}  // namespace coda::epilogues
