"""Gradients of different inputs never share storage (issue 31).

rms_norm / layer_norm with ``residual=`` returned one tensor as the gradient of both x and the
residual (h = x + residual), and autograd may keep a returned gradient as a leaf's ``.grad``: x.grad
and residual.grad were one storage, so accumulating two micro-batches gave 3x instead of 2x and
``x.grad.mul_(0)`` zeroed residual.grad. For every public entry with several differentiable inputs
(tests/_grad_cases.py: every CPU backend, the nn.RMSNorm module with a residual, whole patched
Hugging Face models), on leaves:

- no two leaves' .grad share storage (untyped_storage().data_ptr(), zero-size gradients aside);
- two forward/backward passes accumulate exactly twice one pass's gradients.
"""

import pytest
import torch

import _grad_cases as cases
from _grad_cases import objective

CASES = [c for c in cases.entry_cases() if not c.name.startswith("dropout")] + [
    cases.patched_model("llama", policy) for policy in ("speed", "balanced", "memory")] + [
    cases.patched_model("gemma2", "memory")]


def _backward(run):
    objective(run()).backward()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients_of_different_inputs_do_not_share_storage(case):
    run, leaves = case.build(False)
    assert len(leaves) > 1
    _backward(run)
    storages = {}
    for i, leaf in enumerate(leaves):
        if leaf.grad is None or leaf.grad.numel() == 0:
            continue
        pointer = leaf.grad.untyped_storage().data_ptr()
        assert pointer not in storages, f"leaves {storages.get(pointer)} and {i} share one gradient storage"
        storages[pointer] = i
    once = [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves]
    _backward(run)
    for i, (leaf, grad) in enumerate(zip(leaves, once)):
        if grad is not None:
            assert torch.equal(leaf.grad, 2 * grad), f"leaf {i}: two passes did not accumulate twice one pass"
