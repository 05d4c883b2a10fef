"""examples/train_distributed.py on one GPU: a 1-rank NCCL process group (torchrun
--standalone --nproc_per_node 1), DDP then FSDP2, on the bf16 kernel path; it must
finish, every step's loss finite and the last below the first. The tokens/s it logs
are in the test's output (pytest -s) and in the JSON log it writes."""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_distributed.py")
STEPS = 30


def test_example_one_rank_nccl(tmp_path):
    pytest.importorskip("transformers")
    log = tmp_path / "log.json"
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", EXAMPLE,
           "--device", "cuda", "--mode", "both", "--steps", str(STEPS), "--log-json", str(log),
           "--save", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=540)
    print(proc.stdout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-8000:]}"
    with open(log) as f:
        results = {r["mode"]: r for r in json.load(f)}
    assert set(results) == {"ddp", "fsdp2"}
    for mode, r in results.items():
        losses = r["losses"]
        assert r["world_size"] == 1 and r["device"].startswith("cuda") and len(losses) == STEPS
        assert all(math.isfinite(v) for v in losses), f"{mode}: {losses}"
        assert losses[-1] < losses[0], f"{mode}: the loss did not fall: {losses}"
        assert r["mean_tokens_per_s"] > 0
        assert os.path.isdir(tmp_path / "ckpt" / mode)
