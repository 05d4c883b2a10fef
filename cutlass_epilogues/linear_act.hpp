// Epilogue program: Y = act(acc + bias) + residual, optionally keeping, for
// the backward, H = acc + bias or act'(H).
//
// The forward of a Linear (+ activation) (+ residual add). The backward's
// act' needs H; storing it (or act'(H), SavedForBackward in activation.hpp)
// here costs one extra write of the tile while it is on chip instead of a
// re-read of Y later. Every leaf is optional at run time (a null pointer
// turns it off), so one instantiation covers linear, linear+bias,
// +activation, +residual, and training (H or act'(H) stored) or inference.
//
// H feeds two trees, so the program is CUTLASS's split tree (a DAG whose
// shared input is evaluated once):
//
//   H = plus(acc, bias[n])                     input tree; Sm90RowBroadcast (null: 0)
//   store(saved(H))                            Sm90AuxStore (null: skipped); H or act'(H)
//   Y = plus(act(H), residual[m, n])           root, converted to Element;
//                                              RuntimeActivation, Sm90AuxLoad (null: 0, no loads)
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

  using H = cutlass::epilogue::fusion::Sm90SplitTreeFetch;  // the input tree's value, in the others

  using PreAct = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus>, typename P::Acc, typename P::PerCol>;
  using Saved = cutlass::epilogue::fusion::Sm90EVT<typename P::Store,
                                                   cutlass::epilogue::fusion::Sm90EVT<Compute<SavedForBackward>, H>>;
  using Act = cutlass::epilogue::fusion::Sm90EVT<Compute<RuntimeActivation>, H>;
  using Output = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus, Element>, Act, typename P::Load>;
  using Callbacks = cutlass::epilogue::fusion::Sm90SplitTreeVisitor<PreAct, Output, Saved>;

  // The run-time leaves, in the order the tree reads them.
  struct Arguments {
    Element const* bias = nullptr;         // (N) or null
    Element* pre_act = nullptr;            // (M, N) H or act'(H), or null
    int64_t ld_pre_act = 0;
    bool save_act_grad = false;            // pre_act gets act'(H)
    ActivationKind activation = ActivationKind::kIdentity;
    Element const* residual = nullptr;     // (M, N) or null
    int64_t ld_residual = 0;
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    return {
        {{}, {a.bias, Element(0), {}}, {}},                   // H = acc + bias
        {                                                     // store(saved(H))
            {{}, {a.activation, a.save_act_grad}},            // saved(H)
            {a.pre_act, P::matrix(a.ld_pre_act)}},            // store
        {                                                     // act(H) + residual
            {{}, {a.activation}},                             // act(H)
            {a.residual, Element(0), P::matrix(a.ld_residual)},  // residual
            {}}};                                             // plus
  }
};

}  // namespace coda::epilogues
