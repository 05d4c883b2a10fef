"""Every fused GEMM of a training step against cuBLAS's plain GEMM of the same operands (`--only fused_gemm`).

For each model (llama1b at 8192 tokens, llama8b at 16,384, gpt2medium at 8192, in
sequences of 2048; --tokens sets the count for all three), a one-layer model of its
config is patched (coda.hf.patch) and takes one forward + backward with labels while a
dispatch mode keeps every torch.ops.coda call. Each call is then replayed once with
coda's launch log on (coda._kernels.recording_launches), which says what GEMMs it
launches: program, tile configuration, raster, swizzle, M, N, K, and the addresses,
leading dimensions and layouts of A and B. Whatever the patch runs is found this way;
nothing here lists the programs.

Cases fused_gemm_<model>_<program>_<pass>_<m>x<n>x<k>, one per distinct GEMM of the
layer (calls_per_layer: how often one layer runs it). Impls:
  coda    the fused kernel: its call replayed, timed by the kernel's own GPU duration
          (CUPTI, through torch.profiler), not the call's other kernels
  cublas  torch.matmul on views of the same bytes in the same layouts (operands "same";
          "random" where the kernel read a buffer of the op's own, e.g. a copy)
Both are timed by the same profiler, the L2 cleared before each rep (cuBLAS: every kernel of
the matmul, a split-K reduction included); the impls take turns,
--rounds rounds; median_ms is the median of the rounds' medians, tflops 2mnk over it,
ratio_to_cublas (on coda's row) the median of the rounds' ratios.
fused_gemm_<model>_layer_sum: per impl, Σ calls_per_layer x median_ms over the layer's
cases, the time a layer spends in fused GEMMs; a step runs it once per layer. coda's rows
also carry the kernel's mainloop stages and epilogue shared memory (_kernels.kernel_facts):
where an epilogue's bytes cost a stage, the mainloop has less to hide its loads behind.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from coda import _kernels

from . import train
from .timing import Runner, gpu_kernels, why

SEQ = 2048
TOKENS = {"llama1b": 8192, "llama8b": 16384, "gpt2medium": 8192}
# LLaMA-3-8B's layer (d 4096, ffn 14,336, 32 q / 8 kv heads of 128) and vocabulary; here for this section alone
LLAMA8B = train.ModelSpec("llama8b", "llama", dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
    max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001))


def spec_of(model: str) -> train.ModelSpec:
    return LLAMA8B if model == "llama8b" else train.MODELS[model]


def points(tokens: Optional[Sequence[int]], gpu: bool) -> List[Tuple[int, str]]:
    """(tokens, model) pairs: each model at its own count, or at each of --tokens (on the CPU too,
    where run() says why it times nothing)."""
    return [(t, m) for m in TOKENS for t in (tokens or [TOKENS[m]])]


# ---- recording a step's calls and their GEMMs

@dataclass
class Call:
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict

    def __call__(self):
        with torch.no_grad():  # the call as the step made it, below autograd: no graph node for a replay
            return self.op(*self.args, **self.kwargs)

    def tensors(self) -> List[torch.Tensor]:
        out: List[torch.Tensor] = []

        def walk(v):
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    walk(x)
        walk(self.args)
        walk(list(self.kwargs.values()))
        return out


def recorder():
    """A dispatch mode that keeps every torch.ops.coda call (`.calls`), the backward's included
    (autograd's threads take the mode along), and runs each as it came."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: List[Call] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "coda":
                self.calls.append(Call(func, args, kwargs))
            return func(*args, **kwargs)

    return Recorder()


def record_step(model: str, tokens: int, device: str = "cuda") -> List[Call]:
    """The coda calls of one forward + backward of a patched one-layer `model` on tokens // SEQ
    sequences of SEQ random tokens (the arguments are kept: a replay reads them)."""
    from transformers import AutoModelForCausalLM

    from coda import hf as coda_hf

    seq = min(SEQ, tokens)
    config = spec_of(model).build_config(seq)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16).train()
    coda_hf.patch(net)
    ids = torch.randint(0, config.vocab_size // 8, (tokens // seq, seq), device=device)
    rec = recorder()
    with rec:
        net(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    return rec.calls


def operand(tensors: Sequence[torch.Tensor], address: int, rows: int, cols: int, ld: int, layout: str,
            dtype: torch.dtype) -> Tuple[torch.Tensor, bool]:
    """The rows x cols operand a kernel read at `address` (leading dimension ld, "row" or "col"
    major) as a view of the call's tensor that holds it, and True; where none does (a buffer
    of the op's own), random values in the same layout, and False."""
    stride = (ld, 1) if layout == "row" else (1, ld)
    size = (rows, cols)
    extent = (rows - 1) * stride[0] + (cols - 1) * stride[1] + 1
    for t in tensors:
        if t.dtype != dtype or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        start, es = storage.data_ptr(), t.element_size()
        if start <= address and address + extent * es <= start + storage.nbytes() and (address - start) % es == 0:
            return t.as_strided(size, stride, (address - start) // es), True
    device = tensors[0].device if tensors else "cuda"
    base = torch.randn(extent, device=device).to(dtype)
    return base.as_strided(size, stride, 0), False


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Gemm:
    """One distinct GEMM of the layer: the call that launches it (position: which of its GEMMs)."""
    model: str
    call: Call
    position: int
    launch: Dict
    calls_per_layer: int = 1
    a: Optional[torch.Tensor] = None
    b: Optional[torch.Tensor] = None
    same_operands: bool = True

    @property
    def key(self) -> Tuple:
        l = self.launch
        return (self.call.op.name(), l["program"], l["config"], l["m"], l["n"], l["k"], l["a_layout"], l["b_layout"])

    @property
    def flops(self) -> float:
        return 2.0 * self.launch["m"] * self.launch["n"] * self.launch["k"]

    def case(self, passes: Dict[str, str]) -> str:
        l = self.launch
        return f"fused_gemm_{self.model}_{l['program']}_{passes.get(l['program'], '?')}_{l['m']}x{l['n']}x{l['k']}"


def gemms_of(model: str, calls: Sequence[Call]) -> List[Tuple[Call, List[Gemm]]]:
    """Each call that launches a fused GEMM, with its GEMMs (replayed once under the launch log);
    a GEMM met again (same op, program, configuration, shape and layouts) counts once more."""
    seen: Dict[Tuple, Gemm] = {}
    out: List[Tuple[Call, List[Gemm]]] = []
    for call in calls:
        with _kernels.recording_launches() as launches:
            call()
        torch.cuda.synchronize()
        fresh: List[Gemm] = []
        for i, l in enumerate(launches):
            g = Gemm(model, call, i, l)
            if g.key in seen:
                seen[g.key].calls_per_layer += 1
                continue
            seen[g.key] = g
            ts = call.tensors()
            dtype = DTYPES[l["dtype"]]
            g.a, same_a = operand(ts, l["a"], l["m"], l["k"], l["lda"], l["a_layout"], dtype)
            g.b, same_b = operand(ts, l["b"], l["k"], l["n"], l["ldb"], l["b_layout"], dtype)
            g.same_operands = same_a and same_b
            fresh.append(g)
        if fresh:
            out.append((call, fresh))
    return out


# ---- timing kernels by their own duration

def coda_gemm_kernel(name: str) -> bool:
    """Whether a kernel is one of coda's CUTLASS GEMMs (CUTLASS's entry point over coda's types)."""
    return ("cutlass::device_kernel" in name or "cutlass13device_kernel" in name) and "coda" in name


class KernelTimer:
    """Times the kernels a step launches, by their GPU durations under the profiler, each rep
    after an L2 flush. The flush (a bitwise not of 256 MB, a kernel no op here launches) also
    marks where each rep begins."""

    def __init__(self, rep_ms: float = 100, min_reps: int = 5, max_reps: int = 200):
        self.rep_ms, self.min_reps, self.max_reps = rep_ms, min_reps, max_reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.flush_names = {e.name for e in self._events(lambda: None, 1)}

    def _events(self, fn: Callable, reps: int):
        return gpu_kernels(fn, reps, before=self.flush.bitwise_not_)

    def reps_for(self, fn: Callable) -> int:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        each = max(start.elapsed_time(end) / 3, 1e-3)
        return int(min(self.max_reps, max(self.min_reps, self.rep_ms / each)))

    def per_rep(self, fn: Callable, reps: int) -> List[List]:
        """Each rep's kernels but the flush, in order; raises unless the flush began each of `reps` reps."""
        out: List[List] = []
        for e in self._events(fn, reps):
            if e.name in self.flush_names:
                out.append([])
            elif out:
                out[-1].append(e)
        if len(out) != reps:
            raise RuntimeError(f"found {len(out)} flushes in {reps} reps: the profiler lost the reps' boundaries")
        return out

    def durations(self, fn: Callable, reps: int, pick: Callable[[str], bool], per_rep: int) -> List[List[float]]:
        """[rep][i] ms: the i-th picked kernel of each rep; another count than per_rep in a rep raises."""
        out = []
        for kernels in self.per_rep(fn, reps):
            picked = [e for e in kernels if pick(e.name)]
            if len(picked) != per_rep:
                names = sorted({e.name[:80] for e in kernels})
                raise RuntimeError(f"expected {per_rep} picked kernel(s) per rep, found {len(picked)}: {names}")
            out.append([e.time_range.elapsed_us() / 1e3 for e in picked])
        return out

    def total(self, fn: Callable, reps: int) -> List[float]:
        """Each rep's kernels' summed durations, ms: a vendor GEMM of one kernel or of a split and its reduction."""
        return [sum(e.time_range.elapsed_us() for e in kernels) / 1e3 for kernels in self.per_rep(fn, reps)]


@dataclass
class _Timings:
    rounds: List[float] = field(default_factory=list)  # each round's median, ms
    all: List[float] = field(default_factory=list)     # every rep, ms
    kernels: List[str] = field(default_factory=list)


def time_call(r: Runner, kt: KernelTimer, call: Call, gemms: List[Gemm], passes: Dict[str, str],
              facts: Optional[Dict[str, Dict[str, int]]] = None) -> List[Dict]:
    """One call's fused GEMMs and each one's cuBLAS GEMM, in turn, r.rounds rounds; coda's rows carry
    the kernel's facts (stages, epilogue bytes: _kernels.kernel_facts) where given."""
    impls: Dict[str, Callable] = {"coda": call}
    for i, g in enumerate(gemms):
        impls[f"cublas{i}"] = (lambda a=g.a, b=g.b: torch.matmul(a, b))
    reps = {name: kt.reps_for(fn) for name, fn in impls.items()}
    per_call = len(_launches_of(call))
    got: Dict[str, List[_Timings]] = {name: [_Timings() for _ in gemms] for name in impls}
    names = list(impls)
    for rnd in range(r.rounds):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            if name == "coda":
                ds = kt.durations(call, reps[name], coda_gemm_kernel, per_call)
                for g_i, g in enumerate(gemms):
                    t = [d[g.position] for d in ds]
                    got[name][g_i].rounds.append(statistics.median(t))
                    got[name][g_i].all += t
            else:
                g_i = int(name[len("cublas"):])
                ds = kt.total(impls[name], reps[name])
                got[name][g_i].rounds.append(statistics.median(ds))
                got[name][g_i].all += ds
    rows = []
    for g_i, g in enumerate(gemms):
        case = g.case(passes)
        l = g.launch
        extra = {"program": l["program"], "pass": passes.get(l["program"]), "op": call.op.name(),
                 "m": l["m"], "n": l["n"], "k": l["k"], "a_layout": l["a_layout"], "b_layout": l["b_layout"],
                 "calls_per_layer": g.calls_per_layer, "operands": "same" if g.same_operands else "random"}
        pair = {}
        for impl, name in (("coda", "coda"), ("cublas", f"cublas{g_i}")):
            t = got[name][g_i]
            q = statistics.quantiles(t.all, n=10) if len(t.all) > 1 else [t.all[0]] * 9
            row = {"case": case, "impl": impl, "median_ms": statistics.median(t.rounds), "p20_ms": q[1],
                   "p80_ms": q[7], "round_ms": [round(v, 4) for v in t.rounds], "reps": reps[name],
                   "tflops": g.flops / statistics.median(t.rounds) / 1e9, **extra}
            if impl == "coda":
                row.update(config=l["config"], raster=l["raster"], swizzle=l["swizzle"])
                row.update((facts or {}).get(f"{l['program']}/{l['config']}/{l['dtype']}", {}))
            pair[impl] = row
        ratios = [c / v for c, v in zip(got["coda"][g_i].rounds, got[f"cublas{g_i}"][g_i].rounds)]
        pair["coda"]["ratio_to_cublas"] = statistics.median(ratios)
        pair["coda"]["round_ratios"] = [round(v, 4) for v in ratios]
        pair["cublas"]["kernels"] = _vendor_kernels(kt, impls[f"cublas{g_i}"])
        for row in pair.values():
            rows.append(row)
        c = pair["coda"]
        print(f"  {case:<56} coda {c['median_ms']:8.3f} ms  cublas {pair['cublas']['median_ms']:8.3f} ms  "
              f"x{c['ratio_to_cublas']:.3f}  {c['tflops']:6.1f} TFLOP/s  {c['config']}"
              + (f" ({c['stages']} stages, epilogue {c['epilogue_bytes'] // 1024} KB)" if "stages" in c else "")
              + ("" if g.same_operands else "  (random operands)"), flush=True)
    return rows


def _launches_of(call: Call) -> List[Dict]:
    with _kernels.recording_launches() as launches:
        call()
    torch.cuda.synchronize()
    return launches


def _vendor_kernels(kt: KernelTimer, fn: Callable) -> List[str]:
    return sorted({e.name[:120] for e in kt.per_rep(fn, 1)[0]})


def layer_sum(model: str, rows: Sequence[Dict]) -> List[Dict]:
    """Per impl, Σ calls_per_layer x median_ms over one model's fused_gemm cases."""
    prefix = f"fused_gemm_{model}_"
    mine = [row for row in rows if row["case"].startswith(prefix) and "calls_per_layer" in row]
    out = []
    for impl in ("coda", "cublas"):
        picked = [row for row in mine if row["impl"] == impl]
        if picked:
            out.append({"case": prefix + "layer_sum", "impl": impl, "gemms": len(picked),
                        "median_ms": sum(row["calls_per_layer"] * row["median_ms"] for row in picked)})
    if len(out) == 2:
        out[0]["ratio_to_cublas"] = out[0]["median_ms"] / out[1]["median_ms"]
    return out


def run(r: Runner, tokens: int, models: Sequence[str], dtype: torch.dtype, device: str) -> None:
    if not r.gpu:
        for model in models:
            r.skip(f"fused_gemm_{model}", "coda", "the fused GEMMs run on an sm_90 GPU only")
        return
    passes, facts = _kernels.programs(), _kernels.kernel_facts()
    kt = KernelTimer(rep_ms=r.rep_ms)
    for model in models:
        try:
            calls = record_step(model, tokens, device)
            found = gemms_of(model, calls)
        except Exception as e:
            r.skip(f"fused_gemm_{model}", "coda", why(e))
            continue
        print(f"  fused_gemm_{model}: {len(calls)} coda calls in a layer's step, "
              f"{sum(len(g) for _, g in found)} distinct fused GEMMs, {tokens} tokens", flush=True)
        rows: List[Dict] = []
        for call, gemms in found:
            try:
                rows += time_call(r, kt, call, gemms, passes, facts)
            except Exception as e:
                for g in gemms:
                    r.skip(g.case(passes), "coda", why(e))
        rows += layer_sum(model, rows)
        for row in rows:
            if row["case"].endswith("layer_sum") and row["impl"] == "coda":
                print(f"  {row['case']:<56} coda {row['median_ms']:8.3f} ms per layer  "
                      f"x{row.get('ratio_to_cublas', float('nan')):.3f} cuBLAS", flush=True)
        r.results += rows
        if r.after_case is not None:
            r.after_case()
        del calls, found
        torch.cuda.empty_cache()
