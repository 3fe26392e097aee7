"""LoRA and other non-plain projections inside remat's fused decoder layers (remat.nn.adapters,
remat.autograd.lora): tiny Llama and Qwen2 models with PEFT LoRA adapters (``init_lora_weights=False``,
so B is not zero), patched before or after ``get_peft_model``, against the same PEFT model unpatched
(loss and every trainable gradient under the 2x rule against a float64 copy); Philox LoRA dropout
against stock PEFT given the same masks; saved bytes with adapters; frozen base weights get no
weight-gradient GEMM; adapter switching, disabling and merging; a Linear subclass with its own
forward takes the generic path."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.autograd.common import draw_rng_state
from remat.memory import retained_bytes, saved_bytes
from remat.ops import ops_for

from _checks import assert_within_2x_of_stock
from helpers import BATCH, HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, LENGTH, CompileCounter, batch, causal_lm

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 4


def lora_config(targets=ALL_TARGETS, dropout=0.0, **overrides):
    options = dict(r=RANK, lora_alpha=8, target_modules=list(targets), lora_dropout=dropout, init_lora_weights=False)
    return peft.LoraConfig(**(options | overrides))


def copy_parameters(model, source):
    """Copies source's parameter values (by name, in each parameter's own dtype) into model; the
    names must agree (a patched model keeps the stock parameter names)."""
    values = dict(source.named_parameters())
    names = dict(model.named_parameters())
    assert set(names) == set(values)
    with torch.no_grad():
        for name, p in names.items():
            p.copy_(values[name])
    return model


def lora_model(kind, dtype, order="stock", policy="balanced", config=None, source=None, seed=0):
    """A tiny causal LM with LoRA adapters: ``order`` "stock" (PEFT only), "patch_first"
    (remat.patch, then get_peft_model) or "peft_first"; parameter values copied from ``source``."""
    model = causal_lm(kind, dtype, seed=seed)
    if order == "patch_first":
        remat.patch(model, policy=policy)
    torch.manual_seed(seed + 1)
    model = peft.get_peft_model(model, config or lora_config())
    if order == "peft_first":
        report = remat.patch(model, policy=policy)
        layers = [entry for entry in report.replaced if entry[1].endswith("DecoderLayer")]
        assert len(layers) == 2 and not report.left_alone, str(report)
    return copy_parameters(model, source) if source is not None else model


def loss_and_grads(model, seed=0):
    """Loss and the gradients of every trainable parameter of one training step."""
    ids, mask, labels = batch()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_matches_stock(got, stock, reference, dtype):
    assert set(got[1]) == set(stock[1]) == set(reference[1])
    assert_within_2x_of_stock("loss", got[0].reshape(1), stock[0].reshape(1), reference[0].reshape(1), dtype)
    for name in reference[1]:
        assert_within_2x_of_stock(name, got[1][name], stock[1][name], reference[1][name], dtype)


def test_peft_adapters_are_trainable_and_nonzero():
    """The setting the comparisons rely on: only LoRA weights train, and B is not zero."""
    model = lora_model("llama", torch.float32)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in name for name in trainable)
    assert len(trainable) == 2 * len(ALL_TARGETS) * 2  # A and B, seven projections, two layers
    b_weights = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert all(p.abs().max() > 0 for p in b_weights)


# Llama in bf16: every policy and order; fp32 and Qwen2 (q/k/v biases): each policy and order in
# some case.
MATRIX = [("llama", torch.bfloat16, policy, order) for policy in ("speed", "balanced", "memory")
          for order in ("patch_first", "peft_first")]
MATRIX += [("llama", torch.float32, "speed", "patch_first"), ("llama", torch.float32, "balanced", "peft_first"),
           ("llama", torch.float32, "memory", "patch_first"), ("qwen2", torch.float32, "speed", "peft_first"),
           ("qwen2", torch.bfloat16, "memory", "patch_first"), ("qwen2", torch.float32, "balanced", "patch_first")]


@pytest.mark.parametrize("kind, dtype, policy, order", MATRIX, ids=lambda v: str(v).replace("torch.", ""))
def test_lora_matches_stock_peft(kind, dtype, policy, order):
    stock = lora_model(kind, dtype)
    if dtype == torch.bfloat16:
        # PEFT keeps bf16 models' adapters in fp32 (autocast_adapter_dtype): branches add in fp32.
        assert stock.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    reference = lora_model(kind, torch.float64, source=stock)
    patched = lora_model(kind, dtype, order, policy, source=stock)
    assert type(patched.base_model.model.model.layers[0]).__module__.startswith("remat.")
    assert_matches_stock(loss_and_grads(patched), loss_and_grads(stock), loss_and_grads(reference), dtype)


@pytest.mark.parametrize("targets", [("q_proj", "v_proj", "down_proj"), ("k_proj", "o_proj", "gate_proj", "up_proj")],
                         ids="-".join)
def test_lora_on_subsets_of_projections(targets):
    config = lora_config(targets, lora_bias=True)
    stock = lora_model("qwen2", torch.float32, config=config)
    reference = lora_model("qwen2", torch.float64, config=config, source=stock)
    patched = lora_model("qwen2", torch.float32, "patch_first", "memory", config=config, source=stock)
    got = loss_and_grads(patched)
    assert any(name.endswith("lora_B.default.bias") for name in got[1])
    assert_matches_stock(got, loss_and_grads(stock), loss_and_grads(reference), torch.float32)


class PhiloxDropout(nn.Module):
    """nn.Dropout with remat's Philox mask (one (seed, offset) draw per call, the mask of element i
    of the contiguous input from word i % 4 of the Philox call at counter offset + i // 4), in any
    dtype: what the fused layers apply, so that stock PEFT given these modules sees the same masks."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training:
            return x
        rng = draw_rng_state(x.device)
        keep_scaled = ops_for("dropout", "torch").philox_dropout(torch.ones_like(x).contiguous(), rng, self.p)
        return x * keep_scaled


def with_philox_dropout(model, p):
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            for name in module.lora_dropout:
                module.lora_dropout[name] = PhiloxDropout(p)
    return model


@pytest.mark.parametrize("policy, order", [("balanced", "patch_first"), ("memory", "peft_first")])
def test_lora_dropout_matches_stock_with_the_same_masks(policy, order):
    config = lora_config(dropout=0.25)
    stock = with_philox_dropout(lora_model("llama", torch.float32, config=config), 0.25)
    reference = with_philox_dropout(lora_model("llama", torch.float64, config=config, source=stock), 0.25)
    patched = lora_model("llama", torch.float32, order, policy, config=config, source=stock)
    got = loss_and_grads(patched, seed=3)
    assert_matches_stock(got, loss_and_grads(stock, seed=3), loss_and_grads(reference, seed=3), torch.float32)
    # The masks matter: without dropout the loss differs.
    no_dropout = lora_model("llama", torch.float32, config=lora_config(), source=stock)
    assert abs(loss_and_grads(no_dropout)[0] - got[0]) > 1e-4


def test_lora_dropout_is_reproducible_and_off_in_eval():
    model = lora_model("llama", torch.float32, "patch_first", config=lora_config(dropout=0.3))
    first, second, other = loss_and_grads(model, seed=5), loss_and_grads(model, seed=5), loss_and_grads(model, seed=6)
    assert torch.equal(first[0], second[0]) and all(torch.equal(first[1][n], second[1][n]) for n in first[1])
    assert not torch.equal(first[0], other[0])
    model.eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        torch.manual_seed(1)
        one = model(input_ids=ids, attention_mask=mask).logits
        torch.manual_seed(2)
        two = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(one, two)


def llama_layer_with_lora(policy, dtype, dropout=0.0):
    model = causal_lm("llama", dtype)
    layer = remat.nn.LlamaLayer.from_module(model.model.layers[0], policy=policy)
    torch.manual_seed(0)
    peft.inject_adapter_in_model(lora_config(dropout=dropout), layer)
    for name, p in layer.named_parameters():
        p.requires_grad_(".lora_" in name)
        if ".lora_" in name:
            p.data = p.data.float()  # as get_peft_model keeps a bf16 model's adapters (autocast_adapter_dtype)
    return layer


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_lora_adds_no_bytes_per_token(policy, dtype, dropout):
    """A LoRA layer keeps what the policy keeps without adapters (saved_bytes_per_token), plus 16
    bytes of Philox state per adapter with dropout: no rank-r intermediate, no mask."""
    layer = llama_layer_with_lora(policy, dtype, dropout)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    rope_tables = 2 * LENGTH * (HEAD_DIM // 2) * 4
    plain = remat.nn.LlamaLayer(HIDDEN, INTER, HEADS, KV_HEADS, policy=policy, dtype=dtype)
    assert layer.saved_bytes_per_token(x.element_size()) == plain.saved_bytes_per_token(x.element_size())
    per_call = 16 * len(ALL_TARGETS) if dropout else 0
    assert layer.saved_bytes_per_call() == per_call
    expected = BATCH * LENGTH * layer.saved_bytes_per_token(x.element_size()) + rope_tables + per_call
    assert saved_bytes(layer, x) == expected
    # Nothing else outlives the forward (an fp32 copy of the input for fp32 adapters, a mask).
    assert retained_bytes(layer, x) == expected - x.numel() * x.element_size()


class WeightGradCounter(TorchDispatchMode):
    """Counts matrix products whose result has the shape of one of ``shapes`` (a frozen weight's)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = set(shapes), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += tuple(out.shape[-2:]) in self.shapes
        return out


@pytest.mark.parametrize("policy", ["speed", "memory"])
def test_frozen_base_gets_no_weight_gradient(policy):
    model = lora_model("llama", torch.float32, "patch_first", policy)
    layers = model.base_model.model.model.layers
    frozen = [p for name, p in layers.named_parameters() if not p.requires_grad and p.dim() == 2]
    assert len(frozen) == 2 * len(ALL_TARGETS)
    shapes = {tuple(p.shape) for p in frozen}
    ids, mask, labels = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    with WeightGradCounter(shapes) as counter:
        loss.backward()
    assert counter.count == 0
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    # The counter sees weight-gradient GEMMs when the base trains.
    for p in frozen:
        p.requires_grad_(True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    with WeightGradCounter(shapes) as counter:
        loss.backward()
    assert counter.count >= len(frozen)


def test_disable_merge_and_unload_give_stock_results():
    stock = lora_model("llama", torch.float32)
    patched = lora_model("llama", torch.float32, "patch_first", source=stock)
    ids, mask, _ = batch()
    real = mask.bool()

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits[real]

    with_adapters = logits(patched)
    base = causal_lm("llama")  # the same base weights, no adapters
    with stock.disable_adapter(), patched.disable_adapter():
        torch.testing.assert_close(logits(patched), logits(stock), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits(patched), logits(base), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(patched), with_adapters, rtol=0, atol=0)
    assert (with_adapters - logits(base)).abs().max() > 1e-3
    patched.merge_adapter()
    torch.testing.assert_close(logits(patched), with_adapters, rtol=1e-5, atol=1e-5)
    with patched.disable_adapter():  # PEFT unmerges disabled merged layers in forward; so does remat
        torch.testing.assert_close(logits(patched), logits(base), rtol=1e-5, atol=1e-5)
    merged = patched.merge_and_unload()
    stock_merged = stock.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(merged.model.layers[0]).__module__.startswith("remat.")
    torch.testing.assert_close(logits(merged), logits(stock_merged), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(merged), with_adapters, rtol=1e-5, atol=1e-5)


def test_several_adapters():
    second = lora_config(("q_proj", "up_proj", "down_proj"), lora_alpha=16)
    stock = lora_model("llama", torch.float32)
    stock.add_adapter("second", second)
    patched = lora_model("llama", torch.float32, "patch_first")
    patched.add_adapter("second", second)
    copy_parameters(patched, stock)
    reference = lora_model("llama", torch.float64)
    reference.add_adapter("second", second)
    copy_parameters(reference, stock)
    for active in ("second", ["default", "second"], "default"):
        for model in (stock, patched, reference):
            model.base_model.set_adapter(active)
        got, base, want = loss_and_grads(patched), loss_and_grads(stock), loss_and_grads(reference)
        assert any(".second." in name for name in got[1]) == (active != "default")
        assert_matches_stock(got, base, want, torch.float32)


class GainLinear(nn.Linear):
    """A Linear subclass whose forward is not ``x W^T + b`` (a per-output gain): reading its weight
    instead of calling it would give wrong results."""

    def __init__(self, linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         dtype=linear.weight.dtype)
        self.weight, self.bias = linear.weight, linear.bias
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, linear.out_features, dtype=linear.weight.dtype))

    def forward(self, x):
        return super().forward(x) * self.gain


def with_gain_linears(model, names):
    for layer in model.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name in names:
                if hasattr(owner, name):
                    setattr(owner, name, GainLinear(getattr(owner, name)))
    return model


@pytest.mark.parametrize("names", [("k_proj",), ("o_proj", "down_proj")], ids="-".join)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_subclass_takes_the_generic_path(names, dtype):
    stock = with_gain_linears(causal_lm("qwen2", dtype), names)
    reference = copy_parameters(with_gain_linears(causal_lm("qwen2", torch.float64), names), stock)
    patched = copy_parameters(with_gain_linears(causal_lm("qwen2", dtype), names), stock)
    report = remat.patch(patched, policy="balanced")
    assert not report.left_alone
    assert type(patched.model.layers[0]).__module__.startswith("remat.")
    got, base, want = loss_and_grads(patched), loss_and_grads(stock), loss_and_grads(reference)
    assert any(name.endswith(".gain") for name in got[1])
    assert_matches_stock(got, base, want, dtype)


def test_lora_on_a_linear_subclass_takes_the_generic_path():
    """PEFT wraps a Linear subclass (as it wraps quantized linears): the LoRA layer is generic too."""
    config = lora_config(("k_proj", "gate_proj"))
    stock = lora_model("llama", torch.float32, config=config)
    stock.base_model.model.model.layers[0].self_attn.k_proj.base_layer = GainLinear(
        stock.base_model.model.model.layers[0].self_attn.k_proj.base_layer)
    patched = lora_model("llama", torch.float32, "patch_first", config=config)
    patched.base_model.model.model.layers[0].self_attn.k_proj.base_layer = GainLinear(
        patched.base_model.model.model.layers[0].self_attn.k_proj.base_layer)
    copy_parameters(patched, stock)
    reference = lora_model("llama", torch.float64, config=config)
    reference.base_model.model.model.layers[0].self_attn.k_proj.base_layer = GainLinear(
        reference.base_model.model.model.layers[0].self_attn.k_proj.base_layer)
    copy_parameters(reference, stock)
    assert_matches_stock(loss_and_grads(patched), loss_and_grads(stock), loss_and_grads(reference), torch.float32)


def test_lora_linear_checks_its_arguments():
    x = torch.randn(3, 8)
    weight = torch.randn(5, 8)
    good = remat.LoRAAdapter(torch.randn(2, 8), torch.randn(5, 2), None, 2.0)
    assert remat.lora_linear(x, weight, None, [good]).shape == (3, 5)
    with pytest.raises(ValueError, match="a must be"):
        remat.lora_linear(x, weight, None, [good._replace(a=torch.randn(2, 7))])
    with pytest.raises(TypeError, match="LoRAAdapter"):
        remat.lora_linear(x, weight, None, [(good.a, good.b, None, 2.0)])
    with pytest.raises(ValueError, match="dropout_p"):
        remat.lora_linear(x, weight, None, [good._replace(dropout_p=1.5)])


def family_model(kind, dtype, seed=0):
    """A tiny Qwen3 / Gemma 3 / Phi-3 / GPT-2 causal LM from a config (no sliding windows)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=2, vocab_size=96, n_positions=32,
                                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
                                         attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config).to(dtype)
    options = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                   use_cache=False, attn_implementation="eager")
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=HEAD_DIM, **options))
    elif kind == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            head_dim=HEAD_DIM, layer_types=["full_attention"] * 2, **options))
    else:
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            original_max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if kind == "gemma3" else 1.0, 0.3)
    return model.to(dtype)


FAMILY_TARGETS = {"qwen3": ALL_TARGETS, "gemma3": ALL_TARGETS,
                  "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), "gpt2": ("c_attn", "c_proj", "c_fc")}


def family_lora_model(kind, dtype, order="stock", policy="balanced", source=None, **config):
    model = family_model(kind, dtype)
    if order == "patch_first":
        report = remat.patch(model, policy=policy)
        assert not report.left_alone, str(report)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, lora_config(FAMILY_TARGETS[kind], **config))
    return copy_parameters(model, source) if source is not None else model


@pytest.mark.parametrize("kind, policy", [("qwen3", "memory"), ("gemma3", "balanced"), ("gemma3", "memory"),
                                          ("phi3", "balanced"), ("phi3", "memory"), ("gpt2", "memory")])
def test_lora_in_other_families(kind, policy):
    """Qwen3, Gemma 3 and Phi-3 take LoRA inside their fused sub-blocks (Gemma's memory policy too,
    with its sandwich norms; Phi-3's qkv_proj / gate_up_proj adapters as row slices of B), and with
    dropout Phi-3's fused projections take the generic path, as GPT-2's Conv1D layers with LoRA
    do (their sub-blocks unfused under checkpoint)."""
    dropout = 0.2 if kind == "phi3" and policy == "memory" else 0.0
    stock = family_lora_model(kind, torch.float32, dropout=dropout)
    if dropout:
        with_philox_dropout(stock, dropout)
    reference = family_lora_model(kind, torch.float64, source=stock, dropout=dropout)
    if dropout:
        with_philox_dropout(reference, dropout)
    patched = family_lora_model(kind, torch.float32, "patch_first", policy, source=stock, dropout=dropout)
    if dropout:
        # Philox masks everywhere (PEFT's forward then runs them under checkpoint: the generic path,
        # whose recompute must replay them).
        with_philox_dropout(patched, dropout)
    assert_matches_stock(loss_and_grads(patched), loss_and_grads(stock), loss_and_grads(reference), torch.float32)


def test_dora_takes_the_generic_path():
    """DoRA (a LoRA variant whose forward is not base + B A x) runs through PEFT's own forward."""
    config = lora_config(("q_proj", "down_proj"), use_dora=True)
    stock = lora_model("llama", torch.float32, config=config)
    reference = lora_model("llama", torch.float64, config=config, source=stock)
    patched = lora_model("llama", torch.float32, "patch_first", config=config, source=stock)
    got = loss_and_grads(patched)
    assert any("lora_magnitude_vector" in name for name in got[1])
    assert_matches_stock(got, loss_and_grads(stock), loss_and_grads(reference), torch.float32)


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("o_proj",), ("o_proj", "gate_proj")], ids="-".join)
@pytest.mark.parametrize("policy", ["balanced", "memory"])
def test_gemma_layer_bytes_with_lora(policy, targets):
    """Gemma's memory policy: LoRA on o_proj / the MLP makes that post-norm keep its input."""
    stock = family_model("gemma3", torch.bfloat16).model.layers[0]
    layer = remat.nn.GemmaLayer.from_module(stock, policy=policy)
    torch.manual_seed(0)
    peft.inject_adapter_in_model(lora_config(targets), layer)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    plain = remat.nn.GemmaLayer.from_module(stock, policy=policy).saved_bytes_per_token(2)
    extra = 2 * HIDDEN * (("o_proj" in targets) + ("gate_proj" in targets)) if policy == "memory" else 0
    assert layer.saved_bytes_per_token(2) == plain + extra
    rope_tables = 2 * LENGTH * (HEAD_DIM // 2) * 4 if layer.self_attn.rope_theta is not None else 0
    assert saved_bytes(layer, x) == BATCH * LENGTH * layer.saved_bytes_per_token(2) + rope_tables


def test_compile_fullgraph_with_lora_and_dropout():
    torch._dynamo.reset()
    model = lora_model("llama", torch.float32, "patch_first", config=lora_config(dropout=0.1))
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    got = loss_and_grads(compiled, seed=2)
    eager = loss_and_grads(model, seed=2)
    assert counter.frames == 1
    torch.testing.assert_close(got[0], eager[0])
    assert set(got[1]) == {f"_orig_mod.{name}" for name in eager[1]}
    for name in eager[1]:
        torch.testing.assert_close(got[1][f"_orig_mod.{name}"], eager[1][name])


def test_carry_wrappers_keeps_adapters_added_after_patching():
    """remat.nn.adapters.carry_wrappers moves PEFT's wrappers of shared projections from a fused
    layer to the stock layer it replaced (what unpatch needs after patch -> get_peft_model)."""
    from remat.nn.adapters import carry_wrappers

    model = causal_lm("llama")
    stock_layer = model.model.layers[0]
    layer = remat.nn.LlamaLayer.from_module(stock_layer)
    peft.inject_adapter_in_model(lora_config(("q_proj", "down_proj")), layer)
    carried = carry_wrappers(layer, stock_layer)
    assert sorted(carried) == ["mlp.down_proj", "self_attn.q_proj"]
    assert stock_layer.self_attn.q_proj is layer.self_attn.q_proj
    assert isinstance(stock_layer.mlp.down_proj, peft.tuners.lora.LoraLayer)
    assert carry_wrappers(layer, stock_layer) == []


def test_unpatch_after_patch_then_peft_keeps_the_adapters():
    """remat.patch, then get_peft_model, then remat.unpatch: the stock layers get PEFT's wrappers
    back, so the unpatched model still trains its adapters and equals stock PEFT."""
    stock = lora_model("llama", torch.float32)
    model = lora_model("llama", torch.float32, "patch_first", source=stock)
    remat.unpatch(model.base_model.model)
    assert not any(isinstance(m, remat.nn.LlamaLayer) for m in model.modules())
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(name for name, p in stock.named_parameters() if p.requires_grad)
    assert len(trainable) == 2 * 2 * len(ALL_TARGETS)
    got, expected = loss_and_grads(model), loss_and_grads(stock)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], rtol=0, atol=0)


def test_lora_under_autocast_matches_stock():
    stock = lora_model("llama", torch.float32)
    reference = lora_model("llama", torch.float64, source=stock)
    patched = lora_model("llama", torch.float32, "peft_first", source=stock)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, base = loss_and_grads(patched), loss_and_grads(stock)
    assert all(g.dtype == torch.float32 for g in got[1].values())
    assert_matches_stock(got, base, loss_and_grads(reference), torch.bfloat16)


@pytest.mark.parametrize("policy", ["balanced", "memory"])
def test_generic_mlp_sub_block_keeps_only_its_input(policy):
    """An MLP with a projection of another linear type runs under checkpoint: it keeps its input h
    (already the fused sub-block's), not the fused block's fp32 norm statistics (4 bytes per token)."""
    model = causal_lm("llama", torch.bfloat16)
    fused = remat.nn.LlamaLayer.from_module(model.model.layers[0], policy=policy)
    generic = remat.nn.LlamaLayer.from_module(model.model.layers[0], policy=policy)
    generic.mlp.down_proj = GainLinear(generic.mlp.down_proj)
    generic.mlp.down_proj.gain.requires_grad_(False)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    tokens = BATCH * LENGTH
    assert saved_bytes(generic, x) == saved_bytes(fused, x) - 4 * tokens
    assert retained_bytes(generic, x) == retained_bytes(fused, x) - 4 * tokens


@pytest.mark.parametrize("order", ["patch_first", "peft_first"])
def test_lora_in_replaced_parts(order):
    """Attention and MLP modules replaced one by one (no whole layers): each projection with LoRA
    runs remat.lora_linear."""
    stock = lora_model("llama", torch.float32)
    reference = lora_model("llama", torch.float64, source=stock)
    patched = causal_lm("llama")
    if order == "patch_first":
        remat.patch(patched, modules=("mlp", "attention"))
    torch.manual_seed(1)
    patched = peft.get_peft_model(patched, lora_config())
    if order == "peft_first":
        remat.patch(patched, modules=("mlp", "attention"))
    copy_parameters(patched, stock)
    layer = patched.base_model.model.model.layers[0]
    assert type(layer.mlp).__name__ == "SwiGLUMLP" and type(layer.self_attn).__module__.startswith("remat.")
    assert_matches_stock(loss_and_grads(patched), loss_and_grads(stock), loss_and_grads(reference), torch.float32)


@pytest.mark.parametrize("policy", ["speed", "memory"])
def test_phi3_lora_joins_the_fused_sub_blocks(policy):
    """Phi-3 with LoRA on every projection keeps the bytes of its policy (no generic path)."""
    stock = family_model("phi3", torch.bfloat16).model.layers[0]
    plain = remat.nn.Phi3Layer.from_module(stock, policy=policy)
    layer = remat.nn.Phi3Layer.from_module(stock, policy=policy)
    peft.inject_adapter_in_model(lora_config(FAMILY_TARGETS["phi3"]), layer)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(layer, x) == saved_bytes(plain, x)
