"""Checkpoint schedules for a chain of blocks, their simulated cost and memory, and the planners
that choose them (uniform, sqrt, greedy heuristic, optimal DP, binomial revolve).

The schedule family. Reversing (running backward through) blocks [a, b) of a chain, given their
input x_a, is one of:

- ``Segment(a, b, recompute)``: tape blocks a..b-1 (run them with autograd recording) and
  backpropagate through them. On the forward spine (see below) ``recompute=False`` tapes them
  during the forward itself and keeps the graph; ``recompute=True`` runs them without a graph in
  the forward and tapes them again in the backward (one extra forward of the segment).
- ``Split(a, k, b, left, right, keep_left)``: produce x_k from x_a, reverse [k, b) (``right``),
  then reverse [a, k) (``left``). With ``keep_left=False`` the left part is advanced without a
  graph and x_k is held as a checkpoint while the right part is reversed; the left part is
  re-run later when it is reversed. With ``keep_left=True`` the left part is taped once, its graph
  kept until it is reversed (no recompute, its saved tensors held meanwhile).

The forward pass runs the rightmost path of the tree (the spine): every Split advances or tapes
its left part and continues right, storing x_k; the last Segment produces the output. This is
single-level checkpointing when every left child is a Segment, and Griewank's revolve (recursive
binomial checkpointing) or Beaumont et al.'s rotor when the tree nests.

Costs are per block: ``saved`` (bytes the block keeps for backward when taped), ``inputs``
(bytes of its input, what a checkpoint before it holds) and ``compute`` (forward cost, e.g.
FLOPs). The memory model (``peak_bytes``) counts, at every moment, the checkpoints held and the
saved tensors of taped blocks alive; a checkpoint whose tensor a taped block also saves is
counted twice, so the model is an upper bound of what hooks measure.
"""

import functools
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    recompute: bool = False


@dataclass(frozen=True)
class Split:
    start: int
    mid: int
    end: int
    left: "Node"
    right: "Node"
    keep_left: bool = False


Node = Segment | Split


@dataclass(frozen=True)
class ChainCosts:
    """Per-block costs of a chain: lists of equal length L."""

    saved: tuple
    inputs: tuple
    compute: tuple

    def __post_init__(self):
        if not (len(self.saved) == len(self.inputs) == len(self.compute)):
            raise ValueError("saved, inputs and compute must have one entry per block")

    @property
    def length(self):
        return len(self.saved)

    def saved_sum(self, a, b):
        return sum(self.saved[a:b])

    def compute_sum(self, a, b):
        return sum(self.compute[a:b])


def peak_bytes(node, costs):
    """Peak bytes held while reversing ``node`` (checkpoints + saved tensors of taped blocks),
    beyond the node's own input. The forward spine's peak is included (it is never larger)."""
    if isinstance(node, Segment):
        return costs.saved_sum(node.start, node.end)
    if node.keep_left:
        return costs.saved_sum(node.start, node.mid) + peak_bytes(node.right, costs)
    return max(costs.inputs[node.mid] + peak_bytes(node.right, costs), peak_bytes(node.left, costs))


def forward_cost(node, costs, on_spine=True):
    """Forward compute of the forward pass plus all recomputation when reversing ``node`` (the
    no-checkpoint baseline is ``costs.compute_sum(0, L)``). Off the spine, every block of a node
    runs again: its left parts are advanced (or taped and kept) and its segments taped."""
    if isinstance(node, Segment):
        runs = 2 if (on_spine and node.recompute) else 1
        return runs * costs.compute_sum(node.start, node.end)
    advance = costs.compute_sum(node.start, node.mid)
    right = forward_cost(node.right, costs, on_spine)
    if node.keep_left:
        return advance + right
    return advance + right + forward_cost(node.left, costs, on_spine=False)


def block_forward_calls(node):
    """Number of block forward calls (forward pass and recompute) to reverse ``node``."""
    ones = (1,) * node.end
    return forward_cost(node, ChainCosts(ones, ones, ones))


def checkpoints_on_spine(node):
    """The block indices whose inputs the forward pass stores as checkpoints."""
    out = []
    while isinstance(node, Split):
        if not node.keep_left:
            out.append(node.mid)
        node = node.right
    return out


def recomputed_blocks(node, on_spine=True):
    """Sorted indices of blocks that run more than once."""
    out = set()
    if isinstance(node, Segment):
        if node.recompute or not on_spine:
            out.update(range(node.start, node.end))
        return out
    if not node.keep_left:
        out.update(recomputed_blocks(node.left, on_spine=False))
        out.update(range(node.start, node.mid))
    elif not on_spine:
        out.update(range(node.start, node.mid))
    out.update(recomputed_blocks(node.right, on_spine))
    return out


def segments_plan(boundaries, recompute, length):
    """Single-level plan: segments [boundaries[i], boundaries[i+1]); ``recompute[i]`` says whether
    segment i is checkpointed (its input stored, re-run in backward) or kept (taped in forward)."""
    starts = list(boundaries)
    ends = starts[1:] + [length]
    node = Segment(starts[-1], ends[-1], recompute=recompute[-1])
    for i in range(len(starts) - 2, -1, -1):
        left = Segment(starts[i], ends[i], recompute=recompute[i])
        node = Split(starts[i], ends[i], length, left, node, keep_left=not recompute[i])
    return node


def no_checkpoint_plan(length):
    return Segment(0, length, recompute=False)


def uniform_plan(length, segments):
    """``segments`` checkpointed segments of (nearly) equal length, the last one included."""
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if not 1 <= segments <= length:
        raise ValueError(f"segments must be between 1 and the number of blocks ({length}), got {segments}")
    boundaries = [round(i * length / segments) for i in range(segments)]
    return segments_plan(boundaries, [True] * segments, length)


def sqrt_plan(length):
    """About sqrt(L) evenly spaced checkpoints (Chen et al. 2016)."""
    return uniform_plan(length, max(1, round(math.sqrt(length))))


def minimal_peak_plan(costs):
    """A schedule of the family with the smallest peak, and that peak (the least feasible budget).

    P(a, b) = min(saved(a, b), min_k max(inputs[k] + P(k, b), P(a, k)), min_k saved(a, k) + P(k, b)).
    """
    n = costs.length

    @functools.cache
    def best(a, b):
        options = [(costs.saved_sum(a, b), ("tape",))]
        for k in range(a + 1, b):
            options.append((max(costs.inputs[k] + best(k, b)[0], best(a, k)[0]), ("checkpoint", k)))
            options.append((costs.saved_sum(a, k) + best(k, b)[0], ("keep", k)))
        return min(options, key=lambda option: option[0])

    def build(a, b):
        how = best(a, b)[1]
        if how[0] == "tape":
            return Segment(a, b)
        k = how[1]
        if how[0] == "checkpoint":
            return Split(a, k, b, build(a, k), build(k, b), keep_left=False)
        return Split(a, k, b, Segment(a, k), build(k, b), keep_left=True)

    return build(0, n), best(0, n)[0]


def minimal_peak(costs):
    """The smallest peak (bytes) any schedule of the family reaches: the least feasible budget."""
    return minimal_peak_plan(costs)[1]


def optimal_plan(costs, budget_bytes, max_units=512):
    """The schedule with the least forward compute whose peak is at most ``budget_bytes``; see
    :func:`_optimal_plan_units`. Sizes are rounded up to memory units, which can make a budget
    that is only just feasible look infeasible: the DP is then repeated with 8x finer units, and
    if the budget is still too tight for the rounding, the least-memory schedule is returned (it
    fits any feasible budget, at more recompute).

    Raises ValueError naming the smallest feasible budget when none fits.
    """
    floor_plan, floor = minimal_peak_plan(costs)
    if budget_bytes < floor:
        raise ValueError(
            f"no checkpoint schedule fits budget_bytes={budget_bytes}; the smallest feasible budget "
            f"is {floor} bytes"
        )
    for units in (max_units, 8 * max_units):
        node = _optimal_plan_units(costs, budget_bytes, units)
        if node is not None:
            return node
    return floor_plan


def _optimal_plan_units(costs, budget_bytes, max_units):
    """The schedule with the least forward compute whose peak is at most ``budget_bytes``.

    Dynamic programming over (start, end, memory): C(a, b, m) is the least compute to reverse
    [a, b) within m bytes, the minimum over: tape all of [a, b); or split at k, advance [a, k),
    hold x_k and reverse [k, b) within m - inputs[k], then [a, k) within m; or split at k, tape and
    keep [a, k) and reverse [k, b) within m - saved(a, k). Memory is counted in units of
    ceil(budget / max_units) bytes, every size rounded up, so the plan never exceeds the budget
    (and the DP is exact when the budget is at most max_units bytes). Returns None when nothing
    fits at this resolution.
    """
    n = costs.length
    unit = max(1, math.ceil(budget_bytes / max_units))
    m_max = budget_bytes // unit
    inf = float("inf")
    saved_u = [math.ceil(s / unit) for s in costs.saved]
    inputs_u = [math.ceil(s / unit) for s in costs.inputs]
    prefix_saved = np.concatenate([[0], np.cumsum(saved_u)])
    prefix_compute = np.concatenate([[0.0], np.cumsum(np.asarray(costs.compute, dtype=np.float64))])
    mem = np.arange(m_max + 1)
    best = {}
    choice = {}
    for length in range(1, n + 1):
        for a in range(0, n - length + 1):
            b = a + length
            tape_all = prefix_saved[b] - prefix_saved[a]
            cost = np.where(mem >= tape_all, prefix_compute[b] - prefix_compute[a], inf)
            how = np.full(m_max + 1, -1, dtype=np.int64)  # -1: tape all; k: checkpoint at k; -k-2: keep left to k
            for k in range(a + 1, b):
                advance = prefix_compute[k] - prefix_compute[a]
                right = best[(k, b)]
                shifted = np.full(m_max + 1, inf)
                if inputs_u[k] <= m_max:
                    shifted[inputs_u[k]:] = right[: m_max + 1 - inputs_u[k]]
                candidate = advance + shifted + best[(a, k)]
                better = candidate < cost
                cost = np.where(better, candidate, cost)
                how = np.where(better, k, how)
                kept = prefix_saved[k] - prefix_saved[a]
                shifted = np.full(m_max + 1, inf)
                if kept <= m_max:
                    shifted[kept:] = right[: m_max + 1 - kept]
                candidate = advance + shifted
                better = candidate < cost
                cost = np.where(better, candidate, cost)
                how = np.where(better, -k - 2, how)
            best[(a, b)] = cost
            choice[(a, b)] = how
    if not np.isfinite(best[(0, n)][m_max]):
        return None

    def build(a, b, m, on_spine):
        how = int(choice[(a, b)][m])
        if how == -1:
            return Segment(a, b, recompute=False)
        if how >= 0:
            k = how
            right = build(k, b, m - inputs_u[k], on_spine)
            left = build(a, k, m, on_spine=False)
            return Split(a, k, b, left, right, keep_left=False)
        k = -how - 2
        kept = int(prefix_saved[k] - prefix_saved[a])
        right = build(k, b, m - kept, on_spine)
        return Split(a, k, b, Segment(a, k), right, keep_left=True)

    return build(0, n, m_max, True)


def revolve_extra_forwards(steps, checkpoints):
    """Griewank and Walther's closed form: the least number of forward steps, beyond the one
    taping run of each step, to reverse ``steps`` steps with ``checkpoints`` checkpoints (the one
    that holds the initial state included): t = r*l - C(s+r, s+1), with r the unique integer such
    that C(s+r-1, s) < l <= C(s+r, s)."""
    if steps < 1 or checkpoints < 1:
        raise ValueError("steps and checkpoints must be >= 1")
    r = 0
    while math.comb(checkpoints + r, checkpoints) < steps:
        r += 1
    return r * steps - math.comb(checkpoints + r, checkpoints + 1)


def revolve_plan(length, slots):
    """The binomial schedule (revolve) for a chain of ``length`` equal blocks that holds at most
    ``slots`` checkpoints besides the chain's input, minimising block forward calls.

    Returns (plan, extra): ``extra`` forward calls beyond one per block, which equals
    ``revolve_extra_forwards(length, slots + 1)`` (Griewank's count includes the input's slot)."""
    if isinstance(slots, bool) or not isinstance(slots, int):
        raise TypeError(f"slots must be an int, got {type(slots).__name__}")
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")

    @functools.cache
    def extra(steps, s):
        # Least extra forward calls and best split to reverse `steps` steps with s slots.
        if steps == 1:
            return 0, None
        if s == 0:
            return steps * (steps - 1) // 2, steps - 1
        best = None
        for m in range(1, steps):
            cost = m + extra(steps - m, s - 1)[0] + extra(m, s)[0]
            if best is None or cost < best[0]:
                best = (cost, m)
        return best

    def build(a, b, s):
        if b - a == 1:
            return Segment(a, b, recompute=False)
        _, m = extra(b - a, s)
        k = a + m
        if s == 0:
            # No slot: x_k is recomputed from x_a whenever it is needed; the advanced state is the
            # taped block's input, held only while that block is taped.
            return Split(a, k, b, build(a, k, 0), Segment(k, b), keep_left=False)
        return Split(a, k, b, build(a, k, s), build(k, b, s - 1), keep_left=False)

    return build(0, length, slots), extra(length, slots)[0]
