"""GPU tests of the per-kernel benchmark (coda.bench.fused_gemm): the launch log gives a GEMM's
shape and operands exactly; a patched LLaMA and GPT-2 layer's step yields the programs of
their training steps, each found by replaying its call; a call's fused GEMMs and their
cuBLAS GEMMs are timed by kernel duration. Skipped without an sm_90 GPU."""

import pytest
import torch

from coda import _kernels, ops
from coda.bench import fused_gemm
from coda.bench.timing import Runner

pytestmark = pytest.mark.gpu


def test_launch_log_gives_shape_layouts_and_operands():
    x = torch.randn(64, 128, device="cuda").to(torch.bfloat16)
    w = (torch.randn(256, 128, device="cuda") / 12).to(torch.bfloat16)
    with _kernels.recording_launches() as launches:
        y = ops.linear(x, w, activation="gelu_tanh")
    torch.cuda.synchronize()
    assert len(launches) == 1, launches
    l = launches[0]
    assert (l["program"], l["dtype"], l["m"], l["n"], l["k"]) == ("linear_act", "bf16", 64, 256, 128)
    assert (l["a"], l["lda"], l["a_layout"]) == (x.data_ptr(), 128, "row")
    assert (l["b"], l["ldb"], l["b_layout"]) == (w.data_ptr(), 128, "col")
    a, same_a = fused_gemm.operand([x, w], l["a"], l["m"], l["k"], l["lda"], l["a_layout"], torch.bfloat16)
    b, same_b = fused_gemm.operand([x, w], l["b"], l["k"], l["n"], l["ldb"], l["b_layout"], torch.bfloat16)
    assert same_a and same_b and torch.equal(a, x) and torch.equal(b, w.t())
    ref = torch.nn.functional.gelu((a.float() @ b.float()), approximate="tanh")
    assert (y.float() - ref).norm() / ref.norm() < 1e-2
    # off again: nothing recorded outside the block
    with _kernels.recording_launches() as after:
        pass
    ops.linear(x, w)
    assert after == []


@pytest.mark.parametrize("model, programs", [
    ("llama_tiny", {"norm_rope_linear", "norm_glu_linear", "linear_residual_stats", "glu_dgrad_rowdot", "norm_dgrad"}),
    ("gpt2_tiny", {"norm_linear_act", "linear_residual_stats", "dact_rowdot", "norm_dgrad"}),
])
def test_a_patched_layer_step_yields_its_programs(model, programs):
    calls = fused_gemm.record_step(model, 512)
    found = fused_gemm.gemms_of(model, calls)
    seen = {g.launch["program"] for _, gemms in found for g in gemms}
    assert programs <= seen, f"{sorted(seen)} lacks {sorted(programs - seen)}"
    assert all(g.launch["m"] * g.launch["n"] * g.launch["k"] > 0 for _, gs in found for g in gs)
    assert any(g.same_operands for _, gs in found for g in gs)
    # the cuBLAS GEMM of a case computes A·B of the bytes the kernel read
    call, gemms = found[0]
    g = gemms[0]
    assert g.a.shape == (g.launch["m"], g.launch["k"]) and g.b.shape == (g.launch["k"], g.launch["n"])


def test_a_call_is_timed_against_cublas_by_kernel_duration():
    calls = fused_gemm.record_step("llama_tiny", 512)
    call, gemms = fused_gemm.gemms_of("llama_tiny", calls)[0]
    r = Runner(True, warmup_ms=5, rep_ms=5, rounds=2)
    kt = fused_gemm.KernelTimer(rep_ms=5)
    rows = fused_gemm.time_call(r, kt, call, gemms, _kernels.programs())
    coda_rows = [row for row in rows if row["impl"] == "coda"]
    cublas_rows = [row for row in rows if row["impl"] == "cublas"]
    assert len(coda_rows) == len(gemms) == len(cublas_rows)
    for row in coda_rows:
        assert row["case"].startswith("fused_gemm_llama_tiny_") and row["median_ms"] > 0 and row["ratio_to_cublas"] > 0
        assert len(row["round_ms"]) == 2 and row["config"]
    assert all(row["kernels"] and row["median_ms"] > 0 for row in cublas_rows)
    assert fused_gemm.layer_sum("llama_tiny", rows)[0]["gemms"] == len(gemms)
