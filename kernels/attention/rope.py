"""Operand tiles of the attention kernels: q, k, v (and o, dout) rows loaded, the rotary
embedding applied on load in the forward kernel, and the QK^T dots of the loaded tiles.

Column tiles (launch.py's `_head_dim_parts` chooses them). Every [rows, D] operand and
accumulator (v, o, dout, dv, and outside the forward's RoPE also q, k, dq, dk) is held as one
tile of BLOCK_D = max(16, next_pow2(D)) columns, or, split (BLOCK_D2 > 0), as two column parts,
columns [0, BLOCK_D) and [BLOCK_D, BLOCK_D + BLOCK_D2), both powers of two >= 16, the second zero
past D: e.g. D = 80 runs as 64 + 16 instead of 128, 96 as 64 + 32, 192 as 128 + 64. Every dot
over D is then the sum of the parts' dots (`_pair_scores`, `_scores`, the dP dots of
backward.py).

RoPE (rotate-half, pairs d and d + D/2) is the forward kernel's only: it computes the rotation
in fp32 from the loaded q or k tile and rounds it to the input dtype, and that rounded tile is
the QK^T operand (never written to memory). The backward kernels take q and k already rotated
(remat.ops.attention rotates them once per pass outside the kernels when a backward follows,
rope_rotated_once), so they hold q, k, dq, dk as the plain column parts above. With RoPE the
forward holds q and k by rotation halves instead, so the rotation is elementwise: each half of
D/2 columns is one tile of BLOCK_H = max(16, next_pow2(D/2)) columns or, split (BLOCK_H2 > 0),
two parts [0, BLOCK_H) and [BLOCK_H, BLOCK_H + BLOCK_H2) of the half, the second zero past D/2:
D/2 = 40 runs as 32 + 16 instead of 64, 48 as 32 + 16, 96 as 64 + 32. Column c of part p of the
first half pairs with column c of part p of the second half (d and d + D/2), so each part
rotates on its own. The forward's q/k operand is four tiles (x1, x2, x3, x4): first half part 1,
second half part 1, first half part 2, second half part 2; QK^T is the sum of the four parts'
dots (`_scores`). launch.ROPE_SPLIT_HALVES chooses padded (default) or split halves.

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
def _rotated_halves_part(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base, positions,
                         FIRST_COL: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    """Columns FIRST_COL.. of both halves of x (`_load_halves`) rotated at `positions`, in fp32
    from the loaded values and rounded to the input dtype: (x1 c - x2 s, x2 c + x1 s)."""
    x1, x2 = _load_halves(ptr, base, rows, row_stride, row_mask, FIRST_COL, WIDTH, HEAD_DIM)
    u1 = x1.to(tl.float32)
    u2 = x2.to(tl.float32)
    c, s = _rope_tables(cos_ptr, sin_ptr, cs_base, positions, row_mask, FIRST_COL, WIDTH, HEAD_DIM)
    dtype = ptr.dtype.element_ty
    return _round(u1 * c - u2 * s, dtype, INTERPRETED), _round(u2 * c + u1 * s, dtype, INTERPRETED)


@triton.jit
def _load_qk_tiles(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base, positions,
                   HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_H2: tl.constexpr,
                   ROPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """The forward's four q/k tiles (x1, x2, x3, x4) of the module docstring of rows of a [.., D]
    operand.

    ROPE: the parts of the rotation halves (x1, x2: columns [0, BLOCK_H) of the first and second
    half; x3, x4: [BLOCK_H, BLOCK_H + BLOCK_H2) with BLOCK_H2 > 0, else placeholders), rotated at
    `positions` (`_rotated_halves_part`: the QK^T operand). Without ROPE: the column parts of
    `_load_pair` as loaded (BLOCK_H = BLOCK_D), x3, x4 placeholders.
    """
    if ROPE:
        x1, x2 = _rotated_halves_part(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base, positions,
                                      0, BLOCK_H, HEAD_DIM, INTERPRETED)
        if BLOCK_H2 > 0:
            x3, x4 = _rotated_halves_part(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base,
                                          positions, BLOCK_H, BLOCK_H2, HEAD_DIM, INTERPRETED)
        else:
            x3, x4 = x1, x2
    else:
        x1, x2 = _load_pair(ptr, base, rows, row_stride, row_mask, HEAD_DIM, BLOCK_H, BLOCK_D2)
        x3, x4 = x1, x2
    return x1, x2, x3, x4


@triton.jit
def _scores(a1, a2, a3, a4, b1, b2, b3, b4, ROPE: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_H2: tl.constexpr,
            INTERPRETED: tl.constexpr, TF32: tl.constexpr):
    """The forward's a @ b^T in fp32 for the four q/k tiles of `_load_qk_tiles` of a and b: the sum of the used
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
def _pair_scores(a1, a2, b1, b2, BLOCK_D2: tl.constexpr, INTERPRETED: tl.constexpr, TF32: tl.constexpr):
    """a @ b^T in fp32 for the column parts (`_load_pair`) of a and b: a1 b1^T + a2 b2^T (the
    second with BLOCK_D2 > 0), summed in `_scores`' order without RoPE, so the backward recomputes
    the forward's scores (the dK/dV kernel takes K Q^T, the transpose: equal bits need the dot to
    round alike with swapped operands, as the interpreter's and fp32 FMA dots do; not established
    for tensor-core MMA). TF32 as `_scores`."""
    acc = tl.zeros([a1.shape[0], b1.shape[0]], dtype=tl.float32)
    acc = _dot(a1, tl.trans(b1), acc, INTERPRETED, TF32)
    if BLOCK_D2 > 0:
        acc = _dot(a2, tl.trans(b2), acc, INTERPRETED, TF32)
    return acc


@triton.jit
def _pair_grad_dots(ds, x1, x2, g1, g2, BLOCK_D2: tl.constexpr, INTERPRETED: tl.constexpr, TF32: tl.constexpr):
    """(g1 + ds @ x1, g2 + ds @ x2) over the used column parts (g2 returned as given with BLOCK_D2
    = 0): the backward's dq (dk), ds [rows, keys] and x the k (q) parts."""
    g1 = _dot(ds, x1, g1, INTERPRETED, TF32)
    if BLOCK_D2 > 0:
        g2 = _dot(ds, x2, g2, INTERPRETED, TF32)
    return g1, g2


@triton.jit
def _add_pair(ptr, base, rows, row_stride, row_mask, x1, x2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_D2: tl.constexpr):
    """Atomically add the fp32 column parts (x1, x2) of `_pair_zeros` into rows of a row-major fp32
    [.., D] buffer (`_add_part`; x2 ignored when BLOCK_D2 = 0)."""
    _add_part(ptr, base, rows, row_stride, row_mask, x1, 0, BLOCK_D, HEAD_DIM)
    if BLOCK_D2 > 0:
        _add_part(ptr, base, rows, row_stride, row_mask, x2, BLOCK_D, BLOCK_D2, HEAD_DIM)
