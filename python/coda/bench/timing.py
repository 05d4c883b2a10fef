"""Timing: one timer per device, impls timed in turn, the host's time to enqueue a step.

On the GPU a timing is triton.testing.do_bench's median with p20 and p80 (it
clears the L2 before every run); without triton, CUDA events around each run
after the same flush. On the CPU, perf_counter.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

Step = Callable[[], object]


def why(e: BaseException) -> str:
    """An exception in one line, for a skipped impl."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def _gpu_time(fn: Step, warmup_ms: float, rep_ms: float) -> Tuple[float, float, float]:
    try:
        from triton.testing import do_bench  # imported here: `import coda.bench` never needs triton
    except ImportError:
        do_bench = None
    if do_bench is not None:
        med, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return med, p20, p80
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    deadline = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < deadline:
        fn()
    times = []
    for _ in range(max(5, int(rep_ms / estimate))):
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), q[1], q[7]


def timer(gpu: bool, warmup_ms: float, rep_ms: float, cpu_reps: int) -> str:
    """What a results file says its timings are."""
    if not gpu:
        return f"perf_counter, median of {cpu_reps} runs"
    try:
        import triton.testing  # noqa: F401
        return f"triton.testing.do_bench, warmup {warmup_ms:g} ms, rep {rep_ms:g} ms, L2 cleared per run"
    except ImportError:
        return f"CUDA events, warmup {warmup_ms:g} ms, rep {rep_ms:g} ms, L2 cleared per run"


def _cpu_time(fn: Step, reps: int = 5) -> Tuple[float, float, float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), max(times)


def host_ms(fn: Step, reps: int = 20, gpu: bool = True) -> float:
    """Median host time to enqueue one step, from an idle GPU: what a step costs the CPU,
    and the floor under its time wherever the GPU's share is smaller."""
    times = []
    for _ in range(reps):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    if gpu:
        torch.cuda.synchronize()
    return statistics.median(times)


def _tensors(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def rel_diff(out, ref) -> Optional[float]:
    """The largest ‖out − ref‖ / ‖ref‖ over the tensors of two results of the same shape; None if
    either has none (cuBLAS's GEMMs alone compute something else)."""
    a, b = _tensors(out), _tensors(ref)
    if not a or len(a) != len(b):
        return None
    return max(((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item() for x, y in zip(a, b))


def gpu_kernels(fn: Step, reps: int = 1, before: Optional[Step] = None) -> list:
    """The GPU kernels of `reps` calls of fn (each after `before`, e.g. an L2 flush, where given),
    as torch.profiler's events of the CUDA device in start order: .name, .time_range (us)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def kernel_timeline(fn: Step, calls: int = 5) -> Dict[str, object]:
    """The GPU kernels one call of fn launches, in order, with each one's time and the
    idle time before it (means over `calls` calls under the profiler): which tiles
    cuBLAS picked (its kernel names spell them out), and whether the GPU waits between
    a composite op's kernels. {"kernels": sorted names, "kernel_us": [[name, us, idle us], ...]}."""
    try:
        fn()
        events = [e for e in gpu_kernels(fn, calls) if e.time_range.elapsed_us() > 0]
        per_call = len(events) // calls if len(events) % calls == 0 else 0
        timeline = []
        for i in range(per_call):  # the same launches each call: average by position
            runs = [events[c * per_call + i] for c in range(calls)]
            idle = [e.time_range.start - events[c * per_call + i - 1].time_range.end
                    for c, e in enumerate(runs) if c * per_call + i > 0]
            timeline.append([events[i].name[:160], round(sum(e.time_range.elapsed_us() for e in runs) / calls, 1),
                             round(sum(idle) / max(len(idle), 1), 1)])
        return {"kernels": sorted({e.name for e in events}), "kernel_us": timeline}
    except Exception as e:  # a diagnosis, never a reason to stop
        return {"kernels": [f"profiler failed: {why(e)}"], "kernel_us": []}


class Runner:
    """Times steps and keeps the rows: {"case", "impl", "median_ms", "p20_ms", "p80_ms", ...}."""

    def __init__(self, gpu: bool, warmup_ms: float = 25, rep_ms: float = 100, rounds: int = 5,
                 host_reps: int = 20, cpu_reps: int = 3):
        self.gpu, self.warmup_ms, self.rep_ms, self.rounds = gpu, warmup_ms, rep_ms, rounds
        self.host_reps, self.cpu_reps = host_reps, cpu_reps
        self.results: List[Dict] = []
        self.skipped: List[Dict] = []
        # called after each timed case: a script rewrites its results file there, so that a
        # run cut short (the GPU machine's per-call limit) keeps what it timed
        self.after_case: Optional[Callable[[], None]] = None

    def measure(self, fn: Step) -> Tuple[float, float, float]:
        """(median, p20, p80) ms of fn."""
        if self.gpu:
            return _gpu_time(fn, self.warmup_ms, self.rep_ms)
        return _cpu_time(fn, self.cpu_reps)

    def skip(self, case: str, impl: str, reason: str) -> None:
        """An impl that does not run here is reported, not fatal; each reason printed once per run."""
        if all(s["reason"] != reason for s in self.skipped):
            print(f"  {case:<32} {impl:<14} skipped: {reason}", flush=True)
        self.skipped.append({"case": case, "impl": impl, "reason": reason})

    def interleaved(self, case: str, impls: Dict[str, Step], flops: Optional[float] = None,
                    reference: Optional[str] = None,
                    views: Optional[Dict[str, Callable[[object], object]]] = None) -> List[Dict]:
        """The impls timed in turn, `rounds` times over, each round starting one impl
        further along the list; median_ms is the median of the rounds' medians (p20_ms,
        p80_ms the medians of theirs), round_ms each round's, host_ms the time to
        enqueue one step. The clock drifts with temperature and power by up to 2%
        between two timings of one kernel, and a kernel timed after light ones reads
        faster: taking turns spreads both over all impls alike.

        Each impl runs once before any timing (torch.compile compiles there, outside
        the timed region); with `reference`, its result is compared with that impl's
        (rel_diff_to_<reference>), so that an impl computing something else shows;
        views[name], where given, first turns that impl's result into the reference's
        layout (coda's permuted weights), outside any timing."""
        live: Dict[str, Step] = {}
        diffs: Dict[str, float] = {}
        ref = None
        order = sorted(impls, key=lambda name: name != reference)  # the reference first
        for name in order:
            try:
                out = impls[name]()
                if self.gpu:
                    torch.cuda.synchronize()
            except Exception as e:
                self.skip(case, name, why(e))
                continue
            live[name] = impls[name]
            if reference is not None and name == reference:
                ref = out
            elif ref is not None and name != "cublas":  # the GEMMs alone compute something else
                if views and name in views:
                    out = views[name](out)
                d = rel_diff(out, ref)
                if d is not None:
                    diffs[name] = d
            del out
        del ref
        names = [n for n in impls if n in live]
        rounds: Dict[str, List[Tuple[float, float, float]]] = {n: [] for n in names}
        for i in range(self.rounds):
            k = i % max(len(names), 1)
            for name in names[k:] + names[:k]:
                if name not in live:
                    continue
                try:
                    rounds[name].append(self.measure(live[name]))
                except Exception as e:
                    self.skip(case, name, why(e))
                    del live[name]
        rows = []
        for name in names:
            if name not in live:
                continue
            t = rounds[name]
            row = {"case": case, "impl": name, "median_ms": statistics.median(r[0] for r in t),
                   "p20_ms": statistics.median(r[1] for r in t), "p80_ms": statistics.median(r[2] for r in t),
                   "round_ms": [round(r[0], 4) for r in t],
                   "host_ms": host_ms(live[name], self.host_reps, self.gpu)}
            if flops:
                row["tflops"] = flops / row["median_ms"] / 1e9
            if name in diffs:
                row[f"rel_diff_to_{reference}"] = diffs[name]
            rows.append(row)
            print(f"  {case:<32} {name:<14} {row['median_ms']:9.3f} ms  host {row['host_ms']:7.3f} ms  "
                  f"(rounds {', '.join(f'{r[0]:.3f}' for r in t)})", flush=True)
        self.results += rows
        if self.after_case is not None:
            self.after_case()
        return rows

    def time(self, case: str, impl: str, fn: Step, flops: Optional[float] = None, with_kernels: bool = False,
             **extra) -> Optional[Dict]:
        """fn alone (a kernel-level script's single timing); with_kernels also lists the
        kernels it launches (row["kernels"], row["kernel_us"])."""
        try:
            fn()
            med, p20, p80 = self.measure(fn)
        except Exception as e:
            self.skip(case, impl, why(e))
            return None
        row = {"case": case, "impl": impl, "median_ms": med, "p20_ms": p20, "p80_ms": p80, **extra}
        if flops:
            row["tflops"] = flops / med / 1e9
        self.results.append(row)
        print(f"  {case:<32} {impl:<14} {med:9.3f} ms" + (f"  {row['tflops']:7.1f} TFLOP/s" if flops else ""),
              flush=True)
        if with_kernels and self.gpu:
            row.update(kernel_timeline(fn))
            for name, us, idle in row["kernel_us"]:
                print(f"  {case:<32} {impl} {us:9.1f} us  (idle before {idle:7.1f} us)  {name[:100]}")
        return row

    def paired(self, case: str, impl: str, fn: Step, baseline: Step, flops: Optional[float] = None,
               rounds: int = 3, **extra) -> Optional[Dict]:
        """fn timed right after its baseline, `rounds` times over: each round's ratio
        compares two timings a second apart, so the clock's drift over a long sweep
        largely cancels (one cuBLAS GEMM read 3.020 and 3.282 ms in one sweep).
        The baseline is cuBLAS on the same GEMM; ratio_to_cublas is the median of the
        rounds' ratios."""
        if not self.gpu:
            return self.time(case, impl, fn, flops, **extra)
        try:
            fn()
            times, ratios = [], []
            for _ in range(rounds):
                floor = self.measure(baseline)[0]
                times.append(self.measure(fn)[0])
                ratios.append(times[-1] / floor)
        except Exception as e:
            self.skip(case, impl, why(e))
            return None
        med, ratio = statistics.median(times), statistics.median(ratios)
        row = {"case": case, "impl": impl, "median_ms": med, "ratio_to_cublas": ratio, "round_ratios": ratios,
               **extra}
        if flops:
            row["tflops"] = flops / med / 1e9
        self.results.append(row)
        print(f"  {case:<32} {impl:<14} {med:9.3f} ms  x{ratio:.3f} cuBLAS (rounds "
              f"{', '.join(f'{q:.3f}' for q in ratios)})", flush=True)
        return row
