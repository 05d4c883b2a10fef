// linear_act, bf16, Pingpong128x128DirectAux: one CUTLASS instantiation.
#include "kernels.cuh"

namespace coda::kernels {
template Status linear_act<DType::kBFloat16, Config::kPingpong128x128DirectAux>(const GemmProblem&, const LinearActEpilogue&);
template size_t linear_act_workspace<DType::kBFloat16, Config::kPingpong128x128DirectAux>(const GemmProblem&);
}  // namespace coda::kernels
