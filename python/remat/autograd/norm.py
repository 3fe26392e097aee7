"""RMSNorm and LayerNorm (optionally fused with the residual add) as autograd Functions.

Recompute contract (DESIGN.md section 2), checked byte for byte in tests/test_memory.py:

- saved: the norm input (x, or h = x + residual when a residual is fused), fp32 rstd [rows] and,
  for LayerNorm, fp32 mean [rows]; the weight is saved too but is a parameter and lives anyway.
- recomputed in the backward kernel: x_hat = (h - mean) * rstd, never stored.

Inputs are already 2-D [rows, cols] with unit column stride (remat.functional reshapes them).
"""

import torch

from remat.autograd.common import refuse_double_backward
from remat.ops import ops_for


class RMSNormFunction(torch.autograd.Function):
    """y = h * rstd * weight with h = x (+ residual). Returns y, or (y, h) with a residual."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, backend):
        ops = ops_for("norm", backend)
        y, h, rstd = ops.rms_norm_fwd(x, weight, residual, eps)
        norm_input = h if residual is not None else x
        ctx.save_for_backward(norm_input, weight, rstd)
        ctx.backend = backend
        ctx.has_residual = residual is not None
        if ctx.has_residual:
            return y, h
        return y

    @staticmethod
    @refuse_double_backward("remat.rms_norm")
    def backward(ctx, dy, dh=None):
        norm_input, weight, rstd = ctx.saved_tensors
        ops = ops_for("norm", ctx.backend)
        dx, dw = ops.rms_norm_bwd(_unit_col(dy), _unit_col(dh), norm_input, weight, rstd)
        dx, d_residual = _input_and_residual_grads(dx, ctx.needs_input_grad[0],
                                                   ctx.has_residual and ctx.needs_input_grad[2])
        return dx, dw if weight is not None and ctx.needs_input_grad[1] else None, d_residual, None, None


class LayerNormFunction(torch.autograd.Function):
    """y = (h - mean) * rstd * weight + bias with h = x (+ residual). Returns y, or (y, h)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, backend):
        ops = ops_for("norm", backend)
        y, h, mean, rstd = ops.layer_norm_fwd(x, weight, bias, residual, eps)
        norm_input = h if residual is not None else x
        ctx.save_for_backward(norm_input, weight, mean, rstd)
        ctx.backend = backend
        ctx.has_bias = bias is not None
        ctx.has_residual = residual is not None
        if ctx.has_residual:
            return y, h
        return y

    @staticmethod
    @refuse_double_backward("remat.layer_norm")
    def backward(ctx, dy, dh=None):
        norm_input, weight, mean, rstd = ctx.saved_tensors
        ops = ops_for("norm", ctx.backend)
        dx, dw, db = ops.layer_norm_bwd(
            _unit_col(dy), _unit_col(dh), norm_input, weight, mean, rstd, ctx.has_bias
        )
        dx, d_residual = _input_and_residual_grads(dx, ctx.needs_input_grad[0],
                                                   ctx.has_residual and ctx.needs_input_grad[3])
        return (
            dx,
            dw if weight is not None and ctx.needs_input_grad[1] else None,
            db if ctx.has_bias and ctx.needs_input_grad[2] else None,
            d_residual,
            None,
            None,
        )


def _input_and_residual_grads(d_h, needs_x, needs_residual):
    """(dx, d_residual) of h = x + residual, both equal to d_h; None where not needed. When both
    are needed, the residual's is a copy: autograd may keep a returned gradient as a leaf's .grad
    (and accumulate into it in place), so one tensor for two inputs would make x.grad and
    residual.grad one storage."""
    if needs_x and needs_residual:
        return d_h, d_h.clone()
    return (d_h if needs_x else None), (d_h if needs_residual else None)


def _unit_col(grad):
    """Incoming gradients can be any strided (or expanded) tensor; the kernels take unit column
    stride and any row stride. An empty gradient can keep any strides, so it is rebuilt."""
    if grad is None:
        return None
    if grad.numel() == 0:
        return grad.new_zeros(grad.shape)
    if grad.shape[1] <= 1 or grad.stride(1) == 1:
        return grad
    return grad.contiguous()


def norm_forward(x, weight, bias, norm, eps, backend):
    """The normalized rows of a fused sub-block's input: (y, mean, rstd) with mean None for
    ``norm="rms"`` and ``"gemma"``. x [rows, cols] with unit column stride; y in x's dtype,
    statistics fp32.

    ``norm="gemma"`` is Gemma's RMSNorm, ``x_hat * (1 + w)`` with ``1 + w`` formed in fp32 and the
    product rounded once to x's dtype (Hugging Face: ``norm(x.float()) * (1 + w.float())`` cast
    back). The norm kernels take the weight in x's dtype, where ``1 + w`` would round, so they run
    on an fp32 copy of the rows with the fp32 weight ``1 + w``; the copy is a temporary, and the
    statistics are those of x."""
    ops = ops_for("norm", backend)
    if norm == "gemma":
        y, _, rstd = ops.rms_norm_fwd(x.float(), _one_plus(weight), None, eps)
        return y.to(x.dtype), None, rstd
    if norm == "rms":
        y, _, rstd = ops.rms_norm_fwd(x, weight, None, eps)
        return y, None, rstd
    y, _, mean, rstd = ops.layer_norm_fwd(x, weight, bias, None, eps)
    return y, mean, rstd


def norm_backward(dy, x, weight, mean, rstd, norm, has_bias, backend):
    """Gradients of :func:`norm_forward` from the saved x and statistics (x_hat recomputed):
    (dx, d_weight or None, d_bias or None). For ``norm="gemma"`` the kernel runs in fp32 (as
    Hugging Face's backward does) and dx, d_weight are rounded once to x's / the weight's dtype."""
    ops = ops_for("norm", backend)
    if norm == "gemma":
        dx, dw = ops.rms_norm_bwd(dy.float(), None, x.float(), _one_plus(weight), rstd)
        return dx.to(x.dtype), (dw.to(weight.dtype) if weight is not None else None), None
    if norm == "rms":
        dx, dw = ops.rms_norm_bwd(dy, None, x, weight, rstd)
        return dx, (dw if weight is not None else None), None
    dx, dw, db = ops.layer_norm_bwd(dy, None, x, weight, mean, rstd, has_bias)
    return dx, (dw if weight is not None else None), (db if has_bias else None)


def _one_plus(weight):
    """Gemma's effective norm weight ``1 + w`` in fp32 (a temporary; None without a weight)."""
    return None if weight is None else weight.float() + 1.0
