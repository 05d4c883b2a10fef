// The nodes of the gated MLP's epilogue programs (norm_glu_linear.hpp,
// glu_dgrad_rowdot.hpp).
//
// The gate/up weight's rows alternate gate and up, so a GEMM output row holds
// each (g, u) pair in adjacent columns, and one visit() of the epilogue holds
// both halves of every pair it touches: a thread's 16 values of a subtile are
// 8 pairs (2i, 2i+1) = (c, c+1), c even, in one row (checked for all five
// tile configurations by benchmarks/design/llama/frag.cu). So act(g)·u is a
// pairwise op inside one visit, with no shuffles.
//
// Two layouts carry pairs:
// - forward: A = act(g)·u is half as wide as the tile; GluNarrowStore writes
//   it through its own (EPI_M, EPI_N/2) smem tile and TMA store.
// - backward: the down projection's dgrad has one accumulator element dA per
//   pair. H (M, 2F) bf16 is read as (M, F) 32-bit lanes, one (g, u) pair per
//   lane, and dH = (dg, du) is written the same way: stock 32-bit aux load and
//   D store, and bits that no node does arithmetic on.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

#include <cstdint>

#include "activation.hpp"
#include "store_l2.hpp"

namespace coda::epilogues {

namespace fusion = cutlass::epilogue::fusion;

// A pair of 16-bit values in one 32-bit lane (g or dg in the low half): bits
// only, never arithmetic.
template <class Element>
CUTLASS_DEVICE void unpack2(float packed, float& lo, float& hi) {
  uint32_t b = __float_as_uint(packed);
  lo = float(Element::bitcast(uint16_t(b & 0xffffu)));
  hi = float(Element::bitcast(uint16_t(b >> 16)));
}
template <class Element>
CUTLASS_DEVICE float pack2(float lo, float hi) {
  uint32_t b = uint32_t(Element(lo).raw()) | (uint32_t(Element(hi).raw()) << 16);
  return __uint_as_float(b);
}


// A = act(g)·u of the child's (g, u) pairs, written as an (M, N/2) tensor
// through an (EPI_M, EPI_N/2) smem tile and an L2-hinted TMA store; the
// child's value passes through (the program stores it as D). Each thread
// writes its 8 values of a subtile with 16-bit smem stores at (row, col/2):
// a quad's columns c = 2q + 8k land in narrow columns q + 4k.
template <int Stages, class EpilogueTile, class Element, class SmemLayoutAtom>
struct GluNarrowStore {
  static constexpr int kEpiM = cute::size<0>(EpilogueTile{});
  static constexpr int kEpiN = cute::size<1>(EpilogueTile{});
  static_assert(kEpiN % 32 == 0, "pairs of a 16-column narrow tile");
  using NarrowTile = cute::Shape<cute::Int<kEpiM>, cute::Int<kEpiN / 2>>;
  using SmemLayoutTma = decltype(cute::tile_to_shape(SmemLayoutAtom{}, NarrowTile{}));
  using SmemLayout = decltype(cute::tile_to_shape(
      SmemLayoutTma{}, cute::make_shape(cute::Int<kEpiM>{}, cute::Int<kEpiN / 2>{}, cute::Int<Stages>{})));
  using StrideMNL = cute::Stride<int64_t, cute::_1, int64_t>;

  struct SharedStorage {
    alignas(cutlass::detail::alignment_for_swizzle(SmemLayout{}))
        cute::array_aligned<Element, cute::cosize_v<SmemLayout>> smem;
  };
  struct Arguments {
    Element* ptr = nullptr;  // (M, N/2) or null
    int64_t ld = 0;
    ActivationKind activation = ActivationKind::kSiLU;
  };
  struct Params {
    using Tma = decltype(cute::make_tma_copy(
        TmaStoreL2{}, cute::make_tensor(static_cast<Element*>(nullptr), cute::repeat_like(StrideMNL{}, int32_t(0)), StrideMNL{}),
        SmemLayoutTma{}));
    Tma tma;
    bool is_nullptr = true;
    ActivationKind activation = ActivationKind::kSiLU;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void*) {
    auto [M, N, K, L] = cute::append<4>(problem_shape, 1);
    Params p;
    p.is_nullptr = args.ptr == nullptr;
    p.activation = args.activation;
    if (!p.is_nullptr) {
      auto t = cute::make_tensor(args.ptr, cute::make_layout(cute::make_shape(M, N / 2, L),
                                                             StrideMNL{args.ld, cute::_1{}, int64_t(0)}));
      p.tma = cute::make_tma_copy(TmaStoreL2{}, t, SmemLayoutTma{});
      p.tma.cache_hint_ = kL2EvictNormal;  // the down projection reads A next
    }
    return p;
  }
  template <class ProblemShape> static bool can_implement(ProblemShape const&, Arguments const&) { return true; }
  template <class ProblemShape> static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE GluNarrowStore() {}
  CUTLASS_HOST_DEVICE GluNarrowStore(Params const& params, SharedStorage const& shared)
      : params_ptr(&params), smem(const_cast<Element*>(shared.smem.data())) {}
  Params const* params_ptr = nullptr;
  Element* smem = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::ProducerLoadArgs<Args...> const&) {
    return fusion::EmptyProducerLoadCallbacks{};
  }

  template <int kHalf, class CTensor, class STensor, class SmemS2G, class GmemS2G>
  struct Callbacks : fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE Callbacks(CTensor c, STensor s, SmemS2G ss, GmemS2G gs, Params const* p)
        : coords(c), smem_epi(s), smem_s2g(ss), gmem_s2g(gs), params(p) {}
    cutlass::Array<Element, kHalf> regs;  // this thread's A values of the subtile
    CTensor coords;                       // (CPY, CPY_M, CPY_N): (row, col) inside the subtile
    STensor smem_epi;                     // (EPI_M, EPI_N/2, PIPE)
    SmemS2G smem_s2g;                     // (TMA, TMA_M, TMA_N, PIPE)
    GmemS2G gmem_s2g;                     // (TMA, TMA_M, TMA_N, EPI_M, EPI_N)
    Params const* params;

    template <class ElementAcc, class ElementIn, int F>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAcc, F> const&, int epi_v, int, int,
                              cutlass::Array<ElementIn, F> const& in) {
      if (!params->is_nullptr) {
        detail::dispatch(params->activation, [&](auto k) {
          CUTLASS_PRAGMA_UNROLL
          for (int p = 0; p < F / 2; ++p) {  // elements 2p, 2p+1 are columns c, c+1 (c even)
            regs[epi_v * (F / 2) + p] =
                Element(detail::act<decltype(k)::value>(float(in[2 * p])) * float(in[2 * p + 1]));
          }
          return 0;
        });
      }
      return in;
    }

    CUTLASS_DEVICE void postreduce(int, int, int store_iteration, bool issue_smem_store) {
      if (params->is_nullptr || !issue_smem_store) return;
      auto s = smem_epi(cute::_, cute::_, store_iteration % Stages);
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < kHalf; ++p) {  // the quad's columns are q + 4k: one 16-bit st.shared each
        auto c = coords(2 * p);
        s(cute::get<0>(c), cute::get<1>(c) / 2) = regs[p];
      }
    }

    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int store_iteration, bool issue_tma_store) {
      if (params->is_nullptr || !issue_tma_store) return;
      cute::copy(params->tma, smem_s2g(cute::_, cute::_, cute::_, store_iteration % Stages),
                 gmem_s2g(cute::_, cute::_, cute::_, epi_m, epi_n));
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    auto cta_narrow = make_shape(size<0>(args.tile_shape_mnk), size<1>(args.tile_shape_mnk) / _2{});
    Tensor gA = local_tile(params_ptr->tma.get_tma_tensor(make_shape(M, N / 2, L)), cta_narrow, make_coord(m, n, l));
    Tensor gA_epi = flat_divide(gA, NarrowTile{});                                       // (EPI_M, EPI_N/2, EPI_M, EPI_N)
    Tensor sA_epi = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem), SmemLayout{}));
    // Coordinates inside one subtile, partitioned exactly like the accumulator fragment.
    Tensor c_sub = fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(make_shape(Int<kEpiM>{}, Int<kEpiN>{})), args.epi_tile, args.tiled_copy,
        args.thread_idx)(_, _, _, _0{}, _0{});                                           // (CPY, CPY_M, CPY_N)
    constexpr int kHalf = decltype(size(c_sub))::value / 2;
    auto s2g = params_ptr->tma.get_slice(_0{});
    Tensor smem_s2g = s2g.partition_S(sA_epi);
    Tensor gmem_s2g = s2g.partition_D(gA_epi);
    return Callbacks<kHalf, decltype(c_sub), decltype(sA_epi), decltype(smem_s2g), decltype(gmem_s2g)>(
        c_sub, sA_epi, smem_s2g, gmem_s2g, params_ptr);
  }
};


// act(g) and act'(g) from one evaluation of the nonlinearity: two separate
// nodes would each run their own tanh / exp (asm volatile, never merged).
template <ActivationKind K>
CUTLASS_DEVICE void act_and_grad(float g, float& a, float& ag) {
  if constexpr (K == ActivationKind::kSiLU) {
    float s = 1.f / (1.f + __expf(-g));
    a = g * s;
    ag = fmaf(a, 1.f - s, s);  // s·(1 + g·(1 − s))
  } else if constexpr (K == ActivationKind::kGeluTanh) {
    namespace d = coda::epilogues::detail;
    float g2 = g * g;
    float t = cutlass::fast_tanh(d::gelu_tanh_arg(g, g2));
    float half_g = 0.5f * g;
    a = fmaf(half_g, t, half_g);
    float dz = fmaf(1.5f * d::kSqrt2OverPi * d::kGeluTanhCubic, g2, 0.5f * d::kSqrt2OverPi);
    ag = fmaf(g * fmaf(-t, t, 1.f), dz, fmaf(0.5f, t, 0.5f));
  } else {
    a = detail::act<K>(g);
    ag = detail::act_grad<K>(g);
  }
}

// A node with no state whose visit() is Fn{}(frg_acc, inputs...): what
// Sm90Compute is, minus its rule that every fragment has the accumulator's
// size (the GLU backward carries 2F values between two of its nodes).
template <class Fn>
struct StatelessNode {
  struct SharedStorage {};
  using Arguments = typename Fn::Arguments;
  using Params = Arguments;
  template <class PS> static Params to_underlying_arguments(PS const&, Arguments const& a, void*) { return a; }
  template <class PS> static bool can_implement(PS const&, Arguments const&) { return true; }
  template <class PS> static size_t get_workspace_size(PS const&, Arguments const&) { return 0; }
  template <class PS>
  static cutlass::Status initialize_workspace(PS const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  CUTLASS_HOST_DEVICE StatelessNode() {}
  CUTLASS_HOST_DEVICE StatelessNode(Params const& p, SharedStorage const&) : params(p) {}
  Params params;
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::ProducerLoadArgs<Args...> const&) {
    return fusion::EmptyProducerLoadCallbacks{};
  }
  struct Callbacks : fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE explicit Callbacks(Params const& p) : params(p) {}
    Params const& params;
    template <class ElementAcc, int F, class... In>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAcc, F> const& acc, int, int, int, In const&... in) {
      return Fn{}(params, acc, in...);
    }
  };
  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const&) {
    return Callbacks(params);
  }
};

// (acc = dA, (g, u) packed) -> 2F values: [0, F) the packed (dg, du) of D,
// [F, 2F) dg·g + du·u in fp32 from the unrounded dg, du.
template <class Element>
struct GluBackwardFn {
  using Arguments = ActivationArguments;
  template <int F>
  CUTLASS_DEVICE cutlass::Array<float, 2 * F> operator()(Arguments const& args, cutlass::Array<float, F> const& dA,
                                                         cutlass::Array<float, F> const& gu) const {
    return detail::dispatch(args.kind, [&](auto k) {
      cutlass::Array<float, 2 * F> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; ++i) {
        float g, u, a, ag;
        unpack2<Element>(gu[i], g, u);
        act_and_grad<decltype(k)::value>(g, a, ag);
        float du = dA[i] * a;
        float dg = dA[i] * u * ag;
        out[i] = pack2<Element>(dg, du);
        out[F + i] = fmaf(dg, g, du * u);
      }
      return out;
    });
  }
};
template <class Element>
struct GluBackwardNode : StatelessNode<GluBackwardFn<Element>> {
  using StatelessNode<GluBackwardFn<Element>>::StatelessNode;
  struct Callbacks : fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE explicit Callbacks(ActivationArguments const& p) : params(p) {}
    ActivationArguments const& params;
    template <class ElementAcc, int F>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAcc, F> const&, int, int, int,
                              cutlass::Array<float, F> const& dA, cutlass::Array<float, F> const& gu) {
      return GluBackwardFn<Element>{}.template operator()<F>(params, dA, gu);
    }
  };
  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const&) {
    return Callbacks(this->params);
  }
};

// A reduction node fed 2F values: reduces the upper F (the row dots), passes
// the lower F (packed dH) on. Sm90TreeVisitor hands a child's value to its
// parent unconverted, so a tree may carry 2F; Sm90TopologicalVisitor cannot
// (it keeps every node's value as Array<ElementCompute, F>).
template <class Inner>
struct UpperHalfCallbacks : Inner {
  CUTLASS_DEVICE explicit UpperHalfCallbacks(Inner&& inner) : Inner(static_cast<Inner&&>(inner)) {}
  template <class ElementAcc, int F, class ElementIn, int F2>
  CUTLASS_DEVICE auto visit(cutlass::Array<ElementAcc, F> const& acc, int epi_v, int epi_m, int epi_n,
                            cutlass::Array<ElementIn, F2> const& in) {
    static_assert(F2 == 2 * F);
    cutlass::Array<ElementIn, F> lo, hi;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < F; ++i) {
      lo[i] = in[i];
      hi[i] = in[F + i];
    }
    Inner::visit(acc, epi_v, epi_m, epi_n, hi);
    return lo;
  }
};
template <class Base>
struct ReduceUpperHalf : Base {
  using Base::Base;
  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    using Inner = decltype(Base::template get_consumer_store_callbacks<ReferenceSrc>(args));
    return UpperHalfCallbacks<Inner>(Base::template get_consumer_store_callbacks<ReferenceSrc>(args));
  }
};

}  // namespace coda::epilogues
