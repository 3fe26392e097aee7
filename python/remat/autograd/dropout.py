"""Dropout whose mask is never stored: a Philox4x32-10 stream keyed by a (seed, offset) pair drawn
from PyTorch's generator (the stream of Triton's tl.rand and of csrc/common/philox.h).

Recompute contract: saves the 16-byte int64 (seed, offset) pair only; backward regenerates the
mask by running the same operator on dy. Element i of the (contiguous) input is kept when
uniform(offset + i) >= p.
"""

import torch

from remat.autograd.attention import draw_rng_state
from remat.ops.dropout import op_for


class PhiloxDropoutFunction(torch.autograd.Function):
    """y = x * keep / (1 - p)."""

    @staticmethod
    def forward(ctx, x, p, backend):
        rng = draw_rng_state(x.device)
        ctx.save_for_backward(rng)
        ctx.p, ctx.backend = p, backend
        return op_for(backend)(x, rng, p)

    @staticmethod
    def backward(ctx, dy):
        (rng,) = ctx.saved_tensors
        return op_for(ctx.backend)(dy.contiguous(), rng, ctx.p), None, None
