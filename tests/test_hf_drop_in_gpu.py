"""test_hf_drop_in_cpu's cases on the GPU, on coda's kernels (bf16 models at
test_convergence_gpu's sizes): packed rows against the unpatched model's packed rows,
decode steps over the KV cache against the whole sequence, and a whole patched training
step (forward and backward) captured in a CUDA graph, by hand and by
torch.compile(mode="reduce-overhead"): no host sync and nothing a capture refuses."""

import copy

import pytest
import torch

import coda
from helpers import launches, rel_err
from test_convergence_gpu import LOSS_TOL, check_ran, fallbacks, sizes  # noqa: F401  (fallbacks: a fixture)
from test_hf_drop_in_cpu import packed
from test_hf_patch_cpu import build, hf_grads, linear_cross_entropy  # noqa: F401  (autouse: stand-in)

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "qwen3", "phi3", "gemma3", "gpt2"]


def bf16_pair(family):
    plain = build(family, 1000, **sizes(family)).cuda().bfloat16()
    return plain, coda.patch(copy.deepcopy(plain))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_on_the_kernels(family, fallbacks):
    plain, model = bf16_pair(family)
    ids, positions, labels, parts = packed(docs=(200, 136, 176))
    ids, positions, labels = ids.cuda(), positions.cuda(), labels.cuda()
    before = launches()
    loss = model(ids, position_ids=positions, labels=labels).loss
    loss.backward()
    check_ran(family, before, fallbacks)
    want = plain(ids, position_ids=positions, labels=labels).loss
    assert abs(loss.item() - want.item()) <= LOSS_TOL * want.item()
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits.float()
        one_by_one = torch.cat([model(p.cuda()).logits.float() for p in parts], 1)
        assert rel_err(logits, one_by_one) <= 2e-2  # bf16: other row counts, other roundings


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_over_the_cache(family):
    _, model = bf16_pair(family)
    model.eval()
    ids = torch.randint(3, 1000, (2, 96), device="cuda")
    with torch.no_grad():
        out = model(ids, use_cache=True)
        steps = []
        nxt = out.logits[:, -1:].argmax(-1)
        seq, cache = ids, out.cache
        for _ in range(4):  # one token at a time: M = batch rows in every GEMM
            seq = torch.cat([seq, nxt], 1)
            step = model(nxt, cache=cache)
            steps.append(step.logits.float())
            nxt = step.logits[:, -1:].argmax(-1)
        whole = model(seq).logits[:, -4:].float()
        assert rel_err(torch.cat(steps, 1), whole) <= 2e-2
        gen = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        assert gen.shape == (2, 104)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_step_captured_in_a_cuda_graph(family, fallbacks):
    _, model = bf16_pair(family)
    ids = torch.randint(0, 250, (4, 128), device="cuda")
    mask = torch.ones_like(ids)  # what a Trainer passes

    def step():
        model(ids, attention_mask=mask, labels=ids).loss.backward()

    model(ids, attention_mask=mask, labels=ids).loss.backward()
    want = {k: v.float() for k, v in hf_grads(model).items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    before = launches()
    with torch.cuda.graph(graph):
        step()
    check_ran(family, before, fallbacks)
    for p in model.parameters():
        p.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    got = hf_grads(model)
    for k in want:
        assert rel_err(got[k].float(), want[k]) <= 1e-2, k


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_reduce_overhead_trains_as_eager(family, fallbacks):
    losses = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = coda.patch(build(family, 1000, **sizes(family)).cuda())
        opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
        run = model
        if graphed:
            torch._dynamo.reset()
            run = torch.compile(model, mode="reduce-overhead")
        ids = torch.randint(0, 250, (4, 128), device="cuda")
        before = launches()
        losses[graphed] = []
        for _ in range(4):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = run(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[graphed].append(loss.item())
        check_ran(family, before, fallbacks)
    torch._dynamo.reset()
    for a, b in zip(losses[True], losses[False]):
        assert abs(a - b) <= LOSS_TOL * b, losses
