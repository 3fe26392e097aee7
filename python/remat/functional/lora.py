"""LoRA adapters in the fused functions (remat.autograd.lora): their argument checks, and a lone
projection with adapters (:func:`lora_linear`)."""

import torch

from remat import checks
from remat.autograd.lora import LoRAAdapter, LoRALinearFunction, flatten
from remat.backend import resolve_backend


def check_lora(lora, in_features, out_features, x, names):
    """Checks ``lora``: None, or one sequence of :class:`LoRAAdapter` per projection (``names``),
    projection i reading ``in_features[i]`` and writing ``out_features[i]``. Returns the
    (layout, flat tensors) of remat.autograd.lora (empty without adapters)."""
    if lora is None:
        return (), ()
    if not isinstance(lora, (tuple, list)) or len(lora) != len(names):
        raise TypeError(f"lora must be None or a sequence of {len(names)} adapter sequences ({', '.join(names)}), "
                        f"got {type(lora).__name__}")
    for name, adapters, width_in, width in zip(names, lora, in_features, out_features):
        if adapters is None:
            continue
        for adapter in adapters:
            if not isinstance(adapter, LoRAAdapter):
                raise TypeError(f"lora[{name}] must hold remat.autograd.lora.LoRAAdapter tuples, got "
                                f"{type(adapter).__name__}")
            _check_adapter(adapter, name, width_in, width, x)
    return flatten(lora)


def _check_adapter(adapter, name, in_features, width, x):
    for label, t in (("a", adapter.a), ("b", adapter.b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise TypeError(f"lora[{name}].{label} must be a 2-D tensor")
        if t.dtype not in checks.SUPPORTED_DTYPES or t.device != x.device:
            raise TypeError(f"lora[{name}].{label} must be float32, float16 or bfloat16 on {x.device}, got "
                            f"{t.dtype} on {t.device}")
    rank = adapter.a.shape[0]
    if tuple(adapter.a.shape) != (rank, in_features) or tuple(adapter.b.shape) != (width, rank):
        raise ValueError(f"lora[{name}]: a must be [r, {in_features}] and b [{width}, r], got "
                         f"{tuple(adapter.a.shape)} and {tuple(adapter.b.shape)}")
    if adapter.a.dtype != adapter.b.dtype:
        raise TypeError(f"lora[{name}]: a and b must share a dtype, got {adapter.a.dtype} and {adapter.b.dtype}")
    if adapter.bias is not None and (not isinstance(adapter.bias, torch.Tensor)
                                     or tuple(adapter.bias.shape) != (width,)
                                     or adapter.bias.dtype != adapter.b.dtype):
        raise ValueError(f"lora[{name}].bias must be None or a [{width}] tensor in b's dtype")
    if isinstance(adapter.scaling, bool) or not isinstance(adapter.scaling, (int, float)):
        raise TypeError(f"lora[{name}].scaling must be a number, got {adapter.scaling!r}")
    checks.check_probability(adapter.dropout_p, f"lora[{name}].dropout_p")


def lora_linear(x, weight, bias, adapters, *, backend=None):
    """A projection with LoRA adapters, ``x W^T + b + sum_a scaling_a * b_a(a_a(dropout_a(x)))``,
    with PEFT's arithmetic (x cast to each adapter's dtype, one rounding of the sum to the base
    output's dtype).

    Args:
        x: ``[..., in]`` float32, float16 or bfloat16.
        weight: ``[out, in]`` in x's dtype; bias: ``[out]`` or None.
        adapters: a sequence of :class:`remat.autograd.lora.LoRAAdapter` (``a`` ``[r, in]``,
            ``b`` ``[out, r]``, in any float dtype on x's device).
        backend: the backend of the dropout kernel (see remat.backend).

    Returns:
        ``[..., out]`` in x's dtype.

    Saved for backward: x, and 16 bytes of Philox state per adapter with dropout; the rank-r
    intermediates and the dropout masks are recomputed. A weight that needs no gradient costs no
    weight-gradient GEMM.
    """
    checks.check_input(x)
    checks.check_matrix(weight, "weight")
    out_features, in_features = weight.shape
    checks.check_weight(weight, "weight", (out_features, x.shape[-1]), x)
    checks.check_weight(bias, "bias", (out_features,), x, optional=True)
    layout, tensors = check_lora((adapters,), (in_features,), (out_features,), x, ("adapters",))
    name = resolve_backend(backend, x)
    (_, *tensors), _ = checks.autocast_cast(x, *tensors)
    (rows, weight, bias), autocast_off = checks.autocast_cast(checks.as_rows(x), weight, bias)
    with autocast_off:
        y = LoRALinearFunction.apply(rows, weight, bias, layout, name, *tensors)
    return y.view(*x.shape[:-1], out_features)
