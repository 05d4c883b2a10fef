"""test_trainer_cpu's side-by-side Trainer fine-tune on packed sequences, on the GPU in
mixed precision (Trainer's bf16=True: fp32 parameters, autocast bf16), on coda's kernels:
the loss of every step within bf16's error of the unpatched model's (as
test_convergence_gpu's tolerance), and the chain's programs ran."""

import pytest
import torch

from helpers import assert_ran, launches
from test_convergence_gpu import LOSS_TOL, PROGRAMS
from test_trainer_cpu import example

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_trainer_on_packed_data_gpu(tmp_path):
    import copy

    import coda
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.LlamaForCausalLM(config).cuda()
    docs = example.documents(40 * 8, 1000, seed=3, shortest=64, longest=256)
    patched = coda.patch(copy.deepcopy(model))
    before = launches()
    got = example.finetune(patched, docs, 40, bf16=True, output_dir=str(tmp_path / "coda"))
    assert_ran(before, PROGRAMS["llama"], "Trainer")
    want = example.finetune(model, docs, 40, bf16=True, output_dir=str(tmp_path / "hf"))
    assert want[-1] < want[0] - 1.0, want
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= LOSS_TOL * b, f"step {step}: patched {a}, unpatched {b}"
