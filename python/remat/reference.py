"""Plain-PyTorch references, shared by the tests and the benchmarks. Tests run them in float64
on the CPU (DESIGN.md section 7)."""

import torch


def rms_norm_reference(x, weight=None, eps=1e-6, residual=None):
    """RMSNorm over the last dim in x's dtype; returns y, or (y, h) with a residual."""
    h = x + residual if residual is not None else x
    y = h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return (y, h) if residual is not None else y


def layer_norm_reference(x, weight=None, bias=None, eps=1e-5, residual=None):
    """LayerNorm over the last dim (biased variance) in x's dtype; returns y, or (y, h)."""
    h = x + residual if residual is not None else x
    centered = h - h.mean(dim=-1, keepdim=True)
    y = centered * torch.rsqrt(centered.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return (y, h) if residual is not None else y


def stock_rms_norm(x, weight=None, eps=1e-6, residual=None):
    """What a user runs today: torch.nn.functional.rms_norm in x's dtype."""
    h = x + residual if residual is not None else x
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, eps)
    return (y, h) if residual is not None else y


def stock_layer_norm(x, weight=None, bias=None, eps=1e-5, residual=None):
    """What a user runs today: torch.nn.functional.layer_norm in x's dtype."""
    h = x + residual if residual is not None else x
    y = torch.nn.functional.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    return (y, h) if residual is not None else y
