"""Dropout whose mask is never stored: a Philox4x32-10 stream keyed by a (seed, offset) pair drawn
from PyTorch's generator (the stream of Triton's tl.rand and of csrc/common/philox.h).

Recompute contract: saves the 16-byte int64 (seed, offset) pair only; backward regenerates the
mask. Element i of the (contiguous) input is kept when uniform(offset + i) >= p.
"""

import torch

from remat.autograd.attention import draw_rng_state
from remat.reference import philox_randint, philox_uniform


def philox_keep_mask(rng, numel, p, device):
    """Bool [numel]: element i is kept when the Philox uniform for counter rng[1] + i is >= p."""
    counters = torch.arange(numel, dtype=torch.int64, device=device) + rng[1]
    return philox_uniform(philox_randint(rng[0], counters)) >= p


class PhiloxDropoutFunction(torch.autograd.Function):
    """y = x * keep / (1 - p)."""

    @staticmethod
    def forward(ctx, x, p):
        rng = draw_rng_state(x.device)
        keep = philox_keep_mask(rng, x.numel(), p, x.device).view(x.shape)
        ctx.save_for_backward(rng)
        ctx.p = p
        return x * keep.to(x.dtype) / (1.0 - p)

    @staticmethod
    def backward(ctx, dy):
        (rng,) = ctx.saved_tensors
        keep = philox_keep_mask(rng, dy.numel(), ctx.p, dy.device).view(dy.shape)
        return dy * keep.to(dy.dtype) / (1.0 - ctx.p), None
