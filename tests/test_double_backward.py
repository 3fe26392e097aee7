"""Double backward (issue 31): a gradient of a gradient through remat is right or refused, never a
wrong number.

remat's backward passes run fused kernels and recompute from saved statistics that carry no graph,
so with ``create_graph=True`` they used to hand out gradients whose own gradients were missing or
wrong (a gradient penalty through remat.rms_norm: 70-180% off). Every autograd Function of the
package now decorates its backward with remat.autograd.common.refuse_double_backward: first-order
gradients stay exact under ``create_graph=True``, and a second backward through the op raises a
RuntimeError that names it and points to stock PyTorch.

- every public entry (tests/_grad_cases.py; every CPU backend, Triton interpreted; two of them
  under remat.checkpoint, whose unpack hooks allow one unpack per saved tensor): first-order
  gradients with ``create_graph=True`` equal those without, bit for bit, and the stock float64
  composite's; the gradients of a gradient penalty (loss + sum ||dL/d leaf||^2), taken with
  ``torch.autograd.grad(penalty, leaves)`` (which runs only the nodes on a path to the leaves, so
  a refusal hanging off the graph would be skipped and the second-order term silently dropped),
  then either raise remat's refusal naming the op (or, for PyTorch's own CPU flash attention node,
  stock's "not implemented") or equal the stock composite's;
- whole patched Hugging Face models (Llama under every layer policy, a per-layer dict with a stock
  layer, a plan at its smallest budget that re-runs a span of layers through the chain executor;
  Gemma 2 under "memory", its own Functions): loss + ||dL/d inputs_embeds||^2 likewise;
- every torch.autograd.Function subclass defined anywhere in remat is covered, so a new Function
  cannot slip through;
- under torch.compile (AOT autograd traces the decorated backward) first-order gradients match
  eager, and AOT autograd's own double-backward refusal applies.
"""

import importlib
import pkgutil

import pytest
import torch

import remat

import _grad_cases as cases
from _grad_cases import REFUSAL, Case, objective

TOLERANCE = dict(rtol=1e-3, atol=1e-4)


def _penalty_grads(case, stock):
    """(first-order gradients of the objective, gradients of objective + the penalty, or the
    RuntimeError the second backward raised), after checking that first-order gradients taken with
    create_graph=True equal those taken without: bit for bit where only remat's backward passes
    run (the same code runs), to rounding where stock ones do (their double-differentiable formulas
    may round differently). Two forwards (the chain executor releases its checkpoints after one
    backward); every case is deterministic (dropout reseeds)."""
    run, leaves = case.build(stock)
    penalized = leaves[:case.penalized] if case.penalized is not None else leaves
    plain = torch.autograd.grad(objective(run()), leaves, allow_unused=True)
    loss = objective(run())
    graphed = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    for a, b in zip(plain, graphed):
        assert (a is None) == (b is None)
        if a is None:
            continue
        if case.exact and not stock:
            assert torch.equal(a, b.detach()), "first-order gradients changed under create_graph=True"
        else:
            torch.testing.assert_close(b.detach(), a, rtol=1e-5, atol=1e-7)
    penalty = loss + sum((g * g).sum() for g in graphed[:len(penalized)] if g is not None)
    try:
        second = torch.autograd.grad(penalty, leaves, allow_unused=True)
    except RuntimeError as error:
        return plain, error
    return plain, second


def _assert_grads_close(mine, stock, what):
    for i, (a, b) in enumerate(zip(mine, stock)):
        if b is None or not b.any():
            assert a is None or not a.any(), f"{what}: leaf {i} has a gradient where stock has none"
            continue
        assert a is not None, f"{what}: leaf {i} has no gradient"
        torch.testing.assert_close(a.double(), b, **TOLERANCE, msg=lambda m, i=i: f"{what}, leaf {i}: {m}")


def check_right_or_refused(case: Case):
    """The case's penalty gradients are the stock composite's, or refused with a message that names
    the op and says what to do; first-order gradients are the stock composite's either way."""
    first, second = _penalty_grads(case, stock=False)
    stock_first, stock_second = _penalty_grads(case, stock=True)
    assert not isinstance(stock_second, Exception), stock_second
    _assert_grads_close(first, stock_first, "first-order gradients against the stock float64 composite")
    if isinstance(second, RuntimeError):
        message = str(second)
        if case.stock_error is not None:
            assert case.stock_error in message
            return
        assert REFUSAL in message, message
        assert message.startswith(case.op or "remat"), message
        assert "stock PyTorch" in message and "remat.unpatch(model)" in message
        return
    _assert_grads_close(second, stock_second, "second-order gradients against the stock float64 composite")


@pytest.mark.parametrize("case", cases.entry_cases(), ids=lambda c: c.name)
def test_public_entry_double_backward_is_right_or_refused(case):
    check_right_or_refused(case)


MODEL_CASES = [cases.patched_model("llama", policy) for policy in ("speed", "balanced", "memory")] + [
    cases.patched_model("llama", {"model.layers.0": "memory", "model.layers.1": "stock"}),
    cases.patched_model("gemma2", "memory"), cases.patched_model("llama", "auto", layers=6),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_patched_model_gradient_penalty_is_right_or_refused(case):
    check_right_or_refused(case)


def _remat_functions():
    """Every torch.autograd.Function subclass defined in remat's modules, after importing them all
    (subclasses found through __subclasses__, so classes defined inside functions count too)."""
    for module in pkgutil.walk_packages(remat.__path__, "remat."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    found, stack = set(), [torch.autograd.Function]
    while stack:
        for sub in stack.pop().__subclasses__():
            stack.append(sub)
            if sub.__module__.startswith("remat.") and sub.__dict__.get("backward") is not None:
                found.add(sub)
    return found


def test_every_remat_function_refuses_double_backward():
    functions = _remat_functions()
    names = {f.__name__ for f in functions}
    # The list as of issue 31, so the discovery itself cannot silently find nothing.
    assert {"RMSNormFunction", "LayerNormFunction", "GatedMLPFunction", "GELUMLPFunction", "NormGatedMLPFunction",
            "NormGELUMLPFunction", "MoEFunction", "NormAttentionFunction", "AttentionFunction",
            "VarlenAttentionFunction", "LoRALinearFunction", "PhiloxDropoutFunction", "LinearCrossEntropyFunction",
            "_GemmaRMSNormFunction", "_PostNormLinearFunction", "_SandwichMLPFunction", "_ChainFunction"} <= names
    uncovered = sorted(f"{f.__module__}.{f.__qualname__}" for f in functions
                       if not getattr(f.backward, "double_backward_refused", None))
    assert not uncovered, f"backward not decorated with remat.autograd.common.refuse_double_backward: {uncovered}"


def test_refusal_under_torch_compile():
    """The decorated backward traces into one graph (fullgraph, AOT autograd); first-order
    gradients under create_graph=True match eager, and a second backward is refused by AOT
    autograd (no wrong number either way)."""
    torch._dynamo.reset()
    _, leaves = cases.rms_norm("torch", True).build(stock=False)
    x, w, r = leaves

    def fn(x, w, r):
        return remat.rms_norm(x, w, residual=r, backend="torch")

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    eager = torch.autograd.grad(objective(fn(x, w, r)), leaves)
    graphed = torch.autograd.grad(objective(compiled(x, w, r)), leaves, create_graph=True)
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(b.detach(), a)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(sum((g * g).sum() for g in graphed), leaves)
