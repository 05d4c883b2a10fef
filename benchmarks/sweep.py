"""Every kernel configuration built, raster order and swizzle on each GEMM of the MLP,
o-proj and QKV, each timed paired with cuBLAS on the same GEMM.

    python benchmarks/sweep.py --out DIR      # DIR/<date>-<device>-sweep-<commit>.json

The library's table builds its shipped kernels; candidates come from a build with
-DCODA_EXTRA_KERNELS="linear_act:kBFloat16:kPingpong128x128;..." (tools/gpu_check.sh
--sweep with EXTRA_KERNELS). Before a configuration is timed, the launch counters must
show the override reached it (one a program is not built in is ignored there) and its
output must match the rule's choice's; one that fails either is reported, not timed.
Rows: coda[c<config>,r<raster>,s<swizzle>] and coda[auto] (the rule), with
ratio_to_cublas, the median of 3 rounds' cuBLAS-then-candidate ratios; -1 for a
raster or swizzle leaves that choice to the rule.
"""

from __future__ import annotations

import sys

import common
import gemms
from coda import _kernels
from coda.bench.timing import rel_diff, why


def _ints(text):
    return [int(v) for v in text.split(",") if v]


def main(argv) -> int:
    p = common.parser(__doc__)
    p.add_argument("--swizzles", default="8", help="comma-separated swizzles to try")
    p.add_argument("--rasters", default="1,2", help="comma-separated raster orders to try (1: along M, 2: along N)")
    p.add_argument("--cases", help="comma-separated: only the GEMMs whose names contain one of these")
    p.add_argument("--configs", help="comma-separated configuration values: only these")
    args = p.parse_args(argv)
    if not common.gpu_or_say("sweep"):
        return 0
    r = common.runner(args)
    out = common.Results(args, f"sweep-t{args.tokens}-d{args.hidden}", r)
    only = args.cases.split(",") if args.cases else None
    wanted = _ints(args.configs) if args.configs else None
    t = gemms.inputs(args.tokens, args.hidden, args.ffn)
    for name, (flops, program, fn, cublas) in gemms.sweep_problems(t).items():
        if only and not any(c in name for c in only):
            continue
        r.time(name, "cublas", cublas, flops, with_kernels=True)
        ref = fn()
        for config, config_name in gemms.configs(program).items():
            if wanted is not None and config not in wanted:
                continue
            tuned = gemms.overridden(fn, config=config)
            try:
                ran = gemms.launched(tuned)
                diff = rel_diff(tuned(), ref)
            except RuntimeError as e:
                ran, diff = {}, float("nan")
                print(f"  {name:<32} c{config}: {why(e)}")
            key = f"{program}/{config_name}"
            if key not in ran:
                print(f"  {name:<32} c{config}: the override did not reach {key} (ran {ran}); not timed")
                r.results.append({"case": name, "impl": f"coda[c{config}]", "error": f"ran {ran}"})
                continue
            if not diff < 1e-2:  # NaN too
                print(f"  {name:<32} c{config}: output differs from the rule's choice's by {diff:.3g}; not timed")
                r.results.append({"case": name, "impl": f"coda[c{config}]", "error": f"relative difference {diff:.3g}"})
                continue
            for raster in _ints(args.rasters):
                for swizzle in _ints(args.swizzles):
                    # the override set around the timing, not inside the timed step: its host
                    # cost would otherwise count in kernels shorter than the host's enqueue
                    with _kernels.override_kernel(config=config, raster=raster, swizzle=swizzle):
                        r.paired(name, f"coda[c{config},r{raster},s{swizzle}]", fn, cublas, flops, config=config,
                                 config_name=config_name, raster=raster, swizzle=swizzle, rel_diff_to_default=diff)
        r.paired(name, "coda[auto]", fn, cublas, flops, kernels=gemms.launched(fn))
        del ref
        out.save()  # a candidate that hangs later leaves what was measured
    out.done()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
