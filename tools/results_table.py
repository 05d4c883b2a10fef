"""Print a results file's cases as a markdown table (the README's performance tables).

    python tools/results_table.py benchmarks/results/2026-12-04-h200-abc1234.json [case-prefix ...]
    python tools/results_table.py --budget FILE

--budget: for each case timed in turn with cuBLAS and torch.compile, what the target
"at least 3% faster than torch.compile" leaves on top of the same GEMMs alone in cuBLAS
(0.97 x compile - cuBLAS), against what coda spends there (coda - cuBLAS).

Older files also hold sequential timings beside `<case>_interleaved` ones; --budget
takes the interleaved ones where both exist.

    python tools/results_table.py --bars FILE [case-prefix ...]

--bars: every coda variant of each case (impl `coda` or `coda_*`, e.g. the LM head's
modes and chunk sizes) against issue 43's bars, from the same run: time over the GEMMs
alone (`cublas`, <= 1.06), over torch.compile (<= 0.95) and Liger (<= 0.80), peak over
Liger's (<= 1). `*` marks a bar met; `frontier` marks a variant no other is both faster
and leaner than, the set the default is picked from. With several cases, a last table
holds each variant's worst ratio over them (the default has to meet the bars at every shape).
Each case ends with the GEMMs alone against the same bars: a time bar they miss asks for
the three GEMMs faster than cuBLAS runs them.
"""

import json
import math
import sys

IMPLS = ["coda", "cublas", "eager", "cublaslt", "liger", "compile"]


def load(path, prefixes=(), interleaved_only=False):
    doc = json.load(open(path))
    cases = {}
    for row in doc["results"]:
        if "median_ms" not in row or (prefixes and not any(row["case"].startswith(p) for p in prefixes)):
            continue
        cases.setdefault(row["case"], {})[row["impl"]] = row
    if interleaved_only:
        cases = {c: t for c, t in cases.items() if c + "_interleaved" not in cases}
    print(f"commit {doc['commit']}, {doc['date']}, {doc['device']}\n")
    return cases


def main(path, prefixes):
    cases = load(path, prefixes)
    present = [i for i in IMPLS if any(i in c for c in cases.values())]
    host = any("host_ms" in r for t in cases.values() for r in t.values())
    ratios = [b for b in ("cublas", "eager", "compile", "liger") if b in present]
    print("| case | " + " | ".join(present) + "".join(f" | coda / {b}" for b in ratios)
          + (" | host ms, coda / eager" if host else "") + " |")
    print("| --- " * (1 + len(present) + len(ratios) + host) + "|")
    for case, t in cases.items():
        cells = [f"{t[i]['median_ms']:.3f} ms" if i in t else "" for i in present]
        cells += [f"{t['coda']['median_ms'] / t[b]['median_ms']:.3f}" if "coda" in t and b in t else ""
                  for b in ratios]
        if host:
            h = [f"{t[i]['host_ms']:.3f}" if "host_ms" in t.get(i, {}) else "-" for i in ("coda", "eager")]
            cells.append(" / ".join(h))
        print(f"| {case} | " + " | ".join(cells) + " |")


def budget(path):
    cases = load(path, interleaved_only=True)
    print("| case | cuBLAS, GEMMs alone | torch.compile | coda | compile over cuBLAS | 0.97 x compile - cuBLAS "
          "| coda - cuBLAS |")
    print("| --- " * 7 + "|")
    for case, t in cases.items():
        if not all(k in t for k in ("coda", "cublas", "compile")):
            continue
        b, c, x = (t[k]["median_ms"] for k in ("cublas", "compile", "coda"))
        print(f"| {case} | {b:.3f} ms | {c:.3f} ms | {x:.3f} ms | {c / b:.3f} | {0.97 * c - b:+.3f} ms "
              f"| {x - b:+.3f} ms |")


# Issue 43's bars: time ratios to an impl of the same run, and peak memory to Liger's.
BARS = (("cublas", 1.06), ("compile", 0.95), ("liger", 0.80))


def frontier(rows):
    """The variants no other is both at least as fast and as lean as (and better in one)."""
    def beaten(a):
        return any(b is not a and b["median_ms"] <= a["median_ms"] and b["peak_gib"] <= a["peak_gib"]
                   and (b["median_ms"] < a["median_ms"] or b["peak_gib"] < a["peak_gib"]) for b in rows)
    return [r for r in rows if "peak_gib" in r and not beaten(r)]


def ratios(r, t):
    """(name, ratio, bar) of variant row r against the bars' impls of its case t, where measured."""
    out = [(f"/ {b}", r["median_ms"] / t[b]["median_ms"], x) for b, x in BARS if b in t]
    if "peak_gib" in t.get("liger", {}):
        out.append(("peak / liger", r.get("peak_gib", math.nan) / t["liger"]["peak_gib"], 1.0))
    return out


def cell(q, x):
    return f"{q:.3f}{' *' if q <= x else ''}"


def bars(path, prefixes):
    cases = load(path, prefixes)
    worst = {}
    for case, t in cases.items():
        mine = [r for i, r in t.items() if i == "coda" or i.startswith("coda_")]
        if not mine:
            continue
        best = {id(r) for r in frontier([r for r in mine if r.get("peak_gib", math.nan) == r.get("peak_gib")])}
        names = [f"{n} (<= {x})" for n, _, x in ratios(mine[0], t)]
        print(f"### {case}\n")
        print("| impl | ms | peak GiB | " + " | ".join(names) + " | frontier |")
        print("| --- " * (4 + len(names)) + "|")
        for r in sorted(mine, key=lambda r: r["median_ms"]):
            qs = ratios(r, t)
            cells = [r["impl"], f"{r['median_ms']:.2f}", f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"]
            cells += [cell(q, x) for _, q, x in qs] + ["yes" if id(r) in best else ""]
            print("| " + " | ".join(cells) + " |")
            w = worst.setdefault(r["impl"], {"cases": 0, "met": 0})
            w["cases"] += 1
            w["met"] += all(q <= x for _, q, x in qs)
            for n, q, x in qs:
                w[n] = max(w.get(n, (q, x)), (q, x), key=lambda p: math.inf if p[0] != p[0] else p[0])
        if "cublas" in t:
            # the floor: a time bar under 1.000 here asks for the three GEMMs faster than cuBLAS runs them
            floor = ratios(t["cublas"], t)
            print("| (GEMMs alone) | " + f"{t['cublas']['median_ms']:.2f} | - | "
                  + " | ".join(f"{q:.3f}" if n.startswith("/") else "-" for n, q, _ in floor) + " |  |")
        print()
    if len(cases) > 1 and worst:
        # the default must meet the bars at every shape: each variant's worst ratio over the cases
        order = [f"/ {b}" for b, _ in BARS] + ["peak / liger"]
        names = [n for n in order if any(n in w for w in worst.values())]
        print("### every case: worst ratio\n")
        print("| impl | cases | all bars met in | " + " | ".join(names) + " |")
        print("| --- " * (3 + len(names)) + "|")
        for impl, w in sorted(worst.items(), key=lambda kv: kv[1].get("/ cublas", (0,))[0]):
            print(f"| {impl} | {w['cases']} | {w['met']} | "
                  + " | ".join(cell(*w[n]) if n in w else "" for n in names) + " |")
        print()


if __name__ == "__main__":
    if sys.argv[1] == "--budget":
        budget(sys.argv[2])
    elif sys.argv[1] == "--bars":
        bars(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1], sys.argv[2:])
