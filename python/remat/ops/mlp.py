"""The MLP activation operators of every backend, behind one signature (see csrc/ops.cpp):

- ``glu_fwd(gate, up, activation) -> h``: h = act(gate) * up
- ``glu_bwd(dh, gate, up, activation, need_h) -> (dgate, dup, h)``: dgate = dh * up * act'(gate),
  dup = dh * act(gate); h = act(gate) * up recomputed when need_h, else an empty tensor
- ``act_fwd(pre, activation) -> h``: h = act(pre)
- ``act_bwd(dh, pre, activation, need_h) -> (dpre, h)``: dpre = dh * act'(pre); h = act(pre) when
  need_h

activation is "silu", "gelu" (erf) or "gelu_tanh". Inputs are contiguous tensors of one shape;
the math is fp32 and each output is rounded once to the input dtype, in every backend, so a
recompute in backward reproduces the forward exactly.
"""

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from remat import _extension
from remat.ops.device import on_tensor_device

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


class MLPOps(NamedTuple):
    """One backend's MLP operators. The fused-GEMM entries (a GEMM with the activation in its
    epilogue and the norm in its prologue) exist only where the backend has such kernels (Triton);
    elsewhere they are None and the Functions run cuBLAS/ATen GEMMs plus the pointwise ops."""

    glu_fwd: object
    glu_bwd: object
    act_fwd: object
    act_bwd: object
    glu_matmul: object = None
    glu_matmul_bwd: object = None
    norm_stats: object = None
    act_matmul: object = None
    act_matmul_bwd: object = None


_INV_SQRT2 = 1 / math.sqrt(2)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_TANH_COEFF = 0.044715


def activate(g, activation):
    """act(g) in fp32 with the formulas of csrc/common/activation.h."""
    if activation == "silu":
        return g / (1 + torch.exp(-g))
    if activation == "gelu":
        return 0.5 * g * (1 + torch.erf(g * _INV_SQRT2))
    if activation != "gelu_tanh":
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    inner = _SQRT_2_OVER_PI * (g + _TANH_COEFF * g * g * g)
    return 0.5 * g * (1 + torch.tanh(inner))


def activate_grad(g, activation):
    """act'(g) in fp32 with the formulas of csrc/common/activation.h."""
    if activation == "silu":
        s = 1 / (1 + torch.exp(-g))
        return s * (1 + g * (1 - s))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(g * _INV_SQRT2))
        return cdf + g * (_INV_SQRT_2PI * torch.exp(-0.5 * g * g))
    if activation != "gelu_tanh":
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    inner = _SQRT_2_OVER_PI * (g + _TANH_COEFF * g * g * g)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * (_SQRT_2_OVER_PI * (1 + 3 * _TANH_COEFF * g * g))


def torch_glu_fwd(gate, up, activation):
    return (activate(gate.float(), activation) * up.float()).to(gate.dtype)


def torch_glu_bwd(dh, gate, up, activation, need_h):
    g, u, d = gate.float(), up.float(), dh.float()
    act = activate(g, activation)
    dgate = (d * u * activate_grad(g, activation)).to(gate.dtype)
    dup = (d * act).to(gate.dtype)
    h = (act * u).to(gate.dtype) if need_h else gate.new_empty(0)
    return dgate, dup, h


def torch_act_fwd(pre, activation):
    return activate(pre.float(), activation).to(pre.dtype)


def torch_act_bwd(dh, pre, activation, need_h):
    p = pre.float()
    dpre = (dh.float() * activate_grad(p, activation)).to(pre.dtype)
    h = activate(p, activation).to(pre.dtype) if need_h else pre.new_empty(0)
    return dpre, h


TORCH_OPS = MLPOps(torch_glu_fwd, torch_glu_bwd, torch_act_fwd, torch_act_bwd)


def _fake_glu_fwd(gate, up, activation):
    return torch.empty_like(gate)


def _fake_glu_bwd(dh, gate, up, activation, need_h):
    return torch.empty_like(gate), torch.empty_like(gate), torch.empty_like(gate) if need_h else gate.new_empty(0)


def _fake_act_fwd(pre, activation):
    return torch.empty_like(pre)


def _fake_act_bwd(dh, pre, activation, need_h):
    return torch.empty_like(pre), torch.empty_like(pre) if need_h else pre.new_empty(0)


EXTENSION_OPS = None
if _extension.LOADED:
    torch.library.register_fake("remat::glu_fwd")(_fake_glu_fwd)
    torch.library.register_fake("remat::glu_bwd")(_fake_glu_bwd)
    torch.library.register_fake("remat::act_fwd")(_fake_act_fwd)
    torch.library.register_fake("remat::act_bwd")(_fake_act_bwd)
    EXTENSION_OPS = MLPOps(torch.ops.remat.glu_fwd, torch.ops.remat.glu_bwd, torch.ops.remat.act_fwd,
                           torch.ops.remat.act_bwd)


@torch.library.custom_op("remat_triton::glu_fwd", mutates_args=())
@on_tensor_device
def triton_glu_fwd(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    from remat.kernels import mlp

    return mlp.glu_fwd(gate, up, activation)


@torch.library.custom_op("remat_triton::glu_bwd", mutates_args=())
@on_tensor_device
def triton_glu_bwd(dh: Tensor, gate: Tensor, up: Tensor, activation: str,
                   need_h: bool) -> tuple[Tensor, Tensor, Tensor]:
    from remat.kernels import mlp

    return mlp.glu_bwd(dh, gate, up, activation, need_h)


@torch.library.custom_op("remat_triton::act_fwd", mutates_args=())
@on_tensor_device
def triton_act_fwd(pre: Tensor, activation: str) -> Tensor:
    from remat.kernels import mlp

    return mlp.act_fwd(pre, activation)


@torch.library.custom_op("remat_triton::act_bwd", mutates_args=())
@on_tensor_device
def triton_act_bwd(dh: Tensor, pre: Tensor, activation: str, need_h: bool) -> tuple[Tensor, Tensor]:
    from remat.kernels import mlp

    return mlp.act_bwd(dh, pre, activation, need_h)


triton_glu_fwd.register_fake(_fake_glu_fwd)
triton_glu_bwd.register_fake(_fake_glu_bwd)
triton_act_fwd.register_fake(_fake_act_fwd)
triton_act_bwd.register_fake(_fake_act_bwd)


@torch.library.custom_op("remat_triton::glu_matmul", mutates_args=())
@on_tensor_device
def triton_glu_matmul(x: Tensor, w_gate: Tensor, w_up: Tensor, activation: str, store_pre: bool, norm: str,
                      mean: Optional[Tensor], rstd: Optional[Tensor], norm_weight: Optional[Tensor],
                      norm_bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Fused dual GEMM: h = act(A Wg^T) * (A Wu^T), gate and up never leaving the kernel unless
    store_pre (then also returned, rounded to x's dtype as the epilogue used them). A is x, or with
    norm "rms" / "layer" the normalized x computed per tile from the given statistics (prologue)."""
    from remat.kernels import matmul

    return matmul.glu_matmul(x, w_gate, w_up, activation, store_pre=store_pre, **_prologue(norm, mean, rstd,
                                                                                           norm_weight, norm_bias))


@triton_glu_matmul.register_fake
def _fake_glu_matmul(x, w_gate, w_up, activation, store_pre, norm, mean, rstd, norm_weight, norm_bias):
    shape = (x.shape[0], w_gate.shape[0])
    pre = x.new_empty(shape) if store_pre else x.new_empty(0)
    return x.new_empty(shape), pre, pre.clone()


@torch.library.custom_op("remat_triton::glu_matmul_bwd", mutates_args=())
@on_tensor_device
def triton_glu_matmul_bwd(x: Tensor, w_gate: Tensor, w_up: Tensor, dh: Tensor, activation: str, need_h: bool,
                          norm: str, mean: Optional[Tensor], rstd: Optional[Tensor], norm_weight: Optional[Tensor],
                          norm_bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The backward recompute of glu_matmul: the same dual GEMM (and prologue), then dgate, dup
    (and h) in the epilogue."""
    from remat.kernels import matmul

    return matmul.glu_matmul_bwd(x, w_gate, w_up, dh, activation, need_h=need_h,
                                 **_prologue(norm, mean, rstd, norm_weight, norm_bias))


@triton_glu_matmul_bwd.register_fake
def _fake_glu_matmul_bwd(x, w_gate, w_up, dh, activation, need_h, norm, mean, rstd, norm_weight, norm_bias):
    return torch.empty_like(dh), torch.empty_like(dh), torch.empty_like(dh) if need_h else dh.new_empty(0)


def _prologue(norm, mean, rstd, norm_weight, norm_bias):
    if norm == "none":
        return {}
    return {"norm": norm, "mean": mean if norm == "layer" else None, "rstd": rstd, "norm_weight": norm_weight,
            "norm_bias": norm_bias}


@torch.library.custom_op("remat_triton::norm_stats", mutates_args=())
@on_tensor_device
def triton_norm_stats(x: Tensor, eps: float, is_rms: bool) -> tuple[Tensor, Tensor]:
    """Per-row (mean, rstd) of x for the matmul's norm prologue, without writing normalized rows."""
    from remat.kernels import norm

    return norm.norm_stats(x, eps, is_rms)


@triton_norm_stats.register_fake
def _fake_norm_stats(x, eps, is_rms):
    rows = x.shape[0]
    return x.new_empty(0 if is_rms else rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("remat_triton::act_matmul", mutates_args=())
@on_tensor_device
def triton_act_matmul(x: Tensor, w: Tensor, b: Optional[Tensor], activation: str,
                      store_pre: bool) -> tuple[Tensor, Tensor]:
    """Fused GEMM with activation epilogue: h = act(x W^T + b); pre returned when store_pre
    (rounded to x's dtype as the epilogue used it)."""
    from remat.kernels import matmul

    return matmul.act_matmul(x, w, b, activation, store_pre=store_pre)


@triton_act_matmul.register_fake
def _fake_act_matmul(x, w, b, activation, store_pre):
    shape = (x.shape[0], w.shape[0])
    return x.new_empty(shape), x.new_empty(shape) if store_pre else x.new_empty(0)


@torch.library.custom_op("remat_triton::act_matmul_bwd", mutates_args=())
@on_tensor_device
def triton_act_matmul_bwd(x: Tensor, w: Tensor, b: Optional[Tensor], dh: Tensor, activation: str,
                          need_h: bool) -> tuple[Tensor, Tensor]:
    """The backward recompute of act_matmul: the same GEMM, then dpre (and h) in the epilogue."""
    from remat.kernels import matmul

    return matmul.act_matmul_bwd(x, w, b, dh, activation, need_h=need_h)


@triton_act_matmul_bwd.register_fake
def _fake_act_matmul_bwd(x, w, b, dh, activation, need_h):
    return torch.empty_like(dh), torch.empty_like(dh) if need_h else dh.new_empty(0)


TRITON_OPS = MLPOps(triton_glu_fwd, triton_glu_bwd, triton_act_fwd, triton_act_bwd, triton_glu_matmul,
                    triton_glu_matmul_bwd, triton_norm_stats, triton_act_matmul, triton_act_matmul_bwd)

# Read by remat.ops.ops_for; None where the extension is not built.
OPS = {"torch": TORCH_OPS, "triton": TRITON_OPS, "cpp": EXTENSION_OPS, "cuda": EXTENSION_OPS}
