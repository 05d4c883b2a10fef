// norm_linear_act, bf16, Pingpong128x128DirectAux: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status norm_linear_act<DType::kBFloat16, Config::kPingpong128x128DirectAux>(const GemmProblem&, const NormLinearEpilogue&);
template size_t norm_linear_act_workspace<DType::kBFloat16, Config::kPingpong128x128DirectAux>(const GemmProblem&);
}  // namespace coda::kernels
