"""python -m coda.bench's training comparison, through its CPU fallback (tiny LLaMA and GPT-2, a
few steps): the table, the results file's rows and loss curves, the plot or the line that says
why there is none, coda's rows (or, until coda.hf exists, the reason they are skipped), and the
kernel-level flags still reaching the kernel benchmarks. The GPU is never used here: where one
is present, the test says the CPU fallback applies."""

import glob
import importlib.util
import json
import os

import pytest

pytest.importorskip("transformers")

from coda.bench import cli, train  # noqa: E402

ROW_KEYS = {"case", "impl", "model", "median_ms", "tokens_per_s", "peak_gib", "last_loss", "steps_timed",
            "speedup_vs_hf"}
CASES = {"llama": "train_step_llama_tiny_b2_s64", "gpt2": "train_step_gpt2_tiny_b2_s64"}
HAS_CODA_HF = importlib.util.find_spec("coda.hf") is not None


def _cpu_only(monkeypatch):
    monkeypatch.setattr(cli, "gpu_here", lambda: (False, "the test runs the CPU fallback"))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One run of the command: both models, hf and coda, 1 warm-up and 2 timed steps."""
    mp = pytest.MonkeyPatch()
    _cpu_only(mp)
    out = tmp_path_factory.mktemp("train")
    try:
        import io
        from contextlib import redirect_stdout
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = cli.main(["--models", "llama1b,gpt2medium", "--impls", "hf,coda", "--out", str(out)])
    finally:
        mp.undo()
    paths = glob.glob(os.path.join(out, "*-train-*.json"))
    return rc, buf.getvalue(), paths, out


def test_runs_and_prints_the_table(job):
    rc, text, _, _ = job
    assert rc == 0, text
    assert "training tiny configs on the CPU instead" in text
    header = next(line for line in text.splitlines() if line.startswith("model"))
    assert header.split() == ["model", "impl", "step", "ms", "tokens/s", "x", "vs", "hf", "peak", "GiB", "last", "loss"]
    for model in ("llama_tiny", "gpt2_tiny"):
        assert any(line.split()[:2] == [model, "hf"] for line in text.splitlines()), text


def test_results_file(job):
    _, text, paths, _ = job
    assert len(paths) == 1, text
    name = os.path.basename(paths[0])
    assert name.split("-")[-2] == "train" and name.endswith(".json")
    data = json.load(open(paths[0]))
    assert data["job"] == "train" and data["timed_on"] == "cpu" and data["dtype"] == "float32"
    assert {"commit", "date", "device", "settings", "timer", "results", "skipped", "loss_curves"} <= set(data)
    rows = {(r["case"], r["impl"]): r for r in data["results"]}
    for case in CASES.values():
        hf = rows[(case, "hf")]
        assert ROW_KEYS <= set(hf), set(hf)
        assert hf["median_ms"] > 0 and hf["tokens_per_s"] > 0 and hf["steps_timed"] == 2
        assert hf["speedup_vs_hf"] == 1.0 and hf["peak_gib"] is None  # no GPU memory on the CPU
        curve = data["loss_curves"][case]["hf"]
        assert len(curve) == 3 and curve[-1] == hf["last_loss"]
        assert all(5 < v < 9 for v in curve)  # about ln(2048) from random weights


def test_coda_rows_or_the_reason(job):
    _, text, paths, _ = job
    data = json.load(open(paths[0]))
    rows = {(r["case"], r["impl"]): r for r in data["results"]}
    skipped = {(s["case"], s["impl"]): s["reason"] for s in data["skipped"]}
    for case in CASES.values():
        if not HAS_CODA_HF:
            assert "coda.hf" in skipped[(case, "coda")], skipped
            continue
        assert (case, "coda") in rows, f"coda skipped: {skipped.get((case, 'coda'))}"
        coda, hf = rows[(case, "coda")], rows[(case, "hf")]
        assert ROW_KEYS <= set(coda)
        # the same weights and data: coda's reference path trains as Hugging Face's model does
        for a, b in zip(data["loss_curves"][case]["coda"], data["loss_curves"][case]["hf"]):
            assert abs(a - b) < 1e-2, (case, data["loss_curves"][case])


def test_plot_or_why_not(job):
    _, text, paths, _ = job
    png = os.path.splitext(paths[0])[0] + ".png"
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in text and not os.path.exists(png)
    else:
        assert os.path.getsize(png) > 10_000


def test_compile_row(monkeypatch, tmp_path, capsys):
    # torch.compile on the tiny GPT-2 (its inductor build is the cost): the same losses as hf's
    _cpu_only(monkeypatch)
    assert cli.main(["--models", "gpt2medium", "--impls", "hf,compile", "--out", str(tmp_path), "--no-plot"]) == 0
    data = json.load(open(glob.glob(os.path.join(tmp_path, "*-train-*.json"))[0]))
    if any(s["impl"] == "compile" for s in data["skipped"]):
        pytest.skip(f"torch.compile does not run here: {data['skipped']}")
    curves = data["loss_curves"][CASES["gpt2"]]
    assert [round(v, 3) for v in curves["compile"]] == [round(v, 3) for v in curves["hf"]]
    assert not glob.glob(os.path.join(tmp_path, "*.png"))


def test_kernel_flags_still_reach_the_kernel_benchmarks(monkeypatch):
    ran = []
    monkeypatch.setattr(cli, "kernels", lambda args: ran.append(("kernels", args.only, args.sweep_shapes)) or 0)
    monkeypatch.setattr(cli, "training", lambda args: ran.append(("training",)) or 0)
    cli.main(["--only", "llama", "--out", "x"])
    cli.main(["--sweep-shapes"])
    cli.main(["--kernels"])
    cli.main(["--tokens", "2048"])
    cli.main([])
    assert ran == [("kernels", ["llama"], False), ("kernels", ["block"], True), ("kernels", ["block"], False),
                   ("kernels", ["block"], False), ("training",)]
    with pytest.raises(SystemExit):
        cli.main(["--only", "llama", "--models", "llama1b"])


def test_liger_leaves_no_patch_behind():
    # the liger impl restores modeling_llama's globals: later impls build plain Hugging Face models
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    saved = train._LigerGlobals(modeling_llama)
    before = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP, modeling_llama.LlamaForCausalLM.forward)
    modeling_llama.LlamaRMSNorm = object
    modeling_llama.LlamaForCausalLM.forward = None
    saved.restore()
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP, modeling_llama.LlamaForCausalLM.forward) == before


def test_rounds_interleave_the_impls(monkeypatch, tmp_path):
    # --rounds 2: both impls built and warmed up in turn, then the second round starts at coda;
    # every impl takes the same steps (1 warm-up, 2 + 2 timed, 1 untimed in round 2) on the same batches
    _cpu_only(monkeypatch)
    order = []
    train_round = train.Trainer.train

    def spy(self, untimed, timed, last):
        order.append((self.impl, untimed, timed))
        return train_round(self, untimed, timed, last)

    monkeypatch.setattr(train.Trainer, "train", spy)
    assert cli.main(["--models", "llama1b", "--impls", "hf,coda", "--rounds", "2", "--steps", "4",
                     "--out", str(tmp_path), "--no-plot"]) == 0
    assert order == [("hf", 1, 2), ("coda", 1, 2), ("coda", 1, 2), ("hf", 1, 2)]
    data = json.load(open(glob.glob(os.path.join(tmp_path, "*-train-*.json"))[0]))
    assert data["settings"]["rounds"] == 2 and "2 rounds of the impls in turn" in data["timer"]
    rows = {r["impl"]: r for r in data["results"]}
    for r in rows.values():
        assert r["steps_timed"] == 4 and r["rounds"] == 2 and len(r["round_ms"]) == 2
    curves = data["loss_curves"][CASES["llama"]]
    assert len(curves["hf"]) == 6
    if HAS_CODA_HF:
        assert all(abs(a - b) < 1e-2 for a, b in zip(curves["coda"], curves["hf"])), curves


def test_round_sizes():
    assert train.round_sizes(20, 4) == [5, 5, 5, 5]
    assert train.round_sizes(7, 3) == [3, 2, 2]
    assert train.round_sizes(2, 4) == [1, 1]
    assert train.round_sizes(5, 1) == [5]


def test_liger_globals_are_swapped_in_for_its_own_steps():
    # Liger rebinds modeling_llama.apply_rotary_pos_emb, which every Llama calls at run time: its
    # model trains with it, and the impls beside it with the original
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    original = modeling_llama.apply_rotary_pos_emb
    g = train._LigerGlobals(modeling_llama)
    modeling_llama.apply_rotary_pos_emb = replacement = lambda *a: a
    g.keep()
    g.restore()
    assert modeling_llama.apply_rotary_pos_emb is original
    with g.patched():
        assert modeling_llama.apply_rotary_pos_emb is replacement
    assert modeling_llama.apply_rotary_pos_emb is original


@pytest.mark.skipif(not HAS_CODA_HF, reason="coda.hf is not importable")
def test_other_families_train_as_hf(monkeypatch, tmp_path):
    # --models qwen3_0.6b,phi3mini_8l,gemma3_1b: their tiny twins on the CPU, coda's loss curve as hf's
    _cpu_only(monkeypatch)
    models = "qwen3_0.6b,phi3mini_8l,gemma3_1b"
    assert cli.main(["--models", models, "--impls", "hf,coda", "--out", str(tmp_path), "--no-plot"]) == 0
    data = json.load(open(glob.glob(os.path.join(tmp_path, "*-train-*.json"))[0]))
    assert not data["skipped"], data["skipped"]
    for tiny in ("qwen3_tiny", "phi3_tiny", "gemma3_tiny"):
        curves = data["loss_curves"][f"train_step_{tiny}_b2_s64"]
        assert len(curves["coda"]) == 3
        for a, b in zip(curves["coda"], curves["hf"]):
            assert abs(a - b) <= 1e-4 * b, (tiny, curves)
