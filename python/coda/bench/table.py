"""The table a run ends with: every row, then coda's ratio to each baseline per case."""

from __future__ import annotations

from typing import Dict, List

BASELINES = ("cublas", "eager", "compile", "liger", "cublaslt")


def _ms(v) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def print_table(rows: List[Dict]) -> None:
    cases: Dict[str, Dict[str, Dict]] = {}
    for row in rows:
        if "median_ms" in row:
            cases.setdefault(row["case"], {})[row["impl"]] = row
    if not cases:
        print("\nnothing was timed")
        return
    width = max(len(c) for c in cases) + 2
    print(f"\n{'case':<{width}}{'impl':<14}{'median ms':>10}{'p20-p80 ms':>18}{'host ms':>10}{'TFLOP/s':>9}"
          f"{'vs eager':>10}")
    for case, impls in cases.items():
        for impl, row in impls.items():
            spread = f"{row['p20_ms']:.3f}-{row['p80_ms']:.3f}" if "p20_ms" in row else ""
            tflops = f"{row['tflops']:.1f}" if "tflops" in row else "-"
            diff = f"{row['rel_diff_to_eager']:.1e}" if "rel_diff_to_eager" in row else ""
            print(f"{case:<{width}}{impl:<14}{_ms(row['median_ms']):>10}{spread:>18}{_ms(row.get('host_ms')):>10}"
                  f"{tflops:>9}{diff:>10}")

    present = [b for b in BASELINES if any(b in impls for impls in cases.values())]
    print(f"\n{'case':<{width}}" + "".join(f"{'coda/' + b:>15}" for b in present)
          + f"{'coda host ms':>14}{'eager host ms':>15}")
    for case, impls in cases.items():
        if "coda" not in impls:
            continue
        coda = impls["coda"]["median_ms"]
        cells = "".join(f"{coda / impls[b]['median_ms']:>15.3f}" if b in impls else f"{'-':>15}" for b in present)
        host = (impls["coda"].get("host_ms"), impls.get("eager", {}).get("host_ms"))
        print(f"{case:<{width}}{cells}{_ms(host[0]):>14}{_ms(host[1]):>15}")
