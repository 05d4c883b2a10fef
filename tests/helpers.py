"""Shared test helpers: error norms, poisoning, the launch counters."""

import gc

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in out makes it NaN."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def poison_cuda_allocator(nbytes: int) -> None:
    """Fill every free block of the caching allocator with NaN, and leave a new one of
    `nbytes` beside them, so outputs a kernel allocates and then fails to write read as
    NaN (0xFFFF is NaN in bf16 and fp16). empty_cache releases only segments with
    nothing live in them: a free block left in a segment an earlier test still holds a
    tensor of would serve a request first (best fit) unpoisoned (956e967, e128038)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    device, stream = torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream
    free = sorted((b["size"] for seg in torch.cuda.memory_snapshot()
                   if seg.get("device", device) == device and seg.get("stream", stream) == stream
                   for b in seg["blocks"] if b["state"] == "inactive"),
                  reverse=True)  # largest first: each request takes a block of its own
    held = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in free]
    held.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
    for t in held:
        t.fill_(0xFF)
    del held, t


# (name, coda's error, torch's error) of every comparison this session; conftest
# writes them to a stamped errors file in $CODA_ERRORS_DIR when set (the GPU check keeps them).
MEASURED = []


def within_torch_error(name: str, err: float, torch_err: float, slack: float = 1.1, numel: int = 0) -> None:
    """The fused result may be no worse than the unfused torch path in the same
    dtype; `slack` absorbs rounding luck on a single draw.

    With `numel` (the elements the norms run over), the slack grows by
    2/sqrt(numel): a relative error over n roundings is itself an estimate
    whose relative spread is about 1/sqrt(n), so two of them over 512
    elements (a one-row gradient) differ by several percent by luck alone."""
    MEASURED.append((name, err, torch_err))
    assert err == err, f"{name}: NaN in output (an element was not written?)"
    if numel > 0:
        slack += 2.0 / numel**0.5
    bound = slack * torch_err + 1e-7
    assert err <= bound, f"{name}: error {err:.3e} exceeds torch's {torch_err:.3e} (bound {bound:.3e})"


def launches() -> dict:
    from coda import _kernels
    return _kernels.launch_counts()


def launched_since(before: dict) -> dict:
    """{"program/config": launches} of the kernels that ran since `before`."""
    return {k: v - before.get(k, 0) for k, v in launches().items() if v > before.get(k, 0)}


def programs_since(before: dict) -> set:
    """The programs ("linear_act", ...) of the kernels launched since `before`."""
    return {key.split("/")[0] for key in launched_since(before)}


def assert_ran(before: dict, programs, name: str = "") -> None:
    """Each of `programs` (csrc/kernels/table.def's names) launched since `before`: the op ran its kernels,
    not its reference path or cuBLAS alone."""
    assert programs, f"{name}: name the programs that must run"
    ran = programs_since(before)
    missing = set(programs) - ran
    assert not missing, f"{name}: {sorted(missing)} did not run (ran {sorted(ran)})"


def check_op(op, args) -> None:
    """torch.library.opcheck, then the fake kernel's output shapes against the
    real outputs' (opcheck runs the fake kernel but does not compare shapes)."""
    torch.library.opcheck(op, args)
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*pytree.tree_map_only(torch.Tensor, mode.from_tensor, args))
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real], op


def rms_stats_rows(x, eps):
    """(2, m) float32 RMSNorm stats, rows 16 bytes apart as the C++ ops allocate them."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    m = x2.shape[0]
    out = torch.zeros(2, (m + 3) // 4 * 4)[:, :m]
    out[1] = torch.rsqrt(x2.square().mean(-1) + eps)
    return out


def cpu_stand_in(monkeypatch, impls):
    """The built coda ops `impls` names run its CPU functions instead (a
    generator for a fixture: the registration lasts until it resumes), and
    every call takes the kernel path: what is checked is the op call, its
    fakes and its C++ autograd, not the kernels."""
    import pytest
    from coda import _kernels
    if not _kernels.available():
        pytest.skip(f"the extension coda._C is not built ({_kernels.LOAD_ERROR})")
    lib = torch.library.Library("coda", "IMPL")
    for name, fn in impls.items():
        lib.impl(name, fn, "CPU")
    monkeypatch.setattr(_kernels, "use_kernels", lambda op, x, dtypes, sizes, unsupported=None: unsupported is None)
    yield
    lib._destroy()


def compiled_once(fn):
    """fn() traced whole by torch.compile (aot_eager: the fakes give every
    output's shape, dtype and strides), from a fresh dynamo cache."""
    torch._dynamo.reset()
    try:
        return torch.compile(fn, fullgraph=True, backend="aot_eager")()
    finally:
        torch._dynamo.reset()


def leaves(*ts):
    """Leaf aliases of ts: their own grads, the same memory (a view stays a view)."""
    return [None if t is None else t.detach().requires_grad_(True) for t in ts]


def run(fn, inputs, dy):
    """Forward and backward; returns (y, [grad of each input])."""
    ins = leaves(*inputs)
    y = fn(*ins)
    y.backward(dy)
    return y.detach(), [None if t is None else t.grad for t in ins]


def check_linear_cross_entropy(name, inputs, target, dl=None, tokens=None, **kw):
    """coda.ops.linear_cross_entropy and torch's unfused path in the inputs' dtype (F.linear, then
    F.cross_entropy on the logits), each against float64, per output and gradient. inputs: x, weight and
    optionally bias and norm_weight (None: absent); on a GPU the allocator is poisoned first. tokens: the rows a
    gradient's error runs over (the slack's numel). Returns coda's loss and gradients."""
    from coda import ops
    only_coda = ("chunk_tokens", "chunk_vocab", "recompute")
    names = ["x", "weight", "bias", "norm_weight"][:len(inputs)]

    def call(impl):
        kwargs = kw if impl is ops.linear_cross_entropy else {k: v for k, v in kw.items() if k not in only_coda}

        def fn(*ts):
            args = dict(zip(names, ts))
            return impl(args["x"], args["weight"], target, args.get("bias"), norm_weight=args.get("norm_weight"),
                        **kwargs)
        return fn

    device = inputs[0].device
    if dl is None:
        dl = (torch.randn(target.shape, device=device) if kw.get("reduction", "mean") == "none"
              else torch.tensor(1.7, device=device))
    if device.type == "cuda":
        m, v = inputs[0].reshape(-1, inputs[0].shape[-1]).shape[0], inputs[1].shape[0]
        poison_cuda_allocator(4 * m * v)
    loss, grads = run(call(ops.linear_cross_entropy), inputs, dl)
    loss64, grads64 = run(call(ops.linear_cross_entropy_reference),
                                     [None if t is None else t.double() for t in inputs], dl.double())
    losst, gradst = run(call(ops.linear_cross_entropy_reference), inputs, dl)
    within_torch_error(f"{name} loss", rel_err(loss, loss64), rel_err(losst, loss64), numel=loss64.numel())
    for nm, g, g64, gt in zip(names, grads, grads64, gradst):
        if g64 is not None:
            assert g.dtype == gt.dtype and g.shape == gt.shape, (nm, g.dtype, g.shape)
            numel = g64.numel() if tokens is None else min(g64.numel(), tokens * g64.shape[-1])
            # recompute=False too: its dW sums over the chunks in float32 and is rounded once, as torch's
            within_torch_error(f"{name} d{nm}", rel_err(g, g64), rel_err(gt, g64), numel=numel)
    return loss, grads
