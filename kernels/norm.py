"""Triton RMSNorm and LayerNorm kernels that save only the norm input and per-row statistics.

Forward saves h (the norm input: x, or x + residual rounded to x's dtype) plus fp32 rstd (and
mean for LayerNorm) per row. Backward recomputes x_hat = (h - mean) * rstd from those instead of
reading a stored x_hat, and reduces the weight/bias gradients deterministically: program p of P
handles rows p, p + P, ... and writes one fp32 partial row; the launcher sums the P partials with
`partial.sum(0)`, so the result does not depend on scheduling.

Rows up to _MAX_SINGLE_TILE_COLS_FWD (forward) or _MAX_SINGLE_TILE_COLS_BWD (backward) columns
are held whole in registers (SINGLE_TILE); wider rows are processed in column tiles of
_TILED_BLOCK elements, re-reading the input once per pass.
"""

import torch
import triton
import triton.language as tl

from ._common import _INTERPRETED, _round

# Widest rows held whole in registers, in elements whatever the dtype: what fills the register
# file is the fp32 working set (the inputs are upcast on load), not the input bytes. Measured
# with ptxas -v on the sm_80/sm_90 builds of every dtype: the forward holds 16384 columns at 16
# warps in 128 registers per thread without spilling (it spills at 32768); the backward keeps
# about five fp32 values per column live (h, dy, weight, x_hat, the dw accumulator) and holds
# 8192 columns at 16 warps in 128 registers, but spills at 16384 (400-2800 bytes per thread).
# Wider rows are tiled rather than spilled.
_MAX_SINGLE_TILE_COLS_FWD = 16384
_MAX_SINGLE_TILE_COLS_BWD = 8192
# Column tile of the tiled path: 4096 elements over 16 warps is 8 per thread (one 16-byte
# load for 16-bit types, two for fp32), 62-76 registers, no spills; a row's re-read tiles come
# mostly from L2.
_TILED_BLOCK = 4096
# Backward programs per SM: about 16 resident warps each. Every configuration here uses at most
# 128 registers per thread, so 16 warps (64K registers) fit an SM at once and the P programs
# run in one wave; more partials would only grow the [P, cols] sum.
_WARPS_PER_SM = 16
# Backward programs when not on a GPU (the interpreter runs programs one after another).
_CPU_NUM_PARTIALS = 4


def _block_config(n_cols, max_single_tile_cols):
    """(BLOCK, SINGLE_TILE, num_warps) for rows of n_cols elements."""
    block = triton.next_power_of_2(max(n_cols, 1))
    single_tile = block <= max_single_tile_cols
    if not single_tile:
        block = _TILED_BLOCK
    # 256 columns per warp (8 per thread) up to 16 warps, so 16 per thread at 8192 columns and
    # 32 at 16384: 1 to 16 warps.
    num_warps = min(max(block // 256, 1), 16)
    return block, single_tile, num_warps


def _num_partials(n_rows, num_warps, device):
    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        programs = sm_count * max(1, _WARPS_PER_SM // num_warps)
    else:
        programs = _CPU_NUM_PARTIALS
    return max(1, min(n_rows, programs))


@triton.jit
def _load_norm_input(x_ptr, residual_ptr, x_offsets, residual_offsets, mask,
                     HAS_RESIDUAL: tl.constexpr, INTERPRETED: tl.constexpr):
    """h in x's dtype: x, or x + residual added in fp32 and rounded once to x's dtype."""
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + residual_offsets, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + residual.to(tl.float32), x_ptr.dtype.element_ty,
                   INTERPRETED)
    return x


@triton.jit
def _norm_fwd_kernel(
    x_ptr, residual_ptr, weight_ptr, bias_ptr,
    y_ptr, h_ptr, mean_ptr, rstd_ptr,
    n_cols, x_row_stride, residual_row_stride, eps,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, SINGLE_TILE: tl.constexpr,
    INTERPRETED: tl.constexpr, STORE_Y: tl.constexpr,
):
    """One program per row. Stats come from h rounded to x's dtype, as the backward reads it.
    STORE_Y=False computes and stores the statistics only (for consumers that normalize on the
    fly, like the fused matmul's norm prologue)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = row * x_row_stride
    residual_row = row * residual_row_stride
    out_row = row * n_cols
    cols = tl.arange(0, BLOCK)
    if SINGLE_TILE:
        mask = cols < n_cols
        h = _load_norm_input(x_ptr, residual_ptr, x_row + cols, residual_row + cols, mask,
                             HAS_RESIDUAL, INTERPRETED)
        if HAS_RESIDUAL:
            tl.store(h_ptr + out_row + cols, h, mask=mask)
        u = h.to(tl.float32)
        if IS_RMS:
            rstd = 1.0 / tl.sqrt_rn(tl.sum(u * u, axis=0) / n_cols + eps)
            x_hat = u * rstd
        else:
            mean = tl.sum(u, axis=0) / n_cols
            centered = tl.where(mask, u - mean, 0.0)
            rstd = 1.0 / tl.sqrt_rn(tl.sum(centered * centered, axis=0) / n_cols + eps)
            x_hat = centered * rstd
            tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
        if STORE_Y:
            y = x_hat
            if HAS_WEIGHT:
                y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = _round(y, y_ptr.dtype.element_ty, INTERPRETED)
            tl.store(y_ptr + out_row + cols, y, mask=mask)
    else:
        # Wide rows: each pass re-reads x (and residual) tile by tile and recomputes h; the
        # stored h is never read back here. Per-lane fp32 accumulators, reduced once per pass.
        first_moment = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            offsets = start + cols
            mask = offsets < n_cols
            u = _load_norm_input(x_ptr, residual_ptr, x_row + offsets, residual_row + offsets,
                                 mask, HAS_RESIDUAL, INTERPRETED).to(tl.float32)
            if IS_RMS:
                first_moment += u * u
            else:
                first_moment += u
        mean = 0.0  # RMSNorm does not center: y = h * rstd * weight.
        if IS_RMS:
            rstd = 1.0 / tl.sqrt_rn(tl.sum(first_moment, axis=0) / n_cols + eps)
        else:
            mean = tl.sum(first_moment, axis=0) / n_cols
            # Centered second pass: E[(u - mean)^2], not E[u^2] - mean^2, which cancels badly.
            squares = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                offsets = start + cols
                mask = offsets < n_cols
                u = _load_norm_input(x_ptr, residual_ptr, x_row + offsets,
                                     residual_row + offsets, mask, HAS_RESIDUAL, INTERPRETED)
                u = u.to(tl.float32)
                centered = tl.where(mask, u - mean, 0.0)
                squares += centered * centered
            rstd = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / n_cols + eps)
            tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
        if STORE_Y:
            for start in range(0, n_cols, BLOCK):
                offsets = start + cols
                mask = offsets < n_cols
                h = _load_norm_input(x_ptr, residual_ptr, x_row + offsets, residual_row + offsets,
                                     mask, HAS_RESIDUAL, INTERPRETED)
                if HAS_RESIDUAL:
                    tl.store(h_ptr + out_row + offsets, h, mask=mask)
                y = (h.to(tl.float32) - mean) * rstd
                if HAS_WEIGHT:
                    y = y * tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    y = y + tl.load(bias_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                y = _round(y, y_ptr.dtype.element_ty, INTERPRETED)
                tl.store(y_ptr + out_row + offsets, y, mask=mask)


@triton.jit
def _recompute_x_hat(h_ptr, mean_ptr, row, h_offsets, mask, rstd, IS_RMS: tl.constexpr):
    """x_hat recomputed from the saved h and stats; 0 outside the row."""
    h = tl.load(h_ptr + h_offsets, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        x_hat = h * rstd
    else:
        x_hat = tl.where(mask, (h - tl.load(mean_ptr + row)) * rstd, 0.0)
    return x_hat


@triton.jit
def _norm_bwd_kernel(
    dy_ptr, dh_ptr, h_ptr, weight_ptr, mean_ptr, rstd_ptr,
    dx_ptr, dweight_partial_ptr, dbias_partial_ptr,
    n_rows, n_cols, dy_row_stride, dh_row_stride, h_row_stride,
    IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, SINGLE_TILE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program p handles rows p, p + P, ... and writes row p of the [P, n_cols] fp32 partials.

    dx = rstd * (g - x_hat * mean(g * x_hat) [- mean(g) for LayerNorm]) + dh, g = dy * weight,
    rounded once to h's dtype. Only h, mean and rstd are read from the forward.
    """
    program = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    partial_row = program.to(tl.int64) * n_cols
    if SINGLE_TILE:
        mask = cols < n_cols
        weight = tl.full([BLOCK], 1.0, dtype=tl.float32)
        if HAS_WEIGHT:
            weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dweight = tl.zeros([BLOCK], dtype=tl.float32)
        dbias = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(program, n_rows, num_programs):
            row64 = tl.cast(row, tl.int64)
            rstd = tl.load(rstd_ptr + row)
            x_hat = _recompute_x_hat(h_ptr, mean_ptr, row, row64 * h_row_stride + cols, mask,
                                     rstd, IS_RMS)
            dy = tl.load(dy_ptr + row64 * dy_row_stride + cols, mask=mask, other=0.0)
            dy = dy.to(tl.float32)
            g = dy * weight
            dx = g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols)
            if not IS_RMS:
                dx -= tl.sum(g, axis=0) / n_cols
            dx *= rstd
            if HAS_DH:
                dh = tl.load(dh_ptr + row64 * dh_row_stride + cols, mask=mask, other=0.0)
                dx += dh.to(tl.float32)
            dx = _round(dx, dx_ptr.dtype.element_ty, INTERPRETED)
            tl.store(dx_ptr + row64 * n_cols + cols, dx, mask=mask)
            if HAS_WEIGHT:
                dweight += dy * x_hat
            if HAS_BIAS:
                dbias += dy
        if HAS_WEIGHT:
            tl.store(dweight_partial_ptr + partial_row + cols, dweight, mask=mask)
        if HAS_BIAS:
            tl.store(dbias_partial_ptr + partial_row + cols, dbias, mask=mask)
    else:
        # Wide rows, per row: a pass for the two row reductions, then a pass that writes dx.
        for row in range(program, n_rows, num_programs):
            row64 = tl.cast(row, tl.int64)
            rstd = tl.load(rstd_ptr + row)
            sum_g_x_hat = tl.zeros([BLOCK], dtype=tl.float32)
            sum_g = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                offsets = start + cols
                mask = offsets < n_cols
                x_hat = _recompute_x_hat(h_ptr, mean_ptr, row, row64 * h_row_stride + offsets,
                                         mask, rstd, IS_RMS)
                g = tl.load(dy_ptr + row64 * dy_row_stride + offsets, mask=mask, other=0.0)
                g = g.to(tl.float32)
                if HAS_WEIGHT:
                    g *= tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                sum_g_x_hat += g * x_hat
                sum_g += g
            mean_g_x_hat = tl.sum(sum_g_x_hat, axis=0) / n_cols
            mean_g = tl.sum(sum_g, axis=0) / n_cols
            for start in range(0, n_cols, BLOCK):
                offsets = start + cols
                mask = offsets < n_cols
                x_hat = _recompute_x_hat(h_ptr, mean_ptr, row, row64 * h_row_stride + offsets,
                                         mask, rstd, IS_RMS)
                g = tl.load(dy_ptr + row64 * dy_row_stride + offsets, mask=mask, other=0.0)
                g = g.to(tl.float32)
                if HAS_WEIGHT:
                    g *= tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                dx = g - x_hat * mean_g_x_hat
                if not IS_RMS:
                    dx -= mean_g
                dx *= rstd
                if HAS_DH:
                    dh = tl.load(dh_ptr + row64 * dh_row_stride + offsets, mask=mask, other=0.0)
                    dx += dh.to(tl.float32)
                dx = _round(dx, dx_ptr.dtype.element_ty, INTERPRETED)
                tl.store(dx_ptr + row64 * n_cols + offsets, dx, mask=mask)
        # Weight/bias partials, tile-major: one accumulator tile summed over this program's rows,
        # then stored once. The partial rows are only written, never read back, so no ordering
        # between this program's threads is needed; the cost is a third read of h and dy.
        if HAS_WEIGHT or HAS_BIAS:
            for start in range(0, n_cols, BLOCK):
                offsets = start + cols
                mask = offsets < n_cols
                dweight = tl.zeros([BLOCK], dtype=tl.float32)
                dbias = tl.zeros([BLOCK], dtype=tl.float32)
                for row in range(program, n_rows, num_programs):
                    row64 = tl.cast(row, tl.int64)
                    dy = tl.load(dy_ptr + row64 * dy_row_stride + offsets, mask=mask, other=0.0)
                    dy = dy.to(tl.float32)
                    if HAS_WEIGHT:
                        x_hat = _recompute_x_hat(h_ptr, mean_ptr, row,
                                                 row64 * h_row_stride + offsets, mask,
                                                 tl.load(rstd_ptr + row), IS_RMS)
                        dweight += dy * x_hat
                    if HAS_BIAS:
                        dbias += dy
                if HAS_WEIGHT:
                    tl.store(dweight_partial_ptr + partial_row + offsets, dweight, mask=mask)
                if HAS_BIAS:
                    tl.store(dbias_partial_ptr + partial_row + offsets, dbias, mask=mask)


def _check_matrix(name, tensor):
    # A column stride only matters when there is more than one column.
    if tensor.dim() != 2 or (tensor.stride(1) != 1 and tensor.shape[1] > 1):
        raise ValueError(
            f"{name}: expected a 2-D tensor with unit column stride, got shape "
            f"{tuple(tensor.shape)} and strides {tuple(tensor.stride())}")


def _norm_fwd(x, weight, bias, residual, eps, is_rms, store_y=True):
    _check_matrix("x", x)
    if residual is not None:
        _check_matrix("residual", residual)
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols) if store_y else (0,), dtype=x.dtype, device=x.device)
    if residual is not None:
        h = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    else:
        h = torch.empty(0, dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    mean = None if is_rms else torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0 and n_cols > 0:
        block, single_tile, num_warps = _block_config(n_cols, _MAX_SINGLE_TILE_COLS_FWD)
        # Absent optional tensors are passed as a placeholder pointer that the constexpr flags
        # keep the kernel from touching.
        _norm_fwd_kernel[(n_rows,)](
            x, residual if residual is not None else x,
            weight.contiguous() if weight is not None else x,
            bias.contiguous() if bias is not None else x,
            y if store_y else x, h if residual is not None else x,
            mean if mean is not None else rstd, rstd,
            n_cols, x.stride(0), residual.stride(0) if residual is not None else 0, eps,
            IS_RMS=is_rms, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, BLOCK=block, SINGLE_TILE=single_tile,
            INTERPRETED=_INTERPRETED, STORE_Y=store_y, num_warps=num_warps,
        )
    return y, h, mean, rstd


def norm_stats(x, eps, is_rms):
    """Per-row statistics of RMSNorm (is_rms) or LayerNorm without writing the normalized rows.

    x: [rows, cols] fp32/fp16/bf16, unit column stride. Returns (mean, rstd), fp32 [rows] each,
    mean an empty(0) tensor for RMSNorm; the same values the forward launchers store.
    """
    _, _, mean, rstd = _norm_fwd(x, None, None, None, eps, is_rms, store_y=False)
    if mean is None:
        mean = torch.empty(0, dtype=torch.float32, device=x.device)
    return mean, rstd


def rms_norm_fwd(x, weight, residual, eps):
    """RMSNorm forward over the last dimension, with an optional fused residual add.

    x: [rows, cols] fp32/fp16/bf16, unit column stride, any row stride. weight: [cols] of x's
    dtype or None (ones). residual: like x, or None. eps: float.
    Returns (y, h, rstd): y [rows, cols] contiguous in x's dtype; h = x + residual rounded to
    x's dtype, contiguous [rows, cols] (empty(0) when residual is None: the norm input is x
    itself); rstd fp32 [rows] = 1 / sqrt(mean(h^2) + eps), computed from the rounded h.
    Backward needs h (or x) and rstd only.
    """
    y, h, _, rstd = _norm_fwd(x, weight, None, residual, eps, is_rms=True)
    return y, h, rstd


def layer_norm_fwd(x, weight, bias, residual, eps):
    """LayerNorm forward over the last dimension, with an optional fused residual add.

    x: [rows, cols] fp32/fp16/bf16, unit column stride, any row stride. weight, bias: [cols] of
    x's dtype or None (ones, zeros). residual: like x, or None. eps: float.
    Returns (y, h, mean, rstd): y [rows, cols] contiguous in x's dtype; h = x + residual rounded
    to x's dtype, contiguous (empty(0) when residual is None); mean and rstd fp32 [rows], from the
    rounded h, with the centered variance mean((h - mean)^2).
    Backward needs h (or x), mean and rstd only.
    """
    return _norm_fwd(x, weight, bias, residual, eps, is_rms=False)


def _norm_bwd(dy, dh, h, weight, mean, rstd, has_bias, is_rms):
    _check_matrix("dy", dy)
    _check_matrix("h", h)
    if dh is not None:
        _check_matrix("dh", dh)
    n_rows, n_cols = h.shape
    device = h.device
    dx = torch.empty((n_rows, n_cols), dtype=h.dtype, device=device)
    block, single_tile, num_warps = _block_config(n_cols, _MAX_SINGLE_TILE_COLS_BWD)
    num_partials = _num_partials(n_rows, num_warps, device)
    has_weight = weight is not None
    dweight_partial = dbias_partial = None
    if has_weight:
        dweight_partial = torch.empty((num_partials, n_cols), dtype=torch.float32, device=device)
    if has_bias:
        dbias_partial = torch.empty((num_partials, n_cols), dtype=torch.float32, device=device)
    rstd = rstd.contiguous()
    if mean is not None:
        mean = mean.contiguous()
    if n_rows > 0 and n_cols > 0:
        _norm_bwd_kernel[(num_partials,)](
            dy, dh if dh is not None else dy, h, weight.contiguous() if has_weight else h,
            mean if mean is not None else rstd, rstd, dx,
            dweight_partial if has_weight else rstd, dbias_partial if has_bias else rstd,
            n_rows, n_cols, dy.stride(0), dh.stride(0) if dh is not None else 0, h.stride(0),
            IS_RMS=is_rms, HAS_DH=dh is not None, HAS_WEIGHT=has_weight, HAS_BIAS=has_bias,
            BLOCK=block, SINGLE_TILE=single_tile, INTERPRETED=_INTERPRETED,
            num_warps=num_warps,
        )
    if has_weight:
        # Summed in a fixed order over the partials: deterministic.
        dweight = dweight_partial.sum(0).to(weight.dtype) if n_rows > 0 else (
            torch.zeros(n_cols, dtype=weight.dtype, device=device))
    else:
        dweight = torch.empty(0, dtype=h.dtype, device=device)
    if has_bias:
        dbias = dbias_partial.sum(0).to(h.dtype) if n_rows > 0 else (
            torch.zeros(n_cols, dtype=h.dtype, device=device))
    else:
        dbias = torch.empty(0, dtype=h.dtype, device=device)
    return dx, dweight, dbias


def rms_norm_bwd(dy, dh, h, weight, rstd):
    """RMSNorm backward, recomputing x_hat = h * rstd from the saved norm input and rstd.

    dy: [rows, cols] gradient of y; dh: gradient flowing into the h returned by the forward (like
    dy) or None; h: the saved norm input [rows, cols] (x, or x + residual), fp32/fp16/bf16; all
    with unit column stride and any row stride. weight: [cols] or None. rstd: fp32 [rows].
    Returns (dx, dw): dx [rows, cols] contiguous in h's dtype, the gradient of h including dh
    (also the residual's gradient); dw [cols] in weight's dtype, or empty(0) when weight is None.
    """
    dx, dweight, _ = _norm_bwd(dy, dh, h, weight, None, rstd, False, is_rms=True)
    return dx, dweight


def layer_norm_bwd(dy, dh, h, weight, mean, rstd, has_bias):
    """LayerNorm backward, recomputing x_hat = (h - mean) * rstd from h and the saved stats.

    dy, dh (or None), h: as for rms_norm_bwd. weight: [cols] or None. mean, rstd: fp32 [rows].
    has_bias: whether the forward had a bias, so db is wanted.
    Returns (dx, dw, db): dx [rows, cols] contiguous in h's dtype, including dh; dw [cols] in
    weight's dtype (empty(0) without weight); db [cols] in h's dtype (empty(0) without bias).
    """
    return _norm_bwd(dy, dh, h, weight, mean, rstd, has_bias, is_rms=False)


def aot_specs():
    """Yield (name, kernel, signature, constexprs, num_warps) for ahead-of-time compile checks.

    `signature` and `constexprs` are in the form `triton.compiler.ASTSource` takes; name is
    '<op>_<fwd|bwd>-<dtype>-<config>'. Covers both kernels for RMSNorm and LayerNorm, every
    dtype, and three configurations: 'narrow' (one column, BLOCK 1, no optional inputs),
    'single' (the widest single tile, every optional input: the most registers) and 'tiled'
    (one column past the widest single tile, every optional input).
    """
    for type_name in ("fp32", "fp16", "bf16"):
        element = f"*{type_name}"
        for is_rms in (True, False):
            op = "rms_norm" if is_rms else "layer_norm"
            fwd_signature = {
                "x_ptr": element, "residual_ptr": element, "weight_ptr": element,
                "bias_ptr": element, "y_ptr": element, "h_ptr": element, "mean_ptr": "*fp32",
                "rstd_ptr": "*fp32", "n_cols": "i32", "x_row_stride": "i64",
                "residual_row_stride": "i64", "eps": "fp32",
            }
            bwd_signature = {
                "dy_ptr": element, "dh_ptr": element, "h_ptr": element, "weight_ptr": element,
                "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "dx_ptr": element,
                "dweight_partial_ptr": "*fp32", "dbias_partial_ptr": "*fp32", "n_rows": "i32",
                "n_cols": "i32", "dy_row_stride": "i64", "dh_row_stride": "i64",
                "h_row_stride": "i64",
            }
            for kind, kernel, signature, max_single_tile_cols, optional_flags in (
                ("fwd", _norm_fwd_kernel, fwd_signature, _MAX_SINGLE_TILE_COLS_FWD,
                 ("HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS")),
                ("bwd", _norm_bwd_kernel, bwd_signature, _MAX_SINGLE_TILE_COLS_BWD,
                 ("HAS_DH", "HAS_WEIGHT", "HAS_BIAS")),
            ):
                configs = [("narrow", 1, False), ("single", max_single_tile_cols, True),
                           ("tiled", max_single_tile_cols + 1, True)]
                if kind == "fwd":
                    configs += [("stats-single", max_single_tile_cols, False),
                                ("stats-tiled", max_single_tile_cols + 1, False)]
                for config, width, with_optionals in configs:
                    block, single_tile, num_warps = _block_config(width, max_single_tile_cols)
                    constexprs = {flag: with_optionals for flag in optional_flags}
                    if kind == "fwd":
                        constexprs["STORE_Y"] = not config.startswith("stats")
                    if is_rms:
                        constexprs["HAS_BIAS"] = False
                    constexprs.update(IS_RMS=is_rms, BLOCK=block, SINGLE_TILE=single_tile,
                                      INTERPRETED=False)
                    full_signature = dict(signature, **dict.fromkeys(constexprs, "constexpr"))
                    yield (f"{op}_{kind}-{type_name}-{config}", kernel, full_signature,
                           constexprs, num_warps)
