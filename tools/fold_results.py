"""Keep the newest results file per (device, job) in benchmarks/results and fold
the others into benchmarks/results/summary.jsonl, one JSON line per measured
row (a benchmark case and impl, a profile row; an errors file as its count
and worst ratio; a log or plot as its name), each with the file's commit,
date, device and name (`source`). The folded files are deleted (git keeps
them); rerunning folds only what is new, so a device session commits its
files, then runs this.

    python tools/fold_results.py [--dir benchmarks/results] [--dry-run]

A job is the part of a file's name between the device and the commit
(<date>-<device>[-<job>]-<commit>.json, logs/<date>-<device>[-<commit>]-<job>.log),
up to its first '-': sweeps at several shapes are one job, as are the
errors files of tuned runs. Files the README shows are kept.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEX = re.compile(r"^[0-9a-f]{7,40}$")
DATE = re.compile(r"^(\d{4}-\d{2}-\d{2})-(.*)$")
# Devices the names have carried; a file whose JSON names another adds its own.
DEVICES = {"h200", "h100-80gb-hbm3", "h100", "cpu"}
ROWS = ("results", "rows")


def slug(device: str) -> str:
    name = device.lower().removeprefix("nvidia ")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def parse(name: str, devices) -> dict:
    """date, device slug, commit and job of a results file's name."""
    stem = os.path.basename(name).rsplit(".", 1)[0]
    m = DATE.match(stem)
    if not m:
        return {"date": "", "device": "unknown", "commit": "", "job": stem}
    date, rest = m.groups()
    device = max((d for d in devices if rest == d or rest.startswith(d + "-")), key=len, default=rest.split("-")[0])
    tokens = [t for t in rest[len(device):].split("-") if t]
    commits = [t for t in tokens if HEX.match(t)]
    words = [t for t in tokens if t not in commits]
    return {"date": date, "device": device, "commit": commits[0][:7] if commits else "",
            "job": words[0] if words else "bench"}


def added_time(path: str) -> int:
    """When git first saw the file (the order of files of one day), else its mtime."""
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%ct", "-1", "--", path], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    return int(out) if out else int(os.path.getmtime(path))


def scalars(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (str, int, float, bool)) or v is None}


def rows_of(path: str, info: dict) -> list:
    base = {"source": os.path.relpath(path, ROOT), "date": info["date"], "device": info["device"],
            "commit": info["commit"], "job": info["job"]}
    if not path.endswith(".json"):
        return [{**base, "kind": path.rsplit(".", 1)[-1]}]
    with open(path) as fh:
        d = json.load(fh)
    if isinstance(d, list):
        return [{**base, **scalars(e)} for e in d if isinstance(e, dict)] or [base]
    top = {**base, **{k: d[k] for k in ("commit", "date", "torch", "cuda", "job") if isinstance(d.get(k), str)}}
    top["commit"] = top["commit"][:7]
    if isinstance(d.get("checks"), list):
        return [{**top, "checks": len(d["checks"]), "worst_ratio_to_torch": d.get("worst_ratio_to_torch"),
                 "seed": d.get("seed")}]
    out = []
    for key in ROWS:
        if isinstance(d.get(key), list):
            out += [{**top, **scalars(e)} for e in d[key] if isinstance(e, dict)]
    return out or [{**top, **{k: v for k, v in scalars(d).items() if k not in top}}]


def linked(names) -> set:
    """Results files the README shows (its plot): the logs in benchmarks/README name folded runs by design."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    return {n for n in names if os.path.basename(n) in readme}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--dry-run", action="store_true", help="print what would be kept and folded")
    a = ap.parse_args(argv)
    summary = os.path.join(a.dir, "summary.jsonl")
    files = sorted(p for p in glob.glob(os.path.join(a.dir, "*")) + glob.glob(os.path.join(a.dir, "logs", "*"))
                   if os.path.isfile(p) and p != summary)
    devices = set(DEVICES)
    stamps = {}
    for p in files:
        if p.endswith(".json"):
            try:
                with open(p) as fh:
                    d = json.load(fh)
            except ValueError as e:
                print(f"fold_results: {p} is not JSON ({e}); left alone", file=sys.stderr)
                continue
            if isinstance(d, dict) and isinstance(d.get("device"), str):
                devices.add(slug(d["device"]))
                stamps[p] = d.get("date", "")
    groups = {}
    for p in files:
        info = parse(p, devices)
        kind = ("log" if os.sep + "logs" + os.sep in p else os.path.splitext(p)[1])
        order = (info["date"], stamps.get(p, ""), added_time(p), p)
        groups.setdefault((info["device"], info["job"], kind), []).append((order, p, info))
    keep = linked(files)
    fold = []
    for entries in groups.values():
        entries.sort()
        keep.add(entries[-1][1])
        fold += [(p, info) for _, p, info in entries[:-1] if p not in keep]
    folded = set()
    if os.path.exists(summary):
        with open(summary) as fh:
            folded = {json.loads(line)["source"] for line in fh if line.strip()}
    new_rows = [r for p, info in sorted(fold) if os.path.relpath(p, ROOT) not in folded for r in rows_of(p, info)]
    print(f"{len(files)} files: keep {len(keep)}, fold {len(fold)} ({len(new_rows)} new summary rows)")
    if a.dry_run:
        for p in sorted(keep):
            print("  keep", os.path.relpath(p, a.dir))
        return 0
    with open(summary, "a") as fh:
        for r in new_rows:
            fh.write(json.dumps(r, sort_keys=False) + "\n")
    for p, _ in fold:
        os.remove(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
