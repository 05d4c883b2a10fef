"""Host time per call of each layer of coda's ops, next to torch's own ops:
shapes small enough that the GPU keeps up, so a call's wall time is what the
host spends on it (custom-op dispatch, the C++ op, the GEMM launch, the Python
wrapper, autograd).

    python benchmarks/host_overhead.py [--rows 256] [--d 1024] --out DIR

An experiment tool: what it finds goes to benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import coda
from coda import ops
from coda.bench import results


def per_call_us(fn, calls=200, repeats=7):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out.append(((t1 - t0) * 1e6 / calls, (t2 - t0) * 1e6 / calls))
    host = statistics.median(o[0] for o in out)
    wall = statistics.median(o[1] for o in out)
    return host, wall


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    m, d = a.rows, a.d
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, d, **bf)
    w = torch.randn(d, d, **bf) * d**-0.5
    w1, w2 = torch.randn(4 * d, d, **bf) * d**-0.5, torch.randn(d, 4 * d, **bf) * (4 * d) ** -0.5
    b, b1 = torch.randn(d, **bf), torch.randn(4 * d, **bf)
    g, beta = 1 + 0.1 * torch.randn(d, **bf), 0.1 * torch.randn(d, **bf)
    dy = torch.randn(m, d, **bf)
    h1 = torch.randn(m, 4 * d, **bf)
    C = torch.ops.coda
    st = C.row_stats(x, True, 1e-5)
    fw, fs, ft = C.fold_norm_weight(w1, g, beta, b1, True)
    cases = {
        "torch.mm": lambda: torch.mm(x, w.t()),
        "F.linear+bias": lambda: F.linear(x, w, b),
        "F.layer_norm": lambda: F.layer_norm(x, (d,), g, beta),
        "torch.empty": lambda: torch.empty(m, d, **bf),
        "C.device_supported (dispatch only)": lambda: C.device_supported(0),
        "C.row_stats (1 plain kernel)": lambda: C.row_stats(x, True, 1e-5),
        "C.fold_norm_weight": lambda: C.fold_norm_weight(w1, g, beta, b1, True),
        "C.linear (1 GEMM)": lambda: C.linear(x, w, b, None, 0, False),
        "C.linear gelu save": lambda: C.linear(x, w, b, None, 1, True),
        "C.linear_backward dx": lambda: C.linear_backward(dy, x, w, None, 0, [True, False, False]),
        "C.linear_backward dx,dw,db": lambda: C.linear_backward(dy, x, w, None, 0, [True, True, True]),
        "C.linear_backward dw": lambda: C.linear_backward(dy, x, w, None, 0, [False, True, False]),
        "torch.mm(dy.t(), x) (a wgrad)": lambda: torch.mm(dy.t(), x),
        "C.linear_residual": lambda: C.linear_residual(x, w, b, x, True, 1e-5),
        "C.norm_linear (stats+fold+GEMM)": lambda: C.norm_linear(x, g, beta, w1, b1, None, None, None, None, True,
                                                                 1e-5, 0, False),
        "C.norm_linear stats+folded given": lambda: C.norm_linear(x, g, beta, w1, b1, st, fw, fs, ft, True, 1e-5, 0,
                                                                  False),
        "C.norm_mlp": lambda: C.norm_mlp(x, g, beta, w1, b1, w2, b, st, None, None, None, x, False, True, 1e-5, 1,
                                         True, False),
        "C.norm_mlp_backward": lambda: C.norm_mlp_backward(dy, x, g, beta, w1, w2, h1, h1, st, fs, ft, False, True, 1,
                                                           [True] * 7),
        "ops.linear no_grad": lambda: ops.linear(x, w, b),
        "ops.layernorm_linear no_grad": lambda: ops.layernorm_linear(x, g, beta, w1, b1),
        "ops.linear_residual no_grad": lambda: ops.linear_residual(x, w, b, x),
        "ops.norm_mlp no_grad": lambda: ops.norm_mlp(x, g, beta, w1, b1, w2, b, residual=x, stats=None),
    }
    rows = []
    with torch.no_grad():
        for name, fn in cases.items():
            host, wall = per_call_us(fn)
            rows.append({"call": name, "host_us": round(host, 2), "wall_us": round(wall, 2)})
            print(f"{name:40s} host {host:8.2f} us/call   wall {wall:8.2f} us/call", flush=True)
    leaves = [t.detach().requires_grad_(True) for t in (x, g, beta, w1, b1)]

    def fwd_grad():
        return ops.layernorm_linear(*leaves)
    host, wall = per_call_us(fwd_grad)
    rows.append({"call": "ops.layernorm_linear with grad (forward)", "host_us": round(host, 2),
                 "wall_us": round(wall, 2)})
    print(f"{'ops.layernorm_linear with grad (fwd)':40s} host {host:8.2f} us/call   wall {wall:8.2f} us/call")
    results.write(a.out, "host_overhead", {"rows_m": m, "d": d, "rows": rows})


if __name__ == "__main__":
    main()
