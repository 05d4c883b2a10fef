"""The main job: train a Hugging Face model with each implementation, same weights, same data.

A LLaMA-3.2-1B-shaped LlamaForCausalLM (d 2048, ffn 8192, 16 layers, 32 q / 8 kv heads
of 64, vocab 128,256, RoPE θ 500,000, tied embeddings) and a GPT-2-medium-shaped
GPT2LMHeadModel (d 1024, 24 layers, 16 heads, vocab 50,257, no dropout), built from
their configs with random weights (nothing is downloaded), bf16 weights, fused AdamW,
batch 4 x 2048 tokens. Impls, each on a fresh model from the same seed:

  hf            the model as Hugging Face builds it (attn_implementation="sdpa")
  liger         Liger-Kernel's patch of that instance (apply_liger_kernel_to_llama: RMSNorm,
                RoPE, SwiGLU, fused linear cross-entropy); none exists for GPT-2
  compile       torch.compile(model)
  coda          coda.hf.patch(model)
  coda_compile  coda.hf.patch(model), then torch.compile

A step is the forward with labels (the model's own loss), backward, optimizer.step()
and zero_grad(set_to_none=True). The data are random tokens, the same batches for every
impl, drawn from the first eighth of the vocabulary (every id stays in the softmax), so
that the loss has somewhere to fall: from about ln(vocab) towards ln(vocab / 8).

The impls train side by side: each model's impls are built in turn (each while the ones
before it hold their weights and optimizer states), and the timed steps are split into
rounds of the impls in turn, each round starting one impl further along (a GPU's clock,
power and temperature drift over a minute: every impl gets its share of each state). In
the first round each impl runs the warm-up steps (torch.compile compiles there), untimed,
then its timed steps; each later round, one untimed step, then its timed steps. Each
timed step is timed by CUDA events around it (the host runs at most one step ahead, as a
loop that logs its loss does); median_ms is the median over all rounds' timed steps
(round_ms: each round's), tokens_per_s = batch·seq / median; peak_gib is
torch.cuda.max_memory_allocated over the first round's timed steps less what the other
impls' models held meanwhile (its own weights, gradients and optimizer states included);
the loss of every step, untimed ones included: every impl takes the same steps on the
same batches. --rounds 1 builds, times and frees one impl at a time. Without a GPU on
which coda's kernels run, a tiny LLaMA and GPT-2 train on the CPU in float32 for a couple
of steps, so that the command works everywhere.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .timing import why

IMPLS = ("hf", "liger", "compile", "coda", "coda_compile")
# on request only (--impls): coda with the LM head's three-GEMM backward (a float32 dW from the forward) and with
# its three-and-a-half-GEMM one (lm_head_recompute="half": half of dW's rows recomputed, no dW beyond the gradient); the
# model's forward and backward captured in CUDA graphs by torch.compile(mode="reduce-overhead"), unpatched and
# patched (where the host, not the GPU, bounds a step: small models)
EXTRA_IMPLS = ("coda_3gemm", "coda_half", "compile_graphs", "coda_graphs")
SEED = 0
LR = 3e-4
DATA_FRACTION = 8  # tokens are drawn from the first vocab // DATA_FRACTION ids


# family -> transformers' config class
CONFIGS = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "phi3": "Phi3Config", "gemma3": "Gemma3TextConfig",
           "gpt2": "GPT2Config"}


@dataclass(frozen=True)
class ModelSpec:
    name: str    # the case's model label
    family: str  # a key of CONFIGS
    config: Dict

    def build_config(self, seq: int):
        import transformers
        kw = dict(self.config, use_cache=False)
        cls = getattr(transformers, CONFIGS[self.family])
        if "rope_theta" in kw:
            theta = kw.pop("rope_theta")
            if "rope_parameters" in inspect.signature(cls.__init__).parameters:  # transformers 5
                kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
            else:
                kw["rope_theta"] = theta
        if "n_positions" in kw:
            kw["n_positions"] = max(kw["n_positions"], seq)
        return cls(**kw)


_LLAMA_IDS = dict(bos_token_id=128000, eos_token_id=128001)
MODELS: Dict[str, ModelSpec] = {
    # LLaMA-3.2-1B's config, without its llama3 RoPE scaling (default RoPE at θ 500,000)
    "llama1b": ModelSpec("llama1b", "llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True, **_LLAMA_IDS)),
    "gpt2medium": ModelSpec("gpt2medium", "gpt2", dict(
        vocab_size=50257, n_positions=2048, n_embd=1024, n_layer=24, n_head=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)),
    # on request (--models): the other families, at the shapes of their small checkpoints
    "gpt2small": ModelSpec("gpt2small", "gpt2", dict(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)),
    "qwen3_0.6b": ModelSpec("qwen3_0.6b", "qwen3", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645)),
    # Phi-3-mini's layer (d 3072, ffn 8192, 32 heads of 96) and vocabulary, 8 of its 32 layers: six impls' models,
    # gradients and AdamW states resident side by side fit on one 80 GB GPU
    "phi3mini_8l": ModelSpec("phi3mini_8l", "phi3", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, pad_token_id=32000)),
    # Gemma-3-1B: 5 local layers (window 512) to 1 global, head_dim 256, vocab 262,144
    "gemma3_1b": ModelSpec("gemma3_1b", "gemma3", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
        max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    "llama_tiny": ModelSpec("llama_tiny", "llama", dict(
        vocab_size=2048, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
        max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2)),
    "gpt2_tiny": ModelSpec("gpt2_tiny", "gpt2", dict(
        vocab_size=2048, n_positions=256, n_embd=128, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
    "qwen3_tiny": ModelSpec("qwen3_tiny", "qwen3", dict(
        vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=1000000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
    "phi3_tiny": ModelSpec("phi3_tiny", "phi3", dict(
        vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "gemma3_tiny": ModelSpec("gemma3_tiny", "gemma3", dict(
        vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=4096, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)),
}
# what the CPU trains instead
TINY = {"llama1b": "llama_tiny", "gpt2medium": "gpt2_tiny", "gpt2small": "gpt2_tiny", "qwen3_0.6b": "qwen3_tiny",
        "phi3mini_8l": "phi3_tiny", "gemma3_1b": "gemma3_tiny"}


@dataclass
class Settings:
    models: Sequence[str]
    impls: Sequence[str]
    steps: int
    warmup_steps: int
    batch: int
    seq: int
    device: str
    dtype: torch.dtype
    max_seconds: float = 0.0     # per impl: no timed step starts past it (0: no limit)
    budget_seconds: float = 0.0  # the whole run: no impl and no round starts past it (0: no limit)
    rounds: int = 1              # the timed steps split over this many rounds of the impls in turn
    lr: float = LR
    seed: int = SEED

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


def case_name(model: str, batch: int, seq: int) -> str:
    return f"train_step_{model}_b{batch}_s{seq}"


# ---- the impls: each takes the built model (its weights in their final dtype and device), returns the one to train

class Skip(Exception):
    """An impl that does not apply here (not installed, no patch for this model): reported, not failed."""


def _compile(model, **options):
    return torch.compile(model, **options)  # the run resets dynamo between models, not between impls side by side


def _coda_patch(model, **options):
    try:
        from coda import hf as coda_hf
    except ImportError as e:
        raise Skip(f"coda.hf is not importable ({why(e)})") from None
    patched = coda_hf.patch(model, **options)
    return model if patched is None else patched


class _LigerGlobals:
    """Liger's apply_liger_kernel_to_<family> rebinds the family's modeling module's globals
    (modeling_llama, modeling_qwen3, ...): the classes later builds take (RMSNorm, MLP) and
    apply_rotary_pos_emb, which every model of the family calls at run time, and the causal
    LM's forward. Kept both ways: the originals back for the impls built and trained beside
    it, Liger's swapped in while its own model trains (`patched()`)."""

    def __init__(self, module, lm: str = "LlamaForCausalLM"):
        self.module, self.saved, self.lm = module, dict(vars(module)), lm
        self.forward = getattr(module, lm).forward
        self.patch: Dict[str, object] = {}
        self.patch_forward = self.forward

    def keep(self):
        """Records what the patch changed (call once it has run)."""
        self.patch = {k: v for k, v in vars(self.module).items() if self.saved.get(k, _MISSING) is not v}
        self.patch_forward = getattr(self.module, self.lm).forward

    def restore(self):
        for name, value in self.saved.items():
            if vars(self.module).get(name, value) is not value:
                setattr(self.module, name, value)
        getattr(self.module, self.lm).forward = self.forward

    @contextlib.contextmanager
    def patched(self):
        for name, value in self.patch.items():
            setattr(self.module, name, value)
        getattr(self.module, self.lm).forward = self.patch_forward
        try:
            yield
        finally:
            self.restore()


_MISSING = object()
_liger_globals: List[_LigerGlobals] = []  # the latest build's, taken by its Trainer


def _liger(model):
    if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
        raise Skip("Liger-Kernel's Triton kernels need a CUDA GPU")
    try:
        from liger_kernel.transformers import monkey_patch
    except Exception as e:  # not installed, or no triton
        raise Skip(f"liger_kernel is not importable ({why(e)})") from None
    model_type = model.config.model_type
    apply = getattr(monkey_patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", {}).get(model_type)
    if apply is None:
        raise Skip(f"Liger-Kernel has no patch for {model_type}")
    cls = type(model)
    _liger_globals.append(_LigerGlobals(sys.modules[cls.__module__], cls.__name__))
    try:
        apply(model=model)  # its defaults: RoPE, RMSNorm, SwiGLU, fused linear cross-entropy
    finally:
        for g in _liger_globals:
            g.keep()
            g.restore()
    return model


def _take_globals() -> List[_LigerGlobals]:
    taken = list(_liger_globals)
    _liger_globals.clear()
    return taken


IMPL_FNS: Dict[str, Callable] = {
    "hf": lambda m: m,
    "liger": _liger,
    "compile": _compile,
    "coda": _coda_patch,
    "coda_compile": lambda m: _compile(_coda_patch(m)),
    "coda_3gemm": lambda m: _coda_patch(m, lm_head_recompute=False),
    "coda_half": lambda m: _coda_patch(m, lm_head_recompute="half"),
    "compile_graphs": lambda m: _compile(m, mode="reduce-overhead"),
    "coda_graphs": lambda m: _compile(_coda_patch(m), mode="reduce-overhead"),
}


# ---- building, data, one impl's training

def build(spec: ModelSpec, s: Settings):
    """A fresh model from the seed: the same initial weights for every impl."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(s.seed)
    with torch.device(s.device):
        model = AutoModelForCausalLM.from_config(spec.build_config(s.seq), attn_implementation="sdpa")
    return model.to(s.dtype).train()


def round_sizes(steps: int, rounds: int) -> List[int]:
    """The timed steps of each round: `steps` as evenly as they go over at most `rounds` rounds."""
    r = max(1, min(rounds, steps))
    return [steps // r + (1 if i < steps % r else 0) for i in range(r)]


def batches(vocab: int, s: Settings) -> List[torch.Tensor]:
    """Every step's (batch, seq) token ids (warm-up, timed, one untimed step per later round),
    from their own generator: the same for every impl."""
    g = torch.Generator().manual_seed(s.seed + 1)
    high = max(vocab // DATA_FRACTION, 2)
    n = s.warmup_steps + s.steps + len(round_sizes(s.steps, s.rounds)) - 1
    return [torch.randint(0, high, (s.batch, s.seq), generator=g).to(s.device) for _ in range(n)]


class Progress:
    """tqdm where importable, else one line rewritten in place."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        try:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="step", leave=False, file=sys.stderr,
                            mininterval=0.5, dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.t0 = time.perf_counter()

    def update(self, loss: Optional[float], phase: str) -> None:
        self.n += 1
        post = f"{phase}" + (f" loss {loss:.4f}" if loss is not None else "")
        if self.bar is not None:
            self.bar.set_postfix_str(post, refresh=False)
            self.bar.update(1)
        else:
            print(f"\r  {self.desc}: {self.n}/{self.total} steps, {time.perf_counter() - self.t0:.1f} s, {post}   ",
                  end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(file=sys.stderr, flush=True)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Trainer:
    """One impl on one model, kept from round to round: the model, its optimizer, the next batch,
    the losses and each round's step times. Built while the impls before it hold their models
    (weights and optimizer states): its peak memory is counted above what they held."""

    def __init__(self, spec: ModelSpec, impl: str, data: List[torch.Tensor], s: Settings,
                 bar: Optional[Progress] = None):
        self.spec, self.impl, self.data, self.s, self.bar = spec, impl, data, s, bar
        self.base = torch.cuda.memory_allocated() if s.gpu else 0
        t0 = time.perf_counter()
        try:
            model = IMPL_FNS[impl](build(spec, s))
        finally:
            self.globals = _take_globals()  # Liger's module globals, swapped in while this one trains
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=s.lr, fused=s.gpu)
        self.setup_s = time.perf_counter() - t0
        self.own_s = self.setup_s  # its setup and steps, summed over the rounds (for --max-seconds)
        self.warmup_s = self.timed_s = 0.0
        self.next = 0
        self.losses: List[float] = []
        self.rounds: List[List[float]] = []  # the timed steps' times (ms), per round
        self.peak_gib: Optional[float] = None

    def past_limit(self, extra_s: float = 0.0) -> bool:
        """Past --max-seconds (its own time, plus extra_s not yet counted): no more timed steps."""
        return bool(self.s.max_seconds) and self.own_s + extra_s > self.s.max_seconds

    @contextlib.contextmanager
    def scope(self):
        """While this impl trains: the module globals its patch set (Liger's), the originals after."""
        with contextlib.ExitStack() as stack:
            for g in self.globals:
                stack.enter_context(g.patched())
            yield

    def step(self) -> torch.Tensor:
        """One training step on the next batch (inside scope()); its loss, not read."""
        ids = self.data[self.next]
        self.next += 1
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def train(self, untimed: int, timed: int, last: bool) -> None:
        """`untimed` steps (the warm-up in the first round, where torch.compile compiles; one in each
        later round), then `timed` steps, each timed by CUDA events around it (the host runs at most
        one step ahead, as a loop that logs its loss does). The first round also takes the peak
        memory of its timed steps."""
        t0 = time.perf_counter()
        first = not self.rounds
        phase = "warm-up" if first else "untimed"
        with self.scope():
            for _ in range(untimed):
                self.losses.append(self.step().item())
                self._progress(f"{self.impl} {phase}")
            if self.s.gpu:
                torch.cuda.synchronize()
                if first:
                    torch.cuda.reset_peak_memory_stats()
            t_timed = time.perf_counter()
            if first:
                self.warmup_s = t_timed - t0
            times = self._timed(timed, t0, last)
            if first and self.s.gpu:
                self.peak_gib = (torch.cuda.max_memory_allocated() - self.base) / 2**30
        self.rounds.append(times)
        self.timed_s += time.perf_counter() - t_timed
        self.own_s += time.perf_counter() - t0

    def _timed(self, n: int, t0: float, last: bool) -> List[float]:
        pending: List[torch.Tensor] = []  # losses not read yet
        events, times = [], []
        for i in range(n):
            if self.s.gpu:
                ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev[0].record()
                pending.append(self.step())
                ev[1].record()
                events.append(ev)
            else:
                t = time.perf_counter()
                pending.append(self.step())
                times.append((time.perf_counter() - t) * 1e3)
            while len(pending) > 1:
                self.losses.append(pending.pop(0).item())
                self._progress(f"{self.impl} timed")
            if self.past_limit(time.perf_counter() - t0):
                if i + 1 < n or not last:
                    print(f"\n  {self.spec.name} {self.impl}: past --max-seconds {self.s.max_seconds:g} after "
                          f"{sum(map(len, self.rounds)) + i + 1} timed steps", file=sys.stderr, flush=True)
                break
        while pending:
            self.losses.append(pending.pop(0).item())
            self._progress(f"{self.impl} timed")
        if self.s.gpu:
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) for a, b in events]
        return times

    def _progress(self, phase: str) -> None:
        if self.bar is not None:
            self.bar.update(self.losses[-1], phase)

    def row(self) -> Dict:
        """Its results row: the median over every round's timed steps, each round's median beside."""
        s = self.s
        times = [t for r in self.rounds for t in r]
        median = statistics.median(times)
        q = statistics.quantiles(times, n=10) if len(times) > 1 else [median] * 9
        row = {
            "case": case_name(self.spec.name, s.batch, s.seq), "impl": self.impl, "model": self.spec.name,
            "median_ms": median, "p20_ms": q[1], "p80_ms": q[7],
            "round_ms": [round(statistics.median(r), 3) for r in self.rounds if r],
            "step_ms": [round(t, 3) for t in times],
            "tokens_per_s": s.batch * s.seq / (median / 1e3),
            "peak_gib": self.peak_gib,
            "last_loss": self.losses[-1], "loss": list(self.losses),
            "steps_timed": len(times), "rounds": len(self.rounds), "warmup_steps": s.warmup_steps,
            "params": sum(p.numel() for p in self.model.parameters()),
            "setup_s": round(self.setup_s, 2), "warmup_s": round(self.warmup_s, 2), "timed_s": round(self.timed_s, 2),
            "impl_s": round(self.own_s, 2),
        }
        if not all(math.isfinite(v) for v in self.losses):
            row["note"] = "non-finite loss"
        return row


# ---- the run

@dataclass
class Outcome:
    results: List[Dict] = field(default_factory=list)
    skipped: List[Dict] = field(default_factory=list)


def run(s: Settings, after_impl: Optional[Callable[[Outcome], None]] = None) -> Outcome:
    """Every model of s, its impls side by side in rounds; after_impl(outcome) after each impl's
    first round and after each later round (a results file rewritten there keeps what was timed
    when the run is cut short)."""
    import transformers
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # config notes, once per build of every impl
    try:
        return _run(s, after_impl)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _run(s: Settings, after_impl: Optional[Callable[[Outcome], None]]) -> Outcome:
    out = Outcome()
    t_run = time.perf_counter()
    report = after_impl or (lambda _: None)

    def spent() -> bool:
        return bool(s.budget_seconds) and time.perf_counter() - t_run > s.budget_seconds

    for name in s.models:
        spec = MODELS[name]
        case = case_name(spec.name, s.batch, s.seq)
        data = batches(spec.config["vocab_size"], s)
        sizes = round_sizes(s.steps, s.rounds)
        trainers: Dict[str, Trainer] = {}
        rows: Dict[str, Dict] = {}  # each impl's row, as of its latest round

        def publish() -> None:
            out.results[:] = [r for r in out.results if r["case"] != case] + list(rows.values())
            _speedups(out, case)
            report(out)

        def drop(impl: str, reason: str) -> None:
            out.skipped.append({"case": case, "impl": impl, "model": spec.name, "reason": reason})
            print(f"  {spec.name:<12} {impl:<13} skipped: {reason}", flush=True)
            report(out)

        torch._dynamo.reset()  # nothing left from an earlier model's graphs
        bar = Progress(len(s.impls) * len(data), spec.name)
        try:
            # round 1: each impl built, warmed up and timed in turn; its model stays for the later rounds
            for impl in s.impls:
                if spent():
                    drop(impl, f"the run's --budget-seconds {s.budget_seconds:g} was spent")
                    continue
                t = None
                try:
                    t = Trainer(spec, impl, data, s, bar)
                    t.train(s.warmup_steps, sizes[0], last=len(sizes) == 1)
                    trainers[impl] = t
                except Skip as e:
                    drop(impl, str(e))
                except Exception as e:  # an OOM, a failing patch: reported, and the run goes on
                    drop(impl, why(e))
                if impl not in trainers:
                    del t
                    _free()
                    continue
                r = rows[impl] = t.row()
                peak = f"{r['peak_gib']:.2f} GiB peak, " if r["peak_gib"] is not None else ""
                print(f"  {spec.name:<12} {impl:<13} {r['median_ms']:9.2f} ms/step  {r['tokens_per_s']:10.0f} tok/s  "
                      f"{peak}loss {r['last_loss']:.4f}  (round 1 of {len(sizes)}: setup {r['setup_s']:.1f} s, "
                      f"warm-up {r['warmup_s']:.1f} s, {r['steps_timed']} steps {r['timed_s']:.1f} s)", flush=True)
                if len(sizes) == 1:  # one round: nothing to keep it for
                    del trainers[impl]
                    t = None
                    _free()
                publish()
            t = None  # the trainers dict holds the models the later rounds need, and nothing else does
            # the later rounds: one untimed step, then the round's timed steps, each round one impl further along
            for k in range(1, len(sizes)):
                if spent():
                    print(f"  {spec.name}: the run's --budget-seconds {s.budget_seconds:g} was spent after round {k}",
                          flush=True)
                    break
                order = list(trainers)
                for impl in order[k % max(len(order), 1):] + order[:k % max(len(order), 1)]:
                    tr = trainers[impl]
                    if tr.past_limit():
                        del trainers[impl]  # its row is taken: free its model for the others
                        del tr
                        _free()
                        continue
                    failed = None
                    try:
                        tr.train(1, sizes[k], last=k + 1 == len(sizes))
                        rows[impl] = tr.row()
                    except Exception as e:
                        failed = f"round {k + 1}: {why(e)}"
                    del tr
                    if failed is not None:  # freed outside the except block, whose traceback holds the model
                        del trainers[impl], rows[impl]
                        _free()
                        drop(impl, failed)
                publish()
        finally:
            bar.close()
            trainers.clear()
            torch._dynamo.reset()
            _free()
        del data
    print(f"coda.bench: {len(out.results)} impls trained, {len(out.skipped)} skipped, in "
          f"{time.perf_counter() - t_run:.1f} s", flush=True)
    return out


def _speedups(out: Outcome, case: str) -> None:
    hf = next((r for r in out.results if r["case"] == case and r["impl"] == "hf"), None)
    if hf is not None:
        for r in out.results:
            if r["case"] == case:
                r["speedup_vs_hf"] = hf["median_ms"] / r["median_ms"]


def print_table(out: Outcome) -> None:
    """model, impl, step ms, tokens/s, x vs hf, peak GiB, last loss; skipped impls with their reason."""
    rows = {(r["model"], r["impl"]): r for r in out.results}
    skipped = {(r["model"], r["impl"]): r["reason"] for r in out.skipped}
    keys = list(dict.fromkeys([(r["model"], r["impl"]) for r in out.results + out.skipped]))
    if not keys:
        print("\nnothing was run")
        return
    order = {m: i for i, m in enumerate(dict.fromkeys(k[0] for k in keys))}
    keys.sort(key=lambda k: (order[k[0]], (IMPLS + EXTRA_IMPLS).index(k[1]) if k[1] in IMPLS + EXTRA_IMPLS else 99))
    width = max(len(k[0]) for k in keys) + 2
    print(f"\n{'model':<{width}}{'impl':<14}{'step ms':>10}{'tokens/s':>12}{'x vs hf':>9}{'peak GiB':>10}"
          f"{'last loss':>11}")
    for key in keys:
        model, impl = key
        if key in rows:
            r = rows[key]
            x = f"{r['speedup_vs_hf']:.3f}" if "speedup_vs_hf" in r else "-"
            peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
            print(f"{model:<{width}}{impl:<14}{r['median_ms']:>10.2f}{r['tokens_per_s']:>12.0f}{x:>9}{peak:>10}"
                  f"{r['last_loss']:>11.4f}")
        else:
            print(f"{model:<{width}}{impl:<14}  skipped: {skipped[key]}")


def payload(s: Settings, out: Outcome) -> Dict:
    """What the results file holds besides its stamp."""
    rounds = len(round_sizes(s.steps, s.rounds))
    how = (f"median over {s.steps} timed steps in {rounds} rounds of the impls in turn, after {s.warmup_steps} "
           f"warm-up steps and one untimed step per later round" if rounds > 1 else
           f"median over {s.steps} timed steps after {s.warmup_steps} warm-up steps")
    timer = f"CUDA events around each step, {how}" if s.gpu else f"perf_counter per step, {how}"
    return {
        "job": "train",
        "timed_on": s.device, "dtype": str(s.dtype).replace("torch.", ""),
        "settings": {"models": list(s.models), "impls": list(s.impls), "steps": s.steps,
                     "warmup_steps": s.warmup_steps, "rounds": s.rounds, "batch": s.batch, "seq": s.seq, "lr": s.lr, "seed": s.seed,
                     "optimizer": f"torch.optim.AdamW(lr={s.lr:g}, fused={s.gpu})",
                     "data": f"uniform random ids below vocab // {DATA_FRACTION}, the same for every impl",
                     "max_seconds": s.max_seconds, "budget_seconds": s.budget_seconds},
        "models": {m: {"family": MODELS[m].family, **MODELS[m].config} for m in s.models},
        "timer": timer,
        "results": [{k: v for k, v in r.items() if k != "loss"} for r in out.results],
        "skipped": out.skipped,
        "loss_curves": curves(out),
    }


def curves(out: Outcome) -> Dict[str, Dict[str, List[float]]]:
    curves: Dict[str, Dict[str, List[float]]] = {}
    for r in out.results:
        curves.setdefault(r["case"], {})[r["impl"]] = r["loss"]
    return curves
