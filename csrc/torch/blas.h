// The LM head's plain GEMMs, on cuBLAS with the precision set for each call.
//
// cuBLAS may split K and reduce the partial sums in the output's 16 bits
// (torch allows it by default), rounding a logit twice; which shapes it does
// that for is its heuristics' choice, so a slice of the vocabulary could get
// it where torch's one GEMM of the whole did not. torch's switch for it is
// the process's (at::globalContext()), read by every thread's GEMMs; these
// calls set the math mode of the calling thread's own handle instead, for
// the call only, and hand it back as they found it.
#pragma once

#include <ATen/ATen.h>

namespace coda::torch_ops::blas {

// c = a·b + beta·c, computed and reduced in float32, on the current stream.
// a (M, K) and b (K, N) of one 16-bit dtype, each with a unit stride in
// either dimension (anything else is copied); c (M, N) of a's dtype or
// float32, with unit column stride. beta 0 does not read c. CPU tensors (the
// loss ops' host registration) take the same contract through at::mm.
void matmul(at::Tensor& c, const at::Tensor& a, const at::Tensor& b, float beta);

}  // namespace coda::torch_ops::blas
