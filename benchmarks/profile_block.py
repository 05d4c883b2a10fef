"""Where one step of the GPT-style block spends its time, host and GPU: the
torch profiler's CPU ops and CUDA kernels per step, cProfile's Python
functions, and each op's host time alone, for coda and eager side by side.

    python benchmarks/profile_block.py --d 1024 2048 --tokens 2048 8192 --out DIR

Writes DIR/profile_block_t<tokens>_d<d>.txt (the tables; kernels in launch
order for the forward and the forward + backward) and a stamped JSON of the
totals. An experiment tool: what it finds goes to benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch

from coda.bench import blocks, results, steps
from coda.bench.timing import kernel_timeline


def host_ms_of(fn, reps=30):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def profile_step(fn, calls=5):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.time_range.elapsed_us() for e in kernels) / calls
    table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    table_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
    return {"gpu_kernel_us": gpu_us, "kernels_per_step": len(kernels) / calls}, table_cpu, table_gpu


def python_profile(fn, calls=20):
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
    return s.getvalue()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, nargs="+", default=[1024])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    rows = []
    for tokens in a.tokens:
        for d in a.d:
            rows += profile_point(tokens, d, a.out)
    results.write(a.out, "profile_block", {"tokens": a.tokens, "rows": rows})


def profile_point(tokens, d, out):
    rows = []
    args = blocks.inputs(tokens, d, torch.bfloat16, "cuda")
    grads = blocks.output_grads(tokens, d, torch.bfloat16, "cuda")
    text = io.StringIO()
    impls = {"coda": blocks.coda_block, "eager": blocks.eager_block}
    for name, block in impls.items():
        fwd = steps.forward(block, args)
        fb = steps.forward_backward(block, args, grads)
        row = {"tokens": tokens, "d": d, "impl": name, "host_fwd_ms": host_ms_of(fwd), "host_fwd_bwd_ms": host_ms_of(fb)}
        totals, cpu_t, gpu_t = profile_step(fb)
        row.update(totals)
        rows.append(row)
        print(row, flush=True)
        for step_name, fn in (("fwd", fwd), ("fwd_bwd", fb)):
            tl = kernel_timeline(fn)
            row[f"kernel_us_{step_name}"] = tl["kernel_us"]
            text.write(f"==== {name} t={tokens} d={d} {step_name}: {sum(us for _, us, _ in tl['kernel_us']):.1f} us "
                       f"of kernels\n---- kernels in launch order: us, idle before\n")
            for k, us, idle in tl["kernel_us"]:
                text.write(f"  {us:8.1f} {idle:8.1f}  {k[:150]}\n")
        text.write(f"---- CPU ops by self time (fwd+bwd)\n{cpu_t}\n"
                   f"---- CUDA kernels\n{gpu_t}\n---- Python (cProfile, 20 steps, by tottime)\n"
                   f"{python_profile(fb)}\n")
    with open(os.path.join(out, f"profile_block_t{tokens}_d{d}.txt"), "w") as f:
        f.write(text.getvalue())
    del args, grads
    return rows


if __name__ == "__main__":
    main()
