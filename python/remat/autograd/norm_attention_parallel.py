"""The attention sub-block under sequence parallelism with keep_qkv=False (layer policy "memory";
remat.sequence_parallel), one head chunk at a time from projection to exchanged output, and
optionally with the attention output projection (o_proj) fused in.

Why a Function of its own: at a million tokens per rank a ``[n, hidden]`` tensor is 8 GiB, and
the whole-tensor path (remat.autograd.norm_attention) holds at its backward peak the shard's q, k,
v and dq, dk, dv (three such tensors at Llama-3.1-8B's shapes) beside the kept o, the incoming
output gradient, the layer input and the residual gradient. Here the Ulysses exchange's head chunks
(norm_attention._head_chunks: gcd(Hq / P, Hkv) of them) are also the projections' unit: a chunk's
q, k, v are projected from the normalized input (the output features of Wq, Wk, Wv, and of each LoRA
B, that make the chunk's heads), exchanged, attended, and in backward their gradients consumed
(the input gradient summed into d normed by one GEMM, the weight gradients of those features) before
the next chunk. With the output projection fused (``w_o``), the gradient of o is made one chunk at
a time from the output's gradient (``dy @ W_o[:, chunk]`` plus the LoRA term), so it never exists
whole either: the caller's output gradient is the residual stream's, which autograd holds anyway.

Recompute contract (DESIGN.md section 2), the same bytes as NormAttentionFunction with
keep_qkv=False for the shard's n tokens: x, the fp32 norm statistics, o ``[B, n, Hq, D]`` and the
head-sharded lse (``[B, Hq / P, P n]``, ``[Hq / P, T]`` packed), the caller's rope tables and
offsets, 16 bytes of Philox state per LoRA adapter with dropout. The fused output projection's input
is o, already saved: it adds nothing. Recomputed in backward: the normalized input (per chunk for
the projections, once before and once after the chunks for the LoRA branches, per chunk after its
attention backward only for trained projection weights), each chunk's q, k, v with their per-head
norms and rope, their exchanges, the probabilities. Never saved: q, k, v, anything an all-to-all
makes.
"""

import torch
import torch.nn.functional as F

from remat.autograd import lora
from remat.autograd.common import linear_grads, refuse_double_backward
from remat.autograd.norm import norm_backward, norm_forward
from remat.autograd.norm_attention import (
    _accumulate,
    _chunk_bwd,
    _chunk_fwd,
    _head_chunks,
    _head_norm,
    _head_norm_backward,
    _lse_chunk,
)

# LoRA targets of this Function: 0 q, 1 k, 2 v (remat.autograd.lora.LoRASlot) and the fused output
# projection's.
OUT_TARGET = 3
# The position of the first LoRA tensor among ParallelNormAttentionFunction.forward's inputs.
_FIRST_LORA_INPUT = 19


def _normalized(rows, norm_weight, norm_bias, options):
    """The normalized input rows [B n, hidden], recomputed (bitwise the forward's: the same kernel)."""
    return norm_forward(rows, norm_weight, norm_bias, options.norm, options.eps, options.norm_backend)[0]


def _chunk_columns(heads, kv_heads, head_dim):
    """The output features of the q, k and v projections that make one head chunk (slices)."""
    return (slice(heads.start * head_dim, heads.stop * head_dim),
            *[slice(kv_heads.start * head_dim, kv_heads.stop * head_dim)] * 2)


def _project_chunk(normed, weights, biases, columns, shape, adapters):
    """[q, k, v] of one head chunk, [B, n, heads of the chunk, D]: the projections' output features
    ``columns`` (:func:`_chunk_columns`) with their LoRA branches (B and bias cut to those features;
    remat.autograd.lora.output_slice)."""
    batch, n, _, _, head_dim = shape
    layout, tensors, rngs, backend = adapters
    projections = []
    for target, (w, b, cols) in enumerate(zip(weights, biases, columns)):
        base = F.linear(normed, w[cols], None if b is None else b[cols])
        sliced = lora.output_slice(layout, tensors, target, cols)
        projections.append(lora.add_branches(base, normed, target, layout, sliced, rngs, backend).view(
            batch, n, -1, head_dim))
    return projections


def _add_product(total, a, b):
    """``total + a @ b`` (None ``total``: ``a @ b``), in place into ``total`` by one GEMM with the
    sum where the dtypes agree (no ``[rows, hidden]`` temporary beside the sum)."""
    if total is None:
        return a @ b
    if total.dtype == a.dtype == b.dtype:
        return total.addmm_(a, b)
    return _accumulate(total, a @ b)


def _attention_fwd(normed, weights, biases, head_norm_weights, cos, sin, cu_seqlens, adapters, options, backend):
    """o [B, n, Hq, D] of this rank's shard and the head-sharded lse (the chunks' in order), one head
    chunk at a time: its q, k, v projected (:func:`_project_chunk`), per-head normed, and handed to
    norm_attention._chunk_fwd as their only references (they die once exchanged). normed: the
    normalized input rows [B n, hidden]."""
    batch, n, hq, hkv, head_dim = options.shape
    o = normed.new_empty(batch, n, hq, head_dim)
    lses = []
    for heads, kv_heads in _head_chunks(hq, hkv, options.sequence_parallel[1]):
        qkv = _project_chunk(normed, weights, biases, _chunk_columns(heads, kv_heads, head_dim), options.shape,
                             adapters)
        if options.qk_norm is not None:
            for i in (0, 1):
                qkv[i], _ = _head_norm(qkv[i], head_norm_weights[i], options)
        o[:, :, heads], lse_c = _chunk_fwd(qkv, cos, sin, cu_seqlens, options, backend)
        lses.append(lse_c)
    return o, lses[0] if len(lses) == 1 else torch.cat(lses, dim=-2)


class _OutputGradient:
    """The gradient of o, one head chunk at a time: the incoming gradient itself (no output
    projection), or, with the output projection fused, ``dy @ W_o[:, chunk] +`` its LoRA branches'
    term for the chunk's input features (the branches' rank-r intermediate gradients made once)."""

    def __init__(self, dy, w_o, adapters, head_dim):
        self.dy, self.w_o, self.head_dim = dy, w_o, head_dim
        layout, tensors, self.rngs, self.backend = adapters
        self.layout, self.tensors = layout, tensors
        if w_o is not None:
            self.rows = dy.reshape(-1, dy.shape[-1])
            self.d_intermediates = lora.intermediate_grads(self.rows, OUT_TARGET, layout, tensors)

    def chunk(self, heads):
        """The gradient of o's heads ``heads`` (a slice), [B, n, heads, D]."""
        if self.w_o is None:
            return self.dy[:, :, heads]
        columns = slice(heads.start * self.head_dim, heads.stop * self.head_dim)
        grad = self.rows @ self.w_o[:, columns]
        lora.add_input_grad_columns(grad, self.d_intermediates, columns, self.layout, self.tensors, self.rngs,
                                    self.backend)
        return grad.view(*self.dy.shape[:2], -1, self.head_dim)

    def weight_grads(self, o, w_o, b_o, need, lora_needs):
        """(d W_o, d b_o, {LoRA flat index: gradient}) of the output projection from the kept o."""
        o_rows = o.reshape(self.rows.shape[0], -1)
        _, d_weight, d_bias = linear_grads(self.rows, o_rows, w_o, False, need[0], b_o is not None and need[1])
        grads = lora.branch_weight_grads(self.rows, o_rows, self.d_intermediates, self.layout, self.tensors, self.rngs,
                                         lora_needs, self.backend)
        return d_weight, d_bias, grads


class ParallelNormAttentionFunction(torch.autograd.Function):
    """out = attention over the sequence group of the shard's q, k, v (as NormAttentionFunction's,
    keep_qkv=False), then ``o W_o^T + b_o`` plus the output projection's LoRA branches when ``w_o``
    is given (``[B, n, out]``), else o ``[B, n, Hq, D]``. The non-tensor arguments are one
    remat.options.NormAttentionOptions (with ``sequence_parallel``); LoRA adapters come last, their
    layout then their flat tensors (targets 0 q, 1 k, 2 v, 3 the output projection). Attention
    dropout, empty queries and tiles are refused by the caller under sequence parallelism."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, q_norm_weight, k_norm_weight, w_o, b_o,
                cos, sin, cu_seqlens, options, backend, lora_layout=(), *lora_tensors):
        batch, n = options.shape[:2]
        rows = x.reshape(batch * n, x.shape[-1])
        lora_rngs = lora.draw_rngs(lora_layout, x.device)
        adapters = (lora_layout, lora_tensors, lora_rngs, options.norm_backend)
        normed, mean, rstd = norm_forward(rows, norm_weight, norm_bias, options.norm, options.eps, options.norm_backend)
        o, lse = _attention_fwd(normed, (w_q, w_k, w_v), (b_q, b_k, b_v), (q_norm_weight, k_norm_weight), cos, sin,
                                cu_seqlens, adapters, options, backend)
        del normed
        out = o
        if w_o is not None:
            o_rows = o.view(batch * n, -1)
            out = lora.add_branches(F.linear(o_rows, w_o, b_o), o_rows, OUT_TARGET, *adapters).view(batch, n, -1)
        ctx.save_for_backward(x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, q_norm_weight, k_norm_weight,
                              w_o, b_o, mean, rstd, o, lse, cos, sin, cu_seqlens, *lora_tensors, *lora_rngs)
        ctx.options, ctx.backend, ctx.lora_layout = options, backend, lora_layout
        return out

    @staticmethod
    @refuse_double_backward("remat.norm_attention")
    def backward(ctx, dy):
        (x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, q_norm_weight, k_norm_weight, w_o, b_o, mean, rstd, o,
         lse, cos, sin, cu_seqlens, *lora_saved) = ctx.saved_tensors
        options, backend, layout = ctx.options, ctx.backend, ctx.lora_layout
        lora_count = lora.TENSORS_PER_ADAPTER * len(layout)
        tensors, rngs = lora_saved[:lora_count], lora_saved[lora_count:]
        adapters = (layout, tensors, rngs, options.norm_backend)
        need = ctx.needs_input_grad
        lora_needs = need[_FIRST_LORA_INPUT:]
        batch, n, hq, hkv, head_dim = options.shape
        rows = x.reshape(batch * n, x.shape[-1])
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        weights, biases, head_norm_weights = (w_q, w_k, w_v), (b_q, b_k, b_v), (q_norm_weight, k_norm_weight)
        d_o = _OutputGradient(dy, w_o, adapters, head_dim)
        chunks = _head_chunks(hq, hkv, options.sequence_parallel[1])
        normed = _normalized(rows, norm_weight, norm_bias, options)
        branches = lora.SlicedBranchGrads(normed, layout, tensors, rngs, lora_needs, options.norm_backend, (0, 1, 2))
        d_normed = None
        projection_grads = [[None, None] for _ in weights]
        head_norm_grads = [None, None]
        for index, (heads, kv_heads) in enumerate(chunks):
            columns = _chunk_columns(heads, kv_heads, head_dim)
            if normed is None:
                normed = _normalized(rows, norm_weight, norm_bias, options)
            attention_in = _project_chunk(normed, weights, biases, columns, options.shape, adapters)
            normed = None
            # Only the per-head norms' backward needs the pre-norm q, k of the chunk: without them
            # the chunk's projections are the core's inputs alone and die once exchanged.
            projections, statistics = list(attention_in), [None, None]
            if options.qk_norm is not None:
                for i in (0, 1):
                    attention_in[i], statistics[i] = _head_norm(projections[i], head_norm_weights[i], options)
            else:
                projections = None
            grads = list(_chunk_bwd(d_o.chunk(heads), attention_in, o[:, :, heads],
                                    _lse_chunk(lse, index, len(chunks)), cos, sin, cu_seqlens, options, backend))
            if options.qk_norm is not None:
                for i in (0, 1):
                    grads[i], d_weight = _head_norm_backward(grads[i], projections[i], head_norm_weights[i],
                                                             statistics[i], options)
                    head_norm_grads[i] = (d_weight.float() if head_norm_grads[i] is None
                                          else head_norm_grads[i].add_(d_weight))
            del projections, statistics
            if any(need[3:6]):  # trained projection weights: their chunk's rows need the normalized input
                normed = _normalized(rows, norm_weight, norm_bias, options)
            for target, cols in enumerate(columns):
                grad = grads[target].reshape(batch * n, -1)
                grads[target] = None
                weight, bias = weights[target], biases[target]
                d_normed = _add_product(d_normed, grad, weight[cols])
                # The chunk's rows of the weight and bias gradients.
                _, *parts = linear_grads(grad, normed, weight[cols], False, need[3 + target],
                                         bias is not None and need[6 + target])
                for slot, (part, whole) in enumerate(zip(parts, (weight, bias))):
                    if part is not None:
                        if projection_grads[target][slot] is None:
                            projection_grads[target][slot] = torch.empty_like(whole)
                        projection_grads[target][slot][cols] = part
                branches.add_slice(grad, target, cols)
                del grad
            normed = None
        lora_grads = {}
        if branches:
            lora_grads = branches.finish(_normalized(rows, norm_weight, norm_bias, options), d_normed)
        d_w_o = d_b_o = None
        if w_o is not None:
            d_w_o, d_b_o, out_grads = d_o.weight_grads(o, w_o, b_o, need[11:13], lora_needs)
            lora_grads.update(out_grads)
        del d_o
        dx, d_norm_weight, d_norm_bias = norm_backward(d_normed, rows, norm_weight, mean, rstd, options.norm,
                                                        norm_bias is not None, options.norm_backend)
        head_norm_grads = [None if g is None or not need[9 + i] else g.to(w.dtype)
                           for i, (g, w) in enumerate(zip(head_norm_grads, head_norm_weights))]
        return (dx.view(x.shape), d_norm_weight if need[1] else None, d_norm_bias if need[2] else None,
                *(g[0] for g in projection_grads), *(g[1] for g in projection_grads), *head_norm_grads, d_w_o, d_b_o,
                None, None, None, None, None, None, *lora.grads_tuple(lora_grads, lora_count))
