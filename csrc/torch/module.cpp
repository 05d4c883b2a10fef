// coda._C: importing it registers torch.ops.coda.* (the fused ops in
// linear_ops.cpp and norm_ops.cpp, and the library's introspection here).
#include <Python.h>

#include <string>
#include <vector>

#include "coda/registry.h"
#include "tensors.h"

namespace {

namespace reg = coda::registry;

bool device_supported(int64_t device) { return coda::device_supported(static_cast<int>(device)); }

// For tests and benchmarks: force a configuration, raster order or swizzle
// (-1: the rule's), e.g. to run the GPU tests on every configuration the
// rule can pick.
void set_kernel_override(int64_t config, int64_t raster, int64_t swizzle) {
  reg::set_kernel_override(static_cast<int>(config), static_cast<int>(raster), static_cast<int>(swizzle));
}

// "program/config/dtype/config index" of every kernel built.
std::vector<std::string> kernels_built() {
  std::vector<std::string> out;
  for (int p = 0; p < reg::program_count(); ++p) {
    for (int c = 0; c < reg::config_count(); ++c) {
      for (coda::DType t : {coda::DType::kBFloat16, coda::DType::kFloat16}) {
        if (!reg::kernel_built(p, t, c)) continue;
        out.push_back(std::string(reg::program_name(p)) + "/" + reg::config_name(c) + "/" +
                      (t == coda::DType::kBFloat16 ? "bf16" : "fp16") + "/" + std::to_string(c));
      }
    }
  }
  return out;
}

// "name/pass" of every program kernels/table.def declares, in its order.
std::vector<std::string> programs() {
  std::vector<std::string> out;
  for (int p = 0; p < reg::program_count(); ++p) {
    out.push_back(std::string(reg::program_name(p)) + "/" + reg::program_pass(p));
  }
  return out;
}

// "program/config/dtype" of every kernel built and 7 integers each (registry.h's KernelFacts, in its order).
std::tuple<std::vector<std::string>, std::vector<int64_t>> kernel_facts() {
  std::vector<std::string> keys;
  std::vector<int64_t> ints;
  for (int p = 0; p < reg::program_count(); ++p) {
    for (int c = 0; c < reg::config_count(); ++c) {
      for (coda::DType t : {coda::DType::kBFloat16, coda::DType::kFloat16}) {
        reg::KernelFacts f;
        if (!reg::kernel_facts(p, t, c, &f)) continue;
        keys.push_back(std::string(reg::program_name(p)) + "/" + reg::config_name(c) + "/" +
                       (t == coda::DType::kBFloat16 ? "bf16" : "fp16"));
        for (int v : {f.stages, f.epilogue_bytes, f.epilogue_tile_m, f.epilogue_tile_n, f.stages_c, f.stages_d,
                      f.smem_bytes}) {
          ints.push_back(v);
        }
      }
    }
  }
  return {keys, ints};
}

// "program/config" -> launches so far, as two lists.
std::tuple<std::vector<std::string>, std::vector<int64_t>> launch_counts() {
  std::vector<std::string> keys;
  std::vector<int64_t> counts;
  for (int p = 0; p < reg::program_count(); ++p) {
    for (int c = 0; c < reg::config_count(); ++c) {
      keys.push_back(std::string(reg::program_name(p)) + "/" + reg::config_name(c));
      counts.push_back(reg::launch_count(p, c));
    }
  }
  return {keys, counts};
}

// For the kernel benchmark: record every GEMM launch from now on (or stop and
// drop the records).
void record_launches(bool on) { reg::record_launches(on); }

// The launches recorded since the last call, as "program/config/dtype/a_layout/b_layout"
// (layouts "row" or "col") and 9 integers each: m, n, k, A's address, lda, B's
// address, ldb, raster, swizzle.
std::tuple<std::vector<std::string>, std::vector<int64_t>> take_launches() {
  std::vector<std::string> keys;
  std::vector<int64_t> ints;
  for (const reg::Launch& l : reg::take_launches()) {
    keys.push_back(std::string(reg::program_name(l.program)) + "/" + reg::config_name(l.config) + "/" +
                   (l.dtype == coda::DType::kBFloat16 ? "bf16" : "fp16") + "/" + (l.a_row_major ? "row" : "col") +
                   "/" + (l.b_row_major ? "row" : "col"));
    for (int64_t v : {l.m, l.n, l.k, reinterpret_cast<int64_t>(l.a), l.lda, reinterpret_cast<int64_t>(l.b), l.ldb,
                      static_cast<int64_t>(l.raster), static_cast<int64_t>(l.swizzle)}) {
      ints.push_back(v);
    }
  }
  return {keys, ints};
}

// What the rule picks for one GEMM of a program ("linear_act", ...) in a dtype
// ("bf16", "fp16") on a device of `sms` SMs, without launching anything:
// (configuration, raster, swizzle, whether a plain GEMM of it goes to cuBLAS).
std::tuple<std::string, int64_t, int64_t, bool> kernel_choice(const std::string& program, const std::string& dtype,
                                                              int64_t m, int64_t n, int64_t k, int64_t sms) {
  const int p = reg::program_index(program.c_str());
  TORCH_CHECK(p >= 0, "_kernel_choice: unknown program '", program, "'");
  TORCH_CHECK(dtype == "bf16" || dtype == "fp16", "_kernel_choice: dtype must be bf16 or fp16, got '", dtype, "'");
  const coda::DType t = dtype == "bf16" ? coda::DType::kBFloat16 : coda::DType::kFloat16;
  const reg::KernelChoice c = reg::kernel_choice(p, t, m, n, k, static_cast<int>(sms));
  return {reg::config_name(c.config), c.raster, c.swizzle, c.vendor_gemm};
}

void set_cross_entropy_one_read(bool on) { reg::set_cross_entropy_one_read(on); }
int64_t cross_entropy_one_read_launches() { return reg::cross_entropy_one_read_launches(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(coda, m) {
  m.def("device_supported(int device) -> bool", &device_supported);
  m.def("_set_kernel_override(int config, int raster, int swizzle) -> ()", &set_kernel_override);
  m.def("_set_cross_entropy_one_read(bool on) -> ()", &set_cross_entropy_one_read);
  m.def("_cross_entropy_one_read_launches() -> int", &cross_entropy_one_read_launches);
  m.def("_kernels_built() -> str[]", &kernels_built);
  m.def("_programs() -> str[]", &programs);
  m.def("_launch_counts() -> (str[], int[])", &launch_counts);
  m.def("_kernel_facts() -> (str[], int[])", &kernel_facts);
  m.def("_record_launches(bool on) -> ()", &record_launches);
  m.def("_take_launches() -> (str[], int[])", &take_launches);
  m.def("_kernel_choice(str program, str dtype, int m, int n, int k, int sms) -> (str, int, int, bool)",
        &kernel_choice);
}

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "coda's compiled kernels (torch.ops.coda)", -1, nullptr};
  return PyModule_Create(&module);
}
