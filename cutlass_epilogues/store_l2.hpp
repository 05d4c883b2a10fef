// TMA stores that carry an L2 eviction priority, for D and for aux outputs.
//
// CUTLASS's SM90_TMA_STORE issues `cp.async.bulk.tensor` without
// `.L2::cache_hint`, and Sm90AuxStore builds its copy from it. TmaStoreL2 is
// the same store with the hint; its Copy_Traits hold the policy beside the
// descriptor, so the host sets it per launch (l2_policy.hpp) without another
// instantiation. AuxStoreL2 is Sm90AuxStore's role (registers -> smem ->
// TMA store, one subtile per store iteration) with that copy.
#pragma once

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp>

#include "l2_policy.hpp"

namespace coda::epilogues {

struct TmaStoreL2 {
  // The tensor map's coordinates, innermost first; rank 2 and 3 cover the
  // (M, N, L) tensors of an epilogue.
  CUTE_HOST_DEVICE static void copy(void const* desc, void const* smem, uint64_t policy, int32_t const& c0,
                                    int32_t const& c1) {
#if defined(CUTE_ARCH_TMA_SM90_ENABLED)
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3}], [%1], %4;"
                 :
                 : "l"(reinterpret_cast<uint64_t>(desc)), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1),
                   "l"(policy)
                 : "memory");
#else
    CUTE_INVALID_CONTROL_PATH("TmaStoreL2 needs sm_90a");
#endif
  }
  CUTE_HOST_DEVICE static void copy(void const* desc, void const* smem, uint64_t policy, int32_t const& c0,
                                    int32_t const& c1, int32_t const& c2) {
#if defined(CUTE_ARCH_TMA_SM90_ENABLED)
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4}], [%1], %5;"
        :
        : "l"(reinterpret_cast<uint64_t>(desc)), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1), "r"(c2),
          "l"(policy)
        : "memory");
#else
    CUTE_INVALID_CONTROL_PATH("TmaStoreL2 needs sm_90a");
#endif
  }
};

}  // namespace coda::epilogues

namespace cute {

// make_tma_copy builds these as {descriptor, aux params}; cache_hint_ starts
// at evict-normal (what a store without the hint gets) until the host sets it.
template <class NumBitsPerTMA, class AuxParams_>
struct Copy_Traits<coda::epilogues::TmaStoreL2, NumBitsPerTMA, AuxParams_> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;
  using AuxParams = AuxParams_;

  TmaDescriptor tma_desc_;
  AuxParams aux_params_;
  uint64_t cache_hint_ = coda::epilogues::kL2EvictNormal;

  CUTE_HOST_DEVICE constexpr TmaDescriptor const* get_tma_descriptor() const { return &tma_desc_; }

  template <class GShape>
  CUTE_HOST_DEVICE constexpr auto get_tma_tensor(GShape const& g_shape) const {
    return make_coord_tensor(make_layout(g_shape, aux_params_.g_stride_));
  }

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    static_assert(is_smem<TS>::value, "TmaStoreL2 copies from smem");
    auto coord = dst.data().coord_;
    void const* smem = raw_pointer_cast(src.data());
    if constexpr (rank(decltype(coord){}) == 2) {
      coda::epilogues::TmaStoreL2::copy(&traits.tma_desc_, smem, traits.cache_hint_, get<0>(coord), get<1>(coord));
    } else {
      static_assert(rank(decltype(coord){}) == 3, "TmaStoreL2 takes 2- and 3-d tensor maps");
      coda::epilogues::TmaStoreL2::copy(&traits.tma_desc_, smem, traits.cache_hint_, get<0>(coord), get<1>(coord),
                                        get<2>(coord));
    }
  }
};

}  // namespace cute

namespace coda::epilogues {

// An (M, N) output of the epilogue program through smem and a hinted TMA
// store (null pointer: not written). The smem layout is Sm90AuxStore's, so
// the node holds the same bytes.
template <int Stages, class EpilogueTile, class Element, cutlass::FloatRoundStyle Round, class StrideMNL,
          class SmemLayoutAtom, class CopyOpR2S, int Alignment>
struct AuxStoreL2 {
  static_assert(Stages > 0, "AuxStoreL2 stores through smem");
  using Stock = cutlass::epilogue::fusion::Sm90AuxStore<Stages, EpilogueTile, Element, Round, StrideMNL,
                                                        SmemLayoutAtom, CopyOpR2S, Alignment>;
  using SmemLayoutTma = typename Stock::SmemLayoutTma;  // one TMA box
  using SmemLayout = typename Stock::SmemLayout;        // (EPI_M, EPI_N, Stages)
  using SharedStorage = typename Stock::SharedStorage;
  using Arguments = typename Stock::Arguments;          // {ptr_aux, dAux}

  struct Params {
    using Tma = decltype(cute::make_tma_copy(
        TmaStoreL2{},
        cute::make_tensor(static_cast<Element*>(nullptr), cute::repeat_like(StrideMNL{}, int32_t(0)), StrideMNL{}),
        SmemLayoutTma{}));
    Tma tma;
    bool is_nullptr = true;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    auto [M, N, K, L] = cute::append<4>(problem_shape, 1);
    Params p;
    p.is_nullptr = args.ptr_aux == nullptr;
    if (!p.is_nullptr) {
      auto tensor = cute::make_tensor(args.ptr_aux, cute::make_layout(cute::make_shape(M, N, L), args.dAux));
      p.tma = cute::make_tma_copy(TmaStoreL2{}, tensor, SmemLayoutTma{});
      p.tma.cache_hint_ = kStoreL2Aux;
    }
    return p;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE AuxStoreL2() {}
  CUTLASS_HOST_DEVICE AuxStoreL2(Params const& params, SharedStorage const& shared)
      : params_ptr(&params), smem(const_cast<Element*>(shared.smem_aux.data())) {}

  Params const* params_ptr = nullptr;
  Element* smem = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  // Per thread: the fragment of each visit collects in regs; postreduce
  // copies them to the store iteration's smem buffer, tma_store (one thread)
  // sends the buffer out.
  template <class RegTensor, class TiledR2S, class SmemR2S, class SmemS2G, class GmemS2G>
  struct Callbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE Callbacks(RegTensor&& regs_, TiledR2S r2s_, SmemR2S&& smem_r2s_, SmemS2G&& smem_s2g_,
                             GmemS2G&& gmem_s2g_, Params const* params_)
        : regs(cute::forward<RegTensor>(regs_)), r2s(r2s_), smem_r2s(cute::forward<SmemR2S>(smem_r2s_)),
          smem_s2g(cute::forward<SmemS2G>(smem_s2g_)), gmem_s2g(cute::forward<GmemS2G>(gmem_s2g_)),
          params(params_) {}

    RegTensor regs;     // (CPY, CPY_M, CPY_N)
    TiledR2S r2s;
    SmemR2S smem_r2s;   // (R2S, R2S_M, R2S_N, PIPE)
    SmemS2G smem_s2g;   // (TMA, TMA_M, TMA_N, PIPE)
    GmemS2G gmem_s2g;   // (TMA, TMA_M, TMA_N, EPI_M, EPI_N)
    Params const* params;

    template <class ElementAcc, class ElementIn, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAcc, FragmentSize> const&, int epi_v, int, int,
                              cutlass::Array<ElementIn, FragmentSize> const& in) {
      cutlass::NumericArrayConverter<Element, ElementIn, FragmentSize, Round> convert;
      cute::recast<cutlass::Array<Element, FragmentSize>>(cute::coalesce(regs))(epi_v) = convert(in);
      return in;
    }

    CUTLASS_DEVICE void postreduce(int, int, int store_iteration, bool issue_smem_store) {
      if (params->is_nullptr || !issue_smem_store) return;
      using R2SLayout = decltype(cute::layout(TiledR2S{}.get_slice(0).retile_S(RegTensor{})));
      cute::copy(r2s, cute::make_tensor(regs.data(), R2SLayout{}), smem_r2s(cute::_, cute::_, cute::_, store_iteration % Stages));
    }

    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int store_iteration, bool issue_tma_store) {
      if (params->is_nullptr || !issue_tma_store) return;
      cute::copy(params->tma, smem_s2g(cute::_, cute::_, cute::_, store_iteration % Stages),
                 gmem_s2g(cute::_, cute::_, cute::_, epi_m, epi_n));
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    Tensor gmem_tile = local_tile(params_ptr->tma.get_tma_tensor(make_shape(M, N, L)), take<0, 2>(args.tile_shape_mnk),
                                  make_coord(m, n, l));                               // (CTA_M, CTA_N)
    Tensor thread_gmem = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        gmem_tile, args.epi_tile, args.tiled_copy, args.thread_idx);                  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N)
    Tensor regs = make_tensor<Element>(take<0, 3>(shape(thread_gmem)));              // (CPY, CPY_M, CPY_N)

    Tensor smem_epi = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(smem), SmemLayout{}));                              // (EPI_TILE_M, EPI_TILE_N, PIPE)
    Tensor gmem_epi = flat_divide(gmem_tile, args.epi_tile);                          // (EPI_TILE_M, EPI_TILE_N, EPI_M, EPI_N)
    auto r2s = conditional_return<ReferenceSrc>(make_tiled_copy_S(Copy_Atom<CopyOpR2S, Element>{}, args.tiled_copy),
                                                make_tiled_copy_D(Copy_Atom<CopyOpR2S, Element>{}, args.tiled_copy));
    Tensor smem_r2s = r2s.get_slice(args.thread_idx).partition_D(smem_epi);
    auto s2g = params_ptr->tma.get_slice(_0{});
    Tensor smem_s2g = s2g.partition_S(smem_epi);
    Tensor gmem_s2g = s2g.partition_D(gmem_epi);
    return Callbacks<decltype(regs), decltype(r2s), decltype(smem_r2s), decltype(smem_s2g), decltype(gmem_s2g)>(
        cute::move(regs), r2s, cute::move(smem_r2s), cute::move(smem_s2g), cute::move(gmem_s2g), params_ptr);
  }
};

}  // namespace coda::epilogues
