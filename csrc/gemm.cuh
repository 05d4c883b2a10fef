// The one GEMM recipe every coda kernel is built from.
//
// As in CUTLASS's example 49, a kernel is a type assembled from named parts:
// a tile configuration (tile, cluster, schedule), the operand layouts, and an
// epilogue program from cutlass_epilogues/. The collective builders choose
// the rest (TMA copies, smem layouts, stage counts). The run-time arguments
// nest the same way as the types.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <atomic>
#include <string>
#include <type_traits>

#include "error.h"
#include "kernels.h"
#include "store_l2.hpp"

namespace coda::kernels {

template <DType T>
struct ElementOf;
template <>
struct ElementOf<DType::kBFloat16> { using type = cutlass::bfloat16_t; };
template <>
struct ElementOf<DType::kFloat16> { using type = cutlass::half_t; };

template <class Tile, class Cluster>
struct CooperativeTile {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

template <class Tile, class Cluster>
struct PingpongTile {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
};

template <Config C>
struct TileConfig;

#define CODA_CONFIG(E, name, schedule, tm, tn, cm, cn)                                              \
  template <>                                                                                     \
  struct TileConfig<Config::E>                                                                    \
      : schedule##Tile<cute::Shape<cute::Int<tm>, cute::Int<tn>, cute::_64>, cute::Shape<cute::Int<cm>, \
                                                                                        cute::Int<cn>, cute::_1>> {};
#include "kernels/table.def"

// A stride of the (rows, cols, batch) kind CUTLASS wants, from one leading
// dimension: whichever mode the stride type fixes to 1 is the contiguous one.
template <class Stride>
Stride stride_from_ld(int64_t ld) {
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(Stride{}))>>::value) {
    return Stride{cute::_1{}, ld, int64_t(0)};
  } else {
    return Stride{ld, cute::_1{}, int64_t(0)};
  }
}

inline int sm_count(int device) {
  static int counts[64] = {};
  if (device < 0 || device >= 64) return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  if (counts[device] == 0) counts[device] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  return counts[device];
}

// The epilogue's shape and pipeline depths: CUTLASS's choice, except that the
// load pipeline, which every aux load of a program shares (one smem buffer
// per stage and loaded tensor), is at most 2 deep. Every smem byte the
// epilogue holds is carved out of the mainloop's stages; CUTLASS's own 4
// stages left the norm's dgrad 2 mainloop stages and 1.44x the plain dgrad's
// time, 2 keep one subtile's load in flight while the last is consumed.
constexpr int kEpilogueLoadStages = 2;

template <class TileShape_, class Element, class Schedule>
struct EpilogueRecipe {
  using TileShape = TileShape_;
  using EpilogueTile = decltype(cutlass::epilogue::collective::detail::sm90_compute_tile_shape_or_override<
                                Element, cutlass::epilogue::collective::EpilogueTileAuto, Schedule, TileShape>());
  using Stock = decltype(cutlass::epilogue::collective::detail::sm90_get_tma_dispatch_policy<
                         TileShape, EpilogueTile, void, Element, Schedule>());
  // The smem swizzle atom of D and of every aux tensor (all row-major Element).
  using SmemLayoutAtom = decltype(cutlass::epilogue::collective::detail::sm90_get_epilogue_smem_swizzle_layout_atom<
                                  cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>, Element, EpilogueTile>());
  static constexpr int StagesC = Stock::StagesC < kEpilogueLoadStages ? Stock::StagesC : kEpilogueLoadStages;
  static constexpr int StagesD = Stock::StagesD;
  using DispatchPolicy = cutlass::epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, Stock::FragmentSize,
                                                                   Stock::ReuseSmemC, Stock::DelayTmaStore>;
  static constexpr int AuxLoadStages = StagesC;
  static constexpr int AuxStoreStages = StagesD;
};

// The mainloop, with a run-time switch (Params::alternate_k) that has each
// CTA load the k-blocks of its odd-numbered tiles last to first: a wave of
// tiles then starts on the k-blocks the wave before it read last, the ones
// still in L2 (fc2's dgrad: 12% fewer DRAM bytes, 0.9% less energy).
template <class Base>
struct AlternatingKMainloop : Base {
  struct Params : Base::Params {
    int alternate_k = 0;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, typename Base::Arguments const& args,
                                        void* workspace) {
    return {Base::to_underlying_arguments(shape, args, workspace), 0};
  }

  // A k-block iterator from the last block down.
  struct DescendingK {
    int k;
    CUTLASS_HOST_DEVICE int operator*() const { return k; }
    CUTLASS_HOST_DEVICE DescendingK& operator++() {
      --k;
      return *this;
    }
  };

  int tiles_loaded = 0;  // by this CTA's producer

  template <class Inputs, class BlockCoord, class KTileIterator>
  CUTLASS_DEVICE void load(Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState write_state, Inputs const& inputs, BlockCoord const& blk,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank,
                           typename Base::TensorStorage& smem) {
    const bool descending = params.alternate_k != 0 && (tiles_loaded++ & 1) != 0;
    if (descending) {
      Base::load(params, pipeline, write_state, inputs, blk, DescendingK{int(*k_tile_iter) + k_tile_count - 1},
                 k_tile_count, thread_idx, block_rank, smem);
    } else {
      Base::load(params, pipeline, write_state, inputs, blk, k_tile_iter, k_tile_count, thread_idx, block_rank, smem);
    }
  }
};

// D's element: the program's ElementD where it names one (the GLU dgrad
// stores (dg, du) bf16 pairs as 32-bit lanes), else the GEMM's dtype.
template <class Prog, class E, class = void>
struct ElementDOf {
  using type = E;
};
template <class Prog, class E>
struct ElementDOf<Prog, E, std::void_t<typename Prog::ElementD>> {
  using type = typename Prog::ElementD;
};

template <DType T, class LayoutA, class LayoutB, Config C, template <class, class> class Program>
struct Gemm {
  using Element = typename ElementOf<T>::type;
  using Tile = TileConfig<C>;
  using TileShape = typename Tile::TileShape;
  static_assert(tile_shape(C).tile_m == cute::size<0>(TileShape{}) && tile_shape(C).tile_n == cute::size<1>(TileShape{}) &&
                    tile_shape(C).cluster_m == cute::size<0>(typename Tile::ClusterShape{}) &&
                    tile_shape(C).cluster_n == cute::size<1>(typename Tile::ClusterShape{}),
                "kernels.h tile_shape() disagrees with TileConfig");
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;
  using LayoutD = cutlass::layout::RowMajor;

  // What the epilogue programs read their node parameters from (TileShape,
  // EpilogueTile, stage counts), as CUTLASS's EpilogueDescriptor would give.
  using EpilogueDescriptor = EpilogueRecipe<TileShape, Element, typename Tile::EpilogueSchedule>;
  using EpilogueProgram = Program<Element, EpilogueDescriptor>;

  // The collective builder's assembly (Sm90TmaBuilderImpl) with the recipe's
  // dispatch policy, and D stored with an L2 hint. No C: residuals come in
  // through the program's own loads.
  using EpiTile = typename EpilogueDescriptor::EpilogueTile;
  using StrideD_ = cutlass::detail::TagToStrideC_t<LayoutD>;
  using ElementD = typename ElementDOf<EpilogueProgram, Element>::type;
  // With no C the collective types C's smem as D's element, so C's atom and
  // load op follow D's too.
  using SmemLayoutAtomD = std::conditional_t<
      std::is_same_v<ElementD, Element>, typename EpilogueDescriptor::SmemLayoutAtom,
      decltype(cutlass::epilogue::collective::detail::sm90_get_epilogue_smem_swizzle_layout_atom<StrideD_, ElementD,
                                                                                                  EpiTile>())>;
  using CollectiveEpilogue = cutlass::epilogue::collective::CollectiveEpilogue<
      typename EpilogueDescriptor::DispatchPolicy, TileShape, EpiTile,
      void, StrideD_, ElementD, StrideD_,
      typename EpilogueProgram::Callbacks,
      cute::SM90_TMA_LOAD, SmemLayoutAtomD,
      decltype(cutlass::epilogue::collective::detail::sm90_get_smem_load_op_for_source<StrideD_, ElementD, EpiTile>()),
      epilogues::TmaStoreL2, SmemLayoutAtomD,
      decltype(cutlass::epilogue::collective::detail::sm90_get_smem_store_op_for_accumulator<StrideD_, ElementD, EpiTile>()),
      cute::Copy_Atom<cute::SM90_U32x4_STSM_N, cutlass::half_t>,  // EpiTile's N is a multiple of 16
      void>;
  static_assert(cute::size<1>(EpiTile{}) % 16 == 0);

  using Mainloop = AlternatingKMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA, kAlignment,
      Element, LayoutB, kAlignment,
      float, TileShape, typename Tile::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Tile::KernelSchedule>::CollectiveOp>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, CollectiveEpilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;

  static typename Device::Arguments arguments(GemmProblem const& p, int device,
                                              typename EpilogueProgram::Arguments const& epilogue) {
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = device;
    hw_info.sm_count = sm_count(device);
    typename Device::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {int(p.m), int(p.n), int(p.k), 1},
        {static_cast<Element const*>(p.a), stride_from_ld<StrideA>(p.lda),
         static_cast<Element const*>(p.b), stride_from_ld<StrideB>(p.ldb)},
        {EpilogueProgram::to_callbacks(epilogue), nullptr, stride_from_ld<StrideD>(p.ldd),
         static_cast<ElementD*>(p.d), stride_from_ld<StrideD>(p.ldd)},
        hw_info};
    using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
    args.scheduler.raster_order =
        p.raster == 1 ? Raster::AlongM : (p.raster == 2 ? Raster::AlongN : Raster::Heuristic);
    args.scheduler.max_swizzle_size = p.swizzle > 0 ? p.swizzle : 1;
    return args;
  }

  static int current_device() {
    int device = 0;
    cudaGetDevice(&device);
    return device;
  }

  static size_t workspace_size(GemmProblem const& p) {
    return Device::get_workspace_size(arguments(p, current_device(), {}));
  }

  // The kernel's dynamic smem limit, raised once per device rather than on
  // every launch as GemmUniversalAdapter::initialize does.
  static cudaError_t allow_smem(int device) {
    static std::atomic<uint64_t> done{0};
    const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
    if (bit != 0 && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
    cudaError_t e = cudaSuccess;
    if (Kernel::SharedStorageSize >= (48 << 10)) {
      e = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(Kernel::SharedStorageSize));
    }
    if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_relaxed);
    return e;
  }

  // One cudaLaunchKernelExC with the cluster shape as a launch attribute:
  // what GemmUniversalAdapter::run does, less the cudaFuncSetAttribute it
  // repeats on every launch (clusters of 2 need no non-portable size).
  static cudaError_t launch(typename Kernel::Params const& params, cudaStream_t stream) {
    using Cluster = typename Tile::ClusterShape;
    static_assert(cute::size(Cluster{}) <= 8, "a non-portable cluster size needs cudaFuncAttributeNonPortableClusterSizeAllowed");
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = cute::size<0>(Cluster{});
    cluster.val.clusterDim.y = cute::size<1>(Cluster{});
    cluster.val.clusterDim.z = cute::size<2>(Cluster{});
    cudaLaunchConfig_t config{};
    config.gridDim = Kernel::get_grid_shape(params);
    config.blockDim = Kernel::get_block_shape();
    config.dynamicSmemBytes = Kernel::SharedStorageSize;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    void* kernel_params[] = {const_cast<typename Kernel::Params*>(&params)};
    return cudaLaunchKernelExC(&config, reinterpret_cast<void const*>(&cutlass::device_kernel<Kernel>), kernel_params);
  }

  // Runs on p.workspace, which must hold workspace_size(p) bytes (see with_workspace).
  static Status run(GemmProblem const& p, typename EpilogueProgram::Arguments const& epilogue) {
    const int device = current_device();
    auto args = arguments(p, device, epilogue);
    if (!Kernel::can_implement(args)) {
      return detail::fail(Status::kNotSupported, "CUTLASS cannot run this problem");
    }
    const size_t need = Device::get_workspace_size(args);
    if (need > p.workspace_bytes) {
      return detail::fail(Status::kWorkspaceTooSmall, "workspace has " + std::to_string(p.workspace_bytes) +
                                                          " bytes, needs " + std::to_string(need));
    }
    cutlass::Status st = Kernel::initialize_workspace(args, p.workspace, p.stream, nullptr);
    if (st != cutlass::Status::kSuccess) {
      return detail::fail(Status::kKernelError, std::string("CUTLASS: ") + cutlassGetStatusString(st));
    }
    cudaError_t e = allow_smem(device);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return detail::fail(Status::kCudaError, std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e));
    }
    auto params = Kernel::to_underlying_arguments(args, p.workspace);
    params.epilogue.tma_store_d.cache_hint_ = epilogues::kStoreL2D;
    params.mainloop.alternate_k = p.alternate_k;
    e = launch(params, p.stream);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return detail::fail(Status::kCudaError, std::string("kernel launch: ") + cudaGetErrorString(e));
    }
    return Status::kSuccess;
  }
};

inline size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The workspace of an op: the GEMM's own bytes, then `extra` bytes of
// scratch (fp32 reduction partials) after them.
template <class G>
size_t workspace_with(GemmProblem const& p, size_t extra) {
  return align_up(G::workspace_size(p)) + extra;
}

// Calls fn(q, scratch): q is p with its workspace cut to the GEMM's part,
// scratch points at the `extra` bytes after it. A caller that passed no
// workspace gets one allocated stream-ordered for this call; one that passed
// too small a workspace gets an error.
template <class G, class Fn>
Status with_workspace(GemmProblem const& p, size_t extra, Fn&& fn) {
  const size_t gemm_bytes = align_up(G::workspace_size(p));
  const size_t need = gemm_bytes + extra;
  GemmProblem q = p;
  bool owned = false;
  if (p.workspace_bytes < need) {
    if (p.workspace != nullptr) {
      return detail::fail(Status::kWorkspaceTooSmall, "workspace has " + std::to_string(p.workspace_bytes) +
                                                          " bytes, needs " + std::to_string(need));
    }
    cudaError_t e = cudaMallocAsync(&q.workspace, need, p.stream);
    if (e != cudaSuccess) return detail::fail(Status::kCudaError, std::string("cudaMallocAsync: ") + cudaGetErrorString(e));
    owned = true;
  }
  q.workspace_bytes = gemm_bytes;
  Status s = fn(q, q.workspace == nullptr ? nullptr : static_cast<char*>(q.workspace) + gemm_bytes);
  if (owned) cudaFreeAsync(q.workspace, p.stream);
  return s;
}

}  // namespace coda::kernels
