"""Flash attention as an autograd Function.

Recompute contract (DESIGN.md section 2), checked byte for byte in tests/test_attention.py:

- saved: q, k, v, o, the fp32 logsumexp lse [B, Hq, N], and with dropout the 16-byte int64
  (seed, offset) pair; with rope, the cos and sin tables as passed in (a Hugging Face model passes
  one pair to every layer; remat.nn.Attention and LlamaLayer build their own per call). Nothing of
  size N x M.
- recomputed in the backward kernels: the rotated q and k, the logits and probabilities from q, k
  and lse, the dropout mask from (seed, offset).

Inputs are already [B, N, Hq, D] / [B, M, Hkv, D] with unit last stride (remat.functional checks
and lays them out).
"""

import torch

from remat.ops.attention import ops_for

# Seeds and offsets are drawn below 2^62, so offset + counter never wraps a uint64.
_RNG_BOUND = 2**62


def rope_tables(cos, sin, head_dim):
    """cos/sin as given by the user ([S, D/2], [B, S, D/2], or Hugging Face's [.., S, D] with equal
    halves, of which the first is used) -> fp32 contiguous [1 or B, S, D/2], or (None, None)."""
    if cos is None:
        return None, None
    tables = []
    for table in (cos, sin):
        table = table[..., : head_dim // 2]
        if table.dim() == 2:
            table = table[None]
        tables.append(table.to(torch.float32).contiguous())
    return tables[0], tables[1]


def draw_rng_state(device):
    """(seed, offset) as an int64 [2] tensor drawn from PyTorch's generator for ``device``: no host
    sync, reproducible under torch.manual_seed, and replayed by checkpointing's RNG restore."""
    return torch.randint(0, _RNG_BOUND, (2,), dtype=torch.int64, device=device)


class AttentionFunction(torch.autograd.Function):
    """o = softmax(logits(q, k)) v with causal/window masking, softcap, rope and dropout."""

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, scale, softcap, window_left, window_right, dropout_p, deterministic, backend):
        ops = ops_for(backend)
        rng = draw_rng_state(q.device) if dropout_p > 0 else None
        cos32, sin32 = rope_tables(cos, sin, q.shape[-1])
        o, lse = ops.attention_fwd(q, k, v, cos32, sin32, rng, scale, softcap, window_left, window_right, dropout_p)
        ctx.save_for_backward(q, k, v, o, lse, rng, cos, sin)
        ctx.options = (scale, softcap, window_left, window_right, dropout_p, deterministic)
        ctx.backend = backend
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse, rng, cos, sin = ctx.saved_tensors
        scale, softcap, window_left, window_right, dropout_p, deterministic = ctx.options
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        cos32, sin32 = rope_tables(cos, sin, q.shape[-1])
        dq, dk, dv = ops_for(ctx.backend).attention_bwd(dout, q, k, v, o, lse, cos32, sin32, rng, scale, softcap,
                                                        window_left, window_right, dropout_p, deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None
