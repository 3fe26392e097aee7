"""Pieces the autograd Functions share: linear-layer gradients, the RNG state for Philox dropout,
and the rotary tables in the kernels' layout."""

import torch

# Seeds and offsets are drawn below 2^62, so offset + counter never wraps a uint64.
_RNG_BOUND = 2**62


def linear_grads(grad_out, inp, weight, needs_input, needs_weight, needs_bias):
    """Gradients of out = inp W^T + b for 2-D grad_out [rows, out], inp [rows, in], weight
    [out, in]: (d_inp, dW, db), None where not needed."""
    d_inp = grad_out @ weight if needs_input else None
    d_weight = grad_out.t() @ inp if needs_weight else None
    d_bias = grad_out.sum(0) if needs_bias else None
    return d_inp, d_weight, d_bias


def draw_rng_state(device):
    """(seed, offset) as an int64 [2] tensor drawn from PyTorch's generator for ``device``: no host
    sync, reproducible under torch.manual_seed, and replayed by checkpointing's RNG restore."""
    return torch.randint(0, _RNG_BOUND, (2,), dtype=torch.int64, device=device)


def kernel_rope_tables(cos, sin, head_dim):
    """The caller's rotary tables in the layout the attention kernels take: cos/sin as given
    ([S, D/2], [B, S, D/2], or Hugging Face's [.., S, D] with equal halves, of which the first is
    used) -> fp32 contiguous [1 or B, S, D/2]; (None, None) without rope. Made per call (forward
    and backward), never saved: the caller's tables are."""
    if cos is None:
        return None, None
    tables = []
    for table in (cos, sin):
        table = table[..., : head_dim // 2]
        if table.dim() == 2:
            table = table[None]
        tables.append(table.to(torch.float32).contiguous())
    return tables[0], tables[1]
