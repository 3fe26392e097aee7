"""One-call patching of real models: ``remat.patch(model)`` swaps, in place, the submodules remat
has fused versions of, sharing their parameters (no copies; ``state_dict`` unchanged), and
``remat.unpatch(model)`` puts the originals back.

This module is the entry: it checks the arguments and fixes the layer configuration (planning
``policy="auto"`` with remat.planning.model_plan), then remat.replacement applies it (what is replaced, the
all-or-nothing guarantee, masks, tuples, saving and generation are documented there). The layers
read top-down: patch -> model_plan -> replacement -> models -> nn.
"""

from remat import checks
from remat.models import registry
from remat.planning import model_plan, peak_plan
from remat.replacement import (
    MODULE_KINDS,
    STOCK,
    PatchReport,
    check_model_and_modules,
    check_patchable,
    check_policy,
    replace_modules,
    set_layer_options,
    unpatch,
)
from remat.sequence_parallel import SequenceGroup

__all__ = ["MODULE_KINDS", "STOCK", "PatchReport", "patch", "unpatch"]


def patch(model, *,
          # What is replaced and how it runs (every way of choosing the policy).
          modules=MODULE_KINDS, backend=None, offload=False, tile_tokens=None, sequence_parallel=None,
          # 1. A fixed policy.
          policy="balanced",
          # 2. policy="auto" on an example batch: per-layer policies and spans under a saved-bytes budget.
          example_inputs=None, budget_bytes_per_token=None, cost="flops", max_span=None,
          # 3. policy="auto" at a length: the configuration whose step's device peak fits.
          seq_len=None, batch_size=1, host_budget_bytes=None,
          # The budget of 2 (saved bytes) or 3 (the device peak).
          budget_bytes=None):
    """Replaces, in place, the submodules of ``model`` that remat has fused versions of (see
    remat.replacement), keeping their parameters, and returns a :class:`PatchReport`.

    Three ways to choose what each layer keeps: a fixed ``policy``; ``policy="auto"`` with
    ``example_inputs`` and ``budget_bytes`` (or ``budget_bytes_per_token``): the layer planner,
    measured on that batch, bounds the peak of the bytes saved for backward; ``policy="auto"`` with
    ``seq_len`` and ``budget_bytes``: the peak planner bounds the step's whole device peak
    (parameters, gradients, kept tensors, the backward's working set; remat.estimate).

    Args:
        model: an ``nn.Module``: a Hugging Face model of a family remat.models lists (built from a config
            or loaded from a checkpoint), or any PyTorch model with ``torch.nn.RMSNorm`` /
            ``LayerNorm`` layers.
        policy: ``"speed"``, ``"balanced"`` (default) or ``"memory"``: what whole decoder layers
            keep for backward (see remat.nn.LlamaLayer); a dict {qualified decoder-layer name:
            policy or ``"stock"``} chooses per layer (layers it does not name stay stock);
            ``"auto"``: planned under a budget (below).
        modules: which kinds to replace, a subset of ``("norm", "mlp", "attention", "loss")``
            (default: all). Whole decoder layers need norm, mlp and attention. "loss": a causal
            LM of a known family computes its training loss (training mode, labels given) with
            remat.linear_cross_entropy, never materialising the logits; its output's ``logits``
            is then None (see remat.models.causal_lm).
        backend: remat backend for the new modules, or None for the default choice.
        budget_bytes, budget_bytes_per_token, example_inputs, cost: with ``policy="auto"`` only:
            remat.plan_model measures every decoder layer on ``example_inputs`` (a dict of forward
            keyword arguments of one training batch) and chooses, per layer, the stock layer, a
            fused policy, or re-running a span of fused layers from its input, so that the step's
            peak of saved bytes stays within the budget (in bytes, or per token of the example) at
            the least recompute (``cost="flops"`` or ``"time"``); ``report.plan.explain()`` shows
            the plan. With "loss" in ``modules``, ``cost="flops"`` and ``budget_bytes``, the plan
            also chooses the loss: fused, or Hugging Face's (logits kept, no recompute) where the
            budget holds them (``report.plan.loss``). Batches larger than the example in either
            dimension raise ValueError.
        max_span: with ``policy="auto"``: the most layers one checkpointed span may hold (default:
            any); ``max_span=1`` under FSDP2 with ``fully_shard`` on each decoder layer (see
            remat.plan_model).
        seq_len, batch_size: with ``policy="auto"`` and ``budget_bytes``, instead of example inputs:
            plan so that the predicted device peak of a training step of ``batch_size`` sequences
            of ``seq_len`` tokens (parameters, gradients, what is kept, the largest backward working
            set, the loss; ``remat.estimate``) stays within ``budget_bytes``, choosing the cheapest of
            remat.planning.peak_plan's configurations (policies, MLP tiling, host offload, checkpointing),
            or a per-layer mix of the first that fits and the one before it (the fewest layers on
            the slower one); ``budget_bytes="auto"`` on a CUDA model: the GPU's total memory less
            3 GiB. ``report.plan.explain()`` prints each candidate's and mix's predicted peak, host
            bytes and recompute FLOPs.
        host_budget_bytes: with ``seq_len``: None (default: any), or the most host memory the
            offloading candidates may hold (their predicted host peak); a candidate over it is
            skipped like one over ``budget_bytes``.

        offload: move what every fused decoder layer keeps for backward (its policy's saved
            tensors, or its input under Hugging Face gradient checkpointing) to host memory after
            its forward and back one layer ahead of its backward (remat.offload.HostOffload, on
            ``report.offload``); bitwise the same gradients. Default False. Not with
            ``policy="auto"`` yet (its checkpointed spans run in remat's own executor).
        tile_tokens: None (default), an int >= 1, or ``"auto"`` (each call's tile chosen from the free
            memory, remat.tiles): every fused decoder layer's MLP runs over tiles of that many tokens in
            forward and backward (remat.norm_mlp, remat.norm_gelu_mlp), so no ``[tokens, intermediate]``
            tensor exists beyond one tile, and so does its attention sub-block (remat.norm_attention:
            backward over query tiles) where the call is causal (a sliding window too, dense rows, or packed
            rows outside torch.compile) without attention dropout (otherwise it runs untiled and the layer
            warns once); the same saved bytes, the untiled results up to rounding. With LoRA dropout, a
            multiple of 4 (the call raises ValueError otherwise; the masks are the untiled call's). The
            fused loss runs over the same token tiles (remat.linear_cross_entropy's ``tile_tokens``), and so
            do mixture-of-experts blocks (under "speed" their kept gate and up of every routed row stay
            whole).

        sequence_parallel: None (default), a ``torch.distributed`` ProcessGroup of the ranks that
            share one sequence (Ulysses; remat.sequence_parallel), or ``"deepspeed"``: DeepSpeed's
            sequence-parallel group, found at the first forward (HF Accelerate's
            ``ParallelismConfig(sp_backend="deepspeed")`` creates it in ``prepare``, after
            patching; remat.sequence_parallel.SequenceGroup). Each rank's model then takes
            its contiguous shard of the sequence (``input_ids``, ``position_ids``, required, and for
            the loss ``labels`` with ``shift_labels`` and ``num_items_in_batch`` of the whole batch,
            as remat.sequence_parallel.shard_batch or DeepSpeed's UlyssesSPDataLoaderAdapter cut
            them), and each attention sub-block exchanges heads for tokens with two all-to-alls.
            Each rank's loss is its share of the whole sequence's, and the gradients of the
            parameters, summed over the group, are the one-process gradients (DDP and FSDP2
            average over their group instead: scale each rank's loss by the group size there; the
            sequence-parallel guide). Needs whole decoder layers for every layer of
            the model, query heads divisible by the group size and KV heads divisible by it or
            dividing it. With ``policy="auto"`` only with ``seq_len`` (the whole sequence's length)
            and ``budget_bytes`` (per rank; the ranks plan under the smallest of theirs, so they
            agree): each candidate is estimated for one rank's shard.
            Every fused layer keeps what its policy keeps for its shard's tokens.

    All or nothing: when anything inside patch raises (the plan included), the model is left as it
    was and the exception propagates.
    """
    modules = check_model_and_modules(model, modules)
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {type(offload).__name__}")
    if offload and policy == "auto":
        raise ValueError("offload=True is not supported with policy='auto' yet: choose a policy")
    tile_tokens = checks.check_tile_tokens(tile_tokens) or None
    group = None
    if sequence_parallel is not None:
        group = SequenceGroup(sequence_parallel)
        if policy == "auto" and seq_len is None:
            raise ValueError("sequence_parallel with policy='auto' plans the device peak: give seq_len and "
                             "budget_bytes (the layer-cost planner with example_inputs does not take it)")
        if not set(registry.PART_KINDS) <= set(modules):
            raise ValueError(f"sequence_parallel runs whole decoder layers: modules must include {registry.PART_KINDS}")
    if host_budget_bytes is not None and (policy != "auto" or seq_len is None):
        raise ValueError("host_budget_bytes is for policy='auto' with seq_len")
    if policy != "auto" and not (budget_bytes is None and budget_bytes_per_token is None and example_inputs is None
                                 and max_span is None and seq_len is None and batch_size == 1):
        raise ValueError("budget_bytes, budget_bytes_per_token, example_inputs, max_span, seq_len and batch_size "
                         f"are for policy='auto' (planning); policy={policy!r} takes none of them")
    if policy != "auto":
        check_policy(policy)
        finish = None
        if offload or tile_tokens or group:
            def finish(report):
                set_layer_options(model, report, offload=offload, tile_tokens=tile_tokens, sequence_parallel=group)
        report = replace_modules(model, policy, modules, backend, finish=finish)
        if group and not report.replaced:  # finish never ran: nothing would split the attention
            unpatch(model)
            raise ValueError("sequence_parallel: remat fused no decoder layer of this model (see the warning), so "
                             "nothing would run its attention over the group's shards")
        return report
    check_patchable(model)
    if not set(registry.PART_KINDS) <= set(modules):
        raise ValueError(f"policy='auto' plans whole decoder layers: modules must include {registry.PART_KINDS}")
    if seq_len is not None:
        if example_inputs is not None or budget_bytes_per_token is not None or max_span is not None or tile_tokens:
            raise ValueError("policy='auto' with seq_len plans the device peak from budget_bytes alone: "
                             "example_inputs, budget_bytes_per_token, max_span and tile_tokens are not taken")
        if budget_bytes is None:
            raise ValueError("policy='auto' with seq_len plans the step's device peak under budget_bytes: give "
                             "budget_bytes=<bytes> (on a CUDA model also 'auto': the GPU's memory less 3 GiB)")
        budget = _device_budget(model, budget_bytes)
        if group is not None:  # every rank plans the same: the group's smallest budgets
            budget, host_budget_bytes = group.smallest(budget), group.smallest(host_budget_bytes)
        peak = peak_plan.plan_peak(model, seq_len=seq_len, batch_size=batch_size, budget_bytes=budget,
                                   modules=modules, backend=backend, host_budget_bytes=host_budget_bytes,
                                   sequence_parallel=group)
        return peak_plan.install(model, peak, modules, backend, group)
    # The planner measures configurations through remat.replacement and leaves the model unpatched.
    plan = model_plan.plan_model(model, example_inputs, budget_bytes=budget_bytes,
                                 budget_bytes_per_token=budget_bytes_per_token, cost=cost, backend=backend,
                                 modules=modules, max_span=max_span)
    # Per qualified layer name: "stock" (left as it is) or the fused policy.
    layer_policies = {plan.costs.layers[i].name: choice for i, choice in plan.layer_policies().items()}
    if plan.loss == "stock":  # the plan keeps Hugging Face's loss (it holds the logits in the budget)
        modules = tuple(kind for kind in modules if kind != "loss")

    def install(report):
        report.plan = plan
        named = dict(model.named_modules())
        model_plan.install(plan, [named[layer.name] for layer in plan.costs.layers])
        if tile_tokens:
            set_layer_options(model, report, tile_tokens=tile_tokens)

    return replace_modules(model, layer_policies, modules, backend, finish=install)


# What a GPU's memory holds besides tensors (the CUDA context, workspaces, fragmentation).
GPU_RESERVE_BYTES = 3 * 2**30


def _device_budget(model, budget_bytes):
    """budget_bytes as given, or for "auto" the total memory of the CUDA device the model is on less
    GPU_RESERVE_BYTES."""
    if budget_bytes != "auto":
        return budget_bytes
    device = next(model.parameters()).device
    if device.type != "cuda" or checks.values_unknown(next(model.parameters())):
        raise ValueError(f"budget_bytes='auto' reads the memory of the model's CUDA device; the model is on "
                         f"{device}{' (fake tensors)' if device.type == 'cuda' else ''}: give budget_bytes in bytes")
    import torch

    return torch.cuda.get_device_properties(device).total_memory - GPU_RESERVE_BYTES
