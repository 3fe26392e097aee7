"""Checkpoint placement and execution: gradients bitwise equal to no checkpointing (fp32, CPU),
RNG and autocast preserved, measured peak saved bytes within the plan, forward-call counts equal
to the plan's (and to revolve's closed form), the DP equal to brute force on small chains."""

import math
import random

import pytest
import torch
from torch import nn

import remat
from remat.checkpoint import schedule as sched
from remat.checkpoint.planner import measure_costs, plan_for_costs
from remat.memory import PeakSavedBytes


class Block(nn.Module):
    """A small MLP block with dropout and a residual: saves several tensors, draws random numbers."""

    def __init__(self, width, hidden, p=0.1):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return x + self.dropout(self.down(torch.nn.functional.gelu(self.up(x))))


def make_chain(n, width=16, hidden=(32,), seed=0, p=0.1):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(width, hidden[i % len(hidden)], p) for i in range(n)])


def grads_of(fn, x, params, seed=123):
    torch.manual_seed(seed)
    out = fn(x)
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).square().sum()
    return [out.detach()] + list(torch.autograd.grad(loss, [x] + params))


STRATEGY_ARGS = [
    ("none", {}),
    ("uniform", {"segments": 3}),
    ("sqrt", {}),
    ("heuristic", {"budget_bytes": 40_000}),
    ("optimal", {}),
    ("optimal", {"budget_bytes": 30_000}),
    ("revolve", {"slots": 2}),
    ("revolve", {"slots": 0}),
]
STRATEGY_IDS = ["none", "uniform3", "sqrt", "heuristic", "optimal-default", "optimal-30k", "revolve2", "revolve0"]


@pytest.mark.parametrize("strategy,kwargs", STRATEGY_ARGS, ids=STRATEGY_IDS)
def test_gradients_bitwise_equal_to_no_checkpointing(strategy, kwargs):
    """With dropout in every block: the recomputed forwards replay the same masks."""
    chain = make_chain(9, hidden=(32, 48, 24))
    x = torch.randn(8, 16, requires_grad=True)
    params = list(chain.parameters())
    plan = remat.plan(chain, x, strategy=strategy, **kwargs)
    got = grads_of(lambda t: remat.checkpoint_sequential(chain, t, plan=plan), x, params)
    want = grads_of(chain, x, params)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("strategy,kwargs", STRATEGY_ARGS, ids=STRATEGY_IDS)
def test_autocast_bf16_cpu_bitwise_equal(strategy, kwargs):
    chain = make_chain(6)
    x = torch.randn(8, 16, requires_grad=True)
    params = list(chain.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = remat.plan(chain, x, strategy=strategy, **kwargs)
        got = grads_of(lambda t: remat.checkpoint_sequential(chain, t, plan=plan), x, params)
        want = grads_of(chain, x, params)
    assert not torch.equal(got[0], grads_of(chain, x, params)[0]), "autocast had no effect"
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("strategy,kwargs", STRATEGY_ARGS, ids=STRATEGY_IDS)
def test_measured_peak_within_plan_and_budget(strategy, kwargs):
    chain = make_chain(10, hidden=(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    plan = remat.plan(chain, x, strategy=strategy, **kwargs)
    with PeakSavedBytes() as tracker:
        out = remat.checkpoint_sequential(chain, x, plan=plan)
        out.sum().backward()
    assert tracker.current == 0, "saved tensors or checkpoints still held after backward"
    assert 0 < tracker.peak <= plan.peak_saved_bytes
    # From below too: every block's backward holds that block's saved tensors, so the measured peak is
    # at least the largest of them (a tracker that missed saved tensors would fall under it).
    assert tracker.peak >= max(plan.costs.saved)
    if plan.budget_bytes is not None:
        assert plan.peak_saved_bytes <= plan.budget_bytes


def test_checkpointing_lowers_measured_peak():
    chain = make_chain(16, hidden=(64,))
    x = torch.randn(32, 16, requires_grad=True)
    peaks = {}
    for strategy, kwargs in [("none", {}), ("sqrt", {}), ("revolve", {"slots": 1})]:
        plan = remat.plan(chain, x, strategy=strategy, **kwargs)
        with PeakSavedBytes() as tracker:
            remat.checkpoint_sequential(chain, x, plan=plan).sum().backward()
        peaks[strategy] = tracker.peak
    assert peaks["revolve"] < peaks["sqrt"] < peaks["none"]


@pytest.mark.parametrize("strategy,kwargs", STRATEGY_ARGS, ids=STRATEGY_IDS)
def test_block_forward_calls_equal_plan(strategy, kwargs):
    chain = make_chain(11)
    x = torch.randn(4, 16, requires_grad=True)
    plan = remat.plan(chain, x, strategy=strategy, **kwargs)
    calls = []
    hooks = [b.register_forward_hook(lambda m, i, o, k=k: calls.append(k)) for k, b in enumerate(chain)]
    try:
        remat.checkpoint_sequential(chain, x, plan=plan).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == plan.block_forward_calls
    assert sorted(set(calls)) == list(range(11))


def test_sqrt_on_100_equal_blocks():
    """About sqrt(L) checkpoints, and exactly one extra forward per block."""
    costs = sched.ChainCosts((1000,) * 100, (100,) * 100, (1.0,) * 100)
    plan = plan_for_costs(costs, strategy="sqrt")
    assert len(plan.checkpoints) == 9  # 10 segments: the inputs of segments 2..10 are stored
    assert plan.block_forward_calls == 200
    assert plan.extra_forward_fraction == 1.0
    assert plan.peak_saved_bytes == 9 * 100 + 10 * 1000


@pytest.mark.parametrize("slots", range(0, 7))
def test_revolve_matches_closed_form(slots):
    for length in range(1, 101):
        schedule, extra = sched.revolve_plan(length, slots)
        assert extra == sched.revolve_extra_forwards(length, slots + 1), (length, slots)
        assert sched.block_forward_calls(schedule) == length + extra


@pytest.mark.parametrize("length,slots", [(12, 1), (20, 2), (30, 3)])
def test_revolve_executed_calls_match_closed_form(length, slots):
    chain = make_chain(length, width=8, hidden=(8,), p=0.0)
    x = torch.randn(2, 8, requires_grad=True)
    plan = remat.plan(chain, x, strategy="revolve", slots=slots)
    calls = []
    hooks = [b.register_forward_hook(lambda *a: calls.append(1)) for b in chain]
    try:
        remat.checkpoint_sequential(chain, x, plan=plan).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == length + sched.revolve_extra_forwards(length, slots + 1)


def _all_schedules(a, b):
    yield sched.Segment(a, b)
    for k in range(a + 1, b):
        rights = list(_all_schedules(k, b))
        for left in _all_schedules(a, k):
            for right in rights:
                yield sched.Split(a, k, b, left, right, keep_left=False)
        for right in rights:
            yield sched.Split(a, k, b, sched.Segment(a, k), right, keep_left=True)


@pytest.mark.parametrize("length", range(1, 9))
def test_optimal_dp_equals_brute_force(length):
    rng = random.Random(length)
    for _ in range(3 if length < 8 else 1):
        costs = sched.ChainCosts(
            tuple(rng.randint(4, 40) for _ in range(length)),
            tuple(rng.randint(1, 10) for _ in range(length)),
            tuple(float(rng.randint(1, 9)) for _ in range(length)),
        )
        schedules = list(_all_schedules(0, length))
        floor = sched.minimal_peak(costs)
        assert floor == min(sched.peak_bytes(s, costs) for s in schedules)
        for budget in sorted({floor, floor + 7, (floor + sum(costs.saved)) // 2, sum(costs.saved)}):
            best = min(sched.forward_cost(s, costs) for s in schedules if sched.peak_bytes(s, costs) <= budget)
            chosen = sched.optimal_plan(costs, budget)
            assert sched.peak_bytes(chosen, costs) <= budget
            assert sched.forward_cost(chosen, costs) == best, (costs, budget)


def test_infeasible_budget_names_smallest_feasible():
    chain = make_chain(6)
    x = torch.randn(4, 16, requires_grad=True)
    smallest = sched.minimal_peak(measure_costs(chain, x))
    with pytest.raises(ValueError, match=f"smallest feasible budget is {smallest} bytes"):
        remat.plan(chain, x, strategy="optimal", budget_bytes=smallest - 1)
    plan = remat.plan(chain, x, strategy="optimal", budget_bytes=smallest)
    assert plan.peak_saved_bytes <= smallest
    with pytest.raises(ValueError, match=f"smallest feasible budget \\(strategy='optimal'\\) is {smallest}"):
        remat.plan(chain, x, strategy="sqrt", budget_bytes=smallest)


def test_uniform_matches_torch_checkpoint_sequential():
    chain = make_chain(8)
    x = torch.randn(4, 16, requires_grad=True)
    params = list(chain.parameters())
    got = grads_of(lambda t: remat.checkpoint_sequential(chain, t, strategy="uniform", segments=4), x, params)
    want = grads_of(lambda t: torch.utils.checkpoint.checkpoint_sequential(chain, 4, t, use_reentrant=False),
                    x, params)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_plan_explain_and_predictions():
    chain = make_chain(5)
    x = torch.randn(4, 16)
    plan = remat.plan(chain, x, strategy="uniform", segments=5)
    text = plan.explain()
    assert len(text.splitlines()) == 1 + 5 + 1
    assert "recomputed" in text and "strategy=uniform" in text
    assert plan.block_forward_calls == 10
    assert plan.checkpoints == [1, 2, 3, 4]
    assert plan.no_checkpoint_bytes == sum(plan.costs.saved)


def test_costs_are_measured():
    chain = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    costs = measure_costs(chain, x)
    assert costs.inputs == (8 * 16 * 4, 8 * 64 * 4, 8 * 64 * 4)
    assert costs.compute[0] == 2 * 8 * 16 * 64 and costs.compute[2] == 2 * 8 * 64 * 16
    assert costs.compute[1] == 8 * 64  # elementwise: one per output element
    assert costs.saved[0] == 8 * 16 * 4 and costs.saved[1] == 8 * 64 * 4


def test_plan_cache_and_no_grad():
    chain = make_chain(4, p=0.0)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(remat.checkpoint_sequential(chain, x), chain(x))
    y = remat.checkpoint_sequential(chain, x.requires_grad_())
    torch.testing.assert_close(y, chain(x))


def test_second_backward_raises():
    chain = make_chain(4)
    x = torch.randn(4, 16, requires_grad=True)
    y = remat.checkpoint_sequential(chain, x, strategy="sqrt")
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()


def test_bad_arguments():
    chain = make_chain(3)
    x = torch.randn(2, 16, requires_grad=True)
    with pytest.raises(ValueError, match="strategy must be one of"):
        remat.plan(chain, x, strategy="random")
    with pytest.raises(ValueError, match="needs segments"):
        remat.plan(chain, x, strategy="uniform")
    with pytest.raises(ValueError, match="segments must be between"):
        remat.plan(chain, x, strategy="uniform", segments=4)
    with pytest.raises(ValueError, match="needs slots"):
        remat.plan(chain, x, strategy="revolve")
    with pytest.raises(ValueError, match="needs budget_bytes"):
        remat.plan(chain, x, strategy="heuristic")
    with pytest.raises(ValueError, match="budget_bytes must be"):
        remat.plan(chain, x, strategy="optimal", budget_bytes=-1)
    with pytest.raises(TypeError, match="sample_input must be"):
        remat.plan(chain, [1.0])
    with pytest.raises(ValueError, match="blocks is empty"):
        remat.checkpoint_sequential([], x)
    plan = remat.plan(chain, x, strategy="sqrt")
    with pytest.raises(ValueError, match="plan is for 3 blocks"):
        remat.checkpoint_sequential(list(chain)[:2], x, plan=plan)


def test_region_checkpoint_matches_and_preserves_rng():
    block = Block(16, 32, p=0.3)
    x = torch.randn(6, 16, requires_grad=True)
    params = list(block.parameters())
    got = grads_of(lambda t: remat.checkpoint(block, t), x, params)
    want = grads_of(block, x, params)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_region_checkpoint_kwargs_nesting_and_no_grad_inputs():
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    scale = torch.randn(8)  # does not require grad

    def inner(t, *, s):
        return torch.tanh(lin(t)) * s

    def outer(t, *, s):
        return remat.checkpoint(inner, t, s=s).exp()

    got = torch.autograd.grad(remat.checkpoint(outer, x, s=scale).sum(), [x, lin.weight])
    want = torch.autograd.grad(outer(x, s=scale).sum(), [x, lin.weight])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    with PeakSavedBytes() as tracker:
        y = remat.checkpoint(inner, x, s=scale)
    assert tracker.peak < 3 * 8 * 4 * 2  # the region keeps no intermediates of its own
    del y
    with pytest.raises(TypeError, match="fn must be callable"):
        remat.checkpoint(3, x)


def test_region_checkpoint_autocast():
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = remat.checkpoint(lin, x)
        y_ref = lin(x)
    assert y.dtype == torch.bfloat16
    got = torch.autograd.grad(y.float().sum(), [x, lin.weight])
    want = torch.autograd.grad(y_ref.float().sum(), [x, lin.weight])
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_works_with_remat_norm_blocks():
    """The planner sees the fused blocks' small saved sets."""
    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Sequential(remat.nn.RMSNorm(16), nn.Linear(16, 16)) for _ in range(6)])
    x = torch.randn(8, 16, requires_grad=True)
    plan = remat.plan(chain, x, strategy="optimal", budget_bytes=2000)
    assert plan.peak_saved_bytes <= 2000
    params = list(chain.parameters())
    got = grads_of(lambda t: remat.checkpoint_sequential(chain, t, plan=plan), x, params)
    want = grads_of(chain, x, params)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert math.isfinite(plan.extra_forward_fraction)
    assert plan.peak_saved_bytes < plan.no_checkpoint_bytes, "the budget should force checkpoints"


def test_in_place_change_of_input_raises():
    chain = make_chain(4, p=0.0)
    x = torch.randn(4, 16, requires_grad=True)
    base = x * 1
    y = remat.checkpoint_sequential(chain, base, strategy="sqrt")
    with torch.no_grad():
        base.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_callable_capturing_grad_tensor_is_refused():
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(TypeError, match=r"blocks\[1\] is a callable that captures a tensor"):
        remat.checkpoint_sequential([nn.Linear(16, 16), lambda t: t @ w], x, strategy="sqrt")
    y = remat.checkpoint_sequential([nn.Linear(16, 16), torch.tanh], x, strategy="sqrt")
    assert y.requires_grad


def test_plan_cache_follows_blocks_and_autocast():
    chain = make_chain(3, p=0.0)
    x = torch.randn(4, 16, requires_grad=True)
    remat.checkpoint_sequential(chain, x, strategy="optimal")
    from remat.checkpoint import _plan_cache

    entries = _plan_cache[chain[0]]
    assert len(entries) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        remat.checkpoint_sequential(chain, x, strategy="optimal")
    assert len(entries) == 2


def test_optimal_fits_the_smallest_feasible_budget_after_rounding():
    """Sizes far above the DP's memory resolution: the tightest feasible budget still plans."""
    costs = sched.ChainCosts((402_328, 821_723), (898_577, 860_342), (1.0, 1.0))
    floor = sched.minimal_peak(costs)
    assert sched.peak_bytes(sched.optimal_plan(costs, floor), costs) <= floor
    plan = plan_for_costs(costs, strategy="optimal")
    assert plan.peak_saved_bytes <= plan.budget_bytes


def test_time_costs_plan_like_flops():
    """cost="time" measures each block's forward in seconds: the same saved and input bytes as the
    FLOP measurement, a positive time per block, and a plan that keeps its budget and gradients."""
    chain = make_chain(6, hidden=(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    by_flops = measure_costs(chain, x)
    by_time = measure_costs(chain, x, cost="time")
    assert by_time.saved == by_flops.saved and by_time.inputs == by_flops.inputs
    assert len(by_time.compute) == len(chain) and all(isinstance(t, float) and t > 0 for t in by_time.compute)
    budget = (sched.minimal_peak(by_time) + sum(by_time.saved)) // 2
    plan = remat.plan(chain, x, strategy="optimal", budget_bytes=budget, cost="time")
    assert plan.peak_saved_bytes <= budget
    params = list(chain.parameters())
    got = grads_of(lambda t: remat.checkpoint_sequential(chain, t, plan=plan), x, params)
    for g, w in zip(got, grads_of(chain, x, params)):
        assert torch.equal(g, w)
    with pytest.raises(ValueError, match="cost must be"):
        measure_costs(chain, x, cost="seconds")
