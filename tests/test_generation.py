"""Generation from a patched model: with a KV cache (DynamicCache, sliding-window layers included)
each fused layer runs the Hugging Face layer it replaced, which appends to the cache and attends
through remat's attention ("remat" attention implementation). Greedy generate() returns the stock
model's tokens for single prompts and batched left-padded prompts on tiny Llama, Mistral (window
4, prompts longer than it), Qwen2 and GPT-2, and also Gemma 2 / 3, Qwen3 and Phi-3; training steps
and generation alternate on one model."""

import pytest
import torch

import remat
from remat.memory import SavedTensorLog

from helpers import LENGTH, batch, causal_lm, gpt2_model

transformers = pytest.importorskip("transformers")

KINDS = ("llama", "mistral", "qwen2", "gpt2")


def build(kind):
    model = gpt2_model() if kind == "gpt2" else causal_lm(kind)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # always max_new_tokens tokens
    # The helpers' configs say use_cache=False (training); generation uses a cache, as by default.
    model.generation_config.use_cache = True
    return model


def greedy(model, ids, mask, new_tokens=6):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)


def greedy_with_logits(model, ids, mask, new_tokens=6):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)


# Per-step logits, patched vs stock, both float32, |logit| < 1 here: the two implementations order
# their float32 sums differently, a few ulps (float32 eps 1.2e-7) through 2 layers; measured at most
# 3.2e-7 over the eight families (CPU), so 2e-6 absolute bounds it with 6x margin, while a wrong
# mask, window or cache position moves logits by 1e-2 and more.
LOGIT_TOLERANCE = dict(rtol=0, atol=2e-6)


def assert_same_generation(got, want, steps):
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == steps
    for step, (got_step, want_step) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(got_step, want_step, **LOGIT_TOLERANCE, msg=lambda m, s=step: f"step {s}: {m}")


class CountingAttention:
    """Wraps the registered "remat" attention function, counting calls and the query lengths."""

    def __init__(self):
        self.registry = transformers.AttentionInterface._global_mapping
        self.inner = self.registry["remat"]
        self.query_lengths = []

    def __enter__(self):
        def counted(module, query, *args, **kwargs):
            self.query_lengths.append(query.shape[2])
            return self.inner(module, query, *args, **kwargs)

        self.registry["remat"] = counted
        return self

    def __exit__(self, *exc):
        self.registry["remat"] = self.inner


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_returns_the_stock_tokens(kind):
    stock, patched = build(kind), build(kind)
    remat.patch(patched)
    ids, mask, _ = batch()
    left = mask.flip(1)  # batched prompts padded on the left, as generate expects
    want_single, want_batched = greedy_with_logits(stock, ids[:1], mask[:1]), greedy_with_logits(stock, ids, left)
    with CountingAttention() as counter:
        got_single = greedy_with_logits(patched, ids[:1], mask[:1])
        got_batched = greedy_with_logits(patched, ids, left)
    # Mistral's window (4) is shorter than the prompt (11): every decode step runs on a full window.
    assert_same_generation(got_single, want_single, 6)
    assert_same_generation(got_batched, want_batched, 6)
    # Every step of every layer attended through remat: the prompt, then one query per new token.
    layers = 2
    assert counter.query_lengths == ([LENGTH] * layers + [1] * layers * 5) * 2


def test_cached_forward_saves_nothing_and_matches_stock():
    stock, patched = build("mistral"), build("mistral")
    remat.patch(patched)
    ids, mask, _ = batch()
    left = mask.flip(1)
    real = left.bool()
    with torch.inference_mode():
        want = stock(input_ids=ids, attention_mask=left, use_cache=True)
    with torch.no_grad(), SavedTensorLog() as log:
        got = patched(input_ids=ids, attention_mask=left, use_cache=True)
    assert log.saved == []
    torch.testing.assert_close(got.logits[real], want.logits[real], rtol=1e-5, atol=1e-5)
    for layer_got, layer_want in zip(got.past_key_values.layers, want.past_key_values.layers, strict=True):
        torch.testing.assert_close(layer_got.keys, layer_want.keys)
        torch.testing.assert_close(layer_got.values, layer_want.values)


def test_training_steps_and_generation_alternate():
    """An evaluation loop that samples mid-training: train, generate, train; parameters and tokens
    stay those of the stock model doing the same."""
    ids, mask, labels = batch()
    left = mask.flip(1)
    runs = []
    for patch in (False, True):
        model = build("qwen2")
        if patch:
            remat.patch(model)
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        tokens = []
        for _ in range(2):
            optimizer.zero_grad()
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
            tokens.append(greedy(model, ids, left, new_tokens=4))
        runs.append((tokens, [p.detach().clone() for p in model.parameters()]))
    (stock_tokens, stock_params), (tokens, params) = runs
    assert not torch.equal(stock_tokens[0], stock_tokens[1])  # training changed what is generated
    for got, want in zip(tokens, stock_tokens, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(params, stock_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_static_cache_and_late_adapters_raise():
    model = build("llama")
    remat.patch(model)
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="dynamic KV cache"):
        model.generate(input_ids=ids[:1], max_new_tokens=2, do_sample=False, cache_implementation="static")
    layer = model.model.layers[0]
    layer.extra = torch.nn.Linear(2, 2)  # a parameter the replaced stock layer does not hold
    with pytest.raises(ValueError, match="adapter added after remat.patch"):
        greedy(model, ids[:1], mask[:1], new_tokens=2)


def test_a_layer_built_on_its_own_refuses_a_cache():
    layer = remat.nn.LlamaLayer(64, 160, 4, 2)
    cache = transformers.DynamicCache()
    with pytest.raises(ValueError, match="remat.patch"):
        layer(torch.randn(1, 3, 64), cache=cache)


def test_generate_returns_the_stock_hidden_states():
    """Hugging Face records hidden states with hooks: with a cache the replacement's carried hooks
    record each layer once (the stock layer inside runs without its own)."""
    ids, mask, _ = batch()
    left = mask.flip(1)
    runs = []
    for patch in (False, True):
        model = build("llama")
        if patch:
            remat.patch(model)
        runs.append(model.generate(input_ids=ids, attention_mask=left, max_new_tokens=3, do_sample=False,
                                   output_hidden_states=True, return_dict_in_generate=True))
    stock, patched = runs
    assert torch.equal(stock.sequences, patched.sequences)
    assert [len(s) for s in patched.hidden_states] == [len(s) for s in stock.hidden_states] == [3, 3, 3]
    for step, (want_step, got_step) in enumerate(zip(stock.hidden_states, patched.hidden_states, strict=True)):
        real = left.bool() if step == 0 else torch.ones(2, 1, dtype=torch.bool)
        for want, got in zip(want_step, got_step, strict=True):
            torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def other_family(kind):
    """Tiny Gemma 2 / Gemma 3 (window 4 on layer 0, attention softcap), Qwen3 (window 4 on layer
    1) and Phi-3 (window 4) models from configs."""
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation="eager")
    if kind in ("gemma2", "gemma3"):
        config_class = transformers.Gemma2Config if kind == "gemma2" else transformers.Gemma3TextConfig
        config = config_class(head_dim=16, query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=5.0,
                              layer_types=["sliding_attention", "full_attention"], **common)
        model_class = transformers.Gemma2ForCausalLM if kind == "gemma2" else transformers.Gemma3ForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                          **common)
        model_class = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Phi3Config(original_max_position_embeddings=64, sliding_window=4, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2, **common)
        model_class = transformers.Phi3ForCausalLM
    model = model_class(config)
    model.generation_config.update(pad_token_id=0, eos_token_id=None, use_cache=True)
    return model


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen3", "phi3"])
def test_other_families_generate_the_stock_tokens(kind):
    stock, patched = other_family(kind), other_family(kind)
    remat.patch(patched)
    ids, mask, _ = batch()
    left = mask.flip(1)
    with CountingAttention() as counter:
        got = greedy_with_logits(patched, ids, left, new_tokens=4)
    assert_same_generation(got, greedy_with_logits(stock, ids, left, new_tokens=4), 4)
    assert len(counter.query_lengths) == 2 * 4


def test_a_cache_in_a_training_forward_raises():
    """Training mode with grad enabled and a KV cache would run the stock layers (keeping every
    activation) in silence: it raises, naming use_cache=False; without grad it generates."""
    model = build("llama")
    remat.patch(model)
    model.train()
    ids, mask, labels = batch()
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=True)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, attention_mask=mask, cache=transformers.DynamicCache())
    with torch.no_grad():
        assert model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values is not None


def test_stock_layers_get_the_cache_under_their_own_argument_name():
    """transformers 5.17 named a decoder layer's cache ``past_key_values`` (GPT2Block: its second
    positional parameter), 5.24 names it ``cache``: the stock block a patched model runs with a
    cache gets it under the name its forward declares. Here each stock GPT-2 block's forward is
    wrapped in one with the 5.17 signature; passed ``cache=`` it would drop the cache into
    ``**kwargs`` and decode without it (logits off by ~0.2 from the second step on)."""
    stock, patched = build("gpt2"), build("gpt2")
    remat.patch(patched)
    received = []
    for layer in patched.transformer.h:
        original = layer._remat_original

        def forward_5_17(hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                         encoder_attention_mask=None, use_cache=False, _original=original, **kwargs):
            assert "cache" not in kwargs
            received.append(past_key_values is not None)
            return type(_original).forward(_original, hidden_states, past_key_values, attention_mask,
                                           encoder_hidden_states, encoder_attention_mask, use_cache, **kwargs)

        original.forward = forward_5_17
    ids, mask, _ = batch()
    want, got = greedy_with_logits(stock, ids[:1], mask[:1]), greedy_with_logits(patched, ids[:1], mask[:1])
    assert_same_generation(got, want, 6)
    assert received and all(received)


def test_the_cache_is_renamed_only_when_the_stock_forward_lacks_its_name():
    from remat.hf import _cache_under_stock_name

    cache = object()

    def new_style(hidden_states, cache=None, **kwargs):
        pass

    def old_style(hidden_states, past_key_values=None, **kwargs):
        pass

    def neither(hidden_states, **kwargs):
        pass

    assert _cache_under_stock_name(old_style, dict(cache=cache, use_cache=True)) == dict(past_key_values=cache,
                                                                                         use_cache=True)
    assert _cache_under_stock_name(new_style, dict(past_key_values=cache)) == dict(cache=cache)
    assert _cache_under_stock_name(new_style, dict(cache=cache, past_key_values=None)) == dict(cache=cache)
    assert _cache_under_stock_name(neither, dict(cache=cache)) == dict(cache=cache)
    assert _cache_under_stock_name(old_style, dict(use_cache=False)) == dict(use_cache=False)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_a_patched_block_called_with_either_cache_name_runs_cached(name):
    """A decoder block called directly with the cache under either name (GPT-2's block takes
    ``cache`` positionally and would get ``cache=None`` besides a ``past_key_values=`` keyword)
    runs the stock block, which appends the stock keys and values to the cache; before the fix
    the ``past_key_values=`` call ran the fused block and left the cache empty."""
    stock, patched = build("gpt2"), build("gpt2")
    remat.patch(patched)
    hidden = torch.randn(1, 5, stock.config.hidden_size)
    caches = []
    for model in (stock, patched):
        model.eval()
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model.transformer.h[0](hidden, use_cache=True, **{name: cache})
        caches.append(cache)
    assert [cache.get_seq_length() for cache in caches] == [5, 5]
    torch.testing.assert_close(caches[1].layers[0].keys, caches[0].layers[0].keys)
    torch.testing.assert_close(caches[1].layers[0].values, caches[0].layers[0].values)
