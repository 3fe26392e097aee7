"""The norm operators of every backend, behind one signature.

Every backend implements the same four functions (the recompute contract of DESIGN.md section 2):

- ``rms_norm_fwd(x, weight, residual, eps) -> (y, h, rstd)``
- ``layer_norm_fwd(x, weight, bias, residual, eps) -> (y, h, mean, rstd)``
- ``rms_norm_bwd(dy, dh, h, weight, rstd) -> (dx, dw)``
- ``layer_norm_bwd(dy, dh, h, weight, mean, rstd, has_bias) -> (dx, dw, db)``

x, residual, dy, dh are [rows, cols] with unit column stride. With a residual, h = x + residual
rounded to x's dtype, and the statistics are computed from that rounded h; without one h is an
empty tensor and the norm input is x. mean and rstd are fp32 [rows]. The backward recomputes
x_hat from h (or x) and the statistics; dx includes dh. dw / db are empty when there is no
weight / bias.
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from remat import _extension
from remat.ops.device import on_tensor_device


class NormOps(NamedTuple):
    rms_norm_fwd: object
    layer_norm_fwd: object
    rms_norm_bwd: object
    layer_norm_bwd: object


def _torch_norm_fwd(x, weight, bias, residual, eps, is_rms):
    if residual is not None:
        h = x + residual
        u = h.float()
    else:
        h = x.new_empty(0)
        u = x.float()
    if is_rms:
        mean = None
        rstd = torch.rsqrt(u.square().mean(dim=1) + eps)
        x_hat = u * rstd[:, None]
    else:
        mean = u.mean(dim=1)
        centered = u - mean[:, None]
        rstd = torch.rsqrt(centered.square().mean(dim=1) + eps)
        x_hat = centered * rstd[:, None]
    y = x_hat
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), h, mean, rstd


def _torch_norm_bwd(dy, dh, h, weight, mean, rstd, has_bias, is_rms):
    u = h.float()
    x_hat = (u if is_rms else u - mean[:, None]) * rstd[:, None]
    dy_f = dy.float()
    g = dy_f * weight.float() if weight is not None else dy_f
    dx = g - x_hat * (g * x_hat).mean(dim=1, keepdim=True)
    if not is_rms:
        dx = dx - g.mean(dim=1, keepdim=True)
    dx = dx * rstd[:, None]
    if dh is not None:
        dx = dx + dh.float()
    dw = (dy_f * x_hat).sum(dim=0).to(h.dtype) if weight is not None else h.new_empty(0)
    db = dy_f.sum(dim=0).to(h.dtype) if has_bias else h.new_empty(0)
    return dx.to(h.dtype), dw, db


def torch_rms_norm_fwd(x, weight, residual, eps):
    y, h, _, rstd = _torch_norm_fwd(x, weight, None, residual, eps, is_rms=True)
    return y, h, rstd


def torch_layer_norm_fwd(x, weight, bias, residual, eps):
    return _torch_norm_fwd(x, weight, bias, residual, eps, is_rms=False)


def torch_rms_norm_bwd(dy, dh, h, weight, rstd):
    dx, dw, _ = _torch_norm_bwd(dy, dh, h, weight, None, rstd, False, is_rms=True)
    return dx, dw


def torch_layer_norm_bwd(dy, dh, h, weight, mean, rstd, has_bias):
    return _torch_norm_bwd(dy, dh, h, weight, mean, rstd, has_bias, is_rms=False)


TORCH_OPS = NormOps(torch_rms_norm_fwd, torch_layer_norm_fwd, torch_rms_norm_bwd, torch_layer_norm_bwd)


def _fake_fwd(x, residual, is_rms):
    rows, cols = x.shape
    y = x.new_empty((rows, cols))
    h = x.new_empty((rows, cols)) if residual is not None else x.new_empty(0)
    mean = x.new_empty(0 if is_rms else rows, dtype=torch.float32)
    rstd = x.new_empty(rows, dtype=torch.float32)
    return y, h, mean, rstd


def _fake_bwd(h, weight, has_bias):
    rows, cols = h.shape
    dw = h.new_empty(cols if weight is not None else 0)
    db = h.new_empty(cols if has_bias else 0)
    return h.new_empty((rows, cols)), dw, db


def _fake_rms_norm_fwd(x, weight, residual, eps):
    y, h, _, rstd = _fake_fwd(x, residual, is_rms=True)
    return y, h, rstd


def _fake_layer_norm_fwd(x, weight, bias, residual, eps):
    return _fake_fwd(x, residual, is_rms=False)


def _fake_rms_norm_bwd(dy, dh, h, weight, rstd):
    dx, dw, _ = _fake_bwd(h, weight, False)
    return dx, dw


def _fake_layer_norm_bwd(dy, dh, h, weight, mean, rstd, has_bias):
    return _fake_bwd(h, weight, has_bias)


EXTENSION_OPS = None
if _extension.LOADED:
    torch.library.register_fake("remat::rms_norm_fwd")(_fake_rms_norm_fwd)
    torch.library.register_fake("remat::layer_norm_fwd")(_fake_layer_norm_fwd)
    torch.library.register_fake("remat::rms_norm_bwd")(_fake_rms_norm_bwd)
    torch.library.register_fake("remat::layer_norm_bwd")(_fake_layer_norm_bwd)
    EXTENSION_OPS = NormOps(
        torch.ops.remat.rms_norm_fwd,
        torch.ops.remat.layer_norm_fwd,
        torch.ops.remat.rms_norm_bwd,
        torch.ops.remat.layer_norm_bwd,
    )


@torch.library.custom_op("remat_triton::rms_norm_fwd", mutates_args=())
@on_tensor_device
def triton_rms_norm_fwd(
    x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    from remat.kernels import norm

    return norm.rms_norm_fwd(x, weight, residual, eps)


@torch.library.custom_op("remat_triton::layer_norm_fwd", mutates_args=())
@on_tensor_device
def triton_layer_norm_fwd(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from remat.kernels import norm

    return norm.layer_norm_fwd(x, weight, bias, residual, eps)


@torch.library.custom_op("remat_triton::rms_norm_bwd", mutates_args=())
@on_tensor_device
def triton_rms_norm_bwd(
    dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor], rstd: Tensor
) -> tuple[Tensor, Tensor]:
    from remat.kernels import norm

    return norm.rms_norm_bwd(dy, dh, h, weight, rstd)


@torch.library.custom_op("remat_triton::layer_norm_bwd", mutates_args=())
@on_tensor_device
def triton_layer_norm_bwd(
    dy: Tensor,
    dh: Optional[Tensor],
    h: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    has_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    from remat.kernels import norm

    return norm.layer_norm_bwd(dy, dh, h, weight, mean, rstd, has_bias)


triton_rms_norm_fwd.register_fake(_fake_rms_norm_fwd)
triton_layer_norm_fwd.register_fake(_fake_layer_norm_fwd)
triton_rms_norm_bwd.register_fake(_fake_rms_norm_bwd)
triton_layer_norm_bwd.register_fake(_fake_layer_norm_bwd)

TRITON_OPS = NormOps(triton_rms_norm_fwd, triton_layer_norm_fwd, triton_rms_norm_bwd, triton_layer_norm_bwd)


# Read by remat.ops.ops_for; None where the extension is not built.
OPS = {"torch": TORCH_OPS, "triton": TRITON_OPS, "cpp": EXTENSION_OPS, "cuda": EXTENSION_OPS}
