"""Public dropout: a Philox mask that is never stored."""

import torch

from remat import checks
from remat.autograd.dropout import PhiloxDropoutFunction
from remat.backend import resolve_backend


def dropout(x, p=0.5, training=True, *, backend=None):
    """Dropout that keeps no mask for backward: the mask is a Philox stream keyed by a (seed,
    offset) pair drawn from PyTorch's generator (16 bytes saved), regenerated in backward. Every
    backend draws the same mask for the same generator state.

    Args:
        x: float32, float16 or bfloat16 tensor, any shape (a non-contiguous one is copied first).
        p: drop probability in [0, 1). training: False returns x unchanged (as F.dropout).
        backend: ``"cuda"``, ``"cpp"``, ``"triton"``, ``"torch"`` or None (see remat.backend).

    Returns:
        ``x * keep / (1 - p)``, a new tensor; x itself when not training or p == 0.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in checks.SUPPORTED_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    checks.check_probability(p, "p")
    name = resolve_backend(backend, x)
    if not training or p == 0:
        return x
    return PhiloxDropoutFunction.apply(x.contiguous(), float(p), name)
