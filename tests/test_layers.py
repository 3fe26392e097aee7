"""Whole layers and real models: remat.nn.LlamaLayer's policies as measured byte formulas, against a
float64 Hugging Face reference; remat.patch on tiny Llama, Mistral and Qwen2 models built from
configs (no downloads): logits, loss and every parameter gradient under the 2x rule, padding,
saved bytes, unpatch, torch.compile, autocast, no_grad / inference_mode, eval and gradient
accumulation."""

import copy
import inspect

import pytest
import torch

import remat
from remat.memory import saved_bytes

from _checks import assert_within_2x_of_stock

transformers = pytest.importorskip("transformers")

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 64, 160, 4, 2, 16
BATCH, LENGTH = 2, 11


def llama_config(kind="llama", **overrides):
    common = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  use_cache=False, attn_implementation="eager")
    common.update(overrides)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=4, **common)
    return transformers.Qwen2Config(**common)


def causal_lm(kind, dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    config = llama_config(kind, **overrides)
    model = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
             "qwen2": transformers.Qwen2ForCausalLM}[kind](config)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model.to(dtype)


def batch(vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, LENGTH), generator=g)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    # Right padding, 3 pads: fewer than Mistral's window of 4, since a pad query whose window holds
    # only pads makes the stock eager model produce NaN (a fully masked softmax row), which then
    # reaches real tokens through 0 * NaN in the next layer.
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def per_token_formula(policy, element):
    """Bytes per token a LlamaLayer keeps (see its docstring), for these sizes."""
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    memory = element * (2 * HIDDEN + q_width) + 4 * HEADS + 8
    balanced = memory + element * (q_width + 2 * kv_width)
    return {"memory": memory, "balanced": balanced, "speed": balanced + 2 * element * INTER}[policy]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_llama_layer_saves_the_documented_bytes(policy, dtype):
    layer = remat.nn.LlamaLayer(HIDDEN, INTER, HEADS, KV_HEADS, policy=policy, dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    rope_tables = 2 * LENGTH * (HEAD_DIM // 2) * 4  # the layer's fp32 cos/sin [1, N, D/2]
    expected = BATCH * LENGTH * per_token_formula(policy, x.element_size()) + rope_tables
    assert saved_bytes(layer, x) == expected


def test_policies_against_eager_layer():
    """The stock Hugging Face layer keeps the probabilities and every intermediate; each policy
    keeps less, in the documented order."""
    model = causal_lm("llama", torch.bfloat16)
    stock = model.model.layers[0]
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(LENGTH)[None].expand(BATCH, LENGTH)
    rope = model.model.rotary_emb(x, positions)
    mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1).to(torch.bfloat16)[None, None]
    eager = saved_bytes(stock, x, attention_mask=mask, position_embeddings=rope, position_ids=positions)
    saved = {p: saved_bytes(remat.nn.LlamaLayer.from_module(stock, policy=p), x, position_embeddings=rope)
             for p in ("speed", "balanced", "memory")}
    assert eager > saved["speed"] > saved["balanced"] > saved["memory"]
    tables = 2 * rope[0].numel() * rope[0].element_size()
    assert saved["memory"] == BATCH * LENGTH * per_token_formula("memory", 2) + tables


def _logits_and_grads(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_patched_model_matches_stock(kind, dtype, policy):
    reference = causal_lm(kind, torch.float64)
    stock = causal_lm(kind, dtype)
    patched = causal_lm(kind, dtype)
    report = remat.patch(patched, policy=policy)
    assert len(report.replaced) == 3 and not report.left_alone  # 2 layers and the final norm
    ids, mask, labels = batch()
    real = mask.bool()
    want = _logits_and_grads(reference, ids, mask, labels)
    base = _logits_and_grads(stock, ids, mask, labels)
    got = _logits_and_grads(patched, ids, mask, labels)
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    assert_within_2x_of_stock("loss", got[1].reshape(1), base[1].reshape(1), want[1].reshape(1), dtype)
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)


def test_patch_shares_parameters_and_unpatch_restores():
    model = causal_lm("llama")
    layers = list(model.model.layers)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    remat.patch(model)
    assert type(model.model.layers[0]).__name__ == "HFLlamaLayer"
    assert list(model.state_dict()) == keys
    for name, p in model.named_parameters():
        assert p is params[name]
    with pytest.raises(ValueError, match="already patched"):
        remat.patch(model)
    remat.unpatch(model)
    assert list(model.model.layers) == layers
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    with pytest.raises(ValueError, match="not patched"):
        remat.unpatch(model)


def test_patch_subset_of_module_kinds():
    model = causal_lm("llama")
    report = remat.patch(model, modules=("norm", "mlp"))
    names = {name for name, _, _ in report.replaced}
    assert "model.layers.0.mlp" in names and "model.layers.0.input_layernorm" in names and "model.norm" in names
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"
    ids, mask, labels = batch()
    stock = causal_lm("llama")
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                               stock(input_ids=ids, attention_mask=mask).logits[mask.bool()], rtol=1e-5, atol=1e-5)


def test_plain_pytorch_norms_are_patched():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16),
                                torch.nn.RMSNorm(16))
    x = torch.randn(5, 8)
    want = model(x)
    report = remat.patch(model, modules=("norm",))
    assert [old for _, old, _ in report.replaced] == ["LayerNorm", "RMSNorm"]
    torch.testing.assert_close(model(x), want)


def test_left_padding_and_kv_cache_raise():
    model = causal_lm("llama")
    remat.patch(model)
    ids, mask, _ = batch()
    left = mask.flip(1)
    with pytest.raises(ValueError, match="right padding"):
        model(input_ids=ids, attention_mask=left)
    with pytest.raises(ValueError, match="KV cache|use_cache"):
        model(input_ids=ids, attention_mask=mask, use_cache=True)


def test_patched_training_step_saves_less():
    ids, mask, labels = batch()
    stock = causal_lm("llama", torch.bfloat16)
    eager = saved_bytes(lambda: stock(input_ids=ids, attention_mask=mask, labels=labels).loss)
    for policy, bound in (("speed", 0.7), ("balanced", 0.55), ("memory", 0.45)):
        patched = causal_lm("llama", torch.bfloat16)
        remat.patch(patched, policy=policy)
        saved = saved_bytes(lambda: patched(input_ids=ids, attention_mask=mask, labels=labels).loss)
        assert saved < bound * eager, (policy, saved, eager)


class _CompileCounter:
    def __init__(self):
        self.frames = 0

    def __call__(self, gm, example_inputs):
        self.frames += 1
        return gm.forward


def test_compile_fullgraph_on_patched_model():
    torch._dynamo.reset()
    model = causal_lm("llama")
    remat.patch(model)
    ids, mask, labels = batch()
    counter = _CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    out = compiled(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    compiled_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager = model(input_ids=ids, attention_mask=mask, labels=labels)
    eager.loss.backward()
    assert counter.frames == 1
    torch.testing.assert_close(out.logits, eager.logits)
    for name, p in model.named_parameters():
        torch.testing.assert_close(compiled_grads[name], p.grad)


def test_autocast_bf16_matches_stock_autocast():
    ids, mask, labels = batch()
    reference = causal_lm("llama", torch.float64)
    stock, patched = causal_lm("llama"), causal_lm("llama")
    remat.patch(patched)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base = _logits_and_grads(stock, ids, mask, labels)
        got = _logits_and_grads(patched, ids, mask, labels)
    want = _logits_and_grads(reference, ids, mask, labels)
    real = mask.bool()
    assert_within_2x_of_stock("logits", got[0][real].float(), base[0][real].float(), want[0][real], torch.bfloat16)
    for name in want[2]:
        assert got[2][name].dtype == torch.float32
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], torch.bfloat16)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_saves_nothing(mode):
    model = causal_lm("llama")
    remat.patch(model)
    ids, mask, _ = batch()
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        assert saved_bytes(lambda: model(input_ids=ids, attention_mask=mask).logits) == 0
        logits = model(input_ids=ids, attention_mask=mask).logits
    stock = causal_lm("llama")
    torch.testing.assert_close(logits[mask.bool()], stock(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                               rtol=1e-5, atol=1e-5)


def test_attention_dropout_in_training_only_and_reproducible():
    model = causal_lm("llama", attention_dropout=0.3)
    remat.patch(model)
    ids, mask, labels = batch()
    model.eval()
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                       model(input_ids=ids, attention_mask=mask).logits)
    model.train()
    torch.manual_seed(4)
    first = _logits_and_grads(model, ids, mask, labels)
    torch.manual_seed(4)
    second = _logits_and_grads(model, ids, mask, labels)
    assert torch.equal(first[0], second[0])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name])
    torch.manual_seed(5)
    assert not torch.equal(_logits_and_grads(model, ids, mask, labels)[0], first[0])


def test_gradient_accumulation_matches_stock():
    ids, mask, labels = batch()
    stock, patched = causal_lm("llama"), causal_lm("llama")
    remat.patch(patched)
    for model in (stock, patched):
        model.zero_grad(set_to_none=True)
        for row in range(BATCH):
            out = model(input_ids=ids[row : row + 1], attention_mask=mask[row : row + 1], labels=labels[row : row + 1])
            out.loss.backward()
    for (name, p), q in zip(stock.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_deepcopy_of_layer_is_independent():
    layer = remat.nn.LlamaLayer(HIDDEN, INTER, HEADS, KV_HEADS)
    clone = copy.deepcopy(layer)
    assert clone.self_attn.q_proj.weight is not layer.self_attn.q_proj.weight
    x = torch.randn(1, 5, HIDDEN)
    torch.testing.assert_close(clone(x), layer(x))


def gpt2_model(dtype=torch.float32, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=2, vocab_size=96, n_positions=32,
                                     attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=0.0, use_cache=False,
                                     attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_gpt2_layer_saves_the_documented_bytes(policy, dtype):
    layer = remat.nn.GPT2Layer(HIDDEN, HEADS, policy=policy, resid_dropout=0.1, dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    s = x.element_size()
    per_token = {"memory": 3 * s * HIDDEN, "balanced": 6 * s * HIDDEN,
                 "speed": 6 * s * HIDDEN + s * 4 * HIDDEN}[policy] + 4 * HEADS + 16
    assert saved_bytes(layer, x) == BATCH * LENGTH * per_token + 2 * 16  # two residual dropouts' RNG state


@pytest.mark.parametrize("policy", ["speed", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_patched_gpt2_matches_stock(dtype, policy):
    reference, stock, patched = gpt2_model(torch.float64), gpt2_model(dtype), gpt2_model(dtype)
    report = remat.patch(patched, policy=policy)
    assert [old for _, old, _ in report.replaced] == ["GPT2Block", "GPT2Block", "LayerNorm"]
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (_logits_and_grads(m, ids, mask, labels) for m in (reference, stock, patched))
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)


def test_gpt2_dropout_is_reproducible_and_stores_no_mask():
    model = gpt2_model(dropout=0.2)
    remat.patch(model)
    model.train()
    ids, mask, labels = batch()
    torch.manual_seed(9)
    first = _logits_and_grads(model, ids, mask, labels)
    torch.manual_seed(9)
    second = _logits_and_grads(model, ids, mask, labels)
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name])
    layer = model.transformer.h[0]
    x = torch.randn(BATCH, LENGTH, HIDDEN, requires_grad=True)
    layer.policy = "memory"
    # The memory-policy bytes plus three RNG states (attention and two residual dropouts): no mask.
    assert saved_bytes(layer, x) == BATCH * LENGTH * (12 * HIDDEN + 4 * HEADS + 16) + 3 * 16


def test_patch_keeps_eval_mode():
    model = gpt2_model(dropout=0.3)
    model.eval()
    ids, mask, _ = batch()
    want = model(input_ids=ids, attention_mask=mask).logits
    remat.patch(model)
    assert not model.transformer.h[0].training
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[mask.bool()], want[mask.bool()],
                               rtol=1e-5, atol=1e-5)


def test_patch_attention_alone_keeps_the_sliding_window():
    stock, patched = causal_lm("mistral"), causal_lm("mistral")
    report = remat.patch(patched, modules=("attention",))
    assert {old for _, old, _ in report.replaced} == {"MistralAttention"}
    assert patched.model.layers[0].self_attn.window == (3, None)
    ids, mask, _ = batch()
    real = mask.bool()
    torch.testing.assert_close(patched(input_ids=ids, attention_mask=mask).logits[real],
                               stock(input_ids=ids, attention_mask=mask).logits[real], rtol=1e-5, atol=1e-5)


def test_patched_model_deepcopies_and_checks_positional_masks():
    model = causal_lm("llama")
    remat.patch(model)
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="right padding"):
        model(ids, mask.flip(1))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    assert not torch.equal(clone(input_ids=ids).logits, model(input_ids=ids).logits)
    assert "input_ids" in inspect.signature(model.forward).parameters


def test_lookalike_models_are_left_alone():
    """Qwen3's layers have q/k norms that remat's LlamaLayer does not compute: not replaced."""
    if not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip("this transformers has no Qwen3")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                      use_cache=False, attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(config)
    ids, mask, _ = batch()
    want = model(input_ids=ids, attention_mask=mask).logits
    report = remat.patch(model)
    assert report.replaced == []
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, want)


def test_patch_model_loaded_from_a_local_checkpoint(tmp_path):
    causal_lm("qwen2", attention_dropout=0.3).save_pretrained(tmp_path)
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    patched = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    report = remat.patch(patched, policy="memory")
    assert len(report.replaced) == 3 and not any(m.training for m in patched.modules())
    ids, mask, labels = batch()
    real = mask.bool()
    torch.testing.assert_close(patched(input_ids=ids, attention_mask=mask).logits[real],
                               stock(input_ids=ids, attention_mask=mask).logits[real], rtol=1e-5, atol=1e-5)


def test_mask_check_sees_masks_behind_kwargs_and_wrapped_forwards():
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **batch):
            return self.inner(**batch)

    model = Wrapper(causal_lm("llama"))
    remat.patch(model)
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="right padding"):
        model(input_ids=ids, attention_mask=mask.flip(1))

    inner = causal_lm("llama")
    calls = []
    stock_forward = inner.forward

    def hook_forward(*args, **kwargs):  # an instance forward, as accelerate's hooks install
        calls.append(1)
        return stock_forward(*args, **kwargs)

    inner.forward = hook_forward
    remat.patch(inner)
    with pytest.raises(ValueError, match="right padding"):
        inner(input_ids=ids, attention_mask=mask.flip(1))
    inner(input_ids=ids, attention_mask=mask)
    assert calls == [1]
    remat.unpatch(inner)
    assert inner.forward is hook_forward
