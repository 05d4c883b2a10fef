// A record of each GEMM the dispatch launches, while recording is on: what a
// benchmark needs to time a fused kernel against the vendor's plain GEMM of the
// same shape, layouts and operands (coda/registry.h's record_launches).
#pragma once

#include <vector>

#include "kernels.h"

namespace coda::kernels {

struct LaunchRecord {
  Program program;
  Config config;
  DType dtype;
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  int raster, swizzle;
};

void set_launch_log(bool on);
// The records since the last call (or since recording began), oldest first.
std::vector<LaunchRecord> take_launch_log();

}  // namespace coda::kernels
