"""MLP blocks as autograd Functions, with a choice of what they keep for backward.

Gated MLP (SwiGLU, GeGLU): gate = x Wg^T (+bg), up = x Wu^T (+bu), h = act(gate) * up,
y = h Wd^T (+bd). GELU MLP (GPT-2): pre = x Wfc^T + bfc, h = gelu(pre), y = h Wproj^T + bproj.

Recompute contract (bytes per token at hidden H, intermediate I, element size e; parameters live
anyway and are not counted), checked byte for byte in tests/test_mlp.py:

| recompute | gated MLP keeps | GELU MLP keeps | backward recomputes |
| --- | --- | --- | --- |
| "none" | x, gate, up, act(gate), h: (H + 4I) e | x, pre, h: (H + 2I) e | act'(.) (as eager does) |
| "activation" | x, gate, up: (H + 2I) e | x, pre: (H + I) e | act(.), act'(.), h |
| "block" | x: H e | x: H e | the up/gate (fc) GEMM, then as above |

"none" keeps the same tensors as eager PyTorch for the same module, as the baseline (h comes
from the fused kernel, rounded once, where eager rounds act(gate) before the product). The backward's
pointwise kernel recomputes act(gate), its derivative and h in one pass (glu_bwd / act_bwd).
With the Triton backend (recompute "activation" or "block"), the gated MLP's gate and up GEMMs
(without biases) run as one fused dual-GEMM kernel whose epilogue applies the activation
(forward) or computes dgate, dup and h (the "block" backward recompute), so gate and up are never
written to memory there; the GELU MLP's fc GEMM runs likewise with a bias + GELU epilogue.
Inputs are already 2-D [tokens, H] (remat.functional reshapes them).
"""

import torch
import torch.nn.functional as F

from remat.autograd import lora
from remat.autograd.common import (
    into_rows,
    linear_grads,
    refuse_double_backward,
    sequence_tiles,
    tiled_rows_backward,
)
from remat.autograd.norm import norm_backward, norm_forward
from remat.ops import ops_for

RECOMPUTE_MODES = ("none", "activation", "block")


class GatedMLPFunction(torch.autograd.Function):
    """y = (act(x Wg^T + bg) * (x Wu^T + bu)) Wd^T + bd, keeping what ``recompute`` says."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, recompute, backend):
        ops = ops_for("mlp", backend)
        fused = _fused_gate_up(ops, recompute, b_gate, b_up)
        if fused:
            h, gate, up = ops.glu_matmul(x, w_gate, w_up, activation, recompute == "activation", "none", None, None,
                                            None, None)
        else:
            gate = F.linear(x, w_gate, b_gate)
            up = F.linear(x, w_up, b_up)
            h = ops.glu_fwd(gate, up, activation)
        y = F.linear(h, w_down, b_down)
        if recompute == "none":
            act = ops.act_fwd(gate, activation)
            ctx.save_for_backward(x, w_gate, w_up, w_down, b_gate, b_up, gate, up, act, h)
        elif recompute == "activation":
            ctx.save_for_backward(x, w_gate, w_up, w_down, b_gate, b_up, gate, up)
        else:
            ctx.save_for_backward(x, w_gate, w_up, w_down, b_gate, b_up)
        ctx.activation, ctx.recompute, ctx.backend, ctx.fused = activation, recompute, backend, fused
        ctx.has_bias = (b_gate is not None, b_up is not None, b_down is not None)
        return y

    @staticmethod
    @refuse_double_backward("remat.gated_mlp")
    def backward(ctx, dy):
        ops = ops_for("mlp", ctx.backend)
        saved = ctx.saved_tensors
        x, w_gate, w_up, w_down, b_gate, b_up = saved[:6]
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        dh = dy @ w_down
        if ctx.recompute == "none":
            gate, up, act, h = saved[6:]
            dup = (dh * act).to(dh.dtype)
            dgate, _ = ops.act_bwd((dh * up).contiguous(), gate, ctx.activation, False)
        elif ctx.recompute == "block" and ctx.fused:
            dgate, dup, h = ops.glu_matmul_bwd(x, w_gate, w_up, dh, ctx.activation, need[3], "none", None, None,
                                                  None, None)
        else:
            if ctx.recompute == "activation":
                gate, up = saved[6:]
            else:
                gate = F.linear(x, w_gate, b_gate)
                up = F.linear(x, w_up, b_up)
            dgate, dup, h = ops.glu_bwd(dh, gate, up, ctx.activation, need[3])
        _, d_w_down, d_b_down = linear_grads(dy, h, w_down, False, need[3], need[6] and ctx.has_bias[2])
        dx_gate, d_w_gate, d_b_gate = linear_grads(dgate, x, w_gate, need[0], need[1], need[4] and ctx.has_bias[0])
        dx_up, d_w_up, d_b_up = linear_grads(dup, x, w_up, need[0], need[2], need[5] and ctx.has_bias[1])
        dx = dx_gate + dx_up if need[0] else None
        return dx, d_w_gate, d_w_up, d_w_down, d_b_gate, d_b_up, d_b_down, None, None, None


def _fused_gate_up(ops, recompute, b_gate, b_up):
    """Whether the gate/up GEMMs run in the backend's fused dual-GEMM kernel, where it has one
    (Triton; it takes no biases; the "none" baseline keeps eager's unfused layout)."""
    return ops.glu_matmul is not None and recompute != "none" and b_gate is None and b_up is None


class GELUMLPFunction(torch.autograd.Function):
    """y = gelu(x Wfc^T + bfc) Wproj^T + bproj, keeping what ``recompute`` says."""

    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, activation, recompute, backend):
        ops = ops_for("mlp", backend)
        # The fused kernel reads w_fc as a contiguous [I, H] matrix; a transposed view (GPT-2's
        # Conv1D layout) takes the cuBLAS GEMM and Triton's activation kernel instead.
        fused = ops.act_matmul is not None and recompute != "none" and w_fc.is_contiguous()
        if fused:
            h, pre = ops.act_matmul(x, w_fc, b_fc, activation, recompute == "activation")
        else:
            pre = F.linear(x, w_fc, b_fc)
            h = ops.act_fwd(pre, activation)
        y = F.linear(h, w_proj, b_proj)
        if recompute == "none":
            ctx.save_for_backward(x, w_fc, b_fc, w_proj, pre, h)
        elif recompute == "activation":
            ctx.save_for_backward(x, w_fc, b_fc, w_proj, pre)
        else:
            ctx.save_for_backward(x, w_fc, b_fc, w_proj)
        ctx.activation, ctx.recompute, ctx.backend, ctx.fused = activation, recompute, backend, fused
        ctx.has_bias = (b_fc is not None, b_proj is not None)
        return y

    @staticmethod
    @refuse_double_backward("remat.gelu_mlp")
    def backward(ctx, dy):
        ops = ops_for("mlp", ctx.backend)
        saved = ctx.saved_tensors
        x, w_fc, b_fc, w_proj = saved[:4]
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        dh = dy @ w_proj
        if ctx.recompute == "none":
            pre, h = saved[4:]
            dpre, _ = ops.act_bwd(dh, pre, ctx.activation, False)
        elif ctx.recompute == "block" and ctx.fused:
            dpre, h = ops.act_matmul_bwd(x, w_fc, b_fc, dh, ctx.activation, need[3])
        else:
            pre = saved[4] if ctx.recompute == "activation" else F.linear(x, w_fc, b_fc)
            dpre, h = ops.act_bwd(dh, pre, ctx.activation, need[3])
        _, d_w_proj, d_b_proj = linear_grads(dy, h, w_proj, False, need[3], need[4] and ctx.has_bias[1])
        dx, d_w_fc, d_b_fc = linear_grads(dpre, x, w_fc, need[0], need[1], need[2] and ctx.has_bias[0])
        return dx, d_w_fc, d_b_fc, d_w_proj, d_b_proj, None, None, None


class NormGatedMLPFunction(torch.autograd.Function):
    """y = GatedMLP(norm(x)): the pre-norm sub-block. With recompute="block" it keeps only x and
    the fp32 norm statistics; the backward recomputes the normalized input with the same norm
    kernel (into a temporary that is freed at once), the up/gate GEMMs from it, and then every
    gradient, the norm's included. With recompute="activation" it also keeps gate and up (no GEMM
    is recomputed; the normalized input still is, for the gate/up weight gradients).

    LoRA adapters of gate/up/down (remat.autograd.lora; layout, then flat tensors, last) join their
    projections: gate and up with theirs are kept or recomputed as above, down's branch is
    applied to h, which backward recomputes anyway; no rank-r intermediate or dropout mask is
    kept (16 bytes of Philox state per adapter with dropout).

    Sequence tiling (``tile`` rows, 0 = none): forward and backward run over tiles of ``tile``
    rows, so no [rows, intermediate] tensor (gate, up, h, their gradients, the normalized input's
    share) exists beyond one tile; y and dx are written tile by tile into whole-size outputs.
    What is kept is unchanged (the statistics and, with "activation", gate and up, written per tile
    into whole-size tensors). Weight gradients are summed over the tiles in fp32 and rounded once.
    Adapters with dropout draw the untiled call's masks: a tile's mask starts at its first row's
    place in the Philox stream (tiles are then a multiple of 4 rows; the caller checks)."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, w_gate, w_up, w_down, b_gate, b_up, b_down,
                norm, eps, activation, recompute, backend, tile=0, lora_layout=(), *lora_tensors):
        ops = ops_for("mlp", backend)
        lora_rngs = lora.draw_rngs(lora_layout, x.device)
        adapters = (lora_layout, lora_tensors, lora_rngs, backend)
        # The fused kernel's prologue computes "rms" and "layer" norms only (not "gemma"'s fp32 1 + w);
        # it has no LoRA branches.
        fused = (_fused_gate_up(ops, "block", b_gate, b_up) and recompute == "block" and norm in ("rms", "layer")
                 and not lora_layout)
        rows = x.shape[0]
        tiles = sequence_tiles(rows, tile)
        if len(tiles) == 1:
            y, mean, rstd, gate, up = _norm_mlp_rows(ops, x, norm_weight, norm_bias, w_gate, w_up, w_down, b_gate,
                                                     b_up, b_down, norm, eps, activation, recompute, fused, adapters)
        else:
            y = x.new_empty(rows, w_down.shape[0])
            gate = up = mean = rstd = None
            for start, end in tiles:
                y_t, mean_t, rstd_t, gate_t, up_t = _norm_mlp_rows(
                    ops, x[start:end], norm_weight, norm_bias, w_gate, w_up, w_down, b_gate, b_up, b_down, norm, eps,
                    activation, recompute, fused, adapters, start)
                y[start:end] = y_t
                del y_t
                mean, rstd, gate, up = (into_rows(whole, part, start, rows) for whole, part in
                                        ((mean, mean_t), (rstd, rstd_t), (gate, gate_t), (up, up_t)))
        if mean is not None and mean.numel() == 0:
            mean = None
        ctx.save_for_backward(x, norm_weight, norm_bias, w_gate, w_up, w_down, b_gate, b_up, mean, rstd, gate, up,
                              *lora_tensors, *lora_rngs)
        ctx.norm, ctx.eps, ctx.activation, ctx.backend, ctx.fused = norm, eps, activation, backend, fused
        ctx.lora_layout, ctx.tile = lora_layout, tile
        # The dtypes of the tiled backward's summed gradients (every tensor input after x).
        ctx.grad_dtypes = tuple(None if t is None else t.dtype for t in (
            norm_weight, norm_bias, w_gate, w_up, w_down, b_gate, b_up, b_down, *(None,) * 7, *lora_tensors))
        ctx.has_bias = (norm_bias is not None, b_gate is not None, b_up is not None, b_down is not None)
        return y

    @staticmethod
    @refuse_double_backward("remat.norm_mlp")
    def backward(ctx, dy):
        x, norm_weight, norm_bias, w_gate, w_up, w_down, b_gate, b_up, mean, rstd, gate, up, *lora_saved = \
            ctx.saved_tensors
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        saved = (x, norm_weight, norm_bias, w_gate, w_up, w_down, b_gate, b_up, mean, rstd, gate, up, lora_saved)
        tiles = sequence_tiles(x.shape[0], ctx.tile)
        if len(tiles) == 1:
            return _norm_mlp_rows_backward(ctx, saved, dy, need)

        def rows_backward(start, end):
            rows = slice(start, end)
            tile_saved = (x[rows], *saved[1:8], *(t[rows] if t is not None else None for t in saved[8:12]), lora_saved)
            return _norm_mlp_rows_backward(ctx, tile_saved, dy[rows], need, start)

        return tiled_rows_backward(x, tiles, need[0], ctx.grad_dtypes, rows_backward)


def _norm_mlp_rows(ops, x, norm_weight, norm_bias, w_gate, w_up, w_down, b_gate, b_up, b_down, norm, eps,
                   activation, recompute, fused, adapters, row_offset=0):
    """The forward of rows x (from row ``row_offset`` of the call): (y, mean, rstd, gate or None,
    up or None), gate/up kept with recompute="activation" only."""
    gate = up = None
    if fused:
        # Statistics only, then the normalized input is computed per tile in the matmul's
        # prologue: it is never written to memory.
        mean, rstd = ops.norm_stats(x, eps, norm == "rms")
        h, _, _ = ops.glu_matmul(x, w_gate, w_up, activation, False, norm, mean, rstd, norm_weight, norm_bias)
    else:
        normed, mean, rstd = norm_forward(x, norm_weight, norm_bias, norm, eps, adapters[3])
        gate, up = _gate_up(normed, w_gate, w_up, b_gate, b_up, adapters, row_offset)
        del normed
        h = ops.glu_fwd(gate, up, activation)
        if recompute == "block":
            gate = up = None
    y = lora.add_branches(F.linear(h, w_down, b_down), h, 2, *adapters, row_offset=row_offset)
    return y, mean, rstd, gate, up


def _norm_mlp_rows_backward(ctx, saved, dy, need, row_offset=0):
    """NormGatedMLPFunction's gradients for rows (from row ``row_offset`` of the call): ``saved``
    holds those rows of x, mean, rstd, gate and up (and the parameters); returns the Function's
    gradient tuple."""
    x, norm_weight, norm_bias, w_gate, w_up, w_down, b_gate, b_up, mean, rstd, gate, up, lora_saved = saved
    ops = ops_for("mlp", ctx.backend)
    lora_count = lora.TENSORS_PER_ADAPTER * len(ctx.lora_layout)
    adapters = (ctx.lora_layout, lora_saved[:lora_count], lora_saved[lora_count:], ctx.backend)
    lora_needs = need[16:]
    # The normalized input, recomputed into a temporary for the gate/up weight gradients and
    # freed below.
    normed, _, _ = norm_forward(x, norm_weight, norm_bias, ctx.norm, ctx.eps, ctx.backend)
    dh = dy @ w_down
    # down's LoRA branches: their share of dh needs no h; their weight gradients wait for h.
    dh_lora, down_intermediates = lora.branch_input_grad(dy, dh.dtype, 2, *adapters[:3], adapters[3], row_offset)
    if dh_lora is not None:
        dh = dh + dh_lora
    del dh_lora
    if ctx.fused:
        dgate, dup, h = ops.glu_matmul_bwd(x, w_gate, w_up, dh, ctx.activation, need[5], ctx.norm, mean, rstd,
                                              norm_weight, norm_bias)
    else:
        if gate is None:
            gate, up = _gate_up(normed, w_gate, w_up, b_gate, b_up, adapters, row_offset)
        dgate, dup, h = ops.glu_bwd(dh, gate, up, ctx.activation, need[5] or bool(down_intermediates))
        del gate, up
    del dh
    _, d_w_down, d_b_down = linear_grads(dy, h, w_down, False, need[5], need[8] and ctx.has_bias[3])
    lora_grads = lora.branch_weight_grads(dy, h, down_intermediates, *adapters[:3], lora_needs, adapters[3],
                                          row_offset)
    del h, down_intermediates
    d_normed_gate, d_w_gate, d_b_gate = linear_grads(dgate, normed, w_gate, True, need[3],
                                                      need[6] and ctx.has_bias[1])
    d_normed_up, d_w_up, d_b_up = linear_grads(dup, normed, w_up, True, need[4], need[7] and ctx.has_bias[2])
    for target in (0, 1):
        d_lora, target_grads = lora.branch_grads(dgate if target == 0 else dup, normed, target, *adapters[:3],
                                                 lora_needs, adapters[3], row_offset)
        if d_lora is not None:
            d_normed_gate = d_normed_gate + d_lora
        del d_lora
        lora_grads.update(target_grads)
    del normed, dgate, dup
    d_normed = (d_normed_gate + d_normed_up).contiguous()
    del d_normed_gate, d_normed_up
    dx, d_norm_weight, d_norm_bias = norm_backward(d_normed, x, norm_weight, mean, rstd, ctx.norm,
                                                     ctx.has_bias[0], ctx.backend)
    return (dx, d_norm_weight if need[1] else None, d_norm_bias if need[2] else None, d_w_gate, d_w_up,
            d_w_down, d_b_gate, d_b_up, d_b_down, None, None, None, None, None, None, None,
            *lora.grads_tuple(lora_grads, lora_count))


def _gate_up(normed, w_gate, w_up, b_gate, b_up, adapters, row_offset=0):
    """gate and up of the normalized input, each with its LoRA branches (targets 0 and 1)."""
    gate = lora.add_branches(F.linear(normed, w_gate, b_gate), normed, 0, *adapters, row_offset=row_offset)
    up = lora.add_branches(F.linear(normed, w_up, b_up), normed, 1, *adapters, row_offset=row_offset)
    return gate, up


class NormGELUMLPFunction(torch.autograd.Function):
    """y = proj(act(fc(norm(x)))): the pre-norm plain (GPT-2) MLP sub-block. Keeps x and the fp32
    norm statistics (recompute="block"; the fc GEMM is recomputed in backward) or also the
    pre-activation (recompute="activation"); the normalized input is always recomputed.

    Sequence tiling (``tile`` rows, 0 = none), as NormGatedMLPFunction's: forward and backward run
    over tiles of rows, so no [rows, intermediate] tensor (fc's output, the activation, their
    gradients) exists beyond one tile; what is kept is unchanged (fc's output, with "activation",
    is written per tile into a whole-size tensor); weight gradients are summed in fp32."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, w_fc, b_fc, w_proj, b_proj, norm, eps, activation, recompute,
                backend, tile=0):
        ops = ops_for("mlp", backend)
        rows = x.shape[0]
        tiles = sequence_tiles(rows, tile)
        if len(tiles) == 1:
            y, mean, rstd, pre = _gelu_mlp_rows(ops, x, norm_weight, norm_bias, w_fc, b_fc, w_proj, b_proj, norm,
                                                eps, activation, recompute, backend)
        else:
            y = x.new_empty(rows, w_proj.shape[0])
            mean = rstd = pre = None
            for start, end in tiles:
                y_t, mean_t, rstd_t, pre_t = _gelu_mlp_rows(ops, x[start:end], norm_weight, norm_bias, w_fc, b_fc,
                                                            w_proj, b_proj, norm, eps, activation, recompute, backend)
                y[start:end] = y_t
                del y_t
                mean, rstd, pre = (into_rows(whole, part, start, rows) for whole, part in
                                   ((mean, mean_t), (rstd, rstd_t), (pre, pre_t)))
        if mean is not None and mean.numel() == 0:
            mean = None
        ctx.save_for_backward(x, norm_weight, norm_bias, w_fc, b_fc, w_proj, mean, rstd, pre)
        ctx.norm, ctx.eps, ctx.activation, ctx.backend, ctx.tile = norm, eps, activation, backend, tile
        ctx.has_bias = (norm_bias is not None, b_fc is not None, b_proj is not None)
        # The dtypes of the tiled backward's summed gradients (every tensor input after x).
        ctx.grad_dtypes = tuple(None if t is None else t.dtype for t in (
            norm_weight, norm_bias, w_fc, b_fc, w_proj, b_proj, *(None,) * 6))
        return y

    @staticmethod
    @refuse_double_backward("remat.norm_gelu_mlp")
    def backward(ctx, dy):
        x, norm_weight, norm_bias, w_fc, b_fc, w_proj, mean, rstd, pre = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        params = (norm_weight, norm_bias, w_fc, b_fc, w_proj)
        tiles = sequence_tiles(x.shape[0], ctx.tile)
        if len(tiles) == 1:
            return _gelu_mlp_rows_backward(ctx, x, *params, mean, rstd, pre, dy, need)

        def rows_backward(start, end):
            rows = slice(start, end)
            return _gelu_mlp_rows_backward(ctx, x[rows], *params, *(None if t is None else t[rows]
                                                                    for t in (mean, rstd, pre)), dy[rows], need)

        return tiled_rows_backward(x, tiles, need[0], ctx.grad_dtypes, rows_backward)


def _gelu_mlp_rows(ops, x, norm_weight, norm_bias, w_fc, b_fc, w_proj, b_proj, norm, eps, activation, recompute,
                   backend):
    """NormGELUMLPFunction's forward of rows x: (y, mean, rstd, fc's output or None), fc's output
    kept with recompute="activation" only."""
    normed, mean, rstd = norm_forward(x, norm_weight, norm_bias, norm, eps, backend)
    pre = F.linear(normed, w_fc, b_fc)
    del normed
    y = F.linear(ops.act_fwd(pre, activation), w_proj, b_proj)
    return y, mean, rstd, pre if recompute == "activation" else None


def _gelu_mlp_rows_backward(ctx, x, norm_weight, norm_bias, w_fc, b_fc, w_proj, mean, rstd, pre, dy, need):
    """NormGELUMLPFunction's gradient tuple for rows x (with those rows of mean, rstd, the kept fc
    output or None, and dy)."""
    ops = ops_for("mlp", ctx.backend)
    # The normalized input, recomputed into a temporary for the fc weight gradient.
    normed, _, _ = norm_forward(x, norm_weight, norm_bias, ctx.norm, ctx.eps, ctx.backend)
    if pre is None:
        pre = F.linear(normed, w_fc, b_fc)
    dpre, h = ops.act_bwd(dy @ w_proj, pre, ctx.activation, need[5])
    del pre
    _, d_w_proj, d_b_proj = linear_grads(dy, h, w_proj, False, need[5], need[6] and ctx.has_bias[2])
    del h
    d_normed, d_w_fc, d_b_fc = linear_grads(dpre, normed, w_fc, True, need[3], need[4] and ctx.has_bias[1])
    del normed, dpre
    dx, d_norm_weight, d_norm_bias = norm_backward(d_normed.contiguous(), x, norm_weight, mean, rstd, ctx.norm,
                                                     ctx.has_bias[0], ctx.backend)
    return (dx, d_norm_weight if need[1] else None, d_norm_bias if need[2] else None, d_w_fc, d_b_fc, d_w_proj,
            d_b_proj, None, None, None, None, None, None)
