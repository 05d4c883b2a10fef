import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from coda import _kernels  # noqa: E402


def gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU here; GPU tests run on an H200 through tools/gpu_check.sh"
    if not _kernels.available():
        return f"coda._C did not load: {_kernels.LOAD_ERROR}"
    if not _kernels.device_ok(torch.device("cuda")):
        return f"{torch.cuda.get_device_name()} is not sm_90; coda's kernels are built for sm_90a only"
    return None


def pytest_sessionstart(session):
    # CODA_TEST_TUNING="config,raster,swizzle[,store_l2[,alternate_k]]" runs every GPU test
    # on the kernels a tuning override picks (a sweep build's candidates among
    # them), so a candidate meets the same checks before it ships.
    tuning = os.environ.get("CODA_TEST_TUNING")
    if tuning and _kernels.available():
        torch.ops.coda.set_tuning(*(int(v) for v in tuning.split(",")))


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("CODA_ERRORS_JSON")
    if not path:
        return
    import json

    from helpers import MEASURED

    rows = [{"check": n, "coda_rel_err": e, "torch_rel_err": t} for n, e, t in MEASURED]
    worst = max((e / t for _, e, t in MEASURED if t > 0), default=None)
    with open(path, "w") as fh:
        json.dump({"worst_ratio_to_torch": worst, "checks": rows}, fh, indent=1)


@pytest.fixture
def seed():
    """A fresh seed each run (inputs are never the same twice); reported on failure."""
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    return s
