"""Where coda's LLaMA block (python/coda/bench/llama.py) spends its GPU time,
kernel by kernel, beside the same GEMMs alone in cuBLAS: the breakdown behind
issue 24's ratios.

    python benchmarks/profile_llama.py --points 16384:4096 8192:2048 --out DIR

Writes DIR/profile_llama_t<tokens>_d<d>.txt (kernels in launch order, us and
idle before each) and a stamped JSON with the per-kernel times. An experiment
tool: what it finds goes to benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import os

import torch

import coda
from coda.bench import llama, results, steps
from coda.bench.timing import kernel_timeline


def point(tokens: int, d: int, out: str, rows: list) -> None:
    cfg = llama.config(d)
    torch.manual_seed(0)
    dt, dev, f = torch.bfloat16, "cuda", cfg.ffn

    def rand(*shape, scale=1.0):
        return steps.rand(*shape, dtype=dt, device=dev, scale=scale)

    x = steps.residual_stream(tokens, d, dt, dev)
    attn, g1, g2 = rand(tokens, cfg.q_size), steps.norm_params(d, dt, dev)[0], steps.norm_params(d, dt, dev)[0]
    w_qkv, w_o = rand(cfg.qkv_size, d, scale=d**-0.5), rand(d, cfg.q_size, scale=cfg.q_size**-0.5)
    w_gate_up, w_down = rand(2 * f, d, scale=d**-0.5), rand(d, f, scale=f**-0.5)
    params = steps.trainable([x, attn, g1, w_qkv, w_o, g2, w_gate_up, w_down])
    _, positions, freq = llama.rope_tables(cfg, tokens, dt, dev)[1:]
    block = llama.coda_block(positions, freq)
    dqkv, dz = rand(tokens, cfg.qkv_size), rand(tokens, d)
    impls = {
        "coda_fwd": steps.forward(block, params),
        "coda_fwd_bwd": steps.forward_backward(block, params, [dqkv, dz]),
        "cublas_fwd": llama.cublas_step(cfg, x, attn, w_qkv, w_o, w_gate_up, w_down, rand(tokens, f), dqkv, dz, False),
        "cublas_fwd_bwd": llama.cublas_step(cfg, x, attn, w_qkv, w_o, w_gate_up, w_down, rand(tokens, f), dqkv, dz,
                                            True),
    }
    with open(os.path.join(out, f"profile_llama_t{tokens}_d{d}.txt"), "w") as text:
        for name, fn in impls.items():
            tl = kernel_timeline(fn)
            total = sum(us for _, us, _ in tl["kernel_us"])
            rows.append({"tokens": tokens, "d": d, "impl": name, "kernel_us_total": total, "kernel_us": tl["kernel_us"]})
            text.write(f"==== {name} t={tokens} d={d}: {total:.1f} us of kernels\n")
            for k, us, idle in tl["kernel_us"]:
                text.write(f"  {us:8.1f} {idle:8.1f}  {k[:150]}\n")
            print(f"{name} t={tokens} d={d}: {total:.1f} us", flush=True)
    print(open(os.path.join(out, f"profile_llama_t{tokens}_d{d}.txt")).read(), flush=True)
    del params, impls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--points", nargs="+", default=["16384:4096", "8192:2048"], help="tokens:d")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    rows: list = []
    for s in a.points:
        tokens, d = map(int, s.split(":"))
        point(tokens, d, a.out, rows)
        torch.cuda.empty_cache()
    results.write(a.out, "profile_llama", {"points": a.points, "rows": rows})


if __name__ == "__main__":
    coda.set_strict(True)
    main()
