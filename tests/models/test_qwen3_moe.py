"""The Qwen3-MoE family (remat.models.qwen3_moe): patched tiny Qwen3-MoE models built from configs
(4 experts, top-2, a dense layer through mlp_only_layers, no downloads) against a float64 copy of
the stock model under the 2x rule, fp32 and bf16, every policy, with and without norm_topk_prob:
logits, loss (with the load-balancing loss), aux_loss, router logits and every gradient; one
layer's routing starves an expert (constructed, and asserted). Qwen3MoeLayer's policies as
measured byte formulas (routing weights in the activation dtype); parameters shared, keys kept."""

import pytest
import torch

import remat
from remat.memory import saved_bytes
from remat.models.qwen3_moe import Qwen3MoeLayer

from _checks import assert_within_2x_of_stock
from helpers import (
    BATCH,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LENGTH,
    MOE_EXPERT_INTER,
    MOE_TOP_K,
    batch,
    check_moe_model_against_stock,
    check_moe_policies_against_stock_layer,
    cpu_backends,
    moe_layer_bytes_per_token,
    starve_an_expert,
)

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K, EXPERT_INTER, DENSE_INTER = 4, MOE_TOP_K, MOE_EXPERT_INTER, 96
STARVED = 2  # the expert that layer 0's router never picks


def qwen3_moe_model(dtype=torch.float32, seed=0, norm_topk_prob=False, **overrides):
    """A tiny Qwen3MoeForCausalLM from a config: 3 layers, layer 1 dense (mlp_only_layers), layers 0
    and 2 sparse (4 experts, top-2), aux loss coefficient 1, random norm weights (q/k norms too).
    Layer 0's router never picks expert 2 (a large constant embedding feature 0, on which its row
    2 has a large negative weight; see helpers.starve_an_expert)."""
    torch.manual_seed(seed)
    options = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=DENSE_INTER,
                   moe_intermediate_size=EXPERT_INTER, num_hidden_layers=3, num_attention_heads=HEADS,
                   num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                   norm_topk_prob=norm_topk_prob, mlp_only_layers=[1], router_aux_loss_coef=1.0,
                   max_position_embeddings=64, use_cache=False, attn_implementation="eager")
    options.update(overrides)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**options))
    starve_an_expert(model, STARVED, free_layer=2, norm_suffixes=("layernorm.weight", "q_norm.weight",
                                                                  "k_norm.weight"))
    model = model.to(dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")
    return model


def per_token_formula(policy, element):
    """Bytes per token a Qwen3MoeLayer keeps (its docstring): routing weights in the activation dtype."""
    return moe_layer_bytes_per_token(policy, element, weight_element=element)


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm_topk_prob", [False, True], ids=["plain", "norm_topk"])
def test_patched_qwen3_moe_matches_stock(norm_topk_prob, dtype, policy, backend):
    reference = qwen3_moe_model(torch.float64, norm_topk_prob=norm_topk_prob)
    stock = qwen3_moe_model(dtype, norm_topk_prob=norm_topk_prob)
    patched = qwen3_moe_model(dtype, norm_topk_prob=norm_topk_prob)
    report = remat.patch(patched, policy=policy, backend=backend)
    mine = [entry for entry in report.replaced if entry[0].startswith("model.")]
    assert mine == [("model.layers.0", "Qwen3MoeDecoderLayer", "HFQwen3MoeLayer"),
                    ("model.layers.1", "Qwen3MoeDecoderLayer", "HFQwen3Layer"),
                    ("model.layers.2", "Qwen3MoeDecoderLayer", "HFQwen3MoeLayer"),
                    ("model.norm", "Qwen3MoeRMSNorm", "RMSNorm")]
    assert patched.model.layers[0].mlp.gate.renormalize == norm_topk_prob
    # The two sparse layers; layer 0 starves expert 2.
    check_moe_model_against_stock(reference, stock, patched, dtype, chosen=[[0, 1, 3], [0, 1, 2, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qwen3_moe_policies_against_the_stock_layer(dtype):
    model = qwen3_moe_model(dtype)
    check_moe_policies_against_stock_layer(model, model.model.layers[2], Qwen3MoeLayer, dtype.itemsize, dtype)


def test_from_module_shares_every_parameter_and_keeps_the_keys():
    model = qwen3_moe_model()
    stock = model.model.layers[0]
    layer = Qwen3MoeLayer.from_module(stock)
    assert list(layer.state_dict()) == list(stock.state_dict())
    for (name, p), (_, q) in zip(stock.named_parameters(), layer.named_parameters()):
        assert p is q, name
    assert isinstance(layer.mlp.gate, type(stock.mlp.gate))
    assert layer.self_attn.qk_norm == "rms" and not layer.mlp.gate.fp32_weights


def layer_from_sizes(policy):
    """A bf16 Qwen3MoeLayer built from the tiny sizes, norm weights near 1 and the rest near 0."""
    layer = Qwen3MoeLayer(HIDDEN, EXPERT_INTER, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM, policy=policy,
                          backend="torch", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1)
    return layer


def test_qwen3_moe_layer_built_from_sizes_saves_the_formula():
    layer = layer_from_sizes("balanced")
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    rope_tables = 2 * LENGTH * (HEAD_DIM // 2) * 4  # the layer's fp32 cos/sin [1, N, D/2]
    assert saved_bytes(layer, x) == BATCH * LENGTH * per_token_formula("balanced", 2) + rope_tables


@pytest.mark.parametrize("policy,expected", [("speed", 51416), ("balanced", 26840), ("memory", 16600)])
def test_real_shaped_layer_keeps_the_readme_bytes(policy, expected):
    """README's table: a Qwen3-30B-A3B-shaped layer (h 2048, I 768, 128 experts top-8, 32/4 heads of
    128), bf16, from its formula (built on the meta device; the formula is measured above)."""
    with torch.device("meta"):
        layer = Qwen3MoeLayer(2048, 768, 128, 8, 32, 4, 128, policy=policy, dtype=torch.bfloat16)
    assert layer.saved_bytes_per_token(2) == expected


def test_left_padded_batch_gives_stock_aux_loss():
    """A left-padded batch: the experts run on every token, pads included (their attention output
    is 0, as stock's SDPA gives them), so the recorded router logits equal stock's in every row and
    the masked load-balancing loss is stock's."""
    reference, patched = (qwen3_moe_model(dtype, attn_implementation="sdpa") for dtype in (torch.float64,
                                                                                         torch.float32))
    remat.patch(patched, backend="torch")
    ids, _, _ = batch()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    outs = [m(input_ids=ids, attention_mask=mask, output_router_logits=True) for m in (reference, patched)]
    for value, ref in zip(outs[1].router_logits, outs[0].router_logits, strict=True):
        torch.testing.assert_close(value.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[1].aux_loss.double(), outs[0].aux_loss.double(), rtol=2e-5, atol=1e-6)


def test_stock_moe_block_keeps_the_readme_bytes():
    """README: the stock post-attention norm + Qwen3MoeSparseMoeBlock of a Qwen3-30B-A3B-shaped
    layer (grouped_mm, bf16, 1024 tokens on the meta device) keeps 131,860.5 bytes per token;
    remat's block keeps sH + 4 + k(8 + s) = 4,180 ("balanced", "memory") or 28,756 ("speed")."""
    config = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                         num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                                         head_dim=128, experts_implementation="grouped_mm")
    with torch.device("meta"):
        stock = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeDecoderLayer(config, 0).to(torch.bfloat16)
        h = torch.randn(1, 1024, 2048, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(lambda t: stock.mlp(stock.post_attention_layernorm(t)), h) / 1024 == 131860.5
    block = Qwen3MoeLayer.from_module(stock).mlp
    assert (block.saved_bytes_per_token(2), block.saved_bytes_per_token(2, "activation")) == (4180, 28756)


@pytest.mark.parametrize("router_logits", ["argument", "config", "off"])
def test_fused_loss_keeps_the_load_balancing_term(router_logits):
    """The patched causal LM's training loss is fused (no logits returned) and carries stock's
    load-balancing term where stock adds it: output_router_logits given to the call, set in the
    config, or off (then no aux loss, as stock); loss, aux loss and gradients equal float64 stock
    under the 2x rule (fp32)."""
    options = {"output_router_logits": router_logits == "config"}
    call = {"output_router_logits": True} if router_logits == "argument" else {}
    reference, stock, patched = (qwen3_moe_model(dtype, **options)
                                 for dtype in (torch.float64, torch.float32, torch.float32))
    report = remat.patch(patched, backend="torch")
    assert not [entry for entry in report.left_alone if entry[1] == "Qwen3MoeForCausalLM"]
    ids, mask, labels = batch()
    steps = []
    for model in (reference, stock, patched):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, **call)
        out.loss.backward()
        steps.append((out, {name: p.grad.clone() for name, p in model.named_parameters()}))
    (want, want_grads), (base, base_grads), (got, got_grads) = steps
    assert got.logits is None and base.logits is not None  # fused: the [tokens, vocab] logits never made
    assert_within_2x_of_stock("loss", got.loss.reshape(1), base.loss.reshape(1), want.loss.reshape(1), torch.float32)
    if router_logits == "off":
        assert want.aux_loss is None and got.aux_loss is None and got.router_logits is None
    else:
        assert_within_2x_of_stock("aux_loss", got.aux_loss.reshape(1), base.aux_loss.reshape(1),
                                  want.aux_loss.reshape(1), torch.float32)
        # The term is in the loss: without it the loss would differ by aux_loss (coefficient 1 here).
        assert abs(float(got.loss.detach()) - float(want.loss.detach())) < 0.01 * float(want.aux_loss.detach())
        assert len(got.router_logits) == 2
    for name, grad in want_grads.items():
        assert_within_2x_of_stock(name, got_grads[name], base_grads[name], grad, torch.float32)


@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiled_moe_blocks_match_stock(dtype, policy, monkeypatch):
    """remat.patch(tile_tokens=4): the sparse layers' MoE blocks run over tiles of 4 tokens (their
    forward and backward each see every tile, counted), as do attention and the loss; logits, loss,
    aux loss, router logits and every gradient (experts, router and norms summed over the tiles in
    fp32) against the float64 stock model under the 2x rule, the routing unchanged."""
    from remat.autograd import moe

    calls = {"forward": [], "backward": []}
    for name, key in (("_forward_rows", "forward"), ("_backward_rows", "backward")):
        original = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda x, *a, _o=original, _k=key: calls[_k].append(x.shape[0]) or _o(x, *a))
    reference, stock, patched = (qwen3_moe_model(d) for d in (torch.float64, dtype, dtype))
    remat.patch(patched, policy=policy, tile_tokens=4)
    check_moe_model_against_stock(reference, stock, patched, dtype, chosen=[[0, 1, 3], [0, 1, 2, 3]])
    tokens = BATCH * LENGTH
    per_pass = [4] * (tokens // 4) + ([tokens % 4] if tokens % 4 else [])
    # Two sparse layers; the step's forward and backward, then a forward without labels for the logits.
    assert calls["backward"] == per_pass * 2
    assert calls["forward"] == per_pass * 4


@pytest.mark.parametrize("policy", ["speed", "memory"])
def test_tiling_keeps_the_saved_bytes(policy):
    layer = layer_from_sizes(policy)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    untiled = saved_bytes(layer, x)
    layer.tile_tokens = 4
    assert saved_bytes(layer, x) == untiled == BATCH * LENGTH * per_token_formula(policy, 2) + 2 * LENGTH * (
        HEAD_DIM // 2) * 4
