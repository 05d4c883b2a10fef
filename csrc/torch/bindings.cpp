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

bool device_supported(int64_t device) { return coda::device_supported(static_cast<int>(device)); }

void set_tuning(int64_t config, int64_t raster, int64_t swizzle) {
  coda::Tuning t;
  t.config = static_cast<int>(config);
  t.raster = static_cast<int>(raster);
  t.swizzle = static_cast<int>(swizzle);
  coda::set_tuning(t);
}

}  // namespace

TORCH_LIBRARY(coda, m) {
  m.def("gemm_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, int activation, bool save_pre_act)"
        " -> (Tensor, Tensor)");
  m.def("gemm_dgrad(Tensor dy, Tensor weight, Tensor? pre_act, int activation, bool compute_dbias)"
        " -> (Tensor, Tensor)");
  m.def("gemm_wgrad(Tensor dy, Tensor x) -> Tensor");
  m.def("device_supported(int device) -> bool", &device_supported);
  m.def("set_tuning(int config, int raster, int swizzle) -> ()", &set_tuning);
}

TORCH_LIBRARY_IMPL(coda, CUDA, m) {
  m.impl("gemm_linear", &gemm_linear);
  m.impl("gemm_dgrad", &gemm_dgrad);
  m.impl("gemm_wgrad", &gemm_wgrad);
}

// Lets `import coda._C` load the library, which registers the ops above.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "coda's compiled kernels (torch.ops.coda)", -1, nullptr};
  return PyModule_Create(&module);
}
