"""Drop-in modules with the constructor arguments and state_dict keys of their stock
counterparts, so ``load_state_dict`` from a stock module works, and ``from_module`` converts one.

Mixed precision: when the input's dtype differs from the parameters' (say bf16 activations with
fp32 parameters under autocast), the parameters are cast to the input's dtype inside autograd
(the cast is differentiable, so gradients reach the fp32 parameters), and the norm runs in the
input's dtype with fp32 statistics.
"""

import numbers

import torch
from torch import nn

from remat import functional


def _normalized_shape_tuple(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def _flatten_hidden(x, normalized_shape):
    """[..., *normalized_shape] -> [..., prod(normalized_shape)], checking the trailing dims."""
    k = len(normalized_shape)
    if tuple(x.shape[x.dim() - k:]) != normalized_shape or x.dim() < k:
        raise ValueError(f"input's trailing dimensions must be {normalized_shape}, got shape {tuple(x.shape)}")
    return x.reshape(*x.shape[: x.dim() - k], -1)


def _param_as(p, x):
    if p is None:
        return None
    flat = p if p.dim() == 1 else p.reshape(-1)
    return flat if flat.dtype == x.dtype else flat.to(x.dtype)


class RMSNorm(nn.Module):
    """Drop-in for ``torch.nn.RMSNorm``: same arguments, parameter ``weight``.

    Args:
        normalized_shape: int or tuple, the trailing dimensions normalized over.
        eps: None (default) uses ``torch.finfo(x.dtype).eps`` at call time, as torch does.
        elementwise_affine: learn ``weight`` (initialised to ones).
        backend: remat backend name, or None for the default choice.

    ``forward(x, residual=None)`` returns y, or ``(y, x + residual)`` when a residual is given.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None, *, backend=None):
        super().__init__()
        self.normalized_shape = _normalized_shape_tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.backend = backend
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @classmethod
    def from_module(cls, stock, *, backend=None):
        """A remat RMSNorm sharing ``stock``'s parameter (no copy) and settings."""
        if not isinstance(stock, nn.RMSNorm):
            raise TypeError(f"from_module expects torch.nn.RMSNorm, got {type(stock).__name__}")
        module = cls(stock.normalized_shape, stock.eps, stock.elementwise_affine, device="meta", backend=backend)
        module.weight = stock.weight
        return module

    def forward(self, x, residual=None):
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        flat = _flatten_hidden(x, self.normalized_shape)
        flat_residual = _flatten_hidden(residual, self.normalized_shape) if residual is not None else None
        out = functional.rms_norm(flat, _param_as(self.weight, x), eps, residual=flat_residual, backend=self.backend)
        if residual is None:
            return out.view(x.shape)
        return out[0].view(x.shape), out[1].view(x.shape)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm``: same arguments, parameters ``weight`` and ``bias``.

    Args:
        normalized_shape: int or tuple, the trailing dimensions normalized over.
        eps: default 1e-5.
        elementwise_affine: learn ``weight`` (ones) and, if ``bias``, ``bias`` (zeros).
        bias: learn a bias (default True).
        backend: remat backend name, or None for the default choice.

    ``forward(x, residual=None)`` returns y, or ``(y, x + residual)`` when a residual is given.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None, *, backend=None):
        super().__init__()
        self.normalized_shape = _normalized_shape_tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.backend = backend
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    @classmethod
    def from_module(cls, stock, *, backend=None):
        """A remat LayerNorm sharing ``stock``'s parameters (no copy) and settings."""
        if not isinstance(stock, nn.LayerNorm):
            raise TypeError(f"from_module expects torch.nn.LayerNorm, got {type(stock).__name__}")
        module = cls(stock.normalized_shape, stock.eps, stock.elementwise_affine, bias=stock.bias is not None,
                     device="meta", backend=backend)
        module.weight = stock.weight
        module.bias = stock.bias
        return module

    def forward(self, x, residual=None):
        flat = _flatten_hidden(x, self.normalized_shape)
        flat_residual = _flatten_hidden(residual, self.normalized_shape) if residual is not None else None
        out = functional.layer_norm(flat, _param_as(self.weight, x), _param_as(self.bias, x), self.eps,
                                    residual=flat_residual, backend=self.backend)
        if residual is None:
            return out.view(x.shape)
        return out[0].view(x.shape), out[1].view(x.shape)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
