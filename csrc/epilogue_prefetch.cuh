// The epilogue's operands (H, a residual, the norm's x), prefetched into L2
// by the mainloop's producer warp while the tile's last MMAs run.
//
// Why: a cooperative kernel's epilogue does not overlap its MMAs, and the
// epilogue's TMA loads run at most kEpilogueLoadStages subtiles ahead of the
// consumers (every smem byte they take comes out of the mainloop's stages).
// The first subtiles are loaded during the mainloop; each later one is
// issued when a buffer frees, so the epilogue waits on DRAM latency once per
// subtile or two. An L2 prefetch needs no smem: issued when the producer has
// queued the tile's last k-blocks (the consumers are then `Stages` k-blocks,
// a few microseconds, from their epilogue), the tile's rows are in L2 when
// the subtile loads come.
//
// The prefetch is cp.async.bulk.prefetch.L2 (sm_90): contiguous bytes, 16-byte
// aligned and a multiple of 16, which the TMA's own alignment rules already
// guarantee for every operand (api.cpp checks them).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "kernels.h"

namespace coda::kernels {

CUTLASS_DEVICE void prefetch_l2_bytes(void const* ptr, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
#endif
}

// A mainloop collective whose producer also prefetches the epilogue's
// operands of each tile (EpiloguePrefetch, null pointers: none). Everything
// else is the base collective's; the kernel sees the derived Arguments and
// Params through the collective's own names.
template <class Base>
struct PrefetchingMainloop : Base {
  using TileShape = typename Base::TileShape;
  using MainloopPipeline = typename Base::MainloopPipeline;
  using PipelineState = typename Base::PipelineState;
  using TensorStorage = typename Base::TensorStorage;

  struct Arguments : Base::Arguments {
    EpiloguePrefetch prefetch;
  };
  struct Params : Base::Params {
    EpiloguePrefetch prefetch;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                        void* workspace) {
    return {Base::to_underlying_arguments(problem_shape, args, workspace), args.prefetch};
  }

  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    Base::load(params, pipeline, smem_pipe_write, load_inputs, blk_coord, k_tile_iter, k_tile_count, thread_idx,
               block_rank_in_cluster, shared_tensors);
    prefetch_tile(params.prefetch, blk_coord, thread_idx % 32);
  }

 private:
  // Each lane of the producer warp prefetches every 32nd row of the tile.
  template <class BlockCoord>
  CUTLASS_DEVICE static void prefetch_tile(EpiloguePrefetch const& p, BlockCoord const& blk_coord, int lane) {
    constexpr int kTileM = cute::size<0>(TileShape{});
    constexpr int kTileN = cute::size<1>(TileShape{});
    const int64_t row0 = int64_t(cute::get<0>(blk_coord)) * kTileM;
    const int64_t col0 = int64_t(cute::get<1>(blk_coord)) * kTileN;
    if (row0 >= p.m || col0 >= p.n) return;
    const int64_t cols = p.n - col0 < kTileN ? p.n - col0 : kTileN;
    const int64_t rows = p.m - row0 < kTileM ? p.m - row0 : kTileM;
    const uint32_t bytes = uint32_t(cols * p.element_bytes);
    CUTLASS_PRAGMA_UNROLL
    for (int t = 0; t < EpiloguePrefetch::kTensors; ++t) {
      if (p.ptr[t] == nullptr) continue;
      char const* base = static_cast<char const*>(p.ptr[t]) + (row0 * p.ld[t] + col0) * p.element_bytes;
      for (int64_t r = lane; r < rows; r += 32) prefetch_l2_bytes(base + r * p.ld[t] * p.element_bytes, bytes);
    }
  }
};

}  // namespace coda::kernels
