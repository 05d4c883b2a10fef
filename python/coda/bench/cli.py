"""python -m coda.bench: coda against its baselines, all timed in turn in one run.

Default: the GPT-style block without its attention (LayerNorm -> QKV, o-proj +
residual, LayerNorm -> GELU MLP + residual), forward and forward + backward, at
8192 tokens and d 1024, 2048, 4096 (ffn 4d), bf16. Impls:
  coda      the block composed from coda.ops
  cublas    its GEMMs alone (torch.matmul): the floor a fused block is held to
  eager     the unfused PyTorch code
  compile   torch.compile of it, compiled once per case before timing
  liger     the eager code with Liger-Kernel's LayerNorm (where installed)
`--only mlp`, `--only norm` run the MLP's and the norm ops' own cases instead.
`--only llama` runs the LLaMA block without its attention (RMSNorm -> QKV ->
RoPE, o-proj + residual, RMSNorm -> SwiGLU MLP + residual; llama.py) at
LLaMA-3-8B's dims x 16,384 tokens and LLaMA-3.2-1B's x 8192 (`--tokens`,
`--dims` pick others), with Liger-Kernel's RMSNorm, SiLU-mul and RoPE as
`liger`, into <date>-<device>-llama-<commit>.json when it runs alone.
`--sweep-shapes` runs the GPT-style block (never llama) at every point of
tokens 2048, 8192, 16384 x d 1024, 2048, 4096 (`--tokens` and `--dims`
narrow it), into <date>-<device>-shapes-<commit>.json.

Each case times its impls in turn, --rounds rounds, each round starting one
impl further along; median_ms is the median of the rounds' medians (timings:
triton.testing.do_bench, the L2 cleared before every run); host_ms is the host
time to enqueue one step. `--out DIR` writes DIR/<date>-<device>-<commit>.json.
Without an sm_90 GPU it says so and times the reference path on the CPU at a
small size. Kernel-level experiments (configuration sweeps, per-kernel
breakdowns, max-autotune, kernel overrides) are scripts in benchmarks/.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

import torch

import coda
from coda import _kernels

from . import blocks, llama, mlp, norm, results, table
from .timing import Runner, timer

SECTIONS = {"block": blocks.run, "mlp": mlp.run, "norm": norm.run, "llama": llama.run}
SWEEP_TOKENS, SWEEP_DIMS = [2048, 8192, 16384], [1024, 2048, 4096]


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v]


def _sections(text: str) -> List[str]:
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(SECTIONS)} (comma-separated), got {text!r}")
    return names


def gpu_here() -> Tuple[bool, str]:
    """(True, "") where coda's kernels run on the current CUDA device, else (False, why not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if not coda.kernels_available():
        return False, f"coda's extension did not load ({getattr(_kernels, 'LOAD_ERROR', None)})"
    if not coda.kernels_run_on(torch.device("cuda")):
        return False, f"{torch.cuda.get_device_name()} is not sm_90"
    return True, ""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m coda.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", type=_sections, default=["block"], metavar="block|mlp|norm|llama",
                   help="the cases to run, comma-separated (default: block)")
    p.add_argument("--tokens", type=_ints, help="comma-separated rows of every activation, one case each "
                                                "(default: 8192 on the GPU, 256 on the CPU; llama: 16384 at "
                                                "d 4096, 8192 at d 2048)")
    p.add_argument("--sweep-shapes", action="store_true",
                   help=f"the block at tokens {','.join(map(str, SWEEP_TOKENS))} x d {','.join(map(str, SWEEP_DIMS))}"
                        " (on the GPU; --tokens, --dims narrow it; not llama)")
    p.add_argument("--dims", type=_ints, help="comma-separated model widths d, ffn = 4d "
                                              "(default: 1024,2048,4096 on the GPU, 256 on the CPU; llama: "
                                              "4096 and 2048, each model's own ffn and heads)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                   help="on the GPU (the CPU runs float32); coda's norm kernels are bf16 only")
    p.add_argument("--warmup-ms", type=float, default=25, help="do_bench's warm-up per timing")
    p.add_argument("--rep-ms", type=float, default=100, help="do_bench's timed window per timing")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each case's impls in turn")
    p.add_argument("--host-reps", type=int, default=20, help="steps the host time is the median of")
    p.add_argument("--out", help="write <date>-<device>-<commit>.json into this folder")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    gpu, why_not = gpu_here()
    if gpu:
        device, dtype = "cuda", getattr(torch, args.dtype)
        tokens = args.tokens or (SWEEP_TOKENS if args.sweep_shapes else [8192])
        dims = args.dims or (SWEEP_DIMS if args.sweep_shapes else [1024, 2048, 4096])
        at = "" if args.only == ["llama"] else f"tokens={','.join(map(str, tokens))} d={','.join(map(str, dims))} "
        print(f"coda.bench on {torch.cuda.get_device_name()}: {','.join(args.only)}, {at}{args.dtype}", flush=True)
    else:
        device, dtype = "cpu", torch.float32
        tokens, dims = args.tokens or [256], args.dims or [256]
        print(f"coda.bench: {why_not}; timing the reference path on the CPU at tokens={','.join(map(str, tokens))} "
              f"d={','.join(map(str, dims))} float32.", flush=True)
    if args.sweep_shapes:
        if args.only != ["block"]:
            print("coda.bench: --sweep-shapes times the block; --only is ignored", flush=True)
        args.only = ["block"]
    # the LLaMA block's (tokens, d) go together: each model at its own token count
    llama_points = llama.points(args.tokens, args.dims, gpu) if "llama" in args.only else []
    if llama_points:
        print("coda.bench: llama at " + ", ".join(f"{t} tokens x d {d}" for t, d in llama_points), flush=True)

    r = Runner(gpu, args.warmup_ms, args.rep_ms, args.rounds, args.host_reps)
    kind = ("shapes" + (f"-t{'-'.join(map(str, tokens))}" if args.tokens else "")) if args.sweep_shapes else ""
    if args.only == ["llama"]:
        kind = "llama"
    path = results.results_path(args.out, kind) if args.out else None
    shape = {"tokens": tokens, "dims": dims, "ffn": "4d"} if args.only != ["llama"] else {}
    if llama_points:
        shape["llama"] = [llama.describe(t, d) for t, d in llama_points]

    def save() -> None:
        if path:
            results.write_to(path, {
                "timed_on": device, "dtype": str(dtype).replace("torch.", ""),
                "shape": shape,
                "timer": timer(gpu, args.warmup_ms, args.rep_ms, r.cpu_reps) + f"; {args.rounds} rounds in turn",
                "results": r.results, "skipped": r.skipped})

    r.after_case = save
    for name in args.only:
        for t, ds in ([(t, [d]) for t, d in llama_points] if name == "llama" else [(t, dims) for t in tokens]):
            SECTIONS[name](r, t, ds, dtype, device)
    table.print_table(r.results)
    if path:
        save()
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
