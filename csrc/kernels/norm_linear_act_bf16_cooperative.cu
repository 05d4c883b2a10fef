// norm_linear_act, bf16, Cooperative128x256: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status norm_linear_act<DType::kBFloat16, Config::kCooperative128x256>(const GemmProblem&, const NormLinearEpilogue&);
template size_t norm_linear_act_workspace<DType::kBFloat16, Config::kCooperative128x256>(const GemmProblem&);
}  // namespace coda::kernels
