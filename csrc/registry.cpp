// coda/registry.h over the table's enums (kernels.h) and the dispatch's counters.
#include "coda/registry.h"

#include <cstring>

#include "kernels.h"
#include "launch_log.h"

namespace coda::registry {

namespace {
using kernels::Config;
using kernels::Program;
bool program_ok(int p) { return p >= 0 && p < kernels::kProgramCount; }
bool config_ok(int c) { return c >= 0 && c < kernels::kConfigCount; }

constexpr bool RowMajor = true, ColumnMajor = false;
struct Layouts {
  bool a_row_major, b_row_major;
};
constexpr Layouts layouts_of(Program p) {
  switch (p) {
#define CODA_PROGRAM(E, name, pass, arguments, a_layout, b_layout, ...) \
  case Program::E:                                                      \
    return {a_layout, b_layout};
#include "kernels/table.def"
  }
  return {RowMajor, RowMajor};
}
}  // namespace

int program_count() { return kernels::kProgramCount; }

const char* program_name(int p) { return program_ok(p) ? kernels::program_name(Program(p)) : nullptr; }

const char* program_pass(int p) {
  if (!program_ok(p)) return nullptr;
  switch (kernels::pass_of(Program(p))) {
    case kernels::Pass::kForward: return "forward";
    case kernels::Pass::kDgrad: return "dgrad";
    case kernels::Pass::kWgrad: return "wgrad";
  }
  return nullptr;
}

int program_index(const char* name) {
  for (int p = 0; name && p < kernels::kProgramCount; ++p) {
    if (std::strcmp(name, kernels::program_name(Program(p))) == 0) return p;
  }
  return -1;
}

int config_count() { return kernels::kConfigCount; }

const char* config_name(int c) { return config_ok(c) ? kernels::config_name(Config(c)) : nullptr; }

bool kernel_built(int p, DType t, int c) {
  return program_ok(p) && config_ok(c) && kernels::is_built(Program(p), t, Config(c));
}

bool kernel_facts(int p, DType t, int c, KernelFacts* out) {
  return program_ok(p) && config_ok(c) && out != nullptr && kernels::kernel_facts(Program(p), t, Config(c), out);
}

int64_t launch_count(int p, int c) {
  return program_ok(p) && config_ok(c) ? kernels::launch_count(Program(p), Config(c)) : 0;
}

KernelChoice kernel_choice(int p, DType t, int64_t m, int64_t n, int64_t k, int sms) {
  if (!program_ok(p)) return {};
  const kernels::Choice c = kernels::choose(Program(p), t, m, n, k);
  return {static_cast<int>(c.config), c.raster, c.swizzle, kernels::prefer_vendor_gemm(Program(p), m, n, k, sms)};
}

void record_launches(bool on) { kernels::set_launch_log(on); }

std::vector<Launch> take_launches() {
  std::vector<Launch> out;
  for (const kernels::LaunchRecord& r : kernels::take_launch_log()) {
    const Layouts l = layouts_of(r.program);
    out.push_back({static_cast<int>(r.program), static_cast<int>(r.config), r.dtype, r.m, r.n, r.k, r.a, r.lda,
                   l.a_row_major, r.b, r.ldb, l.b_row_major, r.raster, r.swizzle});
  }
  return out;
}

void set_kernel_override(int config, int raster, int swizzle) { kernels::set_override(config, raster, swizzle); }

void set_cross_entropy_one_read(bool on) { kernels::set_cross_entropy_one_read(on); }
int64_t cross_entropy_one_read_launches() { return kernels::cross_entropy_one_read_launches(); }

}  // namespace coda::registry
