"""The decode benchmark's pieces (coda.bench.generate) on the CPU: a patched tiny model's greedy
generate() gives the unpatched model's tokens, on coda's ops and under reference_only alike;
reference_only sends every op to its reference path and restores the kernel choice after."""

import pytest
import torch

pytest.importorskip("transformers")

from coda import _kernels  # noqa: E402
from coda.bench import generate  # noqa: E402


@pytest.mark.parametrize("model", ["llama_tiny", "gpt2_tiny"])
def test_patched_generate_gives_the_unpatched_tokens(model, monkeypatch):
    monkeypatch.setattr(generate, "PROMPT", 8)
    hf = generate._model(model, False, "cpu", torch.float32)
    patched = generate._model(model, True, "cpu", torch.float32)
    ids = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    want = generate._generate(hf, ids, 5, False)
    assert want.shape == (2, 13)
    assert torch.equal(generate._generate(patched, ids, 5, False), want)
    assert torch.equal(generate._generate(patched, ids, 5, True), want)


def test_reference_only_is_scoped():
    x = torch.empty(4, 8, device="meta")
    with _kernels.reference_only():
        assert not _kernels.use_kernels("linear", x, _kernels.BF16, [8])
        with _kernels.reference_only():
            pass
        assert _kernels._reference_only
    assert not _kernels._reference_only
