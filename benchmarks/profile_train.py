"""Where one training step of the main job (python/coda/bench/train.py) spends
its GPU time, by kind of kernel, per impl: the breakdown behind issue 26's
ratios (e.g. GPT-2 coda against torch.compile).

    python benchmarks/profile_train.py --models gpt2medium --impls coda,compile --out DIR

After the warm-up steps (torch.compile compiles there), `--steps` steps run
under the profiler; per impl it prints the step's wall time, the GPU's busy
time by category (GEMMs, attention, the loss, the optimizer, the rest) and
the longest kernels, and writes a stamped JSON. Without a GPU it profiles the
tiny CPU configs (CPU ops, not kernels). An experiment tool: what it finds
goes to benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import torch

from coda.bench import results, train

# Checked in order: the first pattern a kernel's name matches is its category.
CATEGORIES = [
    ("attention", r"flash|fmha|attention|sdpa"),
    ("loss", r"cross_entropy|log_softmax|nll_loss|logsumexp"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|sm90_|wgmma|coda::kernels"),
    ("norm", r"norm|rstd|row_stats"),
    ("elementwise", r"elementwise|vectorized|triton|copy|fill|reduce|cat|index"),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def profile_impl(spec: train.ModelSpec, impl: str, s: train.Settings, steps: int) -> dict:
    t = train.Trainer(spec, impl, train.batches(spec.config["vocab_size"], s), s)
    sync = torch.cuda.synchronize if s.gpu else (lambda: None)
    activity = torch.profiler.ProfilerActivity.CUDA if s.gpu else torch.profiler.ProfilerActivity.CPU
    with t.scope():  # Liger's module globals, where it patched them
        for _ in range(s.warmup_steps):
            t.step()
        sync()
        with torch.profiler.profile(activities=[activity]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                t.step()
            sync()
            wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kind = torch.autograd.DeviceType.CUDA if s.gpu else torch.autograd.DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind and e.time_range.elapsed_us() > 0]
    if not s.gpu:  # CPU ops nest: keep the outermost of each stack only
        events = [e for e in events if e.cpu_parent is None]
    by_cat, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        us = e.time_range.elapsed_us() / steps
        by_cat[category(e.name)] += us
        by_name[e.name[:120]] += us
        count[category(e.name)] += 1
    busy = sum(by_cat.values())
    del t
    train._free()
    return {"model": spec.name, "impl": impl, "wall_ms": round(wall_ms, 3), "busy_ms": round(busy / 1e3, 3),
            "by_category_ms": {c: round(v / 1e3, 3) for c, v in by_cat.most_common()},
            "kernels_per_step": {c: n // steps for c, n in count.items()},
            "top_kernels_ms": [[n, round(v / 1e3, 3)] for n, v in by_name.most_common(15)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2medium", help="comma-separated: " + ", ".join(train.MODELS))
    p.add_argument("--impls", default="coda,compile", help="comma-separated: " + ", ".join(train.IMPLS))
    p.add_argument("--steps", type=int, default=3, help="profiled steps per impl")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--out", help="write the stamped JSON into this folder")
    a = p.parse_args()
    gpu = torch.cuda.is_available()
    models = [m if gpu else train.TINY.get(m, m) for m in a.models.split(",")]
    s = train.Settings(models=models, impls=a.impls.split(","), steps=a.steps, warmup_steps=a.warmup_steps,
                       batch=4 if gpu else 2, seq=2048 if gpu else 64, device="cuda" if gpu else "cpu",
                       dtype=torch.bfloat16 if gpu else torch.float32)
    rows = []
    for name in models:
        for impl in s.impls:
            try:
                row = profile_impl(train.MODELS[name], impl, s, a.steps)
            except train.Skip as e:
                print(f"{name} {impl}: skipped ({e})")
                continue
            rows.append(row)
            cats = "  ".join(f"{c} {v:.2f}" for c, v in row["by_category_ms"].items())
            print(f"{name} {impl}: wall {row['wall_ms']:.2f} ms/step, busy {row['busy_ms']:.2f}: {cats}")
            for n, ms in row["top_kernels_ms"][:8]:
                print(f"    {ms:8.3f}  {n}")
    if a.out:
        print("wrote", results.write(a.out, "profile_train", {"batch": s.batch, "seq": s.seq, "rows": rows}))


if __name__ == "__main__":
    main()
