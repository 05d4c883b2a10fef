"""tools/results_table.py --bars: each coda variant against issue 43's bars, and the time/memory frontier."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import results_table  # noqa: E402


def row(impl, ms, peak):
    return {"case": "lm_head_x", "impl": impl, "median_ms": ms, "peak_gib": peak}


def test_frontier_drops_what_another_beats_on_both():
    a, b, c, d = row("coda", 10, 1.0), row("coda_fwd", 8, 2.0), row("coda_v1024", 11, 1.5), row("coda_x", 10, 1.0)
    assert results_table.frontier([a, b, c]) == [a, b]
    assert results_table.frontier([a, d]) == [a, d]  # equal on both: neither beats the other


def test_bars_marks_what_meets_them(tmp_path, capsys):
    path = tmp_path / "r.json"
    rows = [row("cublas", 10.0, 3.0), row("compile", 11.0, 3.0), row("liger", 14.0, 1.2),
            row("coda", 10.5, 1.1), row("coda_fwd", 10.4, 2.0), row("coda_v1024", 12.0, 1.3), row("eager", 12, 6)]
    path.write_text(json.dumps({"commit": "abc1234", "date": "d", "device": "H100", "results": rows}))
    results_table.bars(str(path), [])
    out = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()
           if line.startswith("| coda")}
    assert set(out) == {"coda", "coda_fwd", "coda_v1024"}
    assert "| 1.050 * | 0.955 | 0.750 * | 0.917 * | yes |" in out["coda"]
    assert out["coda_fwd"].endswith("| 1.667 | yes |")
    assert out["coda_v1024"].endswith("| 1.083 |  |")


def test_no_frontier_where_peak_is_not_measured(tmp_path, capsys):
    path = tmp_path / "r.json"
    rows = [row("cublas", 1.0, float("nan")), row("coda", 2.0, float("nan"))]
    path.write_text(json.dumps({"commit": "abc1234", "date": "d", "device": "cpu", "results": rows}))
    results_table.bars(str(path), [])
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("| coda")] == [
        "| coda | 2.00 | nan | 2.000 |  |"]


def test_every_case_keeps_each_variants_worst_ratio(tmp_path, capsys):
    path = tmp_path / "r.json"
    rows = [row("cublas", 10.0, 3.0), row("compile", 11.0, 3.0), row("liger", 14.0, 1.2), row("coda", 10.5, 1.1)]
    rows += [{**r, "case": "lm_head_y", "median_ms": r["median_ms"] * (1.2 if r["impl"] == "coda" else 1)}
             for r in rows]
    path.write_text(json.dumps({"commit": "abc1234", "date": "d", "device": "H100", "results": rows}))
    results_table.bars(str(path), [])
    out = capsys.readouterr().out
    summary = out[out.index("### every case"):].splitlines()
    assert summary[2].startswith("| impl | cases | all bars met in | / cublas | / compile | / liger | peak / liger |")
    assert "| coda | 2 | 0 | 1.260 | 1.145 | 0.900 | 0.917 * |" in summary
