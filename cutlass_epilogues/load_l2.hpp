// An aux load (H, x, a residual) whose tile is fetched into L2 ahead of the
// epilogue, and whose TMA loads carry an L2 eviction priority.
//
// Why: a cooperative kernel's epilogue does not overlap its mainloop, and
// its aux loads go through a pipeline two subtiles deep (gemm.cuh,
// kEpilogueLoadStages). The first two subtiles of a tile are in smem before
// the epilogue starts; each later one is requested only when a buffer frees,
// and the consumers wait out a DRAM round trip for it. On fc2's dgrad
// loading H costs 3.5-4% of the kernel (the 80f6f55 breakdown, against 0.5%
// for the bias gradient and 0.3% for GELU'), three times what reading 512 MB
// at the power cap would. Prefetching the tile's later subtiles when the
// epilogue's load warp starts the tile (during the tile's mainloop) turns
// those round trips into L2 hits, if the lines survive until the epilogue:
// hence the optional evict-last priority of the prefetch, and evict-first on
// the loads that consume the lines.
//
// The node is CUTLASS's Sm90AuxLoad (same smem, same consumer side) with its
// producer callbacks wrapped; the policies are kernel parameters set on the
// host per launch (l2_policy.hpp), 0 meaning Sm90AuxLoad's behaviour.
#pragma once

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>

#include "l2_policy.hpp"

namespace coda::epilogues {

// cp.async.bulk.prefetch.tensor with an L2 cache policy (cute's
// SM90_TMA_LOAD::PREFETCH has none).
struct TmaPrefetchL2 {
  template <class Coord>
  CUTE_DEVICE static void prefetch(void const* desc, uint64_t policy, Coord const& c) {
#if defined(CUTE_ARCH_TMA_SM90_ENABLED)
    const uint64_t d = reinterpret_cast<uint64_t>(desc);
    if constexpr (cute::rank(Coord{}) == 2) {
      asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.L2::cache_hint [%0, {%1, %2}], %3;"
                   :
                   : "l"(d), "r"(int32_t(cute::get<0>(c))), "r"(int32_t(cute::get<1>(c))), "l"(policy)
                   : "memory");
    } else {
      static_assert(cute::rank(Coord{}) == 3, "TmaPrefetchL2 takes 2- and 3-d tensor maps");
      asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.L2::cache_hint [%0, {%1, %2, %3}], %4;"
                   :
                   : "l"(d), "r"(int32_t(cute::get<0>(c))), "r"(int32_t(cute::get<1>(c))),
                     "r"(int32_t(cute::get<2>(c))), "l"(policy)
                   : "memory");
    }
#else
    CUTE_INVALID_CONTROL_PATH("TmaPrefetchL2 needs sm_90a");
#endif
  }
};

template <int Stages, class EpilogueTile, class Element, class StrideMNL, class SmemLayoutAtom, class CopyOpS2R,
          int Alignment>
struct AuxLoadL2 : cutlass::epilogue::fusion::Sm90AuxLoad<Stages, EpilogueTile, Element, StrideMNL, SmemLayoutAtom,
                                                          CopyOpS2R, Alignment> {
  static_assert(Stages > 0, "AuxLoadL2 loads through smem");
  using Base = cutlass::epilogue::fusion::Sm90AuxLoad<Stages, EpilogueTile, Element, StrideMNL, SmemLayoutAtom,
                                                      CopyOpS2R, Alignment>;
  using typename Base::Arguments;
  using typename Base::SharedStorage;

  struct Params : Base::Params {
    uint64_t prefetch_policy = 0;  // 0: no prefetch
    uint64_t load_policy = kL2EvictNormal;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    Params p{Base::to_underlying_arguments(shape, args, workspace)};
    p.prefetch_policy = load_l2_policy().prefetch.load(std::memory_order_relaxed);
    p.load_policy = load_l2_policy().load.load(std::memory_order_relaxed);
    return p;
  }

  CUTLASS_HOST_DEVICE AuxLoadL2() {}
  CUTLASS_HOST_DEVICE AuxLoadL2(Params const& params, SharedStorage const& shared)
      : Base(params, shared), params_l2(&params) {}

  Params const* params_l2 = nullptr;

  template <class Inner>
  struct ProducerCallbacks : Inner {
    CUTLASS_DEVICE ProducerCallbacks(Inner&& inner, Params const* p) : Inner(cute::move(inner)), l2(p) {}
    Params const* l2;

    // Called by the whole (converged) load warp once per tile, before the
    // first subtile's load waits for a buffer. Subtiles are loaded epi_n
    // outer, epi_m inner (CollectiveEpilogue::load); the first Stages of them
    // go straight to smem.
    CUTLASS_DEVICE void begin() {
      if (l2->prefetch_policy == 0 || l2->use_default || !cute::elect_one_sync()) return;
      constexpr int kEpiM = cute::size<3>(decltype(this->bGS_gAux){});
      constexpr int kEpiN = cute::size<4>(decltype(this->bGS_gAux){});
      static_assert(cute::size<1>(decltype(this->bGS_gAux){}) == 1 && cute::size<2>(decltype(this->bGS_gAux){}) == 1,
                    "one TMA box per subtile");
      CUTLASS_PRAGMA_UNROLL
      for (int i = Stages; i < kEpiM * kEpiN; ++i) {
        auto box = this->bGS_gAux(cute::_, cute::_, cute::_, i % kEpiM, i / kEpiM);
        TmaPrefetchL2::prefetch(l2->tma_load_aux.get_tma_descriptor(), l2->prefetch_policy, box.data().coord_);
      }
    }

    // Sm90AuxLoad's step, with the load's L2 policy.
    CUTLASS_DEVICE void step(uint64_t* full_mbarrier_ptr, int epi_m, int epi_n, int load_iteration,
                             bool issue_tma_load) {
      if (l2->use_default || !issue_tma_load) return;
      constexpr uint32_t bytes = cute::size(cute::take<0, 2>(typename Base::SmemLayout{})) *
                                 cute::sizeof_bits_v<Element> / 8;
      cutlass::arch::ClusterTransactionBarrier::expect_transaction(full_mbarrier_ptr, bytes);
      cute::copy(l2->tma_load_aux.with(*full_mbarrier_ptr, uint16_t(0), cute::TMA::CacheHintSm90(l2->load_policy)),
                 this->bGS_gAux(cute::_, cute::_, cute::_, epi_m, epi_n),
                 this->bGS_sAux(cute::_, cute::_, cute::_, load_iteration % Stages));
    }
  };

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const& args) {
    auto inner = Base::get_producer_load_callbacks(args);
    return ProducerCallbacks<decltype(inner)>(cute::move(inner), params_l2);
  }
};

}  // namespace coda::epilogues
