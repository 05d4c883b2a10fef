// linear_act, fp16, Cooperative128x256: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status linear_act<DType::kFloat16, Config::kCooperative128x256>(const GemmProblem&, const LinearActEpilogue&);
template size_t linear_act_workspace<DType::kFloat16, Config::kCooperative128x256>(const GemmProblem&);
}  // namespace coda::kernels
