// The pieces one family of torch ops lends another: a Linear's backward GEMMs
// (linear_ops.cpp) and the RMSNorm fold and backward (norm_ops.cpp).
#pragma once

#include "tensors.h"

namespace coda::torch_ops {

// linear_ops.cpp
Tensor dgrad_of(const Tensor& dy, const Tensor& w, const OptTensor& h, Activation act, const Tensor& dbias);
Tensor wgrad_of(const Tensor& dy, const Tensor& x);
std::tuple<Tensor, Tensor> act_grad_of(const Tensor& dy, const OptTensor& h, Activation act, bool want_dbias);

// norm_ops.cpp: the (2, M) RMSNorm statistics (given or one pass over x), the
// fold (W̃, t), and the norm's backward in the dgrad epilogue -> (dx, N̂, dγ).
Tensor rms_stats_of(const Tensor& x, const OptTensor& stats, double eps);
// y = x·wᵀ + bias + residual and y's row statistics into st (2, M), in one GEMM.
void linear_residual_into(const Tensor& x, const Tensor& w, const OptTensor& bias, const OptTensor& residual,
                          const Tensor& y, bool layernorm, double eps, const Tensor& st);
std::tuple<Tensor, Tensor> rms_fold_of(const Tensor& w, const Tensor& gamma, const OptTensor& bias);
std::tuple<Tensor, Tensor, Tensor> rms_dgrad_of(const Tensor& dp, const Tensor& w, const Tensor& x,
                                                const Tensor& stats, const Tensor& gamma, const Tensor& c1,
                                                const OptTensor& residual_grad, bool want_normalized,
                                                bool want_dgamma);

}  // namespace coda::torch_ops
