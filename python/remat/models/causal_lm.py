"""The output block of Hugging Face causal LMs: a patched ``*ForCausalLM`` (or GPT-2's
``LMHeadModel``) computes its training loss with :func:`remat.linear_cross_entropy`, so the
``[tokens, vocab]`` logits are never materialised, the largest tensor of a training step with a
large vocabulary.

When it applies: the model is in training mode and ``labels`` are given (as in stock, a
``shift_labels`` keyword then replaces the shifted labels).
Then the forward runs the base model, and the loss is HF's ``ForCausalLMLoss`` computed fused:
labels shifted left by one (or ``shift_labels`` as given), ``ignore_index=-100``, mean over the
non-ignored tokens, or the sum divided by ``num_items_in_batch`` when the Trainer passes it (for
gradient accumulation); Gemma 2's ``config.final_logit_softcapping`` becomes the fused cap; a tied
``lm_head`` (the embedding Parameter) is used as it is. The output's ``logits`` is None (as
Liger-Kernel returns): ask for logits with a forward without labels, or in eval mode, where the
model runs as stock. Everything else the base model returns (hidden states, attentions) passes
through. With ``return_dict=False`` (or ``config.return_dict`` False) the tuple keeps stock's
positions: loss, None in the logits' place, then the base model's fields
(remat.hf.output_tuple).

Only the causal LM classes a family lists (``Family.causal_lms``: whose forward is the plain
``lm_head`` + loss) are taken. Mixture-of-experts causal LMs (Mixtral, Qwen3-MoE) add their
load-balancing loss with ``output_router_logits`` as stock does (remat.models.router_loss): the
output then carries ``aux_loss`` and ``router_logits``. Refused at patch time (left alone, with the reason in the patch
report): an unlisted class, an ``lm_head`` that is not
a plain ``nn.Linear`` (a LoRA adapter on it, a quantized layer: its term would be silently
dropped), an ``lm_head`` of a dtype remat's kernels do not run (float64), a model with its own
``loss_function`` or a ``loss_type`` other than ForCausalLM. An
adapter put on ``lm_head`` after patching raises ValueError at the next training forward, never
ignored.
"""

import inspect

import torch
from torch import nn

from remat import checks
from remat.functional.cross_entropy import linear_cross_entropy
from remat.hf import ModelForward, output_tuple
from remat.models import registry, router_loss

LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_STOCK_FORWARD = "_remat_loss_previous_forward"
_KEPT_INSIDE_WRAPPER = "_remat_fused_loss_inside_wrapper"
_INSTALLED = "_remat_fused_loss"
# remat.patch(tile_tokens=T) on the causal LM: the fused loss runs over tiles of T tokens.
_TILE_TOKENS = "_remat_loss_tile_tokens"
# Arguments of the causal LM's forward that are its own, not the base model's.
_LOSS_ARGUMENTS = ("labels", "shift_labels", "logits_to_keep", "num_items_in_batch", "ignore_index")


def is_causal_lm(module):
    """A Hugging Face causal LM head model: its class name ends in ForCausalLM or LMHeadModel and it
    has an ``lm_head``."""
    return type(module).__name__.endswith(LM_SUFFIXES) and hasattr(module, "lm_head")


def refusal(module):
    """Why the fused loss cannot replace this causal LM's loss, or None."""
    if registry.causal_lm_family(module) is None:
        return (f"{type(module).__name__} is not a causal LM of a family remat knows (its forward may change the "
                "logits before the loss); its loss stays stock")
    head = module.lm_head
    if type(head) is not nn.Linear:
        return (f"lm_head is a {type(head).__name__}, not a plain nn.Linear (an adapter or quantized "
                "layer); its loss stays stock, since the fused loss would drop its extra terms")
    if head._forward_pre_hooks or head._forward_hooks or hasattr(head, "_hf_hook"):
        return ("lm_head has forward hooks (accelerate's device placement or offload, a sharding wrapper, ...), "
                "which the fused loss would skip, since it reads lm_head.weight directly; its loss stays stock")
    if head.weight.device.type == "meta":
        return "lm_head's weight is on the meta device (offloaded); its loss stays stock"
    if head.weight.dtype not in checks.SUPPORTED_DTYPES:
        return f"lm_head's weight is {head.weight.dtype}; remat's fused loss runs float32, float16 and bfloat16"
    if "_loss_function" in module.__dict__:
        return "the model has its own loss_function"
    loss_type = getattr(module, "loss_type", None)
    if loss_type not in (None, "ForCausalLM"):
        return f"the model's loss_type is {loss_type!r}, not ForCausalLM"
    if getattr(module, "base_model", None) is None or module.base_model is module:
        return "no base model to run under the lm_head"
    family = registry.causal_lm_family_entry(module)
    if family.router_loss:
        return router_loss.refusal(module, family.causal_lms)
    return None


def install(module):
    """Makes ``module`` (a causal LM that :func:`refusal` accepts) compute its training loss fused:
    its forward becomes a :class:`FusedLossForward` (with the stock forward's signature, so Trainer
    and PEFT see the arguments they expect); :func:`uninstall` restores the previous forward."""
    FusedLossForward.install(module, _STOCK_FORWARD, _INSTALLED)


class FusedLossForward(ModelForward):
    """The forward :func:`install` gives a causal LM: in training mode with ``labels``, the fused
    loss; otherwise the forward it replaced (pickling and the signature: remat.hf.ModelForward)."""

    def _bind(self):
        super()._bind()
        output_type = self.signature.return_annotation
        if isinstance(output_type, str):  # postponed annotations: the name in the model's module
            output_type = type(self.model).forward.__globals__.get(output_type)
        self.output_type = output_type

    def __call__(self, *args, **kwargs):
        model = self.model
        arguments = self.arguments(args, kwargs)
        # Stock once uninstalled, if a wrapper installed later (TRL's SFTTrainer) keeps calling it.
        if not (model.__dict__.get(_INSTALLED) and model.training and arguments.get("labels") is not None):
            inner = model.__dict__.get(_STOCK_FORWARD)
            return inner(*args, **kwargs) if inner is not None else type(model).forward(model, *args, **kwargs)
        return _fused_loss_forward(model, self.output_type, arguments)


def set_tile_tokens(model, tile_tokens):
    """Sets the token tile (None: untiled) of every fused-loss causal LM in ``model``; returns how
    many there are."""
    count = 0
    for module in model.modules():
        if module.__dict__.get(_INSTALLED):
            if tile_tokens:
                setattr(module, _TILE_TOKENS, tile_tokens)  # an int, or "auto" (resolved per call)
            elif _TILE_TOKENS in module.__dict__:
                delattr(module, _TILE_TOKENS)
            count += 1
    return count


def uninstall(module):
    """Restores the forward :func:`install` replaced. A forward wrapped around it later (TRL's
    SFTTrainer installs its fused LM head so) stays in place; the fused-loss forward inside it then
    runs the stock forward."""
    if not module.__dict__.get(_INSTALLED):
        return
    delattr(module, _INSTALLED)
    if _TILE_TOKENS in module.__dict__:
        delattr(module, _TILE_TOKENS)
    if not isinstance(module.__dict__.get("forward"), FusedLossForward):
        setattr(module, _KEPT_INSIDE_WRAPPER, True)
        return
    del module.forward
    previous = module.__dict__.get(_STOCK_FORWARD)
    if previous is not None:
        module.forward = previous
        delattr(module, _STOCK_FORWARD)


def wrapped_after_uninstall(model):
    """Whether a module of ``model`` still runs an uninstalled fused-loss forward inside a wrapper
    installed after it (see :func:`uninstall`); installing again would make the two call each other."""
    return any(module.__dict__.get(_KEPT_INSIDE_WRAPPER) for module in model.modules())


def _fused_loss_forward(model, output_type, arguments):
    reason = refusal(model)
    if reason is not None:
        raise ValueError(f"remat's fused loss cannot train this model: {reason}; call remat.unpatch(model) "
                         "and patch again (the loss then stays stock)")
    labels, shift_labels = arguments.get("labels"), arguments.get("shift_labels")
    num_items = arguments.get("num_items_in_batch")
    ignore_index = arguments.get("ignore_index", -100)
    return_dict = arguments.get("return_dict")
    if return_dict is None:  # as transformers' can_return_tuple resolves it
        return_dict = getattr(model.config, "return_dict", True)
    # The base model returns its output object (its fields by name below), whatever the caller asked.
    base_arguments = {k: v for k, v in arguments.items() if k not in _LOSS_ARGUMENTS}
    base_arguments["return_dict"] = True
    outputs = model.base_model(**base_arguments)
    hidden = outputs.last_hidden_state
    if shift_labels is None:
        # HF's ForCausalLMLoss: the token at position i predicts the label at i + 1.
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    lm_head = model.lm_head
    softcap = getattr(model.config, "final_logit_softcapping", None) or None
    reduction = "sum" if num_items is not None else "mean"
    loss = linear_cross_entropy(hidden, lm_head.weight, shift_labels, lm_head.bias, ignore_index=ignore_index,
                                reduction=reduction, softcap=softcap, tile_tokens=model.__dict__.get(_TILE_TOKENS))
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    fields = {"loss": loss, "logits": None}
    family = registry.causal_lm_family_entry(model)
    if family.router_loss:  # Mixtral, Qwen3-MoE: stock's load-balancing term, as stock adds it
        extra, extra_fields = router_loss.term(model, family.causal_lms, arguments, outputs)
        if extra is not None:
            fields["loss"] = loss + extra.to(loss.device)
        fields.update(extra_fields)
    if not isinstance(output_type, type):
        raise TypeError(f"{type(model).__name__}.forward declares no output class to build")
    # Every field of the stock output class that the base model returned (cache, hidden states,
    # attentions, router logits, ...), by the class's own field names.
    for name in inspect.signature(output_type).parameters:
        if name not in fields and isinstance(outputs, dict) and name in outputs:
            fields[name] = outputs[name]
    output = output_type(**fields)
    if not return_dict:
        # Stock's positions: loss, then logits (None here), then the base model's fields.
        return output_tuple(output, kept=("logits",))
    return output
