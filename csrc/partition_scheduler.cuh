// A persistent tile scheduler that hands each L2 partition a contiguous run
// of every wave's tiles.
//
// Why: the H100/H200 L2 is two partitions, and the DRAM bytes Nsight Compute
// counts for our GEMMs (fc1's forward, 128x128 tiles, swizzle 8: ~3.2 GB a
// launch) match a model in which each partition fetches a wave's operand
// panels for its own SMs: 62 waves x 2 partitions x 24.5 MB (an 8-tile band
// of A and 16.5 columns of B). CUTLASS's scheduler gives cluster c the tiles
// c, c + G, c + 2G, ... (G clusters), and the hardware places clusters on SMs
// of either partition with no relation to c, so both partitions need the
// whole wave's panels. Here a cluster's place in the wave comes from the
// partition its SM belongs to (l2_partition.cu measures that once per
// device): partition 0's clusters take the wave's first tiles, partition 1's
// its last, so in a raster band each partition reads half of the wave's B
// columns.
//
// The order is decided once per launch, by a counter per partition in the
// scheduler's workspace (zeroed by initialize_workspace, a memset on the
// launch's stream). Rank 0 of a cluster takes the number and publishes it to
// the cluster's other CTAs through the workspace. Whatever the partition map
// says, the numbers are a permutation of the clusters, so every tile is
// computed exactly once; a wrong map costs L2 hits, never a wrong result.
// A null map runs CUTLASS's order unchanged.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include <cstdint>

namespace coda::kernels {

struct PartitionScheduler {};  // the tag a TileConfig names

class PartitionedTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  // Two counters, then one slot per cluster (rank 0's number + 1).
  static constexpr int kMaxClusters = 1024;
  static constexpr size_t kWorkspaceBytes = (2 + kMaxClusters) * sizeof(uint32_t);

  struct Arguments : Base::Arguments {
    uint8_t const* sm_partition = nullptr;  // device table, %smid -> 0 or 1; null: CUTLASS's order
  };

  struct Params : Base::Params {
    uint8_t const* sm_partition = nullptr;
    uint32_t* counters = nullptr;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL shape, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
                                        void* workspace = nullptr, uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(shape, tile, cluster, hw_info, args, workspace,
                                                                  epilogue_subtile, ktile_start_alignment_count);
    if (args.sm_partition != nullptr && workspace != nullptr) {
      p.sm_partition = args.sm_partition;
      p.counters = static_cast<uint32_t*>(workspace);
    }
    return p;
  }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const& args, ProblemShape, cutlass::KernelHardwareInfo const&, uint32_t,
                                   const uint32_t = 1, uint32_t = 1) {
    return args.sm_partition != nullptr ? kWorkspaceBytes : 0;
  }

  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const& args, void* workspace, cudaStream_t stream, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, cutlass::CudaHostAdapter* = nullptr) {
    if (args.sm_partition == nullptr) return cutlass::Status::kSuccess;
    if (workspace == nullptr) return cutlass::Status::kErrorWorkspaceNull;
    return cudaMemsetAsync(workspace, 0, kWorkspaceBytes, stream) == cudaSuccess ? cutlass::Status::kSuccess
                                                                                 : cutlass::Status::kErrorInternal;
  }

  static bool can_implement(Arguments const& args) { return Base::can_implement(args); }

  CUTLASS_DEVICE explicit PartitionedTileScheduler(Params const& params) : Base(params) {
#if defined(__CUDA_ARCH__)
    // CUTLASS's numbering (StaticPersistentTileScheduler): for the 2x1 and
    // 1x2 clusters built here, CTA rank r of cluster c starts at c * size + r.
    uint64_t start;
    if (params.raster_order_ == RasterOrder::AlongN) {
      start = uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * uint64_t(gridDim.x);
    } else {
      start = uint64_t(blockIdx.x) * uint64_t(gridDim.y) + uint64_t(blockIdx.y);
    }
    grid_ = uint64_t(gridDim.x) * uint64_t(gridDim.y) * uint64_t(gridDim.z);
    const dim3 cs = cute::cluster_shape();
    const uint32_t cluster_size = cs.x * cs.y * cs.z;
    const uint32_t clusters = uint32_t(grid_ / cluster_size);
    if (params.sm_partition != nullptr && clusters <= kMaxClusters) {
      const uint32_t c = uint32_t(start / cluster_size), r = uint32_t(start % cluster_size);
      // Every thread reads the number from the workspace: a __shared__
      // variable here would sit in front of CUTLASS's dynamic smem and break
      // the 1024-byte alignment its TMA swizzles need (misaligned address,
      // fb44bce run).
      volatile uint32_t* slot = params.counters + 2 + c;
      if (r == 0 && threadIdx.x == 0) {
        uint32_t smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        const uint32_t v = params.sm_partition[smid & 255] == 0 ? atomicAdd(params.counters, 1u)
                                                                : clusters - 1 - atomicAdd(params.counters + 1, 1u);
        *slot = v + 1;
      }
      uint32_t v;
      while ((v = *slot) == 0) __nanosleep(64);
      start = uint64_t(v - 1) * cluster_size + r;
    }
    idx_ = start;
#endif
  }

  // The base's index is private: every member that reads or moves it is
  // restated here on idx_.
  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return get_current_work_for_linear_idx(idx_); }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) { idx_ += grid_ * uint64_t(advance_count); }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo& work_tile_info, uint32_t advance_count = 1) const {
    if (continue_current_work(work_tile_info)) return false;
    return !get_current_work_for_linear_idx(idx_ + grid_ * uint64_t(advance_count)).is_valid();
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info) {
    if (continue_current_work(work_tile_info)) return cute::make_tuple(work_tile_info, true);
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

 private:
  uint64_t idx_ = 0;
  uint64_t grid_ = 0;
};

}  // namespace coda::kernels

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<coda::kernels::PartitionScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = coda::kernels::PartitionedTileScheduler;
};

}  // namespace cutlass::gemm::kernel::detail
