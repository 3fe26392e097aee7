"""Operand tiles of the attention kernels: q, k, v (and o, dout) rows loaded, the rotary
embedding applied on load and its transpose on store, and the QK^T dot of the loaded tiles.

RoPE (rotate-half, pairs d and d + D/2) is computed in fp32 from the loaded q or k tile and
rounded to the input dtype: that rounded tile is the QK^T operand. The rotated q/k are never
written to memory; the backward recomputes them from q, k and cos/sin. The gradients dq, dk are
accumulated in fp32 for the rotated values and get the transposed rotation (rope_rotate_grad)
before the one rounding to the input dtype (`_store_unrotated`).

q/k (and dq/dk) tiles are held as two column halves when RoPE is on, so the rotation and its
transpose are elementwise; without RoPE they are whole [rows, D] tiles. Tiles are padded to
BLOCK_D = max(16, next_pow2(D)) columns (BLOCK_H = max(16, next_pow2(D / 2)) per half with
RoPE); the columns past D (past D/2 in each half) load as zeros and are never stored, so every
D in 1..256 (even with RoPE) runs on the same tiles.

Split head dims (BLOCK_D2 > 0, launch.py's `_head_dim_parts`): every [rows, D] operand (v, o,
dout and the dv accumulator; without RoPE also q, k and the dq, dk accumulators) is held as two
column parts, columns [0, BLOCK_D) and [BLOCK_D, BLOCK_D + BLOCK_D2), both powers of two >= 16,
the second zero past D; e.g. D = 80 runs as 64 + 16 instead of 128, 96 as 64 + 32, 192 as
128 + 64. Every dot over D is then the sum of the two parts' dots (`_scores`, the dP dots of
backward.py). With RoPE, q and k (and dq, dk) stay the two padded rotation halves (BLOCK_H each),
whatever BLOCK_D2. BLOCK_D2 = 0: one part (the second of each pair a placeholder that no caller
reads).
"""

import triton
import triton.language as tl

from .._common import _dot, _round


@triton.jit
def _load_part(ptr, base, rows, row_stride, row_mask, FIRST_COL: tl.constexpr, WIDTH: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """[rows, WIDTH] tile of columns FIRST_COL.. of a [.., D] row-major operand, zero past D and
    where ~row_mask."""
    cols = FIRST_COL + tl.arange(0, WIDTH)
    offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    return tl.load(ptr + offsets, mask=row_mask[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _load_rows(ptr, base, rows, row_stride, row_mask, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """[rows, BLOCK_D] tile of a [.., D] row-major operand, zero past D and where ~row_mask."""
    return _load_part(ptr, base, rows, row_stride, row_mask, 0, BLOCK_D, HEAD_DIM)


@triton.jit
def _load_pair(ptr, base, rows, row_stride, row_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_D2: tl.constexpr):
    """The column parts (first, second) of rows of a [.., D] operand: [rows, BLOCK_D] and, with
    BLOCK_D2 > 0, [rows, BLOCK_D2] from column BLOCK_D on; else second is first (a placeholder)."""
    first = _load_part(ptr, base, rows, row_stride, row_mask, 0, BLOCK_D, HEAD_DIM)
    if BLOCK_D2 > 0:
        second = _load_part(ptr, base, rows, row_stride, row_mask, BLOCK_D, BLOCK_D2, HEAD_DIM)
    else:
        second = first
    return first, second


@triton.jit
def _store_part(ptr, base, rows, row_stride, row_mask, x, FIRST_COL: tl.constexpr, WIDTH: tl.constexpr,
                HEAD_DIM: tl.constexpr, INTERPRETED: tl.constexpr):
    """Store x [rows, WIDTH] into columns FIRST_COL.. (those below D) of a [.., D] row-major
    output, rounded once to its dtype."""
    cols = FIRST_COL + tl.arange(0, WIDTH)
    offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    tl.store(ptr + offsets, _round(x, ptr.dtype.element_ty, INTERPRETED),
             mask=row_mask[:, None] & (cols < HEAD_DIM)[None, :])


@triton.jit
def _store_pair(ptr, base, rows, row_stride, row_mask, x1, x2, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, INTERPRETED: tl.constexpr):
    """Store the column parts (x1, x2) of `_load_pair` (x2 ignored when BLOCK_D2 = 0)."""
    _store_part(ptr, base, rows, row_stride, row_mask, x1, 0, BLOCK_D, HEAD_DIM, INTERPRETED)
    if BLOCK_D2 > 0:
        _store_part(ptr, base, rows, row_stride, row_mask, x2, BLOCK_D, BLOCK_D2, HEAD_DIM, INTERPRETED)


@triton.jit
def _pair_zeros(rows: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr):
    """fp32 zero accumulators of the column parts: [rows, BLOCK_D] and [rows, BLOCK_D2] (a [1, 1]
    placeholder when BLOCK_D2 = 0)."""
    first = tl.zeros([rows, BLOCK_D], dtype=tl.float32)
    if BLOCK_D2 > 0:
        second = tl.zeros([rows, BLOCK_D2], dtype=tl.float32)
    else:
        second = tl.zeros([1, 1], dtype=tl.float32)
    return first, second


@triton.jit
def _load_rotated(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base, positions,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr, ROPE: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """The QK^T operand of q or k rows: (first, second).

    ROPE: the two halves [rows, BLOCK_H] of x rotated at `positions`, in fp32 from the loaded
    values and rounded to the input dtype: first = x1 c - x2 s, second = x2 c + x1 s (x1 =
    x[:, :D/2], x2 = x[:, D/2:]). Without ROPE: the column parts of `_load_pair` as loaded
    (BLOCK_H = BLOCK_D; with BLOCK_D2 = 0 the whole tile twice, the second a placeholder).
    """
    if ROPE:
        half: tl.constexpr = HEAD_DIM // 2
        cols = tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < half)[None, :]
        offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
        x1 = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + offsets + half, mask=mask, other=0.0).to(tl.float32)
        cs_offsets = cs_base + positions.to(tl.int64)[:, None] * half + cols[None, :]
        c = tl.load(cos_ptr + cs_offsets, mask=mask, other=0.0)
        s = tl.load(sin_ptr + cs_offsets, mask=mask, other=0.0)
        dtype = ptr.dtype.element_ty
        first = _round(x1 * c - x2 * s, dtype, INTERPRETED)
        second = _round(x2 * c + x1 * s, dtype, INTERPRETED)
    else:
        first, second = _load_pair(ptr, base, rows, row_stride, row_mask, HEAD_DIM, BLOCK_H, BLOCK_D2)
    return first, second


@triton.jit
def _store_unrotated(ptr, base, rows, row_stride, row_mask, g1, g2, cos_ptr, sin_ptr, cs_base,
                     positions, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D2: tl.constexpr, ROPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Store the gradient of q or k rows from the fp32 gradient of their rotated values.

    ROPE: (g1, g2) are the halves; dx1 = g1 c + g2 s, dx2 = g2 c - g1 s (rope_rotate_grad).
    Without ROPE: (g1, g2) are the column parts of `_load_pair` (g2 unused with BLOCK_D2 = 0).
    Rounded once to ptr's dtype.
    """
    if ROPE:
        dtype = ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK_H)
        offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
        half: tl.constexpr = HEAD_DIM // 2
        mask = row_mask[:, None] & (cols < half)[None, :]
        cs_offsets = cs_base + positions.to(tl.int64)[:, None] * half + cols[None, :]
        c = tl.load(cos_ptr + cs_offsets, mask=mask, other=0.0)
        s = tl.load(sin_ptr + cs_offsets, mask=mask, other=0.0)
        tl.store(ptr + offsets, _round(g1 * c + g2 * s, dtype, INTERPRETED), mask=mask)
        tl.store(ptr + offsets + half, _round(g2 * c - g1 * s, dtype, INTERPRETED), mask=mask)
    else:
        _store_pair(ptr, base, rows, row_stride, row_mask, g1, g2, HEAD_DIM, BLOCK_H, BLOCK_D2, INTERPRETED)


@triton.jit
def _scores(a1, a2, b1, b2, ROPE: tl.constexpr, BLOCK_D2: tl.constexpr, INTERPRETED: tl.constexpr,
            TF32: tl.constexpr):
    """a @ b^T in fp32 for rotated operands: a1 b1^T + a2 b2^T over the halves with ROPE or over
    the column parts with BLOCK_D2 > 0, a1 b1^T over the whole tiles otherwise. TF32: fp32
    operands multiply as TF32 (`_dot`)."""
    acc = tl.zeros([a1.shape[0], b1.shape[0]], dtype=tl.float32)
    acc = _dot(a1, tl.trans(b1), acc, INTERPRETED, TF32)
    if ROPE or BLOCK_D2 > 0:
        acc = _dot(a2, tl.trans(b2), acc, INTERPRETED, TF32)
    return acc
