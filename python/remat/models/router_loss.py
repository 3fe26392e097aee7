"""The load-balancing term of Hugging Face's mixture-of-experts causal LMs (Mixtral, Qwen3-MoE),
for remat's fused loss (remat.models.causal_lm).

Stock (``MixtralForCausalLM.forward``, ``Qwen3MoeForCausalLM.forward``, transformers 5.24): with
``output_router_logits`` (the call's argument, else ``config.output_router_logits``), the base
model returns every sparse layer's router logits, ``aux_loss = load_balancing_loss_func(
router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)`` (the function of the
model's own modeling module), and with labels the loss becomes ``loss + model.router_aux_loss_coef
* aux_loss``. :func:`term` computes the same from the base model's output, so a fused loss keeps
the term; :func:`refusal` says when a model lacks what that needs.
"""

import inspect

REQUIRED_ATTRIBUTES = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")


def _stock_function(model, class_names):
    """``load_balancing_loss_func`` of the modeling module of the class in ``model``'s MRO that
    ``class_names`` lists (FSDP2 swaps in a subclass defined elsewhere), or None."""
    for cls in type(model).__mro__:
        if cls.__name__ in class_names:
            return getattr(inspect.getmodule(cls), "load_balancing_loss_func", None)
    return None


def refusal(model, class_names):
    """Why the fused loss cannot add ``model``'s load-balancing term as stock does, or None."""
    if _stock_function(model, class_names) is None:
        return f"{type(model).__name__}'s modeling module has no load_balancing_loss_func"
    missing = [name for name in REQUIRED_ATTRIBUTES if not hasattr(model, name)]
    if missing:
        return f"{type(model).__name__} has no {', '.join(missing)} (needed for its load-balancing loss)"
    return None


def term(model, class_names, arguments, outputs):
    """(the term to add to the loss, {output field: value}) for one training forward: (None, {})
    without ``output_router_logits``; else ``router_aux_loss_coef * aux_loss`` and
    ``{"aux_loss": aux_loss}`` (the router logits pass through with the base model's fields).

    Args:
        model: the causal LM (:func:`refusal` returned None for it).
        class_names: the family's causal LM class names.
        arguments: the forward's bound arguments (``output_router_logits``, ``attention_mask``).
        outputs: the base model's output (its ``router_logits``).
    """
    wanted = arguments.get("output_router_logits")
    if wanted is None:
        wanted = getattr(model.config, "output_router_logits", False)
    if not wanted:
        return None, {}
    aux_loss = _stock_function(model, class_names)(outputs.router_logits, model.num_experts,
                                                   model.num_experts_per_tok, arguments.get("attention_mask"))
    return model.router_aux_loss_coef * aux_loss, {"aux_loss": aux_loss}
