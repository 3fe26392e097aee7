"""A patched model answers where user code reads stock's answers: ``return_dict=False`` tuples keep
stock's positions (the fused loss's logits and the KV cache a patched training forward does not
build stay in place as None; hidden states, MoE aux loss and router logits at stock's indices,
their values within the 2x rule against float64), and ``save_pretrained`` writes what the
unpatched model writes (config.json and generation_config.json byte for byte, the same
safetensors), which Hugging Face reloads without remat to the stock model's logits."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import remat

from _checks import assert_within_2x_of_stock
from helpers import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, batch, causal_lm, gpt2_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# The families whose causal LM gets remat's fused loss (their Family.causal_lms).
FUSED_LOSS_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2", "mixtral"]


def family_model(kind, dtype=torch.float32, seed=0, use_cache=True):
    """A tiny causal LM of ``kind`` (2 layers, eager attention) in ``dtype``, ``config.use_cache``
    as given (True: what a checkpoint from the Hub says); the same seed gives the same weights in
    every dtype. Mixtral: 4 experts, 2 per token, Hugging Face's eager expert loop."""
    if kind in ("llama", "mistral", "qwen2"):
        return causal_lm(kind, dtype, seed, use_cache=use_cache)
    if kind == "gpt2":
        model = gpt2_model(dtype, seed)
        model.config.use_cache = use_cache
        return model
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=64, use_cache=use_cache,
                  attn_implementation="eager")
    types = ["sliding_attention", "full_attention"]
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=INTER, head_dim=HEAD_DIM,
                                                                       **common))
    elif kind == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            intermediate_size=INTER, original_max_position_embeddings=64, sliding_window=5, pad_token_id=0, **common))
    elif kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            intermediate_size=INTER, head_dim=HEAD_DIM, sliding_window=4, layer_types=types, **common))
    elif kind == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            intermediate_size=INTER, head_dim=HEAD_DIM, sliding_window=4, layer_types=types, **common))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **common))
        model.set_experts_implementation("eager")
    return model.to(dtype)


def _compare_tuples(got, stock, reference, dtype, real):
    """got (patched) against stock position by position: the same length and types, None where
    stock has logits (the fused loss computes none) or a KV cache (a patched training forward
    builds none); tensors and tuples of tensors within the 2x rule against the float64 reference
    (token-shaped values on the real tokens only: padded positions differ by design)."""
    assert len(got) == len(stock) == len(reference), [type(v).__name__ for v in got]
    for i, (value, base, ref) in enumerate(zip(got, stock, reference, strict=True)):
        if torch.is_tensor(base) and base.dim() == 3 and base.shape[-1] == 96:  # the logits [B, N, vocab]
            assert value is None or torch.is_tensor(value), f"position {i}: {type(value).__name__}"
            if value is None:
                continue
        if isinstance(base, transformers.Cache):
            assert value is None or isinstance(value, transformers.Cache), f"position {i}: {type(value).__name__}"
            continue
        assert type(value) is type(base), f"position {i}: {type(value).__name__} != {type(base).__name__}"
        values, bases, refs = (list(v) if isinstance(v, tuple) else [v] for v in (value, base, ref))
        assert len(values) == len(bases)
        for j, (v, b, r) in enumerate(zip(values, bases, refs, strict=True)):
            if v.dim() >= 2 and v.shape[:2] == real.shape:
                v, b, r = v[real], b[real], r[real]
            elif v.dim() == 2 and v.shape[0] == real.numel():  # router logits [B * N, experts]
                v, b, r = (t.view(*real.shape, -1)[real] for t in (v, b, r))
            assert_within_2x_of_stock(f"position {i}[{j}]", v.detach().reshape(-1), b.detach().reshape(-1),
                                      r.detach().reshape(-1), dtype)


def _tuples(kind, use_cache, train=True, **call):
    reference, stock, patched = (family_model(kind, d, use_cache=use_cache)
                                 for d in (torch.float64, torch.float32, torch.float32))
    remat.patch(patched)
    ids, mask, labels = batch()
    for model in (reference, stock, patched):
        model.train(train)
    outs = [model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False, **call)
            for model in (reference, stock, patched)]
    return outs, mask.bool()


@pytest.mark.parametrize("hidden_states", [False, True], ids=["plain", "hidden_states"])
@pytest.mark.parametrize("kind", FUSED_LOSS_FAMILIES)
def test_fused_loss_tuple_keeps_stock_positions(kind, hidden_states):
    """Training with labels and config.use_cache True: stock returns (loss, logits, cache[,
    hidden_states]); the patched model (loss, None, None[, hidden_states]), so ``loss, logits =
    out[:2]`` and ``out[3]`` read what they read in stock."""
    (reference, stock, got), real = _tuples(kind, True, output_hidden_states=hidden_states)
    assert got[1] is None and got[2] is None, "logits and the cache stay in place as None"
    assert isinstance(stock[2], transformers.Cache)
    assert len(stock) == (4 if hidden_states else 3)
    _compare_tuples(got, stock, reference, torch.float32, real)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_tuple_without_cache_and_in_eval_mode(train):
    """config.use_cache False: stock builds no cache, and neither does the tuple hold a place for
    one; in eval mode the patched model computes logits (no fused loss) and leaves only the cache
    None in its place."""
    (reference, stock, got), real = _tuples("llama", False, train=train, output_hidden_states=True)
    assert len(got) == len(stock) == 3
    assert (got[1] is None) == train
    _compare_tuples(got, stock, reference, torch.float32, real)
    (reference, stock, got), real = _tuples("llama", True, train=train, output_hidden_states=True)
    assert len(got) == len(stock) == 4 and got[2] is None
    _compare_tuples(got, stock, reference, torch.float32, real)


def test_loss_only_patch_keeps_the_logits_place():
    """A patch of the loss alone (the layers, and so the cache, stock) keeps the logits' place."""
    ids, mask, labels = batch()
    stock, patched = family_model("llama"), family_model("llama")
    remat.patch(patched, modules=("loss",))
    got, base = (m(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False, output_hidden_states=True)
                 for m in (patched, stock))
    assert len(got) == len(base) == 4 and got[1] is None
    assert isinstance(got[2], transformers.Cache) and len(got[3]) == len(base[3]) == 3


@pytest.mark.parametrize("hidden_states", [False, True], ids=["plain", "hidden_states"])
def test_moe_tuple_with_router_logits_keeps_stock_positions(hidden_states):
    """Mixtral with output_router_logits (its fused loss adds the load-balancing loss, as stock):
    (loss, aux_loss, logits, cache[, hidden_states], router_logits) at stock's indices, the logits
    and the cache None in their places."""
    (reference, stock, got), real = _tuples("mixtral", True, output_router_logits=True,
                                            output_hidden_states=hidden_states)
    assert len(stock) == (6 if hidden_states else 5) and isinstance(stock[3], transformers.Cache)
    assert got[3] is None and got[2] is None and torch.is_tensor(got[1])
    _compare_tuples(got, stock, reference, torch.float32, real)


def _saved(model, directory):
    model.save_pretrained(directory)
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen3", "gemma2"])
def test_save_pretrained_writes_what_stock_writes(kind, tmp_path):
    """The patched model's save_pretrained writes the unpatched model's files byte for byte
    (config.json with its use_cache and no attention implementation of remat's, the generation
    config, the same tensors under the same names); it loads back, without patching, to the stock
    model's logits; the patched model keeps its private config and still pickles; unpatch removes
    the wrapper."""
    stock, patched = family_model(kind), family_model(kind)
    remat.patch(patched)
    want, got = _saved(stock, tmp_path / "stock"), _saved(patched, tmp_path / "patched")
    assert sorted(got) == sorted(want) == ["config.json", "generation_config.json", "model.safetensors"]
    for name in ("config.json", "generation_config.json"):
        assert json.loads(got[name]) == json.loads(want[name]), name
        assert got[name] == want[name], name
    assert json.loads(got["config.json"])["use_cache"] is True
    tensors, stock_tensors = (safetensors_torch.load_file(tmp_path / d / "model.safetensors")
                              for d in ("patched", "stock"))
    assert tensors.keys() == stock_tensors.keys()
    assert all(torch.equal(tensors[k], stock_tensors[k]) for k in tensors)
    # The patched model still runs patched, on its private config (which the save brought up to
    # date, as stock's: dtype and architectures).
    assert patched.config.use_cache is False and patched.config._attn_implementation == "remat"
    assert patched.config.architectures == stock.config.architectures
    pickle.loads(pickle.dumps(patched))
    ids, mask, _ = batch()
    stock.eval()
    with torch.no_grad():
        want_logits = stock(input_ids=ids, attention_mask=mask).logits
        reloaded = []
        for directory in ("patched", "stock"):
            model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / directory).eval()
            if kind == "mixtral":
                model.set_experts_implementation("eager")
            reloaded.append(model(input_ids=ids, attention_mask=mask).logits)
    # Exactly the stock save's reload; close to the live stock model (the reload runs transformers'
    # default attention, not the eager attention the test built it with).
    torch.testing.assert_close(reloaded[0], reloaded[1], rtol=0, atol=0)
    torch.testing.assert_close(reloaded[0], want_logits)
    remat.unpatch(patched)
    assert "save_pretrained" not in patched.__dict__ and "save_pretrained" not in patched.model.__dict__


def test_saved_patched_model_loads_in_a_process_without_remat(tmp_path):
    """A fresh Python process that never imports remat loads the patched model's save as a stock
    model with the stock model's logits."""
    stock, patched = family_model("llama"), family_model("llama")
    remat.patch(patched)
    patched.save_pretrained(tmp_path / "model")
    ids, mask, _ = batch()
    torch.save((ids, mask), tmp_path / "inputs.pt")
    script = (
        "import sys, torch, transformers\n"
        f"d = {str(tmp_path)!r}\n"
        "ids, mask = torch.load(d + '/inputs.pt')\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained(d + '/model').eval()\n"
        "assert model.config.use_cache is True and model.config._attn_implementation != 'remat'\n"
        "with torch.no_grad():\n"
        "    torch.save(model(input_ids=ids, attention_mask=mask).logits, d + '/logits.pt')\n"
        "assert not any(name == 'remat' or name.startswith('remat.') for name in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=300)
    stock.eval()
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).logits
    # Close, not equal: the reload runs transformers' default attention, not the test's eager one.
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want)
