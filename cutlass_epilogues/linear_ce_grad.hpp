// Epilogue program: d loss / d logits of the LM head's cross-entropy, in the
// epilogue of the GEMM that recomputes a slice of the logits in the backward.
//
//   dZ = scale[m] · CeGrad(z, class[n], lse[m], target[m]),   z = round(acc + bias[n])
//   CeGrad = (exp(z' − lse)·(1 + 2·z_loss·lse) − ls/V − [class = target]·(1 − ls)) · cap'(z),
//   z' = cap·tanh(z/cap) (cap > 0; else z' = z, cap' = 1), cap' = 1 − (z'/cap)²
//
// The recomputing backward's per-slice cross-entropy pass (write the logits,
// read them, write the gradient over them) becomes this epilogue: the tile is
// turned into its gradient on chip and written once. The logits are rounded
// to Element before the softmax, as the forward's GEMM rounded the logits its
// lse came from, so both see the same values (up to the two GEMMs' orders of
// summation). The per-row vectors are the caller's (csrc/torch/loss_ops.cpp):
// scale is 0 on ignored rows (their gradient is 0 whatever exp gives) and NaN
// on rows whose target lies outside the vocabulary (the row never trains
// silently); the class of each column is data, fp32 (exact below 2^24), so
// the node needs no coordinates.
//
//   dZ = CeGrad(                               Compute, converted to Element
//          round(plus(acc, bias[n])),          Sm90RowBroadcast Element (null: 0), rounded to Element
//          class[n],                           Sm90RowBroadcast fp32
//          lse[m], target[m], scale[m])        Sm90ColBroadcast fp32 (rows past M: 0)
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/functional.h>

#include "norm_ops.hpp"
#include "primitives.hpp"

namespace coda::epilogues {

// softcap: 0 for none; smooth: label_smoothing / V; hit: 1 − label_smoothing;
// z_loss2: 2·z_loss.
struct CeGradArguments {
  float softcap = 0.f, smooth = 0.f, hit = 1.f, z_loss2 = 0.f;
};

template <class T>
struct CeGrad {
  using Arguments = CeGradArguments;
  CUTLASS_DEVICE T operator()(T const& z, T const& cls, T const& lse, T const& target, T const& scale,
                              Arguments const& args) const {
    const float cap = args.softcap, smooth = args.smooth, hit = args.hit, z2 = args.z_loss2;
    return detail::elementwise<T>(
        [=](float z_, float c, float l, float t, float s) {
          if (s == 0.f) return 0.f;
          const float zc = cap > 0.f ? cap * tanhf(z_ / cap) : z_;
          float g = __expf(zc - l) * (1.f + z2 * l) - smooth - (c == t ? hit : 0.f);
          if (cap > 0.f) {
            const float th = zc / cap;
            g *= 1.f - th * th;
          }
          return s * g;
        },
        z, cls, lse, target, scale);
  }
};

template <class Element, class EpilogueDescriptor>
struct LinearCeGrad {
  using P = Primitives<Element, EpilogueDescriptor>;
  template <template <class> class Fn, class Out = float>
  using Compute = typename P::template Compute<Fn, Out>;
  using PerRow = typename P::PerRowF32;
  using PerCol = typename P::PerColF32;

  using Logits = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus, Element>, typename P::Acc,
                                                    typename P::PerCol>;
  using Callbacks = cutlass::epilogue::fusion::Sm90EVT<Compute<CeGrad, Element>, Logits, PerCol, PerRow, PerRow,
                                                       PerRow>;

  struct Arguments {
    Element const* bias = nullptr;     // (N) or null
    float const* classes = nullptr;    // (N) each column's class
    float const* lse = nullptr;        // (M)
    float const* target = nullptr;     // (M) each row's class
    float const* scale = nullptr;      // (M) each row's gradient scale (0: ignored, NaN: target out of range)
    CeGradArguments grad;
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    return {
        {{}, {a.bias, Element(0), {}}, {}},  // round(acc + bias)
        {a.classes, 0.f, {}},                // class[n]
        {a.lse, 0.f, {}},                    // lse[m]
        {a.target, 0.f, {}},                 // target[m]
        {a.scale, 0.f, {}},                  // scale[m]
        a.grad};                             // CeGrad
  }
};

}  // namespace coda::epilogues
