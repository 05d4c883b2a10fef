"""The gated MLP (SwiGLU / GeGLU) on the CPU: the reference path against Hugging
Face's LlamaMLP built from a config (no downloads; skipped without
transformers), the module's state_dict keys, the weight-layout round trips,
gradients and the argument errors. Its kernels are not built yet (issue 24)."""

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import ops


def _weights(d=32, f=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, dtype=torch.float64) * scale  # noqa: E731
    return r(3, 5, d), r(f, d, scale=d**-0.5), r(f, d, scale=d**-0.5), r(d, f, scale=f**-0.5), 1 + 0.2 * r(d)


def test_layouts_round_trip():
    _, wg, wu, _, _ = _weights()
    w = ops.interleave_gate_up(wg, wu)
    assert torch.equal(w[0], wg[0]) and torch.equal(w[1], wu[0]) and torch.equal(w[4], wg[2])
    g2, u2 = ops.split_gate_up(w)
    assert torch.equal(g2, wg) and torch.equal(u2, wu)
    cat = torch.cat([wg, wu])
    assert torch.equal(ops.concatenated_to_interleaved(cat), w)
    assert torch.equal(ops.interleaved_to_concatenated(w), cat)
    with pytest.raises(ValueError, match="w_gate .* and w_up .* must have the same shape"):
        ops.interleave_gate_up(wg, wu[:3])


@pytest.mark.parametrize("activation,torch_act", [("silu", F.silu), ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh")),
                                                  ("gelu", F.gelu)])
def test_glu_mlp_matches_its_formula(activation, torch_act):
    x, wg, wu, wd, _ = _weights()
    r = torch.randn(3, 5, 32, dtype=torch.float64)
    y = ops.glu_mlp(x, wg, wu, wd, activation, residual=r)
    torch.testing.assert_close(y, (torch_act(x @ wg.t()) * (x @ wu.t())) @ wd.t() + r)


def test_norm_glu_mlp_is_glu_of_the_norm():
    x, wg, wu, wd, gamma = _weights()
    y = ops.norm_glu_mlp(x, gamma, None, wg, wu, wd, "RMSNorm", 1e-6, residual=x)
    n = F.rms_norm(x, (32,), gamma, 1e-6)
    torch.testing.assert_close(y, ops.glu_mlp(n, wg, wu, wd) + x)
    beta = torch.randn(32, dtype=torch.float64)
    y = ops.norm_glu_mlp(x, gamma, beta, wg, wu, wd, "LayerNorm", 1e-5, "gelu_tanh")
    torch.testing.assert_close(y, ops.glu_mlp(F.layer_norm(x, (32,), gamma, beta, 1e-5), wg, wu, wd, "gelu_tanh"))


def test_gradients_flow():
    x, wg, wu, wd, gamma = (t.requires_grad_() for t in _weights())
    ops.norm_glu_mlp(x, gamma, None, wg, wu, wd, residual=x).square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (x, wg, wu, wd, gamma))


def test_errors_name_the_argument():
    x, wg, wu, wd, gamma = _weights()
    with pytest.raises(ValueError, match=r"x has shape \(3, 5, 32\), but w_gate \(48, 16\)"):
        ops.glu_mlp(x, wg[:, :16], wu, wd)
    with pytest.raises(ValueError, match="w_up .* must have w_gate's shape"):
        ops.glu_mlp(x, wg, wu[:40], wd)
    with pytest.raises(ValueError, match="w_down .* takes 40 input features"):
        ops.glu_mlp(x, wg, wu, wd[:, :40])
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.glu_mlp(x, wg, wu, wd, "relu")
    with pytest.raises(ValueError, match="norm_bias must be None for RMSNorm"):
        ops.norm_glu_mlp(x, gamma, gamma, wg, wu, wd)


def _llama_config(transformers, d=64, f=96, act="silu"):
    return transformers.LlamaConfig(hidden_size=d, intermediate_size=f, hidden_act=act, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                    vocab_size=128)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_module_loads_and_matches_llama_mlp(act):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    cfg = _llama_config(transformers, act=act)
    hf_mlp, hf_norm = LlamaMLP(cfg).double(), LlamaRMSNorm(64, eps=1e-6).double()
    with torch.no_grad():
        hf_norm.weight.copy_(1 + 0.2 * torch.randn(64))
    plain = coda.nn.SwiGLUMLP(64, 96, activation=act).double()
    plain.load_state_dict(hf_mlp.state_dict())  # strict: LlamaMLP's keys
    normed = coda.nn.SwiGLUMLP(64, 96, activation=act, normalization="RMSNorm", eps=1e-6).double()
    normed.load_state_dict({**hf_mlp.state_dict(), **{f"norm.{k}": v for k, v in hf_norm.state_dict().items()}})
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    torch.testing.assert_close(plain(x), hf_mlp(x))
    torch.testing.assert_close(normed(x, residual=x), x + hf_mlp(hf_norm(x)))
    assert set(plain.state_dict()) == set(hf_mlp.state_dict())


def test_cuda_call_is_a_visible_fallback():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the fallback warning is for CUDA tensors")
    x, wg, wu, wd, _ = (t.float().cuda() for t in _weights())
    with pytest.warns(coda.FallbackWarning, match="glu_mlp ran its reference path: its kernels are not built yet"):
        ops.glu_mlp(x, wg, wu, wd)
