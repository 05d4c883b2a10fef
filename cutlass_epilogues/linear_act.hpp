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

namespace coda::epilogues {

template <class Element, class EpilogueDescriptor>
struct LinearAct {
  using ElementCompute = float;
  static constexpr auto Round = cutlass::FloatRoundStyle::round_to_nearest;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;
  using TileShape = typename EpilogueDescriptor::TileShape;
  using Layout = cutlass::layout::RowMajor;

  using HDesc = cutlass::epilogue::collective::detail::AuxStoreDescriptor<EpilogueDescriptor, Layout, Element>;
  using RDesc = cutlass::epilogue::collective::detail::AuxLoadDescriptor<EpilogueDescriptor, Layout, Element>;
  using StrideMN = typename HDesc::Stride;
  using StrideBias = cute::Stride<cute::_0, cute::_1, int64_t>;

  template <template <class> class Fn, class Out = ElementCompute>
  using Compute = cutlass::epilogue::fusion::Sm90Compute<Fn, Out, ElementCompute, Round>;

  using Bias = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Element, ElementCompute, StrideBias, kAlignment>;
  using PreAct = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus>, cutlass::epilogue::fusion::Sm90AccFetch, Bias>;
  using StoreH = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90AuxStore<HDesc::Stages, typename EpilogueDescriptor::EpilogueTile, Element, Round,
                                              StrideMN, typename HDesc::SmemLayoutAtom, typename HDesc::CopyOpR2S, kAlignment>,
      PreAct>;
  using Act = cutlass::epilogue::fusion::Sm90EVT<Compute<RuntimeActivation>, StoreH>;
  using Residual = cutlass::epilogue::fusion::Sm90AuxLoad<RDesc::Stages, typename EpilogueDescriptor::EpilogueTile, Element,
                                                          StrideMN, typename RDesc::SmemLayoutAtom, typename RDesc::CopyOpS2R,
                                                          kAlignment>;
  using Callbacks = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus, Element>, Act, Residual>;

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
    StrideMN dH = cute::make_stride(a.ld_pre_act, cute::_1{}, int64_t(0));
    StrideMN dR = cute::make_stride(a.ld_residual, cute::_1{}, int64_t(0));
    return {
        {                                        // act(store_H(acc + bias))
            {                                    // store_H(acc + bias)
                {{}, {a.bias, Element(0), {}}, {}},  // acc + bias
                {a.pre_act, dH}},                // store_H
            {a.activation}},                     // act
        {a.residual, Element(0), dR},            // residual
        {}};                                     // plus
  }
};

}  // namespace coda::epilogues
