"""coda under PyTorch's distributed engine on the CPU: 2 gloo processes (torchrun --standalone)
against 1 rank on the same global batch, with the model of examples/train_distributed.py (a
tiny LlamaForCausalLM built from a config, coda.hf.patch'ed; float32).

  * the example's own command line, 2 ranks, DDP then FSDP2: each loss curve equals the
    1-rank curve (trained in this process, a 1-rank gloo group) within LOSS_RTOL;
  * the gradients of one backward (this file run under torchrun as the worker): DDP's of
    every parameter equal the 1-rank ones within GRAD_TOL on each rank, coda's fused
    qkv_weight and interleaved gate_up_weight among them; under FSDP2 those gradients are
    DTensors sharded on dim 0 like the nn.Linear weights' (o_proj, down_proj, lm_head), each
    rank holding torch.chunk's rows of the 1-rank gradient; with tied embeddings too;
  * get_model_state_dict resolves every key of a patched model (Hugging Face's, from the
    fused weights) to an attribute, and a distributed checkpoint written with it under FSDP2
    (lm_head in its own FSDP group; after an optimizer step) loads into a
    single-process model, patched by coda or a plain LlamaForCausalLM, and back into a 2-rank
    FSDP2 model, bit for bit; the example's own checkpoint loads into a plain model with the
    1-rank run's final weights;
  * --dtype bf16 (the CUDA recipe: autocast under DDP, MixedPrecisionPolicy under FSDP2) on
    2 ranks follows the float32 curve within BF16_RTOL.

Tolerances (float32): the 2-rank run differs from the 1-rank run only in how a weight
gradient's sum over tokens is split (two half-batch sums averaged by the all-reduce or the
reduce-scatter, against one sum): a few float32 roundings per element. Measured: gradients
within 1.2e-7 of their largest element, loss curves of STEPS AdamW steps within 1.0e-7
relative, final weights within 1.2e-7 absolute (9e-7 of the largest). LOSS_RTOL = 1e-5,
GRAD_TOL (rtol 1e-5, atol 1e-6 of the gradient's largest element) and WEIGHT_TOL (rtol 1e-4,
atol 1e-5) leave 10-100x for other BLAS blockings and thread counts; a missing reduction, a
sum instead of a mean or a wrong shard shows as O(1). The checkpoint round trips are exact.
"""

import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_distributed.py")
STEPS = 6
ARGS = ["--device", "cpu", "--steps", str(STEPS)]
LOSS_RTOL = 1e-5
GRAD_TOL = dict(rtol=1e-5, atol_of_max=1e-6)
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)  # the final weights after STEPS AdamW steps (lr 3e-3)
WORKER_CASES = (("ddp", False), ("fsdp2", False), ("fsdp2", True))  # (mode, tied embeddings)
BF16_STEPS, BF16_RTOL = 3, 5e-3  # bf16 compute against the float32 curve (measured: 1.4e-4)


def example():
    """examples/train_distributed.py as a module (examples/ is no package)."""
    if "train_distributed" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_distributed", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_distributed"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_distributed"]


def full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def torchrun(nproc, script, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
           *map(str, args)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-8000:]}"
    return proc


# ---- the runs (module-scoped: each process start costs seconds on 2 cores)

@pytest.fixture(scope="module")
def one_rank():
    """Both modes on a 1-rank gloo group in this process: {mode: (losses, final weights)}."""
    pytest.importorskip("transformers")
    import torch.distributed as dist
    ex = example()
    args = ex.parse_args(ARGS + ["--mode", "both"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun sets each rank (OMP_NUM_THREADS=1): no spinning threads on a busy CPU
    try:
        out = {}
        for r in ex.run(args, torch.device("cpu"), log=lambda line: None, keep_models=True):
            weights = {k: full(v).detach().clone() for k, v in ex.unwrap(r.pop("model")).state_dict().items()}
            out[r["mode"]] = (r["losses"], weights)
        return out
    finally:
        gc.collect()  # the wrapped models, before their process group (see the example's main)
        dist.destroy_process_group()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The example's command line on 2 ranks, both modes, with --save and --log-json."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("example")
    proc = torchrun(2, EXAMPLE, *ARGS, "--mode", "both", "--save", tmp / "ckpt", "--log-json", tmp / "log.json")
    with open(tmp / "log.json") as f:
        return {r["mode"]: r for r in json.load(f)}, tmp / "ckpt", proc.stdout


@pytest.fixture(scope="module")
def worker_out(tmp_path_factory):
    """This file under torchrun on 2 ranks (the worker below): per case and rank, the gradients."""
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("worker")
    torchrun(2, os.path.abspath(__file__), tmp)
    return tmp


def reference_grads(tied):
    """The 1-rank gradients of step 0's global batch, no process group."""
    ex = example()
    args = ex.parse_args(ARGS + (["--tie-embeddings"] if tied else []))
    model = ex.build_model(args, torch.device("cpu"))
    tokens = ex.global_batch(args, 0)
    model(input_ids=tokens, labels=tokens).loss.backward()
    return model, {n: p.grad for n, p in model.named_parameters()}


def parameter_kinds(model):
    """{parameter name: "qkv" | "gate_up" | "linear"} for coda's fused weights and every nn.Linear weight."""
    import coda
    kinds = {}
    for name, m in model.named_modules():
        prefix = name + "." if name else ""
        if isinstance(m, coda.nn.RMSNormQKVRoPE):
            kinds[prefix + "qkv_weight"] = "qkv"
        elif isinstance(m, coda.nn.SwiGLUMLP):
            kinds[prefix + "gate_up_weight"] = "gate_up"
        elif isinstance(m, torch.nn.Linear):
            kinds[prefix + "weight"] = "linear"
    return kinds


def assert_grad_close(name, got, want):
    atol = GRAD_TOL["atol_of_max"] * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=GRAD_TOL["rtol"], atol=atol, msg=lambda m: f"{name}: {m}")


# ---- the tests

def test_loss_curves_two_ranks_equal_one_rank(one_rank, two_ranks):
    logs, _, stdout = two_ranks
    ref = one_rank["ddp"][0]
    assert len(ref) == STEPS and all(math.isfinite(v) for v in ref)
    assert ref[-1] < ref[0], f"the loss did not fall in {STEPS} steps: {ref}"
    for mode in ("ddp", "fsdp2"):
        assert f"{mode} step {STEPS:3d}/{STEPS}" in stdout
        assert logs[mode]["world_size"] == 2 and len(logs[mode]["tokens_per_s"]) == STEPS
        for name, curve in ((f"1-rank {mode}", one_rank[mode][0]), (f"2-rank {mode}", logs[mode]["losses"])):
            worst = max(abs(a - b) / abs(b) for a, b in zip(curve, ref))
            assert worst <= LOSS_RTOL, f"{name} loss curve {curve} vs 1-rank DDP {ref}: relative {worst:.2e}"


@pytest.mark.parametrize("mode,tied", WORKER_CASES)
def test_gradients_reduced_and_sharded_like_linear(worker_out, mode, tied):
    from torch.distributed.tensor import Shard
    model, ref = reference_grads(tied)
    kinds = parameter_kinds(model)
    assert sorted(set(kinds.values())) == ["gate_up", "linear", "qkv"], kinds
    ranks = [torch.load(worker_out / f"grads_{mode}_{int(tied)}_{r}.pt", weights_only=False) for r in range(2)]
    assert set(ranks[0]) == set(ref), (sorted(ranks[0]), sorted(ref))
    for name, want in ref.items():
        got = [g[name] for g in ranks]
        if mode == "ddp":  # the all-reduced mean, whole on each rank
            for r in range(2):
                assert got[r]["placements"] is None
                assert_grad_close(f"rank {r} {name}", got[r]["local"], want)
            continue
        for r in range(2):  # FSDP2: Shard(0) DTensors, rank r holding torch.chunk's rows r
            assert got[r]["placements"] == (Shard(0),), (name, got[r]["placements"])
            assert got[r]["param_placements"] == (Shard(0),), (name, got[r]["param_placements"])
            assert got[r]["local"].shape == torch.chunk(want, 2)[r].shape, (name, got[r]["local"].shape)
        assert_grad_close(name, torch.cat([g["local"] for g in got]), want)
    linear = [n for n, k in kinds.items() if k == "linear"]
    for name in (n for n, k in kinds.items() if k != "linear"):  # coda's fused weights, as an nn.Linear weight
        assert ranks[0][name]["placements"] == ranks[0][linear[0]]["placements"]


@pytest.mark.parametrize("patched", [True, False], ids=["coda", "plain_hf"])
def test_fsdp2_checkpoint_loads_into_one_process(worker_out, patched):
    ex = example()
    truth = torch.load(worker_out / "fsdp2_weights.pt")  # gathered on rank 0 before the save
    args = ex.parse_args(ARGS + ["--seed", "1"])  # other initial weights: the load must overwrite them all
    model = ex.build_model(args, torch.device("cpu"), patch=patched)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "loading without a process group"
        ex.load_checkpoint(model, str(worker_out / "ckpt"))
    got = model.state_dict()
    assert set(got) == set(truth), (sorted(set(got) ^ set(truth)))
    for k, v in truth.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "fsdp2_cast"])
def test_bf16_mixed_precision_trains(one_rank, worker_out, mode):
    """--dtype bf16, as on CUDA: the reference path in bf16, fp32 weights and reductions;
    fsdp2_cast: FSDP2's default cast of every forward input, the float32 statistics a
    decoder layer hands the next among them (dropped and recomputed)."""
    with open(worker_out / f"bf16_{mode}.json") as f:
        r = json.load(f)
    ref = one_rank["ddp"][0][:BF16_STEPS]
    assert r["dtype"] == "bf16" and r["world_size"] == 2 and len(r["losses"]) == BF16_STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
    assert worst <= BF16_RTOL, f"bf16 {mode} losses {r['losses']} vs float32 {ref}: relative {worst:.2e}"


def test_fsdp2_checkpoint_resumes_under_fsdp2(worker_out):
    truth = torch.load(worker_out / "fsdp2_weights.pt")
    back = torch.load(worker_out / "fsdp2_resumed.pt")  # a 2-rank FSDP2 model of other weights, loaded
    assert set(back) == set(truth)
    for k, v in truth.items():
        assert torch.equal(back[k], v), k


def test_example_checkpoint_has_one_rank_weights(one_rank, two_ranks):
    ex = example()
    _, ckpt, _ = two_ranks
    model = ex.build_model(ex.parse_args(ARGS + ["--seed", "1"]), torch.device("cpu"), patch=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ex.load_checkpoint(model, str(ckpt / "fsdp2"))
    want = one_rank["fsdp2"][1]
    got = model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **WEIGHT_TOL, msg=lambda m: f"{k}: {m}")


# ---- the worker: python -m torch.distributed.run --nproc_per_node 2 tests/test_distributed_cpu.py OUT

def _worker(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    ex = example()
    device = ex.init("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for mode, tied in WORKER_CASES:
            args = ex.parse_args(ARGS + (["--tie-embeddings"] if tied else []))
            model = ex.wrap(ex.build_model(args, device), mode, device)
            tokens = ex.local_rows(ex.global_batch(args, 0), rank, world)
            model(input_ids=tokens, labels=tokens).loss.backward()
            grads = {}
            for name, p in ex.unwrap(model).named_parameters():
                g = p.grad
                grads[name] = dict(local=(g.to_local() if isinstance(g, DTensor) else g).detach().clone(),
                                   placements=tuple(g.placements) if isinstance(g, DTensor) else None,
                                   param_placements=tuple(p.placements) if isinstance(p, DTensor) else None)
            torch.save(grads, os.path.join(out, f"grads_{mode}_{int(tied)}_{rank}.pt"))
            if mode == "fsdp2" and not tied:  # a step, then the checkpoint and its truth
                torch.optim.SGD(model.parameters(), lr=0.5).step()
                ex.save_checkpoint(model, os.path.join(out, "ckpt"))
                truth = {k: full(v).detach().clone() for k, v in ex.unwrap(model).state_dict().items()}
                resumed = ex.wrap(ex.build_model(ex.parse_args(ARGS + ["--seed", "1"]), device), mode, device)
                ex.load_checkpoint(resumed, os.path.join(out, "ckpt"))
                back = {k: full(v).detach().clone() for k, v in ex.unwrap(resumed).state_dict().items()}
                if rank == 0:
                    torch.save(truth, os.path.join(out, "fsdp2_weights.pt"))
                    torch.save(back, os.path.join(out, "fsdp2_resumed.pt"))
                del resumed
            del model
        # the CUDA recipe's mixed precision on the CPU: autocast (DDP), MixedPrecisionPolicy (FSDP2)
        args = ex.parse_args(ARGS + ["--dtype", "bf16", "--steps", str(BF16_STEPS)])
        for mode, cast in (("ddp", False), ("fsdp2", False), ("fsdp2", True)):
            args.cast_forward_inputs = cast
            r = ex.train(args, mode, device, log=lambda line: None)
            del r["model"]
            if rank == 0:
                with open(os.path.join(out, f"bf16_{mode}{'_cast' if cast else ''}.json"), "w") as f:
                    json.dump(r, f)
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
