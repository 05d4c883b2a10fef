// Epilogue program: an RMSNorm folded into the QKV projection, with the
// rotary position embedding (RoPE) applied to the output tile.
//
//   Y = RoPE(H),  H = rstd ⊙ acc + t,   acc = X·W̃ᵀ
//
// with W̃ = W∘γ and t = b (fold_norm_weight; see norm_linear_act.hpp for the
// fold). RoPE rotates each adjacent column pair (2j, 2j+1) of row m by
//   φ = 2π·pos[m]·(freq[2j] + freq[2j+1]):   (x0, x1) → (x0 cos φ − x1 sin φ, x0 sin φ + x1 cos φ)
//
// Why adjacent pairs: a thread's 16 values of one epilogue visit are 8 pairs
// of adjacent columns of one row (benchmarks/design/llama/README.md, A), so
// a pair never leaves the thread. Hugging Face's rotate-half partners (j,
// j + hd/2) become adjacent by permuting the q/k head rows of W once
// (python/coda/ops/rope.py); q·kᵀ is unchanged by a permutation q and k share.
//
// Why the frequencies are data: freq[n] holds, per column, the rotation of
// its pair in turns per position, τ = inv_freq/2π split into hi (at the even
// column) + lo (at the odd one), built in float64 on the host; v's columns
// hold 0, a rotation by exactly 0. So the node needs no coordinates, no head
// size and no q/k/v boundaries, and scaled variants (llama3, NTK) are host data.
//
//   Y = RopePairs(                       rotate (2j, 2j+1) by 2π·pos·(hi + lo)
//         NormAffine(acc,                rstd ⊙ acc + t (mean, s null: RMSNorm)
//                    mean = 0, rstd[m],  Sm90ColBroadcast fp32 (null: 1, no norm)
//                    s = 0, t[n]),       Sm90RowBroadcast fp32 (null: 0)
//         pos[m],                        Sm90ColBroadcast int32 → fp32 (exact below 2^24)
//         freq[n])                       Sm90RowBroadcast fp32, hi at even n, lo at odd n
//
// The backward (csrc/rope_kernels.cu) rotates by −φ with the same
// rope_sincos, so forward and backward agree on every angle bit for bit.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

#include <cstdint>

#include "norm_ops.hpp"
#include "primitives.hpp"
#include "rope_angle.hpp"

namespace coda::epilogues {

// RoPE on a fragment whose elements (2i, 2i+1) are one row's adjacent
// columns (2j, 2j+1): h the values, pos the row's position (per element),
// freq the per-column hi/lo turns, so the pair's hi is freq[2i] and its lo
// freq[2i+1], both in the same fragment.
template <class T>
struct RopePairs {
  CUTLASS_DEVICE T operator()(T const& h, T const& pos, T const& freq) const {
    using L = detail::Lanes<T>;
    static_assert(L::N % 2 == 0, "RoPE pairs need whole column pairs in one fragment");
    T out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < L::N; i += 2) {
      float s, c;
      rope_sincos(L::get(pos, i), L::get(freq, i), L::get(freq, i + 1), s, c);
      const float x0 = L::get(h, i), x1 = L::get(h, i + 1);
      L::set(out, i, x0 * c - x1 * s);
      L::set(out, i + 1, x0 * s + x1 * c);
    }
    return out;
  }
};

template <class Element, class EpilogueDescriptor>
struct NormRopeLinear {
  using P = Primitives<Element, EpilogueDescriptor>;
  template <template <class> class Fn, class Out = float>
  using Compute = typename P::template Compute<Fn, Out>;
  using PerRow = typename P::PerRowF32;
  using PerCol = typename P::PerColF32;
  // int32 positions converted to fp32 as they are loaded; rows past M hold 0.
  using Pos = ZeroOutsideRows<cutlass::epilogue::fusion::Sm90ColBroadcast<
      0, typename P::TileShape, int32_t, float, typename P::StrideColVec, P::kAlignmentF32>>;

  using PreAct = cutlass::epilogue::fusion::Sm90EVT<Compute<NormAffine>, typename P::Acc, PerRow, PerRow, PerCol, PerCol>;
  using Callbacks = cutlass::epilogue::fusion::Sm90EVT<Compute<RopePairs, Element>, PreAct, Pos, PerCol>;

  struct Arguments {
    float const* rstd = nullptr;         // (M), or null (no norm)
    float const* shift = nullptr;        // (N) t = b, or null
    int32_t const* positions = nullptr;  // (M)
    float const* freq = nullptr;         // (N) hi/lo turns per pair, 0 on v's columns
  };

  static typename Callbacks::Arguments to_callbacks(Arguments const& a) {
    return {
        {                                // NormAffine(acc, mean, rstd, s, t)
            {},                          // acc
            {nullptr, 0.f, {}},          // mean[m] = 0
            {a.rstd, 1.f, {}},           // rstd[m]
            {nullptr, 0.f, {}},          // s[n] = 0
            {a.shift, 0.f, {}},          // t[n]
            {}},                         // rstd_limit: +inf (RMSNorm)
        {a.positions, 0, {}},            // pos[m]
        {a.freq, 0.f, {}},               // freq[n]
        {}};                             // RopePairs
  }
};

}  // namespace coda::epilogues
