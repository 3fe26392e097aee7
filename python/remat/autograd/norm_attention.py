"""The pre-norm attention sub-block of a transformer layer as one autograd Function: norm, the
q/k/v projections, the optional per-head q/k norms (Qwen3, Gemma 3), rotary embedding and flash
attention, up to the attention output o (the output projection and the residual add stay
outside, as plain autograd ops).

Recompute contract (DESIGN.md section 2), checked byte for byte in tests/models/:

- ``keep_qkv=True`` (layer policies "speed" and "balanced"): saves the sub-block input x, the fp32
  norm statistics, q, k, v (the projections: unrotated and, with per-head q/k norms, before those
  norms), o and the fp32 logsumexp (and 16 bytes of RNG state with dropout, the caller's cos/sin
  with rope). Backward recomputes the normalized input (for the projection weight gradients), the
  per-head normalized q/k with their statistics, the rotated q/k and the probabilities.
- ``keep_qkv=False`` (policy "memory"): saves x, the statistics, o and lse only; backward also
  recomputes q, k and v with the three projection GEMMs.

Never saved: the normalized input, the per-head normalized q/k or their statistics (recomputed
from the saved or recomputed q/k by the same norm kernel, so bitwise the forward's), rotated q/k,
the N x M probabilities, a dropout mask.

Packed sequences (cu_seqlens, B = 1): the same, plus the int32 offsets [S + 1]; lse is [Hq, T].

Sequence parallelism (``options.sequence_parallel``, remat.sequence_parallel): x is this rank's
shard of n tokens, and the same tensors are saved for those n tokens; lse is the core's,
head-sharded (``[B, Hq / P, P n]``, or ``[Hq / P, T]`` packed: as many bytes). q and k are rotated
with the shard's rope tables before the all-to-all that gives each rank every token of its heads
(the rotated copies and everything an all-to-all makes are temporaries, never saved). Backward
recomputes and re-scatters q, k, v, scatters o and the output gradient, and gathers dq, dk, dv back.
The exchange runs one head chunk at a time (:func:`_head_chunks`). This Function runs sequence
parallelism with keep_qkv=True; with keep_qkv=False remat.autograd.norm_attention_parallel runs
the projections chunk by chunk too (q, k, v and their gradients never whole).

LoRA adapters on q/k/v (remat.autograd.lora) add no per-token bytes: their branches are part of the
kept (or recomputed) q, k, v, their rank-r intermediates are recomputed from the normalized input,
and each adapter with dropout keeps only its 16-byte Philox (seed, offset).
"""

import math

import torch
import torch.nn.functional as F

from remat.autograd import lora, norm_attention_tiled
from remat.autograd.attention import attention_ops, attention_rng_state, varlen_rope_tables
from remat.autograd.common import (
    kernel_rope_tables,
    linear_grads,
    refuse_double_backward,
    without_empty_queries,
    zero_empty_queries_,
)
from remat.autograd.norm import norm_backward, norm_forward
from remat.ops.attention import dense_rope_tables
from remat.ops.rope import rope_rotate
from remat.sequence_parallel import gather_heads, gather_kv_grads, scatter_heads, scatter_kv_heads


def _project(normed, weights, biases, shape, adapters):
    """q, k, v = normed @ W^T + b (+ their LoRA branches), viewed [B, N, heads, D]. adapters:
    (layout, flat tensors, rngs, backend) of remat.autograd.lora."""
    batch, n, hq, hkv, head_dim = shape
    heads = (hq, hkv, hkv)
    return [lora.add_branches(F.linear(normed, w, b), normed, target, *adapters).view(batch, n, h, head_dim)
            for target, (w, b, h) in enumerate(zip(weights, biases, heads))]


def _head_norm(t, weight, options):
    """The per-head norm of q or k ``[B, N, H, D]`` over D (rows [B N H, D] through the norm
    kernels): (normed [B, N, H, D], fp32 rstd [B N H])."""
    rows = t.reshape(-1, t.shape[-1])
    normed, _, rstd = norm_forward(rows, weight, None, options.qk_norm, options.qk_eps, options.norm_backend)
    return normed.view(t.shape), rstd


def _head_norm_backward(grad, t, weight, rstd, options):
    """(d t, d weight) of :func:`_head_norm` from the pre-norm t and its statistics."""
    rows = t.reshape(-1, t.shape[-1])
    dy = grad.reshape(rows.shape)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    d_rows, d_weight, _ = norm_backward(dy, rows, weight, None, rstd, options.qk_norm, False, options.norm_backend)
    return d_rows.view(t.shape), d_weight


def _attention_fwd(q, k, v, cos, sin, cu_seqlens, rng, options, backend, rotate_once):
    """The attention kernels on q, k, v [B, N, heads, D]: dense, or with cu_seqlens (B = 1) packed
    self-attention over the sequences it delimits (o [1, T, Hq, D], lse [Hq, T])."""
    ops = attention_ops(backend, rotate_once)
    if cu_seqlens is None:
        cos32, sin32 = kernel_rope_tables(cos, sin, q.shape[-1])
        return ops.attention_fwd(q, k, v, cos32, sin32, rng, *options.attention[:5])
    cos32, sin32 = varlen_rope_tables(cos, sin, q.shape[-1])
    o, lse = ops.attention_varlen_fwd(q[0], k[0], v[0], cu_seqlens, cu_seqlens, options.max_seqlen, options.max_seqlen,
                                      cos32, sin32, rng, *options.attention[:5])
    return o[None], lse


def _attention_bwd(dout, q, k, v, o, lse, cos, sin, cu_seqlens, rng, options, backend, rotate_once):
    """dq, dk, dv [B, N, heads, D] of :func:`_attention_fwd`."""
    ops = attention_ops(backend, rotate_once)
    if cu_seqlens is None:
        cos32, sin32 = kernel_rope_tables(cos, sin, q.shape[-1])
        return ops.attention_bwd(dout, q, k, v, o, lse, cos32, sin32, rng, *options.attention)
    cos32, sin32 = varlen_rope_tables(cos, sin, q.shape[-1])
    grads = ops.attention_varlen_bwd(dout[0], q[0], k[0], v[0], o[0], lse, cu_seqlens, cu_seqlens, options.max_seqlen,
                                     options.max_seqlen, cos32, sin32, rng, *options.attention)
    return tuple(g[None] for g in grads)


def _rope_on_shard(q, k, cos, sin, inverse=False):
    """q [B, n, Hq, D] and k [B, n, Hkv, D] of a sequence shard rotated (or rotated back) with the
    shard's per-token tables, as new tensors; q, k themselves without rope."""
    if cos is None:
        return q, k
    cos32, sin32 = kernel_rope_tables(cos, sin, q.shape[-1])
    cos32, sin32, batch_stride = dense_rope_tables(cos32, sin32)
    return tuple(rope_rotate(t, cos32, sin32, table_batch_stride=batch_stride, inverse=inverse) for t in (q, k))


def _head_chunks(num_heads, num_kv_heads, size):
    """The head groups the Ulysses exchange runs one at a time: C = gcd(Hq / P, Hkv) chunks of Hq / C
    query heads and their Hkv / C KV heads (each rank gets Hq / (C P) query heads of a chunk and the
    KV heads they read), as (q heads, kv heads) slices. One chunk's exchanged tensors and core
    scratch are 1/C of the whole call's: at Llama-3.1-8B's 32/8 heads over 8 ranks, the scattered
    q, o, output gradient and dq (and the core's fp32 dq accumulator) of 4 chunks of one head per
    rank instead of 4 heads. The price: KV heads shared by several chunks' ranks are sent to each
    (Llama-3.1-8B on 8 ranks: each KV head to 4 ranks, the KV traffic 4x, as large as q's)."""
    chunks = math.gcd(num_heads // size, num_kv_heads)
    q_step, kv_step = num_heads // chunks, num_kv_heads // chunks
    return [(slice(c * q_step, (c + 1) * q_step), slice(c * kv_step, (c + 1) * kv_step)) for c in range(chunks)]


def _chunk_fwd(qkv, cos, sin, cu_seqlens, options, backend):
    """One head chunk of the Ulysses attention: qkv, a list [q_c, k_c, v_c] of this rank's shard
    [B, n, heads of the chunk, D] (q, k before rope), emptied here so that, where the caller passes
    its only references, the shard's copies die once exchanged -> (o of the chunk on the shard [B, n,
    heads, D], the core's lse of the chunk, head-sharded). Rope is applied on the shard, then one
    all-to-all per tensor gives this rank every token of its heads of the chunk, and one brings o
    back."""
    group, size = options.sequence_parallel
    q_c, k_c, v_c = qkv
    qkv.clear()
    q_c, k_c = _rope_on_shard(q_c, k_c, cos, sin)
    q_c, k_c, v_c = (scatter_heads(q_c, group, size), scatter_kv_heads(k_c, group, size),
                     scatter_kv_heads(v_c, group, size))
    o_c, lse_c = _attention_fwd(q_c, k_c, v_c, None, None, cu_seqlens, None, options, backend, False)
    del q_c, k_c, v_c
    return gather_heads(o_c, group, size), lse_c


def _chunk_bwd(dout_c, qkv, o_c, lse_c, cos, sin, cu_seqlens, options, backend):
    """dq, dk, dv of one head chunk on this rank's shard [B, n, heads, D] from :func:`_chunk_fwd`'s
    inputs (qkv, emptied here as there), its o (on the shard) and lse: the forward's all-to-alls
    re-run, o and dout scattered too, the gradients gathered back (the KV replicas' summed) and
    rotated back."""
    group, size = options.sequence_parallel
    q_c, k_c, v_c = qkv
    qkv.clear()
    kv_count = k_c.shape[2]
    q_c, k_c = _rope_on_shard(q_c, k_c, cos, sin)
    q_c, k_c, v_c = (scatter_heads(q_c, group, size), scatter_kv_heads(k_c, group, size),
                     scatter_kv_heads(v_c, group, size))
    dq_c, dk_c, dv_c = _attention_bwd(scatter_heads(dout_c, group, size), q_c, k_c, v_c,
                                      scatter_heads(o_c, group, size), lse_c, None, None, cu_seqlens, None, options,
                                      backend, False)
    del q_c, k_c, v_c
    dq_c = gather_heads(dq_c, group, size)
    dk_c, dv_c = (gather_kv_grads(g, group, size, kv_count) for g in (dk_c, dv_c))
    dq_c, dk_c = _rope_on_shard(dq_c, dk_c, cos, sin, inverse=True)
    return dq_c, dk_c, dv_c


def _lse_chunk(lse, index, count):
    """Chunk ``index`` of ``count`` of the head-sharded lse ([B, h, N] dense, [h, T] packed)."""
    heads = lse.shape[-2] // count
    return lse.narrow(-2, index * heads, heads).contiguous()


def _sequence_parallel_fwd(q, k, v, cos, sin, cu_seqlens, options, backend):
    """:func:`_attention_fwd` over the ranks of ``options.sequence_parallel``, one head chunk at a
    time (:func:`_head_chunks`), for q, k, v kept whole (keep_qkv): q, k, v are this rank's shard
    [B, n, heads, D]; returns o of the shard [B, n, Hq, D] and the core's head-sharded lse (the
    chunks' in order)."""
    o = q.new_empty(q.shape)
    lses = []
    for heads, kv_heads in _head_chunks(q.shape[2], k.shape[2], options.sequence_parallel[1]):
        o[:, :, heads], lse_c = _chunk_fwd([q[:, :, heads], k[:, :, kv_heads], v[:, :, kv_heads]], cos, sin,
                                           cu_seqlens, options, backend)
        lses.append(lse_c)
    return o, lses[0] if len(lses) == 1 else torch.cat(lses, dim=-2)


def _sequence_parallel_bwd(dout, q, k, v, o, lse, cos, sin, cu_seqlens, options, backend):
    """dq, dk, dv of the shard [B, n, heads, D] from :func:`_sequence_parallel_fwd`'s inputs (q, k
    before rope), its o and lse, chunk by chunk (:func:`_chunk_bwd`)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    chunks = _head_chunks(q.shape[2], k.shape[2], options.sequence_parallel[1])
    for index, (heads, kv_heads) in enumerate(chunks):
        dq[:, :, heads], dk[:, :, kv_heads], dv[:, :, kv_heads] = _chunk_bwd(
            dout[:, :, heads], [q[:, :, heads], k[:, :, kv_heads], v[:, :, kv_heads]], o[:, :, heads],
            _lse_chunk(lse, index, len(chunks)), cos, sin, cu_seqlens, options, backend)
    return dq, dk, dv


# The position of the first LoRA tensor among NormAttentionFunction.forward's inputs (after x, the
# ten weights and biases, cos, sin, cu_seqlens, empty, options, backend, rotate_once and lora_layout).
_FIRST_LORA_INPUT = 19


def _accumulate(total, term):
    """``total + term``, in place into ``total`` (a tensor this backward made) when its dtype is the
    promoted one, else out of place (an fp32 LoRA term into bf16 keeps the fp32 sum, as stock's
    autograd does); None terms are skipped."""
    if term is None:
        return total
    if total is None:
        return term
    if torch.promote_types(total.dtype, term.dtype) == total.dtype:
        return total.add_(term)
    return total + term


class NormAttentionFunction(torch.autograd.Function):
    """o = attention(rope(qn(norm(x) Wq^T + bq)), rope(kn(norm(x) Wk^T + bk)), norm(x) Wv^T + bv),
    with qn / kn the optional per-head norms (identity without ``options.qk_norm``); the
    non-tensor arguments are one :class:`remat.options.NormAttentionOptions`. LoRA adapters of the
    q/k/v projections (remat.autograd.lora) come last: their layout, then their flat tensors; their
    branches join the projections, are kept inside q, k, v under keep_qkv and recomputed with them
    otherwise, and their rank-r intermediates are recomputed in backward. ``rotate_once``: rope
    rotated once per pass outside the attention kernels (remat.ops.attention.rope_rotated_once,
    decided by the caller). ``empty``: None, or bool ``[B, N]``: queries whose output is 0 and from
    which no gradient flows (pads; remat.autograd.common.zero_empty_queries_)."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, q_norm_weight, k_norm_weight, cos, sin,
                cu_seqlens, empty, options, backend, rotate_once=False, lora_layout=(), *lora_tensors):
        shape, attention = options.shape, options.attention
        batch, n, hq, hkv, head_dim = shape
        rows = x.reshape(batch * n, x.shape[-1])
        lora_rngs = lora.draw_rngs(lora_layout, x.device)
        adapters = (lora_layout, lora_tensors, lora_rngs, options.norm_backend)
        if options.tile_tokens:
            q, k, v, mean, rstd = norm_attention_tiled.project_tiled(rows, norm_weight, norm_bias, (w_q, w_k, w_v),
                                                                     (b_q, b_k, b_v), shape, adapters, options)
        else:
            normed, mean, rstd = norm_forward(rows, norm_weight, norm_bias, options.norm, options.eps,
                                              options.norm_backend)
            q, k, v = _project(normed, (w_q, w_k, w_v), (b_q, b_k, b_v), shape, adapters)
            del normed
        q_in, k_in = q, k
        if options.qk_norm is not None:
            q_in, _ = _head_norm(q, q_norm_weight, options)
            k_in, _ = _head_norm(k, k_norm_weight, options)
        rng = attention_rng_state(backend, x.device) if attention.dropout_p > 0 else None
        ctx.rotate_once = rotate_once
        if options.sequence_parallel is None:
            o, lse = _attention_fwd(q_in, k_in, v, cos, sin, cu_seqlens, rng, options, backend, ctx.rotate_once)
        else:
            o, lse = _sequence_parallel_fwd(q_in, k_in, v, cos, sin, cu_seqlens, options, backend)
        zero_empty_queries_(o, empty)
        del q_in, k_in
        if not options.keep_qkv:
            q = k = v = None
        ctx.save_for_backward(x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, q_norm_weight, k_norm_weight,
                              mean, rstd, q, k, v, o, lse, rng, cos, sin, cu_seqlens, empty, *lora_tensors,
                              *lora_rngs)
        ctx.options, ctx.backend, ctx.lora_layout = options, backend, lora_layout
        return o

    @staticmethod
    @refuse_double_backward("remat.norm_attention")
    def backward(ctx, dout):
        if ctx.options.tile_tokens:
            return norm_attention_tiled.backward_tiled(ctx, ctx.saved_tensors, dout, _head_norm, _head_norm_backward,
                                                       _FIRST_LORA_INPUT)
        (x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, q_norm_weight, k_norm_weight, mean, rstd, q, k, v, o,
         lse, rng, cos, sin, cu_seqlens, empty, *lora_saved) = ctx.saved_tensors
        options, backend, lora_layout = ctx.options, ctx.backend, ctx.lora_layout
        lora_count = lora.TENSORS_PER_ADAPTER * len(lora_layout)
        adapters = (lora_layout, lora_saved[:lora_count], lora_saved[lora_count:], options.norm_backend)
        shape = options.shape
        batch, n, hq, hkv, head_dim = shape
        need = ctx.needs_input_grad
        rows = x.reshape(batch * n, x.shape[-1])
        # The normalized input, recomputed for the projection weight gradients (and for q, k, v
        # under keep_qkv=False), freed before the norm backward. With q, k, v kept it is first needed
        # after the attention backward and made only then (so, under sequence parallelism, it is not
        # held through the attention's exchanges).
        normed = None
        if q is None:
            normed, _, _ = norm_forward(rows, norm_weight, norm_bias, options.norm, options.eps, options.norm_backend)
            q, k, v = _project(normed, (w_q, w_k, w_v), (b_q, b_k, b_v), shape, adapters)
        q_in, k_in = q, k
        if options.qk_norm is not None:
            # The per-head norms and their statistics, recomputed from the pre-norm q and k.
            q_in, q_rstd = _head_norm(q, q_norm_weight, options)
            k_in, k_rstd = _head_norm(k, k_norm_weight, options)
        dout = without_empty_queries(dout, empty)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        if options.sequence_parallel is None:
            dq, dk, dv = _attention_bwd(dout, q_in, k_in, v, o, lse, cos, sin, cu_seqlens, rng, options, backend,
                                        ctx.rotate_once)
        else:
            dq, dk, dv = _sequence_parallel_bwd(dout, q_in, k_in, v, o, lse, cos, sin, cu_seqlens, options, backend)
        del q_in, k_in, v
        d_q_norm = d_k_norm = None
        if options.qk_norm is not None:
            dq, d_q_norm = _head_norm_backward(dq, q, q_norm_weight, q_rstd, options)
            dk, d_k_norm = _head_norm_backward(dk, k, k_norm_weight, k_rstd, options)
        del q, k
        if normed is None:
            normed, _, _ = norm_forward(rows, norm_weight, norm_bias, options.norm, options.eps, options.norm_backend)
        d_normed = None
        grads, lora_grads = [], {}
        # Each projection's gradient is released once used, and the input gradients are summed in
        # place where the sum's dtype holds the term's (fresh GEMM outputs, never a caller's tensor): at
        # most one [tokens, hidden] term beside the running sum.
        projection_grads = [dq, dk, dv]
        del dq, dk, dv
        for target, (weight, bias, need_w, need_b) in enumerate(
                ((w_q, b_q, need[3], need[6]), (w_k, b_k, need[4], need[7]), (w_v, b_v, need[5], need[8]))):
            grad = projection_grads[target].reshape(batch * n, -1)
            projection_grads[target] = None
            d_in, d_w, d_b = linear_grads(grad, normed, weight, True, need_w, need_b and bias is not None)
            d_lora, target_grads = lora.branch_grads(grad, normed, target, *adapters[:3], need[_FIRST_LORA_INPUT:],
                                                     adapters[3])
            del grad
            d_in = _accumulate(d_in, d_lora)
            del d_lora
            lora_grads.update(target_grads)
            d_normed = _accumulate(d_normed, d_in)
            del d_in
            grads.append((d_w, d_b))
        del normed
        dx, d_norm_weight, d_norm_bias = norm_backward(d_normed.contiguous(), rows, norm_weight, mean, rstd,
                                                        options.norm, norm_bias is not None, options.norm_backend)
        return (dx.view(x.shape), d_norm_weight if need[1] else None, d_norm_bias if need[2] else None,
                grads[0][0], grads[1][0], grads[2][0], grads[0][1], grads[1][1], grads[2][1],
                d_q_norm if need[9] else None, d_k_norm if need[10] else None, None, None, None, None, None, None,
                None, None, *lora.grads_tuple(lora_grads, lora_count))
