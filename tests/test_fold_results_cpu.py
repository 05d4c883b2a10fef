"""tools/fold_results.py: the newest file per (device, job) stays, the older ones become summary rows (once)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import fold_results  # noqa: E402


def write(d, name, payload):
    with open(os.path.join(d, name), "w") as fh:
        json.dump(payload, fh)


def test_keeps_the_newest_per_device_and_job(tmp_path):
    d = str(tmp_path)
    os.makedirs(os.path.join(d, "logs"))
    stamp = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11"}
    write(d, "2026-12-05-h100-80gb-hbm3-train-aaaaaaa.json",
          {**stamp, "commit": "aaaaaaa", "date": "2026-12-05T10:00:00+00:00",
           "results": [{"case": "c", "impl": "coda", "median_ms": 2.0}, {"case": "c", "impl": "hf", "median_ms": 3.0}]})
    write(d, "2026-12-06-h100-80gb-hbm3-train-bbbbbbb.json",
          {**stamp, "commit": "bbbbbbb", "date": "2026-12-06T10:00:00+00:00", "results": []})
    write(d, "2026-12-05-h100-80gb-hbm3-errors-1234567.json",
          {**stamp, "commit": "1234567", "date": "2026-12-05T09:00:00+00:00", "worst_ratio_to_torch": 1.2,
           "checks": [{"check": "x"}] * 3})
    write(d, "2026-12-04-h200-sweep-t8192-d1024-ccccccc.json",
          {"device": "NVIDIA H200", "commit": "ccccccc", "date": "2026-12-04T10:00:00+00:00", "results": []})
    write(d, "2026-12-04-h200-sweep-t512-d2048-ddddddd.json",
          {"device": "NVIDIA H200", "commit": "ddddddd", "date": "2026-12-04T11:00:00+00:00", "results": []})
    for name in ("2026-12-05-h100-aaaaaaa-tests.log", "2026-12-06-h100-bbbbbbb-tests.log"):
        open(os.path.join(d, "logs", name), "w").close()
    assert fold_results.main(["--dir", d]) == 0
    left = sorted(os.listdir(d))
    assert left == ["2026-12-04-h200-sweep-t512-d2048-ddddddd.json", "2026-12-05-h100-80gb-hbm3-errors-1234567.json",
                    "2026-12-06-h100-80gb-hbm3-train-bbbbbbb.json", "logs", "summary.jsonl"]
    assert os.listdir(os.path.join(d, "logs")) == ["2026-12-06-h100-bbbbbbb-tests.log"]
    with open(os.path.join(d, "summary.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    train = [r for r in rows if r["job"] == "train"]
    assert [(r["impl"], r["median_ms"], r["commit"], r["device"]) for r in train] == [
        ("coda", 2.0, "aaaaaaa", "h100-80gb-hbm3"), ("hf", 3.0, "aaaaaaa", "h100-80gb-hbm3")]
    assert {r["job"] for r in rows} == {"train", "sweep", "tests"}
    # a second run folds nothing again
    assert fold_results.main(["--dir", d]) == 0
    with open(os.path.join(d, "summary.jsonl")) as fh:
        assert len(fh.readlines()) == len(rows)
