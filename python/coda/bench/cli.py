"""python -m coda.bench: coda against its baselines, all timed in turn in one run.

Default: the training comparison (train.py). A LLaMA-3.2-1B-shaped LlamaForCausalLM
and a GPT-2-medium-shaped GPT2LMHeadModel, random weights from their configs, train
for --warmup-steps untimed and --steps timed steps on random tokens (batch 4 x 2048,
bf16 weights, fused AdamW) with each impl: hf (Hugging Face, SDPA attention), liger
(Liger-Kernel's patch, where installed; none for GPT-2), compile (torch.compile),
coda (coda.hf.patch) and coda_compile (both), side by side: the timed steps go in
--rounds rounds of the impls in turn (4 on the GPU). It prints per impl its median step
time, tokens/s, the ratio to hf, peak memory and last loss; `--out DIR` writes
DIR/<date>-<device>-train-<commit>.json (rewritten after each impl and round: a run cut
short keeps what it timed) and, where matplotlib is installed, a .png of the same name
(tokens/s, peak memory, the loss curves). Without a GPU on which coda's kernels run,
it says so and trains tiny configs on the CPU in float32.

`--kernels`: the kernel-level benchmarks. By default the GPT-style block without its
attention (LayerNorm -> QKV, o-proj + residual, LayerNorm -> GELU MLP + residual),
forward and forward + backward, at 8192 tokens and d 1024, 2048, 4096 (ffn 4d), bf16.
Impls:
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
`--only lm_head` runs the LM head + cross-entropy, forward + backward, at 8192
tokens x d 2048 and 16384 x 4096 (vocabulary 128,256), 8192 x 1024 (50,257) and
8192 x 1536 (151,936) (lm_head.py), with time and
peak memory per impl, into <date>-<device>-lm_head-<commit>.json when it runs alone.
`--only fused_gemm` times every fused GEMM of a patched LLaMA-3.2-1B (8192 tokens),
LLaMA-3-8B (16,384) and GPT-2-medium (8192) layer's forward + backward, kernel by
kernel, against cuBLAS's plain GEMM of the same operands (fused_gemm.py), into
<date>-<device>-fused_gemm-<commit>.json when it runs alone.
`--only generate` times greedy generate() (prompt 128, 64 new tokens, batch 1 and 8;
--tokens sets the batches) of GPT-2-medium and LLaMA-3.2-1B: Hugging Face's, patched,
and patched with every op on its reference path: prefill and per-token decode times
(generate.py), into <date>-<device>-generate-<commit>.json when it runs alone.
`--sweep-shapes` runs the GPT-style block (never llama) at every point of
tokens 2048, 8192, 16384 x d 1024, 2048, 4096 (`--tokens` and `--dims`
narrow it), into <date>-<device>-shapes-<commit>.json. `--only`, `--sweep-shapes`
and every other kernel-level flag imply --kernels.

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
from typing import Callable, List, Optional, Tuple

import torch

import coda
from coda import _kernels

from . import blocks, fused_gemm, generate, llama, lm_head, mlp, norm, results, table, train
from .timing import Runner, timer

SECTIONS = {"block": blocks.run, "mlp": mlp.run, "norm": norm.run, "llama": llama.run, "lm_head": lm_head.run,
            "fused_gemm": fused_gemm.run, "generate": generate.run}
# sections whose points are their own (tokens with a width or a model), not tokens x --dims
OWN_POINTS = ("llama", "lm_head", "fused_gemm", "generate")
SWEEP_TOKENS, SWEEP_DIMS = [2048, 8192, 16384], [1024, 2048, 4096]


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v]


def _choices(options) -> Callable[[str], List[str]]:
    """An argparse type: a comma-separated list of names from `options`."""
    def parse(text: str) -> List[str]:
        names = [v for v in text.split(",") if v]
        if not names or any(v not in options for v in names):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(options)} (comma-separated), got {text!r}")
        return names
    return parse


_sections, _models, _impls = _choices(SECTIONS), _choices(train.MODELS), _choices(train.IMPLS + train.EXTRA_IMPLS)


def gpu_here() -> Tuple[bool, str]:
    """(True, "") where coda's kernels run on the current CUDA device, else (False, why not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if not coda.kernels_available():
        return False, f"coda's extension did not load ({getattr(_kernels, 'LOAD_ERROR', None)})"
    if not coda.kernels_run_on(torch.device("cuda")):
        return False, f"{torch.cuda.get_device_name()} is not sm_90"
    return True, ""


# the kernel-level flags (any one given implies --kernels) with their defaults, and the training comparison's
KERNEL_DEFAULTS = {"only": ["block"], "tokens": None, "dims": None, "sweep_shapes": False, "dtype": "bfloat16",
                   "warmup_ms": 25, "rep_ms": 100, "host_reps": 20}
KERNEL_ROUNDS = 5
TRAIN_FLAGS = ("models", "impls", "steps", "warmup_steps", "batch", "seq", "max_seconds", "budget_seconds", "no_plot")
TRAIN_MODELS = ("llama1b", "gpt2medium")
TRAIN_GPU = {"steps": 20, "warmup_steps": 3, "batch": 4, "seq": 2048, "rounds": 4}
TRAIN_CPU = {"steps": 2, "warmup_steps": 1, "batch": 2, "seq": 64, "rounds": 1}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m coda.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the stamped results file (and the training comparison's plot) into this folder")
    p.add_argument("--rounds", type=int, help="rounds of the impls in turn, each starting one impl further along "
                                              "(default: 5 for the kernel-level benchmarks; the training comparison "
                                              "splits its timed steps over 4 on the GPU, its models side by side, "
                                              "and 1 on the CPU: one model at a time)")
    t = p.add_argument_group("the training comparison (the default)")
    t.add_argument("--models", type=_models, metavar="llama1b,gpt2medium",
                   help=f"comma-separated, of {', '.join(train.MODELS)} (default: llama1b,gpt2medium; on the CPU "
                        "their tiny configs)")
    t.add_argument("--impls", type=_impls, metavar=",".join(train.IMPLS),
                   help="comma-separated, timed in this order (default: all of these; also coda_3gemm: the LM "
                        "head's three-GEMM backward; coda_half: its lm_head_recompute=\"half\"; compile_graphs, "
                        "coda_graphs: torch.compile(mode='reduce-overhead'), CUDA graphs, of the model and of the "
                        "patched model)")
    t.add_argument("--steps", type=int, help="timed steps per impl (default: 20 on the GPU, 2 on the CPU)")
    t.add_argument("--warmup-steps", type=int, help="untimed steps first, torch.compile's compilation among them "
                                                    "(default: 3 on the GPU, 1 on the CPU)")
    t.add_argument("--batch", type=int, help="sequences per step (default: 4 on the GPU, 2 on the CPU)")
    t.add_argument("--seq", type=int, help="tokens per sequence (default: 2048 on the GPU, 64 on the CPU)")
    t.add_argument("--max-seconds", type=float, help="per impl: no timed step starts after this many seconds "
                                                     "from its model's build (default: no limit)")
    t.add_argument("--budget-seconds", type=float, help="the whole run: no impl and no round starts after this "
                                                        "many seconds; impls left are reported as skipped, a round "
                                                        "under way finishes (default: no limit)")
    t.add_argument("--no-plot", action="store_true", help="no .png beside the results file")
    k = p.add_argument_group("the kernel-level benchmarks (--kernels; each flag below implies it)")
    k.add_argument("--kernels", action="store_true", help="run the kernel-level benchmarks instead")
    k.add_argument("--only", type=_sections, metavar="block|mlp|norm|llama|lm_head|fused_gemm|generate",
                   help="the cases to run, comma-separated (default: block)")
    k.add_argument("--tokens", type=_ints, help="comma-separated rows of every activation, one case each "
                                                "(default: 8192 on the GPU, 256 on the CPU; llama: 16384 at "
                                                "d 4096, 8192 at d 2048)")
    k.add_argument("--sweep-shapes", action="store_true", default=None,
                   help=f"the block at tokens {','.join(map(str, SWEEP_TOKENS))} x d {','.join(map(str, SWEEP_DIMS))}"
                        " (on the GPU; --tokens, --dims narrow it; not llama)")
    k.add_argument("--dims", type=_ints, help="comma-separated model widths d, ffn = 4d "
                                              "(default: 1024,2048,4096 on the GPU, 256 on the CPU; llama: "
                                              "4096 and 2048, each model's own ffn and heads)")
    k.add_argument("--dtype", choices=["bfloat16", "float16"],
                   help="on the GPU (the CPU runs float32); coda's norm kernels are bf16 only (default: bfloat16)")
    k.add_argument("--warmup-ms", type=float, help="do_bench's warm-up per timing (default: 25)")
    k.add_argument("--rep-ms", type=float, help="do_bench's timed window per timing (default: 100)")
    k.add_argument("--host-reps", type=int, help="steps the host time is the median of (default: 20)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    kernel_flags = [f"--{k.replace('_', '-')}" for k in KERNEL_DEFAULTS if getattr(args, k) is not None]
    train_flags = [f"--{k.replace('_', '-')}" for k in TRAIN_FLAGS if getattr(args, k) not in (None, False)]
    if args.kernels or kernel_flags:
        if train_flags:
            p.error(f"{', '.join(train_flags)} belong to the training comparison, "
                    f"{', '.join(kernel_flags or ['--kernels'])} to the kernel-level benchmarks: one or the other")
        for k, v in KERNEL_DEFAULTS.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        args.rounds = args.rounds or KERNEL_ROUNDS
        return kernels(args)
    return training(args)


def training(args: argparse.Namespace) -> int:
    """The training comparison (train.py): the GPU's models, or their tiny configs on the CPU."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"coda.bench: the training comparison needs transformers ({e}; pip install 'coda-epilogues[bench]'); "
              "--kernels runs the kernel-level benchmarks without it", file=sys.stderr)
        return 1
    gpu, why_not = gpu_here()
    defaults = TRAIN_GPU if gpu else TRAIN_CPU
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    models = args.models or list(TRAIN_MODELS)
    if gpu:
        device, dtype = "cuda", torch.bfloat16
        print(f"coda.bench on {torch.cuda.get_device_name()}: training {','.join(models)}, batch {args.batch} x "
              f"{args.seq} tokens, bf16 weights, fused AdamW, {args.warmup_steps} warm-up + {args.steps} timed steps "
              f"per impl in {len(train.round_sizes(args.steps, args.rounds))} rounds", flush=True)
    else:
        device, dtype = "cpu", torch.float32
        models = list(dict.fromkeys(train.TINY.get(m, m) for m in models))
        print(f"coda.bench: {why_not}; training tiny configs on the CPU instead ({','.join(models)}, batch "
              f"{args.batch} x {args.seq} tokens, float32, {args.warmup_steps} warm-up + {args.steps} timed steps "
              f"per impl).", flush=True)
    s = train.Settings(models=models, impls=args.impls or list(train.IMPLS), steps=args.steps,
                       warmup_steps=args.warmup_steps, batch=args.batch, seq=args.seq, device=device, dtype=dtype,
                       max_seconds=args.max_seconds or 0.0, budget_seconds=args.budget_seconds or 0.0,
                       rounds=args.rounds)
    if s.steps < 1 or s.warmup_steps < 0 or s.batch < 1 or s.seq < 2 or s.rounds < 1:
        print("coda.bench: --steps, --batch, --rounds must be at least 1, --seq 2, --warmup-steps 0", file=sys.stderr)
        return 2
    # both models: <date>-<device>-train-<commit>.json; a run of one (a call per model) names it
    kind = "train" if args.models in (None, list(TRAIN_MODELS)) else "train-" + "-".join(models)
    path = results.results_path(args.out, kind) if args.out else None

    def save(out: train.Outcome) -> None:
        if path:
            results.write_to(path, train.payload(s, out))

    out = train.run(s, after_impl=save)
    train.print_table(out)
    if path:
        save(out)
        print(f"wrote {path}")
        if not args.no_plot:
            from . import plot
            png = plot.plot_file(path)
            if png:
                print(f"wrote {png}")
    return 0


def kernels(args: argparse.Namespace) -> int:
    """The kernel-level benchmarks: the block, mlp, norm, llama, lm_head, fused_gemm and generate sections."""
    gpu, why_not = gpu_here()
    if gpu:
        device, dtype = "cuda", getattr(torch, args.dtype)
        tokens = args.tokens or (SWEEP_TOKENS if args.sweep_shapes else [8192])
        dims = args.dims or (SWEEP_DIMS if args.sweep_shapes else [1024, 2048, 4096])
        at = "" if len(args.only) == 1 and args.only[0] in OWN_POINTS else \
            f"tokens={','.join(map(str, tokens))} d={','.join(map(str, dims))} "
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

    head_points = lm_head.points(args.tokens, args.dims, gpu) if "lm_head" in args.only else []
    gemm_points = fused_gemm.points(args.tokens, gpu) if "fused_gemm" in args.only else []
    generate_points = generate.points(args.tokens, gpu) if "generate" in args.only else []

    r = Runner(gpu, args.warmup_ms, args.rep_ms, args.rounds, args.host_reps)
    kind = ("shapes" + (f"-t{'-'.join(map(str, tokens))}" if args.tokens else "")) if args.sweep_shapes else ""
    alone = len(args.only) == 1 and args.only[0] in OWN_POINTS
    if alone:
        kind = args.only[0]
    path = results.results_path(args.out, kind) if args.out else None
    shape = {} if alone else {"tokens": tokens, "dims": dims, "ffn": "4d"}
    if gemm_points:
        shape["fused_gemm"] = [{"tokens": t, "model": m, "seq": min(fused_gemm.SEQ, t)} for t, m in gemm_points]
    if generate_points:
        shape["generate"] = [{"batch": b, "model": m, "prompt": generate.PROMPT, "new_tokens": generate.NEW}
                             for b, m in generate_points]
    if head_points:
        shape["lm_head"] = [{"tokens": t, "d": d, "vocab": lm_head.vocab_of(t, d, gpu)} for t, d in head_points]
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
        pairs = {"llama": llama_points, "lm_head": head_points, "fused_gemm": gemm_points,
                 "generate": generate_points}.get(name)
        for t, ds in ([(t, [d]) for t, d in pairs] if pairs is not None else [(t, dims) for t in tokens]):
            SECTIONS[name](r, t, ds, dtype, device)
    table.print_table(r.results)
    if path:
        save()
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
