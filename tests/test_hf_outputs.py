"""Hugging Face's recorded outputs on patched models (remat.models.outputs): output_hidden_states
returns the stock tuple (same count, values and gradients under the 2x rule against float64) for
every family remat patches; a selection of hidden states by index; the recording hooks whatever
the order of the first recorded call and remat.patch, and after unpatch; output_attentions raises
ValueError (remat never forms the attention probabilities); deep copies."""

import copy

import pytest
import torch

import remat

from _checks import assert_within_2x_of_stock
from helpers import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, CompileCounter, batch, causal_lm

transformers = pytest.importorskip("transformers")

LAYERS = 3


def family_model(kind, dtype=torch.float32, seed=0):
    """A tiny causal LM of ``kind`` from a config (3 layers, eager attention, sliding windows where
    the family has them), in ``dtype``; the same seed gives the same weights in every dtype."""
    if kind in ("llama", "mistral", "qwen2"):
        return causal_lm(kind, dtype, seed, num_hidden_layers=LAYERS)
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  use_cache=False, attn_implementation="eager")
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, vocab_size=96, n_positions=32,
                                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
                                         attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=HEAD_DIM, **common))
    elif kind == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            original_max_position_embeddings=64, sliding_window=5, pad_token_id=0, **common))
    elif kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            head_dim=HEAD_DIM, sliding_window=4, layer_types=types, **common))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            head_dim=HEAD_DIM, sliding_window=4, layer_types=types, **common))
    with torch.no_grad():  # norms away from their identity initialisation, so a skipped norm shows
        for name, p in model.named_parameters():
            if "norm" in name or name.split(".")[-2].startswith("ln_"):
                p.add_(0.3 * torch.randn_like(p))
    return model.to(dtype)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2"]


def hidden_states_and_grads(model, ids, mask, probes):
    """The hidden states of one forward with output_hidden_states=True, and the gradients of every
    parameter under a value-head-like loss that reads each of them (sum of hidden state i times
    probe i, over the real tokens)."""
    model.zero_grad(set_to_none=True)
    states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    real = mask.bool()
    loss = sum((state[real] * probe.to(state.dtype)).sum() for state, probe in zip(states, probes))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return [state.detach() for state in states], grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_hidden_states_equal_stock(kind, dtype):
    reference, stock, patched = (family_model(kind, d) for d in (torch.float64, dtype, dtype))
    report = remat.patch(patched)
    assert sum(new.endswith("Layer") for _, _, new in report.replaced) == LAYERS
    ids, mask, _ = batch()
    real = mask.bool()
    probes = torch.randn(LAYERS + 1, int(real.sum()), HIDDEN, generator=torch.Generator().manual_seed(3))
    want, base, got = (hidden_states_and_grads(m, ids, mask, probes) for m in (reference, stock, patched))
    assert len(got[0]) == len(base[0]) == LAYERS + 1
    for i, (value, stock_value, ref) in enumerate(zip(got[0], base[0], want[0])):
        assert value.dtype == dtype
        assert_within_2x_of_stock(f"hidden_states[{i}]", value[real], stock_value[real], ref[real], dtype)
    assert set(got[1]) == set(base[1]) == set(want[1])
    for name in want[1]:
        assert_within_2x_of_stock(f"d{name}", got[1][name], base[1][name], want[1][name], dtype)


def test_memory_policy_and_selected_hidden_states():
    """output_hidden_states as a list of indices (negative ones too) selects the same entries as
    stock, None elsewhere; the memory policy records as the default one does."""
    stock, patched = family_model("llama"), family_model("llama")
    remat.patch(patched, policy="memory")
    ids, mask, _ = batch()
    real = mask.bool()
    for selection in (True, [0, 2, -1]):
        want = stock(input_ids=ids, attention_mask=mask, output_hidden_states=selection).hidden_states
        got = patched(input_ids=ids, attention_mask=mask, output_hidden_states=selection).hidden_states
        assert len(got) == len(want) == LAYERS + 1
        assert [g is None for g in got] == [w is None for w in want]
        assert [w is None for w in want] == ([False] * 4 if selection is True else [False, True, False, False])
        for value, expected in zip(got, want):
            if expected is not None:
                torch.testing.assert_close(value[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recorded_before_patch", [False, True])
def test_recording_whatever_the_order_and_after_unpatch(recorded_before_patch):
    """Hugging Face installs its hooks on the first recorded call: before patching (hooks on the
    stock layers, which patch hands to the replacements) or after (patch has installed them on the
    stock layers already, so unpatch leaves a model that records as stock, and no hook is doubled)."""
    model = family_model("llama")
    ids, mask, _ = batch()

    def counts():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return len(out.hidden_states)

    if recorded_before_patch:
        assert counts() == LAYERS + 1
    remat.patch(model)
    assert counts() == LAYERS + 1
    assert counts() == LAYERS + 1  # hooks stay single across calls
    remat.unpatch(model)
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == LAYERS + 1 and len(out.attentions) == LAYERS
    assert all(a.shape == (ids.shape[0], HEADS, ids.shape[1], ids.shape[1]) for a in out.attentions)
    for layer in model.model.layers:  # one recorder each, Hugging Face's own
        assert [h.__qualname__.split(".")[-1] for h in layer._forward_hooks.values()] == ["output_capturing_hook"]


# Hugging Face's own refusal: a patched model's attention implementation is "remat" (see remat.patch),
# and its config refuses output_attentions for any implementation but eager, before the forward.
ATTENTIONS_REFUSED = ("never forms the attention probabilities"
                      "|not supported when using the `attn_implementation` set to remat")


@pytest.mark.parametrize("modules", [("norm", "mlp", "attention"), ("attention",)], ids=["layers", "attention"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_output_attentions_raises(kind, modules):
    """remat's attention keeps q, k, v, o and the logsumexp, never the probabilities: asking for
    them (by argument or in the config) raises ValueError instead of returning an empty tuple."""
    model = family_model(kind)
    report = remat.patch(model, modules=modules)
    if kind == "gpt2" and modules == ("attention",):
        assert not report.replaced  # GPT-2's attention is replaced only inside a whole block
        return
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match=ATTENTIONS_REFUSED):
        model(input_ids=ids, attention_mask=mask, output_attentions=True)
    with pytest.raises(ValueError, match=ATTENTIONS_REFUSED):
        model.config.output_attentions = True
        model(input_ids=ids, attention_mask=mask)
    model.config.output_attentions = False
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)  # usable after the error
    assert len(out.hidden_states) == LAYERS + 1


@pytest.mark.parametrize("modules", [("norm", "mlp", "attention"), ("attention",)], ids=["layers", "attention"])
def test_replacements_refuse_attentions_in_a_recorded_call(modules):
    """Below Hugging Face's config check: inside a call that records attentions (Hugging Face's
    collector active), a replaced layer or attention module raises naming why, before its forward
    (a whole layer: no attention module to record) or after it (an attention module returns
    ``(output, None)``), rather than recording nothing."""
    from transformers.utils import output_capturing

    model = family_model("llama")
    remat.patch(model, modules=modules)
    layer = model.model.layers[0]
    module = layer if "mlp" in modules else layer.self_attn
    x = torch.randn(1, 5, HIDDEN)
    rope = model.model.rotary_emb(x, torch.arange(5)[None])
    token = output_capturing._active_collector.set({"attentions": []})
    try:
        with pytest.raises(ValueError, match="never forms the attention probabilities"):
            module(x, position_embeddings=rope)
    finally:
        output_capturing._active_collector.reset(token)
    assert module(x, position_embeddings=rope) is not None  # no collector: runs as usual


def test_deep_copy_records_and_unpatches_on_its_own():
    model = family_model("llama")
    remat.patch(model)
    twin = copy.deepcopy(model)
    ids, mask, _ = batch()
    remat.unpatch(twin)
    for patched, replaced in ((model, True), (twin, False)):
        out = patched(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        assert len(out.hidden_states) == LAYERS + 1
        assert isinstance(patched.model.layers[0], remat.nn.LlamaLayer) == replaced


def moe_model(kind, dtype=torch.float32, seed=0):
    """A tiny Mixtral or Qwen3-MoE causal LM from a config: 3 layers of 4 experts, 2 per token, the
    experts run by Hugging Face's eager loop (its grouped_mm takes no float64)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=64, num_experts_per_tok=2, use_cache=False,
                  attn_implementation="eager")
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=32, num_local_experts=4, **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            moe_intermediate_size=32, num_experts=4, head_dim=HEAD_DIM, **common))
    model.set_experts_implementation("eager")
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_router_logits_and_aux_loss_equal_stock(kind, dtype):
    """Mixture-of-experts layers: Hugging Face records router logits with hooks on its router
    class; remat's router (built as a subclass of it, at the same path) carries them, so
    output_router_logits and the load-balancing loss read from them equal stock's."""
    reference, stock, patched = (moe_model(kind, d) for d in (torch.float64, dtype, dtype))
    report = remat.patch(patched)
    assert sum(new.endswith("Layer") for _, _, new in report.replaced) == LAYERS
    ids, mask, _ = batch()
    real = mask.bool()
    want, base, got = (m(input_ids=ids, attention_mask=mask, output_router_logits=True, output_hidden_states=True)
                       for m in (reference, stock, patched))
    assert len(got.router_logits) == len(base.router_logits) == LAYERS
    assert len(got.hidden_states) == LAYERS + 1
    for i, (value, stock_value, ref) in enumerate(zip(got.router_logits, base.router_logits, want.router_logits)):
        # [B * N, E]: compare the real tokens (padded positions differ by design, see remat.patch)
        value, stock_value, ref = (t.view(*ids.shape, -1)[real] for t in (value, stock_value, ref))
        assert_within_2x_of_stock(f"router_logits[{i}]", value.detach(), stock_value.detach(), ref.detach(), dtype)
    assert_within_2x_of_stock("aux_loss", got.aux_loss.detach().reshape(1), base.aux_loss.detach().reshape(1),
                              want.aux_loss.detach().reshape(1), dtype)


def test_compiled_patched_model_records_in_one_graph():
    """Under torch.compile(fullgraph=True) the recording hooks trace into the model's one graph:
    the stock count and values."""
    torch._dynamo.reset()
    model = family_model("llama")
    remat.patch(model)
    ids, _, _ = batch()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    got = compiled(input_ids=ids, output_hidden_states=True).hidden_states
    want = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert counter.frames == 1
    assert len(got) == len(want) == LAYERS + 1
    for value, expected in zip(got, want):
        torch.testing.assert_close(value, expected)


def test_generate_with_hidden_states_equals_stock():
    """generate(output_hidden_states=True): a patched layer runs its stock module's forward with the
    KV cache (remat.hf.run_stock_layer), and the recorders fire once per layer and step."""
    ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    runs = []
    for patched in (False, True):
        model = family_model("llama").eval()
        if patched:
            remat.patch(model)
        runs.append(model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=True,
                                   output_hidden_states=True, return_dict_in_generate=True))
    want, got = runs
    assert torch.equal(got.sequences, want.sequences)
    assert [len(step) for step in got.hidden_states] == [len(step) for step in want.hidden_states] == [LAYERS + 1] * 3
    for got_step, want_step in zip(got.hidden_states, want.hidden_states):
        for value, expected in zip(got_step, want_step):
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5)
