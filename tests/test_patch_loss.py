"""remat.patch's fused output loss on real Hugging Face causal LMs (remat.models.causal_lm): in
training with labels the loss is remat.linear_cross_entropy on the final hidden states, no logits
materialised; HF's label shift, shift_labels, num_items_in_batch, tied embeddings, return_dict=False,
eval mode and unpatch; a non-Linear lm_head is refused loudly."""

import pytest
import torch

import remat
from remat.memory import saved_bytes

from _checks import assert_within_2x_of_stock
from helpers import BATCH, LENGTH, batch, causal_lm, gpt2_model, logits_and_grads

transformers = pytest.importorskip("transformers")


def _loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _check_against_float64(make, dtype, **call):
    """Loss and every gradient of the patched model (fused loss) against a float64 stock copy, under
    the 2x rule with the stock model in ``dtype``."""
    reference, stock, patched = make(torch.float64), make(dtype), make(dtype)
    remat.patch(patched)
    want, base, got = (_loss_and_grads(m, **call) for m in (reference, stock, patched))
    assert got[0].logits is None, "the fused loss materialised logits"
    assert_within_2x_of_stock("loss", got[0].loss.reshape(1), base[0].loss.reshape(1), want[0].loss.reshape(1),
                              dtype)
    for name in want[1]:
        assert_within_2x_of_stock(name, got[1][name], base[1][name], want[1][name], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_loss_matches_stock_with_num_items_and_shift_labels(dtype):
    ids, mask, labels = batch()
    num_items = (labels[:, 1:] != -100).sum()
    _check_against_float64(lambda d: causal_lm("llama", d), dtype, input_ids=ids, attention_mask=mask,
                           labels=labels, num_items_in_batch=num_items)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shift[0, 3] = -100
    _check_against_float64(lambda d: causal_lm("qwen2", d), dtype, input_ids=ids, attention_mask=mask,
                           labels=labels, shift_labels=shift)


def test_fused_loss_with_tied_embeddings_and_gpt2():
    ids, mask, labels = batch()
    _check_against_float64(lambda d: causal_lm("llama", d, tie_word_embeddings=True), torch.float32,
                           input_ids=ids, attention_mask=mask, labels=labels)
    _check_against_float64(gpt2_model, torch.float32, input_ids=ids, attention_mask=mask, labels=labels)


def test_fused_loss_saves_no_logits():
    """A training step's saved bytes drop by the logits term: stock cross-entropy keeps its fp32
    log-probabilities [B * N, V]; the fused loss keeps one fp32 lse per token instead (both keep the
    hidden states and the targets)."""
    ids, mask, labels = batch()
    stock, fused = causal_lm("llama", torch.bfloat16), causal_lm("llama", torch.bfloat16)
    remat.patch(stock, modules=("norm", "mlp", "attention"))
    report = remat.patch(fused)
    assert ("LlamaForCausalLM", "LlamaForCausalLM loss", "fused linear cross-entropy") in report.replaced
    with_logits = saved_bytes(lambda: stock(input_ids=ids, attention_mask=mask, labels=labels).loss)
    without = saved_bytes(lambda: fused(input_ids=ids, attention_mask=mask, labels=labels).loss)
    vocab = fused.config.vocab_size
    assert with_logits - without >= BATCH * LENGTH * (vocab * 4 - 4)


def test_eval_mode_return_dict_and_unpatch():
    ids, mask, labels = batch()
    model = causal_lm("llama")
    remat.patch(model)
    loss, *rest = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert loss.dim() == 0 and all(not (torch.is_tensor(t) and t.shape[-1] == model.config.vocab_size)
                                   for t in rest)
    model.eval()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is not None and out.logits.shape == (BATCH, LENGTH, model.config.vocab_size)
    model.train()
    remat.unpatch(model)
    assert "forward" not in model.__dict__
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is not None


class _AdaptedHead(torch.nn.Linear):
    """An lm_head with an extra term (as a LoRA adapter adds): the fused loss must not drop it."""

    def forward(self, x):
        return super().forward(x) + 1.0


def test_non_linear_lm_head_is_refused_loudly():
    ids, mask, labels = batch()
    model = causal_lm("llama")
    head = model.lm_head
    adapted = _AdaptedHead(head.in_features, head.out_features, bias=False)
    adapted.weight = head.weight
    model.lm_head = adapted
    report = remat.patch(model)
    assert any(kind == "loss" and "not a plain nn.Linear" in why for _, kind, why in report.left_alone)
    stock_loss = logits_and_grads(model, ids, mask, labels)[1]
    assert torch.isfinite(stock_loss)
    remat.unpatch(model)
    model.lm_head = head
    remat.patch(model)
    model.lm_head = adapted  # an adapter added after patching
    with pytest.raises(ValueError, match="not a plain nn.Linear"):
        model(input_ids=ids, attention_mask=mask, labels=labels)


def test_hooked_heads_stay_stock():
    """A hook on lm_head (accelerate's device placement, offload, a sharding unit) would be skipped by
    the fused loss, which reads lm_head.weight directly: such a head keeps the stock loss."""
    ids, mask, labels = batch()
    hooked = causal_lm("llama")
    hooked.lm_head.register_forward_pre_hook(lambda module, args: None)
    report = remat.patch(hooked)
    assert any(kind == "loss" and "forward hooks" in why for _, kind, why in report.left_alone)
    assert hooked(input_ids=ids, attention_mask=mask, labels=labels).logits is not None
