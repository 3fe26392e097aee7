"""A patched model compiled with torch.compile (inductor, AOT autograd's min-cut partitioner) keeps
for backward what the same model keeps eagerly, and gives the eager gradients.

The compiled backward recomputes inside the same joint graph as the forward; without
remat.autograd.common.distinct_from_forward the graph's common-subexpression pass merges the
recomputation into the forward and the partitioner keeps its results (the MLP's gate/up, q/k/v):
the control case below shows the measure sees that."""

import pytest
import torch

import remat
from remat.autograd import common
from remat.memory import PeakSavedBytes

from helpers import HIDDEN, batch, causal_lm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _peak_and_grads(model, ids, mask, labels):
    """(peak saved bytes over forward and backward, loss, {name: grad}) of one training step."""
    model.zero_grad(set_to_none=True)
    with PeakSavedBytes() as peak:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    return peak.peak, loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                                      for n, p in model.named_parameters()}


def _patched_llama(policy):
    # 32 tokens per row and an intermediate 4x the hidden size: the MLP's [rows, intermediate]
    # tensors dominate what a merged recomputation would keep.
    model = causal_lm("llama", intermediate_size=256, attn_implementation="sdpa").train()
    remat.patch(model, policy=policy)
    return model


_ROWS = 2 * 32
_HIDDEN_STATE_BYTES = _ROWS * HIDDEN * 4  # one fp32 [rows, hidden] tensor


def _batch():
    """(ids, mask, labels): 2 rows of 32 tokens, no pads, labels = ids."""
    ids = batch()[0].repeat(1, 3)[:, :32]
    return ids, torch.ones_like(ids), ids


def _eager_then_compiled(model, ids, mask, labels):
    """(eager peak, compiled peak) of one training step of ``model``, eager and then under
    torch.compile (inductor, fullgraph; measured on the step after the compiling one); the
    compiled loss and gradients are asserted equal to eager's."""
    eager_peak, eager_loss, eager_grads = _peak_and_grads(model, ids, mask, labels)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    _peak_and_grads(compiled, ids, mask, labels)  # compiles
    peak, loss, grads = _peak_and_grads(compiled, ids, mask, labels)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    return eager_peak, peak


@pytest.mark.parametrize("policy", ["memory", "balanced"])
def test_compiled_patched_llama_keeps_what_eager_keeps(policy):
    eager_peak, peak = _eager_then_compiled(_patched_llama(policy), *_batch())
    # The partitioner's cut keeps one [rows, hidden] tensor more than eager here (9 against 8) and
    # a few hundred bytes of the packed-rows route's sequence bounds (the compiled step takes it:
    # the mask's all-ones check is data-dependent); a merged recomputation keeps 3x (the control).
    assert peak <= eager_peak + _HIDDEN_STATE_BYTES + 1024, (peak, eager_peak)


def test_without_distinct_views_the_compiled_step_keeps_the_recomputation(monkeypatch):
    """The control: with the backward reading the saved tensors themselves, the compiled memory
    policy keeps the MLP's gate/up and the attention's q/k/v: over twice the eager bytes."""
    ids, mask, labels = _batch()
    model = _patched_llama("memory")
    eager_peak = _peak_and_grads(model, ids, mask, labels)[0]
    monkeypatch.setattr(common, "distinct_from_forward", lambda saved: saved)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    _peak_and_grads(compiled, ids, mask, labels)
    peak = _peak_and_grads(compiled, ids, mask, labels)[0]
    assert peak > eager_peak * 2, (peak, eager_peak)


def test_compiled_plan_with_multi_layer_spans_keeps_no_more_than_eager():
    """A remat plan of two two-layer checkpointed spans compiles to one graph, the spans as
    checkpoint regions the partitioner recomputes: the eager gradients, and no more kept than the
    eager step (whose chain executor's re-run saves count; the compiled re-run's live
    inside the compiled backward)."""
    from remat.planning import model_plan

    ids, mask, labels = _batch()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    model = causal_lm("llama", intermediate_size=256, num_hidden_layers=4, attn_implementation="sdpa").train()
    costs = model_plan.measure_model_costs(model, inputs)
    floor = model_plan.smallest_feasible_budget(costs)
    remat.patch(model, policy="auto", budget_bytes=floor, example_inputs=inputs)
    # Two spans of two layers (the planner picks one-layer spans at this shape's floor).
    spans = tuple(model_plan.Span(start, start + 2, ("memory", "balanced")) for start in (0, 2))
    model_plan.install(model_plan.ModelPlan(costs, spans, floor), list(model.model.layers))
    eager_peak, peak = _eager_then_compiled(model, ids, mask, labels)
    assert peak <= eager_peak + 1024, (peak, eager_peak)
