"""GPU tests: every output and gradient against float64, each within the error
of the unfused torch path in the same dtype, on fresh random inputs, with
outputs poisoned before each run, in strict mode (a fallback to the
reference path raises) and with the launch counters showing that kernels
ran. Skipped without an sm_90 GPU (failed under CODA_REQUIRE_GPU=1)."""

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import _activations, _kernels, ops
from helpers import (assert_ran, check_op, launched_since, launches, leaves, poison_cuda_allocator, rel_err, run,
                     within_torch_error)

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
ACTIVATIONS = [None, "gelu_tanh", "gelu", "relu", "silu"]


@pytest.fixture(autouse=True)
def strict():
    coda.set_strict(True)
    yield
    coda.set_strict(False)


def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


def kink_safe(activation, x, w, b):
    """For ReLU, x, w and b moved onto grids fine enough to keep them random
    and coarse enough that x·wᵀ + b sums exactly in fp32 (x in 1/16ths, w in
    1/512ths), whatever the order of the sums: ReLU' jumps at 0, and one
    pre-activation within rounding of 0 taking the other side than in float64
    costs dx as much as all of bf16's rounding. The other activations are smooth."""
    if activation != "relu":
        return x, w, b
    def grid(t, step):
        return None if t is None else (t.float() / step).round().mul(step).to(t.dtype)
    return grid(x, 1 / 16), grid(w, 1 / 512), grid(b, 1 / 16)


def check_against_torch(name, fn, ref_fn, inputs, dy, out_bytes, *, programs, check_grads=True, tokens=None):
    """coda (fn) and the unfused torch path (ref_fn) in the inputs' dtype, both
    against ref_fn in float64 on the same inputs; fn must launch each of
    `programs` on the way (forward and, with check_grads, backward).

    tokens: the rows the op ran over. A weight gradient (out, in) of few
    tokens is a sum of that many outer products, so its relative error is an
    estimate over tokens·in roundings, not out·in: the slack follows that."""
    poison_cuda_allocator(out_bytes)
    before = launches()
    if check_grads:
        y, grads = run(fn, inputs, dy)
    else:
        with torch.no_grad():
            y, grads = fn(*inputs), []
    torch.cuda.synchronize()
    assert_ran(before, programs, name)
    y64, grads64 = run(ref_fn, [None if t is None else t.double() for t in inputs], dy.double())
    yt, gradst = run(ref_fn, inputs, dy)
    within_torch_error(f"{name} out", rel_err(y, y64), rel_err(yt, y64), numel=y64.numel())
    for i, (g, g64, gt) in enumerate(zip(grads, grads64, gradst)):
        if g64 is not None:
            numel = g64.numel() if tokens is None else min(g64.numel(), tokens * g64.shape[-1])
            within_torch_error(f"{name} grad[{i}]", rel_err(g, g64), rel_err(gt, g64), numel=numel)


# The programs each op launches (csrc/kernels/table.def): a Linear's backward takes act' in a
# separate pass and leaves its plain dgrad to cuBLAS (and its wgrad where the tiles would leave
# SMs idle); the MLP's fc2 dgrad carries act' and db1 whenever there is one to carry.
LINEAR = ("linear_act",)


def mlp_programs(activation, bias):
    return ("linear_act",) + (("dact_dbias",) if activation is not None or bias else ())


LINEAR_SHAPES = [(1000, 1032, 3000), (1, 1032, 3000), (7, 256, 512), (32768, 1024, 1024)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", LINEAR_SHAPES)
@pytest.mark.parametrize("activation", ["gelu_tanh", None])
def test_linear_shapes(m, k, n, activation, dtype, seed):
    x, w, b = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype, scale=k**-0.5), rand(n, dtype=dtype)
    dy = rand(m, n, dtype=dtype)
    check_against_torch(f"linear {m}x{k}x{n} seed={seed}", lambda x, w, b: ops.linear(x, w, b, activation),
                        lambda x, w, b: ops.linear_reference(x, w, b, activation), [x, w, b], dy, 6 * m * n * 2,
                        programs=LINEAR)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_activations(activation, bias, seed):
    m, k, n, dtype = 1000, 1032, 3000, torch.bfloat16
    x, w = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype, scale=k**-0.5)
    b = rand(n, dtype=dtype) if bias else None
    x, w, b = kink_safe(activation, x, w, b)
    dy = rand(m, n, dtype=dtype)
    check_against_torch(f"linear {activation} seed={seed}", lambda x, w, b: ops.linear(x, w, b, activation),
                        lambda x, w, b: ops.linear_reference(x, w, b, activation), [x, w, b], dy, 6 * m * n * 2,
                        programs=LINEAR)


def test_linear_inference_leading_dims(seed):
    x, w, b = rand(4, 250, 512, dtype=torch.bfloat16), rand(1024, 512, dtype=torch.bfloat16, scale=512**-0.5), \
        rand(1024, dtype=torch.bfloat16)
    poison_cuda_allocator(8 * 1000 * 1024 * 2)
    with torch.no_grad():
        y = ops.linear(x, w, b, "silu")
    y64 = ops.linear_reference(x.double(), w.double(), b.double(), "silu")
    assert y.shape == (4, 250, 1024)
    within_torch_error(f"linear leading dims seed={seed}", rel_err(y, y64),
                       rel_err(ops.linear_reference(x, w, b, "silu"), y64))


MLP_SHAPES = [(1000, 1032, 3000), (1, 256, 1024), (7, 256, 1024), (32768, 1024, 4096)]


def mlp_inputs(m, d, f, dtype, bias=True, residual=True):
    return [rand(m, d, dtype=dtype), rand(f, d, dtype=dtype, scale=d**-0.5), rand(f, dtype=dtype) if bias else None,
            rand(d, f, dtype=dtype, scale=f**-0.5), rand(d, dtype=dtype) if bias else None,
            rand(m, d, dtype=dtype) if residual else None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d,f", MLP_SHAPES)
def test_mlp_shapes(m, d, f, dtype, seed):
    inputs = mlp_inputs(m, d, f, dtype)
    dy = rand(m, d, dtype=dtype)
    check_against_torch(f"mlp {m}x{d}x{f} seed={seed}",
                        lambda x, w1, b1, w2, b2, r: ops.mlp(x, w1, b1, w2, b2, "gelu_tanh", r),
                        lambda x, w1, b1, w2, b2, r: ops.mlp_reference(x, w1, b1, w2, b2, "gelu_tanh", r),
                        inputs, dy, 8 * m * f * 2, programs=mlp_programs("gelu_tanh", True))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias,residual", [(True, True), (False, False)])
def test_mlp_activations(activation, bias, residual, seed):
    m, d, f, dtype = 1000, 1032, 3000, torch.bfloat16
    inputs = mlp_inputs(m, d, f, dtype, bias=bias, residual=residual)
    inputs[:3] = kink_safe(activation, *inputs[:3])
    dy = rand(m, d, dtype=dtype)
    check_against_torch(f"mlp {activation} seed={seed}",
                        lambda x, w1, b1, w2, b2, r: ops.mlp(x, w1, b1, w2, b2, activation, r),
                        lambda x, w1, b1, w2, b2, r: ops.mlp_reference(x, w1, b1, w2, b2, activation, r),
                        inputs, dy, 8 * m * f * 2, programs=mlp_programs(activation, bias))


def test_fallback_is_visible_and_correct(seed):
    # d = 1030 is not a multiple of 8: the reference path answers, and says so once.
    coda.set_strict(False)
    inputs = mlp_inputs(64, 1030, 512, torch.bfloat16)
    _kernels._warned.clear()
    with pytest.warns(coda.FallbackWarning, match=r"coda.mlp ran its reference path: feature sizes \[1030, 512, 1030\]"):
        y = ops.mlp(*inputs[:5], "gelu_tanh", inputs[5])
    ref = ops.mlp_reference(*(t.double() for t in inputs[:5]), "gelu_tanh", inputs[5].double())
    assert rel_err(y, ref) < 1e-2
    coda.set_strict(True)
    with pytest.raises(RuntimeError, match="strict mode"):
        ops.mlp(*inputs[:5], "gelu_tanh", inputs[5])
    with pytest.raises(RuntimeError, match="dtype float32 has no kernel"):
        ops.linear(rand(8, 16, dtype=torch.float32), rand(8, 16, dtype=torch.float32))


def test_strided_misaligned_and_expanded_inputs(seed):
    # Views a kernel cannot read in place are copied: a slice whose row stride
    # is wider than its rows, one at an odd offset, and the dy autograd hands
    # over after a broadcast (strides 0), none of which may reach a kernel as is.
    m, k, n, bf = 300, 256, 512, torch.bfloat16
    w, b = rand(n, k, dtype=bf, scale=k**-0.5), rand(n, dtype=bf)
    x0 = rand(m, k, dtype=bf)
    wide = torch.full((m, k + 8), float("nan"), device="cuda", dtype=bf)
    wide[:, :k] = x0
    odd = torch.full((m * k + 1,), float("nan"), device="cuda", dtype=bf)
    odd[1:] = x0.reshape(-1)
    dy = rand(m, n, dtype=bf)
    x64 = x0.double().requires_grad_(True)
    y64 = ops.linear_reference(x64, w.double(), b.double(), "gelu_tanh")
    (g64,) = torch.autograd.grad(y64, x64, dy.double())
    yt = ops.linear_reference(x0.requires_grad_(True), w, b, "gelu_tanh")
    (gt,) = torch.autograd.grad(yt, x0, dy)
    for name, base, view in (("strided", wide, lambda t: t[:, :k]), ("odd offset", odd, lambda t: t[1:].view(m, k))):
        base = base.detach().requires_grad_(True)
        x = view(base)
        before = launches()
        y = ops.linear(x, w, b, "gelu_tanh")
        (g,) = torch.autograd.grad(y, base, dy)
        assert_ran(before, LINEAR, name)
        within_torch_error(f"linear {name} out seed={seed}", rel_err(y, y64), rel_err(yt, y64))
        within_torch_error(f"linear {name} dx seed={seed}", rel_err(view(g), g64), rel_err(gt, g64))
    xe = x0.detach().requires_grad_(True)
    ops.linear(xe, w, b, "gelu_tanh").sum().backward()  # dy: an expand of one scalar
    xe64 = x0.detach().double().requires_grad_(True)
    ops.linear_reference(xe64, w.double(), b.double(), "gelu_tanh").sum().backward()
    xet = x0.detach().requires_grad_(True)
    ops.linear_reference(xet, w, b, "gelu_tanh").sum().backward()
    within_torch_error(f"linear expanded dy seed={seed}", rel_err(xe.grad, xe64.grad), rel_err(xet.grad, xe64.grad))


def test_double_backward_is_a_clear_error():
    x, w = leaves(rand(16, 64, dtype=torch.bfloat16), rand(32, 64, dtype=torch.bfloat16))
    y = ops.linear(x, w, None, "gelu_tanh")
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="coda.linear: double backward is not supported"):
        dx.sum().backward()


@pytest.mark.parametrize("compiled", [False, True])
def test_autocast_fp32_module_like_nn_linear(compiled, seed):
    # fp32 parameters, bf16 compute: the kernels run, bf16 comes out, the
    # gradients are fp32, in eager and under torch.compile alike.
    torch._dynamo.reset()
    ours = coda.nn.Linear(512, 1024, activation="gelu_tanh", device="cuda")
    plain = torch.nn.Linear(512, 1024, device="cuda")
    plain.load_state_dict(ours.state_dict())
    fn = torch.compile(ours, fullgraph=True) if compiled else ours
    x = torch.randn(256, 512, device="cuda")
    before = launches()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(x)
        want = F.gelu(plain(x), approximate="tanh")
    assert_ran(before, LINEAR, "autocast linear")
    assert y.dtype == want.dtype == torch.bfloat16
    assert rel_err(y, want) < 1e-2, seed
    y.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32


def test_compile_fullgraph_mlp_inductor(seed):
    torch._dynamo.reset()
    mlp = coda.nn.MLP(1024, 4096, activation="gelu_tanh", device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(mlp, fullgraph=True)
    x = rand(4, 512, 1024, dtype=torch.bfloat16).requires_grad_(True)
    before = launches()
    y = compiled(x, residual=x)
    y.float().square().mean().backward()
    assert_ran(before, mlp_programs("gelu_tanh", True), "compiled mlp")
    g = x.grad.clone()
    x.grad = None
    y_eager = mlp(x, residual=x)
    y_eager.float().square().mean().backward()
    assert rel_err(y, y_eager) < 1e-6 and rel_err(g, x.grad) < 1e-6


def test_opcheck_on_gpu():
    bf = torch.bfloat16
    x, w, b = rand(64, 256, dtype=bf), rand(512, 256, dtype=bf), rand(512, dtype=bf)
    r, h = rand(64, 512, dtype=bf), rand(64, 512, dtype=bf)
    check_op(torch.ops.coda.linear.default, (x, w, b, r, 1, True))
    check_op(torch.ops.coda.linear.default, (x, w, None, None, 0, False))
    check_op(torch.ops.coda.linear_backward.default, (r, x, w, h, 1, [True, True, True]))
    check_op(torch.ops.coda.linear_backward.default, (r, x, w, None, 0, [True, False, False]))
    w1, w2 = rand(1024, 256, dtype=bf), rand(256, 1024, dtype=bf)
    check_op(torch.ops.coda.mlp.default, (x, w1, None, w2, None, x.clone(), 4, True))
    h1, a1 = rand(64, 1024, dtype=bf), rand(64, 1024, dtype=bf)
    check_op(torch.ops.coda.mlp_backward.default, (x, x, w1, w2, h1, a1, 1, [True, True, True, True, True]))
    check_op(torch.ops.coda.mlp_backward.default, (x, x, w1, w2, a1, a1, 0, [False, True, False, True, False]))


def test_kernel_ops_check_their_shapes():
    x = rand(64, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.coda.linear(x, rand(512, 128, dtype=torch.bfloat16), None, None, 0, False)
    with pytest.raises(RuntimeError, match="pre_act must be"):
        torch.ops.coda.linear_backward(rand(64, 512, dtype=torch.bfloat16), x, rand(512, 256, dtype=torch.bfloat16),
                                       None, 1, [True, True, False])


def test_poisoning_reaches_new_tensors():
    poison_cuda_allocator(1 << 24)
    t = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    assert torch.isnan(t.float()).all()


def test_kernel_from_a_fresh_thread():
    # A thread that has made no CUDA call has no current context, as autograd's
    # backward threads may not; CUTLASS's TMA descriptors need one.
    x, w = rand(256, 512, dtype=torch.bfloat16), rand(384, 512, dtype=torch.bfloat16, scale=512**-0.5)
    out = {}

    def work():
        out["y"] = torch.ops.coda.linear(x, w, None, None, 0, False)[0]

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    ref = x.double() @ w.double().t()
    within_torch_error("linear from a fresh thread", rel_err(out["y"], ref), rel_err(x @ w.t(), ref))


def test_backward_launches_no_fills():
    # A fill kernel in a backward is a zero gradient materialized for an
    # output nobody differentiates: 512 MB each in the MLP's backward at
    # 16,384 tokens, which the backward never read.
    from torch.profiler import ProfilerActivity, profile
    x = rand(512, 1024, dtype=torch.bfloat16)
    mlp = coda.nn.MLP(1024, 4096, activation="gelu_tanh", device="cuda", dtype=torch.bfloat16)
    norm_mlp = coda.nn.LayerNormMLP(1024, 4096, device="cuda", dtype=torch.bfloat16)
    qkv = coda.nn.LayerNormLinear(1024, 3072, device="cuda", dtype=torch.bfloat16)
    for module in (mlp, norm_mlp, qkv):
        xi = x.detach().clone().requires_grad_(True)
        y = module(xi)
        dy = torch.randn_like(y)
        y.backward(dy)  # warm up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            module(xi).backward(dy)
            torch.cuda.synchronize()
        fills = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and "FillFunctor" in e.name]
        assert not fills, f"{type(module).__name__}: {fills}"


def test_every_configuration_the_rule_can_pick(seed):
    # Each configuration a program is built in, forced, on the ops that run it.
    configs = sorted({c for cs in _kernels.kernels_built().values() for c in cs})
    m, d, f = 777, 512, 1536
    inputs = mlp_inputs(m, d, f, torch.bfloat16)
    dy = rand(m, d, dtype=torch.bfloat16)
    for config in configs:
        with _kernels.override_kernel(config):
            before = launches()
            check_against_torch(f"mlp config {config} seed={seed}",
                                lambda x, w1, b1, w2, b2, r: ops.mlp(x, w1, b1, w2, b2, "gelu_tanh", r),
                                lambda x, w1, b1, w2, b2, r: ops.mlp_reference(x, w1, b1, w2, b2, "gelu_tanh", r),
                                inputs, dy, 8 * m * f * 2, programs=mlp_programs("gelu_tanh", True))
            ran = launched_since(before)
        name = _kernels.kernel_configs("linear_act")[config]
        assert ran.get(f"linear_act/{name}", 0) > 0, ran
