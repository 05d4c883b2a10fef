// What each kernel's types come to, printed on the host without a GPU: the
// mainloop's stage count, the epilogue's shared memory (its subtile, load and
// store stages) and the kernel's total, for every program x configuration of
// csrc/kernels/table.def, built or not. Every epilogue byte is carved out of
// the mainloop's stages, so this is where a fused GEMM can lose to cuBLAS
// before anything runs. Built by `cmake --build <dir> --target coda_kernel_facts`.
#include <cstdio>
#include <utility>

#include "kernels.cuh"
#undef CODA_KERNEL  // kernels.cuh's instantiating form; the list below is read for names only

namespace k = coda::kernels;

// Whether the build lists (P, T, C): kernel_list.def, as dispatch.cpp reads it, without linking the kernels.
constexpr bool listed(k::Program p, coda::DType t, k::Config c) {
#define CODA_KERNEL(P_, T_, C_) \
  if (p == k::Program::P_ && t == coda::DType::T_ && c == k::Config::C_) return true;
#include "kernel_list.def"
  return false;
}

template <k::Program P, coda::DType T, k::Config C>
void print(const char* dtype) {
  const k::KernelFacts f = k::facts<P, T, C>();  // kernels.cuh's, as the library's registry reports them
  std::printf("%-22s %-5s %-24s %6d %10d %6dx%-4d %3d %3d %11d %6s\n", k::program_name(P), dtype, k::config_name(C),
              f.stages, f.epilogue_bytes, f.epilogue_tile_m, f.epilogue_tile_n, f.stages_c, f.stages_d, f.smem_bytes,
              listed(P, T, C) ? "built" : "");
}

template <int P, int... C>
void configs(std::integer_sequence<int, C...>) {
  (print<k::Program(P), coda::DType::kBFloat16, k::Config(C)>("bf16"), ...);
}

template <int... P>
void programs(std::integer_sequence<int, P...>) {
  (configs<P>(std::make_integer_sequence<int, k::kConfigCount>{}), ...);
}

int main() {
  std::printf("%-22s %-5s %-24s %6s %10s %11s %3s %3s %11s %6s\n", "program", "dtype", "config", "stages",
              "epi_smem", "epi_tile", "C", "D", "smem_bytes", "");
  programs(std::make_integer_sequence<int, k::kProgramCount>{});
  return 0;
}
