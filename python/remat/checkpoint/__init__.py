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
        the chain's output. Gradients reach ``x`` and the blocks' ``nn.Module`` parameters; a plain
        callable block that captures a tensor requiring grad is refused (TypeError). An in-place
        change of ``x`` between forward and backward raises in backward.
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks is empty")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {type(preserve_rng_state).__name__}")
    _check_blocks_hold_no_grad_tensors(blocks)
    params_need_grad = any(p.requires_grad for b in blocks if isinstance(b, torch.nn.Module) for p in b.parameters())
    if not torch.is_grad_enabled() or not (x.requires_grad or params_need_grad):
        for block in blocks:
            x = block(x)
        return x
    if plan is None:
        plan = _cached_plan(blocks, x, strategy, budget_bytes, segments, slots)
    elif not isinstance(plan, Plan):
        raise TypeError(f"plan must be a remat.Plan (from remat.plan), got {type(plan).__name__}")
    if plan.num_blocks != len(blocks):
        raise ValueError(f"plan is for {plan.num_blocks} blocks, got {len(blocks)}")
    return run_chain(blocks, x, plan.schedule, preserve_rng_state)


def _autocast_key():
    return tuple((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda"))


def _cached_plan(blocks, x, strategy, budget_bytes, segments, slots):
    """The plan for these blocks and this input's shape, dtype, device and autocast state, made
    on first use. Entries hold weak references to every block and are used only while each still
    refers to the same object (ids of dead objects can be reused)."""
    key = (tuple(id(b) for b in blocks), tuple(x.shape), x.dtype, x.device, _autocast_key(), strategy,
           budget_bytes, segments, slots)
    try:
        per_block = _plan_cache.setdefault(blocks[0], {})
        refs = [weakref.ref(b) for b in blocks]
    except TypeError:
        per_block, refs = {}, None
    entry = per_block.get(key)
    if entry is not None and all(r() is b for r, b in zip(entry[0], blocks)):
        return entry[1]
    made = plan(blocks, x, strategy=strategy, budget_bytes=budget_bytes, segments=segments, slots=slots)
    if refs is not None:
        per_block[key] = (refs, made)
    return made


def _check_blocks_hold_no_grad_tensors(blocks):
    """Gradients reach x and the blocks' nn.Module parameters only. A plain callable that captures
    a tensor requiring grad (a closure or default argument) would silently get none: refuse it."""
    for index, block in enumerate(blocks):
        if isinstance(block, torch.nn.Module):
            continue
        if not callable(block):
            raise TypeError(f"blocks[{index}] must be callable, got {type(block).__name__}")
        function = getattr(block, "__func__", block)
        captured = [c.cell_contents for c in (getattr(function, "__closure__", None) or ()) if _cell_filled(c)]
        captured += list(getattr(function, "__defaults__", None) or ())
        captured += [getattr(block, "__self__", None)]
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in captured):
            raise TypeError(
                f"blocks[{index}] is a callable that captures a tensor requiring grad; it would get no "
                "gradient. Wrap it in an nn.Module with the tensor as an nn.Parameter"
            )


def _cell_filled(cell):
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True
