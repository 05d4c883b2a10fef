"""GPU tests of coda.ops.dropout_residual (GPT-2's residual dropout, its add and the next norm's
statistics in one pass): the kept fraction, per column and in adjacent pairs, within 6 standard
deviations of keep and keep²; kept elements x / keep and dropped ones the residual exactly; a seed
fixes the mask and a new draw changes it; the backward regenerates the forward's mask; the
statistics are those of the result as stored; a captured CUDA graph draws anew on each replay;
a patched GPT-2 with resid_pdrop 0.1 trains on the kernels (strict). Skipped without an sm_90 GPU."""

import math

import pytest
import torch

from coda import ops
from test_gpu import rand, strict  # noqa: F401  (strict: autouse)

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def _kept(p, m=4096, n=1024, dtype=BF16):
    x = torch.full((m, n), 3.0, device="cuda", dtype=dtype)
    r = torch.zeros(m, n, device="cuda", dtype=dtype)
    y = ops.dropout_residual(x, r, p)
    return y, (y != 0)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction_per_column_and_in_pairs(p):
    keep = 1 - p
    y, kept = _kept(p)
    k = kept.double()
    n_all = k.numel()
    assert abs(k.mean().item() - keep) < 6 * math.sqrt(keep * p / n_all)
    col = k.mean(0)
    assert (col - keep).abs().max().item() < 6 * math.sqrt(keep * p / k.shape[0])
    pairs = (k[:, 0::2] * k[:, 1::2]).mean().item()  # elements of one Philox block and neighbours
    assert abs(pairs - keep * keep) < 6 * math.sqrt(keep**2 * (1 - keep**2) / (n_all / 2))
    rows = (k[0::2] * k[1::2]).mean().item()  # the same column of adjacent rows
    assert abs(rows - keep * keep) < 6 * math.sqrt(keep**2 * (1 - keep**2) / (n_all / 2))
    # kept: 3 / keep rounded once; dropped: the residual, 0
    torch.testing.assert_close(y[kept].float(), torch.full_like(y[kept], 3.0 / keep).float(), rtol=2**-8, atol=0)


def test_a_seed_fixes_the_mask_and_a_new_draw_changes_it():
    torch.manual_seed(11)
    _, a = _kept(0.1, 512, 512)
    _, b = _kept(0.1, 512, 512)
    torch.manual_seed(11)
    _, c = _kept(0.1, 512, 512)
    assert torch.equal(a, c) and not torch.equal(a, b)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_backward_regenerates_the_mask(dtype, seed):
    m, n, p = 1000, 1032, 0.2
    x = (rand(m, n, dtype=dtype).abs() + 0.5).requires_grad_(True)  # nonzero: kept = (y != r)
    r = rand(m, n, dtype=dtype).requires_grad_(True)
    y = ops.dropout_residual(x, r, p)
    kept = y.detach() != r.detach()
    dy = rand(m, n, dtype=dtype)
    y.backward(dy)
    assert torch.equal(x.grad[~kept], torch.zeros_like(x.grad[~kept]))
    torch.testing.assert_close(x.grad[kept].float(), dy[kept].float() / (1 - p), rtol=2**-8, atol=0)
    assert torch.equal(r.grad, dy)
    dropped_frac = 1 - kept.double().mean().item()
    assert abs(dropped_frac - p) < 6 * math.sqrt(p * (1 - p) / (m * n))


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_statistics_are_the_results(normalization):
    m, n, p, eps = 777, 2048, 0.1, 1e-5
    x, r = rand(m, n, dtype=BF16), rand(m, n, dtype=BF16, scale=4.0)
    y, stats = ops.dropout_residual(x, r, p, normalization, eps)
    yf = y.float()
    if normalization == "LayerNorm":
        var, mean = torch.var_mean(yf, -1, correction=0)
        torch.testing.assert_close(stats[..., 0], mean, rtol=1e-4, atol=1e-4)
    else:
        var = yf.square().mean(-1)
        assert torch.equal(stats[..., 0], torch.zeros_like(var))
    torch.testing.assert_close(stats[..., 1], torch.rsqrt(var + eps), rtol=1e-4, atol=1e-5)


def test_a_captured_graph_draws_anew_on_each_replay():
    x = torch.full((256, 512), 2.0, device="cuda", dtype=BF16)
    r = torch.zeros_like(x)
    out = torch.empty_like(x)
    ops.dropout_residual(x, r, 0.5)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(ops.dropout_residual(x, r, 0.5))
    g.replay()
    first = out.clone()
    g.replay()
    assert not torch.equal(first != 0, out != 0)


def test_patched_gpt2_trains_with_residual_dropout_on_the_kernels():
    transformers = pytest.importorskip("transformers")
    import coda
    config = transformers.GPT2Config(vocab_size=512, n_positions=128, n_embd=256, n_layer=2, n_head=4,
                                     resid_pdrop=0.1, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to("cuda", BF16).train()
    coda.patch(model)
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    losses = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
