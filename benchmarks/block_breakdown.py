"""Where a block step's GPU time goes, by kind of kernel, from a profile_block results file:

    python benchmarks/block_breakdown.py results/<date>-h200-profile_block-<commit>.json

Per (tokens, d, impl, step): the GEMMs (coda's CUTLASS kernels, cuBLAS's nvjet/cutlass
kernels), coda's small kernels (row statistics, weight fold, row dots, partial sums,
column sums), PyTorch's elementwise and norm kernels, and the GPU's idle time between
kernels (the host not keeping up). Prints a markdown table; reads only, writes nothing.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

KINDS = ("coda GEMM", "cuBLAS GEMM", "coda small", "torch other", "idle")


def kind(name: str) -> str:
    if name.startswith("_ZN7cutlass13device_kernel") and "N4coda" in name:
        return "coda GEMM"
    if name.startswith("nvjet") or "gemm" in name.lower() or "cutlass" in name.lower():
        return "cuBLAS GEMM"
    if "coda::kernels" in name:
        return "coda small"
    return "torch other"


def breakdown(timeline):
    """{kind: us} for one step's [[name, us, idle_before_us], ...]; the idle before the first
    kernel is the time to the first launch, left out."""
    out = defaultdict(float)
    for i, (name, us, idle) in enumerate(timeline):
        out[kind(name)] += us
        if i > 0:
            out["idle"] += idle
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    a = p.parse_args()
    d = json.load(open(a.results))
    print(f"{d.get('commit')} {d.get('device')} torch {d.get('torch')}, µs per step\n")
    print("| tokens × d | impl | step | " + " | ".join(KINDS) + " | kernels | host ms |")
    print("|---|---|---|" + "---|" * (len(KINDS) + 2))
    for row in d["rows"]:
        for step in ("fwd", "fwd_bwd"):
            tl = row.get(f"kernel_us_{step}") or (row.get("kernel_us") if step == "fwd_bwd" else None)
            if not tl:
                continue
            b = breakdown(tl)
            host = row.get(f"host_{step}_ms")
            print(f"| {row.get('tokens', d.get('tokens')):,} × {row['d']} | {row['impl']} | {step} | "
                  + " | ".join(f"{b.get(k, 0.0):.0f}" for k in KINDS)
                  + f" | {len(tl)} | {host:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
