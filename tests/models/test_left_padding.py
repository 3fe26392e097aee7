"""Left padding with standard labels on every family remat patches: the recipe of
``DataCollatorForLanguageModeling`` with ``tokenizer.padding_side = "left"`` and pad = eos, whose
labels are -100 at the pads only, so the first real token's label is predicted from a pad position.

Stock's default attention (SDPA) gives a pad before a row's first real token an attention output
of 0 and runs the rest of the layer (output projection, norms, MLP, experts) on it; remat's layers
do the same, so the logits at every position (pads included), the loss (with the experts' aux loss
where the family has one) and every gradient match the float64 stock model within twice stock's
float32 error (the 2x rule), eager and under torch.compile.

Gemma 2 has no SDPA in Hugging Face (its softcap): its stock runs eager attention, which gives a
fully masked row the mean of all the row's values (real tokens after the pad included; NaN in
float64, whose mask value overflows the float32 softmax), where remat gives 0. There stock's own
eager and SDPA disagree; remat follows SDPA (docs/patch.md), and Gemma 2 is checked against its
float32 stock at real positions, with the label read at the last pad ignored."""

import pytest
import torch

import remat

from _checks import assert_within_2x_of_stock
from helpers import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, CompileCounter, causal_lm, gpt2_model

transformers = pytest.importorskip("transformers")

SDPA_FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "gemma3", "phi3", "qwen3", "mixtral", "qwen3_moe")
LENGTH, PADS, VOCAB = 10, 3, 96
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64, use_cache=False)


@pytest.fixture(autouse=True)
def _no_compiled_code_left_behind():
    """Dynamo's caches of this module's compiled models (their guards hold the models) are dropped
    after each test rather than carried into later tests of the worker."""
    yield
    torch._dynamo.reset()


def build(family, dtype):
    """A tiny model of ``family`` from its config, stock attention SDPA (Gemma 2: eager, its only
    one), sliding windows (Mistral, Gemma, Phi-3) wider than the pads; MoE families route with aux
    loss (router_aux_loss_coef 1), the float64 reference through Hugging Face's eager experts."""
    torch.manual_seed(0)
    attention = "eager" if family == "gemma2" else "sdpa"
    if family in ("llama", "mistral", "qwen2"):
        return causal_lm(family, dtype, attn_implementation=attention)
    if family == "gpt2":
        model = gpt2_model(dtype)
        model.config._attn_implementation = attention
        return model
    options = dict(COMMON, attn_implementation=attention)
    if family in ("gemma2", "gemma3"):
        options.update(head_dim=HEAD_DIM, query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=5.0,
                       layer_types=["sliding_attention", "full_attention"])
        config = (transformers.Gemma2Config if family == "gemma2" else transformers.Gemma3TextConfig)(**options)
        model_class = transformers.Gemma2ForCausalLM if family == "gemma2" else transformers.Gemma3ForCausalLM
    elif family == "phi3":
        config = transformers.Phi3Config(**options, sliding_window=5, original_max_position_embeddings=64,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model_class = transformers.Phi3ForCausalLM
    elif family == "qwen3":
        config, model_class = transformers.Qwen3Config(**options, head_dim=HEAD_DIM), transformers.Qwen3ForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(**options, head_dim=HEAD_DIM, num_local_experts=4, num_experts_per_tok=2,
                                            router_aux_loss_coef=1.0, output_router_logits=True)
        model_class = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**options, head_dim=HEAD_DIM, moe_intermediate_size=INTER // 2,
                                             num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=1.0,
                                             output_router_logits=True)
        model_class = transformers.Qwen3MoeForCausalLM
    model = model_class(config)
    with torch.no_grad():  # random norm weights (stock initialises them to ones or zeros)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if family != "gemma2" and family != "gemma3" else 0.0, 0.3)
    model = model.to(dtype)
    if dtype == torch.float64 and family in ("mixtral", "qwen3_moe"):
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    return model


def left_padded_batch():
    """ids, mask ``[2, 10]``, the second row left-padded with 3 pads (pad = eos = id 2), and the
    collator's labels: the ids with -100 at the pads only."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=g)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, :PADS] = 0
    ids[1, :PADS] = 2
    return ids, mask, ids.masked_fill(mask == 0, -100)


def step(model, ids, mask, labels):
    """(logits, loss, {name: grad}) of a training step and a forward without labels (a patched
    causal LM in training computes its loss fused, without logits)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {name.removeprefix("_orig_mod."): p.grad.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits, loss.detach().reshape(1), grads


def check_against_stock(got, base, want):
    assert_within_2x_of_stock("logits", got[0], base[0], want[0], torch.float32)
    assert_within_2x_of_stock("loss", got[1], base[1], want[1], torch.float32)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], torch.float32)


@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_left_padding_with_standard_labels_matches_stock_everywhere(family):
    ids, mask, labels = left_padded_batch()
    want = step(build(family, torch.float64), ids, mask, labels)
    base = step(build(family, torch.float32), ids, mask, labels)
    patched = build(family, torch.float32)
    remat.patch(patched)
    check_against_stock(step(patched, ids, mask, labels), base, want)


def test_left_padded_gemma2_matches_its_eager_stock_at_real_tokens():
    ids, mask, labels = left_padded_batch()
    labels[1, PADS] = -100  # predicted from the last pad, where stock eager averages the row (module docstring)
    stock = step(build("gemma2", torch.float32), ids, mask, labels)
    patched = build("gemma2", torch.float32)
    remat.patch(patched)
    got = step(patched, ids, mask, labels)
    real = mask.bool()
    torch.testing.assert_close(got[0][real], stock[0][real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], stock[1], rtol=1e-5, atol=1e-6)
    for name, grad in stock[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_left_padding_under_compile_matches_stock_everywhere(family):
    """torch.compile runs pads as sequences of their own (fixed shapes, one graph) and replaces
    their attention output by 0: stock's values at every position, in one graph (fullgraph).
    Gemma 3: its post-attention norm runs on the pads' zero attention output. (The MoE families
    compile with graph breaks at the expert grouping, covered in their own tests.)"""
    torch._dynamo.reset()
    ids, mask, labels = left_padded_batch()
    want = step(build(family, torch.float64), ids, mask, labels)
    base = step(build(family, torch.float32), ids, mask, labels)
    patched = build(family, torch.float32)
    remat.patch(patched)
    counter = CompileCounter()
    got = step(torch.compile(patched, backend=counter, fullgraph=True), ids, mask, labels)
    assert counter.frames == 2  # the forward with labels and the one without
    check_against_stock(got, base, want)


class CountingRuns(CompileCounter):
    """A CompileCounter that also counts the runs of its graphs: a call dynamo gave up on (its
    recompile limit reached) runs eagerly and adds no run."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def __call__(self, gm, example_inputs):
        super().__call__(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


def compiled_steps_over_lengths(model, lengths):
    """Compiles ``model`` (a counting backend) and runs a training step on a left-padded batch of each
    length; returns the backend."""
    torch._dynamo.reset()
    counter = CountingRuns()
    compiled = torch.compile(model, backend=counter)
    for length in lengths:
        ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        mask[0, :PADS] = 0
        compiled(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    return counter


def test_compiled_training_over_ten_padded_lengths_builds_no_more_graphs_than_stock():
    """Ten padded lengths: the length is dynamic after one recompile, as for stock (the varlen
    kernels' max_seqlen is a SymInt in their schemas, so passing the padded length to them does not
    specialise it), and every call runs a compiled graph (none falls back to eager at dynamo's
    recompile limit)."""
    lengths = range(16, 96, 8)
    stock = compiled_steps_over_lengths(build("llama", torch.float32), lengths)
    patched = build("llama", torch.float32)
    remat.patch(patched)
    got = compiled_steps_over_lengths(patched, lengths)
    assert got.frames <= stock.frames
    assert got.runs >= len(lengths)
