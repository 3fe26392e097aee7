"""Flash attention as an autograd Function.

Recompute contract (DESIGN.md section 2), checked byte for byte in tests/test_attention.py:

- saved: q, k, v, o, the fp32 logsumexp lse [B, Hq, N], and with dropout the 16-byte int64
  (seed, offset) pair (remat's kernels: drawn here; the aten core: FlashAttention-2's own, see
  attention_rng_state); with rope, the cos and sin tables as passed in (a Hugging Face model passes
  one pair to every layer; remat.nn.Attention and LlamaLayer build their own per call). Nothing of
  size N x M.
- recomputed in the backward kernels: the rotated q and k, the logits and probabilities from q, k
  and lse, the dropout mask from (seed, offset). The Triton backend with rope and a backward to
  come rotates q and k once per pass outside its kernels instead (remat.ops.attention
  rope_rotated_once), into temporaries that are never saved.

Inputs are already [B, N, Hq, D] / [B, M, Hkv, D] with unit last stride (remat.functional checks
and lays them out).
"""

import torch

from remat.autograd.common import (
    draw_rng_state,
    kernel_rope_tables,
    refuse_double_backward,
    without_empty_queries,
    zero_empty_queries_,
)
from remat.ops import ops_for
from remat.ops.attention import rotated_once


def attention_rng_state(backend, device):
    """The 16-byte RNG state a dropout call saves, int64 [2] on ``device``: for remat's kernels a
    (seed, offset) pair drawn here from PyTorch's generator, keying remat's Philox stream; for the
    aten core a buffer its forward fills with the seed and offset FlashAttention-2 drew for itself
    from the same generator (remat.ops.attention, the comment above _FLASH_MAJORS). Either way
    torch.manual_seed and checkpointing's RNG restore reproduce the mask."""
    if backend == "aten":
        return torch.empty(2, dtype=torch.int64, device=device)
    return draw_rng_state(device)


def attention_ops(backend, rotate_once):
    """The attention operators of ``backend``, with rope rotated once per pass outside the kernels
    where ``rotate_once`` (remat.ops.attention.rope_rotated_once, decided by the caller for both
    passes)."""
    ops = ops_for("attention", backend)
    return rotated_once(ops) if rotate_once else ops


class AttentionFunction(torch.autograd.Function):
    """o = softmax(logits(q, k)) v with causal/window masking, softcap, rope and dropout; the
    scalar options are one :class:`remat.options.AttentionOptions`; ``rotate_once``: rope rotated
    once per pass outside the kernels (remat.ops.attention.rope_rotated_once, decided by the caller,
    which knows whether a backward can follow: inside forward grad mode is always off). ``empty``:
    None, or bool ``[B, N]``: queries whose output is 0 and from which no gradient flows (pads; see
    remat.autograd.common.zero_empty_queries_)."""

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, options, backend, rotate_once, empty=None):
        rng = attention_rng_state(backend, q.device) if options.dropout_p > 0 else None
        cos32, sin32 = kernel_rope_tables(cos, sin, q.shape[-1])
        ctx.rotate_once = rotate_once
        o, lse = attention_ops(backend, ctx.rotate_once).attention_fwd(q, k, v, cos32, sin32, rng, *options[:5])
        zero_empty_queries_(o, empty)
        ctx.save_for_backward(q, k, v, o, lse, rng, cos, sin, empty)
        ctx.options, ctx.backend = options, backend
        return o

    @staticmethod
    @refuse_double_backward("remat.attention")
    def backward(ctx, dout):
        q, k, v, o, lse, rng, cos, sin, empty = ctx.saved_tensors
        dout = without_empty_queries(dout, empty)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        cos32, sin32 = kernel_rope_tables(cos, sin, q.shape[-1])
        dq, dk, dv = attention_ops(ctx.backend, ctx.rotate_once).attention_bwd(dout, q, k, v, o, lse, cos32, sin32,
                                                                                rng, *ctx.options)
        return dq, dk, dv, None, None, None, None, None, None


def varlen_rope_tables(cos, sin, head_dim):
    """The caller's rotary tables of a packed call in the layout the varlen kernels take: fp32
    contiguous ``[S, D/2]`` (positions restart per sequence) from ``[S, D/2|D]``, or ``[1, T, D/2]``
    (per packed key token) from ``[1, T, D/2|D]``; (None, None) without rope. Made per call."""
    if cos is None:
        return None, None
    return tuple(t[..., : head_dim // 2].to(torch.float32).contiguous() for t in (cos, sin))


class VarlenAttentionFunction(torch.autograd.Function):
    """Packed (variable-length) attention: q [total_q, Hq, D], k, v [total_k, Hkv, D] holding the
    sequences the int32 offsets cu_seqlens_q / cu_seqlens_k delimit, each attending only within
    itself. Saves what AttentionFunction saves (o, fp32 lse [Hq, total_q]) plus the offsets.
    ``empty``: None, or bool ``[total_q]`` as AttentionFunction's.
    cu_seqlens_k None means cu_seqlens_q's (one tensor, saved once: torch.compile cannot trace
    an autograd.Function given one tensor twice)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, options, backend,
                rotate_once, empty=None):
        rng = attention_rng_state(backend, q.device) if options.dropout_p > 0 else None
        cos32, sin32 = varlen_rope_tables(cos, sin, q.shape[-1])
        offsets_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        ctx.rotate_once = rotate_once
        o, lse = attention_ops(backend, ctx.rotate_once).attention_varlen_fwd(
            q, k, v, cu_seqlens_q, offsets_k, max_seqlen_q, max_seqlen_k, cos32, sin32, rng, *options[:5])
        zero_empty_queries_(o, empty)
        ctx.save_for_backward(q, k, v, o, lse, rng, cos, sin, cu_seqlens_q, cu_seqlens_k, empty)
        ctx.options, ctx.backend, ctx.max_seqlens = options, backend, (max_seqlen_q, max_seqlen_k)
        return o

    @staticmethod
    @refuse_double_backward("remat.attention (packed sequences)")
    def backward(ctx, dout):
        q, k, v, o, lse, rng, cos, sin, cu_seqlens_q, cu_seqlens_k, empty = ctx.saved_tensors
        dout = without_empty_queries(dout, empty)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        cos32, sin32 = varlen_rope_tables(cos, sin, q.shape[-1])
        if cu_seqlens_k is None:
            cu_seqlens_k = cu_seqlens_q
        dq, dk, dv = attention_ops(ctx.backend, ctx.rotate_once).attention_varlen_bwd(
            dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, cos32, sin32, rng, *ctx.options)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None
