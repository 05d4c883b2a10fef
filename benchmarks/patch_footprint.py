"""What coda.hf.patch saves per decoder layer of a Hugging Face model: kernels launched
and activation memory kept for backward, unpatched against patched.

    python benchmarks/patch_footprint.py [--batch 4] [--seq 2048] [--out DIR]

Models, built from configs with random weights, bf16 parameters, training mode, SDPA
attention: a LLaMA with LLaMA-3.2-1B's layer (d 2048, ffn 8192, 32 q / 8 kv heads of 64,
vocab 128,256, tied embeddings) and a GPT-2 with GPT-2 medium's (d 1024, 16 heads, ffn
4096, vocab 50,257). The step is the training forward with labels (the model's own loss)
and its backward. Each model is built with 2 and with 4 layers; per layer = (count at 4 −
count at 2) / 2, which leaves out the embeddings, the final norm, the LM head and the loss
(the step totals at 4 layers, which include them, are reported beside).

Counted:
  kernels_fwd, kernels_fwd_bwd   GPU kernels the profiler saw (torch.profiler, CUDA
                                 activity; memcpy and memset not counted, reported apart)
  saved_mib                      activation memory autograd saves in the forward: the
                                 unique storages that torch.autograd.graph.saved_tensors_hooks
                                 sees packed (C++ autograd nodes included), parameters
                                 excluded, in MiB
  retained_mib                   on CUDA, memory_allocated after the forward minus before it
                                 (what the graph keeps alive: saved tensors and outputs)

Without a GPU it runs tiny models (d 64) on the CPU, where coda's ops run their reference
path and no kernels are counted: a check that the script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
from typing import Dict, List

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

import coda
from coda import _kernels
from coda.bench import results

GPU_MODELS = {
    "llama": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=131072,
                  tie_word_embeddings=True),
    "gpt2": dict(vocab_size=50257, n_positions=2048, n_embd=1024, n_head=16),
}
CPU_MODELS = {
    "llama": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256,
                  tie_word_embeddings=True),
    "gpt2": dict(vocab_size=1000, n_positions=256, n_embd=64, n_head=4),
}
LAYERS = (2, 4)
MIB = 2**20


def build(family: str, dims: Dict, layers: int, seq: int, device: str, dtype: torch.dtype):
    import transformers
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(**dims, num_hidden_layers=layers, use_cache=False)
    else:
        config = transformers.GPT2Config(**dims, n_layer=layers, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        config.n_positions = max(config.n_positions, seq)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(dtype).train()


def step(model, ids, backward: bool):
    loss = model(input_ids=ids, labels=ids).loss
    if backward:
        loss.backward()
    return loss


def count_kernels(model, ids, backward: bool, cuda: bool) -> Dict[str, int]:
    """Kernels, memcpy/memset, and (on the CPU) top-level aten ops of one step."""
    model.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step(model, ids, backward)
        if cuda:
            torch.cuda.synchronize()
    kernels = copies = aten = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            if e.name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels += 1
        elif e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")):
            aten += 1
    return {"kernels": kernels, "copies": copies, "aten_ops": aten}


def saved_bytes(model, ids, cuda: bool) -> Dict[str, float]:
    """Bytes of the unique non-parameter storages autograd saves in the forward; on CUDA also
    the allocator's growth over the forward."""
    model.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: Dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes() > 0:
            storages[s.data_ptr()] = s.nbytes()
        return t

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(model, ids, False)
    out = {"saved_bytes": float(sum(storages.values()))}
    if cuda:
        torch.cuda.synchronize()
        out["retained_bytes"] = float(torch.cuda.memory_allocated() - before)
    loss.backward()  # frees the graph
    model.zero_grad(set_to_none=True)
    return out


def measure(model, ids, cuda: bool) -> Dict[str, float]:
    step(model, ids, True)  # warm-up: cuBLAS handles, coda's workspace, SDPA's choice
    model.zero_grad(set_to_none=True)
    fwd, fwd_bwd = count_kernels(model, ids, False, cuda), count_kernels(model, ids, True, cuda)
    row = {"kernels_fwd": fwd["kernels"], "kernels_fwd_bwd": fwd_bwd["kernels"],
           "copies_fwd_bwd": fwd_bwd["copies"], "aten_ops_fwd": fwd["aten_ops"],
           "aten_ops_fwd_bwd": fwd_bwd["aten_ops"]}
    row.update(saved_bytes(model, ids, cuda))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model, ids, True)
        torch.cuda.synchronize()
        row["step_peak_bytes"] = float(torch.cuda.max_memory_allocated() - base)
        model.zero_grad(set_to_none=True)
    return row


def run(batch: int, seq: int, device: str) -> List[Dict]:
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    models = GPU_MODELS if cuda else CPU_MODELS
    rows = []
    for family, dims in models.items():
        ids = torch.randint(0, dims["vocab_size"] // 8, (batch, seq), device=device)
        at: Dict[str, Dict[int, Dict]] = {"hf": {}, "coda": {}}
        for layers in LAYERS:
            plain = build(family, dims, layers, seq, device, dtype)
            patched = coda.hf.patch(copy.deepcopy(plain))
            for impl, model in (("hf", plain), ("coda", patched)):
                at[impl][layers] = measure(model, ids, cuda)
            del plain, patched
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        lo, hi = LAYERS
        for impl, by_layers in at.items():
            per_layer = {k: (by_layers[hi][k] - by_layers[lo][k]) / (hi - lo) for k in by_layers[hi]}
            rows.append({"model": family, "impl": impl, "tokens": batch * seq, "per_layer": per_layer,
                         f"step_{hi}_layers": by_layers[hi], f"step_{lo}_layers": by_layers[lo]})
    return rows


def table(rows: List[Dict], cuda: bool) -> str:
    cols = [("kernels_fwd", "kernels fwd", 1), ("kernels_fwd_bwd", "kernels fwd+bwd", 1),
            ("saved_bytes", "saved MiB", MIB)]
    if cuda:
        cols.append(("retained_bytes", "retained MiB", MIB))
    else:
        cols += [("aten_ops_fwd", "aten ops fwd", 1), ("aten_ops_fwd_bwd", "aten ops fwd+bwd", 1)]
    lines = ["| model | impl | " + " | ".join(f"{name} / layer" for _, name, _ in cols) + " |",
             "| --- | --- |" + " --- |" * len(cols)]
    for r in rows:
        vals = [r["per_layer"][k] / scale for k, _, scale in cols]
        lines.append(f"| {r['model']} | {r['impl']} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    return "\n".join(lines)


def record_fallbacks() -> set:
    """The (op, reason) of each coda op that runs its reference path on CUDA from now on."""
    seen = set()
    original = _kernels.fallback

    def record(op, reason):
        seen.add((op, reason))
        original(op, reason)

    _kernels.fallback = record
    return seen


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; 2 on the CPU)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; 32 on the CPU)")
    p.add_argument("--out", default=None, help="write a stamped results JSON into this directory")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and coda.kernels_run_on(torch.device("cuda"))
    device = "cuda" if cuda else "cpu"
    batch = a.batch or (4 if cuda else 2)
    seq = a.seq or (2048 if cuda else 32)
    fell_back = record_fallbacks()
    rows = run(batch, seq, device)
    print(f"per decoder layer, {batch} x {seq} tokens, {device}"
          + ("" if cuda else " (reference path: no kernels counted)"))
    print(table(rows, cuda))
    if cuda and fell_back:
        print(f"ran their reference path (these counts include it): {sorted(fell_back)}")
    if a.out:
        path = results.write(a.out, "patch_footprint", {"batch": batch, "seq": seq, "layers": list(LAYERS),
                                                         "dtype": "bfloat16" if cuda else "float32",
                                                         "fallbacks": sorted(fell_back), "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
