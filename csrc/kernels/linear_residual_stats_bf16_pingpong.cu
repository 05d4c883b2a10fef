// linear_residual_stats, bf16, Pingpong128x128: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status linear_residual_stats<DType::kBFloat16, Config::kPingpong128x128>(const GemmProblem&, const LinearResidualStatsEpilogue&);
template size_t linear_residual_stats_workspace<DType::kBFloat16, Config::kPingpong128x128>(const GemmProblem&, const LinearResidualStatsEpilogue&);
}  // namespace coda::kernels
