// The public API: checks the arguments, picks a kernel, runs it.
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "coda/coda.h"
#include "error.h"
#include "kernels.h"
#include "l2_policy.hpp"

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
  // current context. A thread whose first CUDA work is a coda op has none:
  // PyTorch's autograd runs backwards on threads of its own, and once the
  // MLP's backward launched nothing before its first GEMM, the descriptor
  // failed and the process crashed (b55ccc2 run). cudaSetDevice makes the
  // device's primary context current, once per thread and device.
  thread_local int bound_device = -1;
  if (bound_device != device) {
    e = cudaSetDevice(device);
    if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string("cudaSetDevice: ") + cudaGetErrorString(e));
    bound_device = device;
  }
  return Status::kSuccess;
}

#define CODA_RETURN_IF_ERROR(expr)          \
  do {                                      \
    Status _s = (expr);                     \
    if (_s != Status::kSuccess) return _s;  \
  } while (0)

// Whether CTAs alternate the k order of their tiles (gemm.cuh,
// AlternatingKMainloop). On: in the 86e5134 power probe it cut fc2's dgrad
// DRAM reads from 2.55 to 2.24 GB a launch and its energy by 0.9% (0.4% with
// GELU' and db1), fc1's forward storing H by 0.8%, and changed nothing else.
constexpr int kAlternateKDefault = 1;

// A kernel configuration and its tile-scheduler settings.
struct Choice {
  kernels::Config config = kernels::Config::kCooperative128x256;
  int raster = 0;   // 0: CUTLASS's heuristic, 1: along M, 2: along N
  int swizzle = 1;
  int alternate_k = kAlternateKDefault;
};

// Tuning overrides (benchmark sweeps) win over the heuristics.
Choice apply_tuning(Choice c) {
  Tuning t = current_tuning();
  if (t.config >= 0) c.config = static_cast<kernels::Config>(t.config);
  if (t.raster >= 0) c.raster = t.raster;
  if (t.swizzle > 0) c.swizzle = t.swizzle;
  if (t.alternate_k >= 0) c.alternate_k = t.alternate_k;
  return c;
}

kernels::GemmProblem problem(const Choice& choice, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                             const void* b, int64_t ldb, void* d, int64_t ldd, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream) {
  kernels::GemmProblem p;
  p.m = m; p.n = n; p.k = k;
  p.a = a; p.lda = lda;
  p.b = b; p.ldb = ldb;
  p.d = d; p.ldd = ldd;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.stream = stream;
  p.raster = choice.raster;
  p.swizzle = choice.swizzle;
  p.alternate_k = choice.alternate_k;
  return p;
}

// Heuristics per op and shape class, from the sweeps in benchmarks/results
// (python -m coda.bench --only-sweep on an H200).
// From the sweeps in benchmarks/results (H200, 16384 tokens, 4096 <-> 16384):
// the forward of a K-small problem (N > K, fc1) runs best ping-pong, which
// hides its epilogue (bias, GELU, the stored pre-activation) behind the other
// warp group's mainloop (0.99-1.00x cuBLAS against 1.09-1.14x cooperative);
// K-large ones (fc2) run best cooperative. Every dgrad measured ran best
// cooperative, ping-pong 1-12% slower (so only the cooperative one is built). Swizzle 8 was best or within noise
// everywhere (4 tied, 2 and 1 lost by up to 27% in the 18d5dc5 sweep); raster order moved times by up to 12%.
// In energy 4 and 2 lost as well (f105437 power probe: fc1's forward 1.029 and 1.074 of cuBLAS's against 1.005,
// fc2's dgrad 1.020 and 1.043 against 1.001), as did 16 and 32 (e1f9d23).
//
// K = N (o-proj, 4096 -> 4096) runs best ping-pong too, paired with cuBLAS
// in the 097adc2 sweep: linear + bias + residual 1.003x against 1.039x
// cooperative, residual-reduce 1.044x against 1.053x; its dgrad stays
// cooperative (1.014x against 1.034x ping-pong).
//
// Ping-pong's epilogue without smem for its aux tensors (15, a sweep
// candidate) against the smem one (1): in the 8d81d04 sweep 15 looked 3-4%
// faster wherever the epilogue loads nothing, but timed in turn with cuBLAS
// over 5 rounds in the 4ce0c57 run (where 15 shipped for those) the two tied
// (fc1: 0.989x / 0.987x plain, 0.990x / 0.995x with GELU; QKV + bias 1.006x
// both; the folded norm 1.007x / 1.006x) and storing H cost more (1.029x
// against 1.019x); loading a residual 15 lost (1.064x against 1.014x).
Choice choose_forward(int64_t n, int64_t k) {
  Choice c;
  c.config = n >= k ? kernels::Config::kPingpong128x128 : kernels::Config::kCooperative128x256;
  c.raster = 1;
  c.swizzle = 8;
  return apply_tuning(c);
}

Choice choose_linear(const LinearArgs& a) { return choose_forward(a.n, a.k); }

Choice choose_dgrad(const DgradArgs& a) {
  Choice c;  // cooperative: the only dgrad configuration built
  c.raster = a.n > a.k ? 2 : 1;
  c.swizzle = 8;
  return apply_tuning(c);
}

Choice choose_wgrad(const WgradArgs&) {
  Choice c;
  c.raster = 2;
  c.swizzle = 8;
  return apply_tuning(c);  // one configuration
}

// The GEMM each op runs, in CUTLASS's terms, for a run or a workspace query.
kernels::GemmProblem linear_problem(const LinearArgs& a, const Choice& c, void* ws, size_t ws_bytes, cudaStream_t s) {
  return problem(c, a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.y, a.ldy, ws, ws_bytes, s);
}

kernels::GemmProblem dgrad_problem(const DgradArgs& a, const Choice& c, void* ws, size_t ws_bytes, cudaStream_t s) {
  return problem(c, a.m, a.n, a.k, a.dy, a.lddy, a.weight, a.ldw, a.dx, a.lddx, ws, ws_bytes, s);
}

kernels::GemmProblem wgrad_problem(const WgradArgs& a, const Choice& c, void* ws, size_t ws_bytes, cudaStream_t s) {
  return problem(c, a.m, a.n, a.k, a.dy, a.lddy, a.x, a.ldx, a.dw, a.lddw, ws, ws_bytes, s);
}

// Runs fn(dtype tag) for the run-time dtype.
template <class Fn>
auto with_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::kBFloat16) return fn(std::integral_constant<DType, DType::kBFloat16>{});
  return fn(std::integral_constant<DType, DType::kFloat16>{});
}

using kernels::Config;

// fn(config tag) for the run-time config when it is one of Cs, else for Fallback.
template <Config Fallback, class Fn>
auto pick(Config, Fn&& fn) {
  return fn(std::integral_constant<Config, Fallback>{});
}
template <Config Fallback, Config Head, Config... Tail, class Fn>
auto pick(Config config, Fn&& fn) {
  if (config == Head) return fn(std::integral_constant<Config, Head>{});
  return pick<Fallback, Tail...>(config, fn);
}

#ifdef CODA_SWEEP_CONFIGS
constexpr bool kSweepBuild = true;
#else
constexpr bool kSweepBuild = false;
#endif

template <Config... Cs>
struct Configs {};

// fn(dtype tag, config tag) for the run-time dtype and configuration, among
// the configurations an op is built in: Sweep's in a sweep build's bf16
// kernels, else Base's (the first of each is the fallback). The sweep
// candidates are bf16 only; CMakeLists.txt lists them. kernel_configs
// reports the same lists.
template <Config... Base, Config... Sweep, class Fn>
auto with_kernel(Configs<Base...>, Configs<Sweep...>, DType dtype, Config config, Fn&& fn) {
  return with_dtype(dtype, [&](auto dt) {
    auto call = [&](auto cfg) { return fn(dt, cfg); };
    if constexpr (kSweepBuild && dt.value == DType::kBFloat16) {
      return pick<Sweep...>(config, call);
    } else {
      return pick<Base...>(config, call);
    }
  });
}

using C = Config;
using OneConfig = Configs<C::kCooperative128x256>;
using LinearConfigs = Configs<C::kCooperative128x256, C::kPingpong128x128>;
// A sweep lists its candidates here and in CMakeLists.txt. The split-N tiles
// (13 for linear only: each half's 96 columns are not a whole 64-column
// swizzle atom of an N-major B; 14 for linear, dgrad and wgrad) were the
// ec92be5 sweep's.
// 15: ping-pong without smem for the epilogue's aux tensors (8d81d04, 4ce0c57).
// 6 and 9 (larger tiles: per MAC, 6 reads ~15% fewer smem bytes than 1,
// both fewer L2 bytes) spent more energy than 1 on fc1's forward, not less
// (power probe at c067b5f: 1.030 and 1.151 cuBLAS's joules plain, against
// 1.004), and are no longer built.
using LinearSweep = Configs<C::kCooperative128x256, C::kPingpong128x128, C::kPingpong128x128DirectAux>;
// Ping-pong dgrad: lost on every shape measured, K = N too (097adc2); without
// smem for H (15) fc2's dgrad ran 1.54x cuBLAS (8d81d04): the direct load's
// latency stalls the epilogue. Nsight Compute says why the smem one loses:
// on fc2's dgrad it read 3.6-4.9 GB from DRAM plain and 6.3-10.9 GB with H
// (raster 1-2), against the cooperative kernel's 2.3 and 3.1-3.9 GB
// (logs/*-f92d62b-profile.log, *-785da3f-profile.log).
// 16 (the epilogue's loads 3 deep, D through one buffer) lost in the a7c6072
// power probe and was removed (kernels.h).
// Nor is the N-major weight the cause: given W2's transpose (a K-major B,
// fc1's forward layout, where ping-pong runs at cuBLAS's speed), a ping-pong
// dgrad built for the 9c4b1cb run ran fc2's dgrad at 1.019x cuBLAS plain and
// 1.130x with GELU' and db1 (interleaved), against the cooperative kernel's
// 0.993x and 1.060x; with the copy of W2 (0.44 ms through torch) the MLP's
// forward + backward took 20.68 ms against 19.88. It was removed after that run.
using DgradSweep = Configs<C::kCooperative128x256, C::kPingpong128x128>;
using WgradSweep = OneConfig;
// The norm fold's kernels are bf16 only: their with_kernel calls pass bf16.
using NormLinearConfigs = LinearConfigs;
using ResidualConfigs = LinearConfigs;
using ResidualSweep = Configs<C::kCooperative128x256, C::kPingpong128x128, C::kPingpong128x128DirectAux>;
using NormDgradSweep = OneConfig;

// The norm-folding kernels are built for bf16 only.
Status check_bf16(DType dtype, const char* op) {
  if (dtype != DType::kBFloat16) {
    return detail::fail(Status::kNotSupported, std::string(op) + " has bf16 kernels only");
  }
  return Status::kSuccess;
}

// fp32 vectors are read 16 bytes at a time.
Status check_vector(const char* name, const void* ptr, bool required) {
  if (ptr == nullptr) {
    return required ? detail::fail(Status::kInvalidArgument, std::string(name) + " is null") : Status::kSuccess;
  }
  if (!aligned16(ptr)) return detail::fail(Status::kMisaligned, std::string(name) + " must be 16-byte aligned");
  return Status::kSuccess;
}

kernels::DActRowDotEpilogue rowdot_epilogue(const DgradArgs& a) {
  kernels::DActRowDotEpilogue e;
  e.pre_act = a.pre_act;
  e.ld_pre_act = a.ld_pre_act;
  e.activation = static_cast<int>(a.activation);
  e.dbias = a.dbias;
  e.shift = a.norm_shift;
  e.col_sum = a.norm_col_sum;
  e.scale = a.norm_scale;
  e.c1 = a.norm_c1;
  e.c2 = a.norm_c2;
  return e;
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
  const int bits = tuning.store_l2 >= 0 ? tuning.store_l2 : epilogues::kStoreL2EvictFirstDefault;
  epilogues::store_l2_policy().d = epilogues::store_l2_policy_of(bits, 1);
  epilogues::store_l2_policy().aux = epilogues::store_l2_policy_of(bits, 2);
}

Tuning get_tuning() { return current_tuning(); }

namespace {
const char* config_name(Config c) {
  switch (c) {
    case Config::kCooperative128x256: return "cooperative_128x256_2x1";
    case Config::kPingpong128x128: return "pingpong_128x128_1x2";
    case Config::kCooperativeStreamK128x256: return "cooperative_streamk_128x256_2x1";
    case Config::kCooperative128x256Cluster1: return "cooperative_128x256_1x1";
    case Config::kCooperative256x128: return "cooperative_256x128_1x2";
    case Config::kPingpong128x128Cluster2x1: return "pingpong_128x128_2x1";
    case Config::kPingpong128x192Cluster2x1: return "pingpong_128x192_2x1";
    case Config::kPingpong128x192: return "pingpong_128x192_1x2";
    case Config::kCooperative256x192: return "cooperative_256x192_2x1";
    case Config::kCooperative256x128Cluster2x1: return "cooperative_256x128_2x1";
    case Config::kCooperative128x256Epi16: return "cooperative_128x256_2x1_epi128x16";
    case Config::kCooperative128x256Epi1Stage: return "cooperative_128x256_2x1_epi1stage";
    case Config::kPingpong128x128Epi64: return "pingpong_128x128_1x2_epi64x64";
    case Config::kSplitN192x192: return "splitn_192x192_2x1";
    case Config::kSplitN320x128: return "splitn_320x128_1x2";
    case Config::kPingpong128x128DirectAux: return "pingpong_128x128_1x2_direct_aux";
  }
  return "unknown";
}

// "value:name,..." of a configuration list, for kernel_configs: from the
// same lists the dispatch picks from.
template <Config... Base, Config... Sweep>
std::string listed(Configs<Base...>, Configs<Sweep...>) {
  std::string out;
  auto add = [&](Config c) {
    if (!out.empty()) out += ",";
    out += std::to_string(static_cast<int>(c)) + ":" + config_name(c);
  };
  if (kSweepBuild) {
    (add(Sweep), ...);
  } else {
    (add(Base), ...);
  }
  return out;
}
}  // namespace

const char* kernel_configs(const char* op) {
  static const std::string linear = listed(LinearConfigs{}, LinearSweep{});
  static const std::string norm_linear = listed(NormLinearConfigs{}, NormLinearConfigs{});
  static const std::string dgrad = listed(OneConfig{}, DgradSweep{});
  static const std::string wgrad = listed(OneConfig{}, WgradSweep{});
  static const std::string residual = listed(ResidualConfigs{}, ResidualSweep{});
  static const std::string norm_dgrad = listed(OneConfig{}, NormDgradSweep{});
  static const std::string one = listed(OneConfig{}, OneConfig{});
  const std::string o = op != nullptr ? op : "";
  if (o == "linear") return linear.c_str();
  if (o == "norm_linear") return norm_linear.c_str();
  if (o == "dgrad") return dgrad.c_str();
  if (o == "wgrad") return wgrad.c_str();
  if (o == "linear_residual") return residual.c_str();
  if (o == "norm_dgrad") return norm_dgrad.c_str();
  return one.c_str();
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

  Choice choice = choose_linear(a);
  auto p = linear_problem(a, choice, workspace, workspace_bytes, stream);
  kernels::LinearActEpilogue e;
  e.bias = a.bias;
  e.pre_act = a.pre_act;
  e.ld_pre_act = a.ld_pre_act;
  e.activation = static_cast<int>(a.activation);
  e.residual = a.residual;
  e.ld_residual = a.ld_residual;
  return with_kernel(LinearConfigs{}, LinearSweep{}, dtype, choice.config,
                            [&](auto dt, auto cfg) { return kernels::linear_act<dt.value, cfg.value>(p, e); });
}

size_t linear_workspace_size(DType dtype, const LinearArgs& a) {
  Choice choice = choose_linear(a);
  auto p = linear_problem(a, choice, nullptr, 0, nullptr);
  return with_kernel(LinearConfigs{}, LinearSweep{}, dtype, choice.config,
                            [&](auto dt, auto cfg) { return kernels::linear_act_workspace<dt.value, cfg.value>(p); });
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
  Choice choice = choose_dgrad(a);
  auto p = dgrad_problem(a, choice, workspace, workspace_bytes, stream);
  if (a.norm_c1 != nullptr) {
    CODA_RETURN_IF_ERROR(check_bf16(dtype, "dgrad with norm row dots"));
    if (a.pre_act == nullptr) return detail::fail(Status::kInvalidArgument, "pre_act is required for the norm row dots");
    CODA_RETURN_IF_ERROR(check_vector("norm_shift", a.norm_shift, false));
    CODA_RETURN_IF_ERROR(check_vector("norm_col_sum", a.norm_col_sum, false));
    return kernels::dact_rowdot<DType::kBFloat16, kernels::Config::kCooperative128x256>(p, rowdot_epilogue(a));
  }
  kernels::DActDBiasEpilogue e;
  e.pre_act = a.pre_act;
  e.ld_pre_act = a.ld_pre_act;
  e.activation = static_cast<int>(a.activation);
  e.dbias = a.dbias;
  return with_kernel(OneConfig{}, DgradSweep{}, dtype, choice.config,
                           [&](auto dt, auto cfg) { return kernels::dact_dbias<dt.value, cfg.value>(p, e); });
}

size_t dgrad_workspace_size(DType dtype, const DgradArgs& a) {
  Choice choice = choose_dgrad(a);
  auto p = dgrad_problem(a, choice, nullptr, 0, nullptr);
  if (a.norm_c1 != nullptr) {
    return kernels::dact_rowdot_workspace<DType::kBFloat16, kernels::Config::kCooperative128x256>(p, rowdot_epilogue(a));
  }
  return with_kernel(OneConfig{}, DgradSweep{}, dtype, choice.config,
                           [&](auto dt, auto cfg) { return kernels::dact_dbias_workspace<dt.value, cfg.value>(p); });
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
  Choice choice = choose_wgrad(a);
  auto p = wgrad_problem(a, choice, workspace, workspace_bytes, stream);
  return with_kernel(OneConfig{}, WgradSweep{}, dtype, choice.config,
                           [&](auto dt, auto cfg) { return kernels::wgrad_store<dt.value, cfg.value>(p); });
}

size_t wgrad_workspace_size(DType dtype, const WgradArgs& a) {
  Choice choice = choose_wgrad(a);
  auto p = wgrad_problem(a, choice, nullptr, 0, nullptr);
  return with_kernel(OneConfig{}, WgradSweep{}, dtype, choice.config,
                           [&](auto dt, auto cfg) { return kernels::wgrad_store_workspace<dt.value, cfg.value>(p); });
}

// ---- norms folded into GEMMs

namespace {

kernels::NormLinearEpilogue norm_linear_epilogue(const NormLinearArgs& a) {
  kernels::NormLinearEpilogue e;
  e.mean = a.mean;
  e.rstd = a.rstd;
  e.col_sum = a.col_sum;
  e.shift = a.shift;
  e.pre_act = a.pre_act;
  e.ld_pre_act = a.ld_pre_act;
  e.activation = static_cast<int>(a.activation);
  return e;
}

kernels::LinearResidualStatsEpilogue residual_stats_epilogue(const LinearResidualArgs& a) {
  kernels::LinearResidualStatsEpilogue e;
  e.bias = a.bias;
  e.residual = a.residual;
  e.ld_residual = a.ld_residual;
  e.layernorm = a.mean != nullptr;
  e.eps = a.eps;
  e.mean = a.mean;
  e.rstd = a.rstd;
  return e;
}

kernels::NormDgradEpilogue norm_dgrad_epilogue(const NormDgradArgs& a) {
  kernels::NormDgradEpilogue e;
  e.x = a.x;
  e.ld_x = a.ldx;
  e.mean = a.mean;
  e.rstd = a.rstd;
  e.gamma = a.gamma;
  e.beta = a.beta;
  e.c1 = a.c1;
  e.c2 = a.c2;
  e.residual_grad = a.residual_grad;
  e.ld_residual_grad = a.ld_residual_grad;
  e.normalized = a.normalized;
  e.ld_normalized = a.ld_normalized;
  e.dgamma = a.dgamma;
  e.dbeta = a.dbeta;
  return e;
}

kernels::GemmProblem norm_linear_problem(const NormLinearArgs& a, const Choice& c, void* ws, size_t ws_bytes,
                                         cudaStream_t s) {
  return problem(c, a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.y, a.ldy, ws, ws_bytes, s);
}

kernels::GemmProblem residual_problem(const LinearResidualArgs& a, const Choice& c, void* ws, size_t ws_bytes,
                                      cudaStream_t s) {
  return problem(c, a.m, a.n, a.k, a.x, a.ldx, a.weight, a.ldw, a.y, a.ldy, ws, ws_bytes, s);
}

kernels::GemmProblem norm_dgrad_problem(const NormDgradArgs& a, const Choice& c, void* ws, size_t ws_bytes,
                                        cudaStream_t s) {
  return problem(c, a.m, a.n, a.k, a.dy, a.lddy, a.weight, a.ldw, a.dx, a.lddx, ws, ws_bytes, s);
}

// The same shape classes as the plain ops (ping-pong forward for N > K).
Choice choose_norm_linear(const NormLinearArgs& a) { return choose_forward(a.n, a.k); }

Choice choose_norm_dgrad(const NormDgradArgs& a) {
  DgradArgs d;
  d.n = a.n;
  d.k = a.k;
  return choose_dgrad(d);
}

Choice choose_residual(const LinearResidualArgs& a) { return choose_forward(a.n, a.k); }

}  // namespace

Status fold_norm_weight(DType dtype, const FoldNormWeightArgs& a, cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype_activation(dtype, Activation::kIdentity));
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
  CODA_RETURN_IF_ERROR(check_dtype_activation(dtype, Activation::kIdentity));
  if (a.m < 0 || a.n <= 0) return detail::fail(Status::kInvalidArgument, "row_stats: sizes must be positive");
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.n, true));
  if (a.rstd == nullptr) return detail::fail(Status::kInvalidArgument, "rstd is null");
  CODA_RETURN_IF_ERROR(check_device());
  return kernels::row_stats(dtype, a, stream);
}

Status norm_linear(DType dtype, const NormLinearArgs& a, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype_activation(dtype, a.activation));
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
  Choice choice = choose_norm_linear(a);
  auto p = norm_linear_problem(a, choice, workspace, workspace_bytes, stream);
  auto e = norm_linear_epilogue(a);
  return with_kernel(NormLinearConfigs{}, NormLinearConfigs{}, DType::kBFloat16, choice.config,
                     [&](auto, auto cfg) { return kernels::norm_linear_act<DType::kBFloat16, cfg.value>(p, e); });
}

size_t norm_linear_workspace_size(DType, const NormLinearArgs& a) {
  Choice choice = choose_norm_linear(a);
  auto p = norm_linear_problem(a, choice, nullptr, 0, nullptr);
  return with_kernel(NormLinearConfigs{}, NormLinearConfigs{}, DType::kBFloat16, choice.config,
                     [&](auto, auto cfg) { return kernels::norm_linear_act_workspace<DType::kBFloat16, cfg.value>(p); });
}

Status linear_residual(DType dtype, const LinearResidualArgs& a, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype_activation(dtype, Activation::kIdentity));
  CODA_RETURN_IF_ERROR(check_shape(a.m, a.n, a.k));
  CODA_RETURN_IF_ERROR(check_matrix("x", a.x, a.ldx, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("weight", a.weight, a.ldw, a.k, true));
  CODA_RETURN_IF_ERROR(check_matrix("y", a.y, a.ldy, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("residual", a.residual, a.ld_residual, a.n, false));
  if (a.bias != nullptr && !aligned16(a.bias)) return detail::fail(Status::kMisaligned, "bias must be 16-byte aligned");
  if (a.rstd == nullptr) return detail::fail(Status::kInvalidArgument, "rstd is null");
  CODA_RETURN_IF_ERROR(check_bf16(dtype, "linear_residual"));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) return Status::kSuccess;
  Choice choice = choose_residual(a);
  auto p = residual_problem(a, choice, workspace, workspace_bytes, stream);
  return with_kernel(ResidualConfigs{}, ResidualSweep{}, dtype, choice.config, [&](auto, auto cfg) {
    return kernels::linear_residual_stats<DType::kBFloat16, cfg.value>(p, residual_stats_epilogue(a));
  });
}

size_t linear_residual_workspace_size(DType, const LinearResidualArgs& a) {
  Choice choice = choose_residual(a);
  auto p = residual_problem(a, choice, nullptr, 0, nullptr);
  return with_kernel(ResidualConfigs{}, ResidualSweep{}, DType::kBFloat16, choice.config, [&](auto, auto cfg) {
    return kernels::linear_residual_stats_workspace<DType::kBFloat16, cfg.value>(p, residual_stats_epilogue(a));
  });
}

Status norm_row_dots(DType dtype, const NormRowDotsArgs& a, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  CODA_RETURN_IF_ERROR(check_dtype_activation(dtype, a.activation));
  if (a.m < 0 || a.n <= 0) return detail::fail(Status::kInvalidArgument, "norm_row_dots: sizes must be positive");
  CODA_RETURN_IF_ERROR(check_matrix("dy", a.dy, a.lddy, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("pre_act", a.pre_act, a.ld_pre_act, a.n, true));
  CODA_RETURN_IF_ERROR(check_matrix("dp", a.dp, a.lddp, a.n, a.activation != Activation::kIdentity));
  if (a.c1 == nullptr) return detail::fail(Status::kInvalidArgument, "c1 is null");
  CODA_RETURN_IF_ERROR(check_vector("shift", a.shift, false));
  CODA_RETURN_IF_ERROR(check_vector("col_sum", a.col_sum, false));
  if (a.c2 != nullptr && a.col_sum == nullptr) return detail::fail(Status::kInvalidArgument, "c2 needs col_sum");
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
  CODA_RETURN_IF_ERROR(check_dtype_activation(dtype, Activation::kIdentity));
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
  if ((a.dgamma != nullptr && !aligned16(a.dgamma)) || (a.dbeta != nullptr && !aligned16(a.dbeta))) {
    return detail::fail(Status::kMisaligned, "dgamma and dbeta must be 16-byte aligned");
  }
  CODA_RETURN_IF_ERROR(check_bf16(dtype, "norm_dgrad"));
  CODA_RETURN_IF_ERROR(check_device());
  if (a.m == 0) {
    for (void* g : {a.dgamma, a.dbeta}) {
      if (g == nullptr) continue;
      cudaError_t e = cudaMemsetAsync(g, 0, a.n * 2, stream);
      if (e != cudaSuccess) return detail::fail(Status::kCudaError, cudaGetErrorString(e));
    }
    return Status::kSuccess;
  }
  Choice choice = choose_norm_dgrad(a);
  auto p = norm_dgrad_problem(a, choice, workspace, workspace_bytes, stream);
  return with_kernel(OneConfig{}, NormDgradSweep{}, DType::kBFloat16, choice.config, [&](auto, auto cfg) {
    return kernels::norm_dgrad<DType::kBFloat16, cfg.value>(p, norm_dgrad_epilogue(a));
  });
}

size_t norm_dgrad_workspace_size(DType, const NormDgradArgs& a) {
  Choice choice = choose_norm_dgrad(a);
  auto p = norm_dgrad_problem(a, choice, nullptr, 0, nullptr);
  return with_kernel(OneConfig{}, NormDgradSweep{}, DType::kBFloat16, choice.config, [&](auto, auto cfg) {
    return kernels::norm_dgrad_workspace<DType::kBFloat16, cfg.value>(p, norm_dgrad_epilogue(a));
  });
}

}  // namespace coda
