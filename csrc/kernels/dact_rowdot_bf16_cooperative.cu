// dact_rowdot, bf16, Cooperative128x256: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status dact_rowdot<DType::kBFloat16, Config::kCooperative128x256>(const GemmProblem&, const DActRowDotEpilogue&);
template size_t dact_rowdot_workspace<DType::kBFloat16, Config::kCooperative128x256>(const GemmProblem&, const DActRowDotEpilogue&);
}  // namespace coda::kernels
