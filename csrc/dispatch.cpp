// From (program, dtype, configuration) to the kernel that kernels/table.def
// lists for it, with a launch counter per (program, configuration): tests
// assert through it that a kernel ran rather than a reference path.
#include <atomic>
#include <string>

#include "error.h"
#include "kernels.h"

namespace coda::kernels {

namespace {

std::atomic<int64_t> launches[kProgramCount][kConfigCount];

void count(Program p, Config c) {
  launches[static_cast<int>(p)][static_cast<int>(c)].fetch_add(1, std::memory_order_relaxed);
}

Status unlisted(Program p, DType t, Config c) {
  return detail::fail(Status::kNotSupported, std::string("no ") + program_name(p) + " kernel is built for " +
                                                 (t == DType::kBFloat16 ? "bf16" : "fp16") + " in " + config_name(c));
}

}  // namespace

const char* config_name(Config c) {
  switch (c) {
    case Config::kCooperative128x256: return "cooperative_128x256_2x1";
    case Config::kPingpong128x128: return "pingpong_128x128_1x2";
    case Config::kCooperative256x128: return "cooperative_256x128_1x2";
    case Config::kCooperative128x128: return "cooperative_128x128_1x2";
    case Config::kPingpong64x128: return "pingpong_64x128_1x2";
  }
  return "unknown";
}

const char* program_name(Program p) {
  switch (p) {
    case Program::kLinearAct: return "linear_act";
    case Program::kDActDBias: return "dact_dbias";
    case Program::kWgradStore: return "wgrad_store";
    case Program::kNormLinearAct: return "norm_linear_act";
    case Program::kLinearResidualStats: return "linear_residual_stats";
    case Program::kDActRowDot: return "dact_rowdot";
    case Program::kNormDgrad: return "norm_dgrad";
    case Program::kNormGluLinear: return "norm_glu_linear";
    case Program::kGluDgradRowDot: return "glu_dgrad_rowdot";
    case Program::kNormRopeLinear: return "norm_rope_linear";
  }
  return "unknown";
}

bool is_built(Program p, DType t, Config c) {
#define CODA_KERNEL(P_, T_, C_) \
  if (p == Program::P_ && t == DType::T_ && c == Config::C_) return true;
#include "kernel_list.def"
#undef CODA_KERNEL
  return false;
}

template <Program P>
Status run(DType t, Config c, const GemmProblem& p, const Epilogue<P>& e) {
#define CODA_KERNEL(P_, T_, C_)                                      \
  if constexpr (Program::P_ == P) {                                  \
    if (t == DType::T_ && c == Config::C_) {                         \
      count(P, c);                                                   \
      return launch<Program::P_, DType::T_, Config::C_>(p, e);       \
    }                                                                \
  }
#include "kernel_list.def"
#undef CODA_KERNEL
  return unlisted(P, t, c);
}

template <Program P>
size_t workspace_size(DType t, Config c, const GemmProblem& p, const Epilogue<P>& e) {
#define CODA_KERNEL(P_, T_, C_)                                                                  \
  if constexpr (Program::P_ == P) {                                                              \
    if (t == DType::T_ && c == Config::C_) return workspace<Program::P_, DType::T_, Config::C_>(p, e); \
  }
#include "kernel_list.def"
#undef CODA_KERNEL
  return 0;
}

int64_t launch_count(Program p, Config c) {
  return launches[static_cast<int>(p)][static_cast<int>(c)].load(std::memory_order_relaxed);
}

#define CODA_PROGRAM(P)                                                                               \
  template Status run<Program::P>(DType, Config, const GemmProblem&, const Epilogue<Program::P>&);   \
  template size_t workspace_size<Program::P>(DType, Config, const GemmProblem&, const Epilogue<Program::P>&);
CODA_PROGRAM(kLinearAct)
CODA_PROGRAM(kDActDBias)
CODA_PROGRAM(kWgradStore)
CODA_PROGRAM(kNormLinearAct)
CODA_PROGRAM(kLinearResidualStats)
CODA_PROGRAM(kDActRowDot)
CODA_PROGRAM(kNormDgrad)
CODA_PROGRAM(kNormGluLinear)
CODA_PROGRAM(kGluDgradRowDot)
CODA_PROGRAM(kNormRopeLinear)
#undef CODA_PROGRAM

}  // namespace coda::kernels
