"""Gradient checkpointing of whole fused layers (PreNormDecoderLayer.gradient_checkpointing): Hugging
Face's gradient_checkpointing_enable() / _disable() on a patched model, and the flag set directly on
a remat layer. With it a layer keeps only its input (one hidden vector per token), re-runs its fused
forward once in backward, and the gradients are bitwise those of the same model without it (fp32,
dropout on: the RNG state is restored for the re-run)."""

import warnings

import pytest
import torch

import remat
from remat.memory import SavedTensorLog, saved_bytes

from helpers import BATCH, HEADS, HIDDEN, INTER, KV_HEADS, LENGTH, batch, causal_lm

transformers = pytest.importorskip("transformers")


def enable(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias is what Trainer and users call
        model.gradient_checkpointing_enable()


def disable(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_disable()


def step(model, ids, labels, seed):
    """(loss, {name: grad}, saved bytes) of one training step, RNG seeded."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with SavedTensorLog() as log:
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, log.total_bytes


def build(kind, layers, dtype=torch.float32, dropout=0.0):
    if kind == "gpt2":
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=layers, vocab_size=96, n_positions=32,
                                         attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=0.0, use_cache=False,
                                         attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config).to(dtype)
    return causal_lm(kind, dtype, num_hidden_layers=layers, attention_dropout=dropout)


@pytest.mark.parametrize("kind,policy", [("llama", "balanced"), ("gpt2", "speed"), ("mistral", "memory")])
def test_gradient_checkpointing_enable_gives_bitwise_gradients_with_dropout(kind, policy):
    model = build(kind, 2, dropout=0.2)
    remat.patch(model, policy=policy)
    model.train()
    ids, _, labels = batch()
    loss, grads, plain_bytes = step(model, ids, labels, seed=7)
    enable(model)
    layers = [m for m in model.modules() if isinstance(m, remat.nn.PreNormDecoderLayer)]
    assert len(layers) == 2 and all(layer.gradient_checkpointing for layer in layers)
    loss_gc, grads_gc, gc_bytes = step(model, ids, labels, seed=7)
    assert torch.equal(loss, loss_gc)
    assert grads.keys() == grads_gc.keys()
    for name, g in grads.items():
        assert torch.equal(g, grads_gc[name]), name
    assert gc_bytes < plain_bytes
    disable(model)
    assert not any(layer.gradient_checkpointing for layer in layers)
    assert step(model, ids, labels, seed=7)[2] == plain_bytes
    # A different seed draws different dropout masks: the equality above is not vacuous.
    assert not torch.equal(step(model, ids, labels, seed=8)[0], loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_checkpointed_layers_keep_one_hidden_vector_per_token(kind, dtype):
    """Saved bytes of a training step grow by exactly B * N * hidden * element size per layer: two
    models that differ only in depth, the same outermost layers (embeddings, final norm, loss)."""
    ids, _, labels = batch()
    measured = {}
    for layers in (2, 4):
        model = build(kind, layers, dtype)
        remat.patch(model)
        model.train()
        enable(model)
        measured[layers] = saved_bytes(lambda model=model: model(input_ids=ids, labels=labels).loss)
    element = torch.finfo(dtype).bits // 8
    assert measured[4] - measured[2] == 2 * BATCH * LENGTH * HIDDEN * element


def test_flag_on_a_remat_layer_without_hugging_face():
    layer = remat.nn.LlamaLayer(HIDDEN, INTER, HEADS, KV_HEADS, attention_dropout=0.3)
    x = torch.randn(BATCH, LENGTH, HIDDEN, requires_grad=True)
    plain = saved_bytes(layer, x)
    layer.gradient_checkpointing = True
    assert saved_bytes(layer, x) == x.numel() * x.element_size()  # the input only: rope tables are rebuilt
    dy = torch.randn_like(x)
    results = []
    for checkpointing in (False, True):
        layer.gradient_checkpointing = checkpointing
        x.grad = None
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        layer(x).backward(dy)
        results.append([x.grad.clone(), *(p.grad.clone() for p in layer.parameters())])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert plain > x.numel() * x.element_size()


def test_flag_off_in_eval_mode_and_without_grad():
    """As Hugging Face's layers: checkpointing only in training mode with grad enabled."""
    layer = remat.nn.LlamaLayer(HIDDEN, INTER, HEADS, KV_HEADS)
    layer.gradient_checkpointing = True
    x = torch.randn(BATCH, LENGTH, HIDDEN, requires_grad=True)
    layer.eval()
    with SavedTensorLog() as log:
        layer(x)
    assert log.total_bytes > x.numel() * x.element_size()


def test_custom_checkpoint_function_runs_each_layer_twice_in_all():
    """A _gradient_checkpointing_func set by Hugging Face (or the planner) is what runs; each fused
    layer runs once forward and once more in backward, never checkpointed a second time inside."""
    model = causal_lm("llama")
    remat.patch(model)
    model.train()
    enable(model)
    checkpoint_calls, layer_runs = [], []

    def counting_checkpoint(function, *args):
        checkpoint_calls.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    def counted(layer, run):
        def fused_forward(*args):
            layer_runs.append(layer)
            return run(*args)
        return fused_forward

    for layer in model.model.layers:
        layer._gradient_checkpointing_func = counting_checkpoint
        layer._fused_forward = counted(layer, layer._fused_forward)
    ids, _, labels = batch()
    loss = model(input_ids=ids, labels=labels).loss
    assert len(checkpoint_calls) == 2 and len(layer_runs) == 2
    loss.backward()
    assert len(checkpoint_calls) == 2 and len(layer_runs) == 4


def test_reentrant_checkpointing_with_a_left_padded_batch():
    """Trainer's gradient_checkpointing_kwargs={"use_reentrant": True}: the packed (left-padded)
    path passes its offsets as a plain positional argument; gradients stay bitwise."""
    ids, mask, _ = batch()
    left = mask.flip(1)
    labels = ids.masked_fill(left == 0, -100)
    model = causal_lm("llama")
    remat.patch(model)
    model.train()
    results = []
    for checkpointing in (False, True):
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=left, labels=labels).loss.backward()
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in results[0].items():
        assert torch.equal(results[1][name], g), name


def checkpoint_flags(model):
    return [layer.gradient_checkpointing for layer in model.model.layers]


def test_every_n_layers_counts_remat_layers_as_hugging_face_counts_its_own():
    """gradient_checkpointing_enable(every_n_layers=2) flags layers 0 and 2 of four, patched or not;
    with the planner's per-layer mix (a stock layer among remat ones) the count runs over both."""
    stock, patched, mixed = build("llama", 4), build("llama", 4), build("llama", 4)
    remat.patch(patched)
    remat.patch(mixed, policy={"model.layers.1": "stock", "model.layers.0": "balanced", "model.layers.2": "memory",
                               "model.layers.3": "speed"})
    assert type(mixed.model.layers[1]).__name__ == "LlamaDecoderLayer"
    for model in (stock, patched, mixed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(every_n_layers=2)
        assert checkpoint_flags(model) == [True, False, True, False], type(model.model.layers[0]).__name__
        disable(model)
        assert checkpoint_flags(model) == [False] * 4


def test_unpatch_hands_mode_and_checkpointing_to_the_restored_layers():
    """model.eval() and gradient_checkpointing_enable() called while patched hold after unpatch."""
    model = build("llama", 2)
    model.train()
    remat.patch(model)
    model.eval()
    enable(model)
    remat.unpatch(model)
    assert not any(module.training for module in model.modules())
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert "_set_gradient_checkpointing" not in model.__dict__
