"""coda's MLP (or GPT block) forward + backward under kernel overrides, timed in turn
with the library's own choices, cuBLAS's GEMMs alone and torch.compile.

    python benchmarks/variants.py --variant config=1 --variant raster=2,swizzle=4 --out DIR
                                  # DIR/<date>-<device>-variants-<commit>.json

A variant is key=value[,key=value] of coda._kernels.override_kernel's arguments
(config, raster, swizzle). It applies to every GEMM of the step, a configuration only
to the programs built in it: each row's `kernels` says what ran. For steady state, as in
a training loop (each impl run back to back before its window): --warmup-ms 800.
"""

from __future__ import annotations

import sys

import torch

import common
import gemms
from coda.bench import blocks, mlp, steps

KEYS = ("config", "raster", "swizzle")


def variant(spec: str) -> dict:
    override = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    unknown = set(override) - set(KEYS)
    if unknown:
        raise SystemExit(f"variants: unknown override keys {sorted(unknown)}; override_kernel takes {KEYS}")
    return override


def main(argv) -> int:
    p = common.parser(__doc__)
    p.add_argument("--case", choices=["mlp", "block"], default="mlp",
                   help="the MLP at --tokens x --hidden x --ffn, or the GPT block at --tokens, d = --hidden")
    p.add_argument("--variant", action="append", default=[], type=variant, help="repeatable")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if not common.gpu_or_say("variants"):
        return 0
    r = common.runner(args, args.rounds)
    out = common.Results(args, "variants", r)
    m, d, f, dtype = args.tokens, args.hidden, args.ffn, torch.bfloat16
    if args.case == "mlp":
        x, w1, b1, w2, b2 = leaves = steps.trainable(mlp.inputs(m, d, f, dtype, "cuda"))
        dy = steps.rand(m, d, dtype=dtype, device="cuda")
        case, flops = f"mlp_fwd_bwd_{m}x{d}x{f}", 12.0 * m * d * f
        fused, eager, cublas = mlp.coda_mlp, mlp.eager_mlp, mlp.cublas_fwd_bwd(x, w1, w2, dy)
    else:
        leaves = blocks.inputs(m, d, dtype, "cuda")
        dy = blocks.output_grads(m, d, dtype, "cuda")
        case, flops = f"gpt_block_fwd_bwd_t{m}_d{d}", blocks.gemm_flops(m, d, True)
        fused, eager, cublas = blocks.coda_block, blocks.eager_block, blocks.cublas_step(leaves, dy, True)
    coda_step = steps.forward_backward(fused, leaves, dy)
    impls = {"coda": coda_step, "cublas": cublas, "compile": steps.forward_backward(steps.compiled(eager), leaves, dy)}
    kernels = {"coda": gemms.launched(coda_step)}
    for override in args.variant:
        name = "coda[" + ",".join(f"{k}={v}" for k, v in override.items()) + "]"
        impls[name] = gemms.overridden(coda_step, **override)
        kernels[name] = gemms.launched(impls[name])
        print(f"  {name} runs {kernels[name]}")
    for row in r.interleaved(case, impls, flops):
        if row["impl"] in kernels:
            row["kernels"] = kernels[row["impl"]]
    out.done()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
