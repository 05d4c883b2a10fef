"""Linear + bias + GELU under torch.compile's max-autotune (Inductor's Triton GEMM
templates, the persistent TMA ones too, into whose epilogue it can fuse the GELU),
against cuBLAS's GEMM alone and coda, so that the forward target (at most the GEMM
alone in cuBLAS) is also measured for an open fused implementation on the same GPU.

    python benchmarks/max_autotune.py --out DIR   # DIR/<date>-<device>-max-autotune-<commit>.json

The compiled impl's kernel names say whether a fused Triton template won.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import coda
import common
from coda.bench.timing import why


def linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def main(argv) -> int:
    args = common.parser(__doc__).parse_args(argv)
    if not common.gpu_or_say("max_autotune"):
        return 0
    r = common.runner(args)
    out = common.Results(args, "max-autotune", r)
    m, d, f = args.tokens, args.hidden, args.ffn
    x = torch.randn(m, d, device="cuda").to(torch.bfloat16)
    w = (torch.randn(f, d, device="cuda") * d**-0.5).to(torch.bfloat16)
    b = torch.randn(f, device="cuda").to(torch.bfloat16)
    options = {"max_autotune": True, "triton.cudagraphs": False, "triton.enable_persistent_tma_matmul": True,
               "max_autotune_gemm_backends": "ATEN,TRITON"}
    tuned = torch.compile(linear_gelu, options=options, dynamic=False)
    case, flops = f"linear_bias_gelu_fwd_{m}x{d}x{f}_max_autotune", 2.0 * m * d * f
    with torch.no_grad():
        t0 = time.perf_counter()
        try:
            tuned(x, w, b)
            torch.cuda.synchronize()
        except Exception as e:
            print(f"  {case}: max-autotune failed: {why(e)}")
            return 1
        print(f"  {case}: compiled and autotuned in {time.perf_counter() - t0:.0f} s", flush=True)
        impls = {"coda": lambda: coda.ops.linear(x, w, b, "gelu_tanh"), "cublas": lambda: torch.matmul(x, w.t()),
                 "compile": lambda: tuned(x, w, b)}
        r.time(case, "compile", impls["compile"], flops, with_kernels=True)
        r.paired(case + "_paired", "compile", impls["compile"], impls["cublas"], flops)
        r.paired(case + "_paired", "coda", impls["coda"], impls["cublas"], flops)
        r.interleaved(case, impls, flops)
    out.done()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
