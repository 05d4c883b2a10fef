"""What each part of an epilogue costs: coda's kernels one at a time, with one part of
their epilogue or another, against cuBLAS on the same GEMM (QKV forward, dgrad and
wgrad with the norm folded, grouped-query RMSNorm -> QKV, o-proj, fc2's dgrad, fc1's
forward).

    python benchmarks/breakdown.py --out DIR    # DIR/<date>-<device>-breakdown-<commit>.json

Each case: every impl alone (cuBLAS with the kernels it launches), then the GEMMs in turn
with cuBLAS (`<case>_interleaved`: the differences are a few percent), and for the
norm's dgrad both raster orders.
"""

from __future__ import annotations

import sys

import common
import gemms

# no GEMM in these: not timed in turn with one
LIGHT = {"coda[row_stats]", "coda[fold]", "coda[row_dots]", "coda[row_dots+dbias]", "coda[bias_grad]"}


def main(argv) -> int:
    p = common.parser(__doc__)
    p.add_argument("--cases", help="comma-separated: only the cases whose names contain one of these "
                                   "(qkv, fc2_dgrad, fc1_fwd, ...)")
    args = p.parse_args(argv)
    if not common.gpu_or_say("breakdown"):
        return 0
    r = common.runner(args)
    out = common.Results(args, "breakdown", r)
    only = args.cases.split(",") if args.cases else None
    t = gemms.inputs(args.tokens, args.hidden, args.ffn)
    shape = f"{t.m}x{t.d}x{t.f}"
    for name, (flops, cublas, impls) in gemms.breakdown_cases(t).items():
        if only and not any(o in name for o in only):
            continue
        case = f"{name}_{shape}"
        r.time(case, "cublas", cublas, flops, with_kernels=True)
        for impl, fn in impls.items():
            r.time(case, impl, fn, flops, kernels=gemms.launched(fn))
        if "wgrad" not in name:
            r.interleaved(case + "_interleaved", {"cublas": cublas, **{k: v for k, v in impls.items()
                                                                      if k not in LIGHT}}, flops)
        if name == "qkv_dgrad":  # the raster order of the heaviest epilogue
            for raster in (1, 2):
                r.time(case, f"coda[row_dots+norm_dgrad,r{raster}]",
                       gemms.overridden(impls["coda[row_dots+norm_dgrad]"], raster=raster, swizzle=8), flops)
        out.save()
    out.done()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
