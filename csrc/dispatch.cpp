// From (program, dtype, configuration) to the kernel built for it (kernel_list.def:
// kernels/table.def's CODA_KERNEL lines as CMake kept them), with a launch counter per (program, configuration): tests
// assert through it that a kernel ran rather than a reference path.
#include <atomic>
#include <mutex>
#include <string>

#include "error.h"
#include "kernels.h"
#include "launch_log.h"

namespace coda::kernels {

namespace {

std::atomic<int64_t> launches[kProgramCount][kConfigCount];

void count(Program p, Config c) {
  launches[static_cast<int>(p)][static_cast<int>(c)].fetch_add(1, std::memory_order_relaxed);
}

// Off but for a benchmark's recording: one relaxed load per launch otherwise.
std::atomic<bool> log_on{false};
std::mutex log_mutex;
std::vector<LaunchRecord> log_records;

void log_launch(Program program, DType t, Config c, const GemmProblem& p) {
  if (!log_on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(log_mutex);
  log_records.push_back({program, c, t, p.m, p.n, p.k, p.a, p.lda, p.b, p.ldb, p.raster, p.swizzle});
}

Status unlisted(Program p, DType t, Config c) {
  return detail::fail(Status::kNotSupported, std::string("no ") + program_name(p) + " kernel is built for " +
                                                 (t == DType::kBFloat16 ? "bf16" : "fp16") + " in " + config_name(c));
}

}  // namespace

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
      log_launch(P, t, c, p);                                        \
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

bool kernel_facts(Program p, DType t, Config c, KernelFacts* out) {
#define CODA_KERNEL(P_, T_, C_)                                        \
  if (p == Program::P_ && t == DType::T_ && c == Config::C_) {         \
    *out = facts<Program::P_, DType::T_, Config::C_>();                \
    return true;                                                       \
  }
#include "kernel_list.def"
#undef CODA_KERNEL
  return false;
}

int64_t launch_count(Program p, Config c) {
  return launches[static_cast<int>(p)][static_cast<int>(c)].load(std::memory_order_relaxed);
}

void set_launch_log(bool on) {
  std::lock_guard<std::mutex> lock(log_mutex);
  log_on.store(on, std::memory_order_relaxed);
  if (!on) log_records.clear();
}

std::vector<LaunchRecord> take_launch_log() {
  std::lock_guard<std::mutex> lock(log_mutex);
  std::vector<LaunchRecord> out;
  out.swap(log_records);
  return out;
}

#define CODA_PROGRAM(P, ...)                                                                          \
  template Status run<Program::P>(DType, Config, const GemmProblem&, const Epilogue<Program::P>&);   \
  template size_t workspace_size<Program::P>(DType, Config, const GemmProblem&, const Epilogue<Program::P>&);
#include "kernels/table.def"

}  // namespace coda::kernels
