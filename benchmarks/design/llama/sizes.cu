#include "gemm_proto.cuh"
#include "dact_dbias_rowdot.hpp"
#include "linear_act.hpp"
#include "llama_programs.hpp"
#include <cstdio>
using namespace coda::kernels;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

template <class G>
void report(const char* name) {
  using CE = typename G::CollectiveEpilogue;
  printf("%-28s epilogue smem %6zu B  mainloop stages %d  kernel smem %6d B\n", name,
         sizeof(typename CE::SharedStorage), int(G::Mainloop::DispatchPolicy::Stages), int(G::Kernel::SharedStorageSize));
}
template <Config C>
void all(const char* cname) {
  printf("== %s\n", cname);
  report<Gemm<coda::DType::kBFloat16, RowMajor, ColumnMajor, C, coda::epilogues::LinearAct>>("LinearAct (today)");
  report<Gemm<coda::DType::kBFloat16, RowMajor, RowMajor, C, coda::epilogues::DActDBiasRowDot>>("DActDBiasRowDot (today)");
  report<Gemm<coda::DType::kBFloat16, RowMajor, ColumnMajor, C, coda::proto::NormGluLinear>>("NormGluLinear (fwd)");
  report<Gemm<coda::DType::kBFloat16, RowMajor, RowMajor, C, coda::proto::GluDgradRowDot>>("GluDgradRowDot (bwd)");
  report<Gemm<coda::DType::kBFloat16, RowMajor, ColumnMajor, C, coda::proto::NormRopeLinear>>("NormRopeLinear (qkv fwd)");
}
int main() {
  all<Config::kCooperative128x256>("Cooperative128x256");
  all<Config::kCooperative128x128>("Cooperative128x128");
  all<Config::kPingpong128x128>("Pingpong128x128");
}
