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

#include <string>

#include "store_l2.hpp"
#include "error.h"
#include "kernels.h"

namespace coda::kernels {

template <DType T>
struct ElementOf;
template <>
struct ElementOf<DType::kBFloat16> { using type = cutlass::bfloat16_t; };
template <>
struct ElementOf<DType::kFloat16> { using type = cutlass::half_t; };

template <Config C>
struct TileConfig;

// EpiTile: the epilogue's subtile, CUTLASS's automatic choice unless named
// (128x32 for a cooperative 128-row tile, 64x32 for ping-pong). EpiStages:
// at most this many smem buffers per loaded or stored tensor (0: the recipe's
// own counts, see EpilogueRecipe).
using EpilogueTileAuto = cutlass::epilogue::collective::EpilogueTileAuto;

template <class Tile, class Cluster, class Scheduler = void, class EpiTile = EpilogueTileAuto, int EpiStages = 0>
struct CooperativeTile {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using EpilogueTile = EpiTile;
  static constexpr int kEpilogueStages = EpiStages;
  static constexpr bool kDirectAux = false;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using TileScheduler = Scheduler;  // void: CUTLASS's persistent data-parallel scheduler
};

// Cooperative, with the two consumer warp groups splitting the tile along N
// (each holds TileM x TileN/2) instead of along M as CUTLASS's builder does.
// That allows tiles whose M is not a multiple of 128 (192x192, 320x128: the
// shapes of cuBLAS's "coopB" kernels on this GPU). The epilogue's register
// to smem copy then covers columns of both halves at once (CUTLASS builds it
// from the MMA's C layout), so the subtile must span the whole tile width:
// EpiTile is (64, TileN), and EpiStages keeps its buffers few.
// The copy also reaches across the halves (column j and TileN/2 + j), so
// the smem swizzle atom must divide TileN/2: SwizzleTile is what the atom is
// chosen for (64x32: 64-byte swizzle, for TileN/2 = 96).
template <class Tile, class Cluster, class EpiTile, class SwizzleTile = EpiTile, int EpiStages = 1>
struct CooperativeSplitNTile : CooperativeTile<Tile, Cluster, void, EpiTile, EpiStages> {
  static constexpr bool kSplitN = true;
  using SmemSwizzleTile = SwizzleTile;
};

// DirectAux: the epilogue program's aux loads and stores move between
// registers and global memory (CUTLASS's Sm90AuxLoad / Sm90AuxStore with 0
// stages) instead of through smem and TMA. The question it answered: ping-pong
// hides the other warp group's epilogue ALU work but not its H store (+2.6-
// 2.8% on fc1's forward, GELU itself 1%); is that smem traffic next to a
// 128x128 mainloop that reads smem near its bandwidth? No: stored directly,
// H cost as much or more (1.029x against 1.019x cuBLAS, 4ce0c57), and direct
// loads stall the epilogue on their latency (fc2's dgrad with H 1.54x,
// o-proj's residual 1.064x against 1.014x, 8d81d04). A sweep candidate only.
template <class Tile, class Cluster, class EpiTile = EpilogueTileAuto, bool DirectAux = false>
struct PingpongTile {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using EpilogueTile = EpiTile;
  static constexpr int kEpilogueStages = 0;
  static constexpr bool kDirectAux = DirectAux;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
  using TileScheduler = void;
};

using cute::_1;
using cute::_2;
using cute::_16;
using cute::_32;
using cute::_64;
using cute::_128;
using cute::_192;
using cute::_256;
using _320 = cute::Int<320>;

template <>
struct TileConfig<Config::kCooperative128x256> : CooperativeTile<cute::Shape<_128, _256, _64>, cute::Shape<_2, _1, _1>> {};
template <>
struct TileConfig<Config::kPingpong128x128> : PingpongTile<cute::Shape<_128, _128, _64>, cute::Shape<_1, _2, _1>> {};
template <>
struct TileConfig<Config::kCooperativeStreamK128x256>
    : CooperativeTile<cute::Shape<_128, _256, _64>, cute::Shape<_2, _1, _1>, cutlass::gemm::StreamKScheduler> {};
template <>
struct TileConfig<Config::kCooperative128x256Cluster1>
    : CooperativeTile<cute::Shape<_128, _256, _64>, cute::Shape<_1, _1, _1>> {};
template <>
struct TileConfig<Config::kCooperative256x128> : CooperativeTile<cute::Shape<_256, _128, _64>, cute::Shape<_1, _2, _1>> {};
template <>
struct TileConfig<Config::kPingpong128x128Cluster2x1>
    : PingpongTile<cute::Shape<_128, _128, _64>, cute::Shape<_2, _1, _1>> {};
template <>
struct TileConfig<Config::kPingpong128x192Cluster2x1>
    : PingpongTile<cute::Shape<_128, _192, _64>, cute::Shape<_2, _1, _1>> {};
template <>
struct TileConfig<Config::kPingpong128x192> : PingpongTile<cute::Shape<_128, _192, _64>, cute::Shape<_1, _2, _1>> {};
template <>
struct TileConfig<Config::kCooperative256x192> : CooperativeTile<cute::Shape<_256, _192, _64>, cute::Shape<_2, _1, _1>> {};
template <>
struct TileConfig<Config::kCooperative256x128Cluster2x1>
    : CooperativeTile<cute::Shape<_256, _128, _64>, cute::Shape<_2, _1, _1>> {};
template <>
struct TileConfig<Config::kCooperative128x256Epi16>
    : CooperativeTile<cute::Shape<_128, _256, _64>, cute::Shape<_2, _1, _1>, void, cute::Shape<_128, _16>> {};
template <>
struct TileConfig<Config::kCooperative128x256Epi1Stage>
    : CooperativeTile<cute::Shape<_128, _256, _64>, cute::Shape<_2, _1, _1>, void, EpilogueTileAuto, 1> {};
template <>
struct TileConfig<Config::kSplitN192x192>
    : CooperativeSplitNTile<cute::Shape<_192, _192, _64>, cute::Shape<_2, _1, _1>, cute::Shape<_64, _192>,
                            cute::Shape<_64, _32>> {};
template <>
struct TileConfig<Config::kSplitN320x128>
    : CooperativeSplitNTile<cute::Shape<_320, _128, _64>, cute::Shape<_1, _2, _1>, cute::Shape<_64, _128>> {};
template <>
struct TileConfig<Config::kPingpong128x128Epi64>
    : PingpongTile<cute::Shape<_128, _128, _64>, cute::Shape<_1, _2, _1>, cute::Shape<_64, _64>> {};
template <>
struct TileConfig<Config::kPingpong128x128DirectAux>
    : PingpongTile<cute::Shape<_128, _128, _64>, cute::Shape<_1, _2, _1>, EpilogueTileAuto, true> {};

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
// load pipeline (which every aux load of an epilogue program shares, one smem
// buffer per stage and loaded tensor) is at most kEpilogueLoadStages deep.
//
// Why: every smem byte the epilogue holds is carved out of the mainloop's
// operand stages (StageCountAutoCarveout). CUTLASS gives the load pipeline
// min(subtiles, 4) stages, 32 KB per loaded tensor for a 128x256 tile with
// 128x32 subtiles: one 48 KB mainloop stage per tensor. On an H200 the norm's
// dgrad epilogue (two aux loads, an aux store, D) left the mainloop 2 stages
// and ran 1.44x the plain dgrad whichever of its outputs were switched off
// (benchmarks/results, run of 8efa041). Two stages keep one subtile's load in
// flight while the previous one is consumed.
//
// Loading H costs fc2's dgrad 3.5-4% (80f6f55 breakdown), and the later
// subtiles of a tile wait for a buffer before their loads start. Neither
// latency nor L2 residency is the cost: an aux-load node that prefetched
// each tile's later subtiles into L2 when the tile started (normal or
// evict-last priority), with or without evict-first loads, ran fc2's dgrad
// with GELU' and db1 at 1.070-1.073x cuBLAS against 1.069x without, the
// norm's dgrad at 1.039-1.040x against 1.040x (f2b0385, interleaved; the
// node was removed after that run). Nor is it this cap: four buffers (and
// three mainloop stages) ran fc2's dgrad with GELU' and db1 in the same
// 3.536 ms as two (c2bc99a, kernels.h's note on 17). Nor the consumers'
// per-subtile hand-back of the buffer (a proxy fence and an arrive):
// reading H as the GEMM's C with CUTLASS's source recipe (four buffers D is
// stored from, handed back after the TMA store; no delayed store) made its
// load cost more, 3.494 against 3.345 ms with db1, and GELU' with db1 no
// less, 3.556 ms (95e756f run, interleaved; reverted).
constexpr int kEpilogueLoadStages = 2;

template <class TileShape_, class EpilogueTileType, class Element, class Schedule, int MaxStages = 0,
          class SwizzleTile = void, bool DirectAux = false>
struct EpilogueRecipe {
  using TileShape = TileShape_;
  // A named subtile is used as given: CUTLASS's helper would refuse the
  // 64-row subtiles of a cooperative split-N tile, which the collective runs.
  using EpilogueTile = std::conditional_t<
      std::is_same_v<EpilogueTileType, EpilogueTileAuto>,
      decltype(cutlass::epilogue::collective::detail::sm90_compute_tile_shape_or_override<
               Element, EpilogueTileAuto, Schedule, TileShape>()),
      EpilogueTileType>;
  using Stock = decltype(cutlass::epilogue::collective::detail::sm90_get_tma_dispatch_policy<
                         TileShape, EpilogueTile, void, Element, Schedule>());
  // The smem swizzle atom of D and of every aux tensor (all row-major
  // Element), chosen for SmemSwizzleTile.
  using SmemSwizzleTile = std::conditional_t<std::is_void_v<SwizzleTile>, EpilogueTile, SwizzleTile>;
  using SmemLayoutAtom = decltype(cutlass::epilogue::collective::detail::sm90_get_epilogue_smem_swizzle_layout_atom<
                                  cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>, Element,
                                  SmemSwizzleTile>());
  static constexpr int kLoadCap = MaxStages > 0 && MaxStages < kEpilogueLoadStages ? MaxStages : kEpilogueLoadStages;
  static constexpr int StagesC = Stock::StagesC < kLoadCap ? Stock::StagesC : kLoadCap;
  static constexpr int StagesD = MaxStages > 0 && MaxStages < Stock::StagesD ? MaxStages : Stock::StagesD;
  using DispatchPolicy = cutlass::epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, Stock::FragmentSize,
                                                                   Stock::ReuseSmemC, Stock::DelayTmaStore>;
  // The stages of the program's aux loads and stores (0: registers <-> global).
  static constexpr int AuxLoadStages = DirectAux ? 0 : StagesC;
  static constexpr int AuxStoreStages = DirectAux ? 0 : StagesD;
};

template <class Tile, class = void>
struct SwizzleTileOf {
  using type = void;
};
template <class Tile>
struct SwizzleTileOf<Tile, std::void_t<typename Tile::SmemSwizzleTile>> {
  using type = typename Tile::SmemSwizzleTile;
};

template <class Tile, class = void>
struct IsSplitN : std::false_type {};
template <class Tile>
struct IsSplitN<Tile, std::void_t<decltype(Tile::kSplitN)>> : std::bool_constant<Tile::kSplitN> {};

// The builder's mainloop, or for a split-N tile the same collective with a
// tiled MMA of two (TileM x TileN/2) warp-group atoms side by side in N.
template <class Tile, class Built, class Element, class LayoutA, class LayoutB, bool = IsSplitN<Tile>::value>
struct MainloopFor {
  using type = Built;
};
template <class Tile, class Element, class LayoutA, class LayoutB, class DP, class TS, class EA, class SA, class EB,
          class SB, class TM, class GA, class LA, class CA, class TA, class GB, class LB, class CB, class TB>
struct MainloopFor<Tile, cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, TM, GA, LA, CA, TA, GB, LB, CB, TB>,
                   Element, LayoutA, LayoutB, true> {
  using HalfTile = cute::Shape<decltype(cute::get<0>(TS{})), cute::Int<decltype(cute::get<1>(TS{}))::value / 2>,
                               decltype(cute::get<2>(TS{}))>;
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, HalfTile,
                                 cutlass::gemm::collective::detail::gmma_ss_tag_to_major_A<Element, LayoutA>(),
                                 cutlass::gemm::collective::detail::gmma_ss_tag_to_major_B<Element, LayoutB>()>(),
      cute::Layout<cute::Shape<_1, _2, _1>>{}));
  using type = cutlass::gemm::collective::CollectiveMma<DP, TS, EA, SA, EB, SB, TiledMma, GA, LA, CA, TA, GB, LB, CB, TB>;
};

// The mainloop, with a run-time switch (Params::alternate_k) that has each
// CTA load the k-blocks of its odd-numbered tiles last to first.
//
// Why: a persistent kernel's CTAs run their j-th tiles at about the same
// time, a wave, and consecutive waves of a raster band share one operand's
// panels. Nsight Compute's DRAM reads match a model in which no panel
// survives in L2 from one wave to the next (fc1's forward: 3.2 GB read per
// launch, 5.2 GB with the band twice as wide, 8.9 GB four times, e1f9d23),
// and at the power cap each GB read cost ~0.09 J of a 2.3 J kernel. A wave
// that walks K in the opposite order to the one before it starts on the
// k-blocks that wave read last, which are the ones still in L2.
//
// Tried and removed: a tile order that knows the L2's two partitions. A
// probe (one block per SM timing lines a reference SM had just read) split
// the H200's 132 SMs into two groups of 66, TPC pairs, at 273-299 and
// 359-392 cycles per load: data one SM reads is cached on its partition's
// side. A persistent scheduler then gave each partition's clusters a
// contiguous run of every wave's tiles, so that each side holds half the
// wave's B panels. It changed little (2936fa2 power probe, against cuBLAS's
// energy): fc2's dgrad 0.996 against 1.002 plain, 1.053 against 1.059 with
// GELU' and db1; fc1's ping-pong forward 1.015 against 1.013, reading more
// (2.77 against 2.37 GB, ncu); the MLP forward + backward 20.16 against
// 20.13 ms interleaved and 20.13 against 20.17 steady. Commit 2936fa2 has
// the probe (csrc/l2_partition.cu) and the scheduler.
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

template <DType T, class LayoutA, class LayoutB, Config C, template <class, class> class Program>
struct Gemm {
  using Element = typename ElementOf<T>::type;
  using Tile = TileConfig<C>;
  using TileShape = typename Tile::TileShape;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;
  using LayoutD = cutlass::layout::RowMajor;

  // What the epilogue programs read their node parameters from (TileShape,
  // EpilogueTile, StagesC/StagesD), as CUTLASS's EpilogueDescriptor would give.
  using EpilogueDescriptor =
      EpilogueRecipe<TileShape, typename Tile::EpilogueTile, Element, typename Tile::EpilogueSchedule,
                     Tile::kEpilogueStages, typename SwizzleTileOf<Tile>::type, Tile::kDirectAux>;
  using EpilogueProgram = Program<Element, EpilogueDescriptor>;

  // The collective builder's assembly (Sm90TmaBuilderImpl), with the
  // recipe's dispatch policy and swizzle. No C: residuals come in through
  // the program's own loads.
  using EpiTile = typename EpilogueDescriptor::EpilogueTile;
  using StrideD_ = cutlass::detail::TagToStrideC_t<LayoutD>;
  using CollectiveEpilogue = cutlass::epilogue::collective::CollectiveEpilogue<
      typename EpilogueDescriptor::DispatchPolicy, TileShape, EpiTile,
      void, StrideD_, Element, StrideD_,
      typename EpilogueProgram::Callbacks,
      cute::SM90_TMA_LOAD, typename EpilogueDescriptor::SmemLayoutAtom,
      decltype(cutlass::epilogue::collective::detail::sm90_get_smem_load_op_for_source<StrideD_, Element, EpiTile>()),
      epilogues::TmaStoreL2, typename EpilogueDescriptor::SmemLayoutAtom,
      decltype(cutlass::epilogue::collective::detail::sm90_get_smem_store_op_for_accumulator<StrideD_, Element, EpiTile>()),
      cute::Copy_Atom<cute::SM90_U32x4_STSM_N, cutlass::half_t>,  // EpiTile's N is a multiple of 16
      void>;
  static_assert(cute::size<1>(EpiTile{}) % 16 == 0);

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA, kAlignment,
      Element, LayoutB, kAlignment,
      float, TileShape, typename Tile::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Tile::KernelSchedule>::CollectiveOp;

  using Mainloop = AlternatingKMainloop<typename MainloopFor<Tile, BuiltMainloop, Element, LayoutA, LayoutB>::type>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      CollectiveEpilogue, typename Tile::TileScheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;

  static typename Device::Arguments arguments(GemmProblem const& p,
                                              typename EpilogueProgram::Arguments const& epilogue) {
    int device = 0;
    cudaGetDevice(&device);
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = device;
    hw_info.sm_count = sm_count(device);

    typename Device::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {int(p.m), int(p.n), int(p.k), 1},
        {static_cast<Element const*>(p.a), stride_from_ld<StrideA>(p.lda),
         static_cast<Element const*>(p.b), stride_from_ld<StrideB>(p.ldb)},
        {EpilogueProgram::to_callbacks(epilogue), nullptr, stride_from_ld<StrideD>(p.ldd),
         static_cast<Element*>(p.d), stride_from_ld<StrideD>(p.ldd)},
        hw_info};
    using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
    args.scheduler.raster_order =
        p.raster == 1 ? Raster::AlongM : (p.raster == 2 ? Raster::AlongN : Raster::Heuristic);
    args.scheduler.max_swizzle_size = p.swizzle > 0 ? p.swizzle : 1;
    if constexpr (std::is_same_v<typename Tile::TileScheduler, cutlass::gemm::StreamKScheduler>) {
      // Stream-K always: CUTLASS's heuristic runs data-parallel wherever the
      // last wave is at least half full, the 15.5 waves of the MLP's K-large
      // GEMMs among them. Deterministic reduction (the scheduler's default).
      // It lost to data-parallel everywhere it was measured (kernels.h, 2).
      args.scheduler.decomposition_mode = Kernel::TileScheduler::DecompositionMode::StreamK;
    }
    return args;
  }

  static size_t workspace_size(GemmProblem const& p) {
    return Device::get_workspace_size(arguments(p, {}));
  }

  // Runs on p.workspace, which must hold workspace_size(p) bytes (see with_workspace).
  static Status run(GemmProblem const& p, typename EpilogueProgram::Arguments const& epilogue) {
    auto args = arguments(p, epilogue);
    Device gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st != cutlass::Status::kSuccess) {
      return detail::fail(Status::kNotSupported,
                          std::string("CUTLASS cannot run this problem: ") + cutlassGetStatusString(st));
    }
    size_t need = Device::get_workspace_size(args);
    if (need > p.workspace_bytes) {
      return detail::fail(Status::kWorkspaceTooSmall, "workspace has " + std::to_string(p.workspace_bytes) +
                                                          " bytes, needs " + std::to_string(need));
    }
    st = gemm.initialize(args, p.workspace, p.stream);
    if (st == cutlass::Status::kSuccess) {
      // D's L2 priority rides in its TMA copy (store_l2.hpp).
      auto params = gemm.params();
      params.epilogue.tma_store_d.cache_hint_ = epilogues::store_l2_policy().d.load(std::memory_order_relaxed);
      params.mainloop.alternate_k = p.alternate_k;
      st = Device::run(params, p.stream);
    }
    cudaError_t launch = cudaGetLastError();
    if (launch != cudaSuccess) {
      return detail::fail(Status::kCudaError, std::string("kernel launch: ") + cudaGetErrorString(launch));
    }
    if (st != cutlass::Status::kSuccess) {
      return detail::fail(Status::kKernelError, std::string("CUTLASS: ") + cutlassGetStatusString(st));
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
