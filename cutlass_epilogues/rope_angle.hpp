// The rotary angle of one column pair, shared by the RoPE epilogue
// (rope.hpp) and the RoPE backward kernel (csrc/rope_kernels.cu): one
// definition, so forward and backward agree on every angle bit for bit.
// Plain CUDA, no CUTLASS.
#pragma once

namespace coda::epilogues {

// sin and cos of 2π·pos·(hi + lo), (hi, lo) the float-float turns per
// position of one pair.
//
// Why turns: an angle in radians reaches 2π·2^24·τ, and reducing it mod 2π
// in fp32 loses everything below its ulp (Hugging Face's fp32 pipeline is
// off by ~6e-3 rad at position 128K). In turns the reduction is mod 1 and
// exact: t = pos·hi rounded, its rounding error recovered exactly by an
// fmaf (pos is an integer below 2^24, exact in fp32), pos·lo added to it;
// t − round(t) is exact (Sterbenz: the integer is 0 or within 2x of t). The
// reduced r in [−0.5, 0.5] turns keeps the MUFU __sincosf in [−π, π], where
// its absolute error is ~2^-21.4; the angle before it is off by ~3e-7 rad
// (benchmarks/design/llama/rope_angle_check.py, θ = 500000, positions ≤ 128K).
//
// round(t) is the 1.5·2^23 magic add (round to nearest for |t| < 2^22;
// pos·hi < 2^24/2π): an FADD, where FRND shares its pipe with the MUFU.
// The product is __fmul_rn so that the compiler cannot contract it into
// the adds after it: fma(pos, hi, −q) would round the exact product and
// count its error a second time through lo.
__device__ __forceinline__ void rope_sincos(float pos, float hi, float lo, float& s, float& c) {
  const float t = __fmul_rn(pos, hi);                         // turns, rounded
  const float err = fmaf(pos, lo, fmaf(pos, hi, -t));         // exact product error + the low part
  const float q = __fsub_rn(__fadd_rn(t, 12582912.f), 12582912.f);  // nearest integer to t
  const float r = __fadd_rn(__fsub_rn(t, q), err);            // the angle mod 1 turn, in [−0.5, 0.5]
  __sincosf(6.28318530717958647692f * r, &s, &c);
}

}  // namespace coda::epilogues
