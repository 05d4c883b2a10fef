// Epilogue program: Y = act(acc + bias) + residual, optionally keeping, for
// the backward, H = acc + bias or act'(H) (fp16).
//
// The forward of a Linear (+ activation) (+ residual add). The backward's
// act' needs H; storing it here costs one extra write of the tile while it
// is on chip instead of a re-read of Y later. Storing act'(H) instead leaves
// the backward's dgrad only a multiply (ActivationSaver in activation.hpp
// says why). Every leaf is optional at run time (a null pointer turns it
// off), so one instantiation covers linear, linear+bias, +activation,
// +residual, and training (H or act'(H) stored) or inference (not stored).
//
//   Y = plus(                                  root, converted to Element
//         act_and_save(                        AuxStoreL2 + ActivationSaver: act(H) up,
//                                              H or act'(H) stored (null: not stored)
//           plus(acc, bias[n])),               Sm90RowBroadcast (null: 0)
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
  using ActAndSave =
      cutlass::epilogue::fusion::Sm90EVT<typename P::template StoreSaving<ActivationSaver<Element>>, PreAct>;
  using Callbacks = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus, Element>, ActAndSave, typename P::Load>;

  // The run-time leaves, in the order the tree reads them.
  struct Arguments {
    Element const* bias = nullptr;         // (N) or null
    Element* pre_act = nullptr;            // (M, N) H or act'(H), or null
    int64_t ld_pre_act = 0;
    bool save_act_grad = false;            // pre_act gets act'(H) as fp16 bit patterns
    ActivationKind activation = ActivationKind::kIdentity;
    Element const* residual = nullptr;     // (M, N) or null
    int64_t ld_residual = 0;
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    return {
        {                                        // act_and_save(acc + bias)
            {{}, {a.bias, Element(0), {}}, {}},  // acc + bias
            {a.pre_act, P::matrix(a.ld_pre_act), {a.activation, a.save_act_grad}}},  // act, store H / act'(H)
        {a.residual, Element(0), P::matrix(a.ld_residual)},  // residual
        {}};                                     // plus
  }
};

}  // namespace coda::epilogues
