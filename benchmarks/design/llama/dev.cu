#include "gemm_proto.cuh"
#include "dact_dbias_rowdot.hpp"
#include "llama_programs.hpp"
using namespace coda::kernels;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
#if PROG == 1
using G = Gemm<coda::DType::kBFloat16, RowMajor, ColumnMajor, Config::kCooperative128x256, coda::proto::NormGluLinear>;
#elif PROG == 2
using G = Gemm<coda::DType::kBFloat16, RowMajor, RowMajor, Config::kCooperative128x256, coda::proto::GluDgradRowDot>;
#elif PROG == 3
using G = Gemm<coda::DType::kBFloat16, RowMajor, ColumnMajor, Config::kCooperative128x256, coda::proto::NormRopeLinear>;
#elif PROG == 4
using G = Gemm<coda::DType::kBFloat16, RowMajor, RowMajor, Config::kCooperative128x256, coda::epilogues::DActDBiasRowDot>;
#endif
void* kernel_address() { return reinterpret_cast<void*>(&cutlass::device_kernel<G::Kernel>); }
