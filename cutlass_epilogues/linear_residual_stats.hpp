// Epilogue program: residual-reduce.
//
//   Y = X·Wᵀ + b + R,  and per row, over this tile's columns, Σ y and Σ y²
//
// The GEMM that writes the residual stream (an attention out-projection, an
// MLP's fc2) already holds each output row in registers: reducing it there
// gives the next norm's statistics without reading Y again. Each output tile
// writes its row partials (one fp32 per row and N-tile); finalize_row_stats
// merges the few tiles of a row into mean and rstd. The sums are taken over
// Y as stored (rounded to Element), which is what the next norm reads. Σ y is
// skipped (null) for RMSNorm.
//
//   Y = convert(                               root
//         reduce_N_sum(                        Sm90ColReduction, plus  -> partials (null: skipped)
//           reduce_N_sumsq(                    Sm90ColReduction, y²    -> partials
//             convert<Element>(                the value stored
//               acc + b[n] + R[m, n]))))       Sm90RowBroadcast, Sm90AuxLoad (null: 0)
//
// Sm90ColReduction is CUTLASS's reduction over N (one value per row).
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/functional.h>

#include "primitives.hpp"

namespace coda::epilogues {

template <class Element, class EpilogueDescriptor>
struct LinearResidualStats {
  using P = Primitives<Element, EpilogueDescriptor>;
  using Partial = typename P::Partial;
  template <template <class> class Fn, class Out = float>
  using Compute = typename P::template Compute<Fn, Out>;
  using Identity = Compute<cutlass::epilogue::thread::Identity, Element>;

  using Sum = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus>, typename P::Acc, typename P::PerCol>;
  using WithResidual = cutlass::epilogue::fusion::Sm90EVT<Compute<cutlass::plus>, Sum, typename P::Load>;
  using Rounded = cutlass::epilogue::fusion::Sm90EVT<Identity, WithResidual>;
  using SumSq = cutlass::epilogue::fusion::Sm90EVT<typename P::template ReduceN<cutlass::square_and_plus>, Rounded>;
  using SumY = cutlass::epilogue::fusion::Sm90EVT<typename P::template ReduceN<cutlass::plus>, SumSq>;
  using Callbacks = cutlass::epilogue::fusion::Sm90EVT<Identity, SumY>;

  struct Arguments {
    Element const* bias = nullptr;     // (N) or null
    Element const* residual = nullptr; // (M, N) or null
    int64_t ld_residual = 0;
    float* sum_partials = nullptr;     // Partial::per_row_floats(M, N), or null
    float* sumsq_partials = nullptr;   // Partial::per_row_floats(M, N)
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    return {
        {                                              // reduce_N_sum
            {                                          // reduce_N_sumsq
                {                                      // convert<Element>
                    {                                  // + R
                        {{}, {a.bias, Element(0), {}}, {}},  // acc + b
                        {a.residual, Element(0), P::matrix(a.ld_residual)},
                        {}},
                    {}},
                {a.sumsq_partials, 0.f, {}}},
            {a.sum_partials, 0.f, {}}},
        {}};
  }
};

}  // namespace coda::epilogues
