"""The projections of remat's fused layers, read at forward time, so that whatever wraps them after
the layer was built (PEFT's ``get_peft_model`` on a patched model) is seen.

A projection (``q_proj``, ``o_proj``, ``gate_proj``, ...) is one of:

- a plain ``nn.Linear`` (its class's forward is ``nn.Linear.forward``, no forward hooks, no
  instance-level forward): the fused Functions read its ``weight`` and ``bias``;
- a PEFT LoRA ``lora.Linear`` around a plain ``nn.Linear`` whose active adapters are vanilla LoRA
  (no DoRA or other variant, plain ``lora_A`` / ``lora_B``, ``nn.Dropout`` or identity dropout):
  the base weight and bias plus one :class:`remat.autograd.lora.LoRAAdapter` per active adapter,
  whose branches the fused Functions add with PEFT's arithmetic. Disabled adapters
  (``disable_adapter()``) and merged weights give the base layer alone, as PEFT's forward does;
- anything else (a quantized linear such as bitsandbytes' ``Linear4bit``, an ``nn.Linear``
  subclass with its own forward, a DoRA or other PEFT variant, a module with hooks): *generic*.
  The layer never reads its ``weight``: the sub-block holding it runs unfused through the
  modules' own forwards inside ``torch.utils.checkpoint`` (:func:`checkpointed`), keeping only
  the sub-block's input and re-running it in backward.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat import checks, functional
from remat.autograd.lora import LoRAAdapter


class Projection(NamedTuple):
    """A projection as the fused layers read it: ``weight`` / ``bias`` of the (base) linear and its
    active LoRA ``adapters``; ``weight`` None for a generic module, run by its own forward."""

    module: nn.Module
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    adapters: tuple

    @property
    def generic(self):
        return self.weight is None


def _peft_lora_linear():
    """peft's ``lora.Linear`` class, or None when peft is not installed."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def _no_own_forward(module, base_class):
    """The module runs ``base_class.forward`` as is: no override, no instance forward, no hooks."""
    return (type(module).forward is base_class.forward and "forward" not in module.__dict__
            and not module._forward_hooks and not module._forward_pre_hooks)


def is_plain_linear(module):
    """An ``nn.Linear`` whose forward is ``x W^T + b`` with a float weight remat's kernels take."""
    return (isinstance(module, nn.Linear) and _no_own_forward(module, nn.Linear)
            and isinstance(module.weight, torch.Tensor) and module.weight.dtype in checks.SUPPORTED_DTYPES)


def read_projection(module):
    """The :class:`Projection` of ``module`` now (see the module docstring). A PEFT layer whose
    adapters are disabled while merged is unmerged first, as PEFT's own forward does."""
    if is_plain_linear(module):
        return Projection(module, module.weight, module.bias, ())
    lora = _lora_projection(module)
    return lora if lora is not None else Projection(module, None, None, ())


def _lora_projection(module):
    lora_linear = _peft_lora_linear()
    if lora_linear is None or not isinstance(module, lora_linear) or not _no_own_forward(module, lora_linear):
        return None
    base = module.base_layer
    if not is_plain_linear(base) or module.fan_in_fan_out or not getattr(module, "cast_input_dtype_enabled", True):
        return None
    if module.disable_adapters:
        if module.merged:
            module.unmerge()
        return Projection(module, base.weight, base.bias, ())
    if module.merged:
        return Projection(module, base.weight, base.bias, ())
    adapters = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in module.lora_variant:
            return None
        a, b, dropout = module.lora_A[name], module.lora_B[name], module.lora_dropout[name]
        if not (is_plain_linear(a) and is_plain_linear(b)) or a.weight.dtype != b.weight.dtype:
            return None
        if type(dropout) is nn.Dropout:
            p = dropout.p if dropout.training else 0.0
        elif type(dropout) is nn.Identity:
            p = 0.0
        else:
            return None
        adapters.append(LoRAAdapter(a.weight, b.weight, b.bias, float(module.scaling[name]), float(p)))
    return Projection(module, base.weight, base.bias, tuple(adapters))


def projection_features(module, name, owner):
    """(in_features, out_features) of a projection ``owner.<name>``: an nn.Linear, a PEFT layer
    around one, or any module with integer ``in_features`` and ``out_features`` (run generically).
    Anything else raises TypeError."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{type(owner).__name__}.{name} must be a linear module, got {type(module).__name__}")
    sizes = (getattr(module, "in_features", None), getattr(module, "out_features", None))
    if not all(isinstance(size, int) and size > 0 for size in sizes):
        raise TypeError(f"{type(owner).__name__}.{name} must be a linear module with in_features and out_features "
                        f"(nn.Linear, a PEFT LoRA layer or a quantized linear), got {type(module).__name__}")
    return sizes


def weights_like(projections, x):
    """(weights, biases) of plain / LoRA projections in x's dtype (differentiable casts)."""
    return ([checks.cast_like(p.weight, x) for p in projections], [checks.cast_like(p.bias, x) for p in projections])


def lora_argument(projections):
    """The ``lora`` argument of the fused functions: None when no projection has adapters."""
    if not any(p.adapters for p in projections):
        return None
    return tuple(p.adapters for p in projections)


def checkpointed(function, *args):
    """``function(*args)`` under non-reentrant ``torch.utils.checkpoint``: autograd keeps only the
    inputs and re-runs ``function`` in backward (with the forward's RNG state, so dropout masks
    repeat); the generic path of the fused layers. Without grad it just runs."""
    if not torch.is_grad_enabled():
        return function(*args)
    return checkpoint(function, *args, use_reentrant=False)


def linear_projection(projection, x, backend):
    """A lone projection (o_proj) of x ``[..., in]``: plain -> F.linear; LoRA -> one Function
    keeping x and the adapters' RNG state (remat.autograd.lora.LoRALinearFunction); generic ->
    its own forward under :func:`checkpointed` (keeps x)."""
    if projection.generic:
        return checkpointed(projection.module, x)
    weight, bias = checks.cast_like(projection.weight, x), checks.cast_like(projection.bias, x)
    if not projection.adapters:
        return F.linear(x, weight, bias)
    return functional.lora_linear(x, weight, bias, projection.adapters, backend=backend)


def unfused_attention(norm, attention, x, rope, qk_norms=None, layout=None):
    """The attention sub-block through the modules' own forwards: ``norm(x)``, q/k/v_proj, the
    optional per-head norms ``qk_norms = (q_norm, k_norm)``, then remat.attention. o ``[B, N, Hq,
    D]``; the generic path (run it under :func:`checkpointed`). ``layout``: None or x's
    remat.sequences.SequenceLayout (see remat.nn.layers.PreNormDecoderLayer.attention_output)."""
    batch, n, _ = x.shape
    normed = norm(x)
    q = attention.q_proj(normed).view(batch, n, attention.num_heads, attention.head_dim)
    k = attention.k_proj(normed).view(batch, n, attention.num_kv_heads, attention.head_dim)
    v = attention.v_proj(normed).view(batch, n, attention.num_kv_heads, attention.head_dim)
    if qk_norms is not None:
        q, k = qk_norms[0](q), qk_norms[1](k)
    return attend(q, k, v, layout, causal=attention.causal, scale=attention.scale, rope=rope,
                  dropout_p=attention.dropout if attention.training else 0.0, window=attention.window,
                  softcap=attention.softcap, backend=attention.backend)


def attend(q, k, v, layout, **options):
    """remat.attention of q ``[B, N, Hq, D]``, k, v laid out by ``layout`` (None, or a
    remat.sequences.SequenceLayout: packed (B = 1) as variable-length attention over its
    sequences; its empty queries (pads) give 0)."""
    if layout is None:
        return functional.attention(q, k, v, **options)
    if layout.sequence_parallel is not None:
        raise ValueError("sequence_parallel runs the fused attention sub-block only: this layer has a projection of "
                         "another linear type (quantized, DoRA, an nn.Linear subclass) that runs through its own "
                         "forward; sequence parallelism does not cover that path")
    if layout.cu_seqlens is None:
        return functional.attention(q, k, v, empty_queries=layout.empty, **options)
    cu_seqlens, max_seqlen = layout.cu_seqlens, layout.max_seqlen
    empty = None if layout.empty is None else layout.empty[0]
    return functional.attention(q[0], k[0], v[0], cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, empty_queries=empty, **options)[None]


ACTIVATION_FUNCTIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def unfused_gated_mlp(norm, mlp, h):
    """``down_proj(act(gate_proj(norm(h))) * up_proj(norm(h)))`` through the modules' own
    forwards; the generic path (run it under :func:`checkpointed`)."""
    normed = norm(h)
    return mlp.down_proj(ACTIVATION_FUNCTIONS[mlp.activation](mlp.gate_proj(normed)) * mlp.up_proj(normed))


def lora_bytes_per_call(modules):
    """Bytes the LoRA branches of ``modules`` (projections) keep per call: 16 (a Philox seed and
    offset) per active adapter with dropout; nothing per token."""
    return 16 * sum(adapter.dropout_p > 0 for module in modules for adapter in read_projection(module).adapters)


def carry_wrappers(replacement, original):
    """Puts the wrappers added to ``replacement`` after it replaced ``original`` (PEFT's
    ``get_peft_model`` on a patched model wraps the projections the two share) into ``original``
    at the same paths, so that restoring ``original`` (remat.unpatch) keeps the adapters. A
    wrapper is recognised by its ``base_layer`` being the module ``original`` holds at that path.
    Returns the paths carried over."""
    originals = dict(original.named_modules())
    carried = []
    for path, module in list(replacement.named_modules()):
        if path and path in originals and getattr(module, "base_layer", None) is originals[path]:
            parent_path, _, name = path.rpartition(".")
            setattr(original.get_submodule(parent_path), name, module)
            carried.append(path)
    return carried


def fusable_split(projection):
    """Whether a fused projection (Phi-3's qkv_proj, gate_up_proj) can join a fused sub-block as
    row slices: plain, or LoRA without dropout (the slices would need one shared mask)."""
    return not projection.generic and all(adapter.dropout_p == 0 for adapter in projection.adapters)


def split_adapters(adapters_, widths):
    """LoRA adapters of a fused projection as one adapter list per row slice of ``widths`` (B and
    its bias sliced, A shared: autograd sums its gradients); None without adapters."""
    if not adapters_:
        return None
    slices, start = [], 0
    for width in widths:
        end = start + width
        slices.append(tuple(adapter._replace(b=adapter.b[start:end],
                                             bias=None if adapter.bias is None else adapter.bias[start:end])
                            for adapter in adapters_))
        start = end
    return tuple(slices)
