"""The LM head + cross-entropy, forward + backward (`--only lm_head`): time and peak memory.

Cases lm_head_ce_fwd_bwd_t<tokens>_d<d>_v<vocab>, bf16, at 8192 tokens x d 2048 and
16384 x 4096 with LLaMA 3's vocabulary (128,256), 8192 x 1024 with GPT-2's (50,257) and
8192 x 1536 with Qwen's (151,936). Impls:
  coda          coda.ops.linear_cross_entropy as it comes: the backward
                recomputes the logits (four GEMMs, gradients rounded as torch's)
  coda_fwd      recompute=False: the gradients formed in the forward's chunks
                (three GEMMs, dW summed over the chunks in float32)
  coda_fwd_c<N> the same with N tokens per chunk: the memory / time trade-off
  coda_half     recompute="half": the forward forms dX, db and the first half of
                dW's rows, the backward recomputes the logits of the second half
                for theirs (three and a half GEMMs, no float32 dW beyond the gradient)
  coda_half_c<N> the same with N tokens per chunk
  coda_v<N>     coda with N classes per slice: its time at a smaller logits buffer
  coda_epi, coda_v<N>_epi  the same with d loss / d logits formed in the epilogue of the
                backward's logits GEMM (linear_ce_grad; off by default until this row
                says it wins)
  coda_fwd_1r   coda_fwd with the one-read cross-entropy kernel (each row of logits
                held in a cluster's shared memory: read once, not twice), off by
                default until this row says it wins
  cublas        the three GEMMs alone (logits, dX, dW): the floor
  eager         F.linear + F.cross_entropy
  compile       torch.compile of it
  liger         Liger-Kernel's LigerFusedLinearCrossEntropyFunction
Each row has peak_gib (torch.cuda.max_memory_allocated over one step, the
inputs included) and extra_gib (that minus the inputs and the gradients); coda's,
coda_fwd's, coda_half's, cublas's and liger's also the step's kernels (kernel_us)
and their sums by kind (phase_us: gemm, cross_entropy, scale, other): where the
time over the three GEMMs goes.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

import coda
from coda import _kernels

from . import steps
from .timing import Runner, kernel_timeline, why

VOCAB = 128256
POINTS = [(8192, 2048), (16384, 4096), (8192, 1024), (8192, 1536)]
# the vocabulary of the models at those widths other than LLaMA 3's: GPT-2 medium's, Qwen2.5-1.5B's
VOCABS = {(8192, 1024): 50257, (8192, 1536): 151936}
CHUNKS = (1024, 2048, 4096, 8192)
# classes per slice of the recomputing path (coda_v<N>) and tokens per chunk of "half" (coda_half_c<N>): the
# time each pays to come down to Liger's memory (~0.12 GiB beyond the inputs and gradients at 8,192 x 2048);
# at 8,192 tokens a slice of 1,024-2,048 classes (16-32 MiB) also stays in the H100's 50 MB L2 between the
# GEMM that writes it, the cross-entropy pass and the two GEMMs that read it; at 16,384 x 4096 the recomputed
# dX's float32 half (128 MiB) leaves Liger's ~0.19 GiB room for about 900 classes a slice, hence 512
SLICES = (512, 1024, 2048, 4096, 8192)
HALF_CHUNKS = (1024, 2048)
EPI_SLICES = (2048,)
# the impls whose kernels are listed, and the kinds their kernels are summed by (first match)
PROFILED = ("coda", "coda_epi", "coda_fwd", "coda_half", "coda_fwd_1r", "cublas", "liger")
KINDS = (("cross_entropy", ("cross_entropy",)), ("scale", ("scale",)),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas")))


def points(tokens, dims, gpu: bool):
    """(tokens, d) pairs: the four above by default; --tokens / --dims pick others (every pair)."""
    if not gpu:
        return [(t, d) for t in (tokens or [256]) for d in (dims or [64])]
    if tokens is None and dims is None:
        return POINTS
    return [(t, d) for t in (tokens or [8192]) for d in (dims or [2048])]


def vocab_of(tokens: int, d: int, gpu: bool) -> int:
    return VOCABS.get((tokens, d), VOCAB) if gpu else 1000


def phases(kernel_us) -> dict:
    """kernel_timeline's [name, us, idle us] rows summed by kind (KINDS; the rest "other")."""
    out = {kind: 0.0 for kind, _ in KINDS}
    out["other"] = 0.0
    for name, us, _ in kernel_us:
        low = name.lower()
        kind = next((k for k, keys in KINDS if any(key in low for key in keys)), "other")
        out[kind] = round(out[kind] + us, 1)
    return out


def liger_fn():
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception as e:  # not installed, or no triton
        return None, f"liger_kernel is not importable ({why(e)})"
    return (lambda x, w, t: LigerFusedLinearCrossEntropyFunction.apply(x, w, t)[0]), ""


def _peak(step, device: str) -> float:
    """Peak bytes allocated over one step."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    del out
    return float(torch.cuda.max_memory_allocated())


def run(r: Runner, tokens: int, dims: Sequence[int], dtype: torch.dtype, device: str) -> None:
    # a step here is GPU-bound (20-110 ms): 3 enqueue timings say what 20 would, in a tenth of the section's time
    host_reps, r.host_reps = r.host_reps, 3
    try:
        _run(r, tokens, dims, dtype, device)
    finally:
        r.host_reps = host_reps


def _run(r: Runner, tokens: int, dims: Sequence[int], dtype: torch.dtype, device: str) -> None:
    fn_liger, why_not = liger_fn() if r.gpu else (None, "Liger-Kernel's Triton kernels need a CUDA GPU")
    for d in dims:
        vocab = vocab_of(tokens, d, r.gpu)
        case = f"lm_head_ce_fwd_bwd_t{tokens}_d{d}_v{vocab}"
        torch.manual_seed(0)
        x = steps.rand(tokens, d, dtype=dtype, device=device).requires_grad_(True)
        w = steps.rand(vocab, d, dtype=dtype, device=device, scale=d**-0.5).requires_grad_(True)
        t = torch.randint(0, vocab, (tokens,), device=device)

        def step(fn):
            return lambda: torch.autograd.grad(fn(x, w, t), [x, w])

        def eager(x, w, t):
            return F.cross_entropy(F.linear(x, w), t)

        def cublas():
            z = x.detach() @ w.detach().t()
            return z @ w.detach(), z.t() @ x.detach()

        lce = coda.ops.linear_cross_entropy
        impls = {"coda": step(lambda x, w, t: lce(x, w, t)),
                 "coda_fwd": step(lambda x, w, t: lce(x, w, t, recompute=False)),
                 "coda_half": step(lambda x, w, t: lce(x, w, t, recompute="half"))}
        def one_read(x, w, t):
            with _kernels.cross_entropy_one_read():  # the pass runs in the forward
                return lce(x, w, t, recompute=False)

        impls["coda_fwd_1r"] = step(one_read)
        for c in CHUNKS:
            impls[f"coda_fwd_c{c}"] = step(lambda x, w, t, c=c: lce(x, w, t, recompute=False, chunk_tokens=c))
        for c in HALF_CHUNKS:
            impls[f"coda_half_c{c}"] = step(lambda x, w, t, c=c: lce(x, w, t, recompute="half", chunk_tokens=c))
        for c in SLICES:
            impls[f"coda_v{c}"] = step(lambda x, w, t, c=c: lce(x, w, t, chunk_vocab=c))

        def epilogue(fn):
            def run():
                with _kernels.lm_head_grad_epilogue():  # the backward runs inside the step too
                    return fn()
            return run

        impls["coda_epi"] = epilogue(impls["coda"])
        for c in EPI_SLICES:
            impls[f"coda_v{c}_epi"] = epilogue(impls[f"coda_v{c}"])
        impls.update({"cublas": cublas, "eager": step(eager), "compile": step(steps.compiled(eager))})
        if fn_liger is not None:
            impls["liger"] = step(fn_liger)
        else:
            r.skip(case, "liger", why_not)
        rows = r.interleaved(case, impls, 3 * 2.0 * tokens * d * vocab, reference="eager")
        held = 2 * (x.nbytes + w.nbytes)  # inputs and their gradients
        for row in rows:
            try:
                peak = _peak(impls[row["impl"]], device)
            except Exception as e:  # a diagnosis, never a reason to stop
                r.skip(case, row["impl"] + " (peak)", why(e))
                continue
            row["peak_gib"] = peak / 2**30
            row["extra_gib"] = (peak - held) / 2**30
            print(f"  {case:<32} {row['impl']:<14} peak {row['peak_gib']:7.3f} GiB  "
                  f"extra {row['extra_gib']:7.3f} GiB", flush=True)
            if r.gpu and row["impl"] in PROFILED:
                row.update(kernel_timeline(impls[row["impl"]]))
                row["phase_us"] = phases(row["kernel_us"])
                print(f"  {case:<32} {row['impl']:<14} " +
                      "  ".join(f"{k} {v / 1e3:.2f} ms" for k, v in row["phase_us"].items()), flush=True)
        if r.after_case is not None:
            r.after_case()
        del impls, x, w, t
        if r.gpu:
            torch.cuda.empty_cache()
