"""One-call patching of real models: ``remat.patch(model)`` swaps, in place, the submodules remat
has fused versions of, sharing their parameters (no copies; ``state_dict`` unchanged), and
``remat.unpatch(model)`` puts the originals back.

What is replaced:

- Hugging Face Llama, Mistral and Qwen2 decoder layers (``self_attn``, ``mlp``,
  ``input_layernorm``, ``post_attention_layernorm``) and GPT-2 blocks, when ``modules`` has all of
  "norm", "mlp" and "attention": by :class:`remat.nn.LlamaLayer` / :class:`remat.nn.GPT2Layer`
  with the chosen ``policy``.
- Otherwise, one by one: ``torch.nn.RMSNorm``, ``torch.nn.LayerNorm`` and the Llama-family
  RMSNorms ("norm"), the Llama-family MLPs ("mlp") and attention modules ("attention", by an
  adapter with Hugging Face's calling convention, keeping their sliding window and causality).

Only these classes (by name: Llama, Mistral, Qwen2, GPT-2) are replaced; look-alikes whose
computation differs (Qwen3's q/k norms, Cohere's LayerNorm, non-causal vision attention) are left
as they are. Replacements keep the originals' train/eval mode.

Hugging Face masks: remat's kernels do causal (and sliding-window) attention, not arbitrary masks.
A patched model checks the ``attention_mask`` it is called with: rows that are all ones, or ones
followed by zeros (right padding), are accepted, because under a causal mask a real token never
sees a later pad token; padded positions then attend causally to the pad tokens before them, so
their outputs (which a loss with label -100 at pads ignores) differ from the stock model's.
Left padding or other masks raise ValueError. A patched model is for training: it sets
``config.use_cache = False`` (restored by unpatch), and a KV cache raises ValueError.
"""

import functools
import inspect
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from remat import nn as remat_nn

MODULE_KINDS = ("norm", "mlp", "attention")
_ORIGINAL = "_remat_original"
_HOOK = "_remat_patched"
_USE_CACHE = "_remat_saved_use_cache"
_PREVIOUS_FORWARD = "_remat_previous_forward"

# Hugging Face classes whose computation remat's modules reproduce exactly; others with similar
# attribute names (Qwen3's q/k norms, Cohere's mean-centred norm, non-causal vision attention)
# are not replaced.
_LLAMA_FAMILY = ("Llama", "Mistral", "Qwen2")
_HF_LAYERS = tuple(f"{family}DecoderLayer" for family in _LLAMA_FAMILY)
_HF_ATTENTIONS = tuple(f"{family}Attention" for family in _LLAMA_FAMILY)
_HF_MLPS = tuple(f"{family}MLP" for family in _LLAMA_FAMILY)
_HF_RMS_NORMS = tuple(f"{family}RMSNorm" for family in _LLAMA_FAMILY)


@dataclass
class PatchReport:
    """What :func:`patch` did: ``replaced`` holds (qualified name, original type, remat type),
    ``left_alone`` (qualified name, type, reason) for modules of a kind it was asked for but
    could not take."""

    replaced: list = field(default_factory=list)
    left_alone: list = field(default_factory=list)

    def __str__(self):
        lines = [f"remat.patch: replaced {len(self.replaced)} modules, left {len(self.left_alone)} alone"]
        lines += [f"  {name}: {old} -> {new}" for name, old, new in self.replaced]
        lines += [f"  {name}: {kind} left alone ({why})" for name, kind, why in self.left_alone]
        return "\n".join(lines)


class HFAttention(remat_nn.Attention):
    """remat.nn.Attention with Hugging Face's attention calling convention:
    ``forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs) ->
    (output, None)``. The mask is checked at the model (see remat.patch)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        remat_nn.refuse_kv_cache(kwargs)
        return super().forward(hidden_states, position_embeddings=position_embeddings), None


class HFGPT2Layer(remat_nn.GPT2Layer):
    """remat.nn.GPT2Layer taking a Hugging Face GPT2Block's arguments (the 4-D mask is not read;
    remat.patch has checked the model's 2-D mask)."""

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None, **kwargs):
        remat_nn.refuse_kv_cache(dict(kwargs, cache=cache))
        if encoder_hidden_states is not None:
            raise ValueError("remat's GPT2Layer has no cross-attention (encoder_hidden_states)")
        return super().forward(hidden_states)


class HFLlamaLayer(remat_nn.LlamaLayer):
    """remat.nn.LlamaLayer taking a Hugging Face decoder layer's arguments; the 4-D mask the model
    builds is not read (remat.patch has checked the model's 2-D mask)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        remat_nn.refuse_kv_cache(kwargs)
        return super().forward(hidden_states, position_ids=position_ids, position_embeddings=position_embeddings)


def _kind_of(module):
    """"norm", "mlp", "attention", "llama_layer", "gpt2_block" or None (not a class remat takes)."""
    name = type(module).__name__
    if type(module) in (nn.RMSNorm, nn.LayerNorm) or (name in _HF_RMS_NORMS and remat_nn.is_hf_rms_norm(module)):
        return "norm"
    if name in _HF_MLPS:
        return "mlp"
    if name in _HF_ATTENTIONS:
        return "attention"
    if name in _HF_LAYERS:
        return "llama_layer"
    if name == "GPT2Block":
        return "gpt2_block"
    return None


def patch(model, *, policy="balanced", modules=MODULE_KINDS, backend=None):
    """Replaces, in place, the submodules of ``model`` that remat has fused versions of (see the
    module docstring), keeping their parameters, and returns a :class:`PatchReport`.

    Args:
        model: an ``nn.Module``: a Hugging Face Llama / Mistral / Qwen2 model (built from a config
            or loaded from a checkpoint), or any PyTorch model with ``torch.nn.RMSNorm`` /
            ``LayerNorm`` layers.
        policy: ``"speed"``, ``"balanced"`` (default) or ``"memory"``: what whole decoder layers
            keep for backward (see remat.nn.LlamaLayer).
        modules: which kinds to replace, a subset of ``("norm", "mlp", "attention")``.
        backend: remat backend for the new modules, or None for the default choice.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    modules = tuple(modules)
    unknown = [m for m in modules if m not in MODULE_KINDS]
    if unknown or not modules:
        raise ValueError(f"modules must be a non-empty subset of {MODULE_KINDS}, got {modules!r}")
    if policy not in remat_nn.LAYER_POLICIES:
        raise ValueError(f"policy must be one of {remat_nn.LAYER_POLICIES}, got {policy!r}")
    if getattr(model, _HOOK, False):
        raise ValueError("model is already patched; call remat.unpatch(model) first")
    report = PatchReport()
    whole_layers = set(MODULE_KINDS) <= set(modules)
    _patch_children(model, "", modules, whole_layers, policy, backend, report)
    if not report.replaced:
        return report
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        setattr(model, _USE_CACHE, config.use_cache)
        config.use_cache = False
    setattr(model, _HOOK, True)
    _install_mask_check(model)
    return report


def _patch_children(parent, prefix, modules, whole_layers, policy, backend, report):
    for name, child in list(parent.named_children()):
        qualified = f"{prefix}{name}"
        kind = _kind_of(child)
        if kind in ("llama_layer", "gpt2_block") and not whole_layers:
            kind = None
        if type(child).__name__ in ("GPT2Attention", "GPT2MLP") and ("attention" in modules or "mlp" in modules):
            report.left_alone.append((qualified, type(child).__name__, "GPT-2's attention and MLP are replaced "
                                      "only as whole blocks: pass all of modules=('norm', 'mlp', 'attention')"))
            continue
        replacement = None
        if kind is not None and (kind in modules or kind in ("llama_layer", "gpt2_block")):
            try:
                replacement = _replacement(child, kind, policy, backend)
            except (TypeError, ValueError) as error:
                report.left_alone.append((qualified, type(child).__name__, str(error)))
                continue
        if replacement is not None:
            replacement.train(child.training)
            object.__setattr__(replacement, _ORIGINAL, child)
            setattr(parent, name, replacement)
            report.replaced.append((qualified, type(child).__name__, type(replacement).__name__))
        else:
            _patch_children(child, f"{qualified}.", modules, whole_layers, policy, backend, report)


def _replacement(child, kind, policy, backend):
    if kind == "llama_layer":
        return HFLlamaLayer.from_module(child, policy=policy, backend=backend)
    if kind == "gpt2_block":
        return HFGPT2Layer.from_module(child, policy=policy, backend=backend)
    if kind == "norm":
        if isinstance(child, nn.LayerNorm):
            return remat_nn.LayerNorm.from_module(child, backend=backend)
        return remat_nn.RMSNorm.from_module(child, backend=backend)
    if kind == "mlp":
        return remat_nn.SwiGLUMLP.from_module(child, backend=backend)
    return HFAttention.from_module(child, backend=backend)


def _install_mask_check(model):
    """Makes model's forward check its attention_mask first. The wrapper is a method bound to the
    model (so deepcopy binds it to the copy), keeps the wrapped forward's signature (Hugging Face's
    Trainer reads it), and finds the mask whether passed by name or position. torch.compile traces
    the check into the model's graph (a forward pre-hook would be a separate graph)."""
    previous = model.__dict__.get("forward")
    stock_forward = type(model).forward
    signature = inspect.signature(stock_forward)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(stock_forward)
    def checked_forward(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        mask = bound.get("attention_mask")
        if mask is None and var_keyword is not None:
            mask = bound.get(var_keyword, {}).get("attention_mask")
        _check_attention_mask(mask)
        # Looked up on the bound model at call time, so a deepcopy calls its own copy.
        inner = self.__dict__.get(_PREVIOUS_FORWARD)
        if inner is not None:
            return inner(*args, **kwargs)
        return stock_forward(self, *args, **kwargs)

    if previous is not None:
        setattr(model, _PREVIOUS_FORWARD, previous)
    model.forward = types.MethodType(checked_forward, model)


def _check_attention_mask(mask):
    """A patched model's 2-D attention mask must be causal-compatible (None or right padding)."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return None
    if mask.dim() != 2:
        raise ValueError(f"a remat-patched model takes a 2-D [B, N] attention_mask (ones, then zeros for right "
                         f"padding), got shape {tuple(mask.shape)}")
    ones = mask.to(torch.bool)
    # Right padding: along each row, once a position is 0 every later one is too.
    pad_before_token = (ones[:, 1:] & ~ones[:, :-1]).any()
    message = ("remat's attention supports causal masks with right padding only; this attention_mask has a pad "
               "before a real token (left padding or holes); pad on the right (tokenizer.padding_side = 'right') "
               "or call remat.unpatch(model)")
    if torch.compiler.is_compiling():
        # Inside a compiled graph a Python branch on tensor data would break the graph; the check
        # becomes an assertion op in the graph instead.
        torch._assert_async(~pad_before_token, message)
    elif bool(pad_before_token):
        raise ValueError(message)
    return None


def unpatch(model):
    """Restores the modules :func:`patch` replaced (the originals, with their shared parameters),
    the model's ``config.use_cache`` and its forward (removing the mask check).

    Args:
        model: a model :func:`patch` returned a report for; anything else raises ValueError.
    """
    if not getattr(model, _HOOK, False):
        raise ValueError("model is not patched by remat.patch")
    delattr(model, _HOOK)
    del model.forward
    if hasattr(model, _PREVIOUS_FORWARD):
        model.forward = getattr(model, _PREVIOUS_FORWARD)
        delattr(model, _PREVIOUS_FORWARD)
    if hasattr(model, _USE_CACHE):
        model.config.use_cache = getattr(model, _USE_CACHE)
        delattr(model, _USE_CACHE)
    _unpatch_children(model)


def _unpatch_children(parent):
    for name, child in list(parent.named_children()):
        original = child.__dict__.get(_ORIGINAL)
        if original is not None:
            setattr(parent, name, original)
        else:
            _unpatch_children(child)
