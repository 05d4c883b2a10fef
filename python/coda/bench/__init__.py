"""coda's benchmarks: `python -m coda.bench` (cli.py says what it runs).

    cli.py      the command line, the device check, the run
    timing.py   the timer, Runner (impls timed in turn, host time), the kernel timeline
    results.py  stamping, naming and writing results files
    blocks.py   the GPT-style block: the default cases
    llama.py    the LLaMA block (RMSNorm, RoPE, SwiGLU; --only llama)
    mlp.py, norm.py   the MLP's and the norm ops' own cases (--only mlp, --only norm)
    steps.py    inputs, and a function made the step that is timed (forward, + backward, compiled)
    liger.py    Liger-Kernel's norms and LLaMA ops, imported on first use
    table.py    the table a run ends with

The scripts in benchmarks/ import timing and results from here, and the GPU tests
results (their errors file); importing those loads neither the cases nor coda's ops.
"""


def main(argv=None) -> int:
    from .cli import main as run
    return run(argv)


__all__ = ["main"]
