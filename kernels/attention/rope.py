"""Operand tiles of the attention kernels: q, k, v (and o, dout) rows loaded, the rotary
embedding applied on load and its transpose on store, and the QK^T dot of the loaded tiles.

RoPE (rotate-half, pairs d and d + D/2) is computed in fp32 from the loaded q or k tile and
rounded to the input dtype: that rounded tile is the QK^T operand. The rotated q/k are never
written to memory; the backward recomputes them from q, k and cos/sin. The gradients dq, dk are
accumulated in fp32 for the rotated values and get the transposed rotation (rope_rotate_grad)
before the one rounding to the input dtype (`_store_unrotated`).

Column tiles (launch.py's `_head_dim_parts` chooses them). Every [rows, D] operand (v, o, dout
and the dv accumulator; without RoPE also q, k and the dq, dk accumulators) is held as one tile
of BLOCK_D = max(16, next_pow2(D)) columns, or, split (BLOCK_D2 > 0), as two column parts,
columns [0, BLOCK_D) and [BLOCK_D, BLOCK_D + BLOCK_D2), both powers of two >= 16, the second zero
past D: e.g. D = 80 runs as 64 + 16 instead of 128, 96 as 64 + 32, 192 as 128 + 64. Every dot
over D is then the sum of the parts' dots (`_scores`, the dP dots of backward.py).

With RoPE, q and k (and the dq, dk accumulators) are held by rotation halves instead, so the
rotation and its transpose are elementwise: each half of D/2 columns is one tile of BLOCK_H =
max(16, next_pow2(D/2)) columns or, split (BLOCK_H2 > 0), two parts [0, BLOCK_H) and [BLOCK_H,
BLOCK_H + BLOCK_H2) of the half, the second zero past D/2: D/2 = 40 runs as 32 + 16 instead of
64, 48 as 32 + 16, 96 as 64 + 32. Column c of part p of the first half pairs with column c of
part p of the second half (d and d + D/2), so each part rotates on its own. The q/k operand of
a launch is four tiles (x1, x2, x3, x4): first half part 1, second half part 1, first half part
2, second half part 2; QK^T is the sum of the four parts' dots. The two layouts sum QK^T in
different orders, so the forward and the backward of a call must use the same one (the backward
recomputes P against the forward's lse): launch.ROPE_SPLIT_HALVES sets it for all kernels, padded
by default.

The unused tiles are placeholders no caller reads: without RoPE x3, x4 (and x2 when BLOCK_D2 =
0) repeat the loaded tiles, and zero accumulators are [1, 1]. Columns past D (past D/2 in each
half) load as zeros and are never stored, so every D in 1..256 (even with RoPE) runs on the same
kernels.
"""

import triton
import triton.language as tl

from .._common import _dot, _round


@triton.jit
def _load_part(ptr, base, rows, row_stride, row_mask, FIRST_COL: tl.constexpr, WIDTH: tl.constexpr,
               END: tl.constexpr):
    """[rows, WIDTH] tile of columns FIRST_COL.. of a row-major operand (row r at base + r *
    row_stride), zero from column END on and where ~row_mask."""
    cols = FIRST_COL + tl.arange(0, WIDTH)
    offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    return tl.load(ptr + offsets, mask=row_mask[:, None] & (cols < END)[None, :], other=0.0)


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
                END: tl.constexpr, INTERPRETED: tl.constexpr):
    """Store x [rows, WIDTH] into columns FIRST_COL.. (those below END) of a row-major output,
    rounded once to its dtype."""
    cols = FIRST_COL + tl.arange(0, WIDTH)
    offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    tl.store(ptr + offsets, _round(x, ptr.dtype.element_ty, INTERPRETED),
             mask=row_mask[:, None] & (cols < END)[None, :])


@triton.jit
def _store_pair(ptr, base, rows, row_stride, row_mask, x1, x2, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, INTERPRETED: tl.constexpr):
    """Store the column parts (x1, x2) of `_load_pair` (x2 ignored when BLOCK_D2 = 0)."""
    _store_part(ptr, base, rows, row_stride, row_mask, x1, 0, BLOCK_D, HEAD_DIM, INTERPRETED)
    if BLOCK_D2 > 0:
        _store_part(ptr, base, rows, row_stride, row_mask, x2, BLOCK_D, BLOCK_D2, HEAD_DIM, INTERPRETED)


@triton.jit
def _add_part(ptr, base, rows, row_stride, row_mask, x, FIRST_COL: tl.constexpr, WIDTH: tl.constexpr,
              END: tl.constexpr):
    """Atomically add the fp32 x [rows, WIDTH] into columns FIRST_COL.. (those below END) of a
    row-major fp32 buffer (relaxed order: the sums' order varies between runs)."""
    cols = FIRST_COL + tl.arange(0, WIDTH)
    offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    tl.atomic_add(ptr + offsets, x, mask=row_mask[:, None] & (cols < END)[None, :], sem="relaxed")


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
def _qk_zeros(rows: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_H2: tl.constexpr,
              ROPE: tl.constexpr):
    """fp32 zero accumulators of the four q/k tiles (the dq, dk of the rotated values): with ROPE
    [rows, BLOCK_H] twice and [rows, BLOCK_H2] twice; without, `_pair_zeros(rows, BLOCK_H,
    BLOCK_D2)`; [1, 1] placeholders for the unused ones."""
    if ROPE:
        first = tl.zeros([rows, BLOCK_H], dtype=tl.float32)
        second = tl.zeros([rows, BLOCK_H], dtype=tl.float32)
        if BLOCK_H2 > 0:
            third = tl.zeros([rows, BLOCK_H2], dtype=tl.float32)
            fourth = tl.zeros([rows, BLOCK_H2], dtype=tl.float32)
        else:
            third = tl.zeros([1, 1], dtype=tl.float32)
            fourth = tl.zeros([1, 1], dtype=tl.float32)
    else:
        first, second = _pair_zeros(rows, BLOCK_H, BLOCK_D2)
        third = tl.zeros([1, 1], dtype=tl.float32)
        fourth = tl.zeros([1, 1], dtype=tl.float32)
    return first, second, third, fourth


@triton.jit
def _load_halves(ptr, base, rows, row_stride, row_mask, FIRST_COL: tl.constexpr, WIDTH: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """Columns FIRST_COL.. (WIDTH of them, zero from D/2 on) of both rotation halves of rows of a
    [.., D] operand: (x[:, FIRST_COL..], x[:, D/2 + FIRST_COL..]), each [rows, WIDTH]."""
    half: tl.constexpr = HEAD_DIM // 2
    x1 = _load_part(ptr, base, rows, row_stride, row_mask, FIRST_COL, WIDTH, half)
    x2 = _load_part(ptr, base + half, rows, row_stride, row_mask, FIRST_COL, WIDTH, half)
    return x1, x2


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, cs_base, positions, row_mask, FIRST_COL: tl.constexpr, WIDTH: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """(cos, sin) [rows, WIDTH] fp32 at `positions`, columns FIRST_COL.. of the [.., D/2] tables
    (zero from D/2 on and where ~row_mask)."""
    half: tl.constexpr = HEAD_DIM // 2
    c = _load_part(cos_ptr, cs_base, positions, half, row_mask, FIRST_COL, WIDTH, half)
    s = _load_part(sin_ptr, cs_base, positions, half, row_mask, FIRST_COL, WIDTH, half)
    return c, s


@triton.jit
def _halves_part(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base, positions,
                 FIRST_COL: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """Columns FIRST_COL.. of both halves of x (`_load_halves`); with ROTATE rotated at `positions`,
    in fp32 from the loaded values and rounded to the input dtype: (x1 c - x2 s, x2 c + x1 s)."""
    x1, x2 = _load_halves(ptr, base, rows, row_stride, row_mask, FIRST_COL, WIDTH, HEAD_DIM)
    if ROTATE:
        u1 = x1.to(tl.float32)
        u2 = x2.to(tl.float32)
        c, s = _rope_tables(cos_ptr, sin_ptr, cs_base, positions, row_mask, FIRST_COL, WIDTH, HEAD_DIM)
        dtype = ptr.dtype.element_ty
        x1 = _round(u1 * c - u2 * s, dtype, INTERPRETED)
        x2 = _round(u2 * c + u1 * s, dtype, INTERPRETED)
    return x1, x2


@triton.jit
def _load_qk_tiles(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base, positions,
                   HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_H2: tl.constexpr,
                   ROPE: tl.constexpr, ROTATE: tl.constexpr, INTERPRETED: tl.constexpr):
    """The four q/k tiles (x1, x2, x3, x4) of the module docstring of rows of a [.., D] operand.

    ROPE: the parts of the rotation halves (x1, x2: columns [0, BLOCK_H) of the first and second
    half; x3, x4: [BLOCK_H, BLOCK_H + BLOCK_H2) with BLOCK_H2 > 0, else placeholders), rotated by
    `_halves_part` with ROTATE (the QK^T operand), as stored without it (the fast mode's fp32 dq
    buffer). Without ROPE: the column parts of `_load_pair` as loaded (BLOCK_H = BLOCK_D), x3, x4
    placeholders.
    """
    if ROPE:
        x1, x2 = _halves_part(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base, positions, 0,
                              BLOCK_H, HEAD_DIM, ROTATE, INTERPRETED)
        if BLOCK_H2 > 0:
            x3, x4 = _halves_part(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base, positions,
                                  BLOCK_H, BLOCK_H2, HEAD_DIM, ROTATE, INTERPRETED)
        else:
            x3, x4 = x1, x2
    else:
        x1, x2 = _load_pair(ptr, base, rows, row_stride, row_mask, HEAD_DIM, BLOCK_H, BLOCK_D2)
        x3, x4 = x1, x2
    return x1, x2, x3, x4


@triton.jit
def _store_unrotated_part(ptr, base, rows, row_stride, row_mask, g1, g2, cos_ptr, sin_ptr, cs_base, positions,
                          FIRST_COL: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr,
                          INTERPRETED: tl.constexpr):
    """Store columns FIRST_COL.. of both halves of a gradient from the fp32 gradient (g1, g2) of
    the rotated values' same columns: dx1 = g1 c + g2 s, dx2 = g2 c - g1 s (rope_rotate_grad),
    rounded once to ptr's dtype."""
    half: tl.constexpr = HEAD_DIM // 2
    c, s = _rope_tables(cos_ptr, sin_ptr, cs_base, positions, row_mask, FIRST_COL, WIDTH, HEAD_DIM)
    _store_part(ptr, base, rows, row_stride, row_mask, g1 * c + g2 * s, FIRST_COL, WIDTH, half, INTERPRETED)
    _store_part(ptr, base + half, rows, row_stride, row_mask, g2 * c - g1 * s, FIRST_COL, WIDTH, half,
                INTERPRETED)


@triton.jit
def _store_unrotated(ptr, base, rows, row_stride, row_mask, g1, g2, g3, g4, cos_ptr, sin_ptr, cs_base,
                     positions, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr,
                     BLOCK_H2: tl.constexpr, ROPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Store the gradient of q or k rows from the fp32 gradient of their rotated values, given as
    the four q/k tiles (g1, g2, g3, g4) of `_load_qk_tiles`.

    ROPE: each part of the halves gets the transposed rotation (`_store_unrotated_part`; g3, g4
    only with BLOCK_H2 > 0). Without ROPE: (g1, g2) are the column parts of `_load_pair` (g2 unused
    with BLOCK_D2 = 0), g3, g4 unused. Rounded once to ptr's dtype.
    """
    if ROPE:
        _store_unrotated_part(ptr, base, rows, row_stride, row_mask, g1, g2, cos_ptr, sin_ptr, cs_base, positions,
                              0, BLOCK_H, HEAD_DIM, INTERPRETED)
        if BLOCK_H2 > 0:
            _store_unrotated_part(ptr, base, rows, row_stride, row_mask, g3, g4, cos_ptr, sin_ptr, cs_base,
                                  positions, BLOCK_H, BLOCK_H2, HEAD_DIM, INTERPRETED)
    else:
        _store_pair(ptr, base, rows, row_stride, row_mask, g1, g2, HEAD_DIM, BLOCK_H, BLOCK_D2, INTERPRETED)


@triton.jit
def _scores(a1, a2, a3, a4, b1, b2, b3, b4, ROPE: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_H2: tl.constexpr,
            INTERPRETED: tl.constexpr, TF32: tl.constexpr):
    """a @ b^T in fp32 for the four q/k tiles of `_load_qk_tiles` of a and b: the sum of the used
    parts' dots, a1 b1^T + a2 b2^T (with ROPE or BLOCK_D2 > 0) + a3 b3^T + a4 b4^T (with
    BLOCK_H2 > 0). TF32: fp32 operands multiply as TF32 (`_dot`)."""
    acc = tl.zeros([a1.shape[0], b1.shape[0]], dtype=tl.float32)
    acc = _dot(a1, tl.trans(b1), acc, INTERPRETED, TF32)
    if ROPE or BLOCK_D2 > 0:
        acc = _dot(a2, tl.trans(b2), acc, INTERPRETED, TF32)
    if BLOCK_H2 > 0:
        acc = _dot(a3, tl.trans(b3), acc, INTERPRETED, TF32)
        acc = _dot(a4, tl.trans(b4), acc, INTERPRETED, TF32)
    return acc


@triton.jit
def _qk_grad_dots(ds, x1, x2, x3, x4, g1, g2, g3, g4, ROPE: tl.constexpr, BLOCK_D2: tl.constexpr,
                  BLOCK_H2: tl.constexpr, INTERPRETED: tl.constexpr, TF32: tl.constexpr):
    """(g1 + ds @ x1, g2 + ds @ x2, g3 + ds @ x3, g4 + ds @ x4) over the used q/k tiles (as
    `_scores`; the unused accumulators returned as given): the dq (dk) of the rotated values,
    ds [rows, keys] and x the k (q) tiles."""
    g1 = _dot(ds, x1, g1, INTERPRETED, TF32)
    if ROPE or BLOCK_D2 > 0:
        g2 = _dot(ds, x2, g2, INTERPRETED, TF32)
    if BLOCK_H2 > 0:
        g3 = _dot(ds, x3, g3, INTERPRETED, TF32)
        g4 = _dot(ds, x4, g4, INTERPRETED, TF32)
    return g1, g2, g3, g4
