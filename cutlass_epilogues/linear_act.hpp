// Epilogue program: Y = act(acc + bias) + residual, optionally storing H = acc + bias.
//
// The forward of a Linear (+ activation) (+ residual add). H, the
// pre-activation, is what the backward's act' needs; storing it here costs
// one extra write of the tile while it is on chip instead of a re-read of Y
// later. Every leaf is optional at run time (a null pointer turns it off), so
// one instantiation covers linear, linear+bias, +activation, +residual, and
// training (H stored) or inference (not stored).
//
//   Y = plus(                                  root, converted to Element
//         act(                                 RuntimeActivation, kind at run time
//           store_H(                           Sm90AuxStore (null: skipped)
//             plus(acc, bias[n]))),            Sm90RowBroadcast (null: 0)
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
  using StoreH = cutlass::epilogue::fusion::Sm90EVT<typename P::Store, PreAct>;
  using Act = cutlass::epilogue::fusion::Sm90EVT<Compute<RuntimeActivation>, StoreH>;
  using Callbacks = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus, Element>, Act, typename P::Load>;

  // The run-time leaves, in the order the tree reads them.
  struct Arguments {
    Element const* bias = nullptr;         // (N) or null
    Element* pre_act = nullptr;            // (M, N) H, or null
    int64_t ld_pre_act = 0;
    ActivationKind activation = ActivationKind::kIdentity;
    Element const* residual = nullptr;     // (M, N) or null
    int64_t ld_residual = 0;
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    return {
        {                                        // act(store_H(acc + bias))
            {                                    // store_H(acc + bias)
                {{}, {a.bias, Element(0), {}}, {}},  // acc + bias
                {a.pre_act, P::matrix(a.ld_pre_act)}},  // store_H
            {a.activation}},                     // act
        {a.residual, Element(0), P::matrix(a.ld_residual)},  // residual
        {}};                                     // plus
  }
};

}  // namespace coda::epilogues
