"""Checkpoint placement for a chain of blocks: measured per-block costs, the strategies, and the
Plan they produce."""

import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from remat.checkpoint import schedule as sched
from remat.memory import SavedTensorLog

STRATEGIES = ("none", "uniform", "sqrt", "heuristic", "optimal", "revolve")


def measure_costs(blocks, sample_input, *, cost="flops"):
    """Per-block costs measured once on ``sample_input`` (the RNG state is left untouched).

    - saved: bytes the block saves for backward (saved-tensor hooks, parameters excluded);
    - inputs: bytes of the block's input (what a checkpoint before it holds);
    - compute: ``cost="flops"``: FLOPs counted by torch.utils.flop_counter.FlopCounterMode, at
      least the output's element count (so elementwise blocks, which it does not count, are not
      free); ``cost="time"``: median forward seconds over 3 runs.

    Returns a schedule.ChainCosts.
    """
    if cost not in ("flops", "time"):
        raise ValueError(f"cost must be 'flops' or 'time', got {cost!r}")
    saved, inputs, compute = [], [], []
    x = sample_input
    devices = [x.device.index or 0] if x.is_cuda else []
    with torch.random.fork_rng(devices=devices):
        for block in blocks:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"each block must take and return one tensor; got {type(x).__name__}")
            x_in = x.detach()
            if x_in.is_floating_point():
                x_in.requires_grad_(True)
            inputs.append(x_in.numel() * x_in.element_size())
            with torch.enable_grad(), SavedTensorLog() as log, FlopCounterMode(display=False) as flops:
                out = block(x_in)
            saved.append(log.total_bytes)
            if cost == "flops":
                compute.append(max(flops.get_total_flops(), out.numel()))
            else:
                compute.append(_median_seconds(block, x_in))
            x = out.detach()
    return sched.ChainCosts(tuple(saved), tuple(inputs), tuple(compute))


def _median_seconds(block, x):
    times = []
    with torch.no_grad():
        for _ in range(3):
            if x.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            block(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class Plan:
    """A checkpoint schedule for a chain, with its predictions.

    Attributes:
        strategy: the strategy that chose it.
        schedule: the schedule tree (schedule.Segment / schedule.Split).
        costs: the measured schedule.ChainCosts.
        budget_bytes: the budget it was planned for, or None.
        peak_saved_bytes: predicted peak of saved bytes alive (checkpoints plus saved tensors of
            taped blocks) over forward and backward, the input excluded.
        extra_forward_fraction: recompute cost over one plain forward of the chain.
        block_forward_calls: forward calls of all blocks together, forward pass included.
        checkpoints: block indices whose inputs the forward pass stores.
    """

    strategy: str
    schedule: object
    costs: sched.ChainCosts
    budget_bytes: int = None

    @property
    def num_blocks(self):
        return self.costs.length

    @property
    def peak_saved_bytes(self):
        return sched.peak_bytes(self.schedule, self.costs)

    @property
    def no_checkpoint_bytes(self):
        return sum(self.costs.saved)

    @property
    def extra_forward_fraction(self):
        base = self.costs.compute_sum(0, self.num_blocks)
        return (sched.forward_cost(self.schedule, self.costs) - base) / base if base else 0.0

    @property
    def block_forward_calls(self):
        return sched.block_forward_calls(self.schedule)

    @property
    def checkpoints(self):
        return sched.checkpoints_on_spine(self.schedule)

    def explain(self):
        """A table: per block its saved bytes, input bytes, compute, and whether its saved tensors
        are kept from the forward or recomputed; then the totals."""
        recomputed = sched.recomputed_blocks(self.schedule)
        checkpoints = set(self.checkpoints)
        lines = [f"{'block':>5}  {'saved bytes':>12}  {'input bytes':>12}  {'compute':>12}  decision"]
        for i in range(self.num_blocks):
            decision = "recomputed" if i in recomputed else "kept"
            if i in checkpoints:
                decision += ", input checkpointed"
            lines.append(f"{i:>5}  {self.costs.saved[i]:>12}  {self.costs.inputs[i]:>12}  "
                         f"{self.costs.compute[i]:>12.4g}  {decision}")
        lines.append(
            f"strategy={self.strategy}  peak saved bytes={self.peak_saved_bytes} "
            f"(no checkpointing: {self.no_checkpoint_bytes})  budget={self.budget_bytes}  "
            f"extra forward={100 * self.extra_forward_fraction:.1f}%  block forward calls={self.block_forward_calls}"
        )
        return "\n".join(lines)

    def __str__(self):
        return self.explain()


def plan_for_costs(costs, *, strategy="optimal", budget_bytes=None, segments=None, slots=None):
    """Chooses a schedule for measured ``costs`` (a schedule.ChainCosts); see :func:`plan`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if budget_bytes is not None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise TypeError(f"budget_bytes must be an int or None, got {type(budget_bytes).__name__}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be non-negative, got {budget_bytes}")
    n = costs.length
    if n == 0:
        raise ValueError("the chain has no blocks")
    if strategy == "none":
        node = sched.no_checkpoint_plan(n)
    elif strategy == "uniform":
        if segments is None:
            raise ValueError("strategy='uniform' needs segments=")
        node = sched.uniform_plan(n, segments)
    elif strategy == "sqrt":
        node = sched.sqrt_plan(n)
    elif strategy == "revolve":
        if slots is None:
            raise ValueError("strategy='revolve' needs slots= (checkpoints held besides the input)")
        node, _ = sched.revolve_plan(n, slots)
    elif strategy == "heuristic":
        if budget_bytes is None:
            raise ValueError("strategy='heuristic' needs budget_bytes=")
        node = _greedy_plan(costs, budget_bytes)
    else:
        if budget_bytes is None:
            budget_bytes = sched.peak_bytes(sched.sqrt_plan(n), costs)
        node = sched.optimal_plan(costs, budget_bytes)
    result = Plan(strategy, node, costs, budget_bytes)
    if budget_bytes is not None and result.peak_saved_bytes > budget_bytes:
        raise ValueError(
            f"strategy={strategy!r} needs {result.peak_saved_bytes} bytes, over budget_bytes={budget_bytes}; "
            f"the smallest feasible budget (strategy='optimal') is {sched.minimal_peak(costs)} bytes"
        )
    return result


def _greedy_plan(costs, budget_bytes):
    """Single-level greedy: checkpoint blocks one at a time (each its own segment: its input is
    stored, it is re-run in backward) in order of saved bytes freed per unit of compute,
    (saved - input) / compute, until the predicted peak fits the budget."""
    n = costs.length
    marked = [False] * n
    order = sorted(range(n), key=lambda i: -(costs.saved[i] - costs.inputs[i]) / max(costs.compute[i], 1e-30))

    def build():
        boundaries, recompute = [0], [marked[0]]
        for i in range(1, n):
            if marked[i] or marked[i - 1]:
                boundaries.append(i)
                recompute.append(marked[i])
        return sched.segments_plan(boundaries, recompute, n)

    node = build()
    for i in order:
        if sched.peak_bytes(node, costs) <= budget_bytes:
            break
        if costs.saved[i] <= costs.inputs[i]:
            break
        marked[i] = True
        node = build()
    return node


def plan(blocks, sample_input, *, strategy="optimal", budget_bytes=None, segments=None, slots=None,
         cost="flops"):
    """Plans checkpoints for the chain ``blocks`` (callables taking and returning one tensor).

    Args:
        blocks: ``nn.Sequential``, a list of modules, or callables.
        sample_input: an input like the ones to be trained on; costs are measured on it once.
        strategy: ``"none"`` (store everything), ``"uniform"`` (``segments`` checkpointed
            segments, the last included), ``"sqrt"`` (about sqrt(L) segments), ``"heuristic"``
            (greedy under ``budget_bytes``), ``"optimal"`` (least recompute under
            ``budget_bytes``; default budget: what ``"sqrt"`` needs) or ``"revolve"`` (binomial
            schedule with ``slots`` checkpoints, for chains of equal blocks).
        budget_bytes: cap on the predicted peak of saved bytes (the input excluded).
        cost: ``"flops"`` or ``"time"`` (see :func:`measure_costs`).

    Returns:
        Plan. Raises ValueError naming the smallest feasible budget when the budget cannot be met.
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks is empty")
    if not isinstance(sample_input, torch.Tensor):
        raise TypeError(f"sample_input must be a torch.Tensor, got {type(sample_input).__name__}")
    costs = measure_costs(blocks, sample_input, cost=cost)
    return plan_for_costs(costs, strategy=strategy, budget_bytes=budget_bytes, segments=segments, slots=slots)
