// The public API: checks the arguments, picks a kernel, runs it.
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

namespace {

std::mutex tuning_mutex;
Tuning tuning_override;

Tuning current_tuning() {
  std::lock_guard<std::mutex> lock(tuning_mutex);
  return tuning_override;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// TMA moves 16-byte rows: every pointer, leading dimension and contiguous
// extent must be a multiple of 16 bytes (8 elements of 16-bit types).
Status check_matrix(const char* name, const void* ptr, int64_t ld, int64_t cols, bool required) {
  if (ptr == nullptr) {
    if (required) return detail::fail(Status::kInvalidArgument, std::string(name) + " is null");
    return Status::kSuccess;
  }
  if (!aligned16(ptr)) {
    return detail::fail(Status::kMisaligned, std::string(name) + " must be 16-byte aligned");
  }
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

Status check_shape(int64_t m, int64_t n, int64_t k) {
  if (m < 0 || n <= 0 || k <= 0) {
    return detail::fail(Status::kInvalidArgument, "sizes must be positive, got m=" + std::to_string(m) +
                                                      " n=" + std::to_string(n) + " k=" + std::to_string(k));
  }
  constexpr int64_t kMax = (int64_t(1) << 31) - 1;
  if (m > kMax || n > kMax || k > kMax) {
    return detail::fail(Status::kNotSupported, "sizes must fit in int32");
  }
  return Status::kSuccess;
}

Status check_device() {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string("cudaGetDevice: ") + cudaGetErrorString(e));
  if (!device_supported(device)) {
    return detail::fail(Status::kNotSupported, "coda's kernels are built for sm_90a (H100/H200); device " +
                                                   std::to_string(device) + " is not one");
  }
  return Status::kSuccess;
}

#define CODA_RETURN_IF_ERROR(expr)          \
  do {                                      \
    Status _s = (expr);                     \
    if (_s != Status::kSuccess) return _s;  \
  } while (0)

kernels::GemmProblem problem(int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb,
                             void* d, int64_t ldd, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  kernels::GemmProblem p;
  p.m = m; p.n = n; p.k = k;
  p.a = a; p.lda = lda;
  p.b = b; p.ldb = ldb;
  p.d = d; p.ldd = ldd;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.stream = stream;
  Tuning t = current_tuning();
  p.raster = t.raster >= 0 ? t.raster : 0;
  p.swizzle = t.swizzle > 0 ? t.swizzle : 1;
  return p;
}

// Measured per shape class on an H200 (benchmarks/results): a forward that
// also stores H writes twice what it reads per tile when K is small, and
// ping-pong hides that epilogue behind the other warp group's mainloop.
kernels::Config linear_config(const LinearArgs& a) {
  int forced = current_tuning().config;
  if (forced == 0) return kernels::Config::kCooperative128x256;
  if (forced == 1) return kernels::Config::kPingpong128x128;
  return a.n > a.k ? kernels::Config::kPingpong128x128 : kernels::Config::kCooperative128x256;
}

template <kernels::Config C>
Status run_linear(DType dtype, const kernels::GemmProblem& p, const kernels::LinearActEpilogue& e) {
  return dtype == DType::kBFloat16 ? kernels::linear_act<DType::kBFloat16, C>(p, e)
                                   : kernels::linear_act<DType::kFloat16, C>(p, e);
}

Status check_dtype_activation(DType dtype, Activation act) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    return detail::fail(Status::kInvalidArgument, "dtype must be bfloat16 or float16");
  }
  int a = static_cast<int>(act);
  if (a < 0 || a > static_cast<int>(Activation::kSiLU)) {
    return detail::fail(Status::kInvalidArgument, "unknown activation " + std::to_string(a));
  }
  return Status::kSuccess;
}

}  // namespace

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

void set_tuning(const Tuning& tuning) {
  std::lock_guard<std::mutex> lock(tuning_mutex);
  tuning_override = tuning;
}

Tuning get_tuning() { return current_tuning(); }

const char* kernel_configs(const char* op) {
  if (op != nullptr && std::strcmp(op, "linear") == 0) return "cooperative_128x256_2x1,pingpong_128x128_1x2";
  return "cooperative_128x256_2x1";
}

Status linear(DType dtype, const LinearArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype_activation(dtype, a.activation));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("pre_act", a.pre_act, a.ld_pre_act, a.n, false));
  CODA_RETURN_IF_ERROR(check_matrix("residual", a.residual, a.ld_residual, a.n, false));
  if (a.bias != nullptr && !aligned16(a.bias)) return detail::fail(Status::kMisaligned, "bias must be 16-byte aligned");
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;

  auto p = problem(a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.y, a.ldy, workspace, workspace_bytes, stream);
  kernels::LinearActEpilogue e;
  e.bias = a.bias;
  e.pre_act = a.pre_act;
  e.ld_pre_act = a.ld_pre_act;
  e.activation = static_cast<int>(a.activation);
  e.residual = a.residual;
  e.ld_residual = a.ld_residual;
  return linear_config(a) == kernels::Config::kPingpong128x128
             ? run_linear<kernels::Config::kPingpong128x128>(dtype, p, e)
             : run_linear<kernels::Config::kCooperative128x256>(dtype, p, e);
}

size_t linear_workspace_size(DType dtype, const LinearArgs& a) {
  auto p = problem(a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.y, a.ldy, nullptr, 0, nullptr);
  bool bf16 = dtype == DType::kBFloat16;
  if (linear_config(a) == kernels::Config::kPingpong128x128) {
    return bf16 ? kernels::linear_act_workspace<DType::kBFloat16, kernels::Config::kPingpong128x128>(p)
                : kernels::linear_act_workspace<DType::kFloat16, kernels::Config::kPingpong128x128>(p);
  }
  return bf16 ? kernels::linear_act_workspace<DType::kBFloat16, kernels::Config::kCooperative128x256>(p)
              : kernels::linear_act_workspace<DType::kFloat16, kernels::Config::kCooperative128x256>(p);
}

Status dgrad(DType dtype, const DgradArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype_activation(dtype, a.activation));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dx", a.dx, a.lddx, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("pre_act", a.pre_act, a.ld_pre_act, a.n, false));
  if (a.dbias != nullptr && !aligned16(a.dbias)) return detail::fail(Status::kMisaligned, "dbias must be 16-byte aligned");
  if (a.activation != Activation::kIdentity && a.pre_act == nullptr) {
    return detail::fail(Status::kInvalidArgument, "pre_act is required when activation is not identity");
  }
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) {
    if (a.dbias != nullptr) {
      cudaError_t e = cudaMemsetAsync(a.dbias, 0, a.n * 2, stream);
      if (e != cudaSuccess) return detail::fail(Status::kCudaError, cudaGetErrorString(e));
    }
    return Status::kSuccess;
  }
  auto p = problem(a.m, a.n, a.k, a.dy, a.lddy, a.weight, a.ldw, a.dx, a.lddx, workspace, workspace_bytes, stream);
  kernels::DActDBiasEpilogue e;
  e.pre_act = a.pre_act;
  e.ld_pre_act = a.ld_pre_act;
  e.activation = static_cast<int>(a.activation);
  e.dbias = a.dbias;
  return dtype == DType::kBFloat16
             ? kernels::dact_dbias<DType::kBFloat16, kernels::Config::kCooperative128x256>(p, e)
             : kernels::dact_dbias<DType::kFloat16, kernels::Config::kCooperative128x256>(p, e);
}

size_t dgrad_workspace_size(DType dtype, const DgradArgs& a) {
  auto p = problem(a.m, a.n, a.k, a.dy, a.lddy, a.weight, a.ldw, a.dx, a.lddx, nullptr, 0, nullptr);
  return dtype == DType::kBFloat16
             ? kernels::dact_dbias_workspace<DType::kBFloat16, kernels::Config::kCooperative128x256>(p)
             : kernels::dact_dbias_workspace<DType::kFloat16, kernels::Config::kCooperative128x256>(p);
}

Status wgrad(DType dtype, const WgradArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype_activation(dtype, Activation::kIdentity));
  CODA_RETURN_IF_ERROR(check_shape(a.k, a.m, a.n));  // the tokens (k here) may be zero
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.m, true));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dw", a.dw, a.lddw, a.n, true));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.k == 0) {
    cudaError_t e = cudaMemset2DAsync(a.dw, a.lddw * 2, 0, a.n * 2, a.m, stream);
    if (e != cudaSuccess) return detail::fail(Status::kCudaError, cudaGetErrorString(e));
    return Status::kSuccess;
  }
  auto p = problem(a.m, a.n, a.k, a.dy, a.lddy, a.x, a.ldx, a.dw, a.lddw, workspace, workspace_bytes, stream);
  return dtype == DType::kBFloat16 ? kernels::wgrad_store<DType::kBFloat16, kernels::Config::kCooperative128x256>(p)
                                   : kernels::wgrad_store<DType::kFloat16, kernels::Config::kCooperative128x256>(p);
}

size_t wgrad_workspace_size(DType dtype, const WgradArgs& a) {
  auto p = problem(a.m, a.n, a.k, a.dy, a.lddy, a.x, a.ldx, a.dw, a.lddw, nullptr, 0, nullptr);
  return dtype == DType::kBFloat16
             ? kernels::wgrad_store_workspace<DType::kBFloat16, kernels::Config::kCooperative128x256>(p)
             : kernels::wgrad_store_workspace<DType::kFloat16, kernels::Config::kCooperative128x256>(p);
}

}  // namespace coda
