import os
import sys
import zlib

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from coda import _kernels  # noqa: E402


def gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU here (the GPU tests need an sm_90 GPU: H100 or H200)"
    if not _kernels.available():
        return f"coda._C did not load: {_kernels.LOAD_ERROR}"
    if not _kernels.device_ok(torch.device("cuda")):
        return f"{torch.cuda.get_device_name()} is not sm_90; coda's kernels are built for sm_90a only"
    return None


# With CODA_REQUIRE_GPU=1 (the GPU check sets it) a GPU test that cannot run
# fails: the check must not pass by skipping.
REQUIRE_GPU = os.environ.get("CODA_REQUIRE_GPU") == "1"


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None or REQUIRE_GPU:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_setup(item):
    if REQUIRE_GPU and "gpu" in item.keywords:
        reason = gpu_skip_reason()
        if reason is not None:
            pytest.fail(f"CODA_REQUIRE_GPU=1 but {reason}")


def pytest_sessionstart(session):
    # CODA_TEST_TUNING="config,raster,swizzle" runs every GPU test on the
    # kernels that override picks (a sweep's candidates among them).
    tuning = os.environ.get("CODA_TEST_TUNING")
    if tuning and _kernels.available():
        torch.ops.coda._set_kernel_override(*(int(v) for v in tuning.split(",")))


def pytest_sessionfinish(session, exitstatus):
    # The GPU check keeps every comparison's errors: CODA_ERRORS_DIR gets a
    # results file named and stamped like the benchmarks' (coda.bench.results).
    out = os.environ.get("CODA_ERRORS_DIR")
    if not out:
        return
    from coda.bench import results
    from helpers import MEASURED

    rows = [{"check": n, "coda_rel_err": e, "torch_rel_err": t} for n, e, t in MEASURED]
    worst = max((e / t for _, e, t in MEASURED if t > 0), default=None)
    path = results.write(out, "errors", {"worst_ratio_to_torch": worst, "seed": os.environ.get("CODA_SEED"),
                                         "checks": rows})
    print(f"\nerrors of {len(rows)} checks in {path}, worst ratio to torch {worst}")


def _seed_of(nodeid: str) -> int:
    base = os.environ.get("CODA_SEED", "")
    if base == "random":
        base = os.environ["CODA_SEED"] = str(int.from_bytes(os.urandom(4), "little"))
    return zlib.crc32(f"{nodeid}|{base}".encode())


@pytest.fixture(autouse=True)
def seed(request):
    """Every test starts from its own fixed seed, a hash of its id: a failure
    repeats, run alone or in the suite. CODA_SEED=N mixes N into every seed
    (other inputs, again repeatable); CODA_SEED=random draws one N per run
    (the errors file records it). Checks put the seed in their names."""
    s = _seed_of(request.node.nodeid)
    torch.manual_seed(s)
    return s
