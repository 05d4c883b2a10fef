// dact_dbias_kmajor, bf16, Pingpong128x128: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status dact_dbias_kmajor<DType::kBFloat16, Config::kPingpong128x128>(const GemmProblem&,
                                                                              const DActDBiasEpilogue&);
template size_t dact_dbias_kmajor_workspace<DType::kBFloat16, Config::kPingpong128x128>(const GemmProblem&);
}  // namespace coda::kernels
