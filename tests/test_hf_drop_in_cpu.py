"""What real Hugging Face training and evaluation pass a patched model, on the CPU in
float32 against the unpatched model (relative error ≤ 1e-5, the same math summed in
another order): packed sequences (position_ids restarting at 0, as
DataCollatorWithFlattening makes them) against the same documents run one by one,
left padding, 4-D masks, generate() with a KV cache, output_hidden_states, and the
options a patched forward reads from the config."""

import copy

import pytest
import torch

import coda
from helpers import rel_err
from test_hf_patch_cpu import FAMILIES, TOL, assert_state_close, build, hf_grads, pair, tokens

transformers = pytest.importorskip("transformers")

DOCS = (9, 6, 5)  # Mistral's window is 8: the first document is longer


def packed(docs=DOCS, vocab=1000):
    """One row of documents back to back: (ids, position_ids, labels, the documents' ids),
    labels as DataCollatorWithFlattening makes them (each document's first token -100)."""
    parts = [torch.randint(3, vocab, (1, n)) for n in docs]
    ids = torch.cat(parts, 1)
    positions = torch.cat([torch.arange(n) for n in docs])[None]
    labels = ids.clone()
    labels[positions == 0] = -100
    return ids, positions, labels, parts


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_are_the_documents_one_by_one(family):
    plain, model = pair(family)
    ids, positions, labels, parts = packed()
    n = int((labels[:, 1:] != -100).sum())
    loss = model(ids, position_ids=positions, labels=labels, num_items_in_batch=n).loss
    loss.backward()
    # the same documents, one forward each, in the unpatched model: the loss and the gradients add up
    want, start = 0.0, 0
    for part in parts:
        part_labels = labels[:, start: start + part.shape[1]]
        start += part.shape[1]
        doc_loss = plain(part, labels=part_labels, num_items_in_batch=n).loss
        doc_loss.backward()
        want += doc_loss.item()
    assert abs(loss.item() - want) <= TOL * want
    assert_state_close(hf_grads(model), hf_grads(plain), what=f"{family} packed ")
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits
        one_by_one = torch.cat([plain(part).logits for part in parts], 1)
        assert rel_err(logits, one_by_one) <= TOL
        # and as transformers itself runs the packed row (its mask functions detect the packing)
        assert rel_err(logits, plain(ids, position_ids=positions).logits) <= TOL


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_flash_kwargs_of_the_collator_are_accepted(family):
    # DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds cu_seq_lens_* and max_length_*: the position_ids
    # say the same, and they make the mask
    _, model = pair(family)
    ids, positions, labels, _ = packed()
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": ids[0, :9].tolist()}, {"input_ids": ids[0, 9:15].tolist()},
                      {"input_ids": ids[0, 15:].tolist()}])
    assert torch.equal(batch["position_ids"], positions) and torch.equal(batch["labels"], labels)
    with torch.no_grad():
        want = model(ids, position_ids=positions, labels=labels).loss
        assert rel_err(model(**batch).loss, want) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding(family):
    plain, model = pair(family)
    ids = tokens(3, 12)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    keep = mask.bool()
    labels = ids.masked_fill(~keep, -100)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate() makes them
    for kw in (dict(), dict(position_ids=position_ids)):
        ref = plain(ids, attention_mask=mask, labels=labels, **kw)
        out = model(ids, attention_mask=mask, labels=labels, **kw)
        assert abs(out.loss.item() - ref.loss.item()) <= TOL * ref.loss.item()
        with torch.no_grad():
            a, b = model(ids, attention_mask=mask, **kw).logits, plain(ids, attention_mask=mask, **kw).logits
        assert rel_err(a[keep], b[keep]) <= TOL and torch.isfinite(a).all()
        plain.zero_grad(), model.zero_grad()
        ref.loss.backward()
        out.loss.backward()
        assert_state_close(hf_grads(model), hf_grads(plain), what=f"{family} left padding ")


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_4d_masks_as_given(family):
    # a 4-D mask is transformers' own (or a user's), taken as given: boolean (True attends) or additive
    plain, model = pair(family)
    ids = tokens(2, 12)
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()
    allowed[6:, :6] = False  # two documents of 6
    allowed = allowed.expand(2, 1, 12, 12)
    additive = torch.zeros(2, 1, 12, 12).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        for mask in (allowed, additive):
            assert rel_err(model(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits) <= TOL
    if family != "gpt2":  # GPT-2 views any mask of fewer dimensions as (batch, -1), as Hugging Face's GPT-2 does
        with pytest.raises(ValueError, match="attention_mask"):
            model(ids, attention_mask=torch.ones(2, 1, 12))


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_a_kv_cache(family):
    # greedy decoding with the model's KV cache: the same tokens as the unpatched model, left-padded batch included
    plain = build(family).eval()
    model = coda.patch(copy.deepcopy(plain))
    ids = tokens(2, 7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    greedy = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    for kw in (dict(), dict(attention_mask=mask)):
        want = plain.generate(ids, **kw, **greedy)
        assert torch.equal(model.generate(ids, **kw, **greedy), want)
        assert torch.equal(model.generate(ids, **kw, **(greedy | dict(use_cache=False))), want)
    # the cache is filled and read: a step over the cache gives the logits of the whole sequence's last position
    with torch.no_grad():
        first = model(ids, use_cache=True)
        assert first.cache.get_seq_length() == ids.shape[1]
        nxt = first.logits[:, -1:].argmax(-1)
        step = model(nxt, cache=first.cache).logits
        whole = plain(torch.cat([ids, nxt], 1)).logits[:, -1:]
        assert rel_err(step, whole) <= TOL


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3", "gpt2"])
def test_output_hidden_states(family):
    plain, model = pair(family)
    ids = tokens()
    want = plain(ids, output_hidden_states=True)
    for kw in (dict(), dict(labels=ids)):
        got = model(ids, output_hidden_states=True, **kw)
        assert len(got.hidden_states) == len(want.hidden_states)
        for i, (a, b) in enumerate(zip(got.hidden_states, want.hidden_states)):
            assert rel_err(a, b) <= TOL, i
    # a loss on a hidden state trains through it (distillation, probing)
    plain.zero_grad()
    want.hidden_states[1].square().mean().backward()
    model(ids, output_hidden_states=True).hidden_states[1].square().mean().backward()
    assert_state_close(hf_grads(model), hf_grads(plain), what="through a hidden state ")
    base = model.base_model(ids, output_hidden_states=True)
    assert rel_err(base.hidden_states[-1], base.last_hidden_state) == 0.0


def test_config_options():
    # use_cache=None reads the config in eval mode only; a training forward fills no cache
    _, model = pair("llama")
    model.config.use_cache = True
    ids = tokens()
    assert model.train()(ids, labels=ids).cache is None
    assert model.eval()(ids).cache.get_seq_length() == ids.shape[1]
    assert model.eval()(ids, use_cache=False).cache is None
    model.config.output_hidden_states = True
    assert len(model(ids).hidden_states) == model.config.num_hidden_layers + 1
    model.config.output_hidden_states = False
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(ids, output_attentions=True)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3", "gpt2"])
def test_a_step_traces_whole(family):
    # torch.compile(fullgraph=True): no host sync and no branch on the data in a patched step (what CUDA-graph
    # capture and mode="reduce-overhead" need), with the all-ones mask a Trainer passes and with packed rows
    _, model = pair(family)
    ids = tokens(2, 20)
    packed_ids, positions, labels, _ = packed()
    calls = [dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids),
             dict(input_ids=packed_ids, position_ids=positions, labels=labels)]
    want = []
    for kw in calls:
        model(**kw).loss.backward()
        want.append(hf_grads(model))
        model.zero_grad()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for kw, grads in zip(calls, want):
            compiled(**kw).loss.backward()
            assert_state_close(hf_grads(model), grads, what="compiled ")
            model.zero_grad()
    finally:
        torch._dynamo.reset()


def test_int32_labels():
    plain, model = pair("llama")
    ids = tokens()
    assert rel_err(model(ids, labels=ids.int()).loss, plain(ids, labels=ids).loss) <= TOL
