"""Public functions: argument checks and reshaping, then the autograd Function.

Every function checks its inputs and raises TypeError / ValueError naming the argument before any
kernel runs, and never writes into a tensor it was handed.
"""

import contextlib
import math

import torch

from remat.autograd.mlp import RECOMPUTE_MODES, GatedMLPFunction, GELUMLPFunction, NormGatedMLPFunction
from remat.autograd.norm import LayerNormFunction, RMSNormFunction
from remat.backend import resolve_backend
from remat.ops.mlp import ACTIVATIONS

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_input(x, name="x"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a last (hidden) dimension of size >= 1, got shape {tuple(x.shape)}")


def _check_vector(t, name, x):
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.shape != (x.shape[-1],):
        raise ValueError(f"{name} must have shape ({x.shape[-1]},) to match x's last dimension, got {tuple(t.shape)}")
    if t.dtype != x.dtype:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def _check_residual(residual, x):
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"residual must be on x's device {x.device}, got {residual.device}")


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a positive finite number, got {eps}")


def _as_rows(t):
    """[..., cols] -> [rows, cols] with unit column stride (a view where possible, else one copy)."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def rms_norm(x, weight=None, eps=1e-6, *, residual=None, backend=None):
    """RMSNorm over the last dimension: ``y = h / sqrt(mean(h^2) + eps) * weight``.

    Args:
        x: ``[..., hidden]`` float32, float16 or bfloat16; any strides.
        weight: ``[hidden]`` in x's dtype, or None (no scaling).
        eps: added to the mean square; positive. Default 1e-6.
        residual: optional tensor shaped like x. Then ``h = x + residual`` (rounded to x's dtype)
            is computed in the same kernel and ``(y, h)`` is returned, the residual stream for
            the next block.
        backend: ``"cuda"``, ``"cpp"``, ``"triton"``, ``"torch"`` or None (see remat.backend).

    Returns:
        y shaped like x, or ``(y, h)`` when ``residual`` is given.

    Saved for backward: the norm input (x, or h) and fp32 rstd per row; x_hat is recomputed.
    """
    _check_input(x)
    _check_vector(weight, "weight", x)
    _check_residual(residual, x)
    _check_eps(eps)
    name = resolve_backend(backend, x)
    x_rows = _as_rows(x)
    residual_rows = _as_rows(residual) if residual is not None else None
    out = RMSNormFunction.apply(x_rows, weight, residual_rows, float(eps), name)
    if residual is None:
        return out.view(x.shape)
    y, h = out
    return y.view(x.shape), h.view(x.shape)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, backend=None):
    """LayerNorm over the last dimension: ``y = (h - mean) / sqrt(var + eps) * weight + bias``.

    Args:
        x: ``[..., hidden]`` float32, float16 or bfloat16; any strides.
        weight, bias: ``[hidden]`` in x's dtype, or None.
        eps: added to the (biased) variance; positive. Default 1e-5.
        residual: optional tensor shaped like x; then ``h = x + residual`` and ``(y, h)`` is
            returned, as in :func:`rms_norm`.
        backend: ``"cuda"``, ``"cpp"``, ``"triton"``, ``"torch"`` or None.

    Returns:
        y shaped like x, or ``(y, h)`` when ``residual`` is given.

    Saved for backward: the norm input (x, or h), fp32 mean and rstd per row; x_hat is recomputed.
    """
    _check_input(x)
    _check_vector(weight, "weight", x)
    _check_vector(bias, "bias", x)
    _check_residual(residual, x)
    _check_eps(eps)
    name = resolve_backend(backend, x)
    x_rows = _as_rows(x)
    residual_rows = _as_rows(residual) if residual is not None else None
    out = LayerNormFunction.apply(x_rows, weight, bias, residual_rows, float(eps), name)
    if residual is None:
        return out.view(x.shape)
    y, h = out
    return y.view(x.shape), h.view(x.shape)


def _check_weight(w, name, shape, x, optional=False):
    if w is None:
        if optional:
            return
        raise TypeError(f"{name} must be a torch.Tensor, got None")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(w).__name__}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(w.shape)}")
    autocast = x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)
    if w.dtype != x.dtype and not autocast:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
    if not w.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {w.device}")


def _check_choice(value, name, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_matrix(w, name):
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [intermediate, hidden], got shape {tuple(w.shape)}")


def _autocast_cast(x, *tensors):
    """Under autocast, the MLP's GEMMs run in the autocast dtype: x and the parameters are cast
    (differentiably) here, and the Function then runs with autocast off, so that its backward (which
    autocast does not cover) sees the same dtypes as its forward."""
    device_type = x.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return (x, *tensors), contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    cast = [t if t is None or t.dtype == dtype else t.to(dtype) for t in (x, *tensors)]
    return cast, torch.autocast(device_type, enabled=False)


def _check_gated_weights(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    """Checks a gated MLP's weights ([I, H], [I, H], [H, I]) and biases; returns H."""
    _check_matrix(w_gate, "w_gate")
    hidden, inter = x.shape[-1], w_gate.shape[0]
    _check_weight(w_gate, "w_gate", (inter, hidden), x)
    _check_weight(w_up, "w_up", (inter, hidden), x)
    _check_weight(w_down, "w_down", (hidden, inter), x)
    _check_weight(b_gate, "b_gate", (inter,), x, optional=True)
    _check_weight(b_up, "b_up", (inter,), x, optional=True)
    _check_weight(b_down, "b_down", (hidden,), x, optional=True)
    return hidden


def _gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, recompute, backend):
    _check_input(x)
    hidden = _check_gated_weights(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    _check_choice(recompute, "recompute", RECOMPUTE_MODES)
    _check_choice(activation, "activation", ACTIVATIONS)
    name = resolve_backend(backend, x)
    (x_rows, *params), autocast_off = _autocast_cast(_as_rows(x), w_gate, w_up, w_down, b_gate, b_up, b_down)
    with autocast_off:
        y = GatedMLPFunction.apply(x_rows, *params, activation, recompute, name)
    return y.view(*x.shape[:-1], hidden)


def swiglu_mlp(x, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None, recompute="block", backend=None):
    """Llama-style MLP: ``down(silu(gate(x)) * up(x))``.

    Args:
        x: ``[..., H]`` float32, float16 or bfloat16.
        w_gate, w_up: ``[I, H]``; w_down: ``[H, I]`` (``nn.Linear`` layout), x's dtype and device.
        b_gate, b_up: optional ``[I]``; b_down: optional ``[H]``.
        recompute: ``"block"`` (default; keeps x only, recomputes the up/gate GEMMs in backward),
            ``"activation"`` (keeps x, gate, up) or ``"none"`` (keeps what eager PyTorch keeps).
        backend: as for :func:`rms_norm`; it chooses the fused activation kernels, the GEMMs are
            PyTorch's (cuBLAS, or ATen on the CPU).

    Returns:
        ``[..., H]``.
    """
    return _gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, "silu", recompute, backend)


def geglu_mlp(x, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None, approximate="none",
              recompute="block", backend=None):
    """GeGLU MLP: ``down(gelu(gate(x)) * up(x))`` with ``approximate`` "none" (erf) or "tanh";
    arguments as :func:`swiglu_mlp`."""
    _check_choice(approximate, "approximate", ("none", "tanh"))
    activation = "gelu" if approximate == "none" else "gelu_tanh"
    return _gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, recompute, backend)


def gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, *, approximate="none", recompute="block", backend=None):
    """GPT-2-style MLP: ``proj(gelu(fc(x)))``.

    Args:
        x: ``[..., H]``; w_fc: ``[I, H]``; b_fc: ``[I]`` or None; w_proj: ``[H, I]``; b_proj:
            ``[H]`` or None (``nn.Linear`` layout, x's dtype and device).
        approximate: ``"none"`` (erf) or ``"tanh"`` (GPT-2's ``gelu_new``).
        recompute: ``"block"`` (keeps x), ``"activation"`` (keeps x and fc(x)) or ``"none"``.
        backend: as for :func:`swiglu_mlp`.

    Returns:
        ``[..., H]``.
    """
    _check_input(x)
    _check_choice(approximate, "approximate", ("none", "tanh"))
    _check_choice(recompute, "recompute", RECOMPUTE_MODES)
    _check_matrix(w_fc, "w_fc")
    hidden, inter = x.shape[-1], w_fc.shape[0]
    _check_weight(w_fc, "w_fc", (inter, hidden), x)
    _check_weight(b_fc, "b_fc", (inter,), x, optional=True)
    _check_weight(w_proj, "w_proj", (hidden, inter), x)
    _check_weight(b_proj, "b_proj", (hidden,), x, optional=True)
    name = resolve_backend(backend, x)
    activation = "gelu" if approximate == "none" else "gelu_tanh"
    (x_rows, *params), autocast_off = _autocast_cast(_as_rows(x), w_fc, b_fc, w_proj, b_proj)
    with autocast_off:
        y = GELUMLPFunction.apply(x_rows, *params, activation, recompute, name)
    return y.view(*x.shape[:-1], hidden)


def norm_mlp(x, norm_weight, w_gate, w_up, w_down, *, norm_bias=None, norm="rms", eps=None, activation="silu",
             b_gate=None, b_up=None, b_down=None, backend=None):
    """Pre-norm gated MLP sub-block: ``gated_mlp(norm(x))``, keeping only x and the fp32 norm
    statistics for backward (the normalized input is recomputed in backward and never stored).

    Args:
        x: ``[..., H]``.
        norm_weight: ``[H]`` or None; norm_bias: ``[H]`` or None (LayerNorm only).
        w_gate, w_up, w_down, b_gate, b_up, b_down: as for :func:`swiglu_mlp`.
        norm: ``"rms"`` or ``"layer"``. eps: default 1e-6 (rms) or 1e-5 (layer).
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU).
        backend: as for :func:`rms_norm`.

    Returns:
        ``[..., H]`` (the MLP output; add the residual outside).
    """
    _check_input(x)
    _check_choice(norm, "norm", ("rms", "layer"))
    _check_choice(activation, "activation", ACTIVATIONS)
    _check_vector(norm_weight, "norm_weight", x)
    _check_vector(norm_bias, "norm_bias", x)
    if norm == "rms" and norm_bias is not None:
        raise ValueError("norm_bias is only for norm='layer'")
    eps = (1e-6 if norm == "rms" else 1e-5) if eps is None else eps
    _check_eps(eps)
    hidden = _check_gated_weights(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    name = resolve_backend(backend, x)
    (x_rows, *params), autocast_off = _autocast_cast(_as_rows(x), norm_weight, norm_bias, w_gate, w_up, w_down,
                                                     b_gate, b_up, b_down)
    with autocast_off:
        y = NormGatedMLPFunction.apply(x_rows, *params, norm, float(eps), activation, name)
    return y.view(*x.shape[:-1], hidden)
