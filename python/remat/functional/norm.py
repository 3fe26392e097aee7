"""Public norm functions: argument checks and reshaping, then the autograd Function."""

from remat import checks
from remat.autograd.norm import LayerNormFunction, RMSNormFunction
from remat.backend import resolve_backend


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
    checks.check_input(x)
    checks.check_vector(weight, "weight", x)
    checks.check_residual(residual, x)
    checks.check_eps(eps)
    name = resolve_backend(backend, x)
    x_rows = checks.as_rows(x)
    residual_rows = checks.as_rows(residual) if residual is not None else None
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
    checks.check_input(x)
    checks.check_vector(weight, "weight", x)
    checks.check_vector(bias, "bias", x)
    checks.check_residual(residual, x)
    checks.check_eps(eps)
    name = resolve_backend(backend, x)
    x_rows = checks.as_rows(x)
    residual_rows = checks.as_rows(residual) if residual is not None else None
    out = LayerNormFunction.apply(x_rows, weight, bias, residual_rows, float(eps), name)
    if residual is None:
        return out.view(x.shape)
    y, h = out
    return y.view(x.shape), h.view(x.shape)
