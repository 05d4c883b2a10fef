"""The per-kernel benchmark's machinery (coda.bench.fused_gemm) where no GPU is: the recorder
keeps a step's coda calls, the backward's included; an operand is found as a view of the
call's tensor that holds it, in either layout, or made up where none does; cases are
named and summed per layer; the section says why it times nothing on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from helpers import cpu_stand_in

from coda import _kernels
from coda.bench import cli, fused_gemm


def test_operand_is_a_view_of_the_bytes_the_kernel_read():
    base = torch.randn(10, 24).to(torch.bfloat16)
    es = base.element_size()
    # rows 2.. of base, 16 of its 24 columns from column 4: row-major, ld 24
    addr = base.data_ptr() + (2 * 24 + 4) * es
    view, same = fused_gemm.operand([torch.randn(3), base], addr, 8, 16, 24, "row", torch.bfloat16)
    assert same and view.data_ptr() == addr
    assert torch.equal(view, base[2:10, 4:20])
    # column-major: a (16 x 8) operand that is the transpose of base[2:10, 4:20]
    view, same = fused_gemm.operand([base], addr, 16, 8, 24, "col", torch.bfloat16)
    assert same and torch.equal(view, base[2:10, 4:20].t())


def test_operand_not_held_by_the_call_is_made_up_in_its_layout():
    base = torch.randn(4, 8).to(torch.bfloat16)
    past_the_end = base.data_ptr() + base.numel() * base.element_size()
    view, same = fused_gemm.operand([base], past_the_end, 4, 8, 8, "row", torch.bfloat16)
    assert not same and view.shape == (4, 8) and view.stride() == (8, 1)
    # a tensor of another dtype at that address is not it
    view, same = fused_gemm.operand([base], base.data_ptr(), 4, 8, 8, "row", torch.float16)
    assert not same and view.dtype == torch.float16
    view, same = fused_gemm.operand([base], base.data_ptr(), 8, 4, 8, "col", torch.bfloat16)
    assert same and view.stride() == (1, 8) and torch.equal(view, base.t())


def _stand_ins():
    def linear(x, weight, bias, residual, activation, save):
        return F.linear(x, weight, bias), x.new_empty(0)

    def linear_backward(dy, x, weight, pre_act, activation, needs):
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        return ((dy2 @ weight).view(x.shape) if needs[0] else x.new_empty(0),
                dy2.t() @ x2 if needs[1] else x.new_empty(0), dy2.sum(0) if needs[2] else x.new_empty(0))
    return {"linear": linear, "linear_backward": linear_backward}


@pytest.fixture
def cpu_ops(monkeypatch):
    yield from cpu_stand_in(monkeypatch, _stand_ins())


def test_recorder_keeps_the_forward_and_backward_calls(cpu_ops):
    from coda.ops import linear
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    rec = fused_gemm.recorder()
    with rec:
        linear(x, w).sum().backward()
    names = [c.op.name() for c in rec.calls]
    assert names == ["coda::linear", "coda::linear_backward"], names
    # a call replays as it ran, and lists its tensors
    y, _ = rec.calls[0]()
    assert torch.allclose(y, x @ w.t())
    assert any(t is w for t in rec.calls[0].tensors())


def _launch(program, m, n, k, config="pingpong_128x128_1x2"):
    return dict(program=program, config=config, dtype="bf16", m=m, n=n, k=k, a=0, lda=k, a_layout="row", b=0,
                ldb=k, b_layout="col", raster=1, swizzle=8)


class _Op:
    def __init__(self, name):
        self._name = name

    def name(self):
        return self._name


def test_cases_are_named_by_model_program_pass_and_shape():
    g = fused_gemm.Gemm("llama1b", fused_gemm.Call(_Op("coda::norm_linear"), (), {}), 0,
                        _launch("norm_rope_linear", 8192, 3072, 2048))
    assert g.case({"norm_rope_linear": "forward"}) == "fused_gemm_llama1b_norm_rope_linear_forward_8192x3072x2048"
    assert g.flops == 2.0 * 8192 * 3072 * 2048


def test_layer_sum_weights_each_gemm_by_its_calls():
    rows = [
        {"case": "fused_gemm_m_a_forward_1x1x1", "impl": "coda", "median_ms": 1.0, "calls_per_layer": 2},
        {"case": "fused_gemm_m_a_forward_1x1x1", "impl": "cublas", "median_ms": 0.5, "calls_per_layer": 2},
        {"case": "fused_gemm_m_b_dgrad_1x1x1", "impl": "coda", "median_ms": 3.0, "calls_per_layer": 1},
        {"case": "fused_gemm_m_b_dgrad_1x1x1", "impl": "cublas", "median_ms": 2.0, "calls_per_layer": 1},
        {"case": "fused_gemm_other_a_forward_1x1x1", "impl": "coda", "median_ms": 9.0, "calls_per_layer": 1},
    ]
    coda, cublas = fused_gemm.layer_sum("m", rows)
    assert (coda["impl"], coda["median_ms"], coda["gemms"]) == ("coda", 5.0, 2)
    assert cublas["median_ms"] == 3.0 and coda["ratio_to_cublas"] == pytest.approx(5.0 / 3.0)


def test_points_are_each_models_own_tokens_or_the_given_ones():
    assert fused_gemm.points(None, True) == [(8192, "llama1b"), (16384, "llama8b"), (8192, "gpt2medium")]
    assert fused_gemm.points([4096], True) == [(4096, "llama1b"), (4096, "llama8b"), (4096, "gpt2medium")]
    assert fused_gemm.spec_of("llama8b").config["intermediate_size"] == 14336


def test_kernel_names_pick_coda_gemms_only():
    coda_name = ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>, "
                 "coda::kernels::AlternatingKMainloop<...>, coda::epilogues::NormRope<...>>>(...)")
    assert fused_gemm.coda_gemm_kernel(coda_name)
    assert not fused_gemm.coda_gemm_kernel("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT")
    assert not fused_gemm.coda_gemm_kernel("void coda::kernels::merge_partials<__nv_bfloat16>(...)")


def test_section_says_why_it_times_nothing_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert cli.main(["--kernels", "--only", "fused_gemm"]) == 0
    out = capsys.readouterr().out
    assert "fused_gemm_llama1b" in out and "sm_90 GPU only" in out  # each reason is printed once


def test_launch_log_is_empty_without_launches():
    if not _kernels.available():
        pytest.skip(f"the extension coda._C is not built ({_kernels.LOAD_ERROR})")
    with _kernels.recording_launches() as launches:
        pass
    assert launches == []


def _timer_with(events):
    from types import SimpleNamespace
    kt = object.__new__(fused_gemm.KernelTimer)
    kt.flush_names = {"flush"}
    kt._events = lambda fn, reps: [SimpleNamespace(name=n, time_range=SimpleNamespace(elapsed_us=lambda us=us: us))
                                   for n, us in events]
    return kt


GEMM = "void cutlass::device_kernel<coda::kernels::X>"


def test_kernel_timer_splits_reps_at_the_flush_and_picks_the_gemms():
    kt = _timer_with([("flush", 50), ("merge", 3), (GEMM, 1000), ("flush", 50), (GEMM, 1100), ("merge", 2)])
    assert kt.durations(None, 2, fused_gemm.coda_gemm_kernel, 1) == [[1.0], [1.1]]
    assert kt.total(None, 2) == [pytest.approx(1.003), pytest.approx(1.102)]
    with pytest.raises(RuntimeError, match="expected 2 picked kernel"):
        kt.durations(None, 2, fused_gemm.coda_gemm_kernel, 2)
    with pytest.raises(RuntimeError, match="found 2 flushes in 3 reps"):
        kt.total(None, 3)
