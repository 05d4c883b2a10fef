// wgrad_store, fp16, Cooperative128x256: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status wgrad_store<DType::kFloat16, Config::kCooperative128x256>(const GemmProblem&);
template size_t wgrad_store_workspace<DType::kFloat16, Config::kCooperative128x256>(const GemmProblem&);
}  // namespace coda::kernels
