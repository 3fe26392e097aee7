"""Drop-in norm modules with the constructor arguments and state_dict keys of torch.nn.RMSNorm and
torch.nn.LayerNorm (``load_state_dict`` from a stock module works; ``from_module`` converts one),
and Gemma's RMSNorm (:class:`GemmaRMSNorm`, Hugging Face's Gemma2RMSNorm / Gemma3RMSNorm layout).

Mixed precision: when the input's dtype differs from the parameters' (say bf16 activations with
fp32 parameters under autocast), the parameters are cast to the input's dtype inside autograd
(the cast is differentiable, so gradients reach the fp32 parameters), and the norm runs in the
input's dtype with fp32 statistics.
"""

import torch
from torch import nn

from remat import checks, functional
from remat.autograd.common import refuse_double_backward
from remat.autograd.norm import norm_backward, norm_forward
from remat.backend import resolve_backend
from remat.hf import is_hf_rms_norm


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
        if eps is not None:
            checks.check_eps(eps)
        self.normalized_shape = checks.normalized_shape_tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.backend = backend
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @classmethod
    def from_module(cls, stock, *, backend=None):
        """A remat RMSNorm sharing ``stock``'s parameter (no copy) and settings: a
        ``torch.nn.RMSNorm``, or a Hugging Face RMSNorm (a 1-D ``weight`` and ``variance_epsilon``,
        as LlamaRMSNorm, MistralRMSNorm and Qwen2RMSNorm have)."""
        if isinstance(stock, nn.RMSNorm):
            module = cls(stock.normalized_shape, stock.eps, stock.elementwise_affine, device="meta", backend=backend)
        elif is_hf_rms_norm(stock):
            module = cls(stock.weight.shape[0], float(stock.variance_epsilon), device="meta", backend=backend)
        else:
            raise TypeError("from_module expects torch.nn.RMSNorm or a Hugging Face RMSNorm, got "
                            f"{type(stock).__name__}")
        module.weight = stock.weight
        return module

    def forward(self, x, residual=None):
        checks.check_input(x)
        eps = self.eps_for(x)
        flat = checks.flatten_hidden(x, self.normalized_shape)
        flat_residual = checks.flatten_hidden(residual, self.normalized_shape) if residual is not None else None
        out = functional.rms_norm(flat, checks.vector_like(self.weight, x), eps, residual=flat_residual,
                                  backend=self.backend)
        if residual is None:
            return out.view(x.shape)
        return out[0].view(x.shape), out[1].view(x.shape)

    def eps_for(self, x):
        """The epsilon used for input x: ``eps``, or torch.finfo(x.dtype).eps when it is None."""
        return float(self.eps if self.eps is not None else torch.finfo(x.dtype).eps)

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

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None, *,
                 backend=None):
        super().__init__()
        checks.check_eps(eps)
        self.normalized_shape = checks.normalized_shape_tuple(normalized_shape)
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
        flat = checks.flatten_hidden(x, self.normalized_shape)
        flat_residual = checks.flatten_hidden(residual, self.normalized_shape) if residual is not None else None
        out = functional.layer_norm(flat, checks.vector_like(self.weight, x), checks.vector_like(self.bias, x),
                                    self.eps,
                                    residual=flat_residual, backend=self.backend)
        if residual is None:
            return out.view(x.shape)
        return out[0].view(x.shape), out[1].view(x.shape)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class _GemmaRMSNormFunction(torch.autograd.Function):
    """y = x_hat * (1 + w), in fp32, rounded once to x's dtype (remat.autograd.norm.norm_forward
    with norm="gemma"). Saves x (rows [R, C]) and the fp32 rstd [R]; backward recomputes x_hat."""

    @staticmethod
    def forward(ctx, x, weight, eps, backend):
        y, _, rstd = norm_forward(x, weight, None, "gemma", eps, backend)
        ctx.save_for_backward(x, weight, rstd)
        ctx.backend = backend
        return y

    @staticmethod
    @refuse_double_backward("remat's Gemma RMSNorm")
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx, dw, _ = norm_backward(dy, x, weight, None, rstd, "gemma", False, ctx.backend)
        return dx, dw if weight is not None and ctx.needs_input_grad[1] else None, None, None


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm with Hugging Face's ``Gemma2RMSNorm`` / ``Gemma3RMSNorm`` parameter (``weight``,
    initialised to zeros) and arithmetic: ``y = x * rsqrt(mean(x^2) + eps) * (1 + weight)``, all in
    fp32 and rounded once to x's dtype. Runs remat's norm kernels (every backend) on an fp32 copy of
    the rows with the fp32 weight ``1 + weight`` (the kernels take a weight in the input's dtype,
    where ``1 + weight`` would round); keeps x and an fp32 rstd per row for backward.

    Args:
        dim: the normalized (last) dimension. eps: default 1e-6. backend: remat backend or None.
    """

    def __init__(self, dim, eps=1e-6, device=None, dtype=None, *, backend=None):
        super().__init__()
        checks.check_eps(eps)
        self.eps, self.backend = float(eps), backend
        self.weight = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    @classmethod
    def from_module(cls, stock, *, backend=None):
        """A GemmaRMSNorm sharing the weight (no copy) of a Hugging Face Gemma2RMSNorm or
        Gemma3RMSNorm (a 1-D ``weight`` and ``eps``)."""
        if not is_gemma_rms_norm(stock):
            raise TypeError(f"from_module expects a Gemma RMSNorm (a 1-D weight and eps), got {type(stock).__name__}")
        module = cls(stock.weight.shape[0], float(stock.eps), device="meta", backend=backend)
        module.weight = stock.weight
        return module

    def eps_for(self, x):
        """The epsilon (one for every dtype)."""
        return self.eps

    def forward(self, x):
        checks.check_input(x)
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"x's last dimension must be {self.weight.shape[0]}, got shape {tuple(x.shape)}")
        name = resolve_backend(self.backend, x)
        (rows, weight), autocast_off = checks.autocast_cast(checks.as_rows(x), checks.vector_like(self.weight, x))
        with autocast_off:
            y = _GemmaRMSNormFunction.apply(rows, weight, self.eps, name)
        return y.view(x.shape)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def is_gemma_rms_norm(module):
    """A Hugging Face Gemma RMSNorm: a 1-D ``weight`` Parameter and ``eps`` (no ``variance_epsilon``)."""
    weight = getattr(module, "weight", None)
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1 and isinstance(getattr(module, "eps", None), float)
            and not hasattr(module, "variance_epsilon"))
