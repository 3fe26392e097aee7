"""Checkpoint placement over chains of blocks, and region checkpointing.

- :func:`checkpoint`: one region, recomputed in backward.
- :func:`plan`: measures a chain's per-block costs once and chooses where to checkpoint.
- :func:`checkpoint_sequential`: runs a chain under a plan (or a strategy).
"""

import weakref

import torch

from remat.checkpoint.executor import run_chain
from remat.checkpoint.planner import STRATEGIES, Plan, plan, plan_for_costs
from remat.checkpoint.region import checkpoint

__all__ = ["STRATEGIES", "Plan", "checkpoint", "checkpoint_sequential", "plan", "plan_for_costs"]

# Plans made by checkpoint_sequential, per first block, keyed by the input's shape and the options.
_plan_cache = weakref.WeakKeyDictionary()


def checkpoint_sequential(blocks, x, *, strategy="optimal", budget_bytes=None, segments=None, slots=None,
                          plan=None, preserve_rng_state=True):
    """Runs the chain ``blocks`` on ``x`` with checkpoints, as planned by :func:`remat.plan`.

    Args:
        blocks: ``nn.Sequential``, a list of modules, or callables; each takes and returns one tensor.
        x: the chain's input.
        strategy, budget_bytes, segments, slots: as in :func:`remat.plan`. The plan is made on the
            first call for an input shape and reused (it is cached per first block).
        plan: a :class:`Plan` from :func:`remat.plan` to use instead.
        preserve_rng_state: restore each block's RNG state when it is re-run (default True).

    ``"uniform"`` checkpoints every segment, the last one included: its activations are not kept
    while the rest of the model runs forward, and it is re-run in backward. PyTorch's
    ``torch.utils.checkpoint.checkpoint_sequential`` runs the last segment without checkpointing.

    Without grad mode (``torch.no_grad()``, inference) the blocks simply run in order.

    Returns:
        the chain's output. Gradients reach ``x`` and the blocks' parameters.
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks is empty")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    params_need_grad = any(p.requires_grad for b in blocks if isinstance(b, torch.nn.Module) for p in b.parameters())
    if not torch.is_grad_enabled() or not (x.requires_grad or params_need_grad):
        for block in blocks:
            x = block(x)
        return x
    if plan is None:
        plan = _cached_plan(blocks, x, strategy, budget_bytes, segments, slots)
    elif not isinstance(plan, Plan):
        raise TypeError(f"plan must be a remat.checkpoint.Plan, got {type(plan).__name__}")
    if plan.num_blocks != len(blocks):
        raise ValueError(f"plan is for {plan.num_blocks} blocks, got {len(blocks)}")
    return run_chain(blocks, x, plan.schedule, preserve_rng_state)


def _cached_plan(blocks, x, strategy, budget_bytes, segments, slots):
    key = (tuple(id(b) for b in blocks), tuple(x.shape), x.dtype, x.device, strategy, budget_bytes, segments, slots)
    try:
        per_block = _plan_cache.setdefault(blocks[0], {})
    except TypeError:
        per_block = {}
    if key not in per_block:
        per_block[key] = plan(blocks, x, strategy=strategy, budget_bytes=budget_bytes, segments=segments,
                              slots=slots)
    return per_block[key]
