"""python -m coda.bench: coda's fused ops against their baselines, in one run.

Baselines, timed in the same process on the same inputs:
  cublas    the same GEMMs alone (torch.matmul): the floor a fused op is held to
  eager     the unfused PyTorch code
  cublaslt  torch._addmm_activation (cuBLASLt's bias+GELU epilogue), where it applies
  compile   torch.compile of the unfused code
  liger     Liger-Kernel's RMSNorm + torch.matmul (the RMSNorm cases, where installed)

Times are medians (p20, p80 alongside) from triton.testing.do_bench, which
clears the L2 before every run. `--out DIR` writes DIR/<date>-<device>.json.
On a machine without an sm_90 GPU it says so and times the reference path
on the CPU at a small size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import coda
from coda import _kernels, reference


def _commit() -> str:
    if os.environ.get("CODA_COMMIT"):
        return os.environ["CODA_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=here, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def _device_slug(device_name: str) -> str:
    """The device part of a results file's name: "NVIDIA H200" -> "h200"."""
    return device_name.lower().replace("nvidia ", "").replace(" ", "-")


def _time_gpu(fn: Callable[[], object], warmup_ms: int, rep_ms: int) -> Dict[str, float]:
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        med, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return {"median_ms": med, "p20_ms": p20, "p80_ms": p80}
    # Events, with the L2 cleared before each run, as do_bench does.
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return {"median_ms": times[len(times) // 2], "p20_ms": times[len(times) // 5], "p80_ms": times[4 * len(times) // 5]}


def _gpu_kernels(fn: Callable[[], object], calls: int = 5) -> Dict[str, object]:
    """The GPU kernels one call of fn launches, in order, with each one's
    time on the GPU and the idle time before it (means over `calls`
    back-to-back calls under the profiler): which tile, cluster and schedule
    cuBLAS picked (its kernel names spell them out), and where a composite
    op's time goes. {"kernels": sorted names, "kernel_us": [[name, us,
    idle us before it], ...] in launch order}. In the e5d924c run coda's MLP
    kernels summed to 18.4 ms against 19.8 ms timed, where cuBLAS's matched:
    the idle column is there to say whether the GPU waits between them."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                         and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
        names = sorted({e.name for e in events})
        per_call = len(events) // calls if calls and len(events) % calls == 0 else 0
        timeline = []
        for i in range(per_call):  # the same launches each call: average by position
            runs = [events[c * per_call + i] for c in range(calls)]
            us = sum(e.time_range.elapsed_us() for e in runs) / calls
            idle = [e.time_range.start - events[c * per_call + i - 1].time_range.end
                    for c, e in enumerate(runs) if c * per_call + i > 0]
            timeline.append([events[i].name[:160], round(us, 1), round(sum(idle) / max(len(idle), 1), 1)])
        return {"kernels": names, "kernel_us": timeline}
    except Exception as e:  # the profiler is a diagnosis, never a reason to stop
        return {"kernels": [f"profiler failed: {type(e).__name__}: {e}"], "kernel_us": []}


def _time_cpu(fn: Callable[[], object], reps: int = 5) -> Dict[str, float]:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median_ms": times[len(times) // 2], "p20_ms": times[0], "p80_ms": times[-1]}


class Runner:
    def __init__(self, gpu: bool, warmup_ms: int, rep_ms: int, rounds: int = 5, settle_ms: int = 0,
                 steady_rounds: int = 3):
        self.gpu, self.warmup_ms, self.rep_ms, self.rounds = gpu, warmup_ms, rep_ms, rounds
        self.settle_ms, self.steady_rounds = settle_ms, steady_rounds
        self.results: List[Dict] = []
        # Tuning overrides ({"alternate_k": 0}, ...) the MLP forward + backward
        # also runs under, as impls "coda[key=value,...]" in its interleaved timing.
        self.mlp_variants: List[Dict[str, int]] = []

    def time(self, case: str, impl: str, fn: Callable[[], object], flops: float, with_kernels: bool = False,
             **extra) -> Optional[Dict]:
        """with_kernels: also record the names of the kernels fn launches (row["kernels"])."""
        try:
            fn()  # compile / warm up outside the timed region
            t = _time_gpu(fn, self.warmup_ms, self.rep_ms) if self.gpu else _time_cpu(fn)
        except Exception as e:  # a baseline that does not apply here is reported, not fatal
            print(f"  {case:<28} {impl:<10} skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            return None
        row = {"case": case, "impl": impl, **t, "tflops": flops / t["median_ms"] / 1e9, **extra}
        self.results.append(row)
        print(f"  {case:<28} {impl:<10} {t['median_ms']:9.3f} ms  {row['tflops']:7.1f} TFLOP/s", flush=True)
        if with_kernels and self.gpu:
            row.update(_gpu_kernels(fn))
            print(f"  {case:<28} {impl} runs {', '.join(row['kernels'])}")
            for name, us, idle in row["kernel_us"]:
                print(f"  {case:<28} {impl} {us:9.1f} us  (idle before {idle:7.1f} us)  {name[:100]}")
        return row

    def paired(self, case: str, impl: str, fn: Callable[[], object], baseline: Callable[[], object], flops: float,
               rounds: int = 3, **extra) -> Optional[Dict]:
        """fn timed right after its baseline, `rounds` times over. Each round's
        ratio compares two timings a second apart, so the clock's drift over a
        sweep largely cancels (one cuBLAS GEMM timed 3.020 and 3.282 ms in the
        870930a sweep); ratio_to_cublas is the median of the rounds' ratios."""
        if not self.gpu:
            return self.time(case, impl, fn, flops, **extra)
        try:
            fn()
            times, ratios = [], []
            for _ in range(rounds):
                floor = _time_gpu(baseline, self.warmup_ms, self.rep_ms)["median_ms"]
                times.append(_time_gpu(fn, self.warmup_ms, self.rep_ms)["median_ms"])
                ratios.append(times[-1] / floor)
        except Exception as e:
            print(f"  {case:<28} {impl:<10} skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            return None
        med, ratio = sorted(times)[len(times) // 2], sorted(ratios)[len(ratios) // 2]
        row = {"case": case, "impl": impl, "median_ms": med, "ratio_to_cublas": ratio, "round_ratios": ratios,
               "tflops": flops / med / 1e9, **extra}
        self.results.append(row)
        print(f"  {case:<28} {impl:<10} {med:9.3f} ms  x{ratio:.3f} cuBLAS (rounds {', '.join(f'{q:.3f}' for q in ratios)})",
              flush=True)
        return row

    def interleaved(self, case: str, impls: Dict[str, Callable[[], object]], flops: float,
                    steady: bool = False) -> None:
        """The impls timed in turn, `self.rounds` times over: the GPU's clock drifts
        with its temperature and power over a run, by up to 2% between two
        timings of one kernel here, and alternating spreads that over all impls
        alike. Each round starts one impl further along the list, so that no
        impl always follows the same one (a kernel timed after light ones
        reads faster: the order effect in benchmarks/README.md). Rows are
        `<case>_interleaved`, median_ms the median of the rounds'.

        steady (with --settle-ms): also `<case>_steady` rows, where each impl
        runs back to back for settle_ms before its timed window, as it would
        in a training loop, so that no timing carries the power and clock
        state the previous impl left."""
        if not self.gpu:
            return
        self._in_turn(case + "_interleaved", impls, flops, self.warmup_ms, self.rounds)
        if steady and self.settle_ms > 0:
            self._in_turn(case + "_steady", impls, flops, self.settle_ms, self.steady_rounds)

    def _in_turn(self, case: str, impls: Dict[str, Callable[[], object]], flops: float, warmup_ms: int,
                 rounds: int) -> None:
        rows: Dict[str, List[float]] = {name: [] for name in impls}
        try:
            for fn in impls.values():
                fn()
            names = list(impls)
            for i in range(rounds):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    rows[name].append(_time_gpu(impls[name], warmup_ms, self.rep_ms)["median_ms"])
        except Exception as e:
            print(f"  {case:<28} skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            return
        for name, times in rows.items():
            med = sorted(times)[len(times) // 2]
            self.results.append({"case": case, "impl": name, "median_ms": med, "round_ms": times,
                                 "tflops": flops / med / 1e9})
            print(f"  {case:<28} {name:<10} {med:9.3f} ms  (rounds {', '.join(f'{t:.3f}' for t in times)})",
                  flush=True)


def _grads(fn, inputs, dy):
    return lambda: torch.autograd.grad(fn(*inputs), inputs, dy)


def _tuned(fn: Callable[[], object], config: int = -1, raster: int = -1, swizzle: int = -1,
           store_l2: int = -1, alternate_k: int = -1) -> Callable[[], object]:
    """fn with a tuning override (set_tuning: kernel_configs' values, -1 the heuristic's choice;
    store_l2: which epilogue stores are marked L2 evict-first, bits 1 D and 2 aux outputs;
    alternate_k: 1 to load every other tile's k-blocks last to first)."""
    def run():
        torch.ops.coda.set_tuning(config, raster, swizzle, store_l2, alternate_k)
        try:
            return fn()
        finally:
            torch.ops.coda.set_tuning(-1, -1, -1)
    return run


def _eager_linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def run_cases(r: Runner, m: int, d: int, f: int, dtype: torch.dtype, device: str) -> None:
    torch.manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    x, w1, b1 = rand(m, d), rand(f, d, scale=d**-0.5), rand(f)
    w2, b2, res = rand(d, f, scale=f**-0.5), rand(d), rand(m, d)
    gelu = "gelu_tanh"

    def eager_mlp(x, w1, b1, w2, b2):
        return reference.mlp_ref(x, w1, b1, w2, b2, gelu)

    compile_linear = torch.compile(_eager_linear_gelu)
    compile_mlp = torch.compile(eager_mlp)

    # --- linear + bias + GELU forward, fc1's shape
    case, fl = f"linear_bias_gelu_fwd_{m}x{d}x{f}", 2.0 * m * d * f
    with torch.no_grad():
        r.time(case, "coda", lambda: coda.ops.linear(x, w1, b1, gelu), fl)
        r.time(case, "cublas", lambda: torch.matmul(x, w1.t()), fl)
        r.time(case, "eager", lambda: _eager_linear_gelu(x, w1, b1), fl)
        r.time(case, "cublaslt", lambda: torch._addmm_activation(b1, x, w1.t(), use_gelu=True), fl)
        r.time(case, "compile", lambda: compile_linear(x, w1, b1), fl)
        r.interleaved(case, {"coda": lambda: coda.ops.linear(x, w1, b1, gelu), "cublas": lambda: torch.matmul(x, w1.t()),
                             "compile": lambda: compile_linear(x, w1, b1)}, fl, steady=True)
        if r.gpu:
            # training forward: also stores the pre-activation for the backward
            r.time(case + "_save_h", "coda", lambda: torch.ops.coda.linear(x, w1, b1, 1, True), fl)

    # --- MLP forward (inference)
    case, fl = f"mlp_fwd_{m}x{d}x{f}", 4.0 * m * d * f
    with torch.no_grad():
        r.time(case, "coda", lambda: coda.ops.mlp(x, w1, b1, w2, b2, gelu), fl)
        r.time(case, "cublas", lambda: torch.matmul(torch.matmul(x, w1.t()), w2.t()), fl)
        r.time(case, "eager", lambda: eager_mlp(x, w1, b1, w2, b2), fl)
        r.time(case, "compile", lambda: compile_mlp(x, w1, b1, w2, b2), fl)

    # --- MLP forward + backward (training step of the block)
    case, fl = f"mlp_fwd_bwd_{m}x{d}x{f}", 12.0 * m * d * f
    params = [t.detach().clone().requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    dy = rand(m, d)
    r.time(case, "coda", _grads(lambda *p: coda.ops.mlp(*p, activation=gelu), params, dy), fl, with_kernels=True)

    def six_gemms():
        a = torch.matmul(x, w1.t())
        torch.matmul(a, w2.t())
        torch.matmul(dy.t(), a)
        da = torch.matmul(dy, w2)
        torch.matmul(da.t(), x)
        torch.matmul(da, w1)

    r.time(case, "cublas", six_gemms, fl, with_kernels=True)
    r.time(case, "eager", _grads(eager_mlp, params, dy), fl)
    r.time(case, "compile", _grads(compile_mlp, params, dy), fl, with_kernels=True)
    coda_step = _grads(lambda *p: coda.ops.mlp(*p, activation=gelu), params, dy)
    variants = {"coda[" + ",".join(f"{k}={v}" for k, v in t.items()) + "]": _tuned(coda_step, **t)
                for t in r.mlp_variants}
    r.interleaved(case, {"coda": coda_step, "cublas": six_gemms, "compile": _grads(compile_mlp, params, dy),
                         **variants}, fl, steady=True)


def run_max_autotune_case(r: Runner, m: int, d: int, f: int, dtype: torch.dtype, device: str) -> None:
    """Linear + bias + GELU under torch.compile's max-autotune: Inductor's
    Triton GEMM templates (the persistent TMA ones too), into whose epilogue
    it can fuse the GELU, against cuBLAS and coda, so that the forward
    target (<= 1.00x the GEMM alone in cuBLAS) is also measured for an open
    fused implementation on the same GPU. impl "compile", case suffix
    _max_autotune; the kernel names say whether a fused Triton template won."""
    torch.manual_seed(0)
    x = torch.randn(m, d, device=device).to(dtype)
    w1 = (torch.randn(f, d, device=device) * d**-0.5).to(dtype)
    b1 = torch.randn(f, device=device).to(dtype)

    options = {"max_autotune": True, "triton.cudagraphs": False, "triton.enable_persistent_tma_matmul": True,
               "max_autotune_gemm_backends": "ATEN,TRITON"}
    tuned = torch.compile(_eager_linear_gelu, options=options, dynamic=False)
    case, fl = f"linear_bias_gelu_fwd_{m}x{d}x{f}_max_autotune", 2.0 * m * d * f
    with torch.no_grad():
        t0 = time.perf_counter()
        try:
            tuned(x, w1, b1)
            torch.cuda.synchronize()
        except Exception as e:
            print(f"  {case}: max-autotune failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            return
        print(f"  {case}: compiled and autotuned in {time.perf_counter() - t0:.0f} s", flush=True)
        compiled = lambda: tuned(x, w1, b1)  # noqa: E731
        fused = lambda: coda.ops.linear(x, w1, b1, "gelu_tanh")  # noqa: E731
        gemm = lambda: torch.matmul(x, w1.t())  # noqa: E731
        r.time(case, "compile", compiled, fl, with_kernels=True)
        r.time(case, "cublas", gemm, fl)
        r.paired(case + "_paired", "compile", compiled, gemm, fl)
        r.paired(case + "_paired", "coda", fused, gemm, fl)
        r.interleaved(case, {"coda": fused, "cublas": gemm, "compile": compiled}, fl, steady=True)


def _liger_rmsnorm():
    """Liger-Kernel's RMSNorm as a function (x, weight, eps), or None where it is not installed."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:  # not installed, or no triton
        return None
    return lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps)


def run_norm_cases(r: Runner, m: int, d: int, dtype: torch.dtype, device: str) -> None:
    """Issue 3's cases: norm -> QKV, o-proj + residual + stats, forward and forward + backward."""
    torch.manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    # a residual stream: rows whose means drift up to 10 std
    x = ((torch.rand(m, 1, device=device) * 2 - 1) * 10 + torch.randn(m, d, device=device)).to(dtype)
    gamma, beta = (1 + 0.2 * torch.randn(d, device=device)).to(dtype), (0.2 * torch.randn(d, device=device)).to(dtype)
    liger_rms = _liger_rmsnorm() if r.gpu else None

    def eager_ln_qkv(x, g, b, w, bias):
        return F.linear(F.layer_norm(x, (d,), g, b, 1e-5), w, bias)

    def eager_rms_qkv(x, g, w):
        return F.linear(F.rms_norm(x, (d,), g, 1e-6), w)

    def liger_rms_qkv(x, g, w):
        return F.linear(liger_rms(x, g, 1e-6), w)

    def eager_residual(a, w, bias, res):
        y = F.linear(a, w, bias) + res
        var, mean = torch.var_mean(y.float(), -1, correction=0)
        return y, mean, torch.rsqrt(var + 1e-5)

    compiled = {f: torch.compile(f) for f in (eager_ln_qkv, eager_rms_qkv, eager_residual)}

    for name, n, layernorm in (("layernorm_qkv_bias", 3 * d, True), ("rmsnorm_qkv", 3 * d // 2, False)):
        w = rand(n, d, scale=d**-0.5)
        bias = rand(n) if layernorm else None
        fl = 2.0 * m * d * n
        if layernorm:
            fused = lambda x, g, b, w, bias, stats=None: coda.ops.layernorm_linear(x, g, b, w, bias, stats=stats)  # noqa: E731
            eager, args = eager_ln_qkv, [x, gamma, beta, w, bias]
        else:
            fused = lambda x, g, w, stats=None: coda.ops.rmsnorm_linear(x, g, w, stats=stats)  # noqa: E731
            eager, args = eager_rms_qkv, [x, gamma, w]
        case = f"{name}_fwd_{m}x{d}x{n}"
        with torch.no_grad():
            r.time(case, "coda", lambda: fused(*args), fl)
            r.time(case, "cublas", lambda: torch.matmul(x, w.t()), fl)
            r.time(case, "eager", lambda: eager(*args), fl)
            r.time(case, "compile", lambda: compiled[eager](*args), fl)
            r.interleaved(case, {"coda": lambda: fused(*args), "cublas": lambda: torch.matmul(x, w.t()),
                                 "compile": lambda: compiled[eager](*args)}, fl, steady=True)
            if not layernorm and liger_rms is not None:
                r.time(case, "liger", lambda: liger_rms_qkv(*args), fl)
            if r.gpu:  # in a block the stats come from the residual-reduce before (no pass over x)
                stats = coda.ops.row_stats(x, "LayerNorm" if layernorm else "RMSNorm", 1e-5 if layernorm else 1e-6)
                r.time(case + "_given_stats", "coda", lambda: fused(*args, stats=stats), fl)
                r.time(case + "_given_stats", "cublas", lambda: torch.matmul(x, w.t()), fl)
            # the fold alone (W̃ = W∘γ, s, t): once per weight update, inside every forward above
            if r.gpu:
                r.time(case + "_fold_only", "coda", lambda: torch.ops.coda.norm_fold_weight(w, gamma, beta if layernorm else None, bias, True), fl)
        case = f"{name}_fwd_bwd_{m}x{d}x{n}"
        params = [t.detach().clone().requires_grad_(True) if t is not None else None for t in args]
        leaves = [t for t in params if t is not None]
        dy = rand(m, n)

        def grads(fn):
            return lambda: torch.autograd.grad(fn(*params), leaves, dy)

        def three_gemms():
            torch.matmul(x, w.t())
            torch.matmul(dy, w)
            torch.matmul(dy.t(), x)

        r.time(case, "coda", grads(fused), 3 * fl, with_kernels=True)
        r.time(case, "cublas", three_gemms, 3 * fl, with_kernels=True)
        r.time(case, "eager", grads(eager), 3 * fl)
        r.time(case, "compile", grads(compiled[eager]), 3 * fl, with_kernels=True)
        r.interleaved(case, {"coda": grads(fused), "cublas": three_gemms, "compile": grads(compiled[eager])}, 3 * fl,
                      steady=True)
        if not layernorm and liger_rms is not None:
            r.time(case, "liger", grads(liger_rms_qkv), 3 * fl)

    # o-proj + residual + the next LayerNorm's row statistics
    a, w_o, b_o = rand(m, d), rand(d, d, scale=d**-0.5), rand(d)
    fl = 2.0 * m * d * d
    case = f"oproj_residual_stats_fwd_{m}x{d}x{d}"
    with torch.no_grad():
        r.time(case, "coda", lambda: coda.ops.linear_residual(a, w_o, b_o, x), fl)
        r.time(case, "cublas", lambda: torch.matmul(a, w_o.t()), fl)
        r.time(case, "eager", lambda: eager_residual(a, w_o, b_o, x), fl)
        r.time(case, "compile", lambda: compiled[eager_residual](a, w_o, b_o, x), fl)
        r.interleaved(case, {"coda": lambda: coda.ops.linear_residual(a, w_o, b_o, x),
                             "cublas": lambda: torch.matmul(a, w_o.t()),
                             "compile": lambda: compiled[eager_residual](a, w_o, b_o, x)}, fl, steady=True)
    case = f"oproj_residual_stats_fwd_bwd_{m}x{d}x{d}"
    params = [t.detach().clone().requires_grad_(True) for t in (a, w_o, b_o, x)]
    dy = rand(m, d)
    r.time(case, "coda", lambda: torch.autograd.grad(coda.ops.linear_residual(*params)[0], params, dy), 3 * fl)
    r.time(case, "cublas", lambda: (torch.matmul(a, w_o.t()), torch.matmul(dy, w_o), torch.matmul(dy.t(), a)),
           3 * fl)
    r.time(case, "eager", lambda: torch.autograd.grad(eager_residual(*params)[0], params, dy), 3 * fl)
    r.time(case, "compile", lambda: torch.autograd.grad(compiled[eager_residual](*params)[0], params, dy), 3 * fl)


def run_norm_mlp_case(r: Runner, m: int, d: int, f: int, dtype: torch.dtype, device: str) -> None:
    """The pre-norm MLP block x + MLP(LayerNorm(x)), forward + backward."""
    torch.manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    x = ((torch.rand(m, 1, device=device) * 2 - 1) * 10 + torch.randn(m, d, device=device)).to(dtype)
    args = [x, (1 + 0.2 * torch.randn(d, device=device)).to(dtype), (0.2 * torch.randn(d, device=device)).to(dtype),
            rand(f, d, scale=d**-0.5), rand(f), rand(d, f, scale=f**-0.5), rand(d)]

    def eager(x, g, b, w1, b1, w2, b2):
        return reference.mlp_ref(F.layer_norm(x, (d,), g, b, 1e-5), w1, b1, w2, b2, "gelu_tanh", x)

    def fused(x, g, b, w1, b1, w2, b2):
        return coda.ops.norm_mlp(x, g, b, w1, b1, w2, b2, "LayerNorm", 1e-5, "gelu_tanh", residual=x)

    compiled = torch.compile(eager)
    params = [t.detach().clone().requires_grad_(True) for t in args]
    dy = rand(m, d)
    case, fl = f"layernorm_mlp_fwd_bwd_{m}x{d}x{f}", 12.0 * m * d * f
    w1, w2 = args[3], args[5]

    def six_gemms():
        h = torch.matmul(x, w1.t())
        torch.matmul(h, w2.t())
        torch.matmul(dy.t(), h)
        dh = torch.matmul(dy, w2)
        torch.matmul(dh.t(), x)
        torch.matmul(dh, w1)

    r.time(case, "coda", lambda: torch.autograd.grad(fused(*params), params, dy), fl)
    r.time(case, "cublas", six_gemms, fl)
    r.time(case, "eager", lambda: torch.autograd.grad(eager(*params), params, dy), fl)
    r.time(case, "compile", lambda: torch.autograd.grad(compiled(*params), params, dy), fl)
    r.interleaved(case, {"coda": lambda: torch.autograd.grad(fused(*params), params, dy), "cublas": six_gemms,
                         "compile": lambda: torch.autograd.grad(compiled(*params), params, dy)}, fl, steady=True)


def run_norm_breakdown(r: Runner, m: int, d: int, f: int, dtype: torch.dtype,
                       only: Optional[List[str]] = None) -> None:
    """Each kernel of the norm-folding ops alone, against cuBLAS on the same GEMM
    and against coda's plain kernel of the same shape: where the time goes.
    only: the cases whose names contain one of these (None: all)."""
    torch.manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda").to(dtype)

    n = 3 * d
    x, w, b = rand(m, d), rand(n, d) * d**-0.5, rand(n)
    g, beta = rand(d), rand(d)
    dp, h = rand(m, n), rand(m, n)
    mean, rstd = torch.ops.coda.norm_row_stats(x, True, 1e-5)
    folded, s, t = torch.ops.coda.norm_fold_weight(w, g, beta, b, True)
    c1, c2 = torch.randn(m, device="cuda"), torch.randn(m, device="cuda")
    n2, w2q, folded2, rstd2, t2 = _rms_qkv_problem(x, g)
    fl = 2.0 * m * d * n
    cases = {
        # name: (flops, cuBLAS, {impl: fn})
        f"qkv_fwd_{m}x{d}x{n}": (fl, lambda: torch.matmul(x, w.t()), {
            "coda[linear+bias]": lambda: torch.ops.coda.gemm_linear(x, w, b, None, 0, False),
            "coda[norm_linear]": lambda: torch.ops.coda.gemm_norm_linear(x, folded, mean, rstd, s, t, 0, False),
            "coda[row_stats]": lambda: torch.ops.coda.norm_row_stats(x, True, 1e-5),
            "coda[fold]": lambda: torch.ops.coda.norm_fold_weight(w, g, beta, b, True),
        }),
        f"qkv_dgrad_{m}x{n}x{d}": (fl, lambda: torch.matmul(dp, w), {
            "coda[dgrad]": lambda: torch.ops.coda.gemm_dgrad(dp, w, None, 0, False),
            "coda[norm_dgrad]": lambda: torch.ops.coda.gemm_norm_dgrad(dp, w, x, mean, rstd, g, beta, c1, c2, None,
                                                                       True, True),
            "coda[norm_dgrad,no_nhat]": lambda: torch.ops.coda.gemm_norm_dgrad(dp, w, x, mean, rstd, g, beta, c1,
                                                                               c2, None, False, True),
            "coda[norm_dgrad,no_dgamma]": lambda: torch.ops.coda.gemm_norm_dgrad(dp, w, x, mean, rstd, g, beta, c1,
                                                                                 c2, None, True, False),
            "coda[norm_dgrad,+dres]": lambda: torch.ops.coda.gemm_norm_dgrad(dp, w, x, mean, rstd, g, beta, c1, c2,
                                                                             x, True, True),
            "coda[row_dots]": lambda: torch.ops.coda.norm_row_dots(dp, h, 0, t, s, 1.0 / d, False),
            "coda[row_dots+dbias]": lambda: torch.ops.coda.norm_row_dots(dp, h, 0, t, s, 1.0 / d, True),
            "coda[bias_grad]": lambda: dp.sum(0, dtype=torch.float32),
        }),
        f"qkv_wgrad_{n}x{d}x{m}": (fl, lambda: torch.matmul(dp.t(), x), {
            "coda[wgrad]": lambda: torch.ops.coda.gemm_wgrad(dp, x),
        }),
        # RMSNorm -> QKV of grouped-query models (N = 3d/2): its own tile counts
        # and waves, which no sweep had timed.
        f"rms_qkv_fwd_{m}x{d}x{n2}": (2.0 * m * d * n2, lambda: torch.matmul(x, w2q.t()), {
            "coda[linear]": lambda: torch.ops.coda.gemm_linear(x, w2q, None, None, 0, False),
            "coda[norm_linear]": lambda: torch.ops.coda.gemm_norm_linear(x, folded2, None, rstd2, None, t2, 0, False),
        }),
        f"oproj_fwd_{m}x{d}x{d}": (2.0 * m * d * d, lambda: torch.matmul(x, w[:d].t()), {
            "coda[linear+bias+residual]": lambda: torch.ops.coda.gemm_linear(x, w[:d], b[:d], x, 0, False),
            "coda[linear_residual_stats]": lambda: torch.ops.coda.gemm_linear_residual(x, w[:d], b[:d], x, True,
                                                                                       1e-5),
        }),
    }
    dy, w2, h1 = rand(m, d), rand(d, f) * f**-0.5, rand(m, f)
    s1, t1 = torch.randn(f, device="cuda"), torch.randn(f, device="cuda")
    # What each part of fc2's dgrad epilogue costs (the cooperative kernel):
    # the bias gradient, the load of H, GELU' on it.
    cases[f"fc2_dgrad_{m}x{d}x{f}"] = (2.0 * m * d * f, lambda: torch.matmul(dy, w2), {
        "coda[dgrad]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, None, 0, False),
        "coda[dbias]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, None, 0, True),
        "coda[load_h+dbias]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, h1, 0, True),
        "coda[dgelu]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, h1, 1, False),
        "coda[dgelu+dbias]": lambda: torch.ops.coda.gemm_dgrad(dy, w2, h1, 1, True),
        "coda[dgelu+dbias+rowdot]": lambda: torch.ops.coda.gemm_dgrad_rowdot(dy, w2, h1, 1, True, t1, s1, 1.0 / d),
    })
    # The same for fc1's forward (ping-pong, which should hide its epilogue
    # behind the other warp group's mainloop), and the cooperative kernel (0).
    x1, w1, b1 = rand(m, d), rand(f, d) * d**-0.5, rand(f)
    cases[f"fc1_fwd_{m}x{d}x{f}"] = (2.0 * m * d * f, lambda: torch.matmul(x1, w1.t()), {
        "coda[plain]": lambda: torch.ops.coda.gemm_linear(x1, w1, None, None, 0, False),
        "coda[bias]": lambda: torch.ops.coda.gemm_linear(x1, w1, b1, None, 0, False),
        "coda[gelu]": lambda: torch.ops.coda.gemm_linear(x1, w1, b1, None, 1, False),
        "coda[gelu,save_h]": lambda: torch.ops.coda.gemm_linear(x1, w1, b1, None, 1, True),
        "coda[c0,plain]": _tuned(lambda: torch.ops.coda.gemm_linear(x1, w1, None, None, 0, False), config=0),
        "coda[c0,gelu,save_h]": _tuned(lambda: torch.ops.coda.gemm_linear(x1, w1, b1, None, 1, True), config=0),
    })
    for name, (flops, cublas, impls) in cases.items():
        if only and not any(o in name for o in only):
            continue
        r.time(name, "cublas", cublas, flops, with_kernels=True)
        for impl, fn in impls.items():
            r.time(name, impl, fn, flops)
        if "wgrad" not in name:  # the GEMMs in turn with cuBLAS: the differences are a few percent
            light = ("row_stats", "fold", "row_dots", "bias_grad")
            r.interleaved(name, {"cublas": cublas, **{k: v for k, v in impls.items()
                                                      if not any(f"[{l}" in k for l in light)}}, flops)
        if "dgrad" in name and "fc2" not in name:  # the raster order of the heavy epilogue
            for raster in (1, 2):
                r.time(name, f"coda[norm_dgrad,r{raster}]", _tuned(impls["coda[norm_dgrad]"], raster=raster, swizzle=8),
                       flops)


def _rms_qkv_problem(x: torch.Tensor, gamma: torch.Tensor):
    """RMSNorm -> QKV of grouped-query models on x (M, d): N = 3d/2, no bias.
    (N, weight, folded weight, rstd, shift) for gemm_linear / gemm_norm_linear."""
    d = x.shape[1]
    n = 3 * d // 2
    w = (torch.randn(n, d, device=x.device) * d**-0.5).to(x.dtype)
    _, rstd = torch.ops.coda.norm_row_stats(x, False, 1e-6)
    folded, _, shift = torch.ops.coda.norm_fold_weight(w, gamma, None, None, True)
    return n, w, folded, rstd, shift


def _configs(op: str) -> List[int]:
    """The configuration values an op is built in (a sweep build has more)."""
    return [int(item.split(":")[0]) for item in torch.ops.coda.kernel_configs(op).split(",")]


def run_sweep(r: Runner, m: int, d: int, f: int, dtype: torch.dtype, swizzles=(8,), rasters=(1, 2),
              after_case: Optional[Callable[[], None]] = None, cases: Optional[List[str]] = None,
              configs: Optional[List[int]] = None) -> None:
    """Every configuration built, raster order and swizzle on the MLP's and o-proj's GEMMs,
    each timed paired with cuBLAS on the same GEMM (Runner.paired).

    Each configuration's output is first compared with the default one's, so
    that a candidate which computes something else is reported, not timed.
    cases / configs, where given, keep the cases whose names contain one of
    the strings and the configuration values listed.
    """
    torch.manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(dtype)

    x, w1, b1 = rand(m, d), rand(f, d, scale=d**-0.5), rand(f)
    a1, w2, b2 = rand(m, f), rand(d, f, scale=f**-0.5), rand(d)
    dy, res, w_o = rand(m, d), rand(m, d), rand(d, d, scale=d**-0.5)
    w_qkv, b_qkv = rand(3 * d, d, scale=d**-0.5), rand(3 * d)
    lin, dgr, wgr, resid = _configs("linear"), _configs("dgrad"), _configs("wgrad"), _configs("linear_residual")
    fl = 2.0 * m * d * f
    gemms = {
        # name: (flops, configs, coda, cuBLAS alone)
        f"fc1_fwd_save_h_{m}x{d}x{f}": (fl, lin, lambda: torch.ops.coda.gemm_linear(x, w1, b1, None, 1, True),
                                        lambda: torch.matmul(x, w1.t())),
        f"fc1_fwd_{m}x{d}x{f}": (fl, lin, lambda: torch.ops.coda.gemm_linear(x, w1, b1, None, 1, False),
                                 lambda: torch.matmul(x, w1.t())),
        f"fc2_fwd_residual_{m}x{f}x{d}": (fl, lin, lambda: torch.ops.coda.gemm_linear(a1, w2, b2, dy, 0, False),
                                          lambda: torch.matmul(a1, w2.t())),
        f"fc2_dgrad_dgelu_dbias_{m}x{d}x{f}": (fl, dgr, lambda: torch.ops.coda.gemm_dgrad(dy, w2, a1, 1, True),
                                               lambda: torch.matmul(dy, w2)),
        f"fc2_dgrad_{m}x{d}x{f}": (fl, dgr, lambda: torch.ops.coda.gemm_dgrad(dy, w2, None, 0, False),
                                   lambda: torch.matmul(dy, w2)),
        f"fc1_dgrad_{m}x{f}x{d}": (fl, dgr, lambda: torch.ops.coda.gemm_dgrad(a1, w1, None, 0, False),
                                   lambda: torch.matmul(a1, w1)),
        f"fc2_wgrad_{d}x{f}x{m}": (fl, wgr, lambda: torch.ops.coda.gemm_wgrad(dy, a1), lambda: torch.matmul(dy.t(), a1)),
        f"fc1_wgrad_{f}x{d}x{m}": (fl, wgr, lambda: torch.ops.coda.gemm_wgrad(a1, x), lambda: torch.matmul(a1.t(), x)),
        f"qkv_fwd_bias_{m}x{d}x{3 * d}": (2.0 * m * d * 3 * d, lin,
                                         lambda: torch.ops.coda.gemm_linear(x, w_qkv, b_qkv, None, 0, False),
                                         lambda: torch.matmul(x, w_qkv.t())),
        f"oproj_fwd_residual_{m}x{d}x{d}": (2.0 * m * d * d, lin,
                                            lambda: torch.ops.coda.gemm_linear(x, w_o, b2, res, 0, False),
                                            lambda: torch.matmul(x, w_o.t())),
        f"oproj_dgrad_{m}x{d}x{d}": (2.0 * m * d * d, dgr, lambda: torch.ops.coda.gemm_dgrad(dy, w_o, None, 0, False),
                                     lambda: torch.matmul(dy, w_o)),
        f"oproj_residual_stats_{m}x{d}x{d}": (
            2.0 * m * d * d, resid, lambda: torch.ops.coda.gemm_linear_residual(x, w_o, b2, res, True, 1e-5),
            lambda: torch.matmul(x, w_o.t())),
    }

    # The norm's dgrad of the QKV shape (LayerNorm, every output on): the
    # heaviest epilogue, two loads and two stores beside D.
    n = 3 * d
    xq, wq, dp = rand(m, d), rand(n, d, scale=d**-0.5), rand(m, n)
    g, beta = (1 + 0.2 * torch.randn(d, device="cuda")).to(dtype), rand(d, scale=0.2)
    mean, rstd = torch.ops.coda.norm_row_stats(xq, True, 1e-5)
    c1, c2 = torch.randn(m, device="cuda"), torch.randn(m, device="cuda")
    # RMSNorm -> QKV with grouped-query attention's N = 3d/2, forward (norm
    # folded: rstd per row, no bias) and the plain GEMM of that shape; the
    # QKV weight's gradient.
    n2, w_q2, folded2, rstd2, t2 = _rms_qkv_problem(xq, g)
    gemms[f"rms_qkv_norm_linear_{m}x{d}x{n2}"] = (
        2.0 * m * d * n2, _configs("norm_linear"),
        lambda: torch.ops.coda.gemm_norm_linear(xq, folded2, None, rstd2, None, t2, 0, False),
        lambda: torch.matmul(xq, w_q2.t()))
    gemms[f"rms_qkv_fwd_{m}x{d}x{n2}"] = (2.0 * m * d * n2, lin,
                                         lambda: torch.ops.coda.gemm_linear(xq, w_q2, None, None, 0, False),
                                         lambda: torch.matmul(xq, w_q2.t()))
    gemms[f"qkv_wgrad_{n}x{d}x{m}"] = (2.0 * m * d * n, wgr, lambda: torch.ops.coda.gemm_wgrad(dp, xq),
                                      lambda: torch.matmul(dp.t(), xq))
    gemms[f"qkv_norm_dgrad_{m}x{n}x{d}"] = (
        2.0 * m * d * n, _configs("norm_dgrad"),
        lambda: torch.ops.coda.gemm_norm_dgrad(dp, wq, xq, mean, rstd, g, beta, c1, c2, None, True, True),
        lambda: torch.matmul(dp, wq))

    def first(out):
        return out[0] if isinstance(out, (tuple, list)) else out

    if cases:
        gemms = {name: v for name, v in gemms.items() if any(c in name for c in cases)}
    for name, (flops, built, fn, cublas) in gemms.items():
        r.time(name, "cublas", cublas, flops, with_kernels=True)
        torch.ops.coda.set_tuning(-1, -1, -1)
        ref = first(fn()).float()
        for config in (c for c in built if configs is None or c in configs):
            torch.ops.coda.set_tuning(config, -1, -1)
            try:
                diff = (first(fn()).float() - ref).norm().item() / ref.norm().item()
            except RuntimeError as e:
                diff = float("nan")
                print(f"  {name:<28} c{config}: {str(e).splitlines()[0][:160]}")
            if not diff < 1e-2:  # NaN too
                print(f"  {name:<28} c{config}: output differs from the default configuration's by {diff:.3g}; not timed")
                r.results.append({"case": name, "impl": f"coda[c{config}]", "error": f"relative difference {diff:.3g}"})
                continue
            for raster in rasters:
                for swizzle in swizzles:
                    torch.ops.coda.set_tuning(config, raster, swizzle)
                    r.paired(name, f"coda[c{config},r{raster},s{swizzle}]", fn, cublas, flops,
                             config=config, raster=raster, swizzle=swizzle, rel_diff_to_default=diff)
        torch.ops.coda.set_tuning(-1, -1, -1)
        r.paired(name, "coda[auto]", fn, cublas, flops)
        if after_case is not None:
            after_case()  # a hang in a later case (the machine's limit) keeps what was measured


def summarize(results: List[Dict]) -> None:
    print("\ncase                                   impl        median ms   x cuBLAS")
    floors = {row["case"]: row["median_ms"] for row in results if row["impl"] == "cublas"}
    for row in results:
        floor = floors.get(row["case"])
        if "ratio_to_cublas" in row:  # paired timing: its own ratio, not one against another moment's cuBLAS
            ratio = f"{row['ratio_to_cublas']:8.3f}"
        else:
            ratio = f"{row['median_ms'] / floor:8.3f}" if floor else "       -"
        print(f"{row['case']:<38} {row['impl']:<10} {row['median_ms']:10.3f} {ratio}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coda.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--sweep", action="store_true", help="also sweep kernel configurations per GEMM")
    p.add_argument("--only-sweep", action="store_true", help="run only the sweep")
    p.add_argument("--only", choices=["mlp", "norm", "breakdown", "headline"],
                   help="run only the MLP cases, only the norm cases (and the breakdown), only the norm ops' "
                        "per-kernel breakdown, or the MLP and norm cases without the breakdown")
    p.add_argument("--breakdown-cases", help="comma-separated: time only the breakdown cases whose names contain "
                                             "one of these (fc2_dgrad, fc1_fwd, qkv, ...)")
    p.add_argument("--swizzles", default="8", help="swizzle sizes the sweep tries")
    p.add_argument("--rasters", default="1,2", help="raster orders the sweep tries (1: along M, 2: along N)")
    p.add_argument("--sweep-cases", help="comma-separated: sweep only the GEMMs whose names contain one of these")
    p.add_argument("--sweep-configs", help="comma-separated configuration values: sweep only these")
    p.add_argument("--mlp-variant", action="append", default=[],
                   help="a tuning override (key=value[,key=value], set_tuning's names) the MLP forward + backward "
                        "also runs under in its interleaved timing; repeatable")
    p.add_argument("--max-autotune", action="store_true",
                   help="also time linear + bias + GELU under torch.compile's max-autotune (Triton templates "
                        "that can fuse the GELU), after the other cases")
    p.add_argument("--out", help="write <date>-<device>.json into this folder")
    p.add_argument("--warmup-ms", type=int, default=100)
    p.add_argument("--rep-ms", type=int, default=500)
    p.add_argument("--rounds", type=int, default=5, help="rounds of the interleaved timings")
    p.add_argument("--settle-ms", type=int, default=0,
                   help="also time the headline cases in steady state: each impl runs this long before its window")
    p.add_argument("--steady-rounds", type=int, default=3, help="rounds of the steady-state timings")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)

    gpu = torch.cuda.is_available() and _kernels.device_ok(torch.device("cuda"))
    if gpu:
        device_name = torch.cuda.get_device_name()
        m, d, f = args.tokens, args.hidden, args.ffn
        print(f"coda.bench on {device_name}: tokens={m} hidden={d} ffn={f} {args.dtype}")
    else:
        why = "no CUDA GPU" if not torch.cuda.is_available() else (
            f"coda's kernels do not run here ({_kernels.LOAD_ERROR or torch.cuda.get_device_name() + ' is not sm_90'})")
        device_name = "cpu"
        m, d, f = 256, 256, 1024
        print(f"coda.bench: {why}; timing the reference path on the CPU at tokens={m} hidden={d} ffn={f}.")
        dtype = torch.float32

    r = Runner(gpu, args.warmup_ms, args.rep_ms, args.rounds, args.settle_ms, args.steady_rounds)
    if gpu:
        r.mlp_variants = [{k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))} for spec in args.mlp_variant]
    device = "cuda" if gpu else "cpu"

    def write() -> None:
        if not args.out:
            return
        os.makedirs(args.out, exist_ok=True)
        date = datetime.datetime.now(datetime.timezone.utc)
        path = os.path.join(args.out, f"{date:%Y-%m-%d}-{_device_slug(device_name)}"
                                      f"{'-sweep' if args.only_sweep else ''}.json")
        doc = {
            "commit": _commit(),
            "date": date.isoformat(timespec="seconds"),
            "device": device_name,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "dtype": str(dtype).replace("torch.", ""),
            "shape": {"tokens": m, "hidden": d, "ffn": f},
            "timer": "triton.testing.do_bench median (L2 cleared per run)" if gpu else "perf_counter median",
            "results": r.results,
        }
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)
        print(f"wrote {path}")

    # The results file is rewritten after each section, so that a run cut
    # short (the GPU machine's per-call limit) still leaves what it timed.
    if not args.only_sweep:
        if args.only in (None, "mlp", "headline"):
            run_cases(r, m, d, f, dtype, device)
            write()
        if args.only in (None, "norm", "headline"):
            run_norm_cases(r, m, d, dtype, device)
            run_norm_mlp_case(r, m, d, f, dtype, device)
            write()
        if gpu and (args.only in (None, "norm", "breakdown") or args.breakdown_cases):
            run_norm_breakdown(r, m, d, f, dtype,
                               args.breakdown_cases.split(",") if args.breakdown_cases else None)
    if gpu and args.max_autotune and not args.only_sweep:
        run_max_autotune_case(r, m, d, f, dtype, device)
        write()
    if gpu and (args.sweep or args.only_sweep):
        run_sweep(r, m, d, f, dtype, tuple(int(s) for s in args.swizzles.split(",")),
                  rasters=tuple(int(s) for s in args.rasters.split(",")), after_case=write,
                  cases=args.sweep_cases.split(",") if args.sweep_cases else None,
                  configs=[int(c) for c in args.sweep_configs.split(",")] if args.sweep_configs else None)
    summarize(r.results)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
