"""The attention backward kernels, recomputing P (and the dropout mask) from q, k and the
forward's lse; the [N, M] matrices are never written to memory.

No RoPE here: q and k come already rotated (remat.ops.attention rotates them once per pass
outside the kernels, rope_rotated_once, and rotates dq, dk back), and the forward kernel of such
a call ran on the same rotated q and k without RoPE, so the scores recomputed here sum QK^T in
the forward's order (rope.py `_pair_scores`).

Rounding points: Delta = rowsum(dout * o) in fp32 (a preprocess pass), P = exp2((t - lse) *
log2 e) from the forward's t bit for bit (logits.py), dS = P * (dP * keep/(1-p) - Delta) *
dt/ddot; P and dS are rounded to the input dtype before their dots (dV += P^T dO, dQ += dS K,
dK += dS^T Q), the accumulators are fp32 and rounded once to the input dtype. fp32 inputs skip
every rounding; their dots multiply in IEEE fp32, or in TF32 with the TF32 constexpr
(forward.py). With a split head dim (BLOCK_D2 > 0, rope.py) every [rows, D] operand and
accumulator is two column parts: QK^T and dP = dO_1 V_1^T + dO_2 V_2^T summed over the parts,
each part of dv, dk, dq its own dot.

Deterministic: a dK/dV kernel (program per key block and (batch, kv head), looping over the
group's query heads and their visible query blocks; or, HEAD_SPLITS > 1, per key block and
(batch, kv head, part of the group), writing fp32 partial sums that the launcher adds in a fixed
order) and a dQ kernel (program per query block and (batch, query head)), no atomics. Fast: the
dK/dV kernel also adds each tile's dQ into a zeroed fp32 buffer with atomics, then a small kernel
casts it.
"""

import triton
import triton.language as tl

from .._common import _dot, _round
from .logits import _recomputed_probs, _times_logit_grad
from .masks import (
    _OUT,
    _dropout_keep,
    _dropout_rows,
    _key_range,
    _offset_bounds,
    _operand_base,
    _query_block,
    _query_range,
    _sequence,
    _stats_base,
    _visible,
)
from .rope import (
    _add_pair,
    _load_pair,
    _load_part,
    _pair_grad_dots,
    _pair_scores,
    _pair_zeros,
    _store_pair,
    _store_part,
)


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr,
    stride_ob, stride_on, stride_oh, stride_dob, stride_don, stride_doh, N,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D2: tl.constexpr = 0,
):
    """Delta [B, Hq, N] fp32 = rowsum(dout * o) of one row block x (head, batch)."""
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    o1, o2 = _load_pair(o_ptr, b * stride_ob + h * stride_oh, rows, stride_on, row_mask, HEAD_DIM,
                        BLOCK_D, BLOCK_D2)
    do1, do2 = _load_pair(do_ptr, b * stride_dob + h * stride_doh, rows, stride_don, row_mask,
                          HEAD_DIM, BLOCK_D, BLOCK_D2)
    delta = tl.sum(o1.to(tl.float32) * do1.to(tl.float32), 1)
    if BLOCK_D2 > 0:
        delta += tl.sum(o2.to(tl.float32) * do2.to(tl.float32), 1)
    tl.store(delta_ptr + (b * tl.num_programs(1) + h) * N + rows, delta, mask=row_mask)


@triton.jit
def _bwd_kv_tile(
    dv, dv2, dk, dk2, k, k2, v, v2, start_n, key_pos, start_m, q_ptr, do_ptr, q_base, do_base,
    stride_qn, stride_don, lse_ptr, delta_ptr, row_base, dq_ptr, dq_base, dq_row_stride, N, M, lo_d, hi_d,
    scale, cap_scale, softcap, seed, rng_base, drop_groups, dropout_p, inv_keep,
    MASKED, ATOMIC_DQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    INTERPRETED: tl.constexpr, TF32: tl.constexpr,
):
    """One query tile's contribution to dv, dk (and with ATOMIC_DQ, dq) of a key block: returns
    (dv, dv2, dk, dk2), the column parts of dv and dk (rope.py; the second ones placeholders with
    BLOCK_D2 = 0). k, k2 and v, v2: the key block's column parts.

    Works on the transposed [keys, queries] tiles, so dv and dk accumulate as plain dots.
    MASKED (a runtime scalar) applies the window and the row/key bounds; the caller clears it
    only for tiles inside the band. N, M: the (sequence's) lengths; start_n: the key block's
    first key; rng_base: the dropout counter of row 0, key 0 of the head; drop_groups: the
    dropout counters per row (ceil(M / 4), M the launch's, max_seqlen_k for packed sequences).
    """
    rows = start_m + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    positions = rows + (M - N)
    q, q2 = _load_pair(q_ptr, q_base, rows, stride_qn, row_mask, HEAD_DIM, BLOCK_D, BLOCK_D2)
    do, do2 = _load_pair(do_ptr, do_base, rows, stride_don, row_mask, HEAD_DIM, BLOCK_D, BLOCK_D2)
    lse = tl.load(lse_ptr + row_base + rows, mask=row_mask, other=0.0)
    delta = tl.load(delta_ptr + row_base + rows, mask=row_mask, other=0.0)
    # Rows that saw no key have lse = +inf: P = exp2(-inf) = 0.
    p, th = _recomputed_probs(_pair_scores(k, k2, q, q2, BLOCK_D2, INTERPRETED, TF32), lse[None, :], scale,
                              cap_scale, softcap, SOFTCAP)
    dtype = do.dtype
    dp = _dot(v, tl.trans(do), tl.zeros([v.shape[0], BLOCK_M], dtype=tl.float32), INTERPRETED, TF32)
    if BLOCK_D2 > 0:
        dp = _dot(v2, tl.trans(do2), dp, INTERPRETED, TF32)
    if DROPOUT:
        # The [rows, keys] mask of the forward's stream, transposed to the [keys, rows] tiles.
        keep = tl.trans(_dropout_keep(seed, rng_base + rows.to(tl.int64) * drop_groups, start_n,
                                      dropout_p, BLOCK_N))
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = _times_logit_grad(p * (dp - delta[None, :]), th, scale, SOFTCAP)
    if MASKED:
        # Masked pairs get P = dS = 0 by selection: p * (dP - Delta) would be 0 * NaN there when the
        # row's Delta or the pair's dP is NaN (a NaN in v, dout or o), as in the C++ and CUDA kernels.
        row_pos = tl.where(row_mask, positions, -_OUT)
        visible = _visible(row_pos[None, :], key_pos[:, None], lo_d, hi_d)
        p = tl.where(visible, p, 0.0)
        ds = tl.where(visible, ds, 0.0)
    if DROPOUT:
        p_dropped = _round(tl.where(keep, p * inv_keep, 0.0), dtype, INTERPRETED)
    else:
        p_dropped = _round(p, dtype, INTERPRETED)
    dv = _dot(p_dropped, do, dv, INTERPRETED, TF32)
    if BLOCK_D2 > 0:
        dv2 = _dot(p_dropped, do2, dv2, INTERPRETED, TF32)
    ds = _round(ds, dtype, INTERPRETED)
    dk, dk2 = _pair_grad_dots(ds, q, q2, dk, dk2, BLOCK_D2, INTERPRETED, TF32)
    if ATOMIC_DQ:
        # This tile's dq, column part by part, added into the fp32 buffer.
        dq, dq2 = _pair_zeros(BLOCK_M, BLOCK_D, BLOCK_D2)
        dq, dq2 = _pair_grad_dots(tl.trans(ds), k, k2, dq, dq2, BLOCK_D2, INTERPRETED, TF32)
        _add_pair(dq_ptr, dq_base, rows, dq_row_stride, row_mask, dq, dq2, HEAD_DIM, BLOCK_D, BLOCK_D2)
    return dv, dv2, dk, dk2


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr, rng_ptr, cu_q_ptr, cu_k_ptr,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
    N, M, GROUP, scale, cap_scale, softcap, left, right, dropout_p, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr, TF32: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr, HEAD_SPLITS: tl.constexpr = 1, BLOCK_D2: tl.constexpr = 0,
):
    """dk, dv of one key block x (kv head, batch), summed over the GROUP query heads of the kv
    head and their visible query blocks in a fixed order. Grid (key blocks, Hkv, B).

    HEAD_SPLITS > 1 (a divisor of GROUP; the launchers choose it when the grid above would leave
    multiprocessors idle): grid (key blocks, Hkv * HEAD_SPLITS, B), program (.., kv_head *
    HEAD_SPLITS + s, ..) sums only the GROUP / HEAD_SPLITS query heads s * GROUP / HEAD_SPLITS ..
    of its kv head, and dk_ptr, dv_ptr are fp32 workspaces [B, M, Hkv * HEAD_SPLITS, D]
    ([total_k, ..] with VARLEN) that receive the partial sums unrounded; the launcher sums the
    HEAD_SPLITS partials of each kv head in a fixed order and rounds once.

    ATOMIC_DQ (the fast mode): also adds each tile's dq into dq_ptr, an fp32
    [B, N, Hq, D] buffer the caller zeroed, with atomics; otherwise dq_ptr is not touched.
    VARLEN: batch entries are the packed sequences (masks.py); blocks past a sequence's end do
    nothing.
    """
    start_n = tl.program_id(0) * BLOCK_N
    # out_head: the program's head in dk_ptr / dv_ptr (its kv head, or its (kv head, split)).
    out_head = tl.program_id(1).to(tl.int64)
    kv_head = out_head // HEAD_SPLITS
    b = tl.program_id(2).to(tl.int64)
    q_row0, k_row0, n, m, total_q = _sequence(cu_q_ptr, cu_k_ptr, b, N, M, VARLEN)
    num_out_heads = tl.num_programs(1)
    num_heads = num_out_heads // HEAD_SPLITS * GROUP
    heads_per_program = GROUP // HEAD_SPLITS
    first_head = kv_head * GROUP + (out_head % HEAD_SPLITS) * heads_per_program
    keys = start_n + tl.arange(0, BLOCK_N)
    key_mask = keys < m
    k, k2 = _load_pair(k_ptr, _operand_base(b, k_row0, stride_kb, stride_kn, kv_head, stride_kh, VARLEN), keys,
                       stride_kn, key_mask, HEAD_DIM, BLOCK_D, BLOCK_D2)
    v, v2 = _load_pair(v_ptr, _operand_base(b, k_row0, stride_vb, stride_vn, kv_head, stride_vh, VARLEN), keys,
                       stride_vn, key_mask, HEAD_DIM, BLOCK_D, BLOCK_D2)
    dv, dv2 = _pair_zeros(BLOCK_N, BLOCK_D, BLOCK_D2)
    dk, dk2 = _pair_zeros(BLOCK_N, BLOCK_D, BLOCK_D2)
    if DROPOUT:
        seed = tl.load(rng_ptr)
        rng_offset = tl.load(rng_ptr + 1)
    else:
        seed = 0
        rng_offset = 0
    lo, hi, int_start, int_end = _query_range(start_n, n, m, left, right, BLOCK_M, BLOCK_N)
    hi = tl.where(start_n < m, hi, lo)
    lo_d, hi_d = _offset_bounds(left, right)
    key_pos = tl.where(key_mask, keys, _OUT)
    # Dropout counters per row: four keys per Philox call over the launch's M (masks.py).
    drop_groups = tl.cdiv(M, 4)
    for head_in_program in range(heads_per_program):
        h = first_head + head_in_program
        q_base = _operand_base(b, q_row0, stride_qb, stride_qn, h, stride_qh, VARLEN)
        do_base = _operand_base(b, q_row0, stride_dob, stride_don, h, stride_doh, VARLEN)
        row_base = _stats_base(b, h, num_heads, N, q_row0, total_q, VARLEN)
        rng_base = rng_offset + (b * num_heads + h) * N * drop_groups
        dq_base = (q_row0 * num_heads + h) * HEAD_DIM
        for start_m in range(lo, hi, BLOCK_M):
            dv, dv2, dk, dk2 = _bwd_kv_tile(
                dv, dv2, dk, dk2, k, k2, v, v2, start_n, key_pos, start_m, q_ptr, do_ptr, q_base,
                do_base, stride_qn, stride_don, lse_ptr, delta_ptr, row_base, dq_ptr, dq_base,
                num_heads * HEAD_DIM, n, m, lo_d, hi_d,
                scale, cap_scale, softcap, seed, rng_base, drop_groups, dropout_p, inv_keep,
                (start_m < int_start) | (start_m >= int_end), ATOMIC_DQ, HEAD_DIM, BLOCK_D, BLOCK_D2,
                BLOCK_M, BLOCK_N, SOFTCAP, DROPOUT, INTERPRETED, TF32)
    # dk, dv are contiguous [B, M, Hkv, D] ([total_k, Hkv, D] with VARLEN), or the fp32
    # workspaces [B, M, Hkv * HEAD_SPLITS, D].
    out_base = (k_row0 * num_out_heads + out_head) * HEAD_DIM
    out_row_stride = num_out_heads * HEAD_DIM
    _store_pair(dk_ptr, out_base, keys, out_row_stride, key_mask, dk, dk2, HEAD_DIM, BLOCK_D, BLOCK_D2,
                INTERPRETED)
    _store_pair(dv_ptr, out_base, keys, out_row_stride, key_mask, dv, dv2, HEAD_DIM, BLOCK_D, BLOCK_D2,
                INTERPRETED)


@triton.jit
def _bwd_q_tile(
    dq, dq2, q, q2, do, do2, lse, delta, positions, start_n,
    k_ptr, v_ptr, k_base, v_base, stride_kn, stride_vn,
    M, lo_d, hi_d, scale, cap_scale, softcap, seed, rng_rows, dropout_p,
    inv_keep, MASKED, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, INTERPRETED: tl.constexpr,
    TF32: tl.constexpr,
):
    """One key tile's contribution to the dq of a query block: returns the updated column parts
    (dq, dq2) (rope.py; dq2 a placeholder with BLOCK_D2 = 0)."""
    keys = start_n + tl.arange(0, BLOCK_N)
    key_mask = keys < M
    k, k2 = _load_pair(k_ptr, k_base, keys, stride_kn, key_mask, HEAD_DIM, BLOCK_D, BLOCK_D2)
    v, v2 = _load_pair(v_ptr, v_base, keys, stride_vn, key_mask, HEAD_DIM, BLOCK_D, BLOCK_D2)
    p, th = _recomputed_probs(_pair_scores(q, q2, k, k2, BLOCK_D2, INTERPRETED, TF32), lse[:, None], scale,
                              cap_scale, softcap, SOFTCAP)
    dp = _dot(do, tl.trans(v), tl.zeros([do.shape[0], BLOCK_N], dtype=tl.float32), INTERPRETED, TF32)
    if BLOCK_D2 > 0:
        dp = _dot(do2, tl.trans(v2), dp, INTERPRETED, TF32)
    if DROPOUT:
        keep = _dropout_keep(seed, rng_rows, start_n, dropout_p, BLOCK_N)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = _times_logit_grad(p * (dp - delta[:, None]), th, scale, SOFTCAP)
    if MASKED:
        # dS = 0 by selection at masked pairs (_bwd_kv_tile says why).
        key_pos = tl.where(key_mask, keys, _OUT)
        ds = tl.where(_visible(positions[:, None], key_pos[None, :], lo_d, hi_d), ds, 0.0)
    return _pair_grad_dots(_round(ds, do.dtype, INTERPRETED), k, k2, dq, dq2, BLOCK_D2, INTERPRETED, TF32)


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, rng_ptr, cu_q_ptr, cu_k_ptr,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
    N, M, GROUP, scale, cap_scale, softcap, left, right, dropout_p, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr, TF32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr, BLOCK_D2: tl.constexpr = 0,
):
    """dq of one query block x (query head, batch), over its visible key tiles in order (the
    deterministic mode). Grid (query blocks, Hq, B), query blocks last-first. VARLEN: batch
    entries are the packed sequences (masks.py)."""
    q_row0, k_row0, n, m, total_q = _sequence(cu_q_ptr, cu_k_ptr, tl.program_id(2).to(tl.int64), N, M, VARLEN)
    start_m, rows, row_mask, positions, h, kv_head, b, num_heads = _query_block(
        n, m, GROUP, BLOCK_M)
    q, q2 = _load_pair(q_ptr, _operand_base(b, q_row0, stride_qb, stride_qn, h, stride_qh, VARLEN), rows,
                       stride_qn, row_mask, HEAD_DIM, BLOCK_D, BLOCK_D2)
    do, do2 = _load_pair(do_ptr, _operand_base(b, q_row0, stride_dob, stride_don, h, stride_doh, VARLEN), rows,
                         stride_don, row_mask, HEAD_DIM, BLOCK_D, BLOCK_D2)
    stats = _stats_base(b, h, num_heads, N, q_row0, total_q, VARLEN) + rows
    lse = tl.load(lse_ptr + stats, mask=row_mask, other=0.0)
    delta = tl.load(delta_ptr + stats, mask=row_mask, other=0.0)
    k_base = _operand_base(b, k_row0, stride_kb, stride_kn, kv_head, stride_kh, VARLEN)
    v_base = _operand_base(b, k_row0, stride_vb, stride_vn, kv_head, stride_vh, VARLEN)
    seed, rng_rows = _dropout_rows(rng_ptr, (b * num_heads + h) * N + rows, M, DROPOUT)
    dq, dq2 = _pair_zeros(BLOCK_M, BLOCK_D, BLOCK_D2)
    lo, hi, int_start, int_end = _key_range(start_m, n, m, left, right, BLOCK_M, BLOCK_N)
    hi = tl.where(start_m < n, hi, lo)
    lo_d, hi_d = _offset_bounds(left, right)
    for start_n in range(lo, hi, BLOCK_N):
        dq, dq2 = _bwd_q_tile(
            dq, dq2, q, q2, do, do2, lse, delta, positions, start_n,
            k_ptr, v_ptr, k_base, v_base, stride_kn, stride_vn,
            m, lo_d, hi_d, scale, cap_scale, softcap, seed, rng_rows, dropout_p, inv_keep,
            (start_n < int_start) | (start_n >= int_end), HEAD_DIM, BLOCK_D, BLOCK_D2,
            BLOCK_N, SOFTCAP, DROPOUT, INTERPRETED, TF32)
    # dq is contiguous [B, N, Hq, D] ([total_q, Hq, D] with VARLEN).
    _store_pair(dq_ptr, (q_row0 * num_heads + h) * HEAD_DIM, rows, num_heads * HEAD_DIM, row_mask, dq, dq2,
                HEAD_DIM, BLOCK_D, BLOCK_D2, INTERPRETED)


@triton.jit
def _attn_bwd_dq_postprocess_kernel(
    dq_acc_ptr, dq_ptr, N, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """dq = dq_acc rounded to dq's dtype, for one row block x (head, batch); both [B, N, Hq, D]
    contiguous (packed sequences: one batch entry of N = total_q rows), dq_acc fp32 (the fast
    mode's atomic buffer). BLOCK_D: the padded columns, max(16, next_pow2(D))."""
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    num_heads = tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    base = (b * N * num_heads + h) * HEAD_DIM
    row_stride = num_heads * HEAD_DIM
    dq = _load_part(dq_acc_ptr, base, rows, row_stride, row_mask, 0, BLOCK_D, HEAD_DIM)
    _store_part(dq_ptr, base, rows, row_stride, row_mask, dq, 0, BLOCK_D, HEAD_DIM, INTERPRETED)
