"""Print a results file's cases as a markdown table (the README's performance tables).

    python tools/results_table.py benchmarks/results/2026-12-02-h200.json [case-prefix ...]
    python tools/results_table.py --budget FILE

--budget: for each case timed in turn with cuBLAS and torch.compile, what
the target "at least 3% faster than torch.compile" leaves on top of the same
GEMMs alone in cuBLAS (0.97 x compile - cuBLAS), against what coda spends
there (coda - cuBLAS).
"""

import json
import sys

IMPLS = ["coda", "cublas", "eager", "cublaslt", "liger", "compile"]


def main(path, prefixes):
    doc = json.load(open(path))
    cases = {}
    for row in doc["results"]:
        if prefixes and not any(row["case"].startswith(p) for p in prefixes):
            continue
        cases.setdefault(row["case"], {})[row["impl"]] = row["median_ms"]
    present = [i for i in IMPLS if any(i in c for c in cases.values())]
    print(f"commit {doc['commit']}, {doc['date']}, {doc['device']}\n")
    print("| case | " + " | ".join(present) + " | coda / cuBLAS | coda / compile |")
    print("| --- " * (len(present) + 3) + "|")
    for case, t in cases.items():
        cells = [f"{t[i]:.3f} ms" if i in t else "" for i in present]
        ratio = lambda base: f"{t['coda'] / t[base]:.3f}" if "coda" in t and base in t else ""  # noqa: E731
        print(f"| {case} | " + " | ".join(cells) + f" | {ratio('cublas')} | {ratio('compile')} |")


def budget(path):
    doc = json.load(open(path))
    cases = {}
    for row in doc["results"]:
        if row["case"].endswith(("_interleaved", "_steady")):
            cases.setdefault(row["case"], {})[row["impl"]] = row["median_ms"]
    print(f"commit {doc['commit']}, {doc['date']}, {doc['device']}\n")
    print("| case | cuBLAS, GEMMs alone | torch.compile | coda | compile over cuBLAS | 0.97 x compile - cuBLAS "
          "| coda - cuBLAS |")
    print("| --- " * 7 + "|")
    for case, t in cases.items():
        if not all(k in t for k in ("coda", "cublas", "compile")):
            continue
        b, c, x = t["cublas"], t["compile"], t["coda"]
        print(f"| {case} | {b:.3f} ms | {c:.3f} ms | {x:.3f} ms | {c / b:.3f} | {0.97 * c - b:+.3f} ms "
              f"| {x - b:+.3f} ms |")


if __name__ == "__main__":
    if sys.argv[1] == "--budget":
        budget(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2:])
