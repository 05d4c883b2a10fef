"""Launch one GEMM variant of benchmarks/power_probe.py a few times, for Nsight Compute.

    python benchmarks/profile_kernel.py --list
    ncu --clock-control none --launch-skip 2 --launch-count 1 -k 'regex:device_kernel|nvjet' \
        python benchmarks/profile_kernel.py fc2_dgrad 'coda[c1,dgelu+dbias]' --configs 1

The first launches are warm-up (and the tuning override's first call); ncu
skips them. `tools/gpu_check.sh --profile` runs a list of variants this way.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from power_probe import variants  # noqa: E402


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", nargs="?", help="fc1_fwd or fc2_dgrad")
    p.add_argument("impl", nargs="?", help="an impl of that case, e.g. 'coda[dgelu+dbias]'")
    p.add_argument("--configs", default="", help="candidate configurations to add, as power_probe's --configs")
    p.add_argument("--raster", type=int, default=-1, help="for the candidate configurations (1: along M, 2: along N)")
    p.add_argument("--swizzle", type=int, default=-1)
    p.add_argument("--store-l2", default="", help="Tuning::store_l2 values whose variants to add, as power_probe's")
    p.add_argument("--swizzles", default="", help="swizzles whose variants to add, as power_probe's")
    p.add_argument("--alternate-k", default="", help="alternate_k values whose variants to add, as power_probe's")
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--list", action="store_true", help="print the case/impl pairs and exit")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("profile_kernel: needs an sm_90 GPU; nothing launched")
        return 0
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    cases = variants(args.tokens, args.hidden, args.ffn, ints(args.configs), args.raster, args.swizzle,
                     ints(args.store_l2), ints(args.swizzles), ints(args.alternate_k))
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
