// Activations chosen at run time, as CUTLASS epilogue compute functors.
//
// One GEMM instantiation serves every activation: the kind travels in the
// node's Arguments (Sm90Compute hands them to the functor as its last
// argument), so adding an activation costs a branch, not a kernel.
// The branch is uniform across the grid, so it costs no divergence, and it
// is taken once per fragment (see detail::dispatch).
#pragma once

#include <cutlass/array.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>

#include <type_traits>

namespace coda::epilogues {

// Values are part of the public ABI (coda::Activation mirrors them).
enum class ActivationKind : int {
  kIdentity = 0,
  kGeluTanh = 1,
  kGeluErf = 2,
  kReLU = 3,
  kSiLU = 4,
};

struct ActivationArguments {
  ActivationKind kind = ActivationKind::kIdentity;
};

namespace detail {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluTanhCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// The tanh GELU's argument sqrt(2/pi)·(x + 0.044715·x³), as x·(k + k·c·x²):
// three FP32 ops around the tanh. A cooperative kernel's epilogue does not
// overlap its MMAs, so each op per element shows in the GEMM's time.
CUTLASS_DEVICE float gelu_tanh_arg(float x, float x2) {
  return x * fmaf(kSqrt2OverPi * kGeluTanhCubic, x2, kSqrt2OverPi);
}

template <ActivationKind K>
CUTLASS_DEVICE float act(float x) {
  if constexpr (K == ActivationKind::kGeluTanh) {
    float t = cutlass::fast_tanh(gelu_tanh_arg(x, x * x));
    float half_x = 0.5f * x;
    return fmaf(half_x, t, half_x);  // x/2 · (1 + t)
  } else if constexpr (K == ActivationKind::kGeluErf) {
    return 0.5f * x * (1.f + erff(x * kInvSqrt2));
  } else if constexpr (K == ActivationKind::kReLU) {
    return x > 0.f ? x : 0.f;
  } else if constexpr (K == ActivationKind::kSiLU) {
    return x / (1.f + __expf(-x));
  } else {
    return x;
  }
}

// d act(h) / dh
template <ActivationKind K>
CUTLASS_DEVICE float act_grad(float h) {
  if constexpr (K == ActivationKind::kGeluTanh) {
    // (1 + t)/2 + h·(1 − t²) · sqrt(2/pi)/2 · (1 + 3c·h²)
    float h2 = h * h;
    float t = cutlass::fast_tanh(gelu_tanh_arg(h, h2));
    float du = fmaf(1.5f * kSqrt2OverPi * kGeluTanhCubic, h2, 0.5f * kSqrt2OverPi);
    return fmaf(h * fmaf(-t, t, 1.f), du, fmaf(0.5f, t, 0.5f));
  } else if constexpr (K == ActivationKind::kGeluErf) {
    return 0.5f * (1.f + erff(h * kInvSqrt2)) + h * kInvSqrt2Pi * __expf(-0.5f * h * h);
  } else if constexpr (K == ActivationKind::kReLU) {
    return h > 0.f ? 1.f : 0.f;
  } else if constexpr (K == ActivationKind::kSiLU) {
    float s = 1.f / (1.f + __expf(-h));
    return s * (1.f + h * (1.f - s));
  } else {
    return 1.f;
  }
}

// Calls fn(std::integral_constant<ActivationKind, K>) for the run-time kind.
// The test happens once per fragment, outside the element loops: a switch
// inside them compiles to an indirect branch per element and a kernel many
// times larger and slower.
template <class Fn>
CUTLASS_DEVICE auto dispatch(ActivationKind kind, Fn&& fn) {
  using K = ActivationKind;
  if (kind == K::kGeluTanh) return fn(std::integral_constant<K, K::kGeluTanh>{});
  if (kind == K::kGeluErf) return fn(std::integral_constant<K, K::kGeluErf>{});
  if (kind == K::kReLU) return fn(std::integral_constant<K, K::kReLU>{});
  if (kind == K::kSiLU) return fn(std::integral_constant<K, K::kSiLU>{});
  return fn(std::integral_constant<K, K::kIdentity>{});
}

}  // namespace detail

// y = act(x). Sm90Compute instantiates the scalar form only to find Arguments.
template <class T>
struct RuntimeActivation {
  using Arguments = ActivationArguments;
  CUTLASS_DEVICE T operator()(T const& x, Arguments const& args) const {
    return detail::dispatch(args.kind, [&](auto k) { return T(detail::act<decltype(k)::value>(float(x))); });
  }
};

template <class T, int N>
struct RuntimeActivation<cutlass::Array<T, N>> {
  using Arguments = ActivationArguments;
  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& x, Arguments const& args) const {
    return detail::dispatch(args.kind, [&](auto k) {
      cutlass::Array<T, N> y;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) y[i] = T(detail::act<decltype(k)::value>(float(x[i])));
      return y;
    });
  }
};

// dh = dy * act'(h): the backward of RuntimeActivation, fed the saved pre-activation.
template <class T>
struct RuntimeActivationGrad {
  using Arguments = ActivationArguments;
  CUTLASS_DEVICE T operator()(T const& dy, T const& h, Arguments const& args) const {
    return detail::dispatch(args.kind,
                            [&](auto k) { return T(float(dy) * detail::act_grad<decltype(k)::value>(float(h))); });
  }
};

template <class T, int N>
struct RuntimeActivationGrad<cutlass::Array<T, N>> {
  using Arguments = ActivationArguments;
  CUTLASS_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& dy, cutlass::Array<T, N> const& h,
                                                 Arguments const& args) const {
    return detail::dispatch(args.kind, [&](auto k) {
      cutlass::Array<T, N> dh;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) dh[i] = T(float(dy[i]) * detail::act_grad<decltype(k)::value>(float(h[i])));
      return dh;
    });
  }
};

}  // namespace coda::epilogues
