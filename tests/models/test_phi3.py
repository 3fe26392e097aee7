"""The Phi-3 family (remat.models.phi3): Phi3Layer's policies as measured byte formulas; its fused
qkv_proj / gate_up_proj used as row slices (views, no copies, state_dict unchanged); patched tiny
Phi-3 models built from configs (no downloads; full rotary, a sliding window shorter than the
sequence): logits, loss and every parameter gradient under the 2x rule against a float64 copy of
the stock model, fp32 and bf16, every policy, backends cpp and torch; partial rotary refused with
its reason; residual dropout reproducible without a stored mask."""

import pytest
import torch

import remat
from remat.memory import retained_bytes, saved_bytes
from remat.models.phi3 import Phi3Layer

from _checks import assert_within_2x_of_stock
from helpers import (
    BATCH,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LENGTH,
    batch,
    cpu_backends,
    logits_and_grads,
    real_shaped_per_token,
)

transformers = pytest.importorskip("transformers")

HEAD_DIM = HIDDEN // HEADS  # Phi-3's head dim is hidden / heads
WINDOW = 5


def phi3_model(dtype=torch.float32, seed=0, **overrides):
    """A tiny Phi3ForCausalLM from a config: 2 layers, GQA, full rotary (partial_rotary_factor 1,
    Phi-3's own), every layer with a sliding window of 5 keys (fewer than the sequence), random
    norm weights (stock initialises them to ones)."""
    torch.manual_seed(seed)
    options = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                   original_max_position_embeddings=64, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2, use_cache=False, attn_implementation="eager")
    options.update(overrides)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.normal_(1.0, 0.3)
    return model.to(dtype)


def per_token_formula(policy, element):
    """Bytes per token a Phi3Layer keeps (LlamaLayer's formulas; see its docstring)."""
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    memory = element * (2 * HIDDEN + q_width) + 4 * HEADS + 8
    balanced = memory + element * (q_width + 2 * kv_width)
    return {"memory": memory, "balanced": balanced, "speed": balanced + 2 * element * INTER}[policy]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_phi3_layer_saves_the_documented_bytes(policy, dtype):
    layer = Phi3Layer(HIDDEN, INTER, HEADS, KV_HEADS, policy=policy, resid_dropout=0.1, dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    rope_tables = 2 * LENGTH * (HEAD_DIM // 2) * 4  # the layer's fp32 cos/sin [1, N, D/2]
    assert layer.saved_bytes_per_token(x.element_size()) == per_token_formula(policy, x.element_size())
    # Plus the two residual dropouts' RNG states (16 bytes each): no mask.
    expected = BATCH * LENGTH * per_token_formula(policy, x.element_size()) + rope_tables + 2 * 16
    assert saved_bytes(layer, x) == expected


def test_phi3_policies_against_the_stock_layer():
    model = phi3_model(torch.bfloat16)
    stock = model.model.layers[0]
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(LENGTH)[None].expand(BATCH, LENGTH)
    rope = model.model.rotary_emb(x, positions)
    mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1).to(torch.bfloat16)[None, None]
    eager = saved_bytes(stock, x, attention_mask=mask, position_embeddings=rope, position_ids=positions)
    saved = {p: saved_bytes(Phi3Layer.from_module(stock, policy=p), x, position_embeddings=rope)
             for p in ("speed", "balanced", "memory")}
    assert eager > saved["speed"] > saved["balanced"] > saved["memory"]
    tables = 2 * rope[0].numel() * rope[0].element_size()
    for policy, value in saved.items():
        assert value == BATCH * LENGTH * per_token_formula(policy, 2) + tables, policy


def test_fused_weights_are_used_as_views():
    model = phi3_model()
    stock = model.model.layers[0]
    layer = Phi3Layer.from_module(stock)
    assert list(layer.state_dict()) == list(stock.state_dict())
    for (name, p), (_, q) in zip(stock.named_parameters(), layer.named_parameters()):
        assert p is q, name
    x = torch.randn(1, 3, HIDDEN)
    (w_q, w_k, w_v), _ = layer.self_attn.qkv_weights(x)
    w_gate, w_up, _, _ = layer.mlp.gate_up_weights(x)
    qkv, gate_up = stock.self_attn.qkv_proj.weight, stock.mlp.gate_up_proj.weight
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for view, parent, first_row in ((w_q, qkv, 0), (w_k, qkv, q_width), (w_v, qkv, q_width + kv_width),
                                    (w_gate, gate_up, 0), (w_up, gate_up, INTER)):
        assert view._base is parent and view.data_ptr() == parent[first_row].data_ptr()
    assert w_q.shape == (q_width, HIDDEN) and w_v.shape == (kv_width, HIDDEN) and w_up.shape == (INTER, HIDDEN)
    assert layer.self_attn.window == (WINDOW - 1, None) and layer.self_attn.scale == HEAD_DIM**-0.5


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_patched_phi3_matches_stock(dtype, policy, backend):
    reference, stock, patched = (phi3_model(d) for d in (torch.float64, dtype, dtype))
    report = remat.patch(patched, policy=policy, backend=backend)
    mine = [entry for entry in report.replaced if entry[0].startswith("model.")]
    assert mine == [("model.layers.0", "Phi3DecoderLayer", "HFPhi3Layer"),
                    ("model.layers.1", "Phi3DecoderLayer", "HFPhi3Layer"), ("model.norm", "Phi3RMSNorm", "RMSNorm")]
    assert not report.left_alone
    assert {patched.model.layers[0].backend, patched.model.norm.backend} == {backend}
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (logits_and_grads(m, ids, mask, labels) for m in (reference, stock, patched))
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    assert_within_2x_of_stock("loss", got[1].reshape(1), base[1].reshape(1), want[1].reshape(1), dtype)
    assert set(got[2]) == set(want[2])
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)


def test_partial_rotary_is_refused_with_the_reason():
    model = phi3_model(partial_rotary_factor=0.5)
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.5
    with pytest.raises(ValueError, match="partial rotary"):
        Phi3Layer.from_module(model.model.layers[0])
    ids, mask, _ = batch()
    want = model(input_ids=ids, attention_mask=mask).logits
    report = remat.patch(model)
    reasons = {name: why for name, _, why in report.left_alone}
    assert set(reasons) == {"model.layers.0", "model.layers.1"}
    assert "partial_rotary_factor=0.5" in reasons["model.layers.0"]
    assert "model.layers.0" not in [name for name, _, _ in report.replaced]
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, want, rtol=1e-4, atol=1e-4)


def test_phi3_attention_and_mlp_alone_are_left_alone():
    report = remat.patch(phi3_model(), modules=("attention", "mlp"))
    assert {name for name, _, _ in report.left_alone} == {f"model.layers.{i}.{m}" for i in (0, 1)
                                                          for m in ("self_attn", "mlp")}
    assert all("whole decoder layer" in why for _, _, why in report.left_alone)


def test_phi3_residual_dropout_is_reproducible_and_stores_no_mask():
    model = phi3_model(resid_pdrop=0.2)
    remat.patch(model)
    model.train()
    layer = model.model.layers[0]
    assert layer.resid_dropout == 0.2
    ids, mask, labels = batch()
    torch.manual_seed(9)
    first = logits_and_grads(model, ids, mask, labels)
    torch.manual_seed(9)
    second = logits_and_grads(model, ids, mask, labels)
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), name
    torch.manual_seed(10)
    third = logits_and_grads(model, ids, mask, labels)
    assert not torch.equal(third[2]["model.layers.0.mlp.down_proj.weight"],
                           first[2]["model.layers.0.mlp.down_proj.weight"])
    x = torch.randn(BATCH, LENGTH, HIDDEN, requires_grad=True)
    layer.policy = "memory"
    tables = 2 * LENGTH * (HEAD_DIM // 2) * 4
    assert saved_bytes(layer, x) == BATCH * LENGTH * per_token_formula("memory", 4) + tables + 2 * 16


@pytest.mark.parametrize("policy,expected", [("speed", 69768), ("balanced", 37000), ("memory", 18568)])
def test_real_shaped_layer_keeps_the_readme_bytes(policy, expected):
    """README's table: a Phi-3-mini-shaped layer (h 3072, I 8192, 32/32 heads of 96), bf16."""
    with torch.device("meta"):
        layer = Phi3Layer(3072, 8192, 32, 32, sliding_window=2047, policy=policy, backend="torch",
                          dtype=torch.bfloat16)
    assert real_shaped_per_token(layer, 96) == layer.saved_bytes_per_token(2) == expected


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_layer_retains_what_it_saves(policy, dtype, backend):
    """What a forward keeps alive (remat.memory.retained_bytes) is what it saves for backward, less
    the caller's input: no temporary (weight slices, dropouts) outlives the forward."""
    layer = Phi3Layer(HIDDEN, INTER, HEADS, KV_HEADS, policy=policy, resid_dropout=0.1, backend=backend,
                      dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    assert retained_bytes(layer, x) == saved_bytes(layer, x) - x.numel() * x.element_size() > 0
