"""The SM clock and board power while one GEMM variant runs back to back.

    python benchmarks/power_probe.py --out DIR      # DIR/<date>-<device>-power-<commit>.json

Question it answers: is the cost of an epilogue's extra memory traffic (fc1's
forward storing H, +2-3% in every breakdown, not hidden by ping-pong, and no
cheaper stored without smem) paid in clock, because a GEMM at full tilt runs at
the GPU's power cap and the extra DRAM writes take power from the SMs? Each
variant runs alone for a few seconds, in turn with the others, while
nvidia-smi samples clocks.sm and power.draw; the first second of each phase
is dropped (the clock settles). Rows: median_ms per launch over the phase,
sm_clock_mhz and power_w the means of the phase's samples, mcycles and joules
per launch from them.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Tuple

import torch

import common
import gemms
from coda._activations import GELU_TANH
from coda.bench import results


class Sampler:
    """nvidia-smi's samples of (clocks.sm MHz, power.draw W), stamped on arrival."""

    def __init__(self, period_ms: int = 50):
        self.samples: List[Tuple[float, float, float]] = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"],
            stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                clock, power = (float(v) for v in line.split(",")[:2])
            except ValueError:
                continue
            self.samples.append((time.time(), clock, power))

    def mean(self, t0: float, t1: float) -> Tuple[float, float, int]:
        inside = [(c, p) for t, c, p in self.samples if t0 <= t <= t1]
        if not inside:
            return float("nan"), float("nan"), 0
        return sum(c for c, _ in inside) / len(inside), sum(p for _, p in inside) / len(inside), len(inside)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


# The variants the probe runs of each breakdown case (gemms.breakdown_cases)
PROBED = {
    "fc1_fwd": ("coda[plain]", "coda[bias]", "coda[gelu]", "coda[gelu,save_h]", "coda[c0,plain]"),
    "fc2_dgrad": ("coda[dgrad]", "coda[dbias]", "coda[dgelu+dbias]"),
}


def variants(m: int, d: int, f: int, configs: List[int] = (), raster: int = -1, swizzle: int = -1,
             swizzles: List[int] = ()) -> Dict[str, Dict[str, Callable[[], object]]]:
    """{case: {impl: launch}}: the GEMM variants the probe runs, on fresh inputs
    (benchmarks/profile_kernel.py launches one of them for Nsight Compute).
    `configs` adds candidate configurations (where the program is built in one),
    with raster / swizzle (-1: the rule's); each of `swizzles` (the raster walk's
    band, in clusters) adds the shipped kernels run with it."""
    t = gemms.inputs(m, d, f)
    found = gemms.breakdown_cases(t)
    cases = {name: {"cublas": found[name][1], **{impl: found[name][2][impl] for impl in impls}}
             for name, impls in PROBED.items()}
    fc1 = {"plain": gemms.linear(t.x, t.w1), "gelu,save_h": gemms.linear(t.x, t.w1, t.b1, None, GELU_TANH, True)}
    fc2 = {"dgrad": gemms.dgrad(t.dy, t.w2, t.a1), "dgelu+dbias": gemms.dgrad_dbias(t)}
    for c in configs:
        for case, kernels in (("fc1_fwd", fc1), ("fc2_dgrad", fc2)):
            for tag, (program, fn) in kernels.items():
                if c in gemms.configs(program):
                    cases[case][f"coda[c{c},{tag}]"] = gemms.overridden(fn, c, raster, swizzle)
    for s in swizzles:
        for case, kernels in (("fc1_fwd", fc1), ("fc2_dgrad", fc2)):
            for tag, (_, fn) in kernels.items():
                cases[case][f"coda[{tag},s{s}]"] = gemms.overridden(fn, swizzle=s)
    return cases


def run_phase(fn: Callable[[], object], seconds: float) -> Tuple[float, float, float]:
    """fn back to back for `seconds`; (start, end of the settled part, ms per launch there)."""
    start = time.time()
    settle = start + 1.0
    while time.time() < settle:
        fn()
        torch.cuda.synchronize()
    t0 = time.time()
    begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    n = 0
    while time.time() - t0 < seconds - 1.0:
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    finish.record()
    finish.synchronize()
    return t0, time.time(), begin.elapsed_time(finish) / n


def main(argv: List[str]) -> int:
    p = common.parser(__doc__, timed=False)
    p.add_argument("--seconds", type=float, default=4.0, help="per phase, the first second dropped")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", default="",
                   help="comma-separated configuration values (kernel_configs) to probe too, "
                        "each where the program is built in it")
    p.add_argument("--raster", type=int, default=-1,
                   help="raster order of the --configs candidates (1 along M, 2 along N; -1 the rule's)")
    p.add_argument("--swizzles", default="", help="comma-separated swizzles (1-8) to probe the shipped kernels with")
    args = p.parse_args(argv)
    if not common.gpu_or_say("power_probe"):
        return 0

    m, d, f = args.tokens, args.hidden, args.ffn
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    found = variants(m, d, f, ints(args.configs), raster=args.raster, swizzles=ints(args.swizzles))
    cases = {f"power_{name}_{m}x{d}x{f}": impls for name, impls in found.items()}
    for impls in cases.values():
        for fn in impls.values():
            fn()
    torch.cuda.synchronize()

    sampler = Sampler()
    rows = []
    try:
        for case, impls in cases.items():
            names = list(impls)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    t0, t1, ms = run_phase(impls[name], args.seconds)
                    clock, power, count = sampler.mean(t0, t1)
                    row = {"case": case, "impl": name, "round": r, "median_ms": ms, "sm_clock_mhz": clock,
                           "power_w": power, "samples": count, "mcycles": ms * clock / 1e3,
                           "joules": ms * power / 1e3, "tflops": 2.0 * m * d * f / ms / 1e9}
                    rows.append(row)
                    print(f"  {case} {name:<18} round {r}: {ms:.3f} ms/launch, {clock:.0f} MHz, {power:.0f} W, "
                          f"{row['mcycles']:.3f} Mcycles, {row['joules']:.3f} J ({count} samples)", flush=True)
    finally:
        sampler.stop()

    if args.out:
        path = results.write(args.out, "power", {
            "dtype": "bfloat16", "shape": {"tokens": m, "hidden": d, "ffn": f},
            "timer": "cuda events over each phase", "results": rows})
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
