// wgrad_store, bf16, Cooperative128x256: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status wgrad_store<DType::kBFloat16, Config::kCooperative128x256>(const GemmProblem&);
template size_t wgrad_store_workspace<DType::kBFloat16, Config::kCooperative128x256>(const GemmProblem&);
}  // namespace coda::kernels
