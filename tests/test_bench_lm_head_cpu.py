"""The LM-head benchmark's points and its kernel breakdown by kind (coda.bench.lm_head)."""
from coda.bench import lm_head


def test_points_carry_their_models_vocabularies():
    assert lm_head.points(None, None, gpu=True) == [(8192, 2048), (16384, 4096), (8192, 1024), (8192, 1536)]
    assert [lm_head.vocab_of(t, d, True) for t, d in lm_head.POINTS] == [128256, 128256, 50257, 151936]
    assert lm_head.vocab_of(4096, 2048, True) == lm_head.VOCAB and lm_head.vocab_of(8192, 1024, False) == 1000


def test_phases_sum_kernels_by_kind():
    timeline = [["nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN", 900.0, 1.0],
                ["void coda::kernels::(anonymous namespace)::cross_entropy_kernel<__nv_bfloat16>(...)", 300.0, 0.5],
                ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", 100.0, 0.0],
                ["void coda::kernels::(anonymous namespace)::scale_round_kernel<__nv_bfloat16>(...)", 40.0, 0.0],
                ["void at::native::vectorized_elementwise_kernel<4, ...>", 5.0, 0.0]]
    assert lm_head.phases(timeline) == {"cross_entropy": 300.0, "scale": 40.0, "gemm": 1000.0, "other": 5.0}
