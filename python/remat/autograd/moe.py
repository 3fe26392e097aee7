"""The sparse mixture-of-experts block (router and experts, with the pre-norm fused in) as one
autograd Function, so that the norm's backward runs once on the summed gradient of both.

normed = rmsnorm(x) (or x itself without a norm); router: logits = normed Wr^T (x's dtype),
p = softmax(fp32 logits), (top, indices) = top-k of p, weights = top / sum(top) when
``renormalize``, kept fp32 (``fp32_weights``, Mixtral) or cast to x's dtype (Qwen3-MoE). Experts:
for every expert e with routed rows, x_e = normed[rows of e], y_e = (act(x_e Wg_e^T) * (x_e
Wu_e^T)) Wd_e^T, and out[t] = the sum over t's k choices of weight * y_e[t], accumulated in fp32
and rounded once. Wg_e and Wu_e are the row halves ``gate_up[e, :I]`` and ``gate_up[e, I:]``
(views of the 3-D expert Parameter, never copies). One GEMM per expert on its gathered rows;
experts with no row are skipped; the loop runs over experts, never over tokens.

Recompute contract (bytes per token at hidden H, expert intermediate I, k experts per token,
element size s, routing-weight element size w: 4 with ``fp32_weights``, else s), checked byte for
byte in tests/models/test_mixtral.py and test_qwen3_moe.py:

- "block": keeps x (sH), the fp32 rstd (4), the int64 indices (8k) and the weights (wk): in all
  ``sH + 4 + k(8 + w)``. Backward recomputes normed, each expert's gate/up GEMMs and activation,
  the router logits and softmax.
- "activation": also keeps gate and up of every routed row (``2Iks``). Backward recomputes
  normed, the activation, the router logits and softmax.

The expert input rows are gathered again from the recomputed normed rows in backward instead of
being kept per expert (that would be k times the bytes of x). The routing-weight gradient uses
<dy, y_e> = <dy Wd_e, h_e>, so backward runs no down GEMM beyond the usual two (dh and dWd); the
router GEMM (E x H per token, small next to the experts' 3kIH) runs again in backward. Inputs are
2-D [tokens, H].
"""

import torch
import torch.nn.functional as F

from remat.autograd.common import refuse_double_backward, sequence_tiles
from remat.autograd.mlp import _fused_gate_up
from remat.autograd.norm import norm_backward, norm_forward
from remat.ops import ops_for
from remat.planning.estimator import is_fake, note_assumption

EXPERT_RECOMPUTE_MODES = ("activation", "block")


def _normed(x, norm_weight, eps, backend):
    """(normed rows, fp32 rstd) of x with RMSNorm (eps set), or (x, None) without a norm."""
    if eps is None:
        return x, None
    normed, _, rstd = norm_forward(x, norm_weight, None, "rms", eps, backend)
    return normed, rstd


def _norm_grads(d_normed, x, norm_weight, rstd, eps, backend):
    """(dx, d_norm_weight) through the RMSNorm (x_hat recomputed from x and rstd), or
    (d_normed, None) without a norm."""
    if eps is None:
        return d_normed, None
    dx, d_weight, _ = norm_backward(d_normed.contiguous(), x, norm_weight, None, rstd, "rms", False, backend)
    return dx, d_weight


# What remat.estimate assumes of the routing: fake tensors carry no expert indices to count.
BALANCED_ROUTING = ("mixture-of-experts routing: fake tensors hold no expert indices, so every expert is assumed "
                    "to get an equal share of the (token, choice) pairs (balanced_expert_counts); a real run's "
                    "per-expert temporaries follow its own routing")


def balanced_expert_counts(pairs, num_experts):
    """``pairs`` (token, choice) pairs spread evenly over ``num_experts`` experts (the first
    ``pairs % num_experts`` get one more): a list of E ints. The routing remat.estimate assumes."""
    share, extra = divmod(pairs, num_experts)
    return [share + (expert < extra) for expert in range(num_experts)]


def routed_counts(flat_indices, num_experts):
    """Rows per expert of the flat expert indices [T k]: a list of E Python ints (one host sync)."""
    return torch.bincount(flat_indices, minlength=num_experts).tolist()


def expert_groups(indices, num_experts):
    """The (token, choice) pairs of ``indices`` [T, k] grouped by expert: (positions, counts) with
    positions [T k] the flat pair indices (t k + choice) sorted by expert (stable: by token within
    an expert) and counts a list of E Python ints (rows per expert). On fake tensors (remat.estimate)
    the counts are :func:`balanced_expert_counts`, an assumption the estimate reports."""
    flat = indices.reshape(-1)
    positions = torch.argsort(flat, stable=True)
    if is_fake(flat):
        note_assumption(BALANCED_ROUTING)
        return positions, balanced_expert_counts(flat.numel(), num_experts)
    return positions, routed_counts(flat, num_experts)


def _expert_rows(indices, num_experts):
    """For every expert with routed rows, in expert order: (expert, routed, pairs, rows), where
    ``routed`` is the slice of its pairs in the expert-sorted order (rows of the kept gates/ups),
    ``pairs`` the flat (token, choice) positions routed to it and ``rows`` their token rows."""
    positions, counts = expert_groups(indices, num_experts)
    top_k = indices.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = positions[start:start + count]
        yield expert, slice(start, start + count), pairs, pairs // top_k
        start += count


def _forward_rows(x, norm_weight, w_router, gate_up, down, eps, top_k, renormalize, fp32_weights, activation, fused,
                  ops, gates, ups, backend):
    """The block's forward on rows x [rows, H]: (out [rows, H] in x's dtype, logits, weights,
    indices, fp32 rstd or None). gates/ups: None, or [rows k, I] buffers the "activation" mode fills
    in expert-sorted order."""
    num_experts, inter = gate_up.shape[0], down.shape[2]
    normed, rstd = _normed(x, norm_weight, eps, backend)
    logits = F.linear(normed, w_router)
    top, indices = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    weights = top if fp32_weights else top.to(x.dtype)
    flat_weights = weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert, routed, pairs, rows in _expert_rows(indices, num_experts):
        x_e = normed[rows]
        w_gate, w_up = gate_up[expert, :inter], gate_up[expert, inter:]
        if fused:
            h, _, _ = ops.glu_matmul(x_e, w_gate, w_up, activation, False, "none", None, None, None, None)
        else:
            if gates is not None:
                gate = torch.matmul(x_e, w_gate.t(), out=gates[routed])
                up = torch.matmul(x_e, w_up.t(), out=ups[routed])
            else:
                gate, up = F.linear(x_e, w_gate), F.linear(x_e, w_up)
            h = ops.glu_fwd(gate, up, activation)
        y_e = F.linear(h, down[expert])
        out.index_add_(0, rows, y_e.float() * flat_weights[pairs, None].float())
    return out.to(x.dtype), logits, weights, indices, rstd


class _Grads:
    """Where the backward puts the weight gradients: written once (one tile) in the weights'
    dtype, or summed over token tiles in fp32 (each tile's GEMM rounded once, then added)."""

    def __init__(self, need, gate_up, down, w_router, norm_weight, tiled):
        self.tiled = tiled
        dtype = torch.float32 if tiled else None
        self.gate_up = torch.zeros_like(gate_up, dtype=dtype) if need[3] else None
        self.down = torch.zeros_like(down, dtype=dtype) if need[4] else None
        self.router = torch.zeros_like(w_router, dtype=torch.float32) if need[2] and tiled else None
        self.norm = torch.zeros_like(norm_weight, dtype=torch.float32) if need[1] and tiled else None

    def put(self, buffer, index, value):
        """One expert's gradient block: written (untiled) or added to its fp32 sum (tiled)."""
        if self.tiled:
            buffer[index] += value
        else:
            buffer[index] = value

    def add(self, name, value):
        """Adds one tile's router or norm weight gradient (None: not needed) to its fp32 sum."""
        total = getattr(self, name)
        if total is not None and value is not None:
            total.add_(value)

    def finish(self, gate_up, down):
        """(d gate_up, d down) in the weights' dtype, None where not needed."""
        if not self.tiled:
            return self.gate_up, self.down
        return tuple(None if g is None else g.to(p.dtype)
                     for g, p in ((self.gate_up, gate_up), (self.down, down)))


def _backward_rows(x, dy, d_logits, norm_weight, w_router, gate_up, down, rstd, weights, indices, gates, ups, eps,
                   renormalize, activation, fused, ops, backend, need, grads):
    """The block's backward on rows x [rows, H] with their output gradient dy and the logits'
    gradient d_logits (or None): returns (dx, d_w_router, d_norm_weight) of these rows, the expert
    weight gradients going into ``grads`` (a :class:`_Grads`)."""
    num_experts, inter = gate_up.shape[0], down.shape[2]
    normed, _ = _normed(x, norm_weight, eps, backend)
    flat_weights = weights.reshape(-1)
    dy = dy.contiguous()
    d_normed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    d_flat_weights = torch.zeros(flat_weights.shape, dtype=torch.float32, device=x.device)
    for expert, routed, pairs, rows in _expert_rows(indices, num_experts):
        x_e, dy_e = normed[rows], dy[rows]
        w_e = flat_weights[pairs, None].float()
        w_gate, w_up, w_down = gate_up[expert, :inter], gate_up[expert, inter:], down[expert]
        # g = dy_e Wd: the gradient of the expert's unweighted output at h; dh = weight * g.
        g = dy_e @ w_down
        dh = (g.float() * w_e).to(x.dtype)
        if fused:
            dgate, dup, h = ops.glu_matmul_bwd(x_e, w_gate, w_up, dh, activation, True, "none", None, None, None,
                                               None)
        else:
            if gates is not None:
                gate, up = gates[routed], ups[routed]
            else:
                gate, up = F.linear(x_e, w_gate), F.linear(x_e, w_up)
            dgate, dup, h = ops.glu_bwd(dh, gate, up, activation, True)
        # d weight = <dy_e, y_e> = <dy_e Wd, h>: no recompute of the down GEMM.
        d_flat_weights[pairs] = (g.float() * h.float()).sum(dim=-1)
        if grads.down is not None:
            grads.put(grads.down, expert, (dy_e.float() * w_e).to(x.dtype).t() @ h)
        if grads.gate_up is not None:
            grads.put(grads.gate_up, (expert, slice(None, inter)), dgate.t() @ x_e)
            grads.put(grads.gate_up, (expert, slice(inter, None)), dup.t() @ x_e)
        # One GEMM over [dgate | dup] and the expert's whole [2I, H] slice: one rounding, as stock.
        d_normed.index_add_(0, rows, (torch.cat((dgate, dup), dim=1) @ gate_up[expert]).float())
    # The router: weights -> (renormalized) top-k probabilities -> fp32 softmax -> logits, plus
    # the logits' own gradient (the load-balancing loss); the logits are recomputed.
    logits = F.linear(normed, w_router)
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.gather(1, indices)
    d_top = d_flat_weights.view(indices.shape)
    if renormalize:
        total = top.sum(dim=-1, keepdim=True)
        d_top = (d_top - (d_top * top / total).sum(dim=-1, keepdim=True)) / total
    d_probs = torch.zeros_like(probs).scatter_(1, indices, d_top)
    d_logits_f = probs * (d_probs - (probs * d_probs).sum(dim=-1, keepdim=True))
    if d_logits is not None:
        d_logits_f = d_logits_f + d_logits.float()
    d_logits_total = d_logits_f.to(logits.dtype)
    del logits, probs, d_probs, d_logits_f
    d_w_router = d_logits_total.t() @ normed if need[2] else None
    d_normed += (d_logits_total @ w_router).float()
    dx, d_norm_weight = _norm_grads(d_normed.to(x.dtype), x, norm_weight, rstd, eps, backend)
    return dx, d_w_router, d_norm_weight


class MoEFunction(torch.autograd.Function):
    """(out [T, H], logits [T, E], weights [T, k], indices [T, k]) of the sparse MoE block; see the
    module docstring. gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I], w_router [E, H].
    weights and indices are not differentiable outputs (the weights' gradient flows inside, into
    the logits); logits are (Hugging Face's load-balancing loss differentiates them).

    ``tile`` (0: none; remat.patch(tile_tokens=T)) runs both passes over tiles of tokens: the
    normalized rows, each expert's gathered rows and GEMM temporaries and the fp32 output /
    input-gradient sums exist one tile at a time; the expert, router and norm weight gradients are
    summed over the tiles in fp32 (fp32 [E, 2I, H] and [E, H, I] buffers while the experts train).
    Under "activation" the kept gate and up of a tile's routed rows fill rows [a k, b k) of the
    whole-size buffers in the tile's own expert order, which its backward reads back the same way.
    What is kept is the same either way (the buffers' order differs, not their bytes)."""

    @staticmethod
    def forward(ctx, x, norm_weight, w_router, gate_up, down, eps, top_k, renormalize, fp32_weights, activation,
                recompute, backend, tile=0):
        ops = ops_for("mlp", backend)
        inter = down.shape[2]
        tokens = x.shape[0]
        fused = _fused_gate_up(ops, recompute, None, None) and recompute == "block"
        tiles = sequence_tiles(tokens, tile)
        gates = ups = None
        if recompute == "activation":
            gates, ups = x.new_empty(tokens * top_k, inter), x.new_empty(tokens * top_k, inter)
        args = (norm_weight, w_router, gate_up, down, eps, top_k, renormalize, fp32_weights, activation, fused, ops)
        if len(tiles) == 1:
            out, logits, weights, indices, rstd = _forward_rows(x, *args, gates, ups, backend)
        else:
            out = torch.empty_like(x)
            logits = x.new_empty(tokens, w_router.shape[0])
            weights = torch.empty(tokens, top_k, dtype=torch.float32 if fp32_weights else x.dtype, device=x.device)
            indices = torch.empty(tokens, top_k, dtype=torch.long, device=x.device)
            rstd = None if eps is None else torch.empty(tokens, dtype=torch.float32, device=x.device)
            for start, end in tiles:
                kept = slice(start * top_k, end * top_k)  # the tile's routed rows in the kept buffers
                part = _forward_rows(x[start:end], *args, None if gates is None else gates[kept],
                                     None if ups is None else ups[kept], backend)
                for whole, value in zip((out, logits, weights, indices, rstd), part):
                    if whole is not None:
                        whole[start:end] = value
                del part
        ctx.mark_non_differentiable(weights, indices)
        ctx.save_for_backward(x, norm_weight, w_router, gate_up, down, rstd, weights, indices, gates, ups)
        ctx.eps, ctx.renormalize, ctx.activation, ctx.backend, ctx.fused = eps, renormalize, activation, backend, fused
        ctx.tiles = tiles
        return out, logits, weights, indices

    @staticmethod
    @refuse_double_backward("remat's mixture-of-experts block (remat.nn.moe)")
    def backward(ctx, dy, d_logits, _d_weights, _d_indices):
        x, norm_weight, w_router, gate_up, down, rstd, weights, indices, gates, ups = ctx.saved_tensors
        need = ctx.needs_input_grad
        ops = ops_for("mlp", ctx.backend)
        tiles = ctx.tiles
        grads = _Grads(need, gate_up, down, w_router, norm_weight, len(tiles) > 1)
        options = (ctx.eps, ctx.renormalize, ctx.activation, ctx.fused, ops, ctx.backend, need, grads)
        if len(tiles) == 1:
            dx, d_w_router, d_norm_weight = _backward_rows(x, dy, d_logits, norm_weight, w_router, gate_up, down,
                                                           rstd, weights, indices, gates, ups, *options)
        else:
            dx = torch.empty_like(x)
            top_k = indices.shape[1]
            for start, end in tiles:
                rows, kept = slice(start, end), slice(start * top_k, end * top_k)
                dx[rows], d_w_router, d_norm_weight = _backward_rows(
                    x[rows], dy[rows], d_logits[rows] if d_logits is not None else None, norm_weight, w_router,
                    gate_up, down, rstd[rows] if rstd is not None else None, weights[rows], indices[rows],
                    None if gates is None else gates[kept], None if ups is None else ups[kept], *options)
                grads.add("router", d_w_router)
                grads.add("norm", d_norm_weight)
            d_w_router = grads.router.to(w_router.dtype) if grads.router is not None else None
            d_norm_weight = grads.norm.to(norm_weight.dtype) if grads.norm is not None else None
        d_gate_up, d_down = grads.finish(gate_up, down)
        return (dx if need[0] else None, d_norm_weight if need[1] else None, d_w_router, d_gate_up, d_down,
                None, None, None, None, None, None, None, None)
