"""Launch one GEMM variant of benchmarks/power_probe.py a few times, for Nsight Compute.

    python benchmarks/profile_kernel.py --list
    ncu --clock-control none --launch-skip 2 --launch-count 1 -k 'regex:device_kernel|nvjet' \\
        python benchmarks/profile_kernel.py fc2_dgrad 'coda[c1,dgelu+dbias]' --configs 1

The first launches are warm-up; ncu skips them. `tools/gpu_check.sh --profile` runs a
list of variants this way.
"""

from __future__ import annotations

import sys

import torch

import common
from power_probe import variants


def main(argv) -> int:
    p = common.parser(__doc__, timed=False)
    p.add_argument("case", nargs="?", help="fc1_fwd or fc2_dgrad")
    p.add_argument("impl", nargs="?", help="an impl of that case, e.g. 'coda[dgelu+dbias]'")
    p.add_argument("--configs", default="", help="candidate configurations to add, as power_probe's --configs")
    p.add_argument("--raster", type=int, default=-1, help="for the candidate configurations (1: along M, 2: along N)")
    p.add_argument("--swizzle", type=int, default=-1, help="for the candidate configurations")
    p.add_argument("--swizzles", default="", help="swizzles whose variants to add, as power_probe's")
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--list", action="store_true", help="print the case/impl pairs and exit")
    args = p.parse_args(argv)
    if not common.gpu_or_say("profile_kernel"):
        return 0
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    cases = variants(args.tokens, args.hidden, args.ffn, ints(args.configs), args.raster, args.swizzle,
                     ints(args.swizzles))
    if args.list or not args.case:
        for case, impls in cases.items():
            for impl in impls:
                print(case, impl)
        return 0
    if args.case not in cases or args.impl not in cases[args.case]:
        print(f"profile_kernel: no variant {args.case} {args.impl!r}; --list names them", file=sys.stderr)
        return 2
    fn = cases[args.case][args.impl]
    for _ in range(args.launches):
        fn()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
