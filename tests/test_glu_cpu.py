"""The gated MLP (SwiGLU / GeGLU) on the CPU: the reference path against Hugging
Face's LlamaMLP built from a config (no downloads; skipped without
transformers), the module's state_dict in HF's keys and layout, the
weight-layout round trips, return_stats, gradients, the argument errors, and
the kernel-path call against the spec's schema of coda::norm_glu_mlp (a CPU
stand-in for the op)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import compiled_once, cpu_stand_in, rms_stats_rows

import coda
from coda import _activations, _kernels, ops
from coda.ops import glu


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
    assert torch.equal(ops.concatenated_to_interleaved(ops.interleaved_to_concatenated(w)), w)
    b = torch.arange(6.0)
    assert torch.equal(ops.interleave_gate_up(b[:3], b[3:]), torch.tensor([0.0, 3, 1, 4, 2, 5]))
    with pytest.raises(ValueError, match="w_gate .* and w_up .* must have the same shape"):
        ops.interleave_gate_up(wg, wu[:3])
    with pytest.raises(ValueError, match="split_gate_up: w must have an even first dimension"):
        ops.split_gate_up(w[:5])
    with pytest.raises(ValueError, match="concatenated_to_interleaved: w must be"):
        ops.concatenated_to_interleaved(cat[:5])


ACTS = [("silu", F.silu), ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh")), ("gelu", F.gelu)]


@pytest.mark.parametrize("activation,torch_act", ACTS)
def test_glu_mlp_matches_its_formula(activation, torch_act):
    x, wg, wu, wd, _ = _weights()
    r = torch.randn(3, 5, 32, dtype=torch.float64)
    y = ops.glu_mlp(x, ops.interleave_gate_up(wg, wu), wd, activation, residual=r)
    torch.testing.assert_close(y, (torch_act(x @ wg.t()) * (x @ wu.t())) @ wd.t() + r)


def test_norm_glu_mlp_is_glu_of_the_norm():
    x, wg, wu, wd, gamma = _weights()
    w = ops.interleave_gate_up(wg, wu)
    y = ops.norm_glu_mlp(x, gamma, None, w, wd, "RMSNorm", 1e-6, residual=x)
    torch.testing.assert_close(y, ops.glu_mlp(F.rms_norm(x, (32,), gamma, 1e-6), w, wd) + x)
    beta = torch.randn(32, dtype=torch.float64)
    y = ops.norm_glu_mlp(x, gamma, beta, w, wd, "LayerNorm", 1e-5, "gelu_tanh")
    torch.testing.assert_close(y, ops.glu_mlp(F.layer_norm(x, (32,), gamma, beta, 1e-5), w, wd, "gelu_tanh"))
    torch.testing.assert_close(ops.norm_glu_mlp_reference(x, gamma, beta, w, wd, "LayerNorm", 1e-5, "gelu_tanh"), y)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_stats_in_and_out(normalization):
    x, wg, wu, wd, gamma = _weights()
    w = ops.interleave_gate_up(wg, wu)
    beta = 0.1 * gamma if normalization == "LayerNorm" else None
    # stats of x from row_stats give the same y as computing them here
    st = ops.row_stats(x, normalization, 1e-6)
    y0 = ops.norm_glu_mlp(x, gamma, beta, w, wd, normalization, 1e-6, residual=x)
    y1, st_y = ops.norm_glu_mlp(x, gamma, beta, w, wd, normalization, 1e-6, residual=x, stats=st, return_stats=True)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)  # the given stats are float32, x float64
    # return_stats: the same norm's (mean, rstd) of y, float32 (..., 2), as row_stats computes them
    assert st_y.shape == (3, 5, 2) and st_y.dtype == torch.float32 and not st_y.requires_grad
    torch.testing.assert_close(st_y, ops.row_stats(y0, normalization, 1e-6))
    if normalization == "RMSNorm":
        assert torch.equal(st_y[..., 0], torch.zeros(3, 5))
    ref = ops.norm_glu_mlp_reference(x, gamma, beta, w, wd, normalization, 1e-6, residual=x, return_stats=True)
    torch.testing.assert_close(ref[1], st_y)


def test_gradients_flow():
    x, wg, wu, wd, gamma = _weights()
    leaves = [t.requires_grad_() for t in (x, ops.interleave_gate_up(wg, wu), wd, gamma)]
    x, w, wd, gamma = leaves
    ops.norm_glu_mlp(x, gamma, None, w, wd, residual=x).square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves)


def test_errors_name_the_argument():
    x, wg, wu, wd, gamma = _weights()
    w = ops.interleave_gate_up(wg, wu)
    with pytest.raises(ValueError, match=r"x has shape \(3, 5, 32\), but w_gate_up \(96, 16\)"):
        ops.glu_mlp(x, w[:, :16], wd)
    with pytest.raises(ValueError, match=r"w_gate_up must have an even number of rows \(2F, D\)"):
        ops.glu_mlp(x, w[:95], wd)
    with pytest.raises(ValueError, match=r"w_down \(32, 40\) takes 40 input features"):
        ops.glu_mlp(x, w, wd[:, :40])
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.glu_mlp(x, w, wd, "relu")
    with pytest.raises(ValueError, match=r"residual must have shape \(3, 5, 32\)"):
        ops.glu_mlp(x, w, wd, residual=x[:2])
    with pytest.raises(TypeError, match="w_down has dtype torch.float32, expected torch.float64"):
        ops.glu_mlp(x, w, wd.float())
    with pytest.raises(ValueError, match="norm_bias must be None for RMSNorm"):
        ops.norm_glu_mlp(x, gamma, gamma, w, wd)
    with pytest.raises(ValueError, match="norm_weight is required"):
        ops.norm_glu_mlp(x, None, None, w, wd)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(32,\)"):
        ops.norm_glu_mlp(x, gamma[:16], None, w, wd)
    with pytest.raises(ValueError, match="normalization must be 'LayerNorm' or 'RMSNorm'"):
        ops.norm_glu_mlp(x, gamma, None, w, wd, "BatchNorm")
    with pytest.raises(ValueError, match="stats must be a float32 tensor of shape"):
        ops.norm_glu_mlp(x, gamma, None, w, wd, stats=torch.zeros(3, 5, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="eps must be a finite float"):
        ops.norm_glu_mlp(x, gamma, None, w, wd, eps=-1.0)


def test_autocast_computes_in_the_autocast_dtype():
    x, wg, wu, wd, gamma = (t.float() for t in _weights())
    w = ops.interleave_gate_up(wg, wu).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.norm_glu_mlp(x, gamma, None, w, wd, residual=x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32


# ---- the module against Hugging Face's LlamaMLP

def _llama_config(transformers, d=64, f=96, act="silu"):
    return transformers.LlamaConfig(hidden_size=d, intermediate_size=f, hidden_act=act, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                    vocab_size=128)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_module_loads_and_matches_llama_mlp(act, dtype):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    cfg = _llama_config(transformers, act=act)
    hf_mlp, hf_norm = LlamaMLP(cfg).to(dtype), LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(1 + 0.2 * torch.randn(64))
    plain = coda.nn.SwiGLUMLP(64, 96, activation=act, dtype=dtype)
    plain.load_state_dict(hf_mlp.state_dict())  # strict: LlamaMLP's keys
    normed = coda.nn.SwiGLUMLP(64, 96, activation=act, normalization="RMSNorm", eps=1e-6, dtype=dtype)
    normed.load_state_dict({**hf_mlp.state_dict(), **{f"norm.{k}": v for k, v in hf_norm.state_dict().items()}})
    x = torch.randn(2, 7, 64, dtype=dtype)
    tol = {} if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain(x), hf_mlp(x), **tol)
    torch.testing.assert_close(normed(x, residual=x), x + hf_mlp(hf_norm(x)), **tol)
    y, st = normed(x, residual=x, return_stats=True)
    torch.testing.assert_close(st, ops.row_stats(y, "RMSNorm", 1e-6))


def test_module_state_dict_is_hugging_faces():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    hf_mlp = LlamaMLP(_llama_config(transformers))
    m = coda.nn.SwiGLUMLP(64, 96)
    m.load_state_dict(hf_mlp.state_dict())
    sd, hf_sd = m.state_dict(), hf_mlp.state_dict()
    assert list(sd) == list(hf_sd) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    for k in sd:
        assert torch.equal(sd[k], hf_sd[k]), k
        assert sd[k].is_contiguous()
    # copies: the state_dict does not alias the interleaved parameter (safetensors refuses shared storage)
    assert sd["gate_proj.weight"].untyped_storage().data_ptr() != m.gate_up_weight.untyped_storage().data_ptr()
    assert torch.equal(m.gate_up_weight, ops.interleave_gate_up(hf_sd["gate_proj.weight"], hf_sd["up_proj.weight"]))
    # round trips: HF keys back into a fresh module, and the interleaved key itself
    m2 = coda.nn.SwiGLUMLP(64, 96)
    m2.load_state_dict(sd)
    assert torch.equal(m2.gate_up_weight, m.gate_up_weight)
    m3 = coda.nn.SwiGLUMLP(64, 96)
    m3.load_state_dict({"gate_up_weight": m.gate_up_weight.detach(), "down_proj.weight": hf_sd["down_proj.weight"]})
    assert torch.equal(m3.gate_up_weight, m.gate_up_weight)
    # nested: the prefix is kept, the order too
    outer = torch.nn.Sequential(torch.nn.Linear(4, 4), coda.nn.SwiGLUMLP(64, 96, normalization="RMSNorm"))
    assert list(outer.state_dict()) == ["0.weight", "0.bias", "1.gate_proj.weight", "1.up_proj.weight",
                                        "1.norm.weight", "1.down_proj.weight"]
    outer.load_state_dict(outer.state_dict())
    # keep_vars: views of the parameter, which carry its gradient
    kv = m.state_dict(keep_vars=True)
    kv["up_proj.weight"].sum().backward()
    assert torch.equal(m.gate_up_weight.grad[1::2], torch.ones(96, 64))
    assert torch.equal(m.gate_up_weight.grad[0::2], torch.zeros(96, 64))


def test_module_load_errors():
    m = coda.nn.SwiGLUMLP(64, 96)
    sd = m.state_dict()
    with pytest.raises(RuntimeError, match=r"gate_proj.weight \(96, 64\) and up_proj.weight \(90, 64\) must have"):
        m.load_state_dict({**sd, "up_proj.weight": sd["up_proj.weight"][:90]})
    with pytest.raises(RuntimeError, match="Missing key.*gate_up_weight"):
        m.load_state_dict({k: v for k, v in sd.items() if k != "up_proj.weight"})
    with pytest.raises(ValueError, match="stats and return_stats need a norm"):
        m(torch.randn(2, 64), return_stats=True)
    with pytest.raises(ValueError, match="activation must be one of"):
        coda.nn.SwiGLUMLP(64, 96, activation="relu")


def test_module_init_is_nn_linears():
    torch.manual_seed(0)
    m = coda.nn.SwiGLUMLP(256, 512)
    bound = 256**-0.5
    assert m.gate_up_weight.abs().max() <= bound and m.gate_up_weight.abs().max() > 0.95 * bound


# ---- the kernel path's call, against the spec's schema (a CPU stand-in for the op)

def _norm_glu_mlp_cpu(x, norm_weight, w_gate_up, w_down, stats, residual, add_input, eps, activation, save,
                      want_stats):
    e = x.new_empty
    n = x
    if norm_weight is not None:
        rstd = (stats if stats is not None else rms_stats_rows(x, eps))[1].reshape(*x.shape[:-1], 1)
        n = (x.float() * rstd * norm_weight.float()).to(x.dtype)
    h = F.linear(n, w_gate_up)
    a = _activations.apply(h[..., 0::2], activation) * h[..., 1::2]
    y = F.linear(a, w_down)
    if add_input or residual is not None:
        y = y + (x if add_input else residual)
    return (y, h.reshape(-1, h.shape[-1]).clone() if save else e(0), a.reshape(-1, a.shape[-1]).clone() if save
            else e(0), rms_stats_rows(x, eps) if norm_weight is not None and stats is None else e(0).float(),
            rms_stats_rows(y, eps) if want_stats else e(0).float())


def _norm_glu_mlp_backward_cpu(dy, x, norm_weight, w_gate_up, w_down, h, a, stats, add_input, activation, needs):
    raise NotImplementedError("not called: these tests run without gradients")


@pytest.fixture
def stand_in(monkeypatch):
    yield from cpu_stand_in(monkeypatch, {"norm_glu_mlp": _norm_glu_mlp_cpu, "norm_glu_mlp_backward": _norm_glu_mlp_backward_cpu})


def _kernel_cases():
    x, wg, wu, wd, gamma = (t.float() for t in _weights())
    w, r = ops.interleave_gate_up(wg, wu), torch.randn(3, 5, 32)
    st = rms_stats_rows(x, 1e-6).t().reshape(3, 5, 2)  # not row_stats: its op has no stand-in here
    return [
        (lambda: ops.glu_mlp(x, w, wd, "gelu_tanh", r), lambda: ops.glu_mlp_reference(x, w, wd, "gelu_tanh", r)),
        (lambda: ops.glu_mlp(x, w, wd, residual=x), lambda: ops.glu_mlp_reference(x, w, wd, residual=x)),
        (lambda: ops.norm_glu_mlp(x, gamma, None, w, wd, eps=1e-6, residual=x),
         lambda: ops.norm_glu_mlp_reference(x, gamma, None, w, wd, eps=1e-6, residual=x)),
        (lambda: ops.norm_glu_mlp(x, gamma, None, w, wd, eps=1e-6, activation="gelu", stats=st, return_stats=True),
         lambda: ops.norm_glu_mlp_reference(x, gamma, None, w, wd, eps=1e-6, activation="gelu", stats=st,
                                            return_stats=True)),
    ]


@pytest.mark.parametrize("case", range(4))
def test_kernel_path_call_matches_the_schema(stand_in, case):
    fn, ref = _kernel_cases()[case]
    with torch.no_grad():
        got, want = fn(), ref()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the fakes: shapes, dtypes and strides of the stand-in's outputs
        compiled = compiled_once(fn)
    torch.testing.assert_close(compiled, got)


def test_fakes_match_the_stand_in(stand_in):
    x, wg, wu, wd, gamma = (t.float() for t in _weights())
    w = ops.interleave_gate_up(wg, wu)
    for args in [(x, gamma, w, wd, None, None, True, 1e-6, 4, True, True),
                 (x, None, w, wd, None, x * 0.5, False, 0.0, 1, False, False),
                 (x, gamma, w, wd, rms_stats_rows(x, 1e-6), None, True, 1e-6, 2, True, False)]:
        torch.library.opcheck(torch.ops.coda.norm_glu_mlp.default, args,
                              test_utils=("test_schema", "test_faketensor"))


def test_cuda_layernorm_is_a_visible_fallback():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the fallback warning is for CUDA tensors")
    x, wg, wu, wd, gamma = (t.cuda().bfloat16() for t in _weights())
    with pytest.warns(coda.FallbackWarning, match="norm_glu_mlp ran its reference path: LayerNorm"):
        ops.norm_glu_mlp(x, gamma, gamma, ops.interleave_gate_up(wg, wu), wd, "LayerNorm")
