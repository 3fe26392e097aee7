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
from helpers import BATCH, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LENGTH, batch, cpu_backends

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K, EXPERT_INTER, DENSE_INTER = 4, 2, 40, 96
STARVED = 2  # the expert that layer 0's router never picks


def qwen3_moe_model(dtype=torch.float32, seed=0, norm_topk_prob=False, **overrides):
    """A tiny Qwen3MoeForCausalLM from a config: 3 layers, layer 1 dense (mlp_only_layers), layers 0
    and 2 sparse (4 experts, top-2), aux loss coefficient 1, random norm weights (q/k norms too).
    Layer 0's router never picks expert 2 (a large constant embedding feature 0, on which its row
    2 has a large negative weight; see test_mixtral.mixtral_model)."""
    torch.manual_seed(seed)
    options = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=DENSE_INTER,
                   moe_intermediate_size=EXPERT_INTER, num_hidden_layers=3, num_attention_heads=HEADS,
                   num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                   norm_topk_prob=norm_topk_prob, mlp_only_layers=[1], router_aux_loss_coef=1.0,
                   max_position_embeddings=64, use_cache=False, attn_implementation="eager")
    options.update(overrides)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        model.model.embed_tokens.weight[:, 0] = 3.0
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[0] = 1.0
        router = model.model.layers[0].mlp.gate.weight
        router[:, 0] = 0.1
        router[STARVED, 0] = -1.0
        model.model.layers[2].mlp.gate.weight[:, 0] = 0.0
    model = model.to(dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")
    return model


def step(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits, out.loss.detach(), out.aux_loss.detach(), [r.detach() for r in out.router_logits], grads


def per_token_formula(policy, element):
    """Bytes per token a Qwen3MoeLayer keeps (its docstring): routing weights in the activation dtype."""
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    memory = element * (2 * HIDDEN + q_width) + 4 * HEADS + 8 + TOP_K * (8 + element)
    balanced = memory + element * (q_width + 2 * kv_width)
    return {"memory": memory, "balanced": balanced, "speed": balanced + 2 * EXPERT_INTER * TOP_K * element}[policy]


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
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (step(m, ids, mask, labels) for m in (reference, stock, patched))
    chosen = [logits.topk(TOP_K, dim=-1).indices.unique().tolist() for logits in want[3]]
    assert chosen == [[0, 1, 3], [0, 1, 2, 3]]  # the two sparse layers; layer 0 starves expert 2
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    for i, name in ((1, "loss"), (2, "aux_loss")):
        assert_within_2x_of_stock(name, got[i].reshape(1), base[i].reshape(1), want[i].reshape(1), dtype)
    assert len(got[3]) == len(want[3]) == 2
    rows = real.flatten()
    for layer, (value, stock_value, ref) in enumerate(zip(got[3], base[3], want[3])):
        assert value.dtype == dtype and value.shape == ref.shape  # pad rows not compared (see test_mixtral)
        assert_within_2x_of_stock(f"router_logits[{layer}]", value[rows], stock_value[rows], ref[rows], dtype)
    assert set(got[4]) == set(want[4])
    for name in want[4]:
        assert_within_2x_of_stock(name, got[4][name], base[4][name], want[4][name], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qwen3_moe_policies_against_the_stock_layer(dtype):
    model = qwen3_moe_model(dtype)
    stock = model.model.layers[2]
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    positions = torch.arange(LENGTH)[None].expand(BATCH, LENGTH)
    rope = model.model.rotary_emb(x, positions)
    mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1).to(dtype)[None, None]
    eager = saved_bytes(stock, x, attention_mask=mask, position_embeddings=rope, position_ids=positions)
    saved = {p: saved_bytes(Qwen3MoeLayer.from_module(stock, policy=p, backend="torch"), x, position_embeddings=rope)
             for p in ("speed", "balanced", "memory")}
    assert eager > saved["speed"] > saved["balanced"] > saved["memory"]
    tables = 2 * rope[0].numel() * rope[0].element_size()
    for policy, value in saved.items():
        assert Qwen3MoeLayer.from_module(stock, policy=policy).saved_bytes_per_token(x.element_size()) == \
            per_token_formula(policy, x.element_size())
        assert value == BATCH * LENGTH * per_token_formula(policy, x.element_size()) + tables, policy


def test_from_module_shares_every_parameter_and_keeps_the_keys():
    model = qwen3_moe_model()
    stock = model.model.layers[0]
    layer = Qwen3MoeLayer.from_module(stock)
    assert list(layer.state_dict()) == list(stock.state_dict())
    for (name, p), (_, q) in zip(stock.named_parameters(), layer.named_parameters()):
        assert p is q, name
    assert isinstance(layer.mlp.gate, type(stock.mlp.gate))
    assert layer.self_attn.qk_norm == "rms" and not layer.mlp.gate.fp32_weights


def test_qwen3_moe_layer_built_from_sizes_saves_the_formula():
    layer = Qwen3MoeLayer(HIDDEN, EXPERT_INTER, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM, policy="balanced",
                          backend="torch", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1)
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
    """A left-padded batch runs packed: the recorded router logits are [B N, E] rows (real tokens
    as stock, pads zero), so the masked load-balancing loss is stock's."""
    reference, patched = (qwen3_moe_model(dtype, attn_implementation="sdpa") for dtype in (torch.float64,
                                                                                         torch.float32))
    remat.patch(patched, backend="torch")
    ids, _, _ = batch()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    outs = [m(input_ids=ids, attention_mask=mask, output_router_logits=True) for m in (reference, patched)]
    rows = mask.bool().flatten()
    for value, ref in zip(outs[1].router_logits, outs[0].router_logits):
        assert value.shape == ref.shape and not value[~rows].any()
        torch.testing.assert_close(value[rows].double(), ref[rows], rtol=1e-4, atol=1e-5)
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
