"""A real client: transformers' Trainer fine-tunes a patched model on packed sequences
(DataCollatorWithFlattening), examples/finetune_trainer.py as a user runs it, side by side
with the unpatched model from the same weights and seed: the loss of every step agrees
(CPU, float32: the same math summed in another order) and falls."""

import copy
import importlib.util
import os

import pytest

import coda
from test_hf_patch_cpu import build

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "finetune_trainer.py")
_spec = importlib.util.spec_from_file_location("finetune_trainer", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

STEPS = 12


def curves(model, steps=STEPS, **kw):
    docs = example.documents(steps * 8, model.config.vocab_size, seed=3)
    patched = coda.patch(copy.deepcopy(model))
    return (example.finetune(patched, docs, steps, use_cpu=True, **kw),
            example.finetune(model, docs, steps, use_cpu=True, **kw))


@pytest.mark.parametrize("family", ["example", "qwen3", "gpt2"])
def test_trainer_on_packed_data(family, tmp_path):
    model = example.tiny_llama() if family == "example" else build(family)
    got, want = curves(model, output_dir=str(tmp_path))
    assert len(got) == len(want) == STEPS
    assert want[-1] < want[0] - 0.5, want  # it learns
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-4 * b, f"{family} step {step}: patched {a}, unpatched {b}"


def test_example_runs():
    example.main(["--steps", "2", "--batch-size", "2"])
