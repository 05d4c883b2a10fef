"""Train a small coda-patched LLaMA with PyTorch's own distributed engine: DDP and FSDP2.

    torchrun --nproc_per_node 2 examples/train_distributed.py --device cpu            # gloo, 2 CPU processes
    torchrun --nproc_per_node 1 examples/train_distributed.py --device cuda           # NCCL, one GPU
    torchrun --nproc_per_node 8 examples/train_distributed.py --mode fsdp2 --save ckpt

A transformers.LlamaForCausalLM built from a config (random weights, nothing is downloaded),
coda.hf.patch'ed in place, wrapped in DistributedDataParallel (--mode ddp) or sharded with
FSDP2's fully_shard (--mode fsdp2: each decoder layer, then the root), or each in turn from the
same seed (--mode both, the default). The data are synthetic and learnable: each sequence
counts through the first eighth of the vocabulary from a random start with a random stride
of 1-8 (global_batch). Every step draws one global batch from the step's seed, the same on
every rank, and each rank trains on its rows: the run is the 1-rank run on the same global
batch, up to the order in which the ranks' gradients are summed.

Per step, rank 0 logs the loss of the global batch (the ranks' losses averaged: each rank's
holds as many tokens) and tokens/s (the global batch's tokens over the step's wall time, a
CUDA sync included); the summary's tokens/s is the mean over the steps after --warmup.
--log-json FILE writes both per mode; --save DIR writes the trained model as a distributed
checkpoint (torch.distributed.checkpoint) per mode, DIR/<mode>.

CPU: gloo, a tiny model, float32 (--dtype bf16: as on CUDA). CUDA: NCCL, one GPU per rank
(LOCAL_RANK), a LLaMA-shaped model of ~160M parameters, fp32 master weights and bf16
compute (--dtype bf16, the default there: DDP under torch.autocast, FSDP2 by its
MixedPrecisionPolicy with fp32 gradient reduction). NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set before
torch.distributed is imported (setdefault: a caller's own values stay), which keeps NCCL
off NVLink SHARP / multicast, as on hosts that do not allow it.

Pitfalls of a coda-patched model under these wrappers, and how coda meets them:
  * FSDP2 hands a module its parameters unsharded only inside its own forward (between
    its pre- and post-forward hooks); elsewhere they are sharded DTensors. A patched
    model's lm_head is a coda.nn.LMHead (an nn.Linear, same parameters and keys) whose
    forward takes the labels and computes the fused LM head + loss: the weight is read
    inside lm_head's own forward, so fully_shard(model.lm_head) works as for a plain
    model. shard() below gives it its own group where it is not tied to the embedding
    (a tied weight belongs to one group: the root's, with the embedding).
  * The fused weights (qkv_weight: [q; k; v] with q/k rows pair-permuted; gate_up_weight:
    gate and up rows interleaved) are plain (N, D) Parameters: FSDP2 shards them on dim 0
    and reduce-scatters their gradients as it does an nn.Linear weight's, DDP all-reduces
    them like any other, and the all-gather hands the kernels the whole weight.
  * Their state_dict keys are Hugging Face's (q_proj.weight, gate_proj.weight,
    input_layernorm.weight, ...), made by state_dict hooks, and each key is also an
    attribute path (layer.self_attn.q_proj.weight, a read-only view of the fused weight),
    as torch.distributed.checkpoint's get_model_state_dict / set_model_state_dict need:
    checkpoints are written and read with those, as for a plain model. Under FSDP2 the
    hooks slice and permute the fused DTensor along its sharded dim, which DTensor does
    by redistributing it: in the dict q/k/v_proj are whole (Replicate) on every rank and
    gate/up_proj sharded on dim 1, not dim 0. The checkpoint is thus in Hugging Face's
    keys and layouts (it loads into a plain LlamaForCausalLM, or resumes under FSDP2), at
    the cost of that communication and of every layer's q/k/v weights held whole on each
    rank while it is written.
  * FSDP2's mixed precision casts a module's floating-point forward inputs to bf16 by
    default (cast_forward_inputs=True), the float32 RMSNorm statistics a patched decoder
    layer hands the next one among them. A layer (and the LM head) given statistics that
    are not float32 drops them and reduces its own: correct, one pass over h slower.
    shard() passes cast_forward_inputs=False, which keeps them; the hidden states are
    bf16 anyway, the embedding's weight being bf16.
  * A wrapped model holds its process group: main() collects it before destroying the
    group (see there).
"""

from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

MODES = ("ddp", "fsdp2")

# Per device: the model's shape, the global batch (sequences) and the learning rate.
SIZES = {
    "cpu": dict(vocab=256, hidden=64, ffn=176, layers=2, heads=4, kv_heads=2, seq_len=32, global_batch=8, lr=3e-3),
    "cuda": dict(vocab=32000, hidden=1024, ffn=2816, layers=8, heads=8, kv_heads=4, seq_len=1024, global_batch=16,
                 lr=1e-3),
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=(*MODES, "both"), default="both")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda where there is one")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="compute dtype (weights stay fp32); default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the mean tokens/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-embeddings", action="store_true", help="lm_head.weight is model.embed_tokens.weight")
    for name in SIZES["cpu"]:
        p.add_argument("--" + name.replace("_", "-"), type=type(SIZES["cpu"][name]), default=None,
                       help="default: per device")
    p.add_argument("--cast-forward-inputs", action="store_true",
                   help="FSDP2 bf16: cast every forward input to bf16 (FSDP2's default; see the pitfalls above)")
    p.add_argument("--save", metavar="DIR", help="write a distributed checkpoint per mode, DIR/<mode>")
    p.add_argument("--log-json", metavar="FILE", help="rank 0 writes each mode's losses and tokens/s")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    for name, value in SIZES[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ---- the model

def llama_config(args: argparse.Namespace):
    import transformers
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-5, tie_word_embeddings=args.tie_embeddings, use_cache=False, attn_implementation="sdpa")


def build_model(args: argparse.Namespace, device: torch.device, patch: bool = True) -> torch.nn.Module:
    """A LlamaForCausalLM with fp32 weights from args.seed, the same on every rank, patched by coda."""
    import transformers

    import coda.hf
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(llama_config(args)).to(device)
    return coda.hf.patch(model) if patch else model


def decoder_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    return list(model.model.layers)


def shard(model: torch.nn.Module, bf16: bool = False, cast_forward_inputs: bool = False) -> torch.nn.Module:
    """FSDP2: one FSDP group per decoder layer, one for lm_head unless it is tied to the
    embedding, then the root's (the embedding, the final norm, a tied lm_head)."""
    # bf16: the all-gathered weights in bf16, gradients reduced in fp32; forward inputs not
    # cast by default, which keeps the float32 RMSNorm statistics a patched decoder layer
    # hands the next (cast, they are dropped and recomputed: see the module docstring).
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              cast_forward_inputs=cast_forward_inputs) if bf16 else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    if model.lm_head.weight is not model.get_input_embeddings().weight:
        fully_shard(model.lm_head, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def wrap(model: torch.nn.Module, mode: str, device: torch.device, bf16: bool = False,
         cast_forward_inputs: bool = False) -> torch.nn.Module:
    if mode == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return shard(model, bf16, cast_forward_inputs)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


# ---- the data

def global_batch(args: argparse.Namespace, step: int) -> torch.Tensor:
    """(global_batch, seq_len) int64 tokens of step `step`, the same on every rank: row i
    counts start_i, start_i + stride_i, ... modulo the first eighth of the vocabulary (every
    id stays in the softmax; the loss falls fast from ln(vocab) towards ln(vocab / 8), then
    towards ln 8 as the model learns each token's successors, and below as it infers strides)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    ids = max(args.vocab // 8, 16)
    start = torch.randint(0, ids, (args.global_batch, 1), generator=g)
    stride = torch.randint(1, 9, (args.global_batch, 1), generator=g)
    return (start + stride * torch.arange(args.seq_len)) % ids


def local_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = batch.shape[0] // world
    return batch[rank * n:(rank + 1) * n]


# ---- training

def autocast(device: torch.device, bf16: bool):
    """bf16 compute: DDP keeps fp32 weights under autocast; FSDP2 all-gathers bf16 copies of
    them (MixedPrecisionPolicy), which autocast leaves as they are."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def train_step(model, opt, tokens: torch.Tensor, device: torch.device, bf16: bool = False) -> torch.Tensor:
    """One optimizer step on this rank's rows; returns the local loss (detached)."""
    with autocast(device, bf16):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().float()


def global_mean(t: torch.Tensor, world: int) -> float:
    """The ranks' mean of a scalar (gloo has no ReduceOp.AVG)."""
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item() / world


def train(args: argparse.Namespace, mode: str, device: torch.device, log=print) -> Dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the {world} ranks")
    bf16 = args.dtype == "bf16"
    model = wrap(build_model(args, device), mode, device, bf16, args.cast_forward_inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    tokens_per_step = args.global_batch * args.seq_len
    losses, rates = [], []
    for step in range(args.steps):
        tokens = local_rows(global_batch(args, step), rank, world).to(device)
        t0 = time.perf_counter()
        loss = train_step(model, opt, tokens, device, bf16)
        loss = global_mean(loss, world)  # waits for the step (a CUDA sync)
        dt = time.perf_counter() - t0
        losses.append(loss)
        rates.append(tokens_per_step / dt)
        if rank == 0:
            log(f"{mode} step {step + 1:3d}/{args.steps}  loss {loss:.4f}  tokens/s {rates[-1]:,.0f}")
    timed = rates[min(args.warmup, len(rates) - 1):]
    result = dict(mode=mode, world_size=world, device=str(device), dtype=args.dtype, steps=args.steps, losses=losses,
                  tokens_per_s=rates, mean_tokens_per_s=sum(timed) / len(timed),
                  parameters=sum(p.numel() for p in model.parameters()))
    if rank == 0:
        log(f"{mode}: {world} rank(s), {result['parameters'] / 1e6:.1f}M parameters, final loss {losses[-1]:.4f}, "
            f"{result['mean_tokens_per_s']:,.0f} tokens/s (steps {len(rates) - len(timed) + 1}-{len(rates)})")
    if args.save:
        path = os.path.join(args.save, mode)
        save_checkpoint(model, path)
        if rank == 0:
            log(f"{mode}: checkpoint in {path}")
    result["model"] = model
    return result


# ---- checkpoints

def save_checkpoint(model: torch.nn.Module, path: str) -> None:
    """The model's weights as a distributed checkpoint, in Hugging Face's keys and layouts,
    every rank writing its shards."""
    dcp.save(get_model_state_dict(unwrap(model)), checkpoint_id=path)


def load_checkpoint(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """A checkpoint of save_checkpoint into `model`: a single-process one, patched by coda
    or not (then no process group is needed), or a wrapped one of any world size."""
    model = unwrap(model)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    return model


# ---- the launch

def init(device_type: str) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def run(args: argparse.Namespace, device: torch.device, log=print, keep_models: bool = False) -> List[Dict]:
    """Train each mode of args.mode in turn in the process group already started; each
    result: mode, world_size, dtype, losses and tokens_per_s per step, mean_tokens_per_s,
    parameters, and with keep_models the trained (wrapped) model."""
    if dist.get_rank() == 0:
        log(f"world size {dist.get_world_size()}, backend {dist.get_backend()}, device {device} ({args.dtype}), "
            f"global batch {args.global_batch} x {args.seq_len} tokens")
    results = []
    for mode in MODES if args.mode == "both" else (args.mode,):
        results.append(train(args, mode, device, log))
        if not keep_models:
            del results[-1]["model"]
            gc.collect()  # the model before the next one: its memory, and its hold on the process group
    if args.log_json and dist.get_rank() == 0:
        with open(args.log_json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "model"} for r in results], f, indent=1)
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    device = init(args.device)
    try:
        run(args, device, log=lambda line: print(line, flush=True))
    finally:
        # A wrapped model holds the process group: one left to the garbage collector until
        # the interpreter's exit, after the group's destruction, can abort the process there
        # ("terminate called without an active exception", gloo; DDP in 3 of 10 2-rank runs).
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
