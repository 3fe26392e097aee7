"""The Mixtral family (remat.models.mixtral, remat.nn.moe): patched tiny Mixtral models built from
configs (4 experts, top-2, no downloads) against a float64 copy of the stock model under the 2x
rule, fp32 and bf16, every policy, backends cpp and torch: logits, loss (with the load-balancing
auxiliary loss), aux_loss, router logits and every gradient (router and 3-D expert Parameters
included); one layer's routing starves an expert (constructed, and asserted). MixtralLayer's
policies as measured byte formulas; parameters shared, keys unchanged; the router caught by
Hugging Face's router-logit hooks."""

import pytest
import torch

import remat
from remat.memory import SavedTensorLog, retained_bytes, saved_bytes
from remat.models.mixtral import MixtralLayer
from remat.nn.moe import moe_block

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
    moe_layer_inputs,
    moe_step,
    starve_an_expert,
)

transformers = pytest.importorskip("transformers")

EXPERTS, TOP_K, EXPERT_INTER = 4, MOE_TOP_K, MOE_EXPERT_INTER
STARVED = 3  # the expert that layer 0's router never picks (see mixtral_model)


def mixtral_model(dtype=torch.float32, seed=0, sliding=False, **overrides):
    """A tiny MixtralForCausalLM from a config (2 layers, 4 experts, top-2, aux loss coefficient 1 so
    its gradient is visible) with random norm weights. Layer 0's router never picks expert 3: every
    embedding has a large feature 0 (so the normalized input's feature 0 is large and positive for
    every token), on which that router's row 3 has a large negative weight and rows 0-2 a positive
    one (layer 1's router ignores feature 0). Built in fp32, then cast; the float64 reference runs
    Hugging Face's eager experts loop (grouped_mm takes no float64)."""
    torch.manual_seed(seed)
    options = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=EXPERT_INTER, num_hidden_layers=2,
                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                   num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, router_aux_loss_coef=1.0,
                   max_position_embeddings=64, use_cache=False, attn_implementation="eager")
    if sliding:
        options.update(sliding_window=4)
    options.update(overrides)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**options))
    starve_an_expert(model, STARVED, free_layer=1)  # layer 1 routes by the other features
    model = model.to(dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")
    return model


def per_token_formula(policy, element):
    """Bytes per token a MixtralLayer keeps (its docstring): fp32 routing weights."""
    return moe_layer_bytes_per_token(policy, element, weight_element=4)


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_patched_mixtral_matches_stock(sliding, dtype, policy, backend):
    reference = mixtral_model(torch.float64, sliding=sliding)
    stock = mixtral_model(dtype, sliding=sliding)
    patched = mixtral_model(dtype, sliding=sliding)
    report = remat.patch(patched, policy=policy, backend=backend)
    mine = [entry for entry in report.replaced if entry[0].startswith("model.")]
    assert mine == [("model.layers.0", "MixtralDecoderLayer", "HFMixtralLayer"),
                    ("model.layers.1", "MixtralDecoderLayer", "HFMixtralLayer"),
                    ("model.norm", "MixtralRMSNorm", "RMSNorm")]
    layers = patched.model.layers
    assert [layer.self_attn.window for layer in layers] == [(3, None) if sliding else None] * 2
    # Layer 0's routing starves expert 3 (and uses the other three); layer 1 uses every expert.
    got = check_moe_model_against_stock(reference, stock, patched, dtype, chosen=[[0, 1, 2], [0, 1, 2, 3]])
    assert torch.equal(got[4]["model.layers.0.mlp.experts.gate_up_proj"][STARVED],
                       torch.zeros_like(got[4]["model.layers.0.mlp.experts.gate_up_proj"][STARVED]))


def test_patched_mixtral_without_router_logits_matches_stock():
    """Without output_router_logits: no aux loss and no router logits, as stock; the loss matches."""
    reference, patched = mixtral_model(torch.float64), mixtral_model()
    remat.patch(patched, backend="torch")
    ids, mask, labels = batch()
    outs = [m(input_ids=ids, attention_mask=mask, labels=labels) for m in (reference, patched)]
    assert outs[0].aux_loss is None and outs[1].aux_loss is None and outs[1].router_logits is None
    torch.testing.assert_close(outs[1].loss.double(), outs[0].loss.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixtral_policies_against_the_stock_layer(dtype):
    """The stock layer keeps more than every policy; each policy keeps exactly its formula (plus
    the rope tables the model passes)."""
    model = mixtral_model(dtype)
    check_moe_policies_against_stock_layer(model, model.model.layers[1], MixtralLayer, 4, dtype)


@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_mixtral_layer_built_from_sizes_saves_the_formula(policy):
    layer = MixtralLayer(HIDDEN, EXPERT_INTER, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM, policy=policy,
                         backend="torch", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    rope_tables = 2 * LENGTH * (HEAD_DIM // 2) * 4  # the layer's fp32 cos/sin [1, N, D/2]
    assert saved_bytes(layer, x) == BATCH * LENGTH * per_token_formula(policy, 2) + rope_tables


def test_from_module_shares_every_parameter_and_keeps_the_keys():
    model = mixtral_model()
    stock = model.model.layers[0]
    layer = MixtralLayer.from_module(stock)
    assert list(layer.state_dict()) == list(stock.state_dict())
    for (name, p), (_, q) in zip(stock.named_parameters(), layer.named_parameters()):
        assert p is q, name
    # The router is a subclass of the stock router class (Hugging Face's hooks catch it by isinstance).
    assert isinstance(layer.mlp.gate, type(stock.mlp.gate))
    assert layer.mlp.gate.renormalize and layer.mlp.gate.fp32_weights


def test_experts_use_views_of_the_3d_parameters():
    """The expert GEMMs read gate_up_proj[e, :I], gate_up_proj[e, I:] and down_proj[e] in place
    (autograd saves the Parameters themselves, never a copy or a split)."""
    model = mixtral_model()
    layer = MixtralLayer.from_module(model.model.layers[1], backend="torch")
    x, _, rope = moe_layer_inputs(model, torch.float32)
    with SavedTensorLog() as log:
        layer(x, position_embeddings=rope)
    experts = layer.mlp.experts
    params = [s for s in log.saved if s.is_parameter and len(s.shape) == 3]
    assert {s.shape for s in params} == {tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape)}


def test_patched_mixtral_parts_and_jitter_noise():
    """modules=("mlp",) replaces the sparse block alone (same outputs as stock); router jitter
    noise is left alone with the reason."""
    model, stock = mixtral_model(), mixtral_model()
    report = remat.patch(model, modules=("mlp",), backend="torch")
    assert [new for _, _, new in report.replaced] == ["SparseMoE", "SparseMoE"]
    ids, mask, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   stock(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    jittery = mixtral_model(router_jitter_noise=0.1)
    report = remat.patch(jittery, backend="torch")
    assert {name for name, _, _ in report.left_alone if name.startswith("model.layers")} == {
        "model.layers.0", "model.layers.1"}
    assert all("jitter" in why for name, _, why in report.left_alone if name.startswith("model.layers"))


def test_moe_block_checks_its_arguments():
    x = torch.randn(5, 8)
    w_router, gate_up, down = torch.randn(4, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    common = dict(renormalize=True, fp32_weights=True)
    with pytest.raises(ValueError, match="top_k must be an int in 1..4"):
        moe_block(x, w_router, gate_up, down, 5, **common)
    with pytest.raises(ValueError, match=r"x must be \[tokens, hidden\]"):
        moe_block(x[None], w_router, gate_up, down, 2, **common)
    with pytest.raises(TypeError, match="w_router must have x's dtype"):
        moe_block(x, w_router.double(), gate_up, down, 2, **common)
    with pytest.raises(ValueError, match="norm_weight is given without eps"):
        moe_block(x, w_router, gate_up, down, 2, norm_weight=torch.ones(8), **common)
    with pytest.raises(ValueError, match=r"down must have shape \(4, 8, 3\)"):
        moe_block(x, w_router, gate_up, down[..., :2], 2, **common)
    with pytest.raises(ValueError, match=r"gate_up must have shape \(3, 6, 8\), got \(4, 6, 8\)"):
        moe_block(x, w_router[:3], gate_up, down, 2, **common)
    with pytest.raises(ValueError, match="recompute must be one of"):
        moe_block(x, w_router, gate_up, down, 2, recompute="none", **common)
    with pytest.raises(ValueError, match="gate_up must be a"):
        moe_block(x, w_router, gate_up[:, :5], down, 2, **common)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("recompute", ["block", "activation"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_functions_match_float64(dtype, recompute, backend):
    """moe_block (every CPU backend; Triton's fused gate/up GEMM under the interpreter in "block")
    with a fused RMSNorm on odd sizes (T = 13 tokens, H = 24, I = 10,
    5 experts, top-3, rows with a stride of 29), one expert starved: output and every gradient
    (input, norm weight, router, both 3-D Parameters) against float64, within 2x of the unfused
    computation (Hugging Face's RMSNorm, router and experts loop) in PyTorch in the same dtype."""
    g = torch.Generator().manual_seed(3)
    hidden, inter, experts, top_k, tokens = 24, 10, 5, 3, 13
    wide = torch.randn(tokens, hidden + 5, generator=g)
    wide[:, 0] = 4.0 + torch.rand(tokens, generator=g)  # the normalized feature 0 is large and positive
    router = 0.3 * torch.randn(experts, hidden, generator=g)
    router[:, 0], router[1, 0] = 0.1, -4.0  # expert 1 starved
    params = dict(norm=1 + 0.2 * torch.randn(hidden, generator=g), router=router,
                  gate_up=torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5,
                  down=torch.randn(experts, hidden, inter, generator=g) * inter**-0.5)
    dy = torch.randn(tokens, hidden, generator=g)
    eps = 1e-5

    def unfused(x, norm, router, gate_up, down):
        # Hugging Face's RMSNorm: normalized in fp32, rounded to x's dtype, then times the weight.
        normed = norm * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        probs = torch.softmax(torch.nn.functional.linear(normed, router).float(), dim=-1)
        top, idx = torch.topk(probs, top_k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(normed)
        for e in range(experts):
            tok, slot = torch.where(idx == e)
            gate, up = torch.nn.functional.linear(normed[tok], gate_up[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[e])
            out = out.index_add(0, tok, (y * top[tok, slot, None]).to(out.dtype))
        return out, idx

    def fused(x, norm, router, gate_up, down):
        out, _, _, idx = moe_block(x, router, gate_up, down, top_k, renormalize=True, fp32_weights=True,
                                   norm_weight=norm, eps=eps, recompute=recompute, backend=backend)
        return out, idx

    def run(fn, dt):
        x = wide.to(dt).requires_grad_()
        leaves = {k: v.to(dt).requires_grad_() for k, v in params.items()}
        out, idx = fn(x[:, :hidden], **leaves)
        grads = torch.autograd.grad(out, [x, *leaves.values()], dy.to(dt))
        return [out.detach(), grads[0][:, :hidden], *grads[1:]], idx

    want, idx = run(unfused, torch.float64)
    assert idx.unique().tolist() == [0, 2, 3, 4]
    stock, _ = run(unfused, dtype)
    got, got_idx = run(fused, dtype)
    assert torch.equal(got_idx, idx)
    names = ["out", "dx", "dnorm", "drouter", "dgate_up", "ddown"]
    for name, value, stock_value, ref in zip(names, got, stock, want):
        assert value.dtype == dtype, name
        assert_within_2x_of_stock(name, value, stock_value, ref, dtype)


@pytest.mark.parametrize("policy,expected", [("speed", 151712), ("balanced", 37024), ("memory", 24736)])
def test_real_shaped_layer_keeps_the_readme_bytes(policy, expected):
    """README's table: a Mixtral-8x7B-shaped layer (h 4096, I 14336, 8 experts top-2, 32/8 heads of
    128), bf16, from its formula (built on the meta device; the formula is measured above)."""
    with torch.device("meta"):
        layer = MixtralLayer(4096, 14336, 8, 2, 32, 8, 128, policy=policy, dtype=torch.bfloat16)
    assert layer.saved_bytes_per_token(2) == expected


def test_left_padded_batch_records_router_logits_per_row():
    """A left-padded batch: the real tokens attend packed, every token (pads too, their attention
    output 0 as stock's SDPA gives) runs the experts, so the recorded router logits are stock's
    [B N, E] rows, and Hugging Face's masked load-balancing loss, the loss (standard labels: -100
    at the pads only) and every gradient match the float64 stock model."""
    # sdpa: its fully masked (left-pad) query rows give 0, where float64 eager gives NaN that then
    # reaches real tokens through 0 * NaN in the next layer.
    reference, stock, patched = (mixtral_model(dtype, attn_implementation="sdpa")
                                 for dtype in (torch.float64, torch.float32, torch.float32))
    remat.patch(patched, backend="torch")
    ids, _, _ = batch()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    want, base, got = (moe_step(m, ids, mask, labels) for m in (reference, stock, patched))
    for layer in range(2):
        assert_within_2x_of_stock(f"router_logits[{layer}]", got[3][layer], base[3][layer], want[3][layer],
                                  torch.float32)
    # Hugging Face computes both losses in fp32 (logits upcast), the float64 model's too: fp32 tolerance.
    for i in (1, 2):
        torch.testing.assert_close(got[i].double(), want[i].double(), rtol=2e-5, atol=1e-6)
    for name in want[4]:
        assert_within_2x_of_stock(name, got[4][name], base[4][name], want[4][name], torch.float32)


def test_router_logits_recorded_when_the_model_ran_before_patching():
    """Hugging Face installs its recording hooks at the first recorded call; a model that ran
    before remat.patch still records the patched routers' logits (remat.models.outputs carries the
    hooks to the router subclass)."""
    model, reference = mixtral_model(), mixtral_model()
    ids, mask, _ = batch()
    model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    remat.patch(model, backend="torch")
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
        want = reference(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    assert len(got) == len(want) == 2
    rows = mask.bool().flatten()  # pad rows are not compared (see test_patched_mixtral_matches_stock)
    for value, ref in zip(got, want):
        torch.testing.assert_close(value[rows], ref[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_layer_retains_what_it_saves(policy):
    """What a forward keeps alive is what it saves for backward, less the caller's input: no
    router, expert or accumulation temporary outlives the forward."""
    layer = MixtralLayer(HIDDEN, EXPERT_INTER, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM, policy=policy,
                         backend="torch", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    assert retained_bytes(layer, x) == saved_bytes(layer, x) - x.numel() * x.element_size() > 0


def test_stock_moe_block_keeps_the_readme_bytes():
    """README: the stock post-attention norm + MixtralSparseMoeBlock of a Mixtral-8x7B-shaped layer
    (Hugging Face's default grouped_mm experts, bf16, 1024 tokens on the meta device: its tensor
    sizes do not depend on the routing) keeps 295,032 bytes per token; remat's block keeps
    sH + 4 + 12k = 8,220 ("balanced", "memory") or 122,908 ("speed")."""
    config = transformers.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                        num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=128, experts_implementation="grouped_mm")
    with torch.device("meta"):
        stock = transformers.models.mixtral.modeling_mixtral.MixtralDecoderLayer(config, 0).to(torch.bfloat16)
        h = torch.randn(1, 1024, 4096, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(lambda t: stock.mlp(stock.post_attention_layernorm(t)), h) / 1024 == 295032.03125
    block = MixtralLayer.from_module(stock).mlp
    assert (block.saved_bytes_per_token(2), block.saved_bytes_per_token(2, "activation")) == (8220, 122908)


def test_peft_lora_on_the_experts_is_refused_loudly():
    """PEFT LoRA on the 3-D expert Parameters (target_parameters) wraps the experts in a
    ParamWrapper, which the fused block does not compute: before remat.patch the layer is left
    stock (and the model's outputs are PEFT's), after it the next forward raises."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj",
                                                                          "mlp.experts.down_proj"])
    ids, mask, _ = batch()
    adapted = peft.get_peft_model(mixtral_model(), config)
    with torch.no_grad():
        want = adapted(input_ids=ids, attention_mask=mask).logits
    report = remat.patch(adapted, backend="torch")
    reasons = {name: why for name, _, why in report.left_alone if name.endswith(("layers.0", "layers.1"))}
    assert len(reasons) == 2 and all("ParamWrapper" in why for why in reasons.values())
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids, attention_mask=mask).logits, want, rtol=1e-5, atol=1e-5)
    patched = mixtral_model()
    remat.patch(patched, backend="torch")
    late = peft.get_peft_model(patched, config)
    with pytest.raises(ValueError, match="not remat's MoEExperts"):
        late(input_ids=ids, attention_mask=mask)


def test_gradient_checkpointing_with_a_left_padded_batch():
    """Hugging Face's gradient checkpointing on a patched Mixtral (each fused layer re-run once in
    backward, the packed rows' router-logit placement included): loss, aux loss and every gradient
    equal to the run without it."""
    ids, _, _ = batch()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    runs, calls = [], []
    for checkpointing in (False, True):
        model = mixtral_model(attn_implementation="sdpa")
        remat.patch(model, backend="torch")
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        count = [0]
        for layer in model.model.layers:
            def counted(*args, _inner=layer._fused_forward, _count=count, **kwargs):
                _count[0] += 1
                return _inner(*args, **kwargs)
            layer._fused_forward = counted
        runs.append(moe_step(model, ids, mask, labels))
        calls.append(count[0])
    # Per layer: the training forward, the logits forward; with checkpointing, the re-run in backward.
    assert calls == [4, 6]
    for i in (1, 2):
        torch.testing.assert_close(runs[1][i], runs[0][i], rtol=1e-6, atol=1e-7)
    for name, grad in runs[0][4].items():
        torch.testing.assert_close(runs[1][4][name], grad, rtol=1e-5, atol=1e-7, msg=name)
