"""The kernel choice by shape (csrc/choice.cpp), asked without launching anything: it is
host code, so these run wherever the extension is built (CI included). The decisions
checked are the measured ones in benchmarks/NOTES.md ("Small problems")."""

import re

import pytest

import coda
from coda import _kernels

pytestmark = pytest.mark.skipif(not coda.kernels_available(), reason="the extension is not built here")

SHAPES = [(m, n) for m in (1, 64, 200, 512, 777, 2048, 8192, 16384, 65535 * 64 + 200)
          for n in (128, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)]


def tile_and_cluster(config: str):
    """"pingpong_128x128_1x2" -> (128, 128, 1, 2): output tile and cluster in CTAs."""
    tm, tn, cm, cn = map(int, re.fullmatch(r"[a-z]+_(\d+)x(\d+)_(\d)x(\d)", config).groups())
    return tm, tn, cm, cn


def scheduled_tiles(m: int, n: int, config: str, swizzle: int) -> int:
    """CUTLASS's sm90 persistent scheduler (tile_scheduler_params.h): the swizzle capped by
    the smaller CTA count, both counts rounded up to swizzle x cluster; padded tiles run."""
    tm, tn, cm, cn = tile_and_cluster(config)
    bm, bn = -(-m // tm), -(-n // tn)
    small = min(bm, bn)
    eff = 8 if swizzle >= 8 and small >= 6 else 4 if swizzle >= 4 and small >= 3 else 2 if swizzle >= 2 and small >= 2 else 1
    up = lambda v, to: -(-v // to) * to  # noqa: E731
    return up(bm, eff * cm) * up(bn, eff * cn)


@pytest.mark.parametrize("program", ["linear_act", "norm_linear_act", "linear_residual_stats", "dact_dbias",
                                     "norm_dgrad", "wgrad_store"])
def test_swizzle_pads_at_most_a_32nd(program):
    # swizzle 8 with a 1x2 cluster ran N = 1024 twice over (8 -> 16 tiles of 128)
    for m, n in SHAPES:
        c = _kernels.kernel_choice(program, m, n, 4096)
        assert c["config"] in _kernels.kernel_configs(program).values(), c
        padded, floor = scheduled_tiles(m, n, c["config"], c["swizzle"]), scheduled_tiles(m, n, c["config"], 1)
        assert padded * 32 <= floor * 33, (program, m, n, c)


def test_swizzle_stays_widest_where_nothing_pads():
    assert _kernels.kernel_choice("linear_act", 16384, 16384, 4096)["swizzle"] == 8
    # 8 tiles of 128 along N with a 1x2 cluster: 4 pads nothing, 8 doubled the tiles
    assert _kernels.kernel_choice("linear_residual_stats", 8192, 1024, 1024)["swizzle"] == 4


def test_forward_configs_by_shape():
    choice = _kernels.kernel_choice
    # ping-pong for the forwards at d 2048 (fc1, QKV, o-proj, fc2)
    for n, k in ((8192, 2048), (6144, 2048), (2048, 2048), (2048, 8192)):
        assert choice("linear_act", 8192, n, k)["config"] == "pingpong_128x128_1x2", (n, k)
        assert choice("norm_linear_act", 8192, n, k)["config"] == "pingpong_128x128_1x2", (n, k)
    # cooperative 128x128 for the plain forward with K <= 1024 (bf16, the dtype it is built in)
    assert choice("linear_act", 8192, 4096, 1024)["config"] == "cooperative_128x128_1x2"
    assert choice("linear_act", 8192, 4096, 1024, dtype="fp16")["config"] == "pingpong_128x128_1x2"
    assert choice("linear_act", 8192, 1024, 4096)["config"] == "pingpong_128x128_1x2"  # fc2 at d 1024
    assert choice("linear_act", 512, 2048, 2048)["config"] == "cooperative_128x128_1x2"  # 4 row tiles
    # fc2's shape (N < K) at 16,384 x 4096 runs cooperative
    assert choice("linear_act", 16384, 4096, 16384)["config"] == "cooperative_128x256_2x1"
    assert choice("dact_dbias", 8192, 1024, 4096)["config"] == "cooperative_128x256_2x1"


def test_plain_gemms_to_cublas():
    choice = _kernels.kernel_choice
    assert choice("dact_dbias", 8192, 1024, 1024)["vendor"]  # a plain dgrad, at every shape measured
    assert choice("dact_dbias", 16384, 4096, 16384)["vendor"]
    assert choice("wgrad_store", 1024, 1024, 8192)["vendor"]  # 32 tiles on 132 SMs
    assert not choice("wgrad_store", 16384, 4096, 16384)["vendor"]  # 2048 tiles
    assert not choice("linear_act", 128, 128, 128)["vendor"]  # an epilogue is coda's
    with _kernels.override_kernel(config=0):  # an override times coda's own kernel
        assert not choice("dact_dbias", 8192, 1024, 1024)["vendor"]


def test_kernel_choice_names_a_bad_program():
    with pytest.raises(RuntimeError, match="unknown program 'nope'"):
        _kernels.kernel_choice("nope", 1, 1, 1)
