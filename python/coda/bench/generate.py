"""generate() with a patched model (`--only generate`): whether a decode step should run coda's
kernels (at M = batch rows) or the unfused torch path.

For each model (gpt2medium, llama1b: their configs and full depth, random weights, bf16,
eval mode) and batch (1 and 8 rows by default; --tokens sets them), greedy generate() from a
prompt of PROMPT random tokens, with the model's KV cache, every impl on a model built from the
same seed:
  hf         the model as Hugging Face builds it (SDPA)
  coda       coda.hf.patch(model): prefill and decode on coda's kernels
  coda_ref   the patched model with every op on its reference path (coda._kernels.reference_only):
             the same forward in unfused torch code
Cases generate_<model>_b<batch>: prefill_ms (generate of 1 new token) and decode_ms_per_token
((generate of NEW tokens − prefill) / (NEW − 1)); median_ms is the whole NEW-token call. The
impls take turns, --rounds rounds; medians over them. same_tokens_as_hf: the fraction of
generated tokens equal to hf's (bf16 numerics differ; a low fraction is a bug to look at).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Dict, List, Sequence

import torch

from coda import _kernels

from . import train
from .timing import Runner, why

PROMPT = 128
NEW = 64
BATCHES = (1, 8)
MODELS = ("gpt2medium", "llama1b")


def points(tokens, gpu: bool):
    """(batch, model) pairs: each model at each batch (--tokens: the batches; on the CPU too, where
    run() says why it times nothing)."""
    return [(b, m) for m in MODELS for b in (tokens or BATCHES)]


def _model(name: str, patched: bool, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM

    from coda import hf as coda_hf
    config = train.MODELS[name].build_config(PROMPT + NEW)
    config.use_cache = True
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype).eval()
    model.generation_config.eos_token_id = None  # every call generates its NEW tokens
    model.generation_config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    if patched:
        coda_hf.patch(model)
    return model


def _generate(model, ids: torch.Tensor, new: int, reference: bool) -> torch.Tensor:
    with torch.no_grad(), (_kernels.reference_only() if reference else contextlib.nullcontext()):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False)


def _timed(fn: Callable[[], torch.Tensor]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def run(r: Runner, batch: int, models: Sequence[str], dtype: torch.dtype, device: str) -> None:
    if not r.gpu:
        for model in models:
            r.skip(f"generate_{model}", "coda", "the decode benchmark runs on an sm_90 GPU only")
        return
    for name in models:
        case = f"generate_{name}_b{batch}"
        try:
            nets = {"hf": _model(name, False), "coda": _model(name, True)}
        except Exception as e:
            r.skip(case, "coda", why(e))
            continue
        nets["coda_ref"] = nets["coda"]
        g = torch.Generator().manual_seed(1)
        vocab = nets["hf"].config.vocab_size
        ids = torch.randint(0, vocab // 8, (batch, PROMPT), generator=g).to(device)
        impls = list(nets)
        out: Dict[str, torch.Tensor] = {}
        live: List[str] = []
        for impl in impls:
            try:
                out[impl] = _generate(nets[impl], ids, NEW, impl == "coda_ref")  # warm-up, and the tokens
                live.append(impl)
            except Exception as e:
                r.skip(case, impl, why(e))
        times: Dict[str, Dict[str, List[float]]] = {i: {"full": [], "prefill": []} for i in live}
        for rnd in range(r.rounds):
            k = rnd % max(len(live), 1)
            for impl in live[k:] + live[:k]:
                ref = impl == "coda_ref"
                times[impl]["prefill"].append(_timed(lambda: _generate(nets[impl], ids, 1, ref)))
                times[impl]["full"].append(_timed(lambda: _generate(nets[impl], ids, NEW, ref)))
        rows = []
        for impl in live:
            full, pre = statistics.median(times[impl]["full"]), statistics.median(times[impl]["prefill"])
            row = {"case": case, "impl": impl, "median_ms": full, "round_ms": [round(v, 3) for v in times[impl]["full"]],
                   "prefill_ms": pre, "decode_ms_per_token": (full - pre) / (NEW - 1),
                   "tokens_per_s": batch * NEW / full * 1e3, "batch": batch, "prompt": PROMPT, "new_tokens": NEW}
            if "hf" in out and impl != "hf":
                row["same_tokens_as_hf"] = (out[impl][:, PROMPT:] == out["hf"][:, PROMPT:]).float().mean().item()
            rows.append(row)
            print(f"  {case:<32} {impl:<10} {full:9.1f} ms  prefill {pre:8.2f} ms  decode "
                  f"{row['decode_ms_per_token']:7.3f} ms/token" +
                  (f"  same tokens as hf {row['same_tokens_as_hf']:.2f}" if "same_tokens_as_hf" in row else ""),
                  flush=True)
        r.results += rows
        if r.after_case is not None:
            r.after_case()
        nets.clear()
        out.clear()
        torch.cuda.empty_cache()
