// What the library holds and what it would run, for tools and tests: the
// epilogue programs and tile configurations it was built with (indices in
// the order of csrc/kernels/table.def), the kernels built, each kernel's
// launches so far, and the kernel choice for a GEMM shape. None of it is
// needed to call the ops in coda.h.
#pragma once

#include <cstdint>
#include <vector>

#include "coda/coda.h"

namespace coda::registry {

int program_count();
// The program's name ("linear_act", ...) and pass ("forward", "dgrad", "wgrad"); null past the count.
const char* program_name(int program);
const char* program_pass(int program);
// The index of the program called `name`, or -1.
int program_index(const char* name);

int config_count();
const char* config_name(int config);

bool kernel_built(int program, DType dtype, int config);

// A built kernel's shape in shared memory, from its types: mainloop stages,
// the epilogue's bytes, subtile (rows x columns) and its load (C) and store
// (D) pipeline depths, and the kernel's bytes in all.
struct KernelFacts {
  int stages = 0;
  int epilogue_bytes = 0;
  int epilogue_tile_m = 0, epilogue_tile_n = 0;
  int stages_c = 0, stages_d = 0;
  int smem_bytes = 0;
};
// False (and *out untouched) where the kernel is not built.
bool kernel_facts(int program, DType dtype, int config, KernelFacts* out);
// Launches of (program, config) in this process.
int64_t launch_count(int program, int config);

// What the rule picks for one GEMM of `program`, without launching anything;
// `vendor_gemm`: a plain GEMM of it (no epilogue work) goes to cuBLAS on a
// device of `sms` SMs.
struct KernelChoice {
  int config = 0, raster = 0, swizzle = 1;
  bool vendor_gemm = false;
};
KernelChoice kernel_choice(int program, DType dtype, int64_t m, int64_t n, int64_t k, int sms);

// One GEMM launched: D = epilogue(A·B), A m x k and B k x n in the program's
// operand layouts, with their leading dimensions (in elements), and the tile
// configuration, raster order and swizzle it ran with.
struct Launch {
  int program = 0, config = 0;
  DType dtype = DType::kBFloat16;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  bool a_row_major = true;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool b_row_major = true;
  int raster = 0, swizzle = 1;
};
// From record_launches(true) on, every GEMM launch is recorded (in this
// process, from any thread) until record_launches(false), which also drops
// what was not taken; take_launches() returns the records so far, oldest
// first, and starts a new list. For benchmarks: off, a launch pays one load.
void record_launches(bool on);
std::vector<Launch> take_launches();

// Every later choice takes this configuration (where built), raster order and
// swizzle; -1 leaves one to the rule. For running tests and benchmarks on
// each configuration the rule can pick.
void set_kernel_override(int config, int raster, int swizzle);

// The cross-entropy pass that forms the statistics and the gradient of a
// chunk of logits (linear_cross_entropy with recompute=False) by a cluster of
// CTAs holding each row in shared memory, one read of the logits instead of
// two, where on (rows of up to 8 x 100 KB); off by default until it is
// measured against the one-block-a-row kernel. For tests and benchmarks.
void set_cross_entropy_one_read(bool on);
// Its launches in this process.
int64_t cross_entropy_one_read_launches();

}  // namespace coda::registry
