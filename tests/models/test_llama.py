"""The Llama family (remat.models.llama): LlamaLayer's policies as measured byte formulas, against
the stock Hugging Face layer; patched tiny Llama, Mistral and Qwen2 models built from configs (no
downloads): logits, loss and every parameter gradient under the 2x rule against a float64 copy,
saved bytes of a training step, torch.compile, autocast, no_grad / inference_mode, dropout and
gradient accumulation."""

import copy

import pytest
import torch

import remat
from remat.memory import saved_bytes

from _checks import assert_within_2x_of_stock
from helpers import (
    BATCH,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LENGTH,
    batch,
    causal_lm,
    compiled_and_eager_steps,
    cpu_backends,
    logits_and_grads,
)

transformers = pytest.importorskip("transformers")


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
    assert layer.saved_bytes_per_token(x.element_size()) == per_token_formula(policy, x.element_size())
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


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_patched_model_matches_stock(kind, dtype, policy, backend):
    reference = causal_lm(kind, torch.float64)
    stock = causal_lm(kind, dtype)
    patched = causal_lm(kind, dtype)
    report = remat.patch(patched, policy=policy, backend=backend)
    assert len(report.replaced) == 4 and not report.left_alone  # 2 layers, the final norm and the loss
    assert {patched.model.layers[0].backend, patched.model.norm.backend} == {backend}
    ids, mask, labels = batch()
    real = mask.bool()
    want = logits_and_grads(reference, ids, mask, labels)
    base = logits_and_grads(stock, ids, mask, labels)
    got = logits_and_grads(patched, ids, mask, labels)
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    assert_within_2x_of_stock("loss", got[1].reshape(1), base[1].reshape(1), want[1].reshape(1), dtype)
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)


def test_patched_training_step_saves_less():
    ids, mask, labels = batch()
    stock = causal_lm("llama", torch.bfloat16)
    eager = saved_bytes(lambda: stock(input_ids=ids, attention_mask=mask, labels=labels).loss)
    for policy, bound in (("speed", 0.7), ("balanced", 0.55), ("memory", 0.45)):
        patched = causal_lm("llama", torch.bfloat16)
        remat.patch(patched, policy=policy)
        saved = saved_bytes(lambda model=patched: model(input_ids=ids, attention_mask=mask, labels=labels).loss)
        assert saved < bound * eager, (policy, saved, eager)


def test_compile_fullgraph_on_patched_model():
    model = causal_lm("llama")
    remat.patch(model)
    frames, out, eager, compiled_grads, eager_grads = compiled_and_eager_steps(model, *batch())
    assert frames == 1
    torch.testing.assert_close(out.logits, eager.logits)
    for name in eager_grads:
        torch.testing.assert_close(compiled_grads[name], eager_grads[name])


def test_autocast_bf16_matches_stock_autocast():
    ids, mask, labels = batch()
    reference = causal_lm("llama", torch.float64)
    stock, patched = causal_lm("llama"), causal_lm("llama")
    remat.patch(patched)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base = logits_and_grads(stock, ids, mask, labels)
        got = logits_and_grads(patched, ids, mask, labels)
    want = logits_and_grads(reference, ids, mask, labels)
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
    first = logits_and_grads(model, ids, mask, labels)
    torch.manual_seed(4)
    second = logits_and_grads(model, ids, mask, labels)
    assert torch.equal(first[0], second[0])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name])
    torch.manual_seed(5)
    assert not torch.equal(logits_and_grads(model, ids, mask, labels)[0], first[0])


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
