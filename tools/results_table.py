"""Print a results file's cases as a markdown table (the README's performance tables).

    python tools/results_table.py benchmarks/results/2026-12-02-h200.json [case-prefix ...]
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
