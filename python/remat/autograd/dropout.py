"""Dropout whose mask is never stored: a Philox4x32-10 stream keyed by a (seed, offset) pair drawn
from PyTorch's generator (csrc/common/philox.h, remat.reference.dropout_keep; Triton's
tl.randint4x words).

Recompute contract: saves the 16-byte int64 (seed, offset) pair only; backward regenerates the
mask by running the same operator on dy. Element i of the (contiguous) input is kept when the
uniform of word i % 4 of the Philox call at counter offset + i // 4 is >= p (one call per four
elements: a call over n elements reads counters offset .. offset + ceil(n / 4) - 1).
"""

import torch

from remat.autograd.common import draw_rng_state, refuse_double_backward
from remat.ops import ops_for


class PhiloxDropoutFunction(torch.autograd.Function):
    """y = x * keep / (1 - p)."""

    @staticmethod
    def forward(ctx, x, p, backend):
        rng = draw_rng_state(x.device)
        ctx.save_for_backward(rng)
        ctx.p, ctx.backend = p, backend
        return ops_for("dropout", backend).philox_dropout(x, rng, p)

    @staticmethod
    @refuse_double_backward("remat.dropout")
    def backward(ctx, dy):
        (rng,) = ctx.saved_tensors
        return ops_for("dropout", ctx.backend).philox_dropout(dy.contiguous(), rng, ctx.p), None, None
