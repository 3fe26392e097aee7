"""The GPT-2 family (remat.models.gpt2): GPT2Layer's policies as measured byte formulas, patched tiny
GPT-2 models against a float64 copy of the stock model, residual and attention dropout."""

import pytest
import torch

import remat
from remat.memory import saved_bytes

from _checks import assert_within_2x_of_stock
from helpers import BATCH, HEADS, HIDDEN, LENGTH, batch, cpu_backends, gpt2_model, logits_and_grads

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_gpt2_layer_saves_the_documented_bytes(policy, dtype):
    layer = remat.nn.GPT2Layer(HIDDEN, HEADS, policy=policy, resid_dropout=0.1, dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    s = x.element_size()
    per_token = {"memory": 3 * s * HIDDEN, "balanced": 6 * s * HIDDEN,
                 "speed": 6 * s * HIDDEN + s * 4 * HIDDEN}[policy] + 4 * HEADS + 16
    assert layer.saved_bytes_per_token(s) == per_token
    assert saved_bytes(layer, x) == BATCH * LENGTH * per_token + 2 * 16  # two residual dropouts' RNG state


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_patched_gpt2_matches_stock(dtype, policy, backend):
    reference, stock, patched = gpt2_model(torch.float64), gpt2_model(dtype), gpt2_model(dtype)
    report = remat.patch(patched, policy=policy, backend=backend)
    assert [old for _, old, _ in report.replaced] == ["GPT2Block", "GPT2Block", "LayerNorm", "GPT2LMHeadModel loss"]
    assert {patched.transformer.h[0].backend, patched.transformer.ln_f.backend} == {backend}
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (logits_and_grads(m, ids, mask, labels) for m in (reference, stock, patched))
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    assert_within_2x_of_stock("loss", got[1].reshape(1), base[1].reshape(1), want[1].reshape(1), dtype)
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)


def test_gpt2_dropout_is_reproducible_and_stores_no_mask():
    model = gpt2_model(dropout=0.2)
    remat.patch(model)
    model.train()
    ids, mask, labels = batch()
    torch.manual_seed(9)
    first = logits_and_grads(model, ids, mask, labels)
    torch.manual_seed(9)
    second = logits_and_grads(model, ids, mask, labels)
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name])
    layer = model.transformer.h[0]
    x = torch.randn(BATCH, LENGTH, HIDDEN, requires_grad=True)
    layer.policy = "memory"
    # The memory-policy bytes plus three RNG states (attention and two residual dropouts): no mask.
    assert saved_bytes(layer, x) == BATCH * LENGTH * (12 * HIDDEN + 4 * HEADS + 16) + 3 * 16
