// linear_act, fp16, Cooperative128x256Epi1Stage: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status linear_act<DType::kFloat16, Config::kCooperative128x256Epi1Stage>(const GemmProblem&, const LinearActEpilogue&);
template size_t linear_act_workspace<DType::kFloat16, Config::kCooperative128x256Epi1Stage>(const GemmProblem&);
}  // namespace coda::kernels
