// The LM head's small kernels on the host, for the loss ops' CPU
// registration: the orchestration around them (chunks of tokens, slices of
// the vocabulary, the float32 dW in the gradient's own bytes, the in-place
// rounding) then runs on a machine without a GPU, and its tests compare it
// with float64 there. Each follows the contract of the CUDA function of the
// same name in coda.h, element by element (the same float32 formulas, not
// the same instruction order); only the loss ops call them, and the public
// Python API keeps CPU tensors on its reference path.
#pragma once

#include <ATen/ATen.h>

#include "coda/coda.h"

namespace coda::torch_ops::host {

void cross_entropy(at::ScalarType dtype, const CrossEntropyArgs& args);
// dst may be src (in place: the result fills the buffer's first 2n bytes).
void scale_round(at::ScalarType dtype, const float* src, void* dst, int64_t n, const float* scale);
void scale(at::ScalarType dtype, void* x, int64_t n, const float* scale);
// coda::linear_cross_entropy_grad's GEMM and epilogue into dz (m, n): x (m, k),
// w (n, k) the slice's rows, bias (n) or undefined, the fp32 vectors as its args.
void linear_cross_entropy_grad(at::Tensor& dz, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                               const at::Tensor& classes, const at::Tensor& lse, const at::Tensor& target,
                               const at::Tensor& scale, float label_smoothing, float softcap, float z_loss,
                               int64_t vocab);

}  // namespace coda::torch_ops::host
