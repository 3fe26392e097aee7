"""The model-family table that remat.patch reads. A family module (remat.models.<family>) declares
one :class:`Family`: the Hugging Face decoder-layer classes it replaces whole, the fused layer
that replaces them, and the modules it can replace one by one (:class:`Part`). Adding a family is
one module and one entry in :data:`FAMILY_MODULES`; patch.py does not change."""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

# The family modules, in lookup order.
FAMILY_MODULES = ("remat.models.llama", "remat.models.gpt2", "remat.models.qwen3", "remat.models.phi3",
                  "remat.models.gemma",
                  "remat.models.mixtral",
                  "remat.models.qwen3_moe",
                  "remat.models.torch_norms")

PART_KINDS = ("norm", "mlp", "attention")


class Part(NamedTuple):
    """A module a family replaces on its own. kind: one of :data:`PART_KINDS`. classes: class
    names (Hugging Face's, matched by name so remat imports no model code) or types (matched
    exactly, no subclasses). build: ``build(stock, *, backend) -> module``. accepts: an extra
    predicate on the instance."""

    kind: str
    classes: tuple
    build: Callable
    accepts: Callable = None

    def matches(self, module):
        cls = type(module)
        if cls not in self.classes and cls.__name__ not in self.classes:
            return False
        return self.accepts is None or self.accepts(module)


@dataclass(frozen=True)
class Family:
    """A model family: ``layer_classes`` (decoder-layer class names) are replaced whole by
    ``build_layer(stock, *, policy, backend)``; ``parts`` one by one; ``whole_only`` names classes
    replaced only inside a whole layer (left alone, with ``whole_only_reason``, when the user asks
    for parts). ``causal_lms`` names the family's causal LM classes whose forward is the plain
    ``lm_head`` + ForCausalLM loss (optionally Gemma's ``config.final_logit_softcapping``), whose
    training loss remat.models.causal_lm may compute fused; a class that changes the logits
    otherwise (Cohere's logit_scale, Granite's logits_scaling) must not be listed.
    ``router_loss``: the causal LMs add Hugging Face's load-balancing loss with
    ``output_router_logits`` (remat.models.router_loss), which the fused loss then adds too."""

    name: str
    layer_classes: tuple = ()
    build_layer: Callable = None
    parts: tuple = ()
    whole_only: tuple = ()
    whole_only_reason: str = ""
    causal_lms: tuple = ()
    router_loss: bool = False


class Match(NamedTuple):
    """What the table says of one module: kind "layer", a part kind, or "whole_only"; build is
    the replacement's constructor (None for "whole_only"); reason says why it is left alone."""

    kind: str
    family: str
    build: Callable = None
    reason: str = ""


_FAMILIES = []


def families():
    """The registered :class:`Family` entries, importing the family modules on first use."""
    if not _FAMILIES:
        _FAMILIES.extend(importlib.import_module(name).FAMILY for name in FAMILY_MODULES)
    return tuple(_FAMILIES)


def describe():
    """The families in words, for messages: each family's name and the classes it replaces whole
    (or, for a family of parts only, the classes of its parts)."""
    described = []
    for family in families():
        classes = family.layer_classes or tuple(dict.fromkeys(
            name if isinstance(name, str) else name.__name__ for part in family.parts for name in part.classes))
        described.append(f"{family.name} ({', '.join(classes)})")
    return "; ".join(described)


def causal_lm_family(module):
    """The name of the family that lists ``module``'s class (or a base class of it: FSDP2's
    fully_shard swaps in a subclass) among its causal LMs, or None."""
    family = causal_lm_family_entry(module)
    return None if family is None else family.name


def causal_lm_family_entry(module):
    """The :class:`Family` that lists ``module``'s class (or a base class of it) among its causal
    LMs, or None."""
    names = {cls.__name__ for cls in type(module).__mro__}
    return next((family for family in families() if names & set(family.causal_lms)), None)


def match(module):
    """The :class:`Match` for ``module``, or None when no family takes its class."""
    name = type(module).__name__
    for family in families():
        if name in family.layer_classes:
            return Match("layer", family.name, family.build_layer)
        if name in family.whole_only:
            return Match("whole_only", family.name, reason=family.whole_only_reason)
        for part in family.parts:
            if part.matches(module):
                return Match(part.kind, family.name, part.build)
    return None
