"""Tests that run anywhere: the reference path, shapes, errors, autocast,
tracing and the modules. CI runs these on a machine without a GPU."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import _kernels, ops
from helpers import rel_err

ACTIVATIONS = [None, "gelu_tanh", "gelu", "relu", "silu"]


def make_linear(m, k, n, dtype=torch.float32, bias=True, requires_grad=False):
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k**0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    for t in (x, w, b):
        if t is not None:
            t.requires_grad_(requires_grad)
    return x, w, b


def make_mlp(m, d, f, e=None, dtype=torch.float32, requires_grad=False, residual=True):
    e = d if e is None else e
    ts = [torch.randn(m, d, dtype=dtype), torch.randn(f, d, dtype=dtype) / d**0.5, torch.randn(f, dtype=dtype),
          torch.randn(e, f, dtype=dtype) / f**0.5, torch.randn(e, dtype=dtype),
          torch.randn(m, e, dtype=dtype) if residual else None]
    for t in ts:
        if t is not None:
            t.requires_grad_(requires_grad)
    return ts


def test_extension_built_when_required():
    # CI sets this: a build that produced no loadable extension must fail there.
    if os.environ.get("CODA_REQUIRE_EXTENSION") != "1":
        pytest.skip("CODA_REQUIRE_EXTENSION is not set")
    assert coda.kernels_available(), _kernels.LOAD_ERROR


def test_kernel_table_is_what_the_library_ships():
    # kernels/table.def: every program it declares is built, the forward in the configurations the
    # rule picks (CODA_EXTRA_KERNELS may build more, for sweeps: the shipped ones must be among them).
    if not coda.kernels_available():
        pytest.skip("the extension is not built here")
    built, programs = _kernels.kernels_built(), _kernels.programs()
    assert set(built) == set(programs) and len(programs) == 11
    assert programs["linear_act"] == "forward" and programs["glu_dgrad_rowdot"] == "dgrad"
    assert programs["linear_ce_grad"] == "forward"
    assert programs["wgrad_store"] == "wgrad"
    assert built["linear_act"].items() >= {0: "cooperative_128x256_2x1", 1: "pingpong_128x128_1x2",
                                           2: "cooperative_128x128_1x2"}.items()
    assert built["glu_dgrad_rowdot"] == {1: "pingpong_128x128_1x2"}  # the only one its rule can pick
    # one counter per (program, configuration) the table declares, and nothing counted where nothing ran
    configs = {name for per_program in built.values() for name in per_program.values()}
    assert len(configs) == 3
    counts = _kernels.launch_counts()
    assert set(counts) == {f"{p}/{c}" for p in programs for c in configs}
    if not torch.cuda.is_available():
        assert not any(counts.values()), {k: v for k, v in counts.items() if v}


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_reference(activation, bias, seed):
    x, w, b = make_linear(13, 24, 40, bias=bias)
    out = ops.linear(x, w, b, activation)
    ref = ops.linear_reference(x.double(), w.double(), None if b is None else b.double(), activation)
    assert rel_err(out, ref) < 1e-5, seed


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_matches_reference(activation, seed):
    x, w1, b1, w2, b2, r = make_mlp(9, 16, 48)
    out = ops.mlp(x, w1, b1, w2, b2, activation=activation, residual=r)
    ref = ops.mlp_reference(*(t.double() for t in (x, w1, b1, w2, b2)), activation=activation, residual=r.double())
    assert rel_err(out, ref) < 1e-5, seed


def test_leading_batch_dims():
    x, w, b = torch.randn(2, 3, 5, 16), torch.randn(24, 16), torch.randn(24)
    assert ops.linear(x, w, b, "gelu_tanh").shape == (2, 3, 5, 24)
    x, w1, w2, r = torch.randn(2, 3, 16), torch.randn(32, 16), torch.randn(16, 32), torch.randn(2, 3, 16)
    torch.testing.assert_close(ops.mlp(x, w1, None, w2, None, residual=r), ops.mlp_reference(x, w1, None, w2, None,
                                                                                             residual=r))


def test_one_dimensional_input_like_nn_linear():
    x, w, b = torch.randn(16), torch.randn(8, 16), torch.randn(8)
    torch.testing.assert_close(ops.linear(x, w, b), F.linear(x, w, b))


def test_zero_in_features_and_zero_tokens():
    x, w, b = torch.randn(4, 0), torch.randn(8, 0), torch.randn(8)
    torch.testing.assert_close(ops.linear(x, w, b, "relu"), torch.relu(b).expand(4, 8))
    y = ops.linear(torch.randn(0, 16), torch.randn(8, 16), None, "relu")
    assert y.shape == (0, 8)


def test_gradients_through_the_reference_path():
    ts = [t.double().requires_grad_(True) if t is not None else None for t in make_mlp(4, 6, 10)]
    assert torch.autograd.gradcheck(
        lambda x, w1, b1, w2, b2, r: ops.mlp(x, w1, b1, w2, b2, activation="gelu", residual=r), ts)


def test_frozen_weights_get_no_grad():
    x, w1, b1, w2, b2, r = make_mlp(4, 8, 16)
    x.requires_grad_(True)
    ops.mlp(x, w1, b1, w2, b2, residual=r).sum().backward()
    assert x.grad is not None and w1.grad is None and w2.grad is None


def test_compile_fullgraph_reference_path():
    torch._dynamo.reset()
    ts = make_mlp(8, 16, 32, requires_grad=True)

    def block(x, w1, b1, w2, b2, r):
        return ops.mlp(x, w1, b1, w2, b2, activation="gelu_tanh", residual=r)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    compiled(*ts).square().sum().backward()
    grads = [t.grad.clone() for t in ts]
    for t in ts:
        t.grad = None
    block(*ts).square().sum().backward()
    for g, t in zip(grads, ts):
        torch.testing.assert_close(g, t.grad)


# ---- autocast: fp32 parameters, a lower-precision compute dtype, as nn.Linear

@pytest.mark.parametrize("compiled", [False, True])
def test_autocast_casts_like_nn_linear(compiled):
    torch._dynamo.reset()
    ours, plain = coda.nn.Linear(16, 24, activation="gelu_tanh"), torch.nn.Linear(16, 24)
    plain.load_state_dict(ours.state_dict())
    fn = torch.compile(ours, fullgraph=True, backend="aot_eager") if compiled else ours
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fn(x)
        want = F.gelu(plain(x), approximate="tanh")
    assert y.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(y, want)
    y.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32


# ---- fallbacks are visible

def test_fallback_warns_once_and_strict_raises(monkeypatch):
    monkeypatch.setattr(_kernels, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _kernels.fallback("linear", "dtype float32 has no kernel")
        _kernels.fallback("linear", "dtype float32 has no kernel")
    assert len([w for w in caught if issubclass(w.category, coda.FallbackWarning)]) == 1
    assert "coda.linear ran its reference path: dtype float32" in str(caught[0].message)
    coda.set_strict(True)
    try:
        with pytest.raises(RuntimeError, match="strict mode"):
            _kernels.fallback("mlp", "feature sizes [1030] are not all positive multiples of 8")
    finally:
        coda.set_strict(False)


def test_cpu_tensors_are_not_a_fallback():
    coda.set_strict(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ops.linear(torch.randn(4, 16), torch.randn(8, 16))
    finally:
        coda.set_strict(False)


# ---- errors name the argument and what was expected

def test_error_input_width_blames_the_input():
    with pytest.raises(ValueError, match=r"x has shape \(4, 15\), but weight \(8, 16\) takes 16 input features: "
                                         r"expected x of shape \(\.\.\., 16\)"):
        ops.linear(torch.randn(4, 15), torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"x has shape \(2, 3, 12\).*expected x of shape \(\.\.\., 16\)"):
        coda.nn.Linear(16, 8)(torch.randn(2, 3, 12))
    with pytest.raises(ValueError, match=r"x has shape \(5, 8\).*expected x of shape \(\.\.\., 16\)"):
        coda.nn.LayerNormMLP(16, 32)(torch.randn(5, 8))


def test_error_bias_shape():
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        ops.linear(torch.randn(4, 16), torch.randn(8, 16), torch.randn(9))


def test_error_dtype_mismatch():
    with pytest.raises(TypeError, match="weight has dtype torch.float64, expected torch.float32"):
        ops.linear(torch.randn(4, 16), torch.randn(8, 16, dtype=torch.float64))


def test_error_device_mismatch():
    with pytest.raises(ValueError, match="w2 is on meta, expected cpu"):
        ops.mlp(torch.randn(4, 16), torch.randn(32, 16), None, torch.randn(16, 32, device="meta"), None)


def test_error_activation():
    with pytest.raises(ValueError, match="activation must be None or one of"):
        ops.linear(torch.randn(4, 16), torch.randn(8, 16), activation="tanh")
    with pytest.raises(ValueError, match="activation must be None or one of"):
        coda.nn.Linear(16, 8, activation="swiglu")


def test_error_residual_shape():
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 16\)"):
        ops.mlp(torch.randn(4, 16), torch.randn(32, 16), None, torch.randn(16, 32), None, residual=torch.randn(4, 32))


def test_error_integer_input():
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        ops.linear(torch.ones(4, 16, dtype=torch.int32), torch.randn(8, 16))


# ---- modules hold parameters that load plain PyTorch weights

def test_linear_module_is_a_drop_in():
    plain = torch.nn.Linear(16, 24)
    ours = coda.nn.Linear(16, 24, activation="gelu_tanh")
    assert isinstance(ours, torch.nn.Linear)
    assert ours.state_dict().keys() == plain.state_dict().keys()
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(ours(x), F.gelu(plain(x), approximate="tanh"))
    no_bias = coda.nn.Linear(16, 24, bias=False)
    assert no_bias.bias is None and set(no_bias.state_dict()) == {"weight"}


def test_mlp_module_loads_two_linears():
    fc1, fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
    sd = {f"fc1.{k}": v for k, v in fc1.state_dict().items()}
    sd.update({f"fc2.{k}": v for k, v in fc2.state_dict().items()})
    m = coda.nn.MLP(16, 64, activation="gelu")
    m.load_state_dict(sd)
    x, r = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    torch.testing.assert_close(m(x, residual=r), fc2(F.gelu(fc1(x))) + r)


def test_mlp_module_trains_on_cpu():
    torch.manual_seed(0)
    m = coda.nn.MLP(8, 32, activation="silu")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, target = torch.randn(64, 8), torch.randn(64, 8)
    first = None
    for _ in range(20):
        loss = F.mse_loss(m(x), target)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first
