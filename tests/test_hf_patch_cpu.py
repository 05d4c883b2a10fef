"""coda.hf.patch / unpatch on tiny Hugging Face models built from configs (LLaMA with
and without tied embeddings, Mistral with a sliding window, Qwen2 with q/k/v biases,
Qwen3 with per-head q/k norms, Phi-3 with fused q/k/v and gate/up, Gemma 3, GPT-2), on the CPU in float32, where every op runs its reference path: state_dict keys,
shapes and values as Hugging Face's; no weight kept twice; loss, logits and every
gradient within float32 rounding of the unpatched model (relative error ≤ 1e-5: the two
differ only in the order of float32 sums); right padding; gradient accumulation with
HF's num_items_in_batch; save_pretrained / from_pretrained; unpatch; torch.compile; the
errors for models and calls a patch does not handle; coda.nn.causal_lm_loss against
HF's own loss.

Until coda.ops.linear_cross_entropy exists, the `linear_cross_entropy` fixture stands
in for it with the same signature, in plain torch."""

import copy

import pytest
import torch
import torch.nn.functional as F

import coda
from coda import ops
from helpers import rel_err

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # float32, the same math summed in another order
VOCAB = 1000


def lce_stand_in(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 softcap=None, z_loss=0.0, norm_weight=None, norm_eps=None, recompute=True):
    """coda.ops.linear_cross_entropy's contract, unfused (recompute changes only how the gradients are formed)."""
    assert z_loss == 0.0
    if norm_weight is not None:
        eps = torch.finfo(x.dtype).eps if norm_eps is None else norm_eps
        x = ops.normalize_reference(x, norm_weight, None, eps, False)
    logits = F.linear(x, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)


@pytest.fixture(autouse=True)
def linear_cross_entropy(monkeypatch):
    if not hasattr(ops, "linear_cross_entropy"):
        monkeypatch.setattr(ops, "linear_cross_entropy", lce_stand_in, raising=False)


# ---- tiny models

def llama_kwargs(vocab=VOCAB, **kw):
    """A tiny LLaMA-family config's arguments (Mistral's and Qwen's take the same)."""
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, use_cache=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {**base, **kw}


def llama_config(vocab=VOCAB, **kw):
    return transformers.LlamaConfig(**llama_kwargs(vocab, **kw))


def gpt2_config(vocab=VOCAB, **kw):
    base = dict(vocab_size=vocab, n_positions=256, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2Config(**{**base, **kw})


def config_of(family, vocab=VOCAB, **kw):
    """The family's tiny config; kw overrides (LLaMA's names for the LLaMA family)."""
    if family == "llama":
        return llama_config(vocab, **kw)
    if family == "llama_tied":
        return llama_config(vocab, tie_word_embeddings=True, **kw)
    if family == "mistral":
        return transformers.MistralConfig(**llama_kwargs(vocab, sliding_window=8, **kw))
    if family == "qwen2":
        return transformers.Qwen2Config(**llama_kwargs(vocab, **kw))
    if family == "qwen3":  # per-head q/k norms; head_dim 32 with 4 heads of a 64-wide model, as Qwen3's is its own
        return transformers.Qwen3Config(**llama_kwargs(vocab, head_dim=32, **kw))
    if family == "phi3":  # q/k/v and gate/up fused in its checkpoint
        return transformers.Phi3Config(**llama_kwargs(vocab, **kw))
    if family == "gemma3":  # local (window 8) and global layers, 1 + w norms, sandwich norms, GeGLU-tanh, softcap
        return transformers.Gemma3TextConfig(**llama_kwargs(vocab, head_dim=32, sliding_window=8,
                                                            layer_types=["sliding_attention", "full_attention"],
                                                            final_logit_softcapping=30.0, **kw))
    if family == "gpt2":
        return gpt2_config(vocab, **kw)
    raise ValueError(family)


def build(family, vocab=VOCAB, seed=0, **config):
    """A float32 model of the family from the seed, in training mode; its norms' weights
    drawn too (initialized to ones, they would hide a norm weight read in the wrong order)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_of(family, vocab, **config),
                                                          attn_implementation="sdpa")
    with torch.no_grad():
        for name, module in model.named_modules():
            if "norm" in type(module).__name__.lower() and getattr(module, "weight", None) is not None:
                module.weight.uniform_(0.5, 1.5)
    return model.float().train()


def pair(family, vocab=VOCAB, seed=0):
    """(plain, patched) from the same weights."""
    plain = build(family, vocab, seed)
    return plain, coda.hf.patch(copy.deepcopy(plain))


FAMILIES = ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gpt2"]


def tokens(batch=2, seq=16, vocab=VOCAB):
    return torch.randint(3, vocab, (batch, seq))


def hf_grads(model):
    """The gradients in Hugging Face's layout and keys: each parameter's .grad in its place, read by state_dict()."""
    params = list(model.parameters())
    with torch.no_grad():
        data = [p.data for p in params]
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        out = {k: v.clone() for k, v in model.state_dict().items()}
        for p, d in zip(params, data):
            p.data = d
    return out


def assert_state_close(a, b, tol=TOL, what=""):
    assert list(a) == list(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert rel_err(a[k], b[k]) <= tol, f"{what}{k}: relative error {rel_err(a[k], b[k]):.3e}"


# ---- the patch keeps Hugging Face's weights

@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_keys_shapes_values(family):
    plain = build(family)
    model = copy.deepcopy(plain)
    rng = torch.random.get_rng_state()
    assert coda.patch(model) is model
    assert torch.equal(torch.random.get_rng_state(), rng), "patch drew random numbers"
    before, after = plain.state_dict(), model.state_dict()
    assert list(before) == list(after)  # same keys, same order
    for k in before:
        assert before[k].shape == after[k].shape and torch.equal(before[k], after[k]), k
    # no weight kept twice: as many parameters as HF's, the replaced modules hold none
    numel = sum(p.numel() for p in model.parameters())
    assert numel == sum(p.numel() for p in plain.parameters())
    if family.startswith("gpt2"):
        conv = coda.hf._common.original(model.transformer.h[0].attn.c_attn)
        assert conv.weight is None and conv.bias is None
    else:
        old = coda.hf._common.original(model.model.layers[0])
        fused = family == "phi3"
        assert (old.self_attn.qkv_proj if fused else old.self_attn.q_proj).weight is None
        assert (old.mlp.gate_up_proj if fused else old.mlp.gate_proj).weight is None
        assert model.model.layers[0].mlp.down_proj is old.mlp.down_proj  # o_proj, down_proj: the same modules
    if family == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_rope_frequencies_from_the_config():
    # model.to(bf16) rounds HF's inv_freq buffer to bf16; the patch takes the frequencies from the config
    model = build("llama").to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    coda.patch(model)
    qkv = model.model.layers[0].self_attn.qkv
    assert torch.equal(qkv.freq, ops.rope_frequencies(16, 4, 2, model.config.rope_parameters["rope_theta"]))
    scaled = build("llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    plain = copy.deepcopy(scaled)
    coda.patch(scaled)
    ids = tokens(seq=64)
    assert rel_err(scaled(ids).logits, plain(ids).logits) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_load_hf_state_dict_into_patched(family):
    # a checkpoint of the plain class (other weights) loads into a patched model as it is
    other = build(family, seed=1).state_dict()
    _, model = pair(family)
    model.load_state_dict(other)
    assert_state_close(model.state_dict(), other, 0.0)


# ---- the same numbers

@pytest.mark.parametrize("family", FAMILIES)
def test_loss_logits_gradients_match(family, seed):
    plain, model = pair(family)
    ids = tokens(seq=24)  # Mistral's window of 8 is shorter: its sliding-window mask is used
    labels = ids.clone()
    labels[0, :3] = -100
    ref = plain(ids, labels=labels)
    out = model(ids, labels=labels)
    assert out.logits is None  # the loss without logits
    assert abs(out.loss.item() - ref.loss.item()) <= TOL * ref.loss.item()
    ref.loss.backward()
    out.loss.backward()
    assert_state_close(hf_grads(model), hf_grads(plain), what=f"{family} seed={seed} grad ")
    with torch.no_grad():
        logits = model(ids).logits
        assert rel_err(logits, plain(ids).logits) <= TOL
        assert rel_err(model(ids, logits_to_keep=1).logits, logits[:, -1:]) <= TOL
        hidden = model.base_model(ids).last_hidden_state
        assert rel_err(hidden, plain.base_model(ids).last_hidden_state) <= TOL


def test_blocks_as_chains(monkeypatch):
    # each GEMM that writes the residual stream hands the next norm its statistics: o_proj's to the MLP's
    # norm, the MLP's to the next layer's input norm
    calls = []

    def spy(name):
        fn = getattr(ops, name)

        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls.append((name, args, kwargs, out))
            return out
        monkeypatch.setattr(ops, name, wrapped, raising=False)

    for name in ("rmsnorm_linear_rope", "linear_residual", "norm_glu_mlp", "linear_cross_entropy"):
        spy(name)
    _, model = pair("llama")
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    assert [c[0] for c in calls] == ["rmsnorm_linear_rope", "linear_residual", "norm_glu_mlp"] * 2 + \
        ["linear_cross_entropy"]
    rope_stats = [calls[0][1][7], calls[3][1][7]]  # rmsnorm_linear_rope(x, γ, W, positions, freq, b, eps, stats)
    assert rope_stats[0] is None  # the first layer reduces its own
    for layer in range(2):
        rope, residual, mlp = calls[3 * layer: 3 * layer + 3]
        h, stats = residual[3]
        assert mlp[1][9] is stats  # norm_glu_mlp(x, ..., residual, stats, return_stats)
        eps = model.model.layers[layer].mlp.norm.eps
        assert torch.allclose(stats[..., 1], torch.rsqrt(h.float().square().mean(-1) + eps))
        y, next_stats = mlp[3]
        if layer == 0:
            assert rope_stats[1] is next_stats


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_padding_mask(family):
    # right padding, as a collator pads: the unpadded positions' logits and the loss match
    plain, model = pair(family)
    ids = tokens(3, 16)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ref = plain(ids, attention_mask=mask, labels=labels)
    out = model(ids, attention_mask=mask, labels=labels)
    assert abs(out.loss.item() - ref.loss.item()) <= TOL * ref.loss.item()
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert rel_err(a[keep], b[keep]) <= TOL and torch.isfinite(a).all()
    # all ones: plain causal attention
    assert rel_err(model(ids, attention_mask=torch.ones_like(ids), labels=ids).loss, plain(ids, labels=ids).loss) \
        <= TOL


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradient_accumulation(family):
    # two micro-batches with num_items_in_batch (HF's Trainer convention) = the whole batch in one step
    plain, model = pair(family)
    ids = tokens(4, 16)
    labels = ids.clone()
    labels[0, :9] = -100  # unequal counts per micro-batch: a mean per micro-batch would weigh them wrongly
    labels[3, 12:] = -100
    n = (labels[:, 1:] != -100).sum()
    for m in (plain, model):
        m(ids, labels=labels, num_items_in_batch=n).loss.backward()
    whole, whole_plain = hf_grads(model), hf_grads(plain)
    for m in (plain, model):
        m.zero_grad()
        for half in (slice(0, 2), slice(2, 4)):
            m(ids[half], labels=labels[half], num_items_in_batch=n).loss.backward()
    assert_state_close(hf_grads(model), whole, what="accumulated vs whole ")
    assert_state_close(hf_grads(model), hf_grads(plain), what="accumulated, patched vs plain ")
    assert_state_close(whole, whole_plain, what="whole, patched vs plain ")
    # without num_items_in_batch: the mean over the counted tokens
    mean = model(ids, labels=labels).loss
    total = model(ids, labels=labels, num_items_in_batch=1).loss
    assert abs(mean.item() - total.item() / n.item()) <= TOL * mean.item()


def test_gradient_checkpointing(monkeypatch):
    # model.activation_checkpointing_enable() (HF's gradient checkpointing): each layer recomputed, same gradients
    from coda.hf import llama
    plain, model = pair("llama")
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    want = hf_grads(model)
    model.zero_grad()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    calls = []
    monkeypatch.setattr(llama, "checkpoint", lambda *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(
        *a, **k))
    model(ids, labels=ids).loss.backward()
    assert len(calls) == len(model.model.layers)
    assert_state_close(hf_grads(model), want)


# ---- round trips

@pytest.mark.parametrize("family", ["llama_tied", "qwen2", "qwen3", "phi3", "gemma3", "gpt2"])
def test_save_pretrained_round_trip(family, tmp_path):
    plain, model = pair(family)
    ids = tokens()
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad  # trained a step: the checkpoint must hold the new values
    model.save_pretrained(tmp_path)
    loaded = type(plain).from_pretrained(tmp_path, attn_implementation="sdpa").float()
    assert_state_close(loaded.state_dict(), model.state_dict(), 0.0)
    assert rel_err(loaded(ids, labels=ids).loss, model(ids, labels=ids).loss) <= TOL
    coda.patch(loaded)
    assert_state_close(loaded.state_dict(), model.state_dict(), 0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_keys_are_attribute_paths(family):
    """Every key names an attribute holding its value (fused weights' parts as read-only
    views), as torch.distributed.checkpoint's get/set_model_state_dict require; the LM head
    is a coda.nn.LMHead, an nn.Linear on the same weight. (GPT-2's LinearConv1D keeps its
    weight as nn.Linear does, (out, in): the attribute is the key's value transposed.)"""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from coda.hf.gpt2 import LinearConv1D
    plain, model = pair(family)
    assert isinstance(model.lm_head, coda.nn.LMHead) and isinstance(model.lm_head, torch.nn.Linear)
    state = model.state_dict()
    for key, value in state.items():
        obj = owner = model
        for name in key.split("."):
            owner, obj = obj, getattr(obj, name)
        if isinstance(owner, LinearConv1D) and key.endswith(".weight"):
            obj = obj.t()
        assert torch.equal(obj, value), key
    got = get_model_state_dict(model)
    assert list(got) == list(state) and all(torch.equal(got[k], state[k]) for k in state)
    other = coda.patch(build(family, seed=1))
    set_model_state_dict(other, get_model_state_dict(plain))
    assert_state_close(other.state_dict(), plain.state_dict(), 0.0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "gemma3", "gpt2"])
def test_unpatch_restores_modules_with_trained_values(family):
    model = build(family)
    layers = model.transformer.h if family == "gpt2" else model.model.layers
    modules = list(model.modules())
    coda.patch(model)
    ids = tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    loss = model(ids, labels=ids).loss
    norm = layers[0].ln_1.weight if family == "gpt2" else layers[0].self_attn.qkv.norm.weight
    assert coda.unpatch(model) is model
    assert not coda.hf.is_patched(model) and "forward" not in model.__dict__
    assert [id(m) for m in model.modules()] == [id(m) for m in modules]  # the original modules themselves
    assert_state_close(model.state_dict(), trained, 0.0)
    assert (layers[0].ln_1.weight if family == "gpt2" else layers[0].input_layernorm.weight) is norm
    assert rel_err(model(ids, labels=ids).loss, loss) <= TOL
    assert coda.unpatch(model) is model  # not patched: nothing to do


def test_patch_twice_and_deepcopy():
    model = coda.patch(build("llama"))
    layer = model.model.layers[0]
    assert coda.patch(model) is model and model.model.layers[0] is layer
    ids = tokens()
    clone = copy.deepcopy(model)
    assert clone.forward.__self__ is clone and coda.hf.is_patched(clone)
    assert torch.equal(clone(ids, labels=ids).loss, model(ids, labels=ids).loss)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_torch_compile(family):
    # torch.compile(model) of a patched model, graph breaks allowed (fullgraph=False); aot_eager traces forward
    # and backward as inductor would, at a fraction of its CPU compile time
    _, model = pair(family)
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    want = hf_grads(model)
    model.zero_grad()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
        loss = compiled(ids, labels=ids).loss
        loss.backward()
    finally:
        torch._dynamo.reset()
    assert_state_close(hf_grads(model), want)


# ---- what a patch refuses

def test_unknown_models_raise_type_error():
    with pytest.raises(TypeError, match="no patch for Linear"):
        coda.patch(torch.nn.Linear(8, 8))
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                             ffn_dim=32, num_attention_heads=2,
                                                             word_embed_proj_dim=16))
    with pytest.raises(TypeError, match="OPTForCausalLM"):
        coda.patch(opt)
    assert not coda.hf.is_patched(opt)


def test_unsupported_configurations_raise():
    biased = transformers.LlamaForCausalLM(llama_config(mlp_bias=True))
    state = copy.deepcopy(biased.state_dict())
    with pytest.raises(NotImplementedError, match="mlp_bias"):
        coda.patch(biased)
    assert not coda.hf.is_patched(biased) and "forward" not in biased.__dict__  # checked before anything changed
    assert_state_close(biased.state_dict(), state, 0.0)


def test_unsupported_calls_raise():
    _, model = pair("llama")
    ids = tokens()
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(NotImplementedError, match="shift_labels"):
        model(ids, labels=ids, shift_labels=ids)
    with pytest.raises(NotImplementedError, match="logits_to_keep"):
        model(ids, labels=ids, logits_to_keep=1)
    with pytest.raises(ValueError, match="exactly one"):
        model()
    assert isinstance(model(ids, labels=ids, return_dict=False), tuple)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_without_cache(family):
    # generate(use_cache=False) recomputes whole sequences (with a cache: test_hf_drop_in_cpu)
    plain = build(family).eval()
    model = coda.patch(copy.deepcopy(plain))
    ids = tokens(1, 8)
    greedy = dict(max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(model.generate(ids, **greedy), plain.generate(ids, **greedy))


def test_gpt2_dropout_is_hugging_faces():
    # GPT-2's default dropout (resid, embd, attn: 0.1) in training: the same draws in the same order as the
    # unpatched model, so one seed gives the same loss and gradients; another seed other masks
    plain = transformers.GPT2LMHeadModel(gpt2_config(resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)).train()
    model = coda.patch(copy.deepcopy(plain))
    ids = tokens(4, 32)
    losses = []
    for m in (plain, model, model):
        torch.manual_seed(7)
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == losses[2]  # deterministic for a seed
    assert abs(losses[1] - losses[0]) <= TOL * losses[0]
    assert_state_close({k: v / 2 for k, v in hf_grads(model).items()}, hf_grads(plain), what="dropout ")
    torch.manual_seed(8)
    assert model(ids, labels=ids).loss.item() != losses[1]
    plain.eval(), model.eval()
    assert rel_err(model(ids, labels=ids).loss, plain(ids, labels=ids).loss) <= TOL


def test_gpt2_dropout_rate(monkeypatch):
    # the residual dropout (ops.dropout_residual, at the modules' p) zeroes each element with
    # probability p and scales the rest by 1/(1-p)
    plain = transformers.GPT2LMHeadModel(gpt2_config(resid_pdrop=0.25)).train()
    model = coda.patch(plain)
    seen = []
    original = coda.ops.dropout_residual

    def spy(x, residual, p, *args, **kwargs):
        out = original(x, residual, p, *args, **kwargs)
        y = out[0] if isinstance(out, tuple) else out
        seen.append((x, y - residual, p))
        return out

    monkeypatch.setattr(coda.ops, "dropout_residual", spy)
    model(tokens(8, 64), labels=tokens(8, 64))
    assert len(seen) == 2 * len(model.transformer.h) and all(p == 0.25 for _, _, p in seen)
    x, y, _ = seen[1]  # the first block's MLP dropout
    dropped = (y == 0) & (x != 0)
    n = x.numel()
    p = dropped.float().mean().item()
    assert abs(p - 0.25) <= 4 * (0.25 * 0.75 / n) ** 0.5  # 4 sigma
    kept = ~dropped
    torch.testing.assert_close(y[kept], x[kept] / 0.75)


# ---- coda.nn.causal_lm_loss against HF's loss

def test_causal_lm_loss_matches_hf():
    from transformers.loss.loss_utils import ForCausalLMLoss
    torch.manual_seed(0)
    b, s, d, v = 3, 10, 32, 101
    hidden = torch.randn(b, s, d, requires_grad=True)
    weight = torch.randn(v, d) * d**-0.5
    labels = torch.randint(0, v, (b, s))
    labels[1, 4:] = -100
    norm = torch.nn.RMSNorm(d, eps=1e-5)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    logits = F.linear(norm(hidden), weight)
    for n in (None, 17, torch.tensor(17)):
        want = ForCausalLMLoss(logits, labels, v, num_items_in_batch=n)
        for how in (norm, (norm.weight, norm.eps)):
            got = coda.nn.causal_lm_loss(hidden, weight, labels, norm=how, num_items_in_batch=n)
            assert rel_err(got, want) <= TOL, (n, how)
    ln = torch.nn.LayerNorm(d)
    want = ForCausalLMLoss(F.linear(ln(hidden), weight), labels, v)
    assert rel_err(coda.nn.causal_lm_loss(hidden, weight, labels, norm=ln), want) <= TOL
    with pytest.raises(ValueError, match="labels"):
        coda.nn.causal_lm_loss(hidden, weight, labels[:, 1:])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lm_head_recompute_reaches_the_loss(family, monkeypatch):
    """coda.patch(model, lm_head_recompute=False or "half") (or model.lm_head.recompute) picks
    the loss's three- or three-and-a-half-GEMM backward; the default leaves the op's own
    (recompute); anything else is refused by name."""
    seen = []

    def spy(*args, recompute=True, **kw):
        seen.append(recompute)
        return lce_stand_in(*args, recompute=recompute, **kw)

    monkeypatch.setattr(ops, "linear_cross_entropy", spy, raising=False)
    model, ids = coda.patch(build(family)), tokens()
    model(ids, labels=ids)
    coda.patch(model, lm_head_recompute=False)
    assert model.lm_head.recompute is False
    model(ids, labels=ids)
    model.lm_head.recompute = True
    model(ids, labels=ids)
    coda.patch(model, lm_head_recompute="half")
    model(ids, labels=ids)
    assert seen == [True, False, True, "half"]
    with pytest.raises(ValueError, match="lm_head_recompute must be True, False or 'half', got 'tail'"):
        coda.patch(model, lm_head_recompute="tail")
