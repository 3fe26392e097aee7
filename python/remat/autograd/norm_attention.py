"""The pre-norm attention sub-block of a transformer layer as one autograd Function: norm, the
q/k/v projections, rotary embedding and flash attention, up to the attention output o (the output
projection and the residual add stay outside, as plain autograd ops).

Recompute contract (DESIGN.md section 2), checked byte for byte in tests/models/:

- ``keep_qkv=True`` (layer policies "speed" and "balanced"): saves the sub-block input x, the fp32
  norm statistics, q, k, v (unrotated), o and the fp32 logsumexp (and 16 bytes of RNG state with
  dropout, the caller's cos/sin with rope). Backward recomputes the normalized input (for the
  projection weight gradients), the rotated q/k and the probabilities.
- ``keep_qkv=False`` (policy "memory"): saves x, the statistics, o and lse only; backward also
  recomputes q, k and v with the three projection GEMMs.

Never saved: the normalized input, rotated q/k, the N x M probabilities, a dropout mask.
"""

import torch
import torch.nn.functional as F

from remat.autograd.common import draw_rng_state, kernel_rope_tables, linear_grads
from remat.autograd.norm import norm_backward, norm_forward
from remat.ops import ops_for


def _project(normed, weights, biases, shape):
    """q, k, v = normed @ W^T + b, viewed [B, N, heads, D]."""
    batch, n, hq, hkv, head_dim = shape
    heads = (hq, hkv, hkv)
    return [F.linear(normed, w, b).view(batch, n, h, head_dim) for w, b, h in zip(weights, biases, heads)]


class NormAttentionFunction(torch.autograd.Function):
    """o = attention(rope(norm(x) Wq^T + bq), rope(norm(x) Wk^T + bk), norm(x) Wv^T + bv); the
    non-tensor arguments are one :class:`remat.options.NormAttentionOptions`."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, cos, sin, options, backend):
        shape, attention = options.shape, options.attention
        batch, n, hq, hkv, head_dim = shape
        rows = x.reshape(batch * n, x.shape[-1])
        normed, mean, rstd = norm_forward(rows, norm_weight, norm_bias, options.norm, options.eps,
                                          options.norm_backend)
        q, k, v = _project(normed, (w_q, w_k, w_v), (b_q, b_k, b_v), shape)
        del normed
        rng = draw_rng_state(x.device) if attention.dropout_p > 0 else None
        cos32, sin32 = kernel_rope_tables(cos, sin, head_dim)
        o, lse = ops_for("attention", backend).attention_fwd(q, k, v, cos32, sin32, rng, *attention[:5])
        if not options.keep_qkv:
            q = k = v = None
        ctx.save_for_backward(x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, mean, rstd, q, k, v, o, lse,
                              rng, cos, sin)
        ctx.options, ctx.backend = options, backend
        return o

    @staticmethod
    def backward(ctx, dout):
        (x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, mean, rstd, q, k, v, o, lse, rng, cos,
         sin) = ctx.saved_tensors
        options, backend = ctx.options, ctx.backend
        shape = options.shape
        batch, n, hq, hkv, head_dim = shape
        need = ctx.needs_input_grad
        rows = x.reshape(batch * n, x.shape[-1])
        # The normalized input, recomputed for the projection weight gradients (and for q, k, v
        # under keep_qkv=False), freed before the norm backward.
        normed, _, _ = norm_forward(rows, norm_weight, norm_bias, options.norm, options.eps, options.norm_backend)
        if q is None:
            q, k, v = _project(normed, (w_q, w_k, w_v), (b_q, b_k, b_v), shape)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        cos32, sin32 = kernel_rope_tables(cos, sin, head_dim)
        dq, dk, dv = ops_for("attention", backend).attention_bwd(dout, q, k, v, o, lse, cos32, sin32, rng,
                                                                 *options.attention)
        del q, k, v
        d_normed = None
        grads = []
        for grad, weight, bias, need_w, need_b in ((dq, w_q, b_q, need[3], need[6]), (dk, w_k, b_k, need[4], need[7]),
                                                    (dv, w_v, b_v, need[5], need[8])):
            grad = grad.reshape(batch * n, -1)
            d_in, d_w, d_b = linear_grads(grad, normed, weight, True, need_w, need_b and bias is not None)
            d_normed = d_in if d_normed is None else d_normed + d_in
            grads.append((d_w, d_b))
        del normed
        dx, d_norm_weight, d_norm_bias = norm_backward(d_normed.contiguous(), rows, norm_weight, mean, rstd,
                                                        options.norm, norm_bias is not None, options.norm_backend)
        return (dx.view(x.shape), d_norm_weight if need[1] else None, d_norm_bias if need[2] else None,
                grads[0][0], grads[1][0], grads[2][0], grads[0][1], grads[1][1], grads[2][1],
                None, None, None, None)
