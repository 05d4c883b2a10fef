// coda._C: the kernels as torch.library ops (schemas and CUDA kernels here;
// fake kernels, autograd and the fused ops in python/coda/).
//
// These ops take kernel-ready tensors: 2-D, bf16/fp16, on an sm_90 device,
// rows 16-byte aligned. The Python layer decides when a call is kernel-ready
// and sends everything else to the reference path.
#include <Python.h>

#include <c10/cuda/CUDAStream.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "coda/coda.h"

namespace {

coda::DType dtype_of(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return coda::DType::kBFloat16;
  if (t.scalar_type() == at::kHalf) return coda::DType::kFloat16;
  TORCH_CHECK(false, "coda: ", name, " must be bfloat16 or float16, got ", t.scalar_type());
}

void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 2, "coda: ", name, " must be 2-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_cuda(), "coda: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == like.device(), "coda: ", name, " is on ", t.device(), ", expected ", like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "coda: ", name, " has dtype ", t.scalar_type(), ", expected ",
              like.scalar_type());
  TORCH_CHECK(t.stride(1) == 1, "coda: ", name, " must have contiguous rows (stride(1) == 1), got strides ",
              t.strides());
}

void check_vector(const at::Tensor& t, const char* name, int64_t n, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "coda: ", name, " must have shape (", n, "), got ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), "coda: ", name, " is on ", t.device(), ", expected ", like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "coda: ", name, " has dtype ", t.scalar_type(), ", expected ",
              like.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "coda: ", name, " must be contiguous");
}

void check_status(coda::Status s, const char* op) {
  TORCH_CHECK(s == coda::Status::kSuccess, "coda::", op, " failed (", coda::status_string(s),
              "): ", coda::last_error_message());
}

coda::Activation activation_of(int64_t a) {
  TORCH_CHECK(a >= 0 && a <= static_cast<int64_t>(coda::Activation::kSiLU), "coda: unknown activation code ", a);
  return static_cast<coda::Activation>(a);
}

at::Tensor workspace(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

// y = act(x·wᵀ + bias) + residual; pre_act = x·wᵀ + bias when save_pre_act (else an empty tensor).
std::tuple<at::Tensor, at::Tensor> gemm_linear(const at::Tensor& x, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias,
                                               const std::optional<at::Tensor>& residual, int64_t activation,
                                               bool save_pre_act) {
  check_matrix(x, "x", x);
  check_matrix(weight, "weight", x);
  TORCH_CHECK(weight.size(1) == x.size(1), "coda: weight must have shape (N, ", x.size(1), "), got ", weight.sizes());
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  if (bias) check_vector(*bias, "bias", n, x);
  if (residual) {
    check_matrix(*residual, "residual", x);
    TORCH_CHECK(residual->size(0) == m && residual->size(1) == n, "coda: residual must have shape (", m, ", ", n,
                "), got ", residual->sizes());
  }
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({m, n}, x.options());
  at::Tensor h = save_pre_act ? at::empty({m, n}, x.options()) : at::empty({0}, x.options());

  coda::LinearArgs a;
  a.m = m; a.n = n; a.k = k;
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = weight.data_ptr(); a.ldw = weight.stride(0);
  a.bias = bias ? bias->data_ptr() : nullptr;
  a.activation = activation_of(activation);
  a.residual = residual ? residual->data_ptr() : nullptr;
  a.ld_residual = residual ? residual->stride(0) : 0;
  a.y = y.data_ptr(); a.ldy = y.stride(0);
  a.pre_act = save_pre_act ? h.data_ptr() : nullptr;
  a.ld_pre_act = save_pre_act ? h.stride(0) : 0;
  coda::DType dt = dtype_of(x, "x");
  at::Tensor ws = workspace(coda::linear_workspace_size(dt, a), x);
  check_status(coda::linear(dt, a, ws.data_ptr(), ws.numel(), c10::cuda::getCurrentCUDAStream()), "gemm_linear");
  return {y, h};
}

// dx = (dy·weight) ⊙ act'(pre_act); dbias = Σ_rows dx when compute_dbias (else empty).
std::tuple<at::Tensor, at::Tensor> gemm_dgrad(const at::Tensor& dy, const at::Tensor& weight,
                                              const std::optional<at::Tensor>& pre_act, int64_t activation,
                                              bool compute_dbias) {
  check_matrix(dy, "dy", dy);
  check_matrix(weight, "weight", dy);
  TORCH_CHECK(weight.size(0) == dy.size(1), "coda: weight must have shape (", dy.size(1), ", N), got ",
              weight.sizes());
  const int64_t m = dy.size(0), n = weight.size(1), k = dy.size(1);
  coda::Activation act = activation_of(activation);
  TORCH_CHECK(act == coda::Activation::kIdentity || pre_act.has_value(),
              "coda: pre_act is required when the activation is not identity");
  if (pre_act) {
    check_matrix(*pre_act, "pre_act", dy);
    TORCH_CHECK(pre_act->size(0) == m && pre_act->size(1) == n, "coda: pre_act must have shape (", m, ", ", n,
                "), got ", pre_act->sizes());
  }
  c10::cuda::CUDAGuard guard(dy.device());
  at::Tensor dx = at::empty({m, n}, dy.options());
  at::Tensor db = compute_dbias ? at::empty({n}, dy.options()) : at::empty({0}, dy.options());

  coda::DgradArgs a;
  a.m = m; a.n = n; a.k = k;
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.weight = weight.data_ptr(); a.ldw = weight.stride(0);
  a.activation = act;
  a.pre_act = pre_act ? pre_act->data_ptr() : nullptr;
  a.ld_pre_act = pre_act ? pre_act->stride(0) : 0;
  a.dx = dx.data_ptr(); a.lddx = dx.stride(0);
  a.dbias = compute_dbias ? db.data_ptr() : nullptr;
  coda::DType dt = dtype_of(dy, "dy");
  at::Tensor ws = workspace(coda::dgrad_workspace_size(dt, a), dy);
  check_status(coda::dgrad(dt, a, ws.data_ptr(), ws.numel(), c10::cuda::getCurrentCUDAStream()), "gemm_dgrad");
  return {dx, db};
}

// dw = dyᵀ·x
at::Tensor gemm_wgrad(const at::Tensor& dy, const at::Tensor& x) {
  check_matrix(dy, "dy", dy);
  check_matrix(x, "x", dy);
  TORCH_CHECK(x.size(0) == dy.size(0), "coda: x must have ", dy.size(0), " rows like dy, got ", x.sizes());
  c10::cuda::CUDAGuard guard(dy.device());
  at::Tensor dw = at::empty({dy.size(1), x.size(1)}, dy.options());
  coda::WgradArgs a;
  a.m = dy.size(1); a.n = x.size(1); a.k = dy.size(0);
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.dw = dw.data_ptr(); a.lddw = dw.stride(0);
  coda::DType dt = dtype_of(dy, "dy");
  at::Tensor ws = workspace(coda::wgrad_workspace_size(dt, a), dy);
  check_status(coda::wgrad(dt, a, ws.data_ptr(), ws.numel(), c10::cuda::getCurrentCUDAStream()), "gemm_wgrad");
  return dw;
}

// ---- norms folded into GEMMs (bf16 kernels)

void check_f32_vector(const at::Tensor& t, const char* name, int64_t n, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "coda: ", name, " must have shape (", n, "), got ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), "coda: ", name, " is on ", t.device(), ", expected ", like.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "coda: ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "coda: ", name, " must be contiguous");
}

const float* f32_or_null(const std::optional<at::Tensor>& t) {
  return t && t->numel() ? t->data_ptr<float>() : nullptr;
}

at::Tensor f32(int64_t n, const at::Tensor& like) { return at::empty({n}, like.options().dtype(at::kFloat)); }

// (folded W̃ or empty, s, t): W̃ = W∘γ, s = Σ_k W̃, t = W·β + b.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_fold_weight(const at::Tensor& weight, const at::Tensor& gamma,
                                                                const std::optional<at::Tensor>& beta,
                                                                const std::optional<at::Tensor>& bias,
                                                                bool want_folded) {
  check_matrix(weight, "weight", weight);
  const int64_t n = weight.size(0), k = weight.size(1);
  check_vector(gamma, "gamma", k, weight);
  if (beta) check_vector(*beta, "beta", k, weight);
  if (bias) check_vector(*bias, "bias", n, weight);
  c10::cuda::CUDAGuard guard(weight.device());
  at::Tensor folded = want_folded ? at::empty_like(weight, at::MemoryFormat::Contiguous) : at::empty({0}, weight.options());
  at::Tensor s = f32(n, weight), t = f32(n, weight);
  coda::FoldNormWeightArgs a;
  a.n = n; a.k = k;
  a.weight = weight.data_ptr(); a.ldw = weight.stride(0);
  a.gamma = gamma.data_ptr();
  a.beta = beta ? beta->data_ptr() : nullptr;
  a.bias = bias ? bias->data_ptr() : nullptr;
  a.folded = want_folded ? folded.data_ptr() : nullptr;
  a.ld_folded = want_folded ? folded.stride(0) : 0;
  a.col_sum = s.data_ptr<float>();
  a.shift = t.data_ptr<float>();
  check_status(coda::fold_norm_weight(dtype_of(weight, "weight"), a, c10::cuda::getCurrentCUDAStream()),
               "norm_fold_weight");
  return {folded, s, t};
}

// (mean or empty for RMSNorm, rstd), fp32 per row.
std::tuple<at::Tensor, at::Tensor> norm_row_stats(const at::Tensor& x, bool layernorm, double eps) {
  check_matrix(x, "x", x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor mean = layernorm ? f32(x.size(0), x) : at::empty({0}, x.options().dtype(at::kFloat));
  at::Tensor rstd = f32(x.size(0), x);
  coda::RowStatsArgs a;
  a.m = x.size(0); a.n = x.size(1);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.eps = static_cast<float>(eps);
  a.mean = layernorm ? mean.data_ptr<float>() : nullptr;
  a.rstd = rstd.data_ptr<float>();
  check_status(coda::row_stats(dtype_of(x, "x"), a, c10::cuda::getCurrentCUDAStream()), "norm_row_stats");
  return {mean, rstd};
}

// y = act(h), h = rstd ⊙ (x·W̃ᵀ − mean ⊙ s) + t.
std::tuple<at::Tensor, at::Tensor> gemm_norm_linear(const at::Tensor& x, const at::Tensor& folded,
                                                    const std::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                                    const std::optional<at::Tensor>& col_sum,
                                                    const std::optional<at::Tensor>& shift, int64_t activation,
                                                    bool save_pre_act) {
  check_matrix(x, "x", x);
  check_matrix(folded, "weight", x);
  TORCH_CHECK(folded.size(1) == x.size(1), "coda: weight must have shape (N, ", x.size(1), "), got ", folded.sizes());
  const int64_t m = x.size(0), n = folded.size(0), k = x.size(1);
  if (mean && mean->numel()) check_f32_vector(*mean, "mean", m, x);
  check_f32_vector(rstd, "rstd", m, x);
  if (col_sum && col_sum->numel()) check_f32_vector(*col_sum, "col_sum", n, x);
  if (shift) check_f32_vector(*shift, "shift", n, x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({m, n}, x.options());
  at::Tensor h = save_pre_act ? at::empty({m, n}, x.options()) : at::empty({0}, x.options());
  coda::NormLinearArgs a;
  a.m = m; a.n = n; a.k = k;
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = folded.data_ptr(); a.ldw = folded.stride(0);
  a.mean = f32_or_null(mean);
  a.rstd = rstd.data_ptr<float>();
  a.col_sum = f32_or_null(col_sum);
  a.shift = f32_or_null(shift);
  a.activation = activation_of(activation);
  a.y = y.data_ptr(); a.ldy = y.stride(0);
  a.pre_act = save_pre_act ? h.data_ptr() : nullptr;
  a.ld_pre_act = save_pre_act ? h.stride(0) : 0;
  coda::DType dt = dtype_of(x, "x");
  at::Tensor ws = workspace(coda::norm_linear_workspace_size(dt, a), x);
  check_status(coda::norm_linear(dt, a, ws.data_ptr(), ws.numel(), c10::cuda::getCurrentCUDAStream()),
               "gemm_norm_linear");
  return {y, h};
}

// y = x·wᵀ + bias + residual, with the row statistics of y: (y, mean or empty, rstd).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gemm_linear_residual(const at::Tensor& x, const at::Tensor& weight,
                                                                    const std::optional<at::Tensor>& bias,
                                                                    const std::optional<at::Tensor>& residual,
                                                                    bool layernorm, double eps) {
  check_matrix(x, "x", x);
  check_matrix(weight, "weight", x);
  TORCH_CHECK(weight.size(1) == x.size(1), "coda: weight must have shape (N, ", x.size(1), "), got ", weight.sizes());
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  if (bias) check_vector(*bias, "bias", n, x);
  if (residual) {
    check_matrix(*residual, "residual", x);
    TORCH_CHECK(residual->size(0) == m && residual->size(1) == n, "coda: residual must have shape (", m, ", ", n,
                "), got ", residual->sizes());
  }
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({m, n}, x.options());
  at::Tensor mean = layernorm ? f32(m, x) : at::empty({0}, x.options().dtype(at::kFloat));
  at::Tensor rstd = f32(m, x);
  coda::LinearResidualArgs a;
  a.m = m; a.n = n; a.k = k;
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.weight = weight.data_ptr(); a.ldw = weight.stride(0);
  a.bias = bias ? bias->data_ptr() : nullptr;
  a.residual = residual ? residual->data_ptr() : nullptr;
  a.ld_residual = residual ? residual->stride(0) : 0;
  a.y = y.data_ptr(); a.ldy = y.stride(0);
  a.eps = static_cast<float>(eps);
  a.mean = layernorm ? mean.data_ptr<float>() : nullptr;
  a.rstd = rstd.data_ptr<float>();
  coda::DType dt = dtype_of(x, "x");
  at::Tensor ws = workspace(coda::linear_residual_workspace_size(dt, a), x);
  check_status(coda::linear_residual(dt, a, ws.data_ptr(), ws.numel(), c10::cuda::getCurrentCUDAStream()),
               "gemm_linear_residual");
  return {y, mean, rstd};
}

// fc2's dgrad for a norm-MLP: (dh, dbias or empty, c1, c2 or empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gemm_dgrad_rowdot(
    const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& pre_act, int64_t activation, bool compute_dbias,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& col_sum, double scale) {
  check_matrix(dy, "dy", dy);
  check_matrix(weight, "weight", dy);
  check_matrix(pre_act, "pre_act", dy);
  TORCH_CHECK(weight.size(0) == dy.size(1), "coda: weight must have shape (", dy.size(1), ", N), got ",
              weight.sizes());
  const int64_t m = dy.size(0), n = weight.size(1), k = dy.size(1);
  TORCH_CHECK(pre_act.size(0) == m && pre_act.size(1) == n, "coda: pre_act must have shape (", m, ", ", n, "), got ",
              pre_act.sizes());
  if (shift) check_f32_vector(*shift, "shift", n, dy);
  const bool with_c2 = col_sum && col_sum->numel();
  if (with_c2) check_f32_vector(*col_sum, "col_sum", n, dy);
  c10::cuda::CUDAGuard guard(dy.device());
  at::Tensor dx = at::empty({m, n}, dy.options());
  at::Tensor db = compute_dbias ? at::empty({n}, dy.options()) : at::empty({0}, dy.options());
  at::Tensor c1 = f32(m, dy);
  at::Tensor c2 = with_c2 ? f32(m, dy) : at::empty({0}, dy.options().dtype(at::kFloat));
  coda::DgradArgs a;
  a.m = m; a.n = n; a.k = k;
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.weight = weight.data_ptr(); a.ldw = weight.stride(0);
  a.activation = activation_of(activation);
  a.pre_act = pre_act.data_ptr(); a.ld_pre_act = pre_act.stride(0);
  a.dx = dx.data_ptr(); a.lddx = dx.stride(0);
  a.dbias = compute_dbias ? db.data_ptr() : nullptr;
  a.norm_shift = f32_or_null(shift);
  a.norm_col_sum = with_c2 ? col_sum->data_ptr<float>() : nullptr;
  a.norm_scale = static_cast<float>(scale);
  a.norm_c1 = c1.data_ptr<float>();
  a.norm_c2 = with_c2 ? c2.data_ptr<float>() : nullptr;
  coda::DType dt = dtype_of(dy, "dy");
  at::Tensor ws = workspace(coda::dgrad_workspace_size(dt, a), dy);
  check_status(coda::dgrad(dt, a, ws.data_ptr(), ws.numel(), c10::cuda::getCurrentCUDAStream()), "gemm_dgrad_rowdot");
  return {dx, db, c1, c2};
}

// A lone norm-linear's backward epilogue: (dp or empty with identity, c1, c2 or empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_row_dots(
    const at::Tensor& dy, const at::Tensor& pre_act, int64_t activation, const std::optional<at::Tensor>& shift,
    const std::optional<at::Tensor>& col_sum, double scale, bool compute_dbias) {
  check_matrix(dy, "dy", dy);
  check_matrix(pre_act, "pre_act", dy);
  TORCH_CHECK(pre_act.sizes() == dy.sizes(), "coda: pre_act must have shape ", dy.sizes(), ", got ", pre_act.sizes());
  const int64_t m = dy.size(0), n = dy.size(1);
  if (shift) check_f32_vector(*shift, "shift", n, dy);
  const bool with_c2 = col_sum && col_sum->numel();
  if (with_c2) check_f32_vector(*col_sum, "col_sum", n, dy);
  coda::Activation act = activation_of(activation);
  c10::cuda::CUDAGuard guard(dy.device());
  const bool write_dp = act != coda::Activation::kIdentity;
  at::Tensor dp = write_dp ? at::empty({m, n}, dy.options()) : at::empty({0}, dy.options());
  at::Tensor c1 = f32(m, dy);
  at::Tensor c2 = with_c2 ? f32(m, dy) : at::empty({0}, dy.options().dtype(at::kFloat));
  at::Tensor dbias = at::empty({compute_dbias ? n : 0}, dy.options());
  coda::NormRowDotsArgs a;
  a.m = m; a.n = n;
  a.dy = dy.data_ptr(); a.lddy = dy.stride(0);
  a.pre_act = pre_act.data_ptr(); a.ld_pre_act = pre_act.stride(0);
  a.activation = act;
  a.shift = f32_or_null(shift);
  a.col_sum = with_c2 ? col_sum->data_ptr<float>() : nullptr;
  a.scale = static_cast<float>(scale);
  a.dp = write_dp ? dp.data_ptr() : nullptr;
  a.lddp = write_dp ? dp.stride(0) : 0;
  a.c1 = c1.data_ptr<float>();
  a.c2 = with_c2 ? c2.data_ptr<float>() : nullptr;
  a.dbias = compute_dbias ? dbias.data_ptr() : nullptr;
  const coda::DType dt = dtype_of(dy, "dy");
  at::Tensor ws = workspace(coda::norm_row_dots_workspace_size(dt, a), dy);
  check_status(coda::norm_row_dots(dt, a, ws.data_ptr(), ws.numel(), c10::cuda::getCurrentCUDAStream()),
               "norm_row_dots");
  return {dp, c1, c2, dbias};
}

// (dx, normalized N̂, dgamma, dbeta or empty) of a norm-GEMM's input.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gemm_norm_dgrad(
    const at::Tensor& dp, const at::Tensor& weight, const at::Tensor& x, const std::optional<at::Tensor>& mean,
    const at::Tensor& rstd, const at::Tensor& gamma, const std::optional<at::Tensor>& beta, const at::Tensor& c1,
    const std::optional<at::Tensor>& c2, const std::optional<at::Tensor>& residual_grad, bool want_normalized,
    bool want_dgamma) {
  check_matrix(dp, "dp", dp);
  check_matrix(weight, "weight", dp);
  check_matrix(x, "x", dp);
  TORCH_CHECK(weight.size(0) == dp.size(1), "coda: weight must have shape (", dp.size(1), ", N), got ",
              weight.sizes());
  const int64_t m = dp.size(0), n = weight.size(1), k = dp.size(1);
  TORCH_CHECK(x.size(0) == m && x.size(1) == n, "coda: x must have shape (", m, ", ", n, "), got ", x.sizes());
  const bool layernorm = mean && mean->numel();
  if (layernorm) check_f32_vector(*mean, "mean", m, dp);
  check_f32_vector(rstd, "rstd", m, dp);
  check_vector(gamma, "gamma", n, dp);
  const bool with_beta = beta.has_value();
  if (with_beta) check_vector(*beta, "beta", n, dp);
  check_f32_vector(c1, "c1", m, dp);
  if (c2 && c2->numel()) check_f32_vector(*c2, "c2", m, dp);
  if (residual_grad) {
    check_matrix(*residual_grad, "residual_grad", dp);
    TORCH_CHECK(residual_grad->size(0) == m && residual_grad->size(1) == n, "coda: residual_grad must have shape (",
                m, ", ", n, "), got ", residual_grad->sizes());
  }
  c10::cuda::CUDAGuard guard(dp.device());
  at::Tensor dx = at::empty({m, n}, dp.options());
  at::Tensor nhat = want_normalized ? at::empty({m, n}, dp.options()) : at::empty({0}, dp.options());
  at::Tensor dgamma = want_dgamma ? at::empty({n}, dp.options()) : at::empty({0}, dp.options());
  at::Tensor dbeta = want_dgamma && with_beta ? at::empty({n}, dp.options()) : at::empty({0}, dp.options());
  coda::NormDgradArgs a;
  a.m = m; a.n = n; a.k = k;
  a.dy = dp.data_ptr(); a.lddy = dp.stride(0);
  a.weight = weight.data_ptr(); a.ldw = weight.stride(0);
  a.x = x.data_ptr(); a.ldx = x.stride(0);
  a.mean = layernorm ? mean->data_ptr<float>() : nullptr;
  a.rstd = rstd.data_ptr<float>();
  a.gamma = gamma.data_ptr();
  a.beta = with_beta ? beta->data_ptr() : nullptr;
  a.c1 = c1.data_ptr<float>();
  a.c2 = f32_or_null(c2);
  a.residual_grad = residual_grad ? residual_grad->data_ptr() : nullptr;
  a.ld_residual_grad = residual_grad ? residual_grad->stride(0) : 0;
  a.dx = dx.data_ptr(); a.lddx = dx.stride(0);
  a.normalized = want_normalized ? nhat.data_ptr() : nullptr;
  a.ld_normalized = want_normalized ? nhat.stride(0) : 0;
  a.dgamma = want_dgamma ? dgamma.data_ptr() : nullptr;
  a.dbeta = want_dgamma && with_beta ? dbeta.data_ptr() : nullptr;
  coda::DType dt = dtype_of(dp, "dp");
  at::Tensor ws = workspace(coda::norm_dgrad_workspace_size(dt, a), dp);
  check_status(coda::norm_dgrad(dt, a, ws.data_ptr(), ws.numel(), c10::cuda::getCurrentCUDAStream()),
               "gemm_norm_dgrad");
  return {dx, nhat, dgamma, dbeta};
}

bool device_supported(int64_t device) { return coda::device_supported(static_cast<int>(device)); }

void set_tuning(int64_t config, int64_t raster, int64_t swizzle, int64_t store_l2, int64_t alternate_k) {
  coda::Tuning t;
  t.config = static_cast<int>(config);
  t.raster = static_cast<int>(raster);
  t.swizzle = static_cast<int>(swizzle);
  t.store_l2 = static_cast<int>(store_l2);
  t.alternate_k = static_cast<int>(alternate_k);
  coda::set_tuning(t);
}

std::string kernel_configs(const std::string& op) { return coda::kernel_configs(op.c_str()); }

}  // namespace

TORCH_LIBRARY(coda, m) {
  m.def("gemm_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, int activation, bool save_pre_act)"
        " -> (Tensor, Tensor)");
  m.def("gemm_dgrad(Tensor dy, Tensor weight, Tensor? pre_act, int activation, bool compute_dbias)"
        " -> (Tensor, Tensor)");
  m.def("gemm_wgrad(Tensor dy, Tensor x) -> Tensor");
  m.def("norm_fold_weight(Tensor weight, Tensor gamma, Tensor? beta, Tensor? bias, bool want_folded)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("norm_row_stats(Tensor x, bool layernorm, float eps) -> (Tensor, Tensor)");
  m.def("gemm_norm_linear(Tensor x, Tensor weight, Tensor? mean, Tensor rstd, Tensor? col_sum, Tensor? shift,"
        " int activation, bool save_pre_act) -> (Tensor, Tensor)");
  m.def("gemm_linear_residual(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, bool layernorm, float eps)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("gemm_dgrad_rowdot(Tensor dy, Tensor weight, Tensor pre_act, int activation, bool compute_dbias,"
        " Tensor? shift, Tensor? col_sum, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("norm_row_dots(Tensor dy, Tensor pre_act, int activation, Tensor? shift, Tensor? col_sum, float scale,"
        " bool compute_dbias) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("gemm_norm_dgrad(Tensor dp, Tensor weight, Tensor x, Tensor? mean, Tensor rstd, Tensor gamma, Tensor? beta,"
        " Tensor c1, Tensor? c2, Tensor? residual_grad, bool want_normalized, bool want_dgamma)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("device_supported(int device) -> bool", &device_supported);
  m.def("set_tuning(int config, int raster, int swizzle, int store_l2=-1, int alternate_k=-1) -> ()", &set_tuning);
  m.def("kernel_configs(str op) -> str", &kernel_configs);
}

TORCH_LIBRARY_IMPL(coda, CUDA, m) {
  m.impl("gemm_linear", &gemm_linear);
  m.impl("gemm_dgrad", &gemm_dgrad);
  m.impl("gemm_wgrad", &gemm_wgrad);
  m.impl("norm_fold_weight", &norm_fold_weight);
  m.impl("norm_row_stats", &norm_row_stats);
  m.impl("gemm_norm_linear", &gemm_norm_linear);
  m.impl("gemm_linear_residual", &gemm_linear_residual);
  m.impl("gemm_dgrad_rowdot", &gemm_dgrad_rowdot);
  m.impl("norm_row_dots", &norm_row_dots);
  m.impl("gemm_norm_dgrad", &gemm_norm_dgrad);
}

// Lets `import coda._C` load the library, which registers the ops above.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "coda's compiled kernels (torch.ops.coda)", -1, nullptr};
  return PyModule_Create(&module);
}
