"""The SM clock and board power while one GEMM variant runs back to back.

    python benchmarks/power_probe.py --out DIR      # writes DIR/<date>-<device>-power.json

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

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Tuple

import torch

from coda._activations import GELU_TANH
from coda.bench import _commit, _configs, _device_slug, _tuned


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


def variants(m: int, d: int, f: int, configs: List[int] = (), raster: int = -1,
             swizzle: int = -1, store_l2: List[int] = (),
             swizzles: List[int] = (), alternate_k: List[int] = ()) -> Dict[str, Dict[str, Callable[[], object]]]:
    """{case: {impl: launch}}: the GEMM variants the probe runs, on fresh inputs
    (benchmarks/profile_kernel.py launches one of them for Nsight Compute).
    raster / swizzle (-1: the heuristic's) apply to the candidate configurations;
    each store_l2 value (bits: 1 D, 2 aux outputs marked L2 evict-first) and
    each of `swizzles` (the raster walk's band, in clusters) and of
    alternate_k (1: every other tile's k order reversed, as shipped; 0: never)
    adds the shipped kernels run with it."""
    torch.manual_seed(0)
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(f, d, device="cuda") * d**-0.5).to(torch.bfloat16)
    b1 = torch.randn(f, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w2 = (torch.randn(d, f, device="cuda") * f**-0.5).to(torch.bfloat16)
    h1 = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    cases: Dict[str, Dict[str, Callable[[], object]]] = {
        # fc1's forward: ping-pong as shipped, and the cooperative kernel (0)
        "fc1_fwd": {
            "cublas": lambda: torch.matmul(x, w1.t()),
            "coda[plain]": lambda: torch.ops.coda.gemm_linear(x, w1, None, None, 0, False),
            "coda[bias]": lambda: torch.ops.coda.gemm_linear(x, w1, b1, None, 0, False),
            "coda[gelu]": lambda: torch.ops.coda.gemm_linear(x, w1, b1, None, GELU_TANH, False),
            "coda[gelu,save_h]": lambda: torch.ops.coda.gemm_linear(x, w1, b1, None, GELU_TANH, True),
            "coda[c0,plain]": _tuned(lambda: torch.ops.coda.gemm_linear(x, w1, None, None, 0, False), config=0),
        },
        # fc2's dgrad (cooperative), plain, with GELU' and db1, and the parts
        # of that epilogue one by one (as the bench's breakdown)
        "fc2_dgrad": {
            "cublas": lambda: torch.matmul(dy, w2),
            "coda[dgrad]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, None, 0, False),
            "coda[dbias]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, None, 0, True),
            "coda[load_h+dbias]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, h1, 0, True),
            "coda[dgelu]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, h1, GELU_TANH, False),
            "coda[dgelu+dbias]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, h1, GELU_TANH, True),
        },
    }
    # Candidate configurations, forced through the tuning override; an op
    # not built in one would silently run its first configuration, so those
    # are left out.
    def tuned(fn, c):
        return _tuned(fn, config=c, raster=raster, swizzle=swizzle)

    for c in configs:
        if c in _configs("linear"):
            cases["fc1_fwd"][f"coda[c{c},plain]"] = tuned(
                lambda: torch.ops.coda.gemm_linear(x, w1, None, None, 0, False), c)
            cases["fc1_fwd"][f"coda[c{c},gelu,save_h]"] = tuned(
                lambda: torch.ops.coda.gemm_linear(x, w1, b1, None, GELU_TANH, True), c)
        if c in _configs("dgrad"):
            cases["fc2_dgrad"][f"coda[c{c},dgrad]"] = tuned(
                lambda: torch.ops.coda.gemm_dgrad(dy, w2, None, 0, False), c)
            cases["fc2_dgrad"][f"coda[c{c},dgelu+dbias]"] = tuned(
                lambda: torch.ops.coda.gemm_dgrad(dy, w2, h1, GELU_TANH, True), c)
    # The shipped kernels under one tuning override each, tagged in the impl.
    settings = ([(f"l2={v}", {"store_l2": v}) for v in store_l2] + [(f"s{v}", {"swizzle": v}) for v in swizzles]
                + [(f"alt={v}", {"alternate_k": v}) for v in alternate_k])
    for tag, tuning in settings:
        def under(fn, tuning=tuning):
            return _tuned(fn, **tuning)
        cases["fc1_fwd"][f"coda[plain,{tag}]"] = under(lambda: torch.ops.coda.gemm_linear(x, w1, None, None, 0, False))
        cases["fc1_fwd"][f"coda[gelu,save_h,{tag}]"] = under(
            lambda: torch.ops.coda.gemm_linear(x, w1, b1, None, GELU_TANH, True))
        cases["fc2_dgrad"][f"coda[dgrad,{tag}]"] = under(lambda: torch.ops.coda.gemm_dgrad(dy, w2, None, 0, False))
        cases["fc2_dgrad"][f"coda[dgelu+dbias,{tag}]"] = under(
            lambda: torch.ops.coda.gemm_dgrad(dy, w2, h1, GELU_TANH, True))
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--seconds", type=float, default=4.0, help="per phase, the first second dropped")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", default="",
                   help="comma-separated kernel configuration values (kernel_configs) to probe too, "
                        "each where the op is built in it (a sweep build has more)")
    p.add_argument("--raster", type=int, default=-1,
                   help="raster order of the --configs candidates (1 along M, 2 along N; -1 the heuristic's)")
    p.add_argument("--store-l2", default="", help="comma-separated Tuning::store_l2 values to probe too")
    p.add_argument("--swizzles", default="", help="comma-separated swizzles (1-8) to probe the shipped kernels with")
    p.add_argument("--alternate-k", default="", help="comma-separated Tuning::alternate_k values (0, 1) to probe too")
    p.add_argument("--out", help="write <date>-<device>-power.json into this folder")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("power_probe: needs an sm_90 GPU; nothing measured")
        return 0

    m, d, f = args.tokens, args.hidden, args.ffn
    configs = [int(v) for v in args.configs.split(",") if v]
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    found = variants(m, d, f, configs, raster=args.raster, store_l2=ints(args.store_l2), swizzles=ints(args.swizzles),
                     alternate_k=ints(args.alternate_k))
    cases = {f"power_{name}_{m}x{d}x{f}": impls for name, impls in found.items()}
    for impls in cases.values():
        for fn in impls.values():
            fn()
    torch.cuda.synchronize()

    sampler = Sampler()
    results = []
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
                    results.append(row)
                    print(f"  {case} {name:<18} round {r}: {ms:.3f} ms/launch, {clock:.0f} MHz, {power:.0f} W, "
                          f"{row['mcycles']:.3f} Mcycles, {row['joules']:.3f} J ({count} samples)", flush=True)
    finally:
        sampler.stop()

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        date = datetime.datetime.now(datetime.timezone.utc)
        path = os.path.join(args.out, f"{date:%Y-%m-%d}-{_device_slug(torch.cuda.get_device_name())}-power.json")
        with open(path, "w") as fh:
            json.dump({"commit": _commit(), "date": date.isoformat(timespec="seconds"),
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
                       "shape": {"tokens": m, "hidden": d, "ffn": f}, "timer": "cuda events over each phase",
                       "results": results}, fh, indent=1)
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
