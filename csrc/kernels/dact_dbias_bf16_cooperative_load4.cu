// dact_dbias, bf16, Cooperative128x256Load4: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status dact_dbias<DType::kBFloat16, Config::kCooperative128x256Load4>(const GemmProblem&, const DActDBiasEpilogue&);
template size_t dact_dbias_workspace<DType::kBFloat16, Config::kCooperative128x256Load4>(const GemmProblem&);
}  // namespace coda::kernels
