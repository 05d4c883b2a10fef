"""The shipped kernels' mainloop stages and shared memory, from their types (coda._kernels.kernel_facts,
the registry's; and tools/kernel_facts.cu for every program x configuration, built or not): no GPU
needed. Every byte an epilogue holds is carved out of the mainloop's stages, so a change to an
epilogue program that costs a stage fails here, before any GPU run: time the change (python -m
coda.bench --kernels --only fused_gemm) and update STAGES with what it measured. CI builds the tool
(cmake --target coda_kernel_facts) and sets CODA_KERNEL_FACTS."""

import os
import subprocess

import pytest

SMEM_PER_BLOCK = 232448  # sm_90's opt-in shared memory per block, bytes

# (program, configuration) of every bf16 kernel built -> mainloop stages. Ping-pong 128x128 takes 32 KB a
# stage and gets 6; the cooperative 128x256 tile 48 KB, 4 where its epilogue holds at most 35,840 bytes.
STAGES = {
    ("linear_act", "cooperative_128x256_2x1"): 3,  # residual in, H and D out: 50 KB of epilogue
    ("linear_act", "pingpong_128x128_1x2"): 6,
    ("linear_act", "cooperative_128x128_1x2"): 5,
    ("dact_dbias", "cooperative_128x256_2x1"): 4,
    ("wgrad_store", "cooperative_128x256_2x1"): 4,
    ("norm_linear_act", "cooperative_128x256_2x1"): 4,
    ("norm_linear_act", "pingpong_128x128_1x2"): 6,
    ("linear_residual_stats", "cooperative_128x256_2x1"): 4,
    ("linear_residual_stats", "pingpong_128x128_1x2"): 6,
    ("dact_rowdot", "cooperative_128x256_2x1"): 4,
    ("norm_dgrad", "cooperative_128x256_2x1"): 3,  # two loads and two stores beside D: 67 KB
    ("norm_glu_linear", "cooperative_128x256_2x1"): 4,
    ("norm_glu_linear", "pingpong_128x128_1x2"): 6,
    ("glu_dgrad_rowdot", "pingpong_128x128_1x2"): 6,  # cooperative 128x256 would have 3 (table.def)
    ("norm_rope_linear", "cooperative_128x256_2x1"): 4,
    ("norm_rope_linear", "pingpong_128x128_1x2"): 6,
    ("linear_ce_grad", "pingpong_128x128_1x2"): 6,  # four row vectors and two column vectors: 9.5 KB
}


@pytest.fixture(scope="module")
def built():
    from coda import _kernels
    if not _kernels.available():
        pytest.skip(f"coda._C is not built ({_kernels.LOAD_ERROR})")
    return _kernels.kernel_facts()


def test_shipped_kernels_keep_their_stages(built):
    bf16 = {tuple(key.split("/")[:2]): f for key, f in built.items() if key.endswith("/bf16")}
    assert set(bf16) == set(STAGES), f"built: {sorted(bf16)}"
    got = {key: f["stages"] for key, f in bf16.items()}
    assert got == STAGES, {k: (STAGES.get(k), v) for k, v in got.items() if STAGES.get(k) != v}
    for key, f in built.items():  # the fp16 kernels' types take the same bytes as bf16's
        assert f == built[key.replace("/fp16", "/bf16")], key
        assert f["smem_bytes"] <= SMEM_PER_BLOCK and f["stages_c"] <= 2, (key, f)


@pytest.fixture(scope="module")
def facts():
    exe = os.environ.get("CODA_KERNEL_FACTS")
    if not exe:
        pytest.skip("CODA_KERNEL_FACTS is not set (cmake --build <dir> --target coda_kernel_facts; .ci/run does)")
    out = subprocess.run([exe], capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    rows = {}
    for line in out[1:]:
        cols = line.split()
        program, dtype, config, stages, epi, tile, c, d, smem = cols[:9]
        rows[(program, config)] = dict(dtype=dtype, stages=int(stages), epilogue_bytes=int(epi), epilogue_tile=tile,
                                       stages_c=int(c), stages_d=int(d), smem=int(smem), built=cols[9:] == ["built"])
    return rows


def test_every_program_and_configuration_is_listed(facts):
    from coda import _kernels
    if not _kernels.available():
        pytest.skip(f"coda._C is not built ({_kernels.LOAD_ERROR})")
    configs = {name for c in _kernels.kernels_built().values() for name in c.values()}
    assert {p for p, _ in facts} == set(_kernels.programs())
    assert {c for _, c in facts} >= configs


def test_the_tool_reports_what_the_registry_does(facts, built):
    listed = {key for key, row in facts.items() if row["built"]}
    assert listed == {tuple(key.split("/")[:2]) for key in built if key.endswith("/bf16")}
    for (program, config) in listed:
        row, f = facts[(program, config)], built[f"{program}/{config}/bf16"]
        assert (row["stages"], row["epilogue_bytes"], row["smem"], row["stages_c"], row["stages_d"]) == \
            (f["stages"], f["epilogue_bytes"], f["smem_bytes"], f["stages_c"], f["stages_d"]), (program, config)
        assert row["epilogue_tile"] == f"{f['epilogue_tile_m']}x{f['epilogue_tile_n']}"


def test_kernels_fit_and_epilogues_pipeline_at_most_two_deep(facts):
    for key, row in facts.items():
        assert row["smem"] <= SMEM_PER_BLOCK, (key, row)
        assert row["stages_c"] <= 2 and row["stages"] >= 2, (key, row)
