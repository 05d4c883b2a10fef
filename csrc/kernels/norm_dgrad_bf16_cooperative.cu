// norm_dgrad, bf16, Cooperative128x256: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status norm_dgrad<DType::kBFloat16, Config::kCooperative128x256>(const GemmProblem&, const NormDgradEpilogue&);
template size_t norm_dgrad_workspace<DType::kBFloat16, Config::kCooperative128x256>(const GemmProblem&, const NormDgradEpilogue&);
}  // namespace coda::kernels
