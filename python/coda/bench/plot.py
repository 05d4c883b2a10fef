"""The training comparison's plot, drawn from its results file: one row per model, with
tokens/s and peak memory per impl as bars and the loss curves overlaid.

    python -m coda.bench.plot RESULTS.json [OUT.png]    (default: the .json's stem, .png)

matplotlib is optional: without it, one line says so and no PNG is written.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional

from .train import round_sizes

# hf wide and pale beneath the others: curves that agree lie on it, one that strays shows
STYLES = {"hf": dict(lw=3.0, alpha=0.45), "liger": dict(lw=1.2, ls="--"), "compile": dict(lw=1.2, ls="-."),
          "coda": dict(lw=1.4), "coda_compile": dict(lw=1.2, ls=":")}
COLORS = {"hf": "#7f7f7f", "liger": "#1f77b4", "compile": "#ff7f0e", "coda": "#2ca02c", "coda_compile": "#17becf"}


def plot(data: Dict, png: str) -> Optional[str]:
    """Draws the results file's `data` into png; returns its path, or None without matplotlib or rows."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("coda.bench: matplotlib is not installed (pip install matplotlib); no plot written", flush=True)
        return None
    rows: List[Dict] = [r for r in data.get("results", []) if "tokens_per_s" in r]
    if not rows:
        print("coda.bench: nothing was timed; no plot written", flush=True)
        return None
    cases = list(dict.fromkeys(r["case"] for r in rows))
    curves = data.get("loss_curves", {})
    fig, axes = plt.subplots(len(cases), 3, figsize=(15, 3.8 * len(cases)), squeeze=False)
    for ax_row, case in zip(axes, cases):
        case_rows = [r for r in rows if r["case"] == case]
        impls = [r["impl"] for r in case_rows]
        colors = [COLORS.get(i, "#9467bd") for i in impls]
        speed, mem, loss = ax_row
        bars = speed.bar(impls, [r["tokens_per_s"] / 1e3 for r in case_rows], color=colors)
        for bar, r in zip(bars, case_rows):
            if "speedup_vs_hf" in r:
                speed.annotate(f"{r['speedup_vs_hf']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                               ha="center", va="bottom", fontsize=8)
        speed.set_ylabel("thousand tokens/s")
        speed.set_title(f"{case}: throughput")
        peaks = [r.get("peak_gib") for r in case_rows]
        if any(p is not None for p in peaks):
            mem.bar(impls, [p or 0 for p in peaks], color=colors)
            mem.set_ylabel("GiB")
        else:
            mem.text(0.5, 0.5, "no GPU memory measured", ha="center", va="center", transform=mem.transAxes)
        mem.set_title(f"{case}: peak memory")
        warmup = case_rows[0].get("warmup_steps", 0)
        for impl, values in curves.get(case, {}).items():
            loss.plot(range(len(values)), values, label=impl, color=COLORS.get(impl, "#9467bd"),
                      **STYLES.get(impl, dict(lw=1.2)))
        # a dashed line before each untimed stretch: the warm-up, then each later round's first step, by the
        # run's schedule (an impl stopped by --max-seconds took fewer steps than the others)
        settings = data.get("settings", {})
        sizes = round_sizes(settings.get("steps", case_rows[0].get("steps_timed", 0)),
                            settings.get("rounds", case_rows[0].get("rounds", 1)))
        starts = [warmup + sum(sizes[:k]) + k - 1 for k in range(1, len(sizes))]
        for x in ([warmup] if warmup else []) + starts:
            loss.axvline(x - 0.5, color="#bbbbbb", ls="--", lw=0.8)
        untimed = f"the first {warmup}" if warmup else ""
        if starts:
            untimed += (" and " if untimed else "") + "each later round's first"
        loss.set_xlabel(f"step (untimed: {untimed})" if untimed else "step")
        loss.set_ylabel("loss")
        loss.set_title(f"{case}: loss")
        loss.legend(fontsize=8)
        for ax in (speed, mem):
            ax.tick_params(axis="x", labelsize=8, labelrotation=15)
    stamp = " ".join(str(data.get(k, "")) for k in ("device", "commit", "date"))
    fig.suptitle(f"coda.bench training comparison, {data.get('dtype', '')}, {stamp}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def plot_file(path: str, png: Optional[str] = None) -> Optional[str]:
    """The plot of the results file at path, into png (default: beside it, same stem, .png)."""
    with open(path) as fh:
        data = json.load(fh)
    return plot(data, png or os.path.splitext(path)[0] + ".png")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or len(argv) > 2:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    png = plot_file(*argv)
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
