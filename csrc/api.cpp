// The public API: the argument checks (the only ones on this side of the
// library), the kernel choice (choice.cpp) and the launch (dispatch.cpp).
#include <cstring>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>

#include "coda/coda.h"
#include "error.h"
#include "kernels.h"

namespace coda {

namespace detail {

thread_local std::string last_message;

Status fail(Status status, const std::string& message) {
  last_message = message;
  return status;
}

}  // namespace detail

const char* status_string(Status status) {
  switch (status) {
    case Status::kSuccess: return "success";
    case Status::kInvalidArgument: return "invalid argument";
    case Status::kMisaligned: return "misaligned";
    case Status::kNotSupported: return "not supported";
    case Status::kWorkspaceTooSmall: return "workspace too small";
    case Status::kCudaError: return "CUDA error";
    case Status::kKernelError: return "kernel error";
  }
  return "unknown status";
}

const char* last_error_message() { return detail::last_message.c_str(); }

bool device_supported(int device) {
  static std::once_flag once[64];
  static bool supported[64] = {};
  if (device < 0 || device >= 64) return false;
  std::call_once(once[device], [device] {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) supported[device] = prop.major == 9 && prop.minor == 0;
  });
  return supported[device];
}

bool dgrad_prefers_vendor_gemm(int64_t m, int64_t n, int64_t k, int sms) {
  return kernels::prefer_vendor_gemm(kernels::Program::kDActDBias, m, n, k, sms);
}

bool wgrad_prefers_vendor_gemm(int64_t m, int64_t n, int64_t k, int sms) {
  return kernels::prefer_vendor_gemm(kernels::Program::kWgradStore, m, n, k, sms);
}

namespace {

using kernels::Program;

#define CODA_RETURN_IF_ERROR(expr)          \
  do {                                      \
    Status _s = (expr);                     \
    if (_s != Status::kSuccess) return _s;  \
  } while (0)

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// TMA moves 16-byte rows: every pointer, leading dimension and contiguous
// extent must be a multiple of 16 bytes (8 elements of 16-bit types).
Status check_matrix(const char* name, const void* ptr, int64_t ld, int64_t cols, bool required) {
  if (ptr == nullptr) {
    if (required) return detail::fail(Status::kInvalidArgument, std::string(name) + " is null");
    return Status::kSuccess;
  }
  if (!aligned16(ptr)) return detail::fail(Status::kMisaligned, std::string(name) + " must be 16-byte aligned");
  if (ld < cols) {
    return detail::fail(Status::kInvalidArgument, std::string(name) + ": leading dimension " + std::to_string(ld) +
                                                      " is smaller than its row length " + std::to_string(cols));
  }
  if (ld % 8 != 0 || cols % 8 != 0) {
    return detail::fail(Status::kMisaligned, std::string(name) + ": leading dimension and row length must be "
                                                                 "multiples of 8 elements, got " +
                                                 std::to_string(ld) + " and " + std::to_string(cols));
  }
  return Status::kSuccess;
}

// Vectors are read 16 bytes at a time.
Status check_vector(const char* name, const void* ptr, bool required) {
  if (ptr == nullptr) {
    return required ? detail::fail(Status::kInvalidArgument, std::string(name) + " is null") : Status::kSuccess;
  }
  if (!aligned16(ptr)) return detail::fail(Status::kMisaligned, std::string(name) + " must be 16-byte aligned");
  return Status::kSuccess;
}

Status check_shape(int64_t m, int64_t n, int64_t k) {
  if (m < 0 || n <= 0 || k <= 0) {
    return detail::fail(Status::kInvalidArgument, "sizes must be positive, got m=" + std::to_string(m) +
                                                      " n=" + std::to_string(n) + " k=" + std::to_string(k));
  }
  constexpr int64_t kMax = (int64_t(1) << 31) - 1;
  if (m > kMax || n > kMax || k > kMax) return detail::fail(Status::kNotSupported, "sizes must fit in int32");
  return Status::kSuccess;
}

Status check_dtype(DType dtype) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    return detail::fail(Status::kInvalidArgument, "dtype must be bfloat16 or float16");
  }
  return Status::kSuccess;
}

Status check_activation(Activation act) {
  const int a = static_cast<int>(act);
  if (a < 0 || a > static_cast<int>(Activation::kSiLU)) {
    return detail::fail(Status::kInvalidArgument, "unknown activation " + std::to_string(a));
  }
  return Status::kSuccess;
}

// The norm-folding kernels are built for bf16 only.
Status check_bf16(DType dtype, const char* op) {
  if (dtype != DType::kBFloat16) return detail::fail(Status::kNotSupported, std::string(op) + " has bf16 kernels only");
  return Status::kSuccess;
}

Status check_device() {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    cudaGetLastError();  // not sticky; leave no error behind for the caller
    return detail::fail(Status::kNotSupported, std::string("no usable CUDA device: ") + cudaGetErrorString(e));
  }
  if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string("cudaGetDevice: ") + cudaGetErrorString(e));
  if (!device_supported(device)) {
    return detail::fail(Status::kNotSupported, "coda's kernels are built for sm_90a (H100/H200); device " +
                                                   std::to_string(device) + " is not one");
  }
  // CUTLASS builds its TMA descriptors with a driver call, which needs a
  // current context; a thread whose first CUDA work is a coda op (autograd's
  // backward threads) has none. cudaSetDevice makes the device's primary
  // context current, once per thread and device.
  thread_local int bound_device = -1;
  if (bound_device != device) {
    e = cudaSetDevice(device);
    if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string("cudaSetDevice: ") + cudaGetErrorString(e));
    bound_device = device;
  }
  return Status::kSuccess;
}

Status memset_async(void* ptr, size_t bytes, cudaStream_t stream) {
  if (ptr == nullptr || bytes == 0) return Status::kSuccess;
  cudaError_t e = cudaMemsetAsync(ptr, 0, bytes, stream);
  return e == cudaSuccess ? Status::kSuccess : detail::fail(Status::kCudaError, cudaGetErrorString(e));
}

// One GEMM of program P: D (m, n) = epilogue(A (m, k) · B), as the rule chooses.
struct Operands {
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;
  int64_t ldd;
};

kernels::GemmProblem problem(const kernels::Choice& c, const Operands& o, void* ws, size_t ws_bytes,
                             cudaStream_t stream) {
  kernels::GemmProblem p;
  p.m = o.m; p.n = o.n; p.k = o.k;
  p.a = o.a; p.lda = o.lda;
  p.b = o.b; p.ldb = o.ldb;
  p.d = o.d; p.ldd = o.ldd;
  p.raster = c.raster;
  p.swizzle = c.swizzle;
  p.workspace = ws;
  p.workspace_bytes = ws_bytes;
  p.stream = stream;
  return p;
}

template <Program P>
Status gemm(DType dtype, const Operands& o, const kernels::Epilogue<P>& e, void* ws, size_t ws_bytes,
            cudaStream_t stream) {
  const kernels::Choice c = kernels::choose(P, dtype, o.m, o.n, o.k);
  return kernels::run<P>(dtype, c.config, problem(c, o, ws, ws_bytes, stream), e);
}

template <Program P>
size_t gemm_workspace(DType dtype, const Operands& o, const kernels::Epilogue<P>& e) {
  const kernels::Choice c = kernels::choose(P, dtype, o.m, o.n, o.k);
  return kernels::workspace_size<P>(dtype, c.config, problem(c, o, nullptr, 0, nullptr), e);
}

// ---- each program's GEMM operands, from its public struct (its Steps read the rest)

Operands operands(const LinearArgs& a) { return {a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.y, a.ldy}; }
Operands operands(const DgradArgs& a) { return {a.m, a.n, a.k, a.dy, a.lddy, a.weight, a.ldw, a.dx, a.lddx}; }
Operands operands(const WgradArgs& a) { return {a.m, a.n, a.k, a.dy, a.lddy, a.x, a.ldx, a.dw, a.lddw}; }
Operands operands(const NormLinearArgs& a) { return {a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.y, a.ldy}; }
Operands operands(const LinearResidualArgs& a) { return {a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.y, a.ldy}; }
Operands operands(const NormDgradArgs& a) { return {a.m, a.n, a.k, a.dy, a.lddy, a.weight, a.ldw, a.dx, a.lddx}; }

Operands operands(const NormGluArgs& a) { return {a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.h, a.ldh}; }
// D is (M, F) 32-bit lanes of the (M, 2F) dH.
Operands operands(const GluDgradArgs& a) { return {a.m, a.n, a.k, a.dy, a.lddy, a.weight, a.ldw, a.dh, a.lddh / 2}; }
Operands operands(const NormRopeArgs& a) { return {a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.y, a.ldy}; }
Operands operands(const LinearCrossEntropyGradArgs& a) {
  return {a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.dz, a.lddz};
}

bool has_row_dots(const DgradArgs& a) { return a.norm_c1 != nullptr; }

}  // namespace

// ---- Linear: forward, dgrad, wgrad

Status linear(DType dtype, const LinearArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_activation(a.activation));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("pre_act", a.pre_act, a.ld_pre_act, a.n, false));
  CODA_RETURN_IF_ERROR(check_matrix("residual", a.residual, a.ld_residual, a.n, false));
  CODA_RETURN_IF_ERROR(check_vector("bias", a.bias, false));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return gemm<Program::kLinearAct>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t linear_workspace_size(DType dtype, const LinearArgs& a) {
  return gemm_workspace<Program::kLinearAct>(dtype, operands(a), a);
}

Status dgrad(DType dtype, const DgradArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_activation(a.activation));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dx", a.dx, a.lddx, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("pre_act", a.pre_act, a.ld_pre_act, a.n, false));
  CODA_RETURN_IF_ERROR(check_vector("dbias", a.dbias, false));
  if (a.activation != Activation::kIdentity && a.pre_act == nullptr) {
    return detail::fail(Status::kInvalidArgument, "pre_act is required when activation is not identity");
  }
  if (has_row_dots(a)) {
    CODA_RETURN_IF_ERROR(check_bf16(dtype, "dgrad with norm row dots"));
    if (a.pre_act == nullptr) return detail::fail(Status::kInvalidArgument, "pre_act is required for the norm row dots");
    CODA_RETURN_IF_ERROR(check_vector("norm_shift", a.norm_shift, false));
    CODA_RETURN_IF_ERROR(check_vector("norm_col_sum", a.norm_col_sum, false));
  }
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return memset_async(a.dbias, size_t(a.n) * 2, stream);
  if (has_row_dots(a)) {
    return gemm<Program::kDActRowDot>(dtype, operands(a), a, workspace, workspace_bytes, stream);
  }
  return gemm<Program::kDActDBias>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t dgrad_workspace_size(DType dtype, const DgradArgs& a) {
  if (has_row_dots(a)) return gemm_workspace<Program::kDActRowDot>(dtype, operands(a), a);
  return gemm_workspace<Program::kDActDBias>(dtype, operands(a), a);
}

Status wgrad(DType dtype, const WgradArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_shape(a.k, a.m, a.n));  // the tokens (k here) may be zero
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.m, true));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dw", a.dw, a.lddw, a.n, true));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.k == 0) {
    cudaError_t e = cudaMemset2DAsync(a.dw, a.lddw * 2, 0, a.n * 2, a.m, stream);
    return e == cudaSuccess ? Status::kSuccess : detail::fail(Status::kCudaError, cudaGetErrorString(e));
  }
  return gemm<Program::kWgradStore>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t wgrad_workspace_size(DType dtype, const WgradArgs& a) {
  return gemm_workspace<Program::kWgradStore>(dtype, operands(a), a);
}

// ---- norms folded into GEMMs

Status fold_norm_weight(DType dtype, const FoldNormWeightArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  if (a.n < 0 || a.k <= 0) return detail::fail(Status::kInvalidArgument, "fold_norm_weight: sizes must be positive");
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("folded", a.folded, a.ld_folded, a.k, false));
  CODA_RETURN_IF_ERROR(check_vector("gamma", a.gamma, true));
  CODA_RETURN_IF_ERROR(check_vector("beta", a.beta, false));
  if (a.shift == nullptr) return detail::fail(Status::kInvalidArgument, "shift is null");
  CODA_RETURN_IF_ERROR(check_device());
  return kernels::fold_norm_weight(dtype, a, stream);
}

Status row_stats(DType dtype, const RowStatsArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  if (a.m < 0 || a.n <= 0) return detail::fail(Status::kInvalidArgument, "row_stats: sizes must be positive");
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.n, true));
  if (a.rstd == nullptr) return detail::fail(Status::kInvalidArgument, "rstd is null");
  CODA_RETURN_IF_ERROR(check_device());
  return kernels::row_stats(dtype, a, stream);
}

Status norm_linear(DType dtype, const NormLinearArgs& a, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_activation(a.activation));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("pre_act", a.pre_act, a.ld_pre_act, a.n, false));
  CODA_RETURN_IF_ERROR(check_vector("mean", a.mean, false));
  CODA_RETURN_IF_ERROR(check_vector("rstd", a.rstd, true));
  CODA_RETURN_IF_ERROR(check_vector("col_sum", a.col_sum, false));
  CODA_RETURN_IF_ERROR(check_vector("shift", a.shift, false));
  CODA_RETURN_IF_ERROR(check_bf16(dtype, "norm_linear"));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return gemm<Program::kNormLinearAct>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t norm_linear_workspace_size(DType dtype, const NormLinearArgs& a) {
  return gemm_workspace<Program::kNormLinearAct>(dtype, operands(a), a);
}

Status linear_residual(DType dtype, const LinearResidualArgs& a, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("residual", a.residual, a.ld_residual, a.n, false));
  CODA_RETURN_IF_ERROR(check_vector("bias", a.bias, false));
  if (a.rstd == nullptr) return detail::fail(Status::kInvalidArgument, "rstd is null");
  CODA_RETURN_IF_ERROR(check_bf16(dtype, "linear_residual"));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return gemm<Program::kLinearResidualStats>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t linear_residual_workspace_size(DType dtype, const LinearResidualArgs& a) {
  return gemm_workspace<Program::kLinearResidualStats>(dtype, operands(a), a);
}

Status norm_row_dots(DType dtype, const NormRowDotsArgs& a, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_activation(a.activation));
  if (a.m < 0 || a.n <= 0) return detail::fail(Status::kInvalidArgument, "norm_row_dots: sizes must be positive");
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.n, true));
  const bool needs_h = a.activation != Activation::kIdentity || a.c1 != nullptr;
  CODA_RETURN_IF_ERROR(check_matrix("pre_act", a.pre_act, a.ld_pre_act, a.n, needs_h));
  CODA_RETURN_IF_ERROR(check_matrix("dp", a.dp, a.lddp, a.n, a.activation != Activation::kIdentity));
  CODA_RETURN_IF_ERROR(check_vector("shift", a.shift, false));
  CODA_RETURN_IF_ERROR(check_vector("col_sum", a.col_sum, false));
  if (a.c2 != nullptr && (a.col_sum == nullptr || a.c1 == nullptr)) {
    return detail::fail(Status::kInvalidArgument, "c2 needs c1 and col_sum");
  }
  CODA_RETURN_IF_ERROR(check_device());
  const size_t need = kernels::norm_row_dots_scratch_bytes(a);
  if (workspace_bytes >= need) return kernels::norm_row_dots(dtype, a, workspace, stream);
  if (workspace != nullptr) {
    return detail::fail(Status::kWorkspaceTooSmall,
                        "workspace has " + std::to_string(workspace_bytes) + " bytes, needs " + std::to_string(need));
  }
  void* owned = nullptr;
  cudaError_t e = cudaMallocAsync(&owned, need, stream);
  if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string("cudaMallocAsync: ") + cudaGetErrorString(e));
  Status s = kernels::norm_row_dots(dtype, a, owned, stream);
  cudaFreeAsync(owned, stream);
  return s;
}

size_t norm_row_dots_workspace_size(DType, const NormRowDotsArgs& a) { return kernels::norm_row_dots_scratch_bytes(a); }

Status norm_dgrad(DType dtype, const NormDgradArgs& a, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dx", a.dx, a.lddx, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("residual_grad", a.residual_grad, a.ld_residual_grad, a.n, false));
  CODA_RETURN_IF_ERROR(check_matrix("normalized", a.normalized, a.ld_normalized, a.n, false));
  CODA_RETURN_IF_ERROR(check_vector("mean", a.mean, false));
  CODA_RETURN_IF_ERROR(check_vector("rstd", a.rstd, true));
  CODA_RETURN_IF_ERROR(check_vector("gamma", a.gamma, true));
  CODA_RETURN_IF_ERROR(check_vector("beta", a.beta, false));
  CODA_RETURN_IF_ERROR(check_vector("c1", a.c1, true));
  CODA_RETURN_IF_ERROR(check_vector("c2", a.c2, false));
  CODA_RETURN_IF_ERROR(check_vector("dgamma", a.dgamma, false));
  CODA_RETURN_IF_ERROR(check_vector("dbeta", a.dbeta, false));
  CODA_RETURN_IF_ERROR(check_bf16(dtype, "norm_dgrad"));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) {
    CODA_RETURN_IF_ERROR(memset_async(a.dgamma, size_t(a.n) * 2, stream));
    return memset_async(a.dbeta, size_t(a.n) * 2, stream);
  }
  return gemm<Program::kNormDgrad>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t norm_dgrad_workspace_size(DType dtype, const NormDgradArgs& a) {
  return gemm_workspace<Program::kNormDgrad>(dtype, operands(a), a);
}

// ---- the LLaMA path

Status norm_glu_linear(DType dtype, const NormGluArgs& a, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_activation(a.activation));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  if (a.n % 16 != 0) {
    return detail::fail(Status::kMisaligned, "norm_glu_linear: n (2F) must be a multiple of 16, got " +
                                                 std::to_string(a.n));
  }
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("h", a.h, a.ldh, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("a", a.a, a.lda, a.n / 2, true));
  CODA_RETURN_IF_ERROR(check_vector("rstd", a.rstd, false));
  CODA_RETURN_IF_ERROR(check_bf16(dtype, "norm_glu_linear"));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return gemm<Program::kNormGluLinear>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t norm_glu_linear_workspace_size(DType dtype, const NormGluArgs& a) {
  return gemm_workspace<Program::kNormGluLinear>(dtype, operands(a), a);
}

Status glu_dgrad(DType dtype, const GluDgradArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_activation(a.activation));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("h", a.h, a.ldh, 2 * a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dh", a.dh, a.lddh, 2 * a.n, true));
  CODA_RETURN_IF_ERROR(check_bf16(dtype, "glu_dgrad"));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return gemm<Program::kGluDgradRowDot>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t glu_dgrad_workspace_size(DType dtype, const GluDgradArgs& a) {
  return gemm_workspace<Program::kGluDgradRowDot>(dtype, operands(a), a);
}

Status norm_rope_linear(DType dtype, const NormRopeArgs& a, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.n, true));
  CODA_RETURN_IF_ERROR(check_vector("rstd", a.rstd, false));
  CODA_RETURN_IF_ERROR(check_vector("shift", a.shift, false));
  CODA_RETURN_IF_ERROR(check_vector("positions", a.positions, true));
  CODA_RETURN_IF_ERROR(check_vector("freq", a.freq, true));
  CODA_RETURN_IF_ERROR(check_bf16(dtype, "norm_rope_linear"));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return gemm<Program::kNormRopeLinear>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t norm_rope_linear_workspace_size(DType dtype, const NormRopeArgs& a) {
  return gemm_workspace<Program::kNormRopeLinear>(dtype, operands(a), a);
}

// ---- the LM head's loss: d loss / d logits in the epilogue of the recomputed logits

Status linear_cross_entropy_grad(DType dtype, const LinearCrossEntropyGradArgs& a, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("dz", a.dz, a.lddz, a.n, true));
  CODA_RETURN_IF_ERROR(check_vector("bias", a.bias, false));
  CODA_RETURN_IF_ERROR(check_vector("classes", a.classes, true));
  CODA_RETURN_IF_ERROR(check_vector("lse", a.lse, true));
  CODA_RETURN_IF_ERROR(check_vector("target", a.target, true));
  CODA_RETURN_IF_ERROR(check_vector("scale", a.scale, true));
  if (a.vocab < a.n || a.vocab >= (int64_t(1) << 24)) {
    return detail::fail(Status::kInvalidArgument, "vocab must be at least n and below 2^24 (classes are fp32), got " +
                                                      std::to_string(a.vocab));
  }
  if (!(a.label_smoothing >= 0.f && a.label_smoothing < 1.f) || !(a.softcap >= 0.f)) {
    return detail::fail(Status::kInvalidArgument, "label_smoothing must be in [0, 1) and softcap >= 0");
  }
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return gemm<Program::kLinearCeGrad>(dtype, operands(a), a, workspace, workspace_bytes, stream);
}

size_t linear_cross_entropy_grad_workspace_size(DType dtype, const LinearCrossEntropyGradArgs& a) {
  return gemm_workspace<Program::kLinearCeGrad>(dtype, operands(a), a);
}

Status rope_backward(DType dtype, const RopeBackwardArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  if (a.m < 0 || a.n <= 0 || a.n % 2 != 0) {
    return detail::fail(Status::kInvalidArgument, "rope_backward: m must be >= 0 and n positive and even");
  }
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.n, a.c1 != nullptr));
  CODA_RETURN_IF_ERROR(check_matrix("dp", a.dp, a.lddp, a.n, true));
  CODA_RETURN_IF_ERROR(check_vector("positions", a.positions, true));
  CODA_RETURN_IF_ERROR(check_vector("freq", a.freq, true));
  CODA_RETURN_IF_ERROR(check_vector("shift", a.shift, false));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return kernels::rope_backward(dtype, a, stream);
}

namespace {
Status check_heads(const char* op, int64_t m, int64_t heads, int64_t head_dim) {
  if (m < 0 || heads <= 0 || (head_dim != 64 && head_dim != 128 && head_dim != 256)) {
    return detail::fail(Status::kInvalidArgument, std::string(op) + ": m must be >= 0, heads positive and head_dim "
                                                  "64, 128 or 256, got m " + std::to_string(m) + ", heads " +
                                                  std::to_string(heads) + ", head_dim " + std::to_string(head_dim));
  }
  return Status::kSuccess;
}
}  // namespace

Status dropout_residual(DType dtype, const DropoutResidualArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  if (a.m < 0 || a.n <= 0) return detail::fail(Status::kInvalidArgument, "dropout_residual: sizes must be positive");
  if (!(a.keep > 0.f && a.keep <= 1.f)) {
    return detail::fail(Status::kInvalidArgument, "dropout_residual: keep must be in (0, 1], got " +
                                                  std::to_string(a.keep));
  }
  if ((a.rng.seed_ptr == nullptr) != (a.rng.offset_ptr == nullptr)) {
    return detail::fail(Status::kInvalidArgument, "dropout_residual: rng.seed_ptr and rng.offset_ptr go together");
  }
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("residual", a.residual, a.ld_residual, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.n, true));
  CODA_RETURN_IF_ERROR(check_vector("rng_state", a.rng_state, true));
  CODA_RETURN_IF_ERROR(check_vector("mean", a.mean, false));
  CODA_RETURN_IF_ERROR(check_vector("rstd", a.rstd, false));
  if (a.mean != nullptr && a.rstd == nullptr) {
    return detail::fail(Status::kInvalidArgument, "dropout_residual: mean is written only with rstd");
  }
  CODA_RETURN_IF_ERROR(check_device());
  return kernels::dropout_residual(dtype, a, stream);
}

Status dropout_backward(DType dtype, const DropoutBackwardArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  if (a.m < 0 || a.n <= 0) return detail::fail(Status::kInvalidArgument, "dropout_backward: sizes must be positive");
  if (!(a.keep > 0.f && a.keep <= 1.f)) {
    return detail::fail(Status::kInvalidArgument, "dropout_backward: keep must be in (0, 1], got " +
                                                  std::to_string(a.keep));
  }
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dx", a.dx, a.lddx, a.n, true));
  CODA_RETURN_IF_ERROR(check_vector("rng_state", a.rng_state, true));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return kernels::dropout_backward(dtype, a, stream);
}

Status rmsnorm_residual(DType dtype, const RmsNormResidualArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  if (a.m < 0 || a.n <= 0) return detail::fail(Status::kInvalidArgument, "rmsnorm_residual: sizes must be positive");
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("residual", a.residual, a.ld_residual, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.n, true));
  CODA_RETURN_IF_ERROR(check_vector("weight", a.weight, true));
  CODA_RETURN_IF_ERROR(check_vector("rstd", a.rstd, true));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return kernels::rmsnorm_residual(dtype, a, stream);
}

Status rmsnorm_residual_backward(DType dtype, const RmsNormResidualBackwardArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  if (a.m < 0 || a.n <= 0) {
    return detail::fail(Status::kInvalidArgument, "rmsnorm_residual_backward: sizes must be positive");
  }
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dx", a.dx, a.lddx, a.n, true));
  CODA_RETURN_IF_ERROR(check_vector("weight", a.weight, true));
  CODA_RETURN_IF_ERROR(check_vector("rstd", a.rstd, true));
  CODA_RETURN_IF_ERROR(check_vector("dweight_partials", a.dweight_partials, false));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return kernels::rmsnorm_residual_backward(dtype, a, stream);
}

int64_t rmsnorm_residual_partials(int64_t m) { return kernels::rmsnorm_residual_partials(m); }

Status head_norm_rope(DType dtype, const HeadNormRopeArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_heads("head_norm_rope", a.m, a.heads, a.head_dim));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.heads * a.head_dim, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.heads * a.head_dim, true));
  CODA_RETURN_IF_ERROR(check_vector("weight", a.weight, true));
  CODA_RETURN_IF_ERROR(check_vector("positions", a.positions, true));
  CODA_RETURN_IF_ERROR(check_vector("inv_freq", a.inv_freq, true));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return kernels::head_norm_rope(dtype, a, stream);
}

Status head_norm_rope_backward(DType dtype, const HeadNormRopeBackwardArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  CODA_RETURN_IF_ERROR(check_heads("head_norm_rope_backward", a.m, a.heads, a.head_dim));
  const int64_t n = a.heads * a.head_dim;
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, n, true));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dx", a.dx, a.lddx, n, true));
  CODA_RETURN_IF_ERROR(check_vector("weight", a.weight, true));
  CODA_RETURN_IF_ERROR(check_vector("positions", a.positions, true));
  CODA_RETURN_IF_ERROR(check_vector("inv_freq", a.inv_freq, true));
  CODA_RETURN_IF_ERROR(check_vector("dweight_partials", a.dweight_partials, false));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return kernels::head_norm_rope_backward(dtype, a, stream);
}

int64_t head_norm_rope_partials(int64_t m, int64_t heads) { return kernels::head_norm_rope_partials(m, heads); }

Status cross_entropy(DType dtype, const CrossEntropyArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype(dtype));
  if (a.m < 0 || a.n <= 0) return detail::fail(Status::kInvalidArgument, "cross_entropy: m must be >= 0 and n positive");
  if (a.logits == nullptr || a.target == nullptr || (a.loss == nullptr && a.lse_in == nullptr)) {
    return detail::fail(Status::kInvalidArgument,
                        "cross_entropy: logits, target and loss (or lse_in) must not be null");
  }
  if (a.vocab < 0) return detail::fail(Status::kInvalidArgument, "cross_entropy: vocab must be >= 0 (0: n)");
  const int64_t vocab = a.vocab > 0 ? a.vocab : a.n;
  const bool sliced = a.lse_in != nullptr || a.partial != nullptr;
  if (sliced ? (a.col0 < 0 || a.col0 + a.n > vocab || (a.lse_in != nullptr) == (a.partial != nullptr) ||
                (a.lse_in != nullptr && !a.write_grad) || (a.partial != nullptr && a.write_grad))
             : (a.col0 != 0 || vocab != a.n)) {
    return detail::fail(Status::kInvalidArgument, "cross_entropy: a slice of the vocabulary (col0 " +
                                                  std::to_string(a.col0) + ", n " + std::to_string(a.n) +
                                                  ", vocab " + std::to_string(vocab) +
                                                  ") must lie inside it and take either partial (no write_grad) "
                                                  "or lse_in (write_grad)");
  }
  if (!aligned16(a.logits) || a.ld % 8 != 0 || a.ld < a.n) {
    return detail::fail(Status::kMisaligned, "cross_entropy: logits must be 16-byte aligned with a leading dimension "
                                             ">= n and a multiple of 8, got " + std::to_string(a.ld));
  }
  if (!(a.label_smoothing >= 0.f && a.label_smoothing <= 1.f) || !(a.softcap >= 0.f) || !(a.z_loss >= 0.f)) {
    return detail::fail(Status::kInvalidArgument, "cross_entropy: label_smoothing must be in [0, 1], softcap and "
                                                  "z_loss >= 0");
  }
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  return kernels::cross_entropy(dtype, a, stream);
}

Status scale(DType dtype, void* x, int64_t n, const float* s, cudaStream_t stream) {
  if (n < 0) return detail::fail(Status::kInvalidArgument, "scale: n must be >= 0");
  if (n > 0 && (x == nullptr || s == nullptr)) {
    return detail::fail(Status::kInvalidArgument, "scale: x and scale must not be null");
  }
  CODA_RETURN_IF_ERROR(check_device());
  return kernels::scale(dtype, x, n, s, stream);
}

Status scale_round(DType dtype, const float* src, void* dst, int64_t n, const float* s, cudaStream_t stream) {
  if (n < 0) return detail::fail(Status::kInvalidArgument, "scale_round: n must be >= 0");
  if (n > 0 && (src == nullptr || dst == nullptr)) {
    return detail::fail(Status::kInvalidArgument, "scale_round: src and dst must not be null");
  }
  const char *s0 = static_cast<const char*>(static_cast<const void*>(src)), *d0 = static_cast<const char*>(dst);
  if (n > 0 && s0 != d0 && s0 < d0 + 2 * n && d0 < s0 + 4 * n) {
    return detail::fail(Status::kInvalidArgument, "scale_round: dst must be src itself or not overlap it");
  }
  CODA_RETURN_IF_ERROR(check_device());
  return kernels::scale_round(dtype, src, dst, n, s, stream);
}

}  // namespace coda
