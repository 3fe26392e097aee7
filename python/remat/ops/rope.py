"""Rotary embedding applied once to a whole q or k tensor: the rotation that the attention paths
without rope inside their kernels (the aten core, the Triton training path: remat.ops.attention
rotated_once) run before the core and again, inverted, on the core's dq and dk.

``rope_rotate(x, cos, sin, rows, first_position, table_batch_stride, inverse) -> y``

- x ``[B, L, H, D]`` (float32/float16/bfloat16, any strides with unit last stride, D even); y a
  new contiguous ``[B, L, H, D]`` tensor in x's dtype.
- cos, sin: fp32 contiguous ``[R, D/2]`` tables (a ``[1 or B, S, D/2]`` table flattened).
- Token (b, l) uses table row ``rows[b * L + l]`` when ``rows`` (int64 contiguous ``[B * L]``) is
  given, else ``b * table_batch_stride + first_position + l``; the caller keeps rows in range.
- Rotate-half convention on the pair (x1, x2) = (x[d], x[d + D/2]), in fp32: (x1 c - x2 s,
  x2 c + x1 s), or its transpose (x1 c + x2 s, x2 c - x1 s) with ``inverse`` (a gradient mapped
  back to the unrotated input). Each product and sum rounds to fp32 on its own (no FMA) and the
  result once to the dtype: bitwise what the PyTorch expression ``x1 * c - x2 * s`` gives, in every
  implementation.

Implementations, one per device, all bitwise equal: the Triton kernel (kernels/rope_rotate.py)
for CUDA tensors where Triton is installed (compiled at its first call; not under
TRITON_INTERPRET=1, where the tests run it interpreted through :func:`triton_rope_rotate`), so the
aten core on CUDA with rope needs a working Triton too; the C++ kernel of remat._C for CPU
tensors; and :func:`torch_rope_rotate` (plain PyTorch ops: several passes over fp32 temporaries)
elsewhere. :func:`rope_implementation` says which one a
device gets; ``remat info`` prints it.
"""

from typing import Optional

import torch
from torch import Tensor

from remat import _extension
from remat.backend import triton_available, triton_interpreted
from remat.ops.device import on_tensor_device

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_rope_rotate_args(x, cos, sin, rows, first_position, table_batch_stride):
    """Raises ValueError unless the arguments meet the contract in the module docstring (the
    table rows that tokens read are in range when ``rows`` is None; ``rows`` values are the
    caller's)."""
    if x.dim() != 4 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be a float32/float16/bfloat16 [B, L, H, D] tensor, got {x.dtype} {tuple(x.shape)}")
    batch, length, _, head_dim = x.shape
    if head_dim % 2 or (x.numel() and x.stride(-1) != 1):
        raise ValueError(f"x must have an even head dim and unit last stride, got D={head_dim}, stride {x.stride()}")
    for name, table in (("cos", cos), ("sin", sin)):
        if (table.dim() != 2 or table.shape[1] != head_dim // 2 or table.dtype != torch.float32
                or not table.is_contiguous() or table.device != x.device):
            raise ValueError(f"{name} must be a contiguous fp32 [R, D/2 = {head_dim // 2}] tensor on {x.device}, "
                             f"got {table.dtype} {tuple(table.shape)} on {table.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if rows is not None:
        if (rows.shape != (batch * length,) or rows.dtype != torch.int64 or not rows.is_contiguous()
                or rows.device != x.device):
            raise ValueError(f"rows must be a contiguous int64 [B * L = {batch * length}] tensor on {x.device}, "
                             f"got {rows.dtype} {tuple(rows.shape)} with stride {rows.stride()} on {rows.device}")
        return
    if first_position < 0 or table_batch_stride < 0:
        raise ValueError(f"first_position and table_batch_stride must be >= 0, got {first_position}, "
                         f"{table_batch_stride}")
    last_row = (batch - 1) * table_batch_stride + first_position + length - 1
    if batch and length and last_row >= cos.shape[0]:
        raise ValueError(f"the tables have {cos.shape[0]} rows; tokens read up to row {last_row}")


def torch_rope_rotate(x, cos, sin, rows, first_position, table_batch_stride, inverse):
    """The plain-PyTorch rotation (the reference the kernels equal bitwise)."""
    batch, length, heads, head_dim = x.shape
    half = head_dim // 2
    if rows is None:
        positions = torch.arange(length, device=x.device) + first_position
        rows = (torch.arange(batch, device=x.device)[:, None] * table_batch_stride + positions).reshape(-1)
    c = cos[rows].view(batch, length, 1, half)
    s = sin[rows].view(batch, length, 1, half)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    if inverse:
        y = torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], dim=-1)
    else:
        y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return y.to(x.dtype).contiguous()


def _fake_rope_rotate(x, cos, sin, rows, first_position, table_batch_stride, inverse):
    return x.new_empty(x.shape)


EXTENSION_ROPE_ROTATE = None
if _extension.LOADED:
    torch.library.register_fake("remat::rope_rotate")(_fake_rope_rotate)
    EXTENSION_ROPE_ROTATE = torch.ops.remat.rope_rotate


@torch.library.custom_op("remat_triton::rope_rotate", mutates_args=())
@on_tensor_device
def triton_rope_rotate(x: Tensor, cos: Tensor, sin: Tensor, rows: Optional[Tensor], first_position: int,
                       table_batch_stride: int, inverse: bool) -> Tensor:
    from remat.kernels import rope_rotate

    return rope_rotate.rope_rotate(x, cos, sin, rows, first_position, table_batch_stride, inverse)


triton_rope_rotate.register_fake(_fake_rope_rotate)


def rope_implementation(device):
    """Which implementation rotates tensors on ``device``: "triton", "cpp" or "torch" (see the
    module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" and triton_available() and not triton_interpreted():
        return "triton"
    if device.type == "cpu" and _extension.LOADED:
        return "cpp"
    return "torch"


_IMPLEMENTATIONS = {"triton": triton_rope_rotate, "torch": torch_rope_rotate}


def rope_rotate(x, cos, sin, rows=None, first_position=0, table_batch_stride=0, inverse=False):
    """x ``[B, L, H, D]`` rotated (or, ``inverse``, rotated back) with the tables' rows of its
    tokens, as a new contiguous tensor in x's dtype; the contract is in the module docstring.
    Checks its arguments (ValueError) before any kernel runs."""
    check_rope_rotate_args(x, cos, sin, rows, first_position, table_batch_stride)
    implementation = rope_implementation(x.device)
    function = EXTENSION_ROPE_ROTATE if implementation == "cpp" else _IMPLEMENTATIONS[implementation]
    return function(x, cos, sin, rows, first_position, table_batch_stride, inverse)
