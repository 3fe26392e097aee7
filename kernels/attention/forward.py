"""The attention forward kernel: o and the fp32 logsumexp of one query block, online softmax
over its visible key tiles (masks.py).

Rounding points (those of an unfused PyTorch computation in the input dtype; the QK^T operand
and the logits are rope.py's and logits.py's):
- the softmax runs online over the key tiles with exp2: running max m of t, p = exp2((t - m) *
  log2 e), the row sum l of the undropped p; lse = m + log2(l) * ln 2, +inf (and o = 0) for a
  row that sees no key, NaN (and o NaN) for a row with a NaN or +inf logit, as stock's softmax;
- P (dropped and scaled by 1/(1-p)) is rounded to v's dtype before the PV dot (FlashAttention's
  rounding point); o = acc / l is rounded once. With a split head dim (BLOCK_D2 > 0, rope.py) v,
  the accumulator and o are two column parts, each part's PV dot its own (the same sums); the
  QK^T dot sums the parts of q and k (with RoPE up to four: two per rotation half, BLOCK_H2 > 0;
  RoPE is applied in this kernel only: the backward kernels take q and k already rotated).
fp32 inputs skip every rounding; their dots use IEEE fp32 products, or TF32 products when the
launcher passes TF32 (PyTorch's torch.backends.cuda.matmul.allow_tf32, read per call).

The max and lse are kept in natural units and the difference t - m (t - lse) is taken before the
scaling by log2 e, rather than the exp2-domain t2 = t * log2 e, m2, lse = (m2 + log2 l) * ln 2 and
exp2(t2 - lse * log2 e) that csrc/common/attention_math.h uses: the same function, one more
multiply per score, fewer roundings at the logits' magnitude. Measured on fp32 emulations of both
with logits up to 30-60 (q and k 4 times N(0, 1), D = 16, softcap 30 or none): dv's mean error
1.3-1.6 times lower; without softcap, dv exceeded 2x stock PyTorch's error plus the floor of
tests/_checks.py in 2 of 100 draws instead of 37. With an fp32 lse part of that error is
inherent: rounding the exact lse to fp32 alone gives 1.6-2.3 times stock's mean dv error at those
magnitudes (stock normalises each row by its own sum), so fp32 tests with such logits exceed the
2x rule now and then; moderate logits (|t| up to ~10) stay well inside it.
"""

import triton
import triton.language as tl

from .._common import _dot, _round
from .logits import _LN2, _LOG2E, _logits
from .masks import (
    _OUT,
    _dropout_keep,
    _dropout_rows,
    _key_range,
    _offset_bounds,
    _operand_base,
    _query_block,
    _rope_base,
    _sequence,
    _stats_base,
    _visible,
)
from .rope import _load_pair, _load_qk_tiles, _pair_zeros, _scores, _store_pair


@triton.jit
def _fwd_tile(
    acc, acc2, m, row_sum, q1, q2, q3, q4, positions, rng_rows, start_n,
    k_ptr, v_ptr, k_base, v_base, stride_kn, stride_vn, cos_ptr, sin_ptr, cs_base,
    M, lo_d, hi_d, scale, cap_scale, softcap, seed, dropout_p, inv_keep,
    MASKED, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_H2: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, INTERPRETED: tl.constexpr, TF32: tl.constexpr,
):
    """One key tile of the online softmax: returns the updated (acc, acc2, m, row_sum).
    q1..q4: the query block's q/k tiles (rope.py `_load_qk_tiles`).

    m is the running max of the logits (natural units), row_sum the running sum of the undropped
    probabilities exp2((t - m) * log2 e), acc the fp32 sum of round(P_dropped) @ V (its column
    parts acc, acc2 with BLOCK_D2 > 0; acc2 a placeholder otherwise). MASKED (a
    runtime scalar, uniform over the program) applies the window and the key bound; the caller
    clears it only for tiles that lie wholly inside every row's band.
    """
    keys = start_n + tl.arange(0, BLOCK_N)
    key_mask = keys < M
    k1, k2, k3, k4 = _load_qk_tiles(k_ptr, k_base, keys, stride_kn, key_mask, cos_ptr, sin_ptr, cs_base,
                                   keys, HEAD_DIM, BLOCK_H, BLOCK_D2, BLOCK_H2, ROPE, INTERPRETED)
    t, _ = _logits(_scores(q1, q2, q3, q4, k1, k2, k3, k4, ROPE, BLOCK_D2, BLOCK_H2, INTERPRETED, TF32), scale,
                   cap_scale, softcap, SOFTCAP)
    if MASKED:
        key_pos = tl.where(key_mask, keys, _OUT)
        t = tl.where(_visible(positions[:, None], key_pos[None, :], lo_d, hi_d), t,
                     float("-inf"))
    m_new = tl.maximum(m, tl.max(t, 1))
    # A row with no visible key so far keeps m = -inf: subtract 0 instead, so exp2 gives 0 (not
    # exp2(-inf + inf) = NaN) for both the rescale and the probabilities.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2((m - m_sub) * _LOG2E)
    p = tl.math.exp2((t - m_sub[:, None]) * _LOG2E)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    if DROPOUT:
        keep = _dropout_keep(seed, rng_rows, start_n, dropout_p, BLOCK_N)
        p = tl.where(keep, p * inv_keep, 0.0)
    v1, v2 = _load_pair(v_ptr, v_base, keys, stride_vn, key_mask, HEAD_DIM, BLOCK_D, BLOCK_D2)
    p = _round(p, v1.dtype, INTERPRETED)
    acc = _dot(p, v1, acc * alpha[:, None], INTERPRETED, TF32)
    if BLOCK_D2 > 0:
        acc2 = _dot(p, v2, acc2 * alpha[:, None], INTERPRETED, TF32)
    return acc, acc2, m_new, row_sum


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cos_ptr, sin_ptr, rng_ptr, cu_q_ptr, cu_k_ptr,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, cs_stride_b,
    N, M, GROUP, scale, cap_scale, softcap, left, right, dropout_p, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    ROPE: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, TF32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_D2: tl.constexpr = 0,
    BLOCK_H2: tl.constexpr = 0,
):
    """o and lse of one query block x (query head, batch). Grid (query blocks, Hq, B); the
    query blocks run last-first, so under a causal mask the longest rows start first. VARLEN:
    batch entries are the packed sequences (masks.py), blocks past a sequence's end do nothing."""
    q_row0, k_row0, n, m_len, total_q = _sequence(cu_q_ptr, cu_k_ptr, tl.program_id(2).to(tl.int64),
                                                  N, M, VARLEN)
    start_m, rows, row_mask, positions, h, kv_head, b, num_heads = _query_block(
        n, m_len, GROUP, BLOCK_M)
    cs_base = _rope_base(b, k_row0, cs_stride_b, VARLEN)
    q1, q2, q3, q4 = _load_qk_tiles(q_ptr, _operand_base(b, q_row0, stride_qb, stride_qn, h, stride_qh, VARLEN),
                                   rows, stride_qn, row_mask, cos_ptr, sin_ptr, cs_base, positions, HEAD_DIM,
                                   BLOCK_H, BLOCK_D2, BLOCK_H2, ROPE, INTERPRETED)
    k_base = _operand_base(b, k_row0, stride_kb, stride_kn, kv_head, stride_kh, VARLEN)
    v_base = _operand_base(b, k_row0, stride_vb, stride_vn, kv_head, stride_vh, VARLEN)
    # The dropout counters of key 0 of each row (row index into [B, Hq, N]; masks.py).
    seed, rng_rows = _dropout_rows(rng_ptr, (b * num_heads + h) * N + rows, M, DROPOUT)
    acc, acc2 = _pair_zeros(BLOCK_M, BLOCK_D, BLOCK_D2)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    lo, hi, int_start, int_end = _key_range(start_m, n, m_len, left, right, BLOCK_M, BLOCK_N)
    hi = tl.where(start_m < n, hi, lo)
    lo_d, hi_d = _offset_bounds(left, right)
    for start_n in range(lo, hi, BLOCK_N):
        acc, acc2, m, row_sum = _fwd_tile(
            acc, acc2, m, row_sum, q1, q2, q3, q4, positions, rng_rows, start_n,
            k_ptr, v_ptr, k_base, v_base, stride_kn, stride_vn, cos_ptr, sin_ptr, cs_base,
            m_len, lo_d, hi_d, scale, cap_scale, softcap, seed, dropout_p, inv_keep,
            (start_n < int_start) | (start_n >= int_end), HEAD_DIM, BLOCK_D, BLOCK_D2, BLOCK_H, BLOCK_H2,
            BLOCK_N, ROPE, SOFTCAP, DROPOUT, INTERPRETED, TF32)
    # A row saw a key when its sum is not 0; `row_sum > 0` would also be false for a NaN sum (a NaN
    # or +inf logit: its probability exp2(NaN) or exp2(inf - inf) is NaN) and turn that row into an
    # empty one (o = 0, lse = +inf) where stock's softmax gives NaN: NaN passes through to o and lse.
    seen = row_sum != 0.0
    divisor = tl.where(seen, row_sum, 1.0)[:, None]
    o = tl.where(seen[:, None], tl.math.div_rn(acc, divisor), 0.0)
    if BLOCK_D2 > 0:
        o2 = tl.where(seen[:, None], tl.math.div_rn(acc2, divisor), 0.0)
    else:
        o2 = o
    lse = tl.where(seen, m + tl.math.log2(tl.where(seen, row_sum, 1.0)) * _LN2, float("inf"))
    # o is contiguous [B, N, Hq, D] ([total_q, Hq, D] with VARLEN).
    _store_pair(o_ptr, (q_row0 * num_heads + h) * HEAD_DIM, rows, num_heads * HEAD_DIM, row_mask, o, o2,
                HEAD_DIM, BLOCK_D, BLOCK_D2, INTERPRETED)
    tl.store(lse_ptr + _stats_base(b, h, num_heads, N, q_row0, total_q, VARLEN) + rows, lse, mask=row_mask)
