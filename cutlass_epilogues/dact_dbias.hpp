// Epilogue program: dH = acc * act'(H), and dbias[n] = sum over rows of dH.
//
// The dgrad GEMM of the layer after an activation computes acc = dY·W, the
// gradient of the activation's output. Applying act' here, with the saved
// pre-activation H loaded tile by tile, and reducing the bias gradient over
// the tokens (M) in the same pass removes two passes over the (M, N)
// activation gradient. dbias is reduced in fp32 from the unrounded dH.
// With act = identity and null H / dbias it is the plain dgrad.
//
//   dH = convert(                              root, converted to Element
//          reduce_M(                           Sm90RowReduction -> per-tile partials (null: skipped)
//            act_grad(acc, H[m, n])))          Sm90AuxLoad (null: 0)
//
// act'(H) is computed here from the saved H, not saved by the forward: at
// the power cap GELU' costs about as much in fc1's forward as here, and the
// forward then also stores it (benchmarks/NOTES.md, "fc1 saves act'(H)").
//
// Each output tile writes its column sums to a (ceil(M/TileM), N rounded up
// to TileN) fp32 buffer; a small column-sum kernel finishes dbias. CUTLASS's
// in-kernel final reduction (tile counters, a fence and two more barriers per
// tile, the last CTA of each column summing serially) costs the GEMM far more,
// most in the ping-pong kernel.
//
// CUTLASS's Sm90RowReduction is the one that reduces over M (one value per
// column n); Sm90ColReduction reduces over N.
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/functional.h>

#include "activation.hpp"
#include "primitives.hpp"

namespace coda::epilogues {

template <class Element, class EpilogueDescriptor>
struct DActDBias {
  using P = Primitives<Element, EpilogueDescriptor>;
  using Partial = typename P::Partial;
  template <template <class> class Fn, class Out = float>
  using Compute = typename P::template Compute<Fn, Out>;

  using DAct = cutlass::epilogue::fusion::Sm90EVT<Compute<RuntimeActivationGrad>, typename P::Acc, typename P::Load>;
  using DBias = cutlass::epilogue::fusion::Sm90EVT<typename P::ReduceM, DAct>;
  using Callbacks = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::epilogue::thread::Identity, Element>, DBias>;

  struct Arguments {
    Element const* pre_act = nullptr;      // (M, N) H, or null
    int64_t ld_pre_act = 0;
    ActivationKind activation = ActivationKind::kIdentity;
    float* dbias_partials = nullptr;       // Partial::per_col_floats(M, N), or null
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    return {
        {                                        // reduce_M(act_grad(acc, H))
            {{}, {a.pre_act, Element(0), P::matrix(a.ld_pre_act)}, {a.activation}},  // act_grad(acc, H)
            {a.dbias_partials, 0.f, {}}},  // reduce_M -> partials
        {}};                                     // convert
  }
};

}  // namespace coda::epilogues
