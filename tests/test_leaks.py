"""Measuring and planning leave nothing alive (issue 31, finding 4), and the planner measures the
training step with Hugging Face's default ``use_cache=True``.

- remat.memory's measurements (``saved_bytes``, ``retained_bytes``, ``SavedTensorLog``,
  ``PeakSavedBytes``, ``RetainedTensorLog``) around a forward that no backward consumes: once the
  caller drops the output, plain reference counting frees every intermediate, and the number of
  live tensors is back at its baseline. (Their pack hooks handed autograd the saved tensor itself:
  a saved output with its ``grad_fn`` made a cycle through autograd's C++ graph that gc cannot
  collect, so every measured forward's graph stayed alive for good.)
- ``plan_model`` and ``patch(policy="auto")`` on a tiny Llama whose config keeps ``use_cache=True``:
  the costs equal those of the same model with ``use_cache=False`` (training forwards build no
  cache), ``cost="time"`` works (it raised "Trying to backward through the graph a second time":
  each timed layer re-ran with the measured forward's KV cache; ``cost="flops"`` times nothing and
  worked before), and the patched step trains. An example holding a cache is refused.
- 16 cycles of patch(policy="auto") / one training step / unpatch / plan_model hold the number of
  live tensors and the resident memory flat. (Each cycle left the graphs of the planner's measured
  forwards alive: the region log's pack hook held the layer inputs, whose ``grad_fn`` reached the
  graph that held the hook: here 654 tensors and about 14 MB of resident memory a cycle.)
"""

import gc
import os
import weakref

import pytest
import torch

import remat
from remat.memory import PeakSavedBytes, RetainedTensorLog, SavedTensorLog, retained_bytes, saved_bytes
from remat.planning import model_plan

from helpers import batch, causal_lm

transformers = pytest.importorskip("transformers")

# The planner's fused layers run on the torch backend: these tests are about what stays alive,
# and the Triton interpreter would make the loop ten times slower.
BACKEND = "torch"


@pytest.fixture(autouse=True)
def one_thread():
    """Runs each test on one CPU thread: the tensors are tiny, and on a loaded two-core machine a
    second thread only contends (seen: 0.9 s a patch/step/plan cycle on one thread, 5-9 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def live_tensors():
    """The number of tensors Python holds, after collections until the count settles: garbage an
    earlier test left behind (torch.compile's shape environments and fake tensors, freed through
    finalizers over several collections) would otherwise still be dying during the measurement."""
    count = None
    for _ in range(20):
        gc.collect()
        previous, count = count, sum(1 for o in gc.get_objects() if torch.is_tensor(o))
        if count == previous:
            break
    return count


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sigmoid_chain(x, refs, steps=50):
    """sigmoid(2 x) ``steps`` times (each sigmoid saves its output), with a weak reference to every
    intermediate in ``refs``."""
    for _ in range(steps):
        x = torch.sigmoid(2 * x)
        refs.append(weakref.ref(x))
    return x


def _saved_bytes(fn):
    assert saved_bytes(fn) > 0


def _retained_bytes(fn):
    assert retained_bytes(fn) > 0  # the output keeps the graph while it is measured


def _saved_tensor_log(fn):
    with SavedTensorLog() as log:
        out = fn()
    assert log.total_bytes > 0
    del out


def _retained_tensor_log(fn):
    with RetainedTensorLog() as log:
        out = fn()
    assert log.retained_bytes(out) > 0
    del out


MEASURES = {"saved_bytes": _saved_bytes, "retained_bytes": _retained_bytes, "SavedTensorLog": _saved_tensor_log,
            "RetainedTensorLog": _retained_tensor_log}


@pytest.mark.parametrize("measure", list(MEASURES))
def test_measuring_a_forward_without_backward_keeps_nothing(measure):
    x = torch.randn(64, 64, requires_grad=True)
    MEASURES[measure](lambda: sigmoid_chain(x, []))  # warm-up: whatever a first call creates once
    baseline = live_tensors()
    refs = []
    gc.disable()  # reference counting alone must free the graph
    try:
        MEASURES[measure](lambda: sigmoid_chain(x, refs))
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert alive == 0, f"{alive} of {len(refs)} intermediates are still alive after {measure} returned"
    assert live_tensors() == baseline


def test_peak_saved_bytes_releases_a_forward_without_backward():
    x = torch.randn(64, 64, requires_grad=True)
    refs = []
    baseline = live_tensors()
    gc.disable()
    try:
        with PeakSavedBytes() as peak:
            out = sigmoid_chain(x, refs)
        assert peak.current == peak.peak > 0
        del out
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert alive == 0, f"{alive} of {len(refs)} intermediates are still alive after the output was dropped"
    assert peak.current == 0  # autograd dropped every saved tensor, and the tracker saw it
    assert live_tensors() == baseline


def example(rows=2, length=11):
    """A right-padded training batch of the tiny models' vocabulary (helpers.batch at 2 x 11)."""
    if (rows, length) == (2, 11):
        ids, mask, labels = batch()
    else:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 96, (rows, length), generator=g)
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[1, length - 3:] = 0
        labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def llama_with_cache():
    """The tiny Llama of helpers.causal_lm with Hugging Face's default ``use_cache=True``."""
    model = causal_lm("llama", use_cache=True)
    assert model.config.use_cache
    return model


def stock_peak(costs):
    """The predicted peak of saved bytes with every layer stock."""
    return model_plan.peak_and_cost(costs, [model_plan.Taped(i, "stock") for i in range(len(costs.layers))])[0]


@pytest.mark.parametrize("cost", ["flops", "time"])
def test_plan_with_use_cache_measures_the_training_step(cost):
    inputs = example()
    without_cache = model_plan.measure_model_costs(causal_lm("llama"), inputs, backend=BACKEND)
    budget = (stock_peak(without_cache) + model_plan.smallest_feasible_budget(without_cache)) // 2

    plan = remat.plan_model(llama_with_cache(), inputs, budget_bytes=budget, cost=cost, backend=BACKEND)
    assert [layer.kept for layer in plan.costs.layers] == [layer.kept for layer in without_cache.layers]
    post = without_cache.post_bytes if plan.loss is None else \
        next(choice.post_bytes for choice in without_cache.loss_choices if choice.name == plan.loss)
    assert (plan.costs.pre_bytes, plan.costs.shared_bytes, plan.costs.post_bytes) == \
        (without_cache.pre_bytes, without_cache.shared_bytes, post)
    assert set(plan.layer_policies().values()) != {"stock"}

    stock = causal_lm("llama")
    stock_loss = stock(**inputs).loss
    stock_loss.backward()
    model = llama_with_cache()
    report = remat.patch(model, policy="auto", budget_bytes=budget, example_inputs=inputs, cost=cost,
                         backend=BACKEND)
    assert report.plan.predicted_peak_bytes <= budget
    with PeakSavedBytes() as peak:
        loss = model(**inputs).loss
        loss.backward()
    assert peak.peak <= budget
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("key", ["past_key_values", "use_cache"])
def test_example_with_a_kv_cache_is_refused(key):
    inputs = example()
    inputs[key] = transformers.DynamicCache() if key == "past_key_values" else True
    with pytest.raises(ValueError, match="KV cache or use_cache=True"):
        remat.plan_model(llama_with_cache(), inputs, budget_bytes=10**9, backend=BACKEND)


CYCLES, WARM_UP = 16, 4


def test_auto_patch_cycles_hold_tensors_and_memory_flat():
    inputs = example(rows=4, length=32)
    model = llama_with_cache()
    costs = model_plan.measure_model_costs(model, inputs, backend=BACKEND)
    budget = model_plan.smallest_feasible_budget(costs)  # spans: the chain executor runs too
    leak = 2 * stock_peak(costs) * (CYCLES - WARM_UP)
    del costs
    counts, resident = [], []
    for _ in range(CYCLES):
        report = remat.patch(model, policy="auto", budget_bytes=budget, example_inputs=inputs, backend=BACKEND)
        assert report.plan.spans()
        model(**inputs).loss.backward()
        model.zero_grad(set_to_none=True)
        remat.unpatch(model)
        plan = remat.plan_model(model, inputs, budget_bytes=budget, backend=BACKEND)
        del report, plan
        counts.append(live_tensors())
        resident.append(resident_bytes())
    steady = counts[WARM_UP:]
    assert max(steady) - min(steady) <= 4, f"live tensors per cycle: {counts}"
    # leak: each leaking cycle kept the graphs of at least its two all-stock measured forwards
    # (patch's plan and plan_model's), each holding the stock step's saved bytes; the bound is
    # half of that. Measured before the fix: 166 MB over these cycles, bound 18 MB; after: < 1 MB.
    growth = resident[-1] - resident[WARM_UP - 1]
    assert growth < leak / 2, f"resident memory grew {growth} bytes over {CYCLES - WARM_UP} cycles (leak: {leak})"
