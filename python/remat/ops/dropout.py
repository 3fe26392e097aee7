"""The Philox dropout operator of every backend: ``philox_dropout(x, rng, p) -> y`` with
y = keep ? x / (1 - p) : 0, keep(i) = uniform(word i) >= p, word i being word i % 4 of the
Philox4x32-10 call at counter offset + i // 4 (remat.reference.dropout_keep; csrc/common/philox.h,
Triton's tl.randint4x): one call per four elements. rng = int64 [seed, offset], x contiguous. The
division is done in fp32 and rounded once."""

from typing import NamedTuple

import torch
from torch import Tensor

from remat import _extension
from remat.ops.device import on_tensor_device
from remat.reference import dropout_keep


class DropoutOps(NamedTuple):
    philox_dropout: object


def torch_philox_dropout(x, rng, p):
    """The plain-PyTorch version: the Philox stream as int64 tensor arithmetic."""
    keep = dropout_keep(rng[0], rng[1], x.numel(), p, x.device).view(x.shape)
    # A tensor divisor: with a Python number PyTorch's CUDA division multiplies by the reciprocal,
    # which differs from the kernels' IEEE division in the last fp32 bit.
    divisor = torch.full((), 1.0 - p, dtype=torch.float32, device=x.device)
    return torch.where(keep, x.float() / divisor, 0.0).to(x.dtype)


def _fake_philox_dropout(x, rng, p):
    return torch.empty_like(x)


EXTENSION_OPS = None
if _extension.LOADED:
    torch.library.register_fake("remat::philox_dropout")(_fake_philox_dropout)
    EXTENSION_OPS = DropoutOps(torch.ops.remat.philox_dropout)


@torch.library.custom_op("remat_triton::philox_dropout", mutates_args=())
@on_tensor_device
def triton_philox_dropout(x: Tensor, rng: Tensor, p: float) -> Tensor:
    from remat.kernels import dropout

    return dropout.philox_dropout(x, rng, p)


triton_philox_dropout.register_fake(_fake_philox_dropout)


# Read by remat.ops.ops_for; None where the extension is not built.
OPS = {"torch": DropoutOps(torch_philox_dropout), "triton": DropoutOps(triton_philox_dropout),
       "cpp": EXTENSION_OPS, "cuda": EXTENSION_OPS}
