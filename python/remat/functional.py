"""Public functions: argument checks and reshaping, then the autograd Function.

Every function checks its inputs and raises TypeError / ValueError naming the argument before any
kernel runs, and never writes into a tensor it was handed.
"""

import math

import torch

from remat.autograd.norm import LayerNormFunction, RMSNormFunction
from remat.backend import resolve_backend

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
