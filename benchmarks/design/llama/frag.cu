// Probe: which (row, col) of the CTA tile each visit() fragment covers.
#include "gemm.cuh"
#include "linear_act.hpp"
#include <cstdio>
using namespace cute;
using namespace coda::kernels;

template <Config C>
void probe(const char* name, int threads_to_show) {
  using G = Gemm<coda::DType::kBFloat16, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, C, coda::epilogues::LinearAct>;
  using TiledMma = typename G::Mainloop::TiledMma;
  using Tile = typename G::TileShape;
  using EpiTile = typename G::EpiTile;
  using Element = typename G::Element;
  constexpr int F = G::EpilogueDescriptor::DispatchPolicy::FragmentSize;
  using CopyOpR2S = decltype(cutlass::epilogue::collective::detail::sm90_get_smem_store_op_for_accumulator<typename G::StrideD_, Element, EpiTile>());
  TiledMma tiled_mma;
  auto tiled_copy_C_atom = make_tiled_copy_C_atom(Copy_Atom<SM90_U32x4_STSM_N, cutlass::half_t>{}, tiled_mma);
  auto tiled_r2s = make_tiled_copy_S(Copy_Atom<CopyOpR2S, Element>{}, tiled_copy_C_atom);
  printf("== %s: Tile ", name); print(Tile{}); printf(" EpiTile "); print(EpiTile{}); printf(" FragmentSize %d threads %d\n", F, int(size(tiled_mma)));
  printf("   TiledMma: "); print(typename TiledMma::AtomShape_MNK{}); printf(" thr "); print(size(tiled_mma)); printf("\n   CopyOpR2S is STSM_N x4: %d\n", int(std::is_same_v<CopyOpR2S, SM90_U32x4_STSM_N>));
  auto cD_mn = local_tile(make_identity_tensor(make_shape(1 << 20, 1 << 20)), take<0, 2>(Tile{}), make_coord(0, 0));
  auto sD_shape = make_shape(size<0>(EpiTile{}), size<1>(EpiTile{}), _1{});
  bool pairs_ok = true, acc_ok = true;
  for (int t = 0; t < int(size(tiled_mma)); ++t) {
    auto thr = tiled_r2s.get_slice(t);
    auto tRS_cD = thr.partition_S(flat_divide(cD_mn, EpiTile{}));  // (R2S,R2S_M,R2S_N,EPI_M,EPI_N)
    auto tRS_rD_layout = make_layout(take<0, 3>(shape(thr.partition_S(make_identity_tensor(sD_shape)))));
    // accumulator coordinates, as the visit's frg_acc sees them
    auto tCcAcc = tiled_mma.get_slice(t).partition_C(cD_mn);     // (MMA,MMA_M,MMA_N)
    auto tRS_cAcc = thr.retile_S(tCcAcc);                          // ((R2S,R2S_V),MMA_M,MMA_N)
    int nfrg = size(tRS_rD_layout) / F;
    int EPI_M = size<3>(tRS_cD), EPI_N = size<4>(tRS_cD);
    int mma_tile_n = size<1>(Tile{}) / size<2>(tRS_cAcc);
    for (int en = 0; en < EPI_N; ++en)
      for (int em = 0; em < EPI_M; ++em) {
        auto sub = tRS_cD(_, _, _, em, en);
        int mma_n = en * size<1>(EpiTile{}) / mma_tile_n;
        int r2s_v = (en % (mma_tile_n / size<1>(EpiTile{}))) * nfrg;
        auto acc_mn = tRS_cAcc(_, em, mma_n);
        for (int v = 0; v < nfrg; ++v) {
          for (int i = 0; i < F; ++i) {
            auto c = sub(v * F + i);
            auto ca = acc_mn((r2s_v + v) * F + i);
            if (!(get<0>(c) == get<0>(ca) && get<1>(c) == get<1>(ca))) acc_ok = false;
            if (i % 2 == 1) {
              auto p = sub(v * F + i - 1);
              if (!(get<0>(p) == get<0>(c) && get<1>(p) % 2 == 0 && get<1>(c) == get<1>(p) + 1)) pairs_ok = false;
            }
          }
          if (t < threads_to_show && em < 1 && en < 2) {
            printf("  t%3d epi_m %d epi_n %d epi_v %d:", t, em, en, v);
            for (int i = 0; i < F; ++i) printf(" (%d,%d)", int(get<0>(sub(v * F + i))), int(get<1>(sub(v * F + i))));
            printf("\n");
          }
        }
      }
    if (t == 0) { printf("   tRS_cD layout: "); print(tRS_cD.layout()); printf("\n   visits per subtile %d, subtiles %dx%d\n", nfrg, EPI_M, EPI_N); }
  }
  printf("   pairs (2i,2i+1) = same row, cols (c,c+1), c even: %s\n", pairs_ok ? "YES for all threads/subtiles" : "NO");
  printf("   acc fragment coords == D coords: %s\n", acc_ok ? "YES" : "NO");
}

int main() {
  probe<Config::kCooperative128x256>("Cooperative128x256", 5);
  probe<Config::kCooperative128x128>("Cooperative128x128", 1);
  probe<Config::kCooperative256x128>("Cooperative256x128", 1);
  probe<Config::kPingpong128x128>("Pingpong128x128", 5);
  probe<Config::kPingpong64x128>("Pingpong64x128", 1);
}
