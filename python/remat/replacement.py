"""What remat.patch does under one layer configuration (:func:`replace_modules`): it swaps, in
place, the submodules remat has fused versions of, sharing their parameters (no copies;
``state_dict`` unchanged), and :func:`unpatch` puts the originals back. remat.patch (remat/patch.py)
fixes the configuration, planning ``policy="auto"`` with remat.planning.model_plan, which measures
configurations through this module; this module imports neither.

What is replaced is what the model-family table (remat.models.registry) lists:

- whole decoder layers (Hugging Face Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3
  decoder layers, GPT-2 blocks), when ``modules`` has all of "norm", "mlp" and "attention": by the
  family's fused layer (:class:`remat.nn.LlamaLayer`, :class:`remat.nn.GPT2Layer`, ...) with the
  chosen ``policy``;
- otherwise, one by one, the parts a family lists: ``torch.nn.RMSNorm``, ``torch.nn.LayerNorm`` and
  the Llama-family RMSNorms ("norm"), the Llama-family MLPs ("mlp") and attention modules
  ("attention", by an adapter with Hugging Face's calling convention, keeping their sliding window
  and causality);
- with "loss" in ``modules``, a listed causal LM's training loss (remat.models.causal_lm).

Only the listed classes are replaced; look-alikes whose computation differs (OLMo 2's norms,
Cohere's LayerNorm, non-causal vision attention) are left as they are. Replacements keep the
originals' train/eval mode. A listed module remat's kernels cannot run (float64 parameters, an
attention head dim above remat.checks.MAX_HEAD_DIM; remat.nn.layers.check_runnable), or whose
build refuses it (TypeError / ValueError), is left alone with the reason in the report.

All or nothing: when anything inside patch raises, the model is put back as it was (modules,
hooks, configs, forwards) and the exception propagates. A patch that replaces nothing leaves the
model unchanged (but for a mark that unpatch removes: unpatch succeeds on any model patch was
called on), and warns; so does a model whose
Hugging Face layers no family takes (the warning names them and the families remat knows).

Saving: a patched model pickles whenever the stock model does (``torch.save(model)``,
``copy.deepcopy``), loading as a patched model that unpatch restores: everything patch installs
(forward wrappers, setters, Hugging Face's recording hooks, MoE routers) is an object of a
module-level class, a planned model's (``policy="auto"``) layer forwards too. unpatch removes every
hook patch installed. ``save_pretrained`` of a patched Hugging Face model writes what the unpatched
model writes (config.json with the model's own ``use_cache`` and attention implementation, not the
private copy's below; the generation config; the same tensors under the same names): it runs with
the original configs put back (:class:`StockConfigSave`), and the checkpoint loads without remat.

``return_dict=False``: the tuple keeps stock's positions. A field stock computes that the patched
forward leaves None (the fused loss's ``logits``; the KV cache a patched forward does not build,
where the stock model's config or ``use_cache`` argument would build one) stays in its place as
None, so ``loss, logits = out[:2]`` and later indices (hidden states, MoE ``aux_loss`` and router
logits) read what they read in stock (remat.hf.output_tuple).

Hugging Face masks, packing and generation (when attention is replaced: whole layers or attention
modules): the model's ``config._attn_implementation`` becomes ``"remat"`` on a private copy of its
config (the model's modules hold the copy until unpatch puts the original back; other models built
from the same config object are not changed),
registered with transformers (remat.hf.register_attention), so the model gives its layers
the 2-D padding mask, or None without padding. A 2-D ``attention_mask`` may pad anywhere (right,
left, holes): each row's real tokens run as one packed variable-length sequence; rows whose
``position_ids`` restart (packed documents) or Hugging Face's ``cu_seq_lens_q/k`` arguments run
each document as its own sequence (remat.sequences.sequence_layout). The model checks the mask it
is called with: other masks (4-D, custom) raise ValueError. With a KV cache (``generate``), each
fused layer runs the Hugging Face layer it replaced, which appends to the cache and attends through
remat's attention (remat.hf.hf_attention), in no_grad saving nothing. ``config.use_cache``
is set False (on the copy) so training forwards build no cache; ``generate`` still uses
one (its generation config's ``use_cache``).
"""

import copy
import dataclasses
import inspect
import sys
import warnings
from dataclasses import dataclass, field

from torch import nn

from remat import sequence_parallel
from remat.hf import (
    ATTENTION_IMPLEMENTATION,
    ModelForward,
    cache_field,
    check_attention_mask,
    output_tuple,
    register_attention,
    stock_builds_cache,
)
from remat.models import causal_lm, outputs, registry
from remat.nn.adapters import carry_wrappers
from remat.nn.layers import LAYER_POLICIES, PreNormDecoderLayer, check_runnable
from remat.offload import HostOffload
from remat.sequences import SEQUENCE_PARALLEL_FLAG

# "loss": a causal LM's training loss through remat.linear_cross_entropy (remat.models.causal_lm).
MODULE_KINDS = (*registry.PART_KINDS, "loss")
# A per-layer policy dict's value for a decoder layer left as it is (the planner's choice too).
STOCK = "stock"
_ORIGINAL = "_remat_original"
_HOOK = "_remat_patched"
_SEQUENCE_PARALLEL = SEQUENCE_PARALLEL_FLAG
_CONFIGS = "_remat_saved_configs"
_CHECKPOINT_SETTER = "_set_gradient_checkpointing"
_COUNTING = "_remat_counts_checkpointed_layers"
_PREVIOUS_FORWARD = "_remat_previous_forward"
_MASK_CHECK = "_remat_mask_check"
_KEPT_INSIDE_WRAPPER = "_remat_mask_check_inside_wrapper"
# Set on a model a patch call left unchanged (it replaced nothing): unpatch then has nothing to undo
# and only removes the mark; a later patch may run (and removes it too).
_REPLACED_NOTHING = "_remat_replaced_nothing"


@dataclass
class PatchReport:
    """What :func:`patch` did: ``replaced`` holds (qualified name, original type, remat type),
    ``left_alone`` (qualified name, type, reason) for modules of a kind it was asked for but
    could not take."""

    replaced: list = field(default_factory=list)
    left_alone: list = field(default_factory=list)
    # policy="auto": the remat.planning.model_plan.ModelPlan the layers run (plan.explain()).
    plan: object = None
    # offload=True: the remat.offload.HostOffload the layers share (host_bytes, copied_bytes).
    offload: object = None

    def __str__(self):
        lines = [f"remat.patch: replaced {len(self.replaced)} modules, left {len(self.left_alone)} alone"]
        lines += [f"  {name}: {old} -> {new}" for name, old, new in self.replaced]
        lines += [f"  {name}: {kind} left alone ({why})" for name, kind, why in self.left_alone]
        return "\n".join(lines)


def set_layer_options(model, report, *, offload=False, tile_tokens=None, checkpointing=False, prefetch=True,
                      sequence_parallel=None):
    """Sets options on every fused decoder layer ``report`` names, in model order: the MLP's and
    attention sub-block's tile (``tile_tokens``, also the fused loss's), one shared HostOffload (``offload``; on
    ``report.offload``; ``prefetch`` as HostOffload's), whole-layer checkpointing
    (``checkpointing``: the layer keeps its input, re-run in backward) and sequence parallelism
    (``sequence_parallel``: a remat.sequence_parallel.SequenceGroup; ValueError when a Hugging Face
    layer of the model runs unfused, or a layer's heads cannot be split over a group given now)."""
    layers = [layer for _, layer in fused_layers(model, report)]
    if sequence_parallel is not None:
        _check_sequence_parallel_layers(model, layers, sequence_parallel)
        model.__dict__[_SEQUENCE_PARALLEL] = True  # its forward then requires position_ids (MaskCheckedForward)
        for layer in layers:
            layer.sequence_parallel = sequence_parallel
    if offload:
        report.offload = HostOffload(prefetch=prefetch)
    causal_lm.set_tile_tokens(model, tile_tokens)
    for index, layer in enumerate(layers):
        layer.tile_tokens = tile_tokens
        if offload:
            layer._offload = report.offload
            layer._offload_index = index
        if checkpointing:
            layer.gradient_checkpointing = True


def fused_layers(model, report):
    """(qualified name, layer) of the fused decoder layers (remat.nn.layers.PreNormDecoderLayer)
    ``report`` names, in model order."""
    named = dict(model.named_modules())
    return [(name, named[name]) for name, _, _ in report.replaced if isinstance(named.get(name), PreNormDecoderLayer)]


def replace_modules(model, policy, modules=MODULE_KINDS, backend=None, finish=None):
    """Replaces, in place, the submodules of ``model`` that remat has fused versions of under one
    layer configuration, keeping their parameters, and returns a :class:`PatchReport`: what
    remat.patch does once its policy is fixed (remat.patch also plans ``policy="auto"`` first;
    remat.planning.model_plan measures configurations through this function and :func:`unpatch`).

    Args:
        model: an ``nn.Module`` (see remat.patch).
        policy: ``"speed"``, ``"balanced"`` or ``"memory"`` for every decoder layer, or a dict
            {qualified decoder-layer name: one of those or :data:`STOCK`} (layers it does not name
            stay stock).
        modules: which kinds to replace, a non-empty subset of :data:`MODULE_KINDS`.
        backend: remat backend for the new modules, or None for the default choice.
        finish: None, or a function of the report run last inside the all-or-nothing section
            (remat.patch installs a plan there).

    All or nothing: when anything inside raises, the model is put back as it was and the exception
    propagates. A call that replaces nothing leaves the model unchanged but for a mark unpatch
    removes, and warns; so does a model with Hugging Face layers no family takes.
    """
    modules = check_model_and_modules(model, modules)
    check_policy(policy)
    check_patchable(model)
    unknown_layers = _unknown_layer_classes(model)
    # Whatever fails inside (a layer's build, installing hooks, the loss, finish, ...) leaves the
    # model as it was: everything replace_modules changes is a module attribute (_ModuleState).
    state = _ModuleState(model)
    model.__dict__.pop(_REPLACED_NOTHING, None)
    try:
        report = _replace(model, policy, modules, backend)
        if finish is not None and report.replaced:
            finish(report)
    except BaseException:
        state.restore()
        raise
    if not report.replaced:
        # Nothing runs fused: the model keeps no trace of the call (no hooks, configs or forward)
        # but one mark, so that remat.unpatch(model) succeeds (a no-op that removes it) and code
        # written as patch ... unpatch runs on any model.
        state.restore()
        setattr(model, _REPLACED_NOTHING, True)
    if unknown_layers or not report.replaced:
        warnings.warn(_no_fused_layers_message(model, report, unknown_layers), stacklevel=3)
    return report


def check_model_and_modules(model, modules):
    """Raises TypeError unless ``model`` is an ``nn.Module``, ValueError unless ``modules`` is a
    non-empty subset of :data:`MODULE_KINDS`; returns ``modules`` as a tuple."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    modules = tuple(modules)
    unknown = [m for m in modules if m not in MODULE_KINDS]
    if unknown or not modules:
        raise ValueError(f"modules must be a non-empty subset of {MODULE_KINDS}, got {modules!r}")
    return modules


def check_policy(policy):
    """Raises ValueError unless ``policy`` is a fused layer policy or a dict {layer name: fused
    policy or :data:`STOCK`}."""
    if isinstance(policy, dict):
        if not all(isinstance(k, str) and v in (*LAYER_POLICIES, STOCK) for k, v in policy.items()):
            raise ValueError(f"a policy dict maps layer names to one of {(*LAYER_POLICIES, STOCK)}, got {policy!r}")
    elif policy not in LAYER_POLICIES:
        raise ValueError(f"policy must be one of {(*LAYER_POLICIES, 'auto')} or a dict, got {policy!r}")


def check_patchable(model):
    """Raises ValueError when ``model`` is patched already, or its forward was wrapped after an
    earlier patch (a trainer's wrapper still running that patch's forward)."""
    if getattr(model, _HOOK, False):
        raise ValueError("model is already patched; call remat.unpatch(model) first")
    if model.__dict__.get(_KEPT_INSIDE_WRAPPER) or causal_lm.wrapped_after_uninstall(model):
        raise ValueError("model's forward was wrapped after an earlier remat.patch (for example by TRL's "
                         "SFTTrainer) and still runs through that patch's forward; patch the model before "
                         "building the trainer, on a model that was never patched")


def _replace(model, policy, modules, backend):
    """replace_modules's changes to ``model``, on validated arguments; returns the :class:`PatchReport`."""
    report = PatchReport()
    whole_layers = set(registry.PART_KINDS) <= set(modules)
    # Hugging Face's output-recording hooks go on the stock modules first, then each replacement
    # gets its original's (remat.models.outputs): output_hidden_states returns what stock returns.
    outputs.install_recorders(model)
    _patch_children(model, "", modules, whole_layers, policy, backend, report)
    layers_replaced = bool(report.replaced)
    if "loss" in modules:
        _patch_loss(model, report)
    if not report.replaced:
        return report
    setattr(model, _HOOK, True)
    if layers_replaced:
        _install_checkpoint_counting(model)
    if layers_replaced and _attention_replaced(model):
        # Training forwards build no cache (generate still does); the model builds 2-D padding
        # masks for remat's layers and runs stock attention modules (with a cache) through remat's.
        # On private copies of the configs: Hugging Face shares one config object among the
        # models built from it (Cls(config), from_config(model.config)), which must not change.
        configs = _give_private_configs(model)
        if configs:
            register_attention()
        for config in configs:
            config.use_cache = False
            config._attn_implementation = ATTENTION_IMPLEMENTATION
        _install_stock_save(model)
        _install_mask_check(model)
    return report


class _ModuleState:
    """What :func:`patch` may change in ``model``, saved so that :meth:`restore` puts it back: each
    module's attributes (its ``__dict__``: children, hook dicts, an instance forward, its config,
    flags and setters), the dicts, lists and sets among them (``_modules``, ``_forward_hooks``, ...)
    copied too and put back in place (hook handles hold the dicts themselves). Everything patch
    does to a model is such an attribute of one of its modules; besides, patch registers remat's
    attention with transformers (process-wide, idempotent, changing no model)."""

    def __init__(self, model):
        self.saved = [(module, dict(module.__dict__),
                       {key: copy.copy(value) for key, value in module.__dict__.items()
                        if isinstance(value, (dict, list, set))})
                      for module in model.modules()]

    def restore(self):
        for module, attributes, containers in self.saved:
            for key, value in containers.items():
                held = attributes[key]
                if isinstance(held, list):
                    held[:] = value
                else:
                    held.clear()
                    held.update(value)
            module.__dict__.clear()
            module.__dict__.update(attributes)


def _check_sequence_parallel_layers(model, layers, source):
    """Raises ValueError unless every Hugging Face layer of ``model`` runs fused (a stock layer
    would attend within its rank's shard only) and, for a group given now (``source``, a
    remat.sequence_parallel.SequenceGroup), each fused layer's heads split over its ranks
    (remat.sequence_parallel.check_heads; DeepSpeed's group is checked at the first forward)."""
    base = getattr(sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", None)
    stock = sorted({name for name, module in model.named_modules() if base is not None and isinstance(module, base)})
    if stock or not layers:
        raise ValueError("sequence_parallel needs every decoder layer of the model fused (whole layers of a family "
                         "remat knows, policy not 'stock'); these run stock: "
                         f"{', '.join(stock[:4]) or 'all'}{' ...' if len(stock) > 4 else ''}")
    if source.group is None:
        return
    size = sequence_parallel.check_group(source.group)
    for layer in layers:
        attention = getattr(layer, "self_attn", layer)
        num_heads = attention.num_heads
        sequence_parallel.check_heads(num_heads, getattr(attention, "num_kv_heads", num_heads), size,
                                      type(layer).__name__)


def _unknown_layer_classes(model):
    """The class names of ``model``'s Hugging Face layers (``GradientCheckpointingLayer``: decoder
    and encoder layers) when no family of remat's table takes any of them (a model of a family
    remat does not know); else (): a model with some known layers (a vision-language model's text
    decoder) runs those fused."""
    base = getattr(sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", None)
    if base is None:
        return ()
    layers = [module for module in model.modules() if isinstance(module, base)]
    if any(registry.match(layer) is not None for layer in layers):
        return ()
    return tuple(sorted({type(layer).__name__ for layer in layers}))


def _no_fused_layers_message(model, report, unknown_layers):
    """The warning patch gives when it replaced nothing, or when no family takes the model's layers."""
    name = type(model).__name__
    if unknown_layers:
        done = (f"replaced {len(report.replaced)} modules (no decoder layer)" if report.replaced else
                "left the model unchanged")
        why = (f"no family remat knows takes its layers ({', '.join(unknown_layers)}); they stay stock. "
               f"Families remat knows: {registry.describe()}")
        return f"remat.patch({name}) {done}: {why}"
    if report.left_alone:
        reasons = "; ".join(f"{qualified}: {why}" for qualified, _, why in report.left_alone[:3])
        more = f" (and {len(report.left_alone) - 3} more)" if len(report.left_alone) > 3 else ""
        return (f"remat.patch({name}) replaced nothing and left the model unchanged; left alone: {reasons}{more}")
    return (f"remat.patch({name}) replaced nothing and left the model unchanged: it holds no module of a class "
            f"remat knows. Families remat knows: {registry.describe()}")


def _is_hf_config(config):
    return config is not None and hasattr(config, "_attn_implementation") and hasattr(config, "sub_configs")


def _modules_with_originals(model):
    """model's modules and those of the Hugging Face modules patch replaced (kept aside, run for
    generation: their attention modules read their config's ``_attn_implementation``)."""
    seen = {}
    stack = [model]
    while stack:
        for module in stack.pop().modules():
            if id(module) not in seen:
                seen[id(module)] = module
                original = module.__dict__.get(_ORIGINAL)
                if original is not None:
                    stack.append(original)
    return list(seen.values())


def _give_private_configs(model):
    """Gives model's modules (and the replaced originals') shallow copies of the Hugging Face
    configs they hold, one copy per distinct config, with sub-configs (``text_config``, ...)
    pointing at the copies of those too (a multimodal model builds its text mask from its own
    config's ``text_config``, which must be the copy its language model holds); records
    ``(module, original config)`` for unpatch and returns the copies of the decoder configs
    modules hold (those with ``use_cache``; a vision tower's config keeps its attention)."""
    modules = _modules_with_originals(model)
    held = {}
    for module in modules:
        config = module.__dict__.get("config")
        if _is_hf_config(config):
            held.setdefault(id(config), config)
    copies = {}
    pending = list(held.values())
    while pending:
        config = pending.pop()
        if id(config) in copies:
            continue
        copies[id(config)] = (config, copy.copy(config))
        pending += [sub for key in type(config).sub_configs if _is_hf_config(sub := getattr(config, key, None))]
    for _, private in copies.values():
        for key in type(private).sub_configs:
            sub = private.__dict__.get(key)
            if sub is not None and id(sub) in copies:
                private.__dict__[key] = copies[id(sub)][1]
    swapped = []
    for module in modules:
        config = module.__dict__.get("config")
        if _is_hf_config(config):
            swapped.append((module, config))
            module.__dict__["config"] = copies[id(config)][1]
    setattr(model, _CONFIGS, swapped)
    return [copies[key][1] for key, config in held.items() if hasattr(config, "use_cache")]


def _attention_replaced(model):
    """Whether patch replaced a module that runs attention (a whole decoder layer or an attention
    module)."""
    for module in model.modules():
        original = module.__dict__.get(_ORIGINAL)
        found = registry.match(original) if original is not None else None
        if found is not None and found.kind in ("layer", "attention"):
            return True
    return False


def _patch_children(parent, prefix, modules, whole_layers, policy, backend, report):
    for name, child in list(parent.named_children()):
        qualified = f"{prefix}{name}"
        found = registry.match(child)
        if found is not None and found.kind == "whole_only":
            if "attention" in modules or "mlp" in modules:
                report.left_alone.append((qualified, type(child).__name__, found.reason))
                continue
            found = None
        if found is not None and not (whole_layers if found.kind == "layer" else found.kind in modules):
            found = None
        if found is None:
            _patch_children(child, f"{qualified}.", modules, whole_layers, policy, backend, report)
            continue
        try:
            if found.kind == "layer":
                layer_policy = policy.get(qualified, STOCK) if isinstance(policy, dict) else policy
                if layer_policy == STOCK:
                    report.left_alone.append((qualified, type(child).__name__, "kept stock by policy='auto'"))
                    continue
                replacement = found.build(child, policy=layer_policy, backend=backend)
            else:
                replacement = found.build(child, backend=backend)
            check_runnable(replacement)
        except (TypeError, ValueError) as error:
            report.left_alone.append((qualified, type(child).__name__, str(error)))
            continue
        replacement.train(child.training)
        object.__setattr__(replacement, _ORIGINAL, child)
        outputs.carry_recorders(replacement, child)
        setattr(parent, name, replacement)
        report.replaced.append((qualified, type(child).__name__, type(replacement).__name__))


def _patch_loss(model, report):
    for name, module in model.named_modules():
        if not causal_lm.is_causal_lm(module):
            continue
        qualified = name or type(module).__name__
        reason = causal_lm.refusal(module)
        if reason is not None:
            report.left_alone.append((qualified, "loss", reason))
            continue
        causal_lm.install(module)
        report.replaced.append((qualified, f"{type(module).__name__} loss", "fused linear cross-entropy"))


def _install_mask_check(model):
    """Makes model's forward check its attention_mask first: the forward becomes a
    :class:`MaskCheckedForward`, which runs the forward it replaced (or the stock one)."""
    MaskCheckedForward.install(model, _PREVIOUS_FORWARD, _MASK_CHECK)


class MaskCheckedForward(ModelForward):
    """A patched model's forward: checks the attention_mask (passed by name, by position or inside
    ``**kwargs``; remat.hf.check_attention_mask), then runs the forward it replaced (an
    instance forward such as accelerate's hooks install, kept as ``model._remat_previous_forward``)
    or the class's (pickling and the signature: remat.hf.ModelForward). torch.compile traces the
    check into the model's graph (a forward pre-hook would be a separate graph)."""

    def __call__(self, *args, **kwargs):
        model = self.model
        given = self.arguments(args, kwargs)
        patched = getattr(model, _HOOK, False)  # a pass-through once unpatched, if a later wrapper keeps calling it
        if patched:
            check_attention_mask(given.get("attention_mask"))
            if model.__dict__.get(_SEQUENCE_PARALLEL) and given.get("position_ids") is None:
                # Without them Hugging Face's model would place every shard at positions 0 .. n - 1.
                raise ValueError("a model patched with sequence_parallel needs each shard's position_ids (its "
                                 "tokens' places in the whole sequence; remat.sequence_parallel.shard_batch and "
                                 "DeepSpeed's UlyssesSPDataLoaderAdapter provide them)")
        as_tuple = patched and _returns_tuple(model, given, kwargs)
        if as_tuple:
            # The output object, made a tuple here with stock's positions (remat.hf.output_tuple).
            kwargs = {**kwargs, "return_dict": True}
        inner = model.__dict__.get(_PREVIOUS_FORWARD)
        output = inner(*args, **kwargs) if inner is not None else type(model).forward(model, *args, **kwargs)
        if as_tuple and dataclasses.is_dataclass(output) and isinstance(output, dict):
            return output_tuple(output, kept=_kept_fields(model, type(output), given.get("use_cache")))
        return output


def _returns_tuple(model, given, kwargs):
    """Whether a Hugging Face model's forward called with ``given`` arguments returns a tuple: a
    ``return_dict`` given False, else ``config.return_dict`` False (transformers'
    ``can_return_tuple``). A ``return_dict`` passed by position is left to the model (it cannot be
    overridden by name)."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if base is None or not isinstance(model, base):
        return False
    if "return_dict" in given and "return_dict" not in kwargs:
        return False
    return_dict = given.get("return_dict")
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return not return_dict


def _kept_fields(model, output_type, use_cache):
    """The fields of a patched model's output that stock returns and the patched forward may leave
    None, kept in place as None in its tuple: ``logits`` (None under the fused loss, see
    remat.models.causal_lm; stock always computes them) and the KV cache when the stock model would
    build one (its original config's ``use_cache``: the private copy says False, see patch)."""
    kept = ["logits"]
    original = next((config for module, config in model.__dict__.get(_CONFIGS, ()) if module is model), None)
    cache = cache_field(output_type)
    if cache is not None and original is not None and stock_builds_cache(model, original, use_cache):
        kept.append(cache)
    return tuple(kept)


def _install_stock_save(model):
    """Makes ``save_pretrained`` of each module holding a private config (a Hugging Face model and
    its base model) save what the unpatched model saves: a :class:`StockConfigSave`, removed by
    unpatch."""
    for module, _ in model.__dict__.get(_CONFIGS, ()):
        if callable(getattr(module, "save_pretrained", None)) and not isinstance(
                module.__dict__.get("save_pretrained"), StockConfigSave):
            module.save_pretrained = StockConfigSave(module, model)


class StockConfigSave:
    """A patched Hugging Face model's ``save_pretrained``: runs the one it replaced (the class's,
    or an instance attribute set before patching) with the model's original configs put back for
    the call, so config.json holds the model's ``use_cache`` and attention implementation, not
    the private copies' (``use_cache=False``, ``"remat"``; see patch). What the save sets on the
    configs (transformers writes ``dtype`` and ``architectures`` into them, as it does unpatched)
    is set on the private copies too. The weights need nothing: remat's modules share the stock
    parameters under the stock names. An object of a module-level class, so the model pickles;
    ``inspect.signature`` reads the replaced method's (through ``__wrapped__``)."""

    def __init__(self, module, model):
        self.module = module
        self.model = model
        self.previous = module.__dict__.get("save_pretrained")

    @property
    def __wrapped__(self):
        return self.previous if self.previous is not None else type(self.module).save_pretrained.__get__(self.module)

    def __call__(self, *args, **kwargs):
        swapped = self.model.__dict__.get(_CONFIGS, ())
        private = [module.__dict__["config"] for module, _ in swapped]
        before = [dict(original.__dict__) for _, original in swapped]
        for module, original in swapped:
            module.__dict__["config"] = original
        try:
            return self.__wrapped__(*args, **kwargs)
        finally:
            for (module, original), copied, old in zip(swapped, private, before, strict=True):
                module.__dict__["config"] = copied
                copied.__dict__.update({key: value for key, value in original.__dict__.items()
                                        if key not in old or old[key] is not value})


def _remove_stock_save(model):
    for module, _ in model.__dict__.get(_CONFIGS, ()):
        wrapper = module.__dict__.get("save_pretrained")
        if isinstance(wrapper, StockConfigSave):
            del module.save_pretrained
            if wrapper.previous is not None:
                module.save_pretrained = wrapper.previous


def unpatch(model):
    """Restores the modules :func:`patch` replaced (the originals, with their shared parameters),
    the model's ``config.use_cache`` and ``config._attn_implementation``, and its forward (removing
    the mask check).

    Args:
        model: a model :func:`patch` was called on (one it replaced nothing in, unchanged but for a
            mark, is restored by removing the mark); anything else raises ValueError.
    """
    if model.__dict__.pop(_REPLACED_NOTHING, False):
        return
    if not getattr(model, _HOOK, False):
        raise ValueError("model is not patched by remat.patch")
    delattr(model, _HOOK)
    model.__dict__.pop(_SEQUENCE_PARALLEL, None)
    if model.__dict__.pop(_MASK_CHECK, False):
        if isinstance(model.__dict__.get("forward"), MaskCheckedForward):
            del model.forward
            if hasattr(model, _PREVIOUS_FORWARD):
                model.forward = getattr(model, _PREVIOUS_FORWARD)
                delattr(model, _PREVIOUS_FORWARD)
        else:
            # A wrapper installed after patching (TRL's SFTTrainer replaces forward with its fused
            # LM head around the mask check) stays the model's forward; the mask check inside it
            # passes everything through now that the model is unpatched.
            setattr(model, _KEPT_INSIDE_WRAPPER, True)
    _remove_stock_save(model)
    for module, config in model.__dict__.pop(_CONFIGS, ()):
        module.__dict__["config"] = config
    for module in model.modules():
        causal_lm.uninstall(module)
    _remove_checkpoint_counting(model)
    _unpatch_children(model)
    outputs.remove_recorders(model)


def _unpatch_children(parent):
    for name, child in list(parent.named_children()):
        original = child.__dict__.get(_ORIGINAL)
        if original is not None:
            outputs.drop_recorders(child)
            # Adapters added after patching (patch, then get_peft_model) wrap the projections the
            # fused layer shares with the original: move them there, or unpatch would drop them.
            carry_wrappers(child, original)
            _carry_mode(child, original)
            setattr(parent, name, original)
        else:
            _unpatch_children(child)


def _carry_mode(replacement, original):
    """What was set on ``replacement`` while patched and must hold for ``original`` once restored:
    train/eval mode (model.eval() after patching) and Hugging Face's gradient-checkpointing flag and
    function (model.gradient_checkpointing_enable() after patching)."""
    original.train(replacement.training)
    if hasattr(original, "gradient_checkpointing"):
        # Only what was set while patched: an original whose flag nobody set keeps its attributes
        # as they were (unpatch leaves the model's modules as they were before patching).
        flag = replacement.__dict__.get("gradient_checkpointing")
        function = replacement.__dict__.get("_gradient_checkpointing_func",
                                            original.__dict__.get("_gradient_checkpointing_func"))
        if "_gradient_checkpointing_func" in replacement.__dict__:
            original._gradient_checkpointing_func = function
        # A flag remat's planner set (its own checkpointed layers run remat's checkpoint function, a
        # class attribute) is not Hugging Face's: carried to a stock layer without a checkpoint
        # function of its own, the stock layer could not run its next forward.
        if flag is not None and (not flag or function is not None):
            original.gradient_checkpointing = flag


def _install_checkpoint_counting(model):
    """Makes Hugging Face's ``gradient_checkpointing_enable(every_n_layers=k)`` count remat's layers.
    Hugging Face flags every k-th GradientCheckpointingLayer and gives every other module with a
    ``gradient_checkpointing`` attribute the flag outright, which would checkpoint every remat layer;
    the wrapper (a :class:`CountingSetter`) re-flags the decoder layers (remat's and any left stock)
    in module order, as Hugging Face counts them in a stock model. Installed on each module of
    ``model`` that has the setter (new format only), removed by unpatch."""
    for module in model.modules():
        setter = getattr(module, _CHECKPOINT_SETTER, None)
        if setter is None or _CHECKPOINT_SETTER in module.__dict__:
            continue
        if "every_n_layers" not in inspect.signature(setter).parameters:
            continue
        setattr(module, _CHECKPOINT_SETTER, CountingSetter(module))
        setattr(module, _COUNTING, True)


class CountingSetter:
    """A module's ``_set_gradient_checkpointing`` while patched: runs the class's setter, then
    flags every ``every_n_layers``-th decoder layer (remat's and stock ones, in module order) when
    enabling. An object of a module-level class (not a closure), so the model pickles;
    ``inspect.signature`` reads the class's setter (through ``__wrapped__``: Hugging Face reads it
    to tell the setter's format)."""

    def __init__(self, module):
        self.module = module

    @property
    def __wrapped__(self):
        return getattr(type(self.module), _CHECKPOINT_SETTER).__get__(self.module)

    def __call__(self, *args, **kwargs):
        setter = self.__wrapped__
        setter(*args, **kwargs)
        bound = inspect.signature(setter).bind(*args, **kwargs)
        bound.apply_defaults()
        enable, every_n_layers = bound.arguments["enable"], bound.arguments["every_n_layers"]
        from transformers.modeling_layers import GradientCheckpointingLayer

        index = 0
        for layer in self.module.modules():
            if isinstance(layer, (PreNormDecoderLayer, GradientCheckpointingLayer)) and enable:
                layer.gradient_checkpointing = index % every_n_layers == 0
                index += 1


def _remove_checkpoint_counting(model):
    for module in model.modules():
        if module.__dict__.pop(_COUNTING, False):
            delattr(module, _CHECKPOINT_SETTER)
