// coda: Transformer-block GEMMs whose epilogues do the memory-bound work.
//
// The public C++ API. No torch, no CUTLASS in this header: device pointers,
// shapes, leading dimensions and a stream in; a Status out. Every matrix is
// row-major with the given leading dimension (element (i, j) at ptr[i*ld + j]),
// which is how PyTorch hands over activations and nn.Linear weights [out, in].
// Kernels are built for sm_90a (H100 / H200) only.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace coda {

enum class Status : int {
  kSuccess = 0,
  kInvalidArgument,    // a null pointer, a negative size, an unknown enum value
  kMisaligned,         // a pointer or leading dimension is not 16-byte aligned
  kNotSupported,       // no kernel for this device, dtype or shape; use a reference path
  kWorkspaceTooSmall,  // pass at least *_workspace_size() bytes, or nullptr
  kCudaError,          // a CUDA runtime call or launch failed
  kKernelError,        // CUTLASS refused or failed to launch the kernel
};

// A short name for the status, e.g. "misaligned".
const char* status_string(Status status);
// Details of the last non-success status returned on this thread.
const char* last_error_message();

enum class DType : int { kBFloat16 = 0, kFloat16 = 1 };

// Values match coda::epilogues::ActivationKind.
enum class Activation : int { kIdentity = 0, kGeluTanh = 1, kGeluErf = 2, kReLU = 3, kSiLU = 4 };

// Y = act(X·Wᵀ + bias) + residual;  H = X·Wᵀ + bias  (the forward of a Linear).
struct LinearArgs {
  int64_t m = 0, n = 0, k = 0;       // tokens, out features, in features
  const void* x = nullptr;           // (m, k)
  int64_t ldx = 0;
  const void* weight = nullptr;      // (n, k), nn.Linear layout
  int64_t ldw = 0;
  const void* bias = nullptr;        // (n) or null
  Activation activation = Activation::kIdentity;
  const void* residual = nullptr;    // (m, n) or null, added after the activation
  int64_t ld_residual = 0;
  void* y = nullptr;                 // (m, n) out
  int64_t ldy = 0;
  void* pre_act = nullptr;           // (m, n) out, H for the backward; or null
  int64_t ld_pre_act = 0;
};

// dX = (dY·W) ⊙ act'(H);  dbias = Σ_rows dX.  The dgrad GEMM of the layer
// *after* an activation, with that activation's backward and its bias
// gradient in the epilogue. With Activation::kIdentity and null pre_act /
// dbias it is the plain dgrad dX = dY·W.
struct DgradArgs {
  int64_t m = 0, n = 0, k = 0;       // tokens, in features (of dX), out features (of dY)
  const void* dy = nullptr;          // (m, k)
  int64_t lddy = 0;
  const void* weight = nullptr;      // (k, n), nn.Linear layout of the layer dY came from
  int64_t ldw = 0;
  Activation activation = Activation::kIdentity;
  const void* pre_act = nullptr;     // (m, n) H saved by the forward, or null
  int64_t ld_pre_act = 0;
  void* dx = nullptr;                // (m, n) out
  int64_t lddx = 0;
  void* dbias = nullptr;             // (n) out, or null
};

// dW = dYᵀ·X, the weight gradient of a Linear: dY (tokens, n), X (tokens, k).
struct WgradArgs {
  int64_t m = 0, n = 0, k = 0;       // out features, in features, tokens
  const void* dy = nullptr;          // (k, m)
  int64_t lddy = 0;
  const void* x = nullptr;           // (k, n)
  int64_t ldx = 0;
  void* dw = nullptr;                // (m, n) out
  int64_t lddw = 0;
};

// Each op runs on `stream`. `workspace` may be null: then the op allocates
// what it needs stream-ordered (cudaMallocAsync) and frees it after.
Status linear(DType dtype, const LinearArgs& args, void* workspace, size_t workspace_bytes,
              cudaStream_t stream);
Status dgrad(DType dtype, const DgradArgs& args, void* workspace, size_t workspace_bytes,
             cudaStream_t stream);
Status wgrad(DType dtype, const WgradArgs& args, void* workspace, size_t workspace_bytes,
             cudaStream_t stream);

size_t linear_workspace_size(DType dtype, const LinearArgs& args);
size_t dgrad_workspace_size(DType dtype, const DgradArgs& args);
size_t wgrad_workspace_size(DType dtype, const WgradArgs& args);

// True when the current device can run coda's kernels (sm_90).
bool device_supported(int device);

// Kernel choice, for tuning sweeps. -1 leaves a field to coda's heuristic.
// config: index into the kernel configurations of an op (see kernel_configs);
// raster: 0 heuristic, 1 along M, 2 along N; swizzle: 1, 2, 4 or 8.
struct Tuning {
  int config = -1;
  int raster = -1;
  int swizzle = -1;
};
void set_tuning(const Tuning& tuning);  // process-wide; for benchmarks
Tuning get_tuning();
// Names of the configurations an op ("linear", "dgrad", "wgrad") can pick.
const char* kernel_configs(const char* op);

}  // namespace coda
