"""remat.patch / unpatch on real Hugging Face models, whatever the family: shared parameters and
unpatch, subsets of module kinds, plain PyTorch norms, the mask check (4-D masks refused:
positional, in kwargs, behind wrapped forwards), the attention implementation switched and
restored, eval mode, deepcopy, look-alike classes left alone, models loaded from a local
checkpoint."""

import copy
import inspect

import pytest
import torch

import remat

from helpers import HEADS, HIDDEN, INTER, KV_HEADS, batch, causal_lm, gpt2_model

transformers = pytest.importorskip("transformers")


def test_patch_shares_parameters_and_unpatch_restores():
    model = causal_lm("llama")
    layers = list(model.model.layers)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    remat.patch(model)
    assert type(model.model.layers[0]).__name__ == "HFLlamaLayer"
    assert list(model.state_dict()) == keys
    for name, p in model.named_parameters():
        assert p is params[name]
    with pytest.raises(ValueError, match="already patched"):
        remat.patch(model)
    remat.unpatch(model)
    assert list(model.model.layers) == layers
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    with pytest.raises(ValueError, match="not patched"):
        remat.unpatch(model)


def test_patch_subset_of_module_kinds():
    model = causal_lm("llama")
    report = remat.patch(model, modules=("norm", "mlp"))
    names = {name for name, _, _ in report.replaced}
    assert "model.layers.0.mlp" in names and "model.layers.0.input_layernorm" in names and "model.norm" in names
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"
    ids, mask, labels = batch()
    stock = causal_lm("llama")
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                               stock(input_ids=ids, attention_mask=mask).logits[mask.bool()], rtol=1e-5, atol=1e-5)


def test_plain_pytorch_norms_are_patched():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16),
                                torch.nn.RMSNorm(16))
    x = torch.randn(5, 8)
    want = model(x)
    report = remat.patch(model, modules=("norm",))
    assert [old for _, old, _ in report.replaced] == ["LayerNorm", "RMSNorm"]
    torch.testing.assert_close(model(x), want)


def four_d_mask(mask):
    """A 4-D additive mask [B, 1, N, N] (what a user builds for custom attention patterns)."""
    n = mask.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_non_padding_masks_raise_and_padding_masks_and_caches_run():
    """4-D (custom) masks are refused, naming what is supported; left padding and a KV cache run
    (their results: tests/models/test_sequences.py, tests/test_generation.py)."""
    model = causal_lm("llama")
    remat.patch(model)
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="2-D"):
        model(input_ids=ids, attention_mask=four_d_mask(mask))
    model(input_ids=ids, attention_mask=mask.flip(1))
    with torch.no_grad():  # a cache in a training forward with grad raises (tests/test_generation.py)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    assert out.past_key_values.get_seq_length() == ids.shape[1]
    assert model.config._attn_implementation == "remat" and model.config.use_cache is False
    remat.unpatch(model)
    assert model.config._attn_implementation == "eager" and model.config.use_cache is False  # as built


def test_patch_keeps_eval_mode():
    model = gpt2_model(dropout=0.3)
    model.eval()
    ids, mask, _ = batch()
    want = model(input_ids=ids, attention_mask=mask).logits
    remat.patch(model)
    assert not model.transformer.h[0].training
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[mask.bool()], want[mask.bool()],
                               rtol=1e-5, atol=1e-5)


def test_patch_attention_alone_keeps_the_sliding_window():
    stock, patched = causal_lm("mistral"), causal_lm("mistral")
    report = remat.patch(patched, modules=("attention",))
    assert {old for _, old, _ in report.replaced} == {"MistralAttention"}
    assert patched.model.layers[0].self_attn.window == (3, None)
    ids, mask, _ = batch()
    real = mask.bool()
    torch.testing.assert_close(patched(input_ids=ids, attention_mask=mask).logits[real],
                               stock(input_ids=ids, attention_mask=mask).logits[real], rtol=1e-5, atol=1e-5)


def test_patched_model_deepcopies_and_checks_positional_masks():
    model = causal_lm("llama")
    remat.patch(model)
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="2-D"):
        model(ids, four_d_mask(mask))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    assert not torch.equal(clone(input_ids=ids).logits, model(input_ids=ids).logits)
    assert "input_ids" in inspect.signature(model.forward).parameters


def test_lookalike_models_are_left_alone():
    """OLMo 2's layers norm q and k over all heads at once and put their norms after each
    sub-block, which no remat family computes: not replaced. (Qwen3, once the look-alike here,
    is its own family now: tests/models/test_qwen3.py.)"""
    if not hasattr(transformers, "Olmo2ForCausalLM"):
        pytest.skip("this transformers has no OLMo 2")
    torch.manual_seed(0)
    config = transformers.Olmo2Config(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, eos_token_id=None,
                                      use_cache=False, attn_implementation="eager")
    model = transformers.Olmo2ForCausalLM(config)
    ids, mask, _ = batch()
    want = model(input_ids=ids, attention_mask=mask).logits
    report = remat.patch(model)
    assert report.replaced == []
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, want)


def test_patch_model_loaded_from_a_local_checkpoint(tmp_path):
    causal_lm("qwen2", attention_dropout=0.3).save_pretrained(tmp_path)
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    patched = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    report = remat.patch(patched, policy="memory")
    assert len(report.replaced) == 4 and not any(m.training for m in patched.modules())  # the loss too
    ids, mask, labels = batch()
    real = mask.bool()
    torch.testing.assert_close(patched(input_ids=ids, attention_mask=mask).logits[real],
                               stock(input_ids=ids, attention_mask=mask).logits[real], rtol=1e-5, atol=1e-5)


def test_mask_check_sees_masks_behind_kwargs_and_wrapped_forwards():
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **batch):
            return self.inner(**batch)

    model = Wrapper(causal_lm("llama"))
    remat.patch(model)
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="2-D"):
        model(input_ids=ids, attention_mask=four_d_mask(mask))

    inner = causal_lm("llama")
    calls = []
    stock_forward = inner.forward

    def hook_forward(*args, **kwargs):  # an instance forward, as accelerate's hooks install
        calls.append(1)
        return stock_forward(*args, **kwargs)

    inner.forward = hook_forward
    remat.patch(inner)
    with pytest.raises(ValueError, match="2-D"):
        inner(input_ids=ids, attention_mask=four_d_mask(mask))
    inner(input_ids=ids, attention_mask=mask)
    assert calls == [1]
    remat.unpatch(inner)
    assert inner.forward is hook_forward
