// The named primitives every epilogue program is assembled from, bound to one
// element type and one epilogue shape (EpilogueRecipe in csrc/gemm.cuh):
// scaling (per-row / per-column broadcasts), elementwise ops, aux loads and
// stores, and reductions over M or N into per-tile partials.
//
// CUTLASS's names, for reading the programs: Sm90ColBroadcast holds one value
// per row m (a column vector), Sm90RowBroadcast one per column n;
// Sm90ColReduction reduces over N (one value per row), Sm90RowReduction over
// M (one per column). Here they are PerRow / PerCol and ReduceN / ReduceM.
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/functional.h>

#include <cstdint>

#include "norm_ops.hpp"
#include "store_l2.hpp"

namespace coda::epilogues {

// A per-row broadcast whose rows past the problem's edge hold the node's
// default. Sm90ColBroadcast copies its vector with a predicate into a
// register buffer it never initializes, so those rows held whatever the
// registers did, and the norm's dγ (a sum over M of acc ⊙ x̂, x̂ built from
// mean and rstd) summed 0 · garbage for M % 128 != 0.
template <class Base>
struct ZeroOutsideRows : Base {
  using Base::Base;

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using Inner = decltype(Base::template get_consumer_store_callbacks<ReferenceSrc>(args));
    struct Callbacks : Inner {
      CUTLASS_DEVICE explicit Callbacks(Inner&& inner) : Inner(static_cast<Inner&&>(inner)) {}
      CUTLASS_DEVICE void begin() {
        Inner::begin();
        // The same pairing of coordinates and registers as Base's copy.
        auto coords = cute::filter_zeros(this->tCcCol, this->tCgCol.stride());
        auto values = cute::filter_zeros(this->tCrCol);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(values); ++i) {
          if (!cute::elem_less(coords(i), this->residue_tCcCol)) values(i) = this->params.null_default;
        }
      }
    };
    return Callbacks(Base::template get_consumer_store_callbacks<ReferenceSrc>(args));
  }
};

template <class Element_, class EpilogueDescriptor>
struct Primitives {
  using Element = Element_;
  using ElementCompute = float;  // every program computes in fp32
  static constexpr auto Round = cutlass::FloatRoundStyle::round_to_nearest;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;
  static constexpr int kAlignmentF32 = 4;
  using TileShape = typename EpilogueDescriptor::TileShape;
  using EpilogueTile = typename EpilogueDescriptor::EpilogueTile;
  using Layout = cutlass::layout::RowMajor;
  using Partial = Partials<TileShape>;

  // The smem of the aux tensors, as CUTLASS's Aux{Load,Store}Descriptor
  // would choose it.
  using StrideMN = cutlass::detail::TagToStrideC_t<Layout>;  // (M, N) row-major with a leading dimension
  using SmemLayoutAtom = typename EpilogueDescriptor::SmemLayoutAtom;
  struct LoadDesc {
    static constexpr int Stages = EpilogueDescriptor::AuxLoadStages;
    using SmemLayoutAtom = Primitives::SmemLayoutAtom;
    using CopyOpS2R = decltype(cutlass::epilogue::collective::detail::sm90_get_smem_load_op_for_source<
                               StrideMN, Element, EpilogueTile>());
  };
  struct StoreDesc {
    static constexpr int Stages = EpilogueDescriptor::AuxStoreStages;
    using SmemLayoutAtom = Primitives::SmemLayoutAtom;
    using CopyOpR2S = decltype(cutlass::epilogue::collective::detail::sm90_get_smem_store_op_for_accumulator<
                               StrideMN, Element, EpilogueTile>());
  };
  using StrideRowVec = cute::Stride<cute::_0, cute::_1, int64_t>;  // one value per column n
  using StrideColVec = cute::Stride<cute::_1, cute::_0, int64_t>;  // one value per row m

  static StrideMN matrix(int64_t ld) { return cute::make_stride(ld, cute::_1{}, int64_t(0)); }

  using Acc = cutlass::epilogue::fusion::Sm90AccFetch;
  // Fn<Array<float, N>> applied to the children, converted to Out.
  template <template <class> class Fn, class Out = ElementCompute>
  using Compute = cutlass::epilogue::fusion::Sm90Compute<Fn, Out, ElementCompute, Round>;
  // An (M, N) tensor in Element, through smem (null: the default value, no loads).
  using Load = cutlass::epilogue::fusion::Sm90AuxLoad<LoadDesc::Stages, EpilogueTile, Element, StrideMN,
                                                      typename LoadDesc::SmemLayoutAtom, typename LoadDesc::CopyOpS2R,
                                                      kAlignment>;
  // The child's value, also written as an (M, N) Element tensor (null: not
  // written), through smem with an L2-hinted TMA store (store_l2.hpp).
  using Store = AuxStoreL2<StoreDesc::Stages, EpilogueTile, Element, Round, StrideMN,
                           typename StoreDesc::SmemLayoutAtom, typename StoreDesc::CopyOpR2S, kAlignment>;
  // Per-row / per-column vectors (null: the default value).
  using PerRowF32 = ZeroOutsideRows<
      cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float, float, StrideColVec, kAlignmentF32>>;
  using PerColF32 = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float, StrideRowVec, kAlignmentF32>;
  using PerCol = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Element, float, StrideRowVec, kAlignment>;
  // Sums of the child over this tile's columns (one per row) / rows (one per
  // column), fp32, into Partial's buffers; RegReduce folds one value in
  // (square_and_plus: Σ y²). Null: skipped. The child's value passes through.
  //
  // Every element of the tile is summed without comparing its coordinates to
  // the problem's edge (VisitCheckOOB false): the comparisons are per element
  // in an epilogue the cooperative kernel's MMAs wait for, and cost fc2's
  // dgrad 2.6% with the bias gradient. So every reduced value must be 0
  // outside the problem: the accumulator is (TMA fills A and B there with
  // zeros), aux loads are zero-filled by TMA, PerCol broadcasts fill their
  // defaults there and PerRowF32 (ZeroOutsideRows) does; a new program keeps
  // its reduced values products or sums of those.
  template <template <class> class RegReduce = cutlass::plus>
  using ReduceN = cutlass::epilogue::fusion::Sm90ColReduction<
      RegReduce, cutlass::plus, cutlass::plus, 0, TileShape, ElementCompute, ElementCompute, Round, StrideColVec,
      kAlignmentF32, /*EnableNullptr=*/true, /*FinalReduction=*/false, /*VisitCheckOOB=*/false>;
  using ReduceM = cutlass::epilogue::fusion::Sm90RowReduction<
      cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape, ElementCompute, ElementCompute, Round, StrideRowVec,
      kAlignmentF32, /*EnableNullptr=*/true, /*FinalReduction=*/false, /*VisitCheckOOB=*/false>;
};

}  // namespace coda::epilogues
