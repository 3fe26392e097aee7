"""Hugging Face glue shared by the model families: recognising HF modules, reading their configs
(rope type, sliding window), refusing KV caches, and the padding-mask check a patched model runs.

Facts these rely on (transformers 5.24, see shared/notes/hf_integration.md): decoder layers get
the model's 4-D mask and ``position_embeddings=(cos, sin)`` from the model's rotary module; a
layer's ``self_attn.layer_idx`` indexes ``config.layer_types``.
"""

import torch
from torch import nn


def is_hf_rms_norm(module):
    """A Hugging Face RMSNorm: a 1-D ``weight`` and ``variance_epsilon`` (LlamaRMSNorm and kin)."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 1 and hasattr(module, "variance_epsilon")


def refuse_kv_cache(kwargs):
    """remat's layers are for training: a KV cache among Hugging Face's call arguments raises."""
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        raise ValueError("remat's layers are for training: a KV cache (use_cache, past_key_values) is not "
                         "supported; call remat.unpatch(model) before generating")


def rope_type_of(config):
    """"default" for plain rotary embedding, else the config's rope_type (llama3, yarn, ...)."""
    for source in (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)):
        if isinstance(source, dict) and source.get("rope_type", source.get("type", "default")) != "default":
            return source.get("rope_type", source.get("type"))
    return "default"


def sliding_window_of(stock, config):
    """(window - 1, None) for a Hugging Face attention whose layer uses sliding-window attention
    (Mistral: keys within the last ``sliding_window`` positions), else None."""
    window = getattr(config, "sliding_window", None) if config is not None else None
    if window is None or not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(stock, "layer_idx", None)
    if layer_types is not None and layer_idx is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return (int(window) - 1, None)


def check_attention_mask(mask):
    """A patched model's 2-D attention mask must be causal-compatible: None, all ones, or ones
    followed by zeros along each row (right padding). Anything else raises ValueError (inside a
    compiled graph: an assertion op in the graph)."""
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
