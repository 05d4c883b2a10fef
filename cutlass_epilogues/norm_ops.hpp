// The pieces the norm-folding epilogue programs share: the elementwise
// functors of the fold's algebra and the shapes of the per-tile partial
// buffers their reductions write.
//
// A norm folded into the GEMM after it (see norm_linear_act.hpp):
//   Norm(x)·Wᵀ + b = rstd ⊙ (x·W̃ᵀ − mean ⊙ s) + t,   W̃ = W∘γ, s = Σ_k W̃, t = W·β + b
// and its backward (norm_dgrad.hpp) need a handful of 3- to 7-ary
// expressions. Each is one Sm90Compute functor here, so a tree node reads as
// the formula it computes. All math is fp32 (the epilogue's ElementCompute).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/cutlass.h>

#include <cstdint>

namespace coda::epilogues {

namespace detail {

// fn applied element by element to same-shaped fragments (or to scalars:
// Sm90Compute instantiates the scalar form only to look for Arguments).
template <class T>
struct Lanes {
  static constexpr int N = 1;
  CUTLASS_DEVICE static float get(T const& v, int) { return float(v); }
  CUTLASS_DEVICE static void set(T& v, int, float x) { v = T(x); }
};
template <class E, int N_>
struct Lanes<cutlass::Array<E, N_>> {
  static constexpr int N = N_;
  CUTLASS_DEVICE static float get(cutlass::Array<E, N_> const& v, int i) { return float(v[i]); }
  CUTLASS_DEVICE static void set(cutlass::Array<E, N_>& v, int i, float x) { v[i] = E(x); }
};

template <class T, class Fn, class... Ts>
CUTLASS_DEVICE T elementwise(Fn const& fn, Ts const&... in) {
  T out;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < Lanes<T>::N; ++i) Lanes<T>::set(out, i, fn(Lanes<Ts>::get(in, i)...));
  return out;
}

}  // namespace detail

// rstd ⊙ (acc − mean ⊙ s) + t: the folded norm's affine map on the accumulator.
// The subtraction happens on the fp32 accumulator, before any rounding, so the
// large terms of rows with |mean| ≫ std cancel at fp32 precision. Rows whose
// rstd reaches rstd_limit are constant (variance below 2⁻¹⁹·eps): their x̂ is
// 0, so H = t, where the fold would multiply the fp32 rounding of two large
// sums by up to 1/sqrt(eps). RMSNorm subtracts nothing: its limit is +inf.
struct NormAffineArguments {
  float rstd_limit = __builtin_huge_valf();
};

template <class T>
struct NormAffine {
  using Arguments = NormAffineArguments;
  CUTLASS_DEVICE T operator()(T const& acc, T const& mean, T const& rstd, T const& s, T const& t,
                              Arguments const& args) const {
    const float limit = args.rstd_limit;
    return detail::elementwise<T>(
        [limit](float a, float mu, float r, float s_, float t_) { return r < limit ? r * (a - mu * s_) + t_ : t_; },
        acc, mean, rstd, s, t);
  }
};

// (x − mean) ⊙ rstd: the normalized input, recomputed from x and the row stats.
template <class T>
struct Standardize {
  CUTLASS_DEVICE T operator()(T const& x, T const& mean, T const& rstd) const {
    return detail::elementwise<T>([](float x_, float mu, float r) { return (x_ - mu) * r; }, x, mean, rstd);
  }
};

// x̂ ⊙ γ + β: the norm's output, for the weight gradient.
template <class T>
struct ScaleShift {
  CUTLASS_DEVICE T operator()(T const& xhat, T const& gamma, T const& beta) const {
    return detail::elementwise<T>([](float x, float g, float b) { return x * g + b; }, xhat, gamma, beta);
  }
};

// dp ⊙ (h − t): the summand of c₁ (h − t = x̂γ·Wᵀ, the part of the
// pre-activation that depends on x̂).
template <class T>
struct ProductWithShifted {
  CUTLASS_DEVICE T operator()(T const& dp, T const& h, T const& t) const {
    return detail::elementwise<T>([](float d, float h_, float t_) { return d * (h_ - t_); }, dp, h, t);
  }
};

template <class T>
struct Product {
  CUTLASS_DEVICE T operator()(T const& a, T const& b) const {
    return detail::elementwise<T>([](float a_, float b_) { return a_ * b_; }, a, b);
  }
};

// rstd ⊙ (γ ⊙ acc − x̂ ⊙ c₁ − c₂) + dr: the norm's input gradient from the
// dgrad accumulator acc = dP·W, plus the gradient of a residual branch.
template <class T>
struct NormInputGrad {
  CUTLASS_DEVICE T operator()(T const& acc, T const& xhat, T const& gamma, T const& rstd, T const& c1, T const& c2,
                              T const& dr) const {
    return detail::elementwise<T>(
        [](float a, float xh, float g, float r, float c1_, float c2_, float dr_) {
          return r * (g * a - xh * c1_ - c2_) + dr_;
        },
        acc, xhat, gamma, rstd, c1, c2, dr);
  }
};

// The first input, converted: lets a DAG's last node emit one value while the
// nodes it lists only need visiting.
template <class T>
struct First {
  template <class... Rest>
  CUTLASS_DEVICE T operator()(T const& a, Rest const&...) const { return a; }
};

// Per-tile partial sums, CUTLASS's non-final reductions (FinalReduction=false):
//  - over N (Sm90ColReduction, one value per row m): a (RowsPadded(M), TilesN)
//    buffer, element (m, tile) at m + tile * RowsPadded(M);
//  - over M (Sm90RowReduction, one value per column n): a (TilesM, ColsPadded(N))
//    buffer, element (tile, n) at tile * ColsPadded(N) + n.
template <class TileShape>
struct Partials {
  static constexpr int64_t kTileM = cute::size<0>(TileShape{});
  static constexpr int64_t kTileN = cute::size<1>(TileShape{});
  static int64_t tiles_m(int64_t m) { return (m + kTileM - 1) / kTileM; }
  static int64_t tiles_n(int64_t n) { return (n + kTileN - 1) / kTileN; }
  static int64_t rows_padded(int64_t m) { return tiles_m(m) * kTileM; }
  static int64_t cols_padded(int64_t n) { return tiles_n(n) * kTileN; }
  // floats of one reduction over N (per row) / over M (per column)
  static int64_t per_row_floats(int64_t m, int64_t n) { return rows_padded(m) * tiles_n(n); }
  static int64_t per_col_floats(int64_t m, int64_t n) { return tiles_m(m) * cols_padded(n); }
};

}  // namespace coda::epilogues
