"""What the kernel-level scripts share: their common options, the GPU check, the results file."""

from __future__ import annotations

import argparse

import torch

from coda.bench import results, timing
from coda.bench.cli import gpu_here
from coda.bench.timing import Runner


def parser(doc: str, timed: bool = True) -> argparse.ArgumentParser:
    """--tokens --hidden --ffn (the MLP headline's shape by default), --out, and for a
    script that times with do_bench, --warmup-ms --rep-ms."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    if timed:
        p.add_argument("--warmup-ms", type=float, default=25)
        p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--out", help="write the results file into this folder")
    return p


def gpu_or_say(script: str) -> bool:
    """True where coda's kernels run; else says why, and the script measures nothing."""
    ok, why = gpu_here()
    if not ok:
        print(f"{script}: needs coda's kernels on an sm_90 GPU ({why}); nothing measured")
    return ok


class Results:
    """The script's results file, rewritten after every case (Runner.after_case): a run the
    GPU machine's time limit cuts short keeps what it measured."""

    def __init__(self, args: argparse.Namespace, kind: str, runner: Runner):
        self.path = results.results_path(args.out, kind) if args.out else None
        self.runner = runner
        self.head = {"dtype": "bfloat16", "shape": {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn},
                     "timer": timing.timer(True, args.warmup_ms, args.rep_ms, 0)}
        runner.after_case = self.save

    def save(self) -> None:
        if self.path:
            results.write_to(self.path, {**self.head, "results": self.runner.results, "skipped": self.runner.skipped})

    def done(self) -> None:
        self.save()
        if self.path:
            print("wrote", self.path)


def runner(args: argparse.Namespace, rounds: int = 5) -> Runner:
    torch.manual_seed(0)
    return Runner(True, args.warmup_ms, args.rep_ms, rounds)
