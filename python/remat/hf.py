"""Hugging Face glue shared by the model families: recognising HF modules, reading their configs
(rope type, sliding window), the mask check a patched model runs, and remat's attention registered
with transformers as the attention implementation ``"remat"`` (:func:`register_attention`).

Facts these rely on (transformers 5.24, see shared/notes/hf_integration.md): a model builds one
mask for its layers with the mask function registered under ``config._attn_implementation``
(``AttentionMaskInterface``) and its attention modules call the attention function registered
under the same name (``AttentionInterface``), with q ``[B, Hq, S, D]`` and k/v ``[B, Hkv, K, D]``
after rope and the KV cache; decoder layers get ``position_embeddings=(cos, sin)`` from the
model's rotary module; a layer's ``self_attn.layer_idx`` indexes ``config.layer_types``.
"""

import dataclasses
import functools
import inspect

import torch
from torch import nn

from remat import functional
from remat.checks import values_unknown
from remat.sequences import OFFSET_ARGUMENTS, refuse_offsets_with_padding, sequence_layout


def is_hf_rms_norm(module):
    """A Hugging Face RMSNorm: a 1-D ``weight`` and ``variance_epsilon`` (LlamaRMSNorm and kin)."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 1 and hasattr(module, "variance_epsilon")


ATTENTION_IMPLEMENTATION = "remat"


def register_attention():
    """Registers :func:`hf_attention` and :func:`padding_mask` with transformers under the name
    ``"remat"`` (idempotent). remat.patch calls it and sets a patched model's
    ``config._attn_implementation`` to that name, so that the model builds the 2-D padding mask
    its layers take, and so that a stock attention module (one running with a KV cache, see
    :func:`run_stock_layer`) attends through remat's kernels."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, hf_attention)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, padding_mask)


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 **kwargs):
    """The mask a patched model gives its layers (transformers' mask-function signature): None when
    no key is padding, else the 2-D bool padding mask ``[B, kv_length]`` (True: a real token), its
    last ``kv_length`` columns (a sliding-window cache keeps the last keys only). The causal and
    sliding-window structure is the layers' own; packed rows are found from ``position_ids`` by the
    layers (remat.sequences.sequence_layout). Under torch.compile the mask is returned whenever
    one is given (testing it for padding would read it on the host).

    ``mask_function`` is transformers' mask rule for the layer; remat's layers run causal
    attention with the family's sliding window and split packed rows themselves, so only
    transformers' causal rule, its sliding-window rule and (without ``attention_mask``) their
    packed-sequence combination are accepted; any other rule (a prefix-LM or image block from
    ``block_sequence_ids`` / ``token_type_ids``, an ``or_mask_function`` / ``and_mask_function``
    of the model, a bidirectional or chunked mask) raises ValueError rather than being dropped."""
    refuse_mask_rule(mask_function, packed_allowed=attention_mask is None)
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if values_unknown(attention_mask) or attention_mask.shape[1] != kv_length or not bool(attention_mask.all()):
        return attention_mask
    return None


def _closure(function):
    """The free variables of a closure: ``{name: value}``."""
    cells = getattr(function, "__closure__", None) or ()
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in cells), strict=True))


def _rule_codes():
    """The code objects of the closures transformers' mask-rule factories return (compared by
    identity: under torch.compile a nested function's ``__qualname__`` reads as None, its
    ``__code__`` does not)."""
    from transformers import masking_utils as rules

    # remap_positions_for_packed_sequence is newer than transformers 5.17, whose packed rule
    # combines the causal rule itself with the packed-sequence rule (remapped: None there).
    remap = getattr(rules, "remap_positions_for_packed_sequence", None)
    return dict(and_masks=rules.and_masks(rules.causal_mask_function).__code__,
                sliding=rules.sliding_window_overlay(1).__code__,
                packed=rules.packed_sequence_mask_function(None).__code__,
                remapped=None if remap is None else remap(rules.causal_mask_function, None).__code__)


def _is_causal_rule(function, codes):
    """Whether ``function`` is transformers' causal mask rule, or the causal rule and a
    sliding-window overlay combined by ``and_masks`` (either order: transformers builds both,
    create_sliding_window_causal_mask and create_causal_mask(and_mask_function=...))."""
    from transformers import masking_utils

    if function is masking_utils.causal_mask_function:
        return True
    if getattr(function, "__code__", None) is not codes["and_masks"]:
        return False
    parts = _closure(function).get("mask_functions", ())
    overlays = [part for part in parts if getattr(part, "__code__", None) is codes["sliding"]]
    return len(parts) == 2 and masking_utils.causal_mask_function in parts and len(overlays) == 1


def _is_packed_rule(function, codes):
    """transformers' packed-sequence combination of a causal rule: ``and_masks(remap_positions(causal
    rule), packed_sequence_mask_function(...))``, or ``and_masks(causal rule, packed_sequence_mask_function(...))``
    in transformers versions without ``remap_positions_for_packed_sequence`` (5.17)."""
    if getattr(function, "__code__", None) is not codes["and_masks"]:
        return False
    parts = _closure(function).get("mask_functions", ())
    if len(parts) != 2 or getattr(parts[1], "__code__", None) is not codes["packed"]:
        return False
    if codes["remapped"] is None:
        return _is_causal_rule(parts[0], codes)
    return (getattr(parts[0], "__code__", None) is codes["remapped"]
            and _is_causal_rule(_closure(parts[0]).get("mask_function"), codes))


def refuse_mask_rule(mask_function, packed_allowed):
    """Raises ValueError unless ``mask_function`` (what transformers passes a mask interface) is
    None, transformers' causal rule, its sliding-window causal rule, or (``packed_allowed``: no
    padding mask) their packed-sequence combination; see :func:`padding_mask`."""
    if mask_function is None:
        return
    codes = _rule_codes()
    if _is_causal_rule(mask_function, codes) or (packed_allowed and _is_packed_rule(mask_function, codes)):
        return
    name = getattr(getattr(mask_function, "__code__", None), "co_name", type(mask_function).__name__)
    raise ValueError("a remat-patched model runs causal attention (with the family's sliding window, and packed "
                     "rows from position_ids or cu_seq_lens_q/k); the model asked for another mask rule "
                     f"({name}: a prefix-LM or image block from "
                     "token_type_ids / block_sequence_ids, an or_mask_function / and_mask_function, a bidirectional "
                     "or chunked mask), which remat does not support; call remat.unpatch(model) for this model")


def hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                 softcap=None, **kwargs):
    """remat.attention with transformers' attention-function signature, for stock attention modules
    of a patched model (those that run with a KV cache).

    Args:
        module: the calling attention module (its ``is_causal``, default True, is read).
        query: ``[B, Hq, S, D]``; key, value: ``[B, Hkv, K, D]`` after rope and the cache, not
            repeated for GQA; the S queries are the last S of the K key positions.
        attention_mask: None or the 2-D ``[B, K]`` padding mask of :func:`padding_mask`. With
            padding, the real tokens of each row are packed and attend as one variable-length
            sequence per row (pad keys are never seen; pad queries give 0). Without a mask and a
            cache (S = K), rows whose ``position_ids`` restart, or Hugging Face's
            ``cu_seq_lens_q/k`` arguments, split into documents that attend only within
            themselves (remat.sequences.sequence_layout).
        dropout: probability; scaling: logit scale (default 1/sqrt(D)); sliding_window: the
            layer's window W (keys within the last W positions, self included) or None; softcap:
            Gemma 2's logit cap or None. Other keyword arguments are ignored.

    Returns:
        ``(out [B, S, Hq, D], None)``: causal attention aligned bottom-right (the last query with
        the last key); no probabilities.
    """
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        raise ValueError("remat's attention takes a 2-D [B, K] padding mask or None; got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    if any(kwargs.get(name) is not None for name in ("cu_seq_lens_q", "cu_seq_lens_k")):
        refuse_offsets_with_padding(attention_mask)
    options = dict(causal=bool(getattr(module, "is_causal", True)), scale=scaling, dropout_p=float(dropout or 0.0),
                   window=None if not sliding_window else (int(sliding_window) - 1, None), softcap=softcap or None)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, length, heads, D]
    if attention_mask is None:
        if q.shape[1] == k.shape[1]:  # no cache: packed rows are found as the fused layers find them
            batch, n = q.shape[:2]
            layout = sequence_layout(batch, n, None, kwargs.get("position_ids"),
                                     **{name: kwargs.get(name) for name in OFFSET_ARGUMENTS})
            if layout is not None:
                packed = {"cu_seqlens_q": layout.cu_seqlens, "cu_seqlens_k": layout.cu_seqlens,
                          "max_seqlen_q": layout.max_seqlen, "max_seqlen_k": layout.max_seqlen}
                rows = (t.reshape(batch * n, *t.shape[2:]) for t in (q, k, v))
                out = functional.attention(*rows, **packed, **options)
                return out.view(q.shape), None
        return functional.attention(q, k, v, **options), None
    real_keys = attention_mask.to(device=q.device, dtype=torch.bool)
    real_queries = real_keys[:, -q.shape[1]:]
    cu_seqlens_q, cu_seqlens_k = (nn.functional.pad(real.sum(1).cumsum(0), (1, 0)).to(torch.int32)
                                  for real in (real_queries, real_keys))
    packed = functional.attention(q[real_queries], k[real_keys], v[real_keys], cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, **options)
    return q.new_zeros(q.shape).index_put((real_queries,), packed), None


def run_stock_layer(layer, *args, **kwargs):
    """Runs the Hugging Face module that remat.patch replaced by ``layer`` (kept as
    ``layer._remat_original``, sharing its parameters) on the same arguments: what a patched layer
    does with a KV cache (generation), where the model's own code updates the cache and attends
    through :func:`hf_attention`; in a training forward (``layer.training`` with grad enabled) a
    cache raises ValueError instead. The stock module is put in ``layer``'s train/eval mode first,
    and its forward runs without its module hooks (``layer``'s own hooks run around the call).
    Raises ValueError when ``layer`` has no original (built outside remat.patch) or holds
    parameters its original lacks (an adapter added after patching, which the stock module would
    silently skip)."""
    stock = layer.__dict__.get("_remat_original")
    if stock is None:
        raise ValueError(f"{type(layer).__name__} runs with a KV cache only inside a model patched by remat.patch "
                         "(it then runs the replaced Hugging Face module); this one was built on its own")
    if layer.training and torch.is_grad_enabled():
        raise ValueError("a KV cache in a training forward (training mode, grad enabled): remat's fused layers train "
                         "without a cache (the stock layer would run instead, keeping all its activations); pass "
                         "use_cache=False (or no past_key_values), or run the cached forward under torch.no_grad() "
                         "or in eval mode")
    stock_parameters = {id(p) for p in stock.parameters()}
    missing = [name for name, p in layer.named_parameters() if id(p) not in stock_parameters]
    if missing:
        raise ValueError(f"{type(layer).__name__} holds parameters its replaced Hugging Face module lacks "
                         f"({', '.join(missing[:3])}, ...: an adapter added after remat.patch), which generation "
                         "with a KV cache would skip; apply adapters before remat.patch, or merge them")
    if stock.training != layer.training:
        stock.train(layer.training)
    # Its forward, not its __call__: the stock module's own forward hooks (Hugging Face's output
    # recorders, which remat.patch carried over to layer) already run around layer's call.
    return stock.forward(*args, **_cache_under_stock_name(stock.forward, kwargs))


# The names a decoder layer's KV cache argument has had: ``past_key_values`` (transformers 5.17,
# where GPT2Block takes it as its second positional parameter) and ``cache`` (5.24).
_CACHE_NAMES = ("cache", "past_key_values")


@functools.lru_cache(maxsize=64)
def _declared_cache_names(function):
    """The KV cache names among ``function``'s parameters (read once per function: a generation
    step calls this once per layer)."""
    parameters = inspect.signature(function).parameters
    return tuple(name for name in _CACHE_NAMES if name in parameters)


def given_cache(kwargs):
    """The KV cache a decoder layer or attention module was called with, under either of its
    names (``cache`` or ``past_key_values``; a caller may pass one and leave the other None), or
    None."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def _cache_under_stock_name(forward, kwargs):
    """``kwargs`` with the KV cache passed under the name ``forward`` declares (and the other name
    dropped): a stock layer whose forward has only ``past_key_values`` would take ``cache=`` into
    its ``**kwargs`` and ignore it (running without the cache: wrong tokens from the second
    generated one on), and vice versa. Unchanged when no cache is given or forward declares
    neither name."""
    given = [name for name in _CACHE_NAMES if kwargs.get(name) is not None]
    if len(given) != 1:
        return kwargs
    declared = _declared_cache_names(getattr(forward, "__func__", forward))
    if not declared:
        return kwargs
    target = given[0] if given[0] in declared else declared[0]
    renamed = {name: value for name, value in kwargs.items() if name not in _CACHE_NAMES}
    renamed[target] = kwargs[given[0]]
    return renamed


def refuse_static_cache(cache):
    """A patched model generates with a dynamic cache (DynamicCache and its sliding-window layers);
    a static cache (fixed-size buffers, ``cache.is_compileable``) raises ValueError."""
    if cache is not None and getattr(cache, "is_compileable", False):
        raise ValueError("a remat-patched model generates with a dynamic KV cache (DynamicCache, the default); "
                         f"{type(cache).__name__} (a static, fixed-size cache) is not supported; use "
                         "cache_implementation='dynamic'")


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
    """A patched model's ``attention_mask``: None or a 2-D ``[B, N]`` padding mask (ones for real
    tokens, zeros for pads, anywhere: right or left padding, holes). Anything else (a 4-D mask, a
    custom or prefix-LM mask) raises ValueError naming what is supported."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError("a remat-patched model takes attention_mask None or a 2-D [B, N] padding mask (1 = real "
                         "token, 0 = pad, anywhere in a row), and packed rows by position_ids or cu_seq_lens_q/k; "
                         f"got {getattr(mask, 'shape', type(mask).__name__)}: 4-D and custom masks (prefix-LM, "
                         "block masks) are not supported; call remat.unpatch(model) for those")


def output_tuple(output, kept=()):
    """``output`` (a Hugging Face ``ModelOutput``) as the tuple stock returns for
    ``return_dict=False``, with stock's positions. Stock's ``ModelOutput.to_tuple()`` lists the
    fields in class order and drops those that are None; a patched forward leaves None some fields
    stock computes (the fused loss's ``logits``, the KV cache a training forward no longer builds),
    which ``to_tuple()`` would drop, shifting every later field. The fields named in ``kept`` stay
    in their place as None; the others are dropped when None, as stock drops them."""
    values = [(f.name, getattr(output, f.name)) for f in dataclasses.fields(output)]
    return tuple(value for name, value in values if value is not None or name in kept)


def cache_field(output_type):
    """The name of the KV cache field of a Hugging Face output class (``cache`` in transformers
    5.24, ``past_key_values`` before), or None when it has none."""
    names = {f.name for f in dataclasses.fields(output_type)} if dataclasses.is_dataclass(output_type) else ()
    return next((name for name in _CACHE_NAMES if name in names), None)


def stock_builds_cache(model, config, use_cache):
    """Whether the stock ``model`` builds and returns a KV cache for a forward called with
    ``use_cache`` (None: not given) under ``config`` (the model's own config, not a patched
    model's private copy): the argument, else ``config.use_cache``, and never while its base
    model trains with gradient checkpointing and grad enabled (transformers'
    ``merge_with_config_defaults``)."""
    if use_cache is None:
        use_cache = getattr(config, "use_cache", None)
    base = getattr(model, "base_model", model)
    if getattr(base, "gradient_checkpointing", False) and base.training and torch.is_grad_enabled():
        return False
    return bool(use_cache)


class ModelForward:
    """Base of the forwards remat installs on a model instance (``model.forward = Subclass(model)``):
    an object of a module-level class holding the model, not a closure, so the model pickles
    (``torch.save(model)``) and a deep copy's forward holds the copy; ``inspect.signature`` reads
    the stock forward's (through ``__wrapped__``; Hugging Face's Trainer reads it). Subclasses
    implement ``__call__`` and may extend ``_bind`` (run again after unpickling)."""

    def __init__(self, model):
        self.model = model
        self._bind()

    @classmethod
    def install(cls, model, previous_name, mark_name):
        """Makes ``model.forward`` an instance of this class: an instance forward it replaces (such
        as accelerate's hooks install) is kept as ``model.<previous_name>``, and ``model.<mark_name>``
        is set True."""
        previous = model.__dict__.get("forward")
        if previous is not None:
            setattr(model, previous_name, previous)
        model.forward = cls(model)
        setattr(model, mark_name, True)

    def _bind(self):
        self.signature = inspect.signature(type(self.model).forward)
        self.var_keyword = next((p.name for p in self.signature.parameters.values() if p.kind is p.VAR_KEYWORD),
                                None)

    @property
    def __wrapped__(self):
        return type(self.model).forward.__get__(self.model)

    def arguments(self, args, kwargs):
        """{name: value} of a call with ``args`` and ``kwargs`` bound to the stock forward's
        signature, the ``**kwargs`` entries flattened in, without ``self``."""
        bound = self.signature.bind_partial(self.model, *args, **kwargs).arguments
        extra = dict(bound.pop(self.var_keyword, {})) if self.var_keyword else {}
        bound.pop("self", None)
        return {**bound, **extra}

    def __getstate__(self):
        return {"model": self.model}

    def __setstate__(self, state):
        # The signature is read again from the model's class (its annotations need not pickle);
        # pickle has made the model, of its class, before this runs.
        self.model = state["model"]
        self._bind()
