"""GPU tests: every output and gradient against float64, each within the error
of the unfused torch path in the same dtype, on fresh random inputs, with
outputs poisoned before each run. Skipped without an sm_90 GPU."""

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import reference
from helpers import poison_cuda_allocator, rel_err, within_torch_error

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
ACTIVATIONS = [None, "gelu_tanh", "gelu", "relu", "silu"]


def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


def kink_safe(activation, x, w, b):
    """For ReLU, x, w and b moved onto grids fine enough to keep them random
    and coarse enough that x·wᵀ + b sums exactly in fp32 (x in 1/16ths, w in
    1/512ths: every term a multiple of 2^-13, and |x·wᵀ| < 2^5 needs 18 of
    fp32's 24 bits), whatever the order of the sums. ReLU' jumps at 0, so a
    pre-activation within fp32 rounding of 0 may take the other side in one
    path than in float64, and one such element costs dx as much as all of
    bf16's rounding (a 1000x3000 test failed at 1.43x torch's error on one
    draw). On the grid every path, float64 included, sees the same signs;
    the other activations are smooth."""
    if activation != "relu":
        return x, w, b
    def grid(t, step):
        return None if t is None else (t.float() / step).round().mul(step).to(t.dtype)
    return grid(x, 1 / 16), grid(w, 1 / 512), grid(b, 1 / 16)


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def run(fn, inputs, dy):
    """Forward and backward; returns (y, [grad of each input])."""
    ins = leaves(*inputs)
    y = fn(*ins)
    y.backward(dy)
    return y.detach(), [None if t is None else t.grad for t in ins]


def check_against_torch(name, fn, ref_fn, inputs, dy, out_bytes, check_grads=True):
    """coda (fn) and the unfused torch path (ref_fn) in the inputs' dtype, both
    against ref_fn in float64 on the same inputs."""
    poison_cuda_allocator(out_bytes)
    if check_grads:
        y, grads = run(fn, inputs, dy)
    else:
        with torch.no_grad():
            y, grads = fn(*inputs), []
    torch.cuda.synchronize()
    y64, grads64 = run(ref_fn, [None if t is None else t.double() for t in inputs], dy.double())
    yt, gradst = run(ref_fn, inputs, dy)
    within_torch_error(f"{name} out", rel_err(y, y64), rel_err(yt, y64), numel=y64.numel())
    for i, (g, g64, gt) in enumerate(zip(grads, grads64, gradst)):
        if g64 is not None:
            within_torch_error(f"{name} grad[{i}]", rel_err(g, g64), rel_err(gt, g64), numel=g64.numel())


LINEAR_SHAPES = [(1000, 1032, 3000), (1, 1032, 3000), (7, 256, 512), (32768, 1024, 1024)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", LINEAR_SHAPES)
@pytest.mark.parametrize("activation", ["gelu_tanh", None])
def test_linear_shapes(m, k, n, activation, dtype, seed):
    x, w, b = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype, scale=k**-0.5), rand(n, dtype=dtype)
    dy = rand(m, n, dtype=dtype)
    check_against_torch(f"linear seed={seed}", lambda x, w, b: coda.ops.linear(x, w, b, activation),
                        lambda x, w, b: reference.linear_ref(x, w, b, activation), [x, w, b], dy, 6 * m * n * 2)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_activations(activation, bias, seed):
    m, k, n, dtype = 1000, 1032, 3000, torch.bfloat16
    x, w = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype, scale=k**-0.5)
    b = rand(n, dtype=dtype) if bias else None
    x, w, b = kink_safe(activation, x, w, b)
    dy = rand(m, n, dtype=dtype)
    check_against_torch(f"linear {activation} seed={seed}", lambda x, w, b: coda.ops.linear(x, w, b, activation),
                        lambda x, w, b: reference.linear_ref(x, w, b, activation), [x, w, b], dy, 6 * m * n * 2)


def test_linear_inference_leading_dims(seed):
    x, w, b = rand(4, 250, 512, dtype=torch.bfloat16), rand(1024, 512, dtype=torch.bfloat16, scale=512**-0.5), \
        rand(1024, dtype=torch.bfloat16)
    poison_cuda_allocator(8 * 1000 * 1024 * 2)
    with torch.no_grad():
        y = coda.ops.linear(x, w, b, "silu")
    y64 = reference.linear_ref(x.double(), w.double(), b.double(), "silu")
    yt = reference.linear_ref(x, w, b, "silu")
    assert y.shape == (4, 250, 1024)
    within_torch_error(f"linear leading dims seed={seed}", rel_err(y, y64), rel_err(yt, y64))


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
    check_against_torch(f"mlp seed={seed}",
                        lambda x, w1, b1, w2, b2, r: coda.ops.mlp(x, w1, b1, w2, b2, "gelu_tanh", r),
                        lambda x, w1, b1, w2, b2, r: reference.mlp_ref(x, w1, b1, w2, b2, "gelu_tanh", r),
                        inputs, dy, 8 * m * f * 2)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias,residual", [(True, True), (False, False)])
def test_mlp_activations(activation, bias, residual, seed):
    m, d, f, dtype = 1000, 1032, 3000, torch.bfloat16
    inputs = mlp_inputs(m, d, f, dtype, bias=bias, residual=residual)
    inputs[:3] = kink_safe(activation, *inputs[:3])
    dy = rand(m, d, dtype=dtype)
    check_against_torch(f"mlp {activation} seed={seed}",
                        lambda x, w1, b1, w2, b2, r: coda.ops.mlp(x, w1, b1, w2, b2, activation, r),
                        lambda x, w1, b1, w2, b2, r: reference.mlp_ref(x, w1, b1, w2, b2, activation, r),
                        inputs, dy, 8 * m * f * 2)


def test_mlp_fallback_for_unaligned_features(seed):
    # d = 1030 is not a multiple of 8: the reference path must answer, correctly.
    inputs = mlp_inputs(64, 1030, 512, torch.bfloat16)
    dy = rand(64, 1030, dtype=torch.bfloat16)
    assert not coda._kernels.usable(inputs, [1030, 512, 1030])
    check_against_torch(f"mlp unaligned seed={seed}",
                        lambda x, w1, b1, w2, b2, r: coda.ops.mlp(x, w1, b1, w2, b2, "gelu_tanh", r),
                        lambda x, w1, b1, w2, b2, r: reference.mlp_ref(x, w1, b1, w2, b2, "gelu_tanh", r),
                        inputs, dy, 1 << 20)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dgrad_epilogue_alone(activation, seed):
    # dx = (dy·w) ⊙ act'(h), dbias = Σ_rows dx, straight from the kernel op.
    m, k, n = 1000, 1024, 3000
    dy, w, h = rand(m, k, dtype=torch.bfloat16), rand(k, n, dtype=torch.bfloat16, scale=k**-0.5), \
        rand(m, n, dtype=torch.bfloat16)
    act = coda._activations.code(activation)
    poison_cuda_allocator(4 * m * n * 2)
    dx, db = torch.ops.coda.gemm_dgrad(dy, w, h, act, True)
    ref = (dy.double() @ w.double()) * coda._activations.grad(h.double(), act)
    unfused = reference.act_backward(dy @ w, h, act)
    within_torch_error(f"dgrad dx {activation} seed={seed}", rel_err(dx, ref), rel_err(unfused, ref))
    within_torch_error(f"dgrad dbias {activation} seed={seed}", rel_err(db, ref.sum(0)),
                       rel_err(reference.bias_grad(unfused), ref.sum(0)))


def test_compile_fullgraph_mlp_inductor(seed):
    torch._dynamo.reset()
    mlp = coda.nn.MLP(1024, 4096, activation="gelu_tanh", device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(mlp, fullgraph=True)
    x = rand(4, 512, 1024, dtype=torch.bfloat16).requires_grad_(True)
    y = compiled(x, residual=x)
    y.float().square().mean().backward()
    g = x.grad.clone()
    x.grad = None
    y_eager = mlp(x, residual=x)
    y_eager.float().square().mean().backward()
    assert rel_err(y, y_eager) < 1e-6 and rel_err(g, x.grad) < 1e-6


def test_opcheck_on_gpu():
    x, w, b = rand(64, 256, dtype=torch.bfloat16), rand(512, 256, dtype=torch.bfloat16), rand(512, dtype=torch.bfloat16)
    r = rand(64, 512, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.coda.gemm_linear.default, (x, w, b, r, 1, True))
    torch.library.opcheck(torch.ops.coda.gemm_dgrad.default, (r, w, x.new_empty(64, 256).normal_(), 1, True))
    torch.library.opcheck(torch.ops.coda.gemm_wgrad.default, (r, x))
    torch.library.opcheck(torch.ops.coda.linear.default, (x.requires_grad_(True), w, b, 2, True))
    torch.library.opcheck(torch.ops.coda.mlp.default,
                          (x, rand(1024, 256, dtype=torch.bfloat16), None, rand(256, 1024, dtype=torch.bfloat16),
                           None, x.detach().clone(), 4, True))


def test_kernel_errors_are_clear():
    x = rand(64, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight has dtype Half, expected BFloat16"):
        torch.ops.coda.gemm_linear(x, rand(512, 256, dtype=torch.float16), None, None, 0, False)
    with pytest.raises(RuntimeError, match="misaligned"):
        torch.ops.coda.gemm_linear(x[:, :250], rand(512, 250, dtype=torch.bfloat16), None, None, 0, False)
    with pytest.raises(RuntimeError, match="pre_act is required"):
        torch.ops.coda.gemm_dgrad(x, rand(256, 512, dtype=torch.bfloat16), None, 1, False)


def test_poisoning_reaches_new_tensors():
    poison_cuda_allocator(1 << 24)
    t = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    assert torch.isnan(t.float()).all()


def test_kernel_from_a_fresh_thread():
    # A thread that has made no CUDA call has no current context, as autograd's
    # backward threads may not; CUTLASS's TMA descriptors need one.
    import threading
    x, w = rand(256, 512, dtype=torch.bfloat16), rand(384, 512, dtype=torch.bfloat16, scale=512**-0.5)
    out = {}

    def work():
        out["y"] = torch.ops.coda.gemm_linear(x, w, None, None, 0, False)[0]

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    ref = x.double() @ w.double().t()
    within_torch_error("linear from a fresh thread", rel_err(out["y"], ref), rel_err(x @ w.t(), ref))


def test_backward_launches_no_fills():
    # A fill kernel in a backward is a zero gradient materialized for a state
    # output (ops._state_outputs): two 512 MB fills in the MLP's backward at
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


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_mlp_module(normalization, seed):
    # The norm runs unfused for now; the MLP after it is coda's fused one.
    m = coda.nn.LayerNormMLP(1024, 4096, normalization=normalization, device="cuda", dtype=torch.bfloat16)
    x = rand(512, 1024, dtype=torch.bfloat16) + 10 * rand(512, 1, dtype=torch.bfloat16)
    dy = rand(512, 1024, dtype=torch.bfloat16)
    params = [m.norm.weight, getattr(m.norm, "bias", None), m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias]

    def ref(x, nw, nb, w1, b1, w2, b2):
        eps = m.norm.eps
        h = F.layer_norm(x, (1024,), nw, nb, eps) if normalization == "LayerNorm" else F.rms_norm(x, (1024,), nw, eps)
        return reference.mlp_ref(h, w1, b1, w2, b2, "gelu_tanh", x)

    def fused(x, nw, nb, w1, b1, w2, b2):
        tensors = {"norm.weight": nw, "fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2}
        if nb is not None:
            tensors["norm.bias"] = nb
        return torch.func.functional_call(m, tensors, (x,), {"residual": x})

    inputs = [x] + [None if p is None else p.detach() for p in params]
    check_against_torch(f"LayerNormMLP {normalization} seed={seed}", fused, ref, inputs, dy, 8 * 512 * 4096 * 2)
