"""Triton dual GEMM for gated MLPs: gate = A @ w_gate^T and up = A @ w_up^T in one kernel, with an
optional RMSNorm/LayerNorm prologue on A and the GLU in the epilogue.

This is the up/gate half of the "block" and "norm + MLP" recompute contracts (DESIGN.md section
2): the forward can keep only x (and the norm's fp32 statistics), and the backward kernel
recomputes gate and up, then act(gate), act'(gate) and the activation gradients, in its epilogue.

Rounding points are those of the unfused computation (DESIGN.md section 2):
- the normed input A = ((x - mean) * rstd * norm_weight + norm_bias) is computed per loaded tile
  in fp32, in kernels/norm.py's order of operations, and rounded to x's dtype before the dot, as
  the unfused norm kernel stores it; it is never written to memory;
- gate and up accumulate in fp32 and are rounded to x's dtype, as the unfused GEMMs store them;
- h = act(gate) * up (and the backward's dgate, dup) are computed in fp32 from the rounded gate
  and up and rounded once, with kernels/mlp.py's activation code.
The forward and backward kernels share the tile ordering and the main loop (`_tile_indices`,
`_gate_up_tile`) and choose block sizes with the same function of the shapes, so the backward's
gate, up and h are bit-identical to the forward's.

act_matmul / act_matmul_bwd are the single-GEMM variant for the plain (GPT-2 style) MLP: the same
main loop with GATED off (one weight, one accumulator, no norm prologue) and a bias [N] added in
fp32 to the accumulator before the one rounding, so pre = x @ w^T + b is what torch.addmm stores;
h = act(pre) and dpre = dh * act'(pre) are kernels/mlp.py's act (non-gated) expressions. They
have their own tiles (act_matmul_candidates: one accumulator leaves room for a deeper pipeline),
chosen per device by shared memory (_launch_act).

fp32 operands are multiplied as TF32 on tensor cores when PyTorch allows it for fp32 matmuls
(`allow_tf32()`, torch.backends.cuda.matmul.allow_tf32, read per launch and passed as the TF32
constexpr), else in IEEE fp32, as torch.matmul does; fp16/bf16 are unaffected.

The activation math (`_activation_and_grad`) is kernels/mlp.py's, imported rather than copied;
`_round` and `_dot` are kernels/_common.py's.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import _INTERPRETED, _dot, _round, allow_tf32
from .attention.tuning import Tuner
from .mlp import _activation_and_grad

_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_NORMS = (None, "rms", "layer")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class MatmulConfig(NamedTuple):
    """Tile sizes and launch options of one dual-GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Programs per group of the GROUP_M swizzle (Triton's matmul tutorial): GROUP_M row tiles walk
# the N tiles together, so the weight tiles they share are read from L2, not memory.
_GROUP_M = 8
# Tile choice, measured with ptxas -v on the sm_80 and sm_90a builds of every aot_specs() kernel,
# compiled with the 16-byte divisibility a launch with aligned tensors and K % 16 == 0 gets:
# - fp16/bf16, more than 64 rows: 128 x 64 output tiles, BLOCK_K 64, 8 warps, 3 stages. One A
#   tile (128 x 64) feeds two 64 x 64 weight tiles, the tensor-core work and arithmetic
#   intensity of a single 128 x 128 GEMM tile. 120-255 registers per thread, no spills;
#   64-81 KiB of shared memory on sm_80 and 96-113 KiB on sm_90. 128 x 128 tiles (two 128 x 128
#   fp32 accumulators, 128 registers per thread before any operand) hit the 255-register cap
#   and spilled in 14 of the 18 builds, up to 1.1 KiB per thread on sm_90 and 13 KiB on sm_80,
#   the backward's epilogue most.
# - fp16/bf16, at most 64 rows (decode-sized batches): 64 x 64 tiles, otherwise the same; twice
#   the programs per weight column for a launch that is weight-bandwidth bound. 66-247
#   registers, no spills. (4 warps spilled 4-16 bytes on sm_80.)
# - fp32: IEEE products (`_dot`, kernels/_common.py) run on the FMA units, not tensor cores, and
#   Triton's FMA dot holds BLOCK_K-deep operand slices in registers: 64 x 64 tiles, BLOCK_K 16,
#   8 warps take 128 registers and do not spill; BLOCK_K 32 over 4 warps spilled up to 700 bytes.
_LARGE_16BIT = MatmulConfig(128, 64, 64, _GROUP_M, 8, 3)
_SMALL_16BIT = MatmulConfig(64, 64, 64, _GROUP_M, 8, 3)
_FP32 = MatmulConfig(64, 64, 16, _GROUP_M, 8, 3)


def glu_matmul_config(n_rows, n_cols, n_inner, dtype):
    """Block sizes for gate/up of shape [n_rows, n_cols] over n_inner, for x's dtype.

    A fixed rule of the shape and dtype, not an autotuner (none is needed for correctness; an
    autotuned choice can replace this function). The forward and the backward call it with the
    same arguments: the recompute is bit-identical only when both use the same tiles, since
    BLOCK_K fixes the accumulation order.
    """
    del n_cols, n_inner  # The rule above needs neither; an autotuner may.
    if dtype == torch.float32:
        return _FP32
    return _LARGE_16BIT if n_rows > 64 else _SMALL_16BIT


# The single GEMM's own tiles (act_matmul, the plain MLP's up-projection with the bias + act
# epilogue), measured like the dual GEMM's: ptxas -v on sm_80 and sm_90a builds of both
# act_matmul kernels (bias, gelu_tanh, STORE_PRE / NEED_H on) with 16-byte divisibility, and
# Triton's own shared-memory figure (metadata.shared). Facts that set them:
# - One accumulator does not buy a wider tile: the epilogue does. 128 x 64 over 8 warps holds
#   32 fp32 accumulator elements per thread, and the activation and its gradient add several
#   live fp32 temporaries per element: 201-206 registers per thread on sm_80 (78 forward, 198
#   backward on sm_90), no spills. 128 x 128 over 8 warps (64 accumulator elements per thread)
#   hit the 255-register cap and spilled 624 (forward) / 936 (backward) bytes per thread on
#   sm_80 and 372 in the backward on sm_90; over 16 warps the cap falls to 128 registers and it
#   spilled 364-500 bytes; 128 x 256 and 256 x 128 spilled kilobytes. The forward and the
#   backward must share the tile (the recompute is bit-identical only then), so 128 x 64 it is.
# - What one accumulator does buy is pipeline depth: a stage holds one A tile and one weight
#   tile, (128 + 64) x 64 x 2 bytes = 24 KiB for fp16/bf16, against the dual GEMM's 32 KiB
#   (two weight tiles). Measured shared memory per block of 128 x 64 x 64, 8 warps (forward =
#   backward in every build): 3 / 4 / 5 stages take 48 / 72 / 96 KiB on sm_80 (Triton keeps
#   num_stages - 1 buffers there) and 72 / 96 / 120 KiB on sm_90. At ~205 registers x 256
#   threads one block fills an SM's 64 K registers, so occupancy is one block per SM whatever
#   the depth, and the deepest pipeline that fits hides the most load latency: 5 stages, which
#   fits sm_80 (164 KiB per block), sm_90 (227 KiB) and, expected, the 99 KiB of sm_86/89/120
#   (96 KiB in the sm_80-style build those take; not measured there, and the launcher checks
#   the compiled figure). The 4- and 3-stage entries are what the pruning falls back to on a
#   device with less.
# - At most 64 rows (decode-sized batches): 64 x 64 x 64 over 4 warps, the same registers per
#   thread (201-206, no spills) and half the threads, so two blocks share an SM; 5 stages take
#   64 KiB on sm_80 and 80 KiB on sm_90. The launch is weight-bandwidth bound, and the more
#   weight tiles in flight, the closer it gets to memory bandwidth.
# - fp32 with IEEE products (FMA units, BLOCK_K-deep operand slices in registers): the single
#   GEMM affords the 128 x 64 tile the dual GEMM could not, BLOCK_K 16 over 8 warps: 187-228
#   registers, no spills; 4 stages (36 KiB or less). At most 64 rows: 64 x 64 x 16 (106-122
#   registers).
# - fp32 with TF32 (tensor cores, `allow_tf32()`): 128 x 64 x 32, 8 warps, 189-227 registers, no
#   spills; a stage is (128 + 64) x 32 x 4 bytes = 24 KiB as for 16-bit types, so the same
#   stage counts and shared memory (4 stages: 72 KiB on sm_80, 96 KiB on sm_90). At most 64
#   rows: 64 x 64 x 32 over 4 warps (188-228 registers, no spills).
# Each list is in preference order; the launcher takes the first entry whose compiled forward
# and backward kernels both fit the device's shared memory per block (see _launch_act).
def _stages(block_m, block_n, block_k, num_warps, *stage_counts):
    return tuple(MatmulConfig(block_m, block_n, block_k, _GROUP_M, num_warps, stages)
                 for stages in stage_counts)


_ACT_LARGE_16BIT = _stages(128, 64, 64, 8, 5, 4, 3)
_ACT_SMALL_16BIT = _stages(64, 64, 64, 4, 5, 4, 3)
_ACT_LARGE_FP32 = _stages(128, 64, 16, 8, 4, 3)
_ACT_SMALL_FP32 = _stages(64, 64, 16, 8, 4, 3)
_ACT_LARGE_TF32 = _stages(128, 64, 32, 8, 5, 4, 3)
_ACT_SMALL_TF32 = _stages(64, 64, 32, 4, 5, 4, 3)


def act_matmul_candidates(n_rows, n_cols, n_inner, dtype, tf32):
    """The single GEMM's tile configurations for pre [n_rows, n_cols] over n_inner, for x's
    dtype and the TF32 setting (fp32 only), in preference order (see the comment above).

    A fixed rule of the row count and the dtype, not a timed autotuner: the forward and the
    backward must launch the same tile (BLOCK_K fixes the accumulation order, so the recompute
    is bit-identical only then), which a rule keyed on what both calls see guarantees.
    """
    del n_cols, n_inner  # The rule above needs neither.
    small = n_rows <= 64
    if dtype == torch.float32 and tf32:
        return _ACT_SMALL_TF32 if small else _ACT_LARGE_TF32
    if dtype == torch.float32:
        return _ACT_SMALL_FP32 if small else _ACT_LARGE_FP32
    return _ACT_SMALL_16BIT if small else _ACT_LARGE_16BIT


def act_matmul_config(n_rows, n_cols, n_inner, dtype, tf32):
    """The preferred single-GEMM tile (act_matmul_candidates' first): what the interpreter
    launches and what aot_specs compiles."""
    return act_matmul_candidates(n_rows, n_cols, n_inner, dtype, tf32)[0]


@triton.jit
def _tile_indices(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(rows [BLOCK_M], cols [BLOCK_N]) of this program's output tile, int32, in the grouped
    order of Triton's matmul tutorial: GROUP_M consecutive row tiles per column sweep."""
    program = tl.program_id(0)
    num_row_tiles = tl.cdiv(M, BLOCK_M)
    num_col_tiles = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_M * num_col_tiles
    first_row_tile = (program // programs_per_group) * GROUP_M
    group_rows = min(num_row_tiles - first_row_tile, GROUP_M)
    row_tile = first_row_tile + (program % programs_per_group) % group_rows
    col_tile = (program % programs_per_group) // group_rows
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols


@triton.jit
def _gate_up_tile(
    x_ptr, w_gate_ptr, w_up_ptr, bias_ptr, mean_ptr, rstd_ptr, norm_weight_ptr, norm_bias_ptr,
    rows, cols, M, N, K, x_row_stride,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, HAS_NORM_WEIGHT: tl.constexpr, HAS_NORM_BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, TF32: tl.constexpr,
):
    """(gate, up) [BLOCK_M, BLOCK_N] in x's dtype for output rows `rows` and columns `cols`.

    GATED: gate = A @ w_gate^T and up = A @ w_up^T, two fp32 accumulators fed by one A tile per
    K step, each rounded once to x's dtype at the end. Not GATED: only gate = A @ w_gate^T
    (+ bias) is computed, w_up_ptr is never read, and the returned up is gate itself (a
    placeholder the caller ignores). HAS_BIAS (only without GATED): bias [N], x's dtype, is
    added in fp32 to the fp32 accumulator before the one rounding, as torch.addmm does.
    A is x, or for NORM "rms"/"layer" the normed x computed per tile and rounded to x's dtype.
    Loads past M, N and K are masked to 0, so rows past M and columns past N come out 0 (or the
    bias); the callers mask them off their stores. TF32: fp32 operands are multiplied as TF32 on
    tensor cores (`_dot`), else in IEEE fp32; no effect on fp16/bf16.
    """
    tl.static_assert(not (GATED and HAS_BIAS), "a bias is taken only by the non-gated GEMM")
    dtype = x_ptr.dtype.element_ty
    row_mask = rows < M
    col_mask = cols < N
    # 64-bit before the multiplies: row * stride and col * K can pass 2^31.
    x_row_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    weight_col_offsets = cols.to(tl.int64)[None, :] * K
    if NORM != "none":
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
    if NORM == "layer":
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
    gate_acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    if GATED:
        up_acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(x_row_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if NORM != "none":
            # kernels/norm.py's order: x_hat = (x - mean) * rstd (x * rstd for RMSNorm), then
            # * weight, then + bias, in fp32; rounded to the dtype as the norm kernel stores y.
            normed = a.to(tl.float32)
            if NORM == "layer":
                normed = (normed - mean) * rstd
            else:
                normed = normed * rstd
            if HAS_NORM_WEIGHT:
                normed = normed * tl.load(norm_weight_ptr + ks, mask=k_mask,
                                          other=0.0).to(tl.float32)[None, :]
            if HAS_NORM_BIAS:
                normed = normed + tl.load(norm_bias_ptr + ks, mask=k_mask,
                                          other=0.0).to(tl.float32)[None, :]
            # (0 - mean) * rstd and the bias are not 0 past K: zero those columns explicitly.
            a = _round(tl.where(k_mask[None, :], normed, 0.0), dtype, INTERPRETED)
        weight_offsets = weight_col_offsets + ks[:, None]
        weight_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(w_gate_ptr + weight_offsets, mask=weight_mask, other=0.0)
        gate_acc = _dot(a, w_gate, gate_acc, INTERPRETED, TF32)
        if GATED:
            w_up = tl.load(w_up_ptr + weight_offsets, mask=weight_mask, other=0.0)
            up_acc = _dot(a, w_up, up_acc, INTERPRETED, TF32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        gate_acc = gate_acc + bias[None, :]
    gate = _round(gate_acc, dtype, INTERPRETED)
    if GATED:
        up = _round(up_acc, dtype, INTERPRETED)
    else:
        up = gate
    return gate, up


@triton.jit
def _glu_matmul_fwd_kernel(
    x_ptr, w_gate_ptr, w_up_ptr, mean_ptr, rstd_ptr, norm_weight_ptr, norm_bias_ptr,
    h_ptr, gate_ptr, up_ptr,
    M, N, K, x_row_stride,
    ACTIVATION: tl.constexpr, NORM: tl.constexpr, HAS_NORM_WEIGHT: tl.constexpr,
    HAS_NORM_BIAS: tl.constexpr, STORE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, TF32: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of h = act(gate) * up [M, N] (and gate, up when STORE_PRE)."""
    rows, cols = _tile_indices(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # x_ptr stands in for the bias pointer, which HAS_BIAS=False keeps the loop from reading.
    gate, up = _gate_up_tile(
        x_ptr, w_gate_ptr, w_up_ptr, x_ptr, mean_ptr, rstd_ptr, norm_weight_ptr, norm_bias_ptr,
        rows, cols, M, N, K, x_row_stride,
        True, False, NORM, HAS_NORM_WEIGHT, HAS_NORM_BIAS, BLOCK_K, INTERPRETED, TF32,
    )
    activated, _ = _activation_and_grad(gate.to(tl.float32), ACTIVATION)
    h = _round(activated * up.to(tl.float32), h_ptr.dtype.element_ty, INTERPRETED)
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(h_ptr + offsets, h, mask=mask)
    if STORE_PRE:
        tl.store(gate_ptr + offsets, gate, mask=mask)
        tl.store(up_ptr + offsets, up, mask=mask)


@triton.jit
def _glu_matmul_bwd_kernel(
    x_ptr, w_gate_ptr, w_up_ptr, mean_ptr, rstd_ptr, norm_weight_ptr, norm_bias_ptr,
    dh_ptr, dgate_ptr, dup_ptr, h_ptr,
    M, N, K, x_row_stride, dh_row_stride,
    ACTIVATION: tl.constexpr, NORM: tl.constexpr, HAS_NORM_WEIGHT: tl.constexpr,
    HAS_NORM_BIAS: tl.constexpr, NEED_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, TF32: tl.constexpr,
):
    """One tile of dgate = dh * up * act'(gate), dup = dh * act(gate) and (NEED_H) h, with gate
    and up recomputed exactly as _glu_matmul_fwd_kernel computes them."""
    rows, cols = _tile_indices(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # x_ptr stands in for the bias pointer, which HAS_BIAS=False keeps the loop from reading.
    gate, up = _gate_up_tile(
        x_ptr, w_gate_ptr, w_up_ptr, x_ptr, mean_ptr, rstd_ptr, norm_weight_ptr, norm_bias_ptr,
        rows, cols, M, N, K, x_row_stride,
        True, False, NORM, HAS_NORM_WEIGHT, HAS_NORM_BIAS, BLOCK_K, INTERPRETED, TF32,
    )
    rows64 = rows.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dh = tl.load(dh_ptr + rows64[:, None] * dh_row_stride + cols[None, :], mask=mask, other=0.0)
    dh = dh.to(tl.float32)
    up = up.to(tl.float32)
    # The expressions and their order are kernels/mlp.py's _act_bwd_kernel (GATED).
    activated, grad = _activation_and_grad(gate.to(tl.float32), ACTIVATION)
    dtype = dgate_ptr.dtype.element_ty
    offsets = rows64[:, None] * N + cols[None, :]
    tl.store(dgate_ptr + offsets, _round(dh * up * grad, dtype, INTERPRETED), mask=mask)
    tl.store(dup_ptr + offsets, _round(dh * activated, dtype, INTERPRETED), mask=mask)
    if NEED_H:
        tl.store(h_ptr + offsets, _round(activated * up, dtype, INTERPRETED), mask=mask)


@triton.jit
def _act_matmul_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, h_ptr, pre_ptr,
    M, N, K, x_row_stride,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, TF32: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of h = act(pre) [M, N], pre = x @ w^T (+ bias) rounded to x's
    dtype (and pre itself when STORE_PRE): _gate_up_tile's main loop with one GEMM, no norm."""
    rows, cols = _tile_indices(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # x_ptr stands in for the second weight and the norm operands, which GATED=False and
    # NORM="none" keep the loop from reading.
    pre, _ = _gate_up_tile(
        x_ptr, w_ptr, x_ptr, bias_ptr, x_ptr, x_ptr, x_ptr, x_ptr,
        rows, cols, M, N, K, x_row_stride,
        False, HAS_BIAS, "none", False, False, BLOCK_K, INTERPRETED, TF32,
    )
    activated, _ = _activation_and_grad(pre.to(tl.float32), ACTIVATION)
    h = _round(activated, h_ptr.dtype.element_ty, INTERPRETED)
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(h_ptr + offsets, h, mask=mask)
    if STORE_PRE:
        tl.store(pre_ptr + offsets, pre, mask=mask)


@triton.jit
def _act_matmul_bwd_kernel(
    x_ptr, w_ptr, bias_ptr, dh_ptr, dpre_ptr, h_ptr,
    M, N, K, x_row_stride, dh_row_stride,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, TF32: tl.constexpr,
):
    """One tile of dpre = dh * act'(pre) and (NEED_H) h = act(pre), with pre recomputed exactly
    as _act_matmul_fwd_kernel computes it."""
    rows, cols = _tile_indices(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pre, _ = _gate_up_tile(
        x_ptr, w_ptr, x_ptr, bias_ptr, x_ptr, x_ptr, x_ptr, x_ptr,
        rows, cols, M, N, K, x_row_stride,
        False, HAS_BIAS, "none", False, False, BLOCK_K, INTERPRETED, TF32,
    )
    rows64 = rows.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dh = tl.load(dh_ptr + rows64[:, None] * dh_row_stride + cols[None, :], mask=mask, other=0.0)
    dh = dh.to(tl.float32)
    # The expressions and their order are kernels/mlp.py's _act_bwd_kernel (not GATED).
    activated, grad = _activation_and_grad(pre.to(tl.float32), ACTIVATION)
    dtype = dpre_ptr.dtype.element_ty
    offsets = rows64[:, None] * N + cols[None, :]
    tl.store(dpre_ptr + offsets, _round(dh * grad, dtype, INTERPRETED), mask=mask)
    if NEED_H:
        tl.store(h_ptr + offsets, _round(activated, dtype, INTERPRETED), mask=mask)


def _describe(tensor):
    return f"shape {tuple(tensor.shape)}, {tensor.dtype} on {tensor.device}"


def _check_tensor(name, tensor):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")


def _check_same_device(name, tensor, x):
    if tensor.device != x.device:
        raise ValueError(f"{name}: expected a tensor on {x.device} like x, got {_describe(tensor)}")


def _check_row_major(name, tensor, shape):
    """shape as given, unit column stride (any row stride)."""
    if tuple(tensor.shape) != shape or (tensor.stride(1) != 1 and shape[1] > 1):
        raise ValueError(
            f"{name}: expected shape {shape} with unit column stride, got shape "
            f"{tuple(tensor.shape)} and strides {tuple(tensor.stride())}")


def _check_x(x):
    """x: a 2-D fp32/fp16/bf16 tensor with unit column stride. Returns (M, K)."""
    _check_tensor("x", x)
    if x.dtype not in _DTYPES:
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor [M, K], got shape {tuple(x.shape)}")
    n_rows, n_inner = x.shape
    _check_row_major("x", x, (n_rows, n_inner))
    return n_rows, n_inner


def _check_dh(dh, x, n_cols):
    """dh: [M, N] of x's dtype and device, unit column stride."""
    n_rows = x.shape[0]
    _check_tensor("dh", dh)
    if dh.dtype != x.dtype:
        raise TypeError(f"dh: expected {x.dtype} like x, got {dh.dtype}")
    if dh.dim() != 2:
        raise ValueError(f"dh: expected a 2-D tensor [{n_rows}, {n_cols}], got shape "
                         f"{tuple(dh.shape)}")
    _check_row_major("dh", dh, (n_rows, n_cols))
    _check_same_device("dh", dh, x)


def _check_inputs(x, w_gate, w_up, activation, norm, mean, rstd, norm_weight, norm_bias,
                  dh=None):
    """ValueError/TypeError naming the argument, before any launch. Returns (M, N, K)."""
    n_rows, n_inner = _check_x(x)
    _check_tensor("w_gate", w_gate)
    if w_gate.dim() != 2 or w_gate.shape[1] != n_inner:
        raise ValueError(
            f"w_gate: expected [N, {n_inner}] (nn.Linear layout, K = x.shape[1]), got shape "
            f"{tuple(w_gate.shape)}")
    n_cols = w_gate.shape[0]
    for name, weight in (("w_gate", w_gate), ("w_up", w_up)):
        _check_tensor(name, weight)
        if weight.dtype != x.dtype:
            raise TypeError(f"{name}: expected {x.dtype} like x, got {weight.dtype}")
        _check_same_device(name, weight, x)
        if tuple(weight.shape) != (n_cols, n_inner) or not weight.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous [{n_cols}, {n_inner}] tensor (like w_gate), got "
                f"shape {tuple(weight.shape)} and strides {tuple(weight.stride())}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {_ACTIVATIONS}, got {activation!r}")
    if norm not in _NORMS:
        raise ValueError(f"norm: expected one of {_NORMS}, got {norm!r}")
    norm_args = {"mean": mean, "rstd": rstd, "norm_weight": norm_weight, "norm_bias": norm_bias}
    allowed = {None: (), "rms": ("rstd", "norm_weight"),
               "layer": ("mean", "rstd", "norm_weight", "norm_bias")}[norm]
    required = {None: (), "rms": ("rstd",), "layer": ("mean", "rstd")}[norm]
    for name, value in norm_args.items():
        if value is not None and name not in allowed:
            raise ValueError(f"{name}: not taken with norm={norm!r}; pass None")
        if value is None and name in required:
            raise ValueError(f"{name}: required with norm={norm!r}")
    for name in ("mean", "rstd"):
        stat = norm_args[name]
        if stat is not None:
            _check_tensor(name, stat)
            if stat.dtype != torch.float32:
                raise TypeError(f"{name}: expected float32 statistics, got {stat.dtype}")
            if tuple(stat.shape) != (n_rows,):
                raise ValueError(f"{name}: expected shape ({n_rows},) (one per row of x), got "
                                 f"{tuple(stat.shape)}")
            _check_same_device(name, stat, x)
    for name in ("norm_weight", "norm_bias"):
        vector = norm_args[name]
        if vector is not None:
            _check_tensor(name, vector)
            if vector.dtype not in _DTYPES:
                raise TypeError(
                    f"{name}: expected float32, float16 or bfloat16, got {vector.dtype}")
            if tuple(vector.shape) != (n_inner,):
                raise ValueError(f"{name}: expected shape ({n_inner},) (K = x.shape[1]), got "
                                 f"{tuple(vector.shape)}")
            _check_same_device(name, vector, x)
    if dh is not None:
        _check_dh(dh, x, n_cols)
    return n_rows, n_cols, n_inner


def _check_act_inputs(x, w, b, activation, dh=None):
    """act_matmul's arguments: ValueError/TypeError naming the argument, before any launch.
    Returns (M, N, K)."""
    n_rows, n_inner = _check_x(x)
    _check_tensor("w", w)
    if w.dtype != x.dtype:
        raise TypeError(f"w: expected {x.dtype} like x, got {w.dtype}")
    _check_same_device("w", w, x)
    if w.dim() != 2 or w.shape[1] != n_inner or not w.is_contiguous():
        raise ValueError(
            f"w: expected a contiguous [N, {n_inner}] tensor (nn.Linear layout, K = x.shape[1]), "
            f"got shape {tuple(w.shape)} and strides {tuple(w.stride())}")
    n_cols = w.shape[0]
    if b is not None:
        _check_tensor("b", b)
        if b.dtype != x.dtype:
            raise TypeError(f"b: expected {x.dtype} like x, got {b.dtype}")
        if tuple(b.shape) != (n_cols,):
            raise ValueError(f"b: expected shape ({n_cols},) (N = w.shape[0]), got "
                             f"{tuple(b.shape)}")
        _check_same_device("b", b, x)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {_ACTIVATIONS}, got {activation!r}")
    if dh is not None:
        _check_dh(dh, x, n_cols)
    return n_rows, n_cols, n_inner


def _launch(kernel, x, w_gate, w_up, outputs, extra_strides, norm, mean, rstd, norm_weight,
            norm_bias, flags):
    """Launches `kernel` over the [M, N] output with the shared argument layout of both kernels.

    outputs: the kernel's output pointers after the prologue inputs (a placeholder where a flag
    keeps the kernel from writing). extra_strides: row strides after x's. flags: the kernel's
    own constexprs (ACTIVATION and STORE_PRE or NEED_H). TF32 is allow_tf32(), read per call; the
    fp32 tile serves IEEE and TF32 products alike.
    """
    n_rows, n_inner = x.shape
    n_cols = w_gate.shape[0]
    config = glu_matmul_config(n_rows, n_cols, n_inner, x.dtype)
    grid = (triton.cdiv(n_rows, config.block_m) * triton.cdiv(n_cols, config.block_n),)
    rstd = rstd.contiguous() if rstd is not None else None
    # Absent optional tensors are passed as a placeholder pointer that the constexpr flags keep
    # the kernel from touching.
    kernel[grid](
        x, w_gate, w_up,
        mean.contiguous() if mean is not None else x,
        rstd if rstd is not None else x,
        norm_weight.contiguous() if norm_weight is not None else x,
        norm_bias.contiguous() if norm_bias is not None else x,
        *outputs,
        n_rows, n_cols, n_inner, x.stride(0), *extra_strides,
        NORM=norm or "none", HAS_NORM_WEIGHT=norm_weight is not None,
        HAS_NORM_BIAS=norm_bias is not None, **flags,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, INTERPRETED=_INTERPRETED, TF32=allow_tf32(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def glu_matmul(x, w_gate, w_up, activation, *, norm=None, mean=None, rstd=None,
               norm_weight=None, norm_bias=None, store_pre=False):
    """Gated MLP up-projection: h = act(A @ w_gate^T) * (A @ w_up^T) in one kernel.

    x: [M, K] fp32/fp16/bf16, unit column stride, any row stride. w_gate, w_up: [N, K] of x's
    dtype, contiguous (nn.Linear layout). activation: "silu", "gelu" (exact, erf) or "gelu_tanh".
    A is x, or with norm="rms" A = x * rstd * norm_weight, with norm="layer"
    A = (x - mean) * rstd * norm_weight + norm_bias, computed in fp32 and rounded to x's dtype
    (the unfused norm's output); rstd, mean: fp32 [M]; norm_weight, norm_bias: [K] or None
    (RMSNorm takes no bias). All on x's device.
    Returns (h, gate, up): h [M, N] contiguous in x's dtype, act(gate) * up in fp32 from the
    rounded gate and up, rounded once; gate = A @ w_gate^T and up = A @ w_up^T, fp32-accumulated
    and rounded to x's dtype, [M, N] contiguous when store_pre, else empty(0).
    """
    n_rows, n_cols, _ = _check_inputs(x, w_gate, w_up, activation, norm, mean, rstd, norm_weight,
                                      norm_bias)

    def output(wanted):
        shape = (n_rows, n_cols) if wanted else (0,)
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    h, gate, up = output(True), output(store_pre), output(store_pre)
    if n_rows > 0 and n_cols > 0:
        _launch(_glu_matmul_fwd_kernel, x, w_gate, w_up,
                (h, gate if store_pre else h, up if store_pre else h), (),
                norm, mean, rstd, norm_weight, norm_bias,
                dict(ACTIVATION=activation, STORE_PRE=bool(store_pre)))
    return h, gate, up


def glu_matmul_bwd(x, w_gate, w_up, dh, activation, *, norm=None, mean=None, rstd=None,
                   norm_weight=None, norm_bias=None, need_h=True):
    """Backward of glu_matmul's activation, recomputing gate and up (and the normed input) from x.

    x, w_gate, w_up, activation and the norm arguments: as for glu_matmul, which this recomputes
    bit for bit. dh: [M, N] gradient of h, x's dtype, unit column stride, any row stride.
    Returns (dgate, dup, h), each [M, N] contiguous in x's dtype, computed in fp32 from the
    rounded gate and up and rounded once: dgate = dh * up * act'(gate), dup = dh * act(gate)
    (act(gate) unrounded, as in the forward), h = act(gate) * up, bit-identical to glu_matmul's
    h, or empty(0) when need_h is false. The weight and input gradients are left to the caller
    (GEMMs of dgate and dup).
    """
    n_rows, n_cols, _ = _check_inputs(x, w_gate, w_up, activation, norm, mean, rstd, norm_weight,
                                      norm_bias, dh=dh)

    def output(wanted):
        shape = (n_rows, n_cols) if wanted else (0,)
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    dgate, dup, h = output(True), output(True), output(need_h)
    if n_rows > 0 and n_cols > 0:
        _launch(_glu_matmul_bwd_kernel, x, w_gate, w_up,
                (dh, dgate, dup, h if need_h else dgate), (dh.stride(0),),
                norm, mean, rstd, norm_weight, norm_bias,
                dict(ACTIVATION=activation, NEED_H=bool(need_h)))
    return dgate, dup, h


# The single GEMM's tile per (device, dtype, TF32, row class), shared by its forward and
# backward kernels: remat's tuner (kernels/attention/tuning.py) with timing off, so a miss takes
# act_matmul_candidates' first entry that fits the device and caches it, inside CUDA graph
# capture too (so the forward and the backward of a captured step launch one tile). Nothing is
# timed, allocated or launched besides the real launch; a miss compiles the candidates it
# checks (Triton's compile cache keeps them).
_ACT_TUNER = Tuner(autotune=False, name="remat GEMM (bias + activation epilogue)")


def _act_tile_key(x, tf32):
    """The single GEMM's tile-cache key: act_matmul_candidates depends on these alone."""
    return ("act_matmul", x.device.index, x.dtype, tf32, x.shape[0] <= 64)


def _launch_act(kernel, x, w, b, outputs, extra_strides, flags):
    """Launches an act_matmul kernel over the [M, N] output, with act_matmul_candidates' tile
    for the shape, dtype and TF32 setting: the first, under the interpreter; compiled, the first
    whose forward and backward kernels both fit the device's shared memory per block, cached per
    _act_tile_key, so the forward and the backward pick the same one. TF32 is allow_tf32(),
    read per call (a compiled variant: flipping PyTorch's setting between a forward and its
    backward makes the recompute differ in rounding)."""
    n_rows, n_inner = x.shape
    n_cols = w.shape[0]
    tf32 = allow_tf32()
    bias = b.contiguous() if b is not None else x
    sizes = (n_rows, n_cols, n_inner, x.stride(0))

    def options(config, kernel_flags):
        return dict(HAS_BIAS=b is not None, **kernel_flags,
                    BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                    GROUP_M=config.group_m, INTERPRETED=_INTERPRETED, TF32=tf32,
                    num_warps=config.num_warps, num_stages=config.num_stages)

    def grid(config):
        return (triton.cdiv(n_rows, config.block_m) * triton.cdiv(n_cols, config.block_n),)

    def run(config):
        kernel[grid(config)](x, w, bias, *outputs, *sizes, *extra_strides,
                             **options(config, flags))

    if _INTERPRETED:
        run(act_matmul_config(n_rows, n_cols, n_inner, x.dtype, tf32))
        return

    def shared_memory_of(config):
        # Both kernels, with every optional output on: the [M, N] output passed here stands for
        # all of the other kernel's [M, N] operands (the row stride of dh is then N).
        out = outputs[0] if kernel is _act_matmul_fwd_kernel else outputs[1]
        forward = _act_matmul_fwd_kernel.warmup(
            x, w, bias, out, out, *sizes, grid=grid(config),
            **options(config, dict(ACTIVATION=flags["ACTIVATION"], STORE_PRE=True)))
        backward = _act_matmul_bwd_kernel.warmup(
            x, w, bias, out, out, out, *sizes, n_cols, grid=grid(config),
            **options(config, dict(ACTIVATION=flags["ACTIVATION"], NEED_H=True)))
        return max(forward.metadata.shared, backward.metadata.shared)

    _ACT_TUNER.launch(_act_tile_key(x, tf32),
                      act_matmul_candidates(n_rows, n_cols, n_inner, x.dtype, tf32),
                      shared_memory_of, run)


def act_matmul(x, w, b, activation, *, store_pre=False):
    """Plain (GPT-2 style) MLP up-projection: h = act(x @ w^T + b) in one kernel.

    x: [M, K] fp32/fp16/bf16, unit column stride, any row stride. w: [N, K] of x's dtype,
    contiguous (nn.Linear layout). b: [N] of x's dtype, or None. activation: "gelu" (exact, erf),
    "gelu_tanh" or "silu". All on x's device.
    Returns (h, pre): pre = x @ w^T + b, accumulated in fp32 with the bias added in fp32 and
    rounded once to x's dtype (what torch.addmm outputs); h = act(pre) in fp32 from the rounded
    pre, rounded once, [M, N] contiguous in x's dtype. pre is returned [M, N] contiguous when
    store_pre, else empty(0).
    """
    n_rows, n_cols, _ = _check_act_inputs(x, w, b, activation)

    def output(wanted):
        shape = (n_rows, n_cols) if wanted else (0,)
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    h, pre = output(True), output(store_pre)
    if n_rows > 0 and n_cols > 0:
        _launch_act(_act_matmul_fwd_kernel, x, w, b, (h, pre if store_pre else h), (),
                    dict(ACTIVATION=activation, STORE_PRE=bool(store_pre)))
    return h, pre


def act_matmul_bwd(x, w, b, dh, activation, *, need_h=True):
    """Backward of act_matmul's activation, recomputing pre = x @ w^T + b from x.

    x, w, b, activation: as for act_matmul, whose pre this recomputes bit for bit. dh: [M, N]
    gradient of h, x's dtype, unit column stride, any row stride.
    Returns (dpre, h), each [M, N] contiguous in x's dtype, computed in fp32 from the rounded
    pre and rounded once: dpre = dh * act'(pre); h = act(pre), bit-identical to act_matmul's h,
    or empty(0) when need_h is false. These are kernels/mlp.py's act_bwd expressions. The weight,
    bias and input gradients are left to the caller (GEMMs and a column sum of dpre).
    """
    n_rows, n_cols, _ = _check_act_inputs(x, w, b, activation, dh=dh)

    def output(wanted):
        shape = (n_rows, n_cols) if wanted else (0,)
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    dpre, h = output(True), output(need_h)
    if n_rows > 0 and n_cols > 0:
        _launch_act(_act_matmul_bwd_kernel, x, w, b, (dh, dpre, h if need_h else dpre),
                    (dh.stride(0),), dict(ACTIVATION=activation, NEED_H=bool(need_h)))
    return dpre, h


def aot_specs():
    """Yield (name, kernel, signature, constexprs, num_warps, options) for ahead-of-time compile
    checks; options holds num_stages.

    `signature` and `constexprs` are in the form `triton.compiler.ASTSource` takes; name is
    'glu_matmul_<fwd|bwd>-<dtype>-<activation>-<norm>[-store_pre|-need_h][-tf32]'. Covers both
    kernels without a prologue, with the RMSNorm prologue (weight) and with the LayerNorm
    prologue (weight and bias): for bf16 every (kernel, norm) pair, the activations spread over
    them and STORE_PRE / NEED_H on and off; for fp16 one forward and one backward; for fp32 one
    forward and one backward with IEEE products and one of each with TF32 (-tf32). Each uses the
    configuration glu_matmul_config picks for a 4096 x 4096 x 4096 launch of its dtype (the
    128 x 64 x 64 tensor-core tile for 16-bit types). Sizes are 32-bit and row strides 64-bit,
    as the launcher passes a stride past 2^31 - 1; the fp32 specs take 64-bit sizes.

    Then act_matmul's kernels, named 'act_matmul_<fwd|bwd>-<dtype>-<activation>-<bias|nobias>
    [-store_pre|-need_h][-tf32][-small]', with act_matmul_config's tiles (and stage counts) for
    4096 rows, or for 64 rows (-small): for bf16 both kernels with gelu and gelu_tanh, each with
    and without the bias (STORE_PRE / NEED_H spread over them), and both kernels with the
    small-row tile; for fp16 one forward and one backward; for fp32 one forward and one
    backward with IEEE products, and with TF32 one of each at 4096 rows and at 64 rows; size and
    stride types as above.
    """
    bf16_cases = (
        ("fwd", "silu", None, False), ("fwd", "gelu", "rms", True),
        ("fwd", "gelu_tanh", "layer", False), ("fwd", "silu", "layer", True),
        ("bwd", "gelu_tanh", None, True), ("bwd", "silu", "rms", False),
        ("bwd", "gelu", "layer", True),
    )
    fp32_cases = (("fwd", "gelu", "layer", False), ("bwd", "gelu", None, False))
    for type_name, dtype, cases, size_type, tf32 in (
        ("bf16", torch.bfloat16, bf16_cases, "i32", False),
        ("fp16", torch.float16, (("fwd", "silu", "rms", True), ("bwd", "silu", "rms", True)),
         "i32", False),
        ("fp32", torch.float32, fp32_cases, "i64", False),
        ("fp32", torch.float32, fp32_cases, "i64", True),
    ):
        config = glu_matmul_config(4096, 4096, 4096, dtype)
        element = f"*{type_name}"
        for kind, activation, norm, flag in cases:
            signature = {
                "x_ptr": element, "w_gate_ptr": element, "w_up_ptr": element,
                "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "norm_weight_ptr": element,
                "norm_bias_ptr": element,
            }
            if kind == "fwd":
                kernel = _glu_matmul_fwd_kernel
                signature.update(h_ptr=element, gate_ptr=element, up_ptr=element)
                strides = ("x_row_stride",)
                flags = {"STORE_PRE": flag}
                suffix = "-store_pre" if flag else ""
            else:
                kernel = _glu_matmul_bwd_kernel
                signature.update(dh_ptr=element, dgate_ptr=element, dup_ptr=element,
                                 h_ptr=element)
                strides = ("x_row_stride", "dh_row_stride")
                flags = {"NEED_H": flag}
                suffix = "-need_h" if flag else ""
            signature.update(M=size_type, N=size_type, K=size_type)
            signature.update(dict.fromkeys(strides, "i64"))
            constexprs = dict(
                ACTIVATION=activation, NORM=norm or "none", HAS_NORM_WEIGHT=norm is not None,
                HAS_NORM_BIAS=norm == "layer", **flags,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                GROUP_M=config.group_m, INTERPRETED=False, TF32=tf32,
            )
            signature.update(dict.fromkeys(constexprs, "constexpr"))
            suffix += "-tf32" if tf32 else ""
            yield (f"glu_matmul_{kind}-{type_name}-{activation}-{norm or 'plain'}{suffix}",
                   kernel, signature, constexprs, config.num_warps,
                   {"num_stages": config.num_stages})

    bf16_act_cases = (
        ("fwd", "gelu", True, True), ("fwd", "gelu", False, False),
        ("fwd", "gelu_tanh", True, False), ("fwd", "gelu_tanh", False, True),
        ("bwd", "gelu", True, False), ("bwd", "gelu", False, True),
        ("bwd", "gelu_tanh", True, True), ("bwd", "gelu_tanh", False, False),
    )
    both_kernels = (("fwd", "gelu_tanh", True, True), ("bwd", "gelu_tanh", True, True))
    fp32_act_cases = (("fwd", "gelu", True, False), ("bwd", "gelu", False, False))
    for type_name, dtype, cases, size_type, tf32, n_rows in (
        ("bf16", torch.bfloat16, bf16_act_cases, "i32", False, 4096),
        ("bf16", torch.bfloat16, both_kernels, "i32", False, 64),
        ("fp16", torch.float16, both_kernels, "i32", False, 4096),
        ("fp32", torch.float32, fp32_act_cases, "i64", False, 4096),
        ("fp32", torch.float32, fp32_act_cases, "i64", True, 4096),
        ("fp32", torch.float32, both_kernels, "i64", True, 64),
    ):
        config = act_matmul_config(n_rows, 4096, 4096, dtype, tf32)
        element = f"*{type_name}"
        for kind, activation, has_bias, flag in cases:
            signature = {"x_ptr": element, "w_ptr": element, "bias_ptr": element}
            if kind == "fwd":
                kernel = _act_matmul_fwd_kernel
                signature.update(h_ptr=element, pre_ptr=element)
                strides = ("x_row_stride",)
                flags = {"STORE_PRE": flag}
                suffix = "-store_pre" if flag else ""
            else:
                kernel = _act_matmul_bwd_kernel
                signature.update(dh_ptr=element, dpre_ptr=element, h_ptr=element)
                strides = ("x_row_stride", "dh_row_stride")
                flags = {"NEED_H": flag}
                suffix = "-need_h" if flag else ""
            signature.update(M=size_type, N=size_type, K=size_type)
            signature.update(dict.fromkeys(strides, "i64"))
            constexprs = dict(
                ACTIVATION=activation, HAS_BIAS=has_bias, **flags,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                GROUP_M=config.group_m, INTERPRETED=False, TF32=tf32,
            )
            signature.update(dict.fromkeys(constexprs, "constexpr"))
            bias_name = "bias" if has_bias else "nobias"
            suffix += ("-tf32" if tf32 else "") + ("-small" if n_rows <= 64 else "")
            yield (f"act_matmul_{kind}-{type_name}-{activation}-{bias_name}{suffix}",
                   kernel, signature, constexprs, config.num_warps,
                   {"num_stages": config.num_stages})
