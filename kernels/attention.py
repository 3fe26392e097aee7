"""Triton flash attention with recompute backward: forward saves o and the fp32 logsumexp only.

The recompute contract (DESIGN.md section 2; python/remat/ops/attention.py states it for every
backend): the forward keeps q, k, v, o, lse (fp32 [B, Hq, N], natural log) and the dropout
seed/offset (the int64 rng tensor). The backward recomputes the probabilities P = exp(t - lse) tile
by tile from q, k and lse, the dropout mask from (seed, offset), and the rotary embedding of q and
k from cos/sin; the [N, M] matrices and the rotated q/k are never written to memory.

Shapes: q [B, N, Hq, D]; k, v [B, M, Hkv, D] (query head h reads kv head h // (Hq / Hkv)); any
strides with a unit last-dimension stride. Query i sits at position i + M - N (bottom-right
alignment) and sees key j iff (left < 0 or j >= pos - left) and (right < 0 or j <= pos + right);
causal is right = 0.

Rounding points (those of an unfused PyTorch computation in the input dtype):
- RoPE (rotate-half, pairs d and d + D/2) is computed in fp32 from the loaded q or k tile and
  rounded to the input dtype: that rounded tile is the QK^T operand;
- QK^T accumulates in fp32; logit t = dot * scale, or softcap * tanh(dot * scale / softcap)
  (`_tanh`: Triton has no tanh the interpreter can run);
- the softmax runs online over the key tiles with exp2: running max m of t, p = exp2((t - m) *
  log2 e), the row sum l of the undropped p; lse = m + log2(l) * ln 2, +inf (and o = 0) for a
  row that sees no key;
- P (dropped and scaled by 1/(1-p)) is rounded to v's dtype before the PV dot (FlashAttention's
  rounding point); o = acc / l is rounded once;
- backward: Delta = rowsum(dout * o) in fp32 (a preprocess pass), P = exp2((t - lse) * log2 e)
  from the forward's t bit for bit, dS = P * (dP * keep/(1-p) - Delta) * dt/ddot; P and dS are
  rounded to the input dtype before their dots (dV += P^T dO, dQ += dS K, dK += dS^T Q), the
  accumulators are fp32 and dq, dk get the transposed rotation (rope_rotate_grad) before the one
  rounding to the input dtype.
fp32 inputs skip every rounding (dots use IEEE fp32 products).

The max and lse are kept in natural units and the difference t - m (t - lse) is taken before the
scaling by log2 e, rather than the exp2-domain t2 = t * log2 e, m2, lse = (m2 + log2 l) * ln 2 and
exp2(t2 - lse * log2 e) that csrc/common/attention_math.h uses: the same function, one more multiply per
score, fewer roundings at the logits' magnitude. Measured on fp32 emulations of both with logits
up to 30-60 (q and k 4 times N(0, 1), D = 16, softcap 30 or none): dv's mean error 1.3-1.6 times
lower; without softcap, dv exceeded 2x stock PyTorch's error plus the floor of tests/_checks.py
in 2 of 100 draws instead of 37. With an fp32 lse part of that error is inherent: rounding the
exact lse to fp32 alone gives 1.6-2.3 times stock's mean dv error at those magnitudes (stock
normalises each row by its own sum), so fp32 tests with such logits exceed the 2x rule now and
then; moderate logits (|t| up to ~10) stay well inside it.

Dropout: element (b, h, i, j) of the [B, Hq, N, M] probabilities (h the query head) draws
tl.rand(seed, offset + ((b * Hq + h) * N + i) * M + j) with an int64 counter and is kept iff the
draw is >= dropout_p: remat.reference.attention_dropout_keep and csrc/common/philox.h produce the
same mask. The seed and offset are read on the device from rng = int64 [seed, offset].

Work per program only covers the visible band: a query block visits the key range
[max(0, first_pos - left), min(M, last_pos + right + 1)), and a key block the matching query
range (`_key_range`, `_query_range`). One loop walks those tiles; a scalar per tile says whether
it straddles an edge of the band (the causal diagonal, a window edge, the end of the keys or
queries), and only those tiles run the mask arithmetic, two compares per score on key - position
offsets (`_visible`), under a branch uniform across the program. Three loops (masked lead,
unmasked interior, masked tail) cost 56-120 bytes of register spills per thread in the sm_80
build of the forward at D 64, where this single loop has none. q/k (and dq/dk) tiles are held as
two column halves when RoPE is on, so the rotation and its transpose are elementwise; without
RoPE they are whole [rows, D] tiles.

Backward, deterministic: a dK/dV kernel (program per key block and (batch, kv head), looping over
the group's query heads and their visible query blocks) and a dQ kernel (program per query block
and (batch, query head)), no atomics. Fast: the dK/dV kernel also adds each tile's dQ into a
zeroed fp32 buffer with atomics, then a small kernel rotates and casts it.

Block sizes: `triton.autotune` over a few configurations per kernel, padded head dim, dtype
class and feature weight (`_CONFIGS`, `_configs_for`) when compiled; a fixed 16 x 16 tile under
the interpreter. REMAT_ATTENTION_AUTOTUNE=0 (read at import) launches the first configuration
of each list without benchmarking, so every process picks the same tiles: the deterministic
backward is then bitwise reproducible across processes too, not only within one (the autotuner
caches its choice per process, and another choice changes the summation order).

`_round` (kernels/norm.py) and `_dot` (kernels/matmul.py) are imported relatively when this module
is remat.kernels.attention, and by file path when the file is loaded outside a package.
"""

import importlib.util
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

try:
    from .matmul import _dot
    from .norm import _round
except ImportError:
    # Loaded by file path (tests/test_triton_aot.py), with no parent package: load the sibling
    # files under private names.
    def _load_sibling(stem):
        spec = importlib.util.spec_from_file_location(
            f"{__name__}_{stem}", Path(__file__).with_name(f"{stem}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    _dot = _load_sibling("matmul")._dot
    _round = _load_sibling("norm")._round

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
# Sequence lengths below 2^28 keep the kernels' position arithmetic (see _OUT) inside int32.
_MAX_LENGTH = 1 << 28
_MAX_GRID_YZ = 65535

# tanh(x) = x + x^3 R(x^2) for |x| < 0.75, R a degree-6 polynomial fitted to tanh on [0, 0.75]
# (least squares on Chebyshev nodes, reweighted toward minimax relative error); evaluated in fp32
# it is within 0.75 ulp of tanh there. Above 0.75, tanh = 1 - 2e / (1 + e) with e = exp(-2|x|)
# <= 0.22, within 1.6 ulp (numpy's exp; ex2.approx on the GPU adds up to about 2 ulp of e, which
# the factor 2e / (1 + e) <= 0.37 shrinks). The exp form alone near 0 loses all relative
# accuracy (1 - e cancels), which softcap then multiplies by the cap (30-50).
_TANH_LIMIT = tl.constexpr(0.75)
_TANH_R0 = tl.constexpr(-3.3333332231e-01)
_TANH_R1 = tl.constexpr(1.3333280960e-01)
_TANH_R2 = tl.constexpr(-5.3959888259e-02)
_TANH_R3 = tl.constexpr(2.1805848495e-02)
_TANH_R4 = tl.constexpr(-8.6003612189e-03)
_TANH_R5 = tl.constexpr(2.9743004571e-03)
_TANH_R6 = tl.constexpr(-6.3505479826e-04)


@triton.jit
def _tanh(x):
    """tanh of fp32 x from a polynomial and exp: Triton has tanh only in libdevice, which the
    interpreter cannot run; one formula keeps the CPU tests on the compiled arithmetic."""
    ax = tl.abs(x)
    x2 = ax * ax
    poly = _TANH_R5 + x2 * _TANH_R6
    poly = _TANH_R4 + x2 * poly
    poly = _TANH_R3 + x2 * poly
    poly = _TANH_R2 + x2 * poly
    poly = _TANH_R1 + x2 * poly
    poly = _TANH_R0 + x2 * poly
    small = ax + ax * x2 * poly
    e = tl.exp(-2.0 * ax)
    large = 1.0 - tl.math.div_rn(2.0 * e, 1.0 + e)
    magnitude = tl.where(ax < _TANH_LIMIT, small, large)
    return tl.where(x < 0.0, -magnitude, magnitude)


@triton.jit
def _logits(dot, scale, cap_scale, softcap, SOFTCAP: tl.constexpr):
    """(t, tanh term) for the fp32 dot products: the logit t = dot * scale, or softcap *
    tanh(dot * scale / softcap), in natural units; the tanh (for the logit's derivative) with
    SOFTCAP, else `dot` as a placeholder. Forward and backward share this, so the backward's
    logits are the forward's bit for bit."""
    if SOFTCAP:
        th = _tanh(dot * cap_scale)
        t = th * softcap
    else:
        th = dot
        t = dot * scale
    return t, th


@triton.jit
def _recomputed_probs(dot, lse, scale, cap_scale, softcap, SOFTCAP: tl.constexpr):
    """(P, tanh term) of the backward from the fp32 dot products and the rows' lse:
    P = exp2((t - lse) * log2 e), with `_logits`'s t and tanh term."""
    t, th = _logits(dot, scale, cap_scale, softcap, SOFTCAP)
    return tl.math.exp2((t - lse) * _LOG2E), th


@triton.jit
def _times_logit_grad(value, th, scale, SOFTCAP: tl.constexpr):
    """value * dt/ddot: scale * (1 - tanh^2) with softcap (attention_logit_grad), else scale."""
    if SOFTCAP:
        result = value * (scale * (1.0 - th * th))
    else:
        result = value * scale
    return result


# Window offsets are clamped to _FAR (the launchers clamp left/right), and masked-off rows and
# keys get positions _OUT away, so one offset test covers the window and both bounds. Exact for
# N, M < 2^28, which the launchers check; 2 * _OUT stays inside int32.
_FAR = tl.constexpr(1 << 28)
_OUT = tl.constexpr(1 << 29)


@triton.jit
def _offset_bounds(left, right):
    """(lo, hi): key j is inside the window of the query at position pos iff
    lo <= j - pos <= hi (left/right < 0: unbounded, as -_FAR / _FAR)."""
    return tl.where(left >= 0, -left, -_FAR), tl.where(right >= 0, right, _FAR)


@triton.jit
def _visible(row_pos, key_pos, lo, hi):
    """The visibility mask of broadcast row_pos (query positions, -_OUT for rows past N) and
    key_pos (key indices, _OUT for keys past M): two compares per element."""
    offset = key_pos - row_pos
    return (offset >= lo) & (offset <= hi)


@triton.jit
def _interior(lo, lo_full, hi_full, BLOCK: tl.constexpr):
    """[int_start, int_end): the tiles lo + k * BLOCK that lie inside [lo_full, hi_full), i.e.
    need no mask; empty when the bounds cross."""
    int_start = lo + tl.cdiv(tl.maximum(lo_full - lo, 0), BLOCK) * BLOCK
    int_end = int_start + (tl.maximum(hi_full - int_start, 0) // BLOCK) * BLOCK
    return int_start, int_end


@triton.jit
def _key_range(start_m, N, M, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles of the query block [start_m, start_m + BLOCK_M): (lo, hi, int_start, int_end),
    the keys [lo, hi) some row of the block sees and its unmasked tiles (`_interior`)."""
    shift = M - N
    first_pos = start_m + shift
    last_pos = tl.minimum(start_m + BLOCK_M, N) - 1 + shift
    lo = tl.where(left >= 0, tl.maximum(first_pos - left, 0), 0)
    hi = tl.where(right >= 0, tl.minimum(last_pos + right + 1, M), M)
    # Keys >= lo_full are inside every row's left edge, keys < hi_full inside every right edge.
    lo_full = tl.where(left >= 0, tl.maximum(last_pos - left, lo), lo)
    hi_full = tl.where(right >= 0, tl.minimum(first_pos + right + 1, hi), hi)
    int_start, int_end = _interior(lo, lo_full, hi_full, BLOCK_N)
    return lo, hi, int_start, int_end


@triton.jit
def _query_range(start_n, N, M, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query tiles that see some key of the block [start_n, start_n + BLOCK_N): (lo, hi,
    int_start, int_end) as in `_key_range`. Row i sees key j iff
    j - shift - right <= i <= j - shift + left. A block that runs past M has no interior."""
    shift = M - N
    end_n = start_n + BLOCK_N
    last_key = tl.minimum(end_n, M) - 1
    lo = tl.where(right >= 0, tl.maximum(start_n - shift - right, 0), 0)
    hi = tl.where(left >= 0, tl.minimum(last_key - shift + left + 1, N), N)
    lo_full = tl.where(right >= 0, tl.maximum(end_n - 1 - shift - right, lo), lo)
    hi_full = tl.where(left >= 0, tl.minimum(start_n - shift + left + 1, hi), hi)
    hi_full = tl.where(end_n <= M, hi_full, lo)
    int_start, int_end = _interior(lo, lo_full, hi_full, BLOCK_M)
    return lo, hi, int_start, int_end


@triton.jit
def _load_rows(ptr, base, rows, row_stride, row_mask, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """[rows, BLOCK_D] tile of a [.., D] row-major operand, zero past D and where ~row_mask."""
    cols = tl.arange(0, BLOCK_D)
    offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    return tl.load(ptr + offsets, mask=row_mask[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _load_rotated(ptr, base, rows, row_stride, row_mask, cos_ptr, sin_ptr, cs_base, positions,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, ROPE: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """The QK^T operand of q or k rows: (first, second).

    ROPE: the two halves [rows, BLOCK_H] of x rotated at `positions`, in fp32 from the loaded
    values and rounded to the input dtype: first = x1 c - x2 s, second = x2 c + x1 s (x1 =
    x[:, :D/2], x2 = x[:, D/2:]). Without ROPE: the whole [rows, BLOCK_H = BLOCK_D] tile as
    loaded, twice (the second is a placeholder that no caller reads).
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
        first = _load_rows(ptr, base, rows, row_stride, row_mask, HEAD_DIM, BLOCK_H)
        second = first
    return first, second


@triton.jit
def _store_unrotated(ptr, base, rows, row_stride, row_mask, g1, g2, cos_ptr, sin_ptr, cs_base,
                     positions, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     ROPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Store the gradient of q or k rows from the fp32 gradient of their rotated values.

    ROPE: (g1, g2) are the halves; dx1 = g1 c + g2 s, dx2 = g2 c - g1 s (rope_rotate_grad).
    Without ROPE: g1 is the whole tile. Rounded once to ptr's dtype.
    """
    dtype = ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    if ROPE:
        half: tl.constexpr = HEAD_DIM // 2
        mask = row_mask[:, None] & (cols < half)[None, :]
        cs_offsets = cs_base + positions.to(tl.int64)[:, None] * half + cols[None, :]
        c = tl.load(cos_ptr + cs_offsets, mask=mask, other=0.0)
        s = tl.load(sin_ptr + cs_offsets, mask=mask, other=0.0)
        tl.store(ptr + offsets, _round(g1 * c + g2 * s, dtype, INTERPRETED), mask=mask)
        tl.store(ptr + offsets + half, _round(g2 * c - g1 * s, dtype, INTERPRETED), mask=mask)
    else:
        mask = row_mask[:, None] & (cols < HEAD_DIM)[None, :]
        tl.store(ptr + offsets, _round(g1, dtype, INTERPRETED), mask=mask)


@triton.jit
def _scores(a1, a2, b1, b2, ROPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """a @ b^T in fp32 for rotated operands: a1 b1^T + a2 b2^T over the halves with ROPE,
    a1 b1^T over the whole tiles without."""
    acc = tl.zeros([a1.shape[0], b1.shape[0]], dtype=tl.float32)
    acc = _dot(a1, tl.trans(b1), acc, INTERPRETED)
    if ROPE:
        acc = _dot(a2, tl.trans(b2), acc, INTERPRETED)
    return acc


@triton.jit
def _dropout_keep(seed, counters, dropout_p):
    """Keep mask of the draws at the int64 `counters`: tl.rand(seed, counter) >= dropout_p."""
    return tl.rand(seed, counters) >= dropout_p


@triton.jit
def _fwd_tile(
    acc, m, l, q1, q2, positions, rng_rows, start_n,
    k_ptr, v_ptr, k_base, v_base, stride_kn, stride_vn, cos_ptr, sin_ptr, cs_base,
    M, lo_d, hi_d, scale, cap_scale, softcap, seed, dropout_p, inv_keep,
    MASKED, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One key tile of the online softmax: returns the updated (acc, m, l).

    m is the running max of the logits (natural units), l the running sum of the undropped
    probabilities exp2((t - m) * log2 e), acc the fp32 sum of round(P_dropped) @ V. MASKED (a
    runtime scalar, uniform over the program) applies the window and the key bound; the caller
    clears it only for tiles that lie wholly inside every row's band.
    """
    keys = start_n + tl.arange(0, BLOCK_N)
    key_mask = keys < M
    k1, k2 = _load_rotated(k_ptr, k_base, keys, stride_kn, key_mask, cos_ptr, sin_ptr, cs_base,
                           keys, HEAD_DIM, BLOCK_H, ROPE, INTERPRETED)
    t, _ = _logits(_scores(q1, q2, k1, k2, ROPE, INTERPRETED), scale, cap_scale, softcap,
                   SOFTCAP)
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
    l = l * alpha + tl.sum(p, 1)
    if DROPOUT:
        keep = _dropout_keep(seed, rng_rows[:, None] + keys[None, :], dropout_p)
        p = tl.where(keep, p * inv_keep, 0.0)
    v = _load_rows(v_ptr, v_base, keys, stride_vn, key_mask, HEAD_DIM, BLOCK_D)
    acc = _dot(_round(p, v.dtype, INTERPRETED), v, acc * alpha[:, None], INTERPRETED)
    return acc, m_new, l


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cos_ptr, sin_ptr, rng_ptr,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, cs_stride_b,
    N, M, GROUP, scale, cap_scale, softcap, left, right, dropout_p, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    ROPE: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """o and lse of one query block x (query head, batch). Grid (query blocks, Hq, B); the
    query blocks run last-first, so under a causal mask the longest rows start first."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    num_heads = tl.num_programs(1)
    kv_head = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    positions = rows + (M - N)
    cs_base = b * cs_stride_b
    q1, q2 = _load_rotated(q_ptr, b * stride_qb + h * stride_qh, rows, stride_qn, row_mask,
                           cos_ptr, sin_ptr, cs_base, positions, HEAD_DIM, BLOCK_H, ROPE,
                           INTERPRETED)
    k_base = b * stride_kb + kv_head * stride_kh
    v_base = b * stride_vb + kv_head * stride_vh
    # Row index into [B, Hq, N]; the dropout counters continue it over the M keys.
    row_ids = (b * num_heads + h) * N + rows
    if DROPOUT:
        seed = tl.load(rng_ptr)
        rng_rows = tl.load(rng_ptr + 1) + row_ids * M
    else:
        seed = 0
        rng_rows = row_ids
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    lo, hi, int_start, int_end = _key_range(start_m, N, M, left, right, BLOCK_M, BLOCK_N)
    lo_d, hi_d = _offset_bounds(left, right)
    for start_n in range(lo, hi, BLOCK_N):
        acc, m, l = _fwd_tile(
            acc, m, l, q1, q2, positions, rng_rows, start_n,
            k_ptr, v_ptr, k_base, v_base, stride_kn, stride_vn, cos_ptr, sin_ptr, cs_base,
            M, lo_d, hi_d, scale, cap_scale, softcap, seed, dropout_p, inv_keep,
            (start_n < int_start) | (start_n >= int_end), HEAD_DIM, BLOCK_D, BLOCK_H, BLOCK_N,
            ROPE, SOFTCAP, DROPOUT, INTERPRETED)
    seen = l > 0.0
    o = tl.math.div_rn(acc, tl.where(seen, l, 1.0)[:, None])
    o = tl.where(seen[:, None], o, 0.0)
    lse = tl.where(seen, m + tl.math.log2(tl.where(seen, l, 1.0)) * _LN2, float("inf"))
    # o is contiguous [B, N, Hq, D].
    o_base = (b * N * num_heads + h) * HEAD_DIM
    cols = tl.arange(0, BLOCK_D)
    o_offsets = o_base + rows.to(tl.int64)[:, None] * (num_heads * HEAD_DIM) + cols[None, :]
    tl.store(o_ptr + o_offsets, _round(o, o_ptr.dtype.element_ty, INTERPRETED),
             mask=row_mask[:, None] & (cols < HEAD_DIM)[None, :])
    tl.store(lse_ptr + row_ids, lse, mask=row_mask)


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr,
    stride_ob, stride_on, stride_oh, stride_dob, stride_don, stride_doh, N,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Delta [B, Hq, N] fp32 = rowsum(dout * o) of one row block x (head, batch)."""
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    o = _load_rows(o_ptr, b * stride_ob + h * stride_oh, rows, stride_on, row_mask, HEAD_DIM,
                   BLOCK_D)
    do = _load_rows(do_ptr, b * stride_dob + h * stride_doh, rows, stride_don, row_mask,
                    HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + (b * tl.num_programs(1) + h) * N + rows, delta, mask=row_mask)


@triton.jit
def _bwd_kv_tile(
    dv, dk1, dk2, k1, k2, v, keys, key_pos, start_m, q_ptr, do_ptr, q_base, do_base,
    stride_qn, stride_don, lse_ptr, delta_ptr, row_base, dq_ptr, dq_base, dq_row_stride,
    cos_ptr, sin_ptr, cs_base, N, M, lo_d, hi_d,
    scale, cap_scale, softcap, seed, rng_base, dropout_p, inv_keep,
    MASKED, ATOMIC_DQ: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, ROPE: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One query tile's contribution to dv, dk (and with ATOMIC_DQ, dq) of a key block.

    Works on the transposed [keys, queries] tiles, so dv and dk accumulate as plain dots.
    MASKED (a runtime scalar) applies the window and the row/key bounds; the caller clears it
    only for tiles inside the band.
    """
    rows = start_m + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    positions = rows + (M - N)
    q1, q2 = _load_rotated(q_ptr, q_base, rows, stride_qn, row_mask, cos_ptr, sin_ptr, cs_base,
                           positions, HEAD_DIM, BLOCK_H, ROPE, INTERPRETED)
    do = _load_rows(do_ptr, do_base, rows, stride_don, row_mask, HEAD_DIM, BLOCK_D)
    lse = tl.load(lse_ptr + row_base + rows, mask=row_mask, other=0.0)
    delta = tl.load(delta_ptr + row_base + rows, mask=row_mask, other=0.0)
    # Rows that saw no key have lse = +inf: P = exp2(-inf) = 0.
    p, th = _recomputed_probs(_scores(k1, k2, q1, q2, ROPE, INTERPRETED), lse[None, :], scale,
                              cap_scale, softcap, SOFTCAP)
    if MASKED:
        row_pos = tl.where(row_mask, positions, -_OUT)
        p = tl.where(_visible(row_pos[None, :], key_pos[:, None], lo_d, hi_d), p, 0.0)
    dtype = do.dtype
    dp = _dot(v, tl.trans(do), tl.zeros([v.shape[0], BLOCK_M], dtype=tl.float32), INTERPRETED)
    if DROPOUT:
        keep = _dropout_keep(
            seed, rng_base + rows.to(tl.int64)[None, :] * M + keys[:, None], dropout_p)
        dv = _dot(_round(tl.where(keep, p * inv_keep, 0.0), dtype, INTERPRETED), do, dv,
                  INTERPRETED)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    else:
        dv = _dot(_round(p, dtype, INTERPRETED), do, dv, INTERPRETED)
    ds = _round(_times_logit_grad(p * (dp - delta[None, :]), th, scale, SOFTCAP), dtype,
                INTERPRETED)
    dk1 = _dot(ds, q1, dk1, INTERPRETED)
    if ROPE:
        dk2 = _dot(ds, q2, dk2, INTERPRETED)
    if ATOMIC_DQ:
        ds_t = tl.trans(ds)
        cols = tl.arange(0, BLOCK_H)
        offsets = dq_base + rows.to(tl.int64)[:, None] * dq_row_stride + cols[None, :]
        zeros = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        if ROPE:
            half: tl.constexpr = HEAD_DIM // 2
            mask = row_mask[:, None] & (cols < half)[None, :]
            tl.atomic_add(dq_ptr + offsets, _dot(ds_t, k1, zeros, INTERPRETED), mask=mask,
                          sem="relaxed")
            tl.atomic_add(dq_ptr + offsets + half, _dot(ds_t, k2, zeros, INTERPRETED),
                          mask=mask, sem="relaxed")
        else:
            mask = row_mask[:, None] & (cols < HEAD_DIM)[None, :]
            tl.atomic_add(dq_ptr + offsets, _dot(ds_t, k1, zeros, INTERPRETED), mask=mask,
                          sem="relaxed")
    return dv, dk1, dk2


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr,
    cos_ptr, sin_ptr, rng_ptr,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh, cs_stride_b,
    N, M, GROUP, scale, cap_scale, softcap, left, right, dropout_p, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    ROPE: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """dk, dv of one key block x (kv head, batch), summed over the GROUP query heads of the kv
    head and their visible query blocks in a fixed order. Grid (key blocks, Hkv, B).

    ATOMIC_DQ (the fast mode): also adds each tile's dq (of the rotated q) into dq_ptr, an fp32
    [B, N, Hq, D] buffer the caller zeroed, with atomics; otherwise dq_ptr is not touched.
    """
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    num_kv_heads = tl.num_programs(1)
    num_heads = num_kv_heads * GROUP
    keys = start_n + tl.arange(0, BLOCK_N)
    key_mask = keys < M
    cs_base = b * cs_stride_b
    k1, k2 = _load_rotated(k_ptr, b * stride_kb + kv_head * stride_kh, keys, stride_kn,
                           key_mask, cos_ptr, sin_ptr, cs_base, keys, HEAD_DIM, BLOCK_H, ROPE,
                           INTERPRETED)
    v = _load_rows(v_ptr, b * stride_vb + kv_head * stride_vh, keys, stride_vn, key_mask,
                   HEAD_DIM, BLOCK_D)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dk1 = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    if ROPE:
        dk2 = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    else:
        dk2 = tl.zeros([1, 1], dtype=tl.float32)
    if DROPOUT:
        seed = tl.load(rng_ptr)
        rng_offset = tl.load(rng_ptr + 1)
    else:
        seed = 0
        rng_offset = 0
    lo, hi, int_start, int_end = _query_range(start_n, N, M, left, right, BLOCK_M, BLOCK_N)
    lo_d, hi_d = _offset_bounds(left, right)
    key_pos = tl.where(key_mask, keys, _OUT)
    for head_in_group in range(GROUP):
        h = kv_head * GROUP + head_in_group
        q_base = b * stride_qb + h * stride_qh
        do_base = b * stride_dob + h * stride_doh
        row_base = (b * num_heads + h) * N
        rng_base = rng_offset + row_base * M
        dq_base = (b * N * num_heads + h) * HEAD_DIM
        for start_m in range(lo, hi, BLOCK_M):
            dv, dk1, dk2 = _bwd_kv_tile(
                dv, dk1, dk2, k1, k2, v, keys, key_pos, start_m, q_ptr, do_ptr, q_base,
                do_base, stride_qn, stride_don, lse_ptr, delta_ptr, row_base, dq_ptr, dq_base,
                num_heads * HEAD_DIM, cos_ptr, sin_ptr, cs_base, N, M, lo_d, hi_d,
                scale, cap_scale, softcap, seed, rng_base, dropout_p, inv_keep,
                (start_m < int_start) | (start_m >= int_end), ATOMIC_DQ, HEAD_DIM, BLOCK_D,
                BLOCK_H, BLOCK_M, ROPE, SOFTCAP, DROPOUT, INTERPRETED)
    # dk, dv are contiguous [B, M, Hkv, D].
    out_base = (b * M * num_kv_heads + kv_head) * HEAD_DIM
    out_row_stride = num_kv_heads * HEAD_DIM
    _store_unrotated(dk_ptr, out_base, keys, out_row_stride, key_mask, dk1, dk2, cos_ptr,
                     sin_ptr, cs_base, keys, HEAD_DIM, BLOCK_H, ROPE, INTERPRETED)
    cols = tl.arange(0, BLOCK_D)
    dv_offsets = out_base + keys.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
    tl.store(dv_ptr + dv_offsets, _round(dv, dv_ptr.dtype.element_ty, INTERPRETED),
             mask=key_mask[:, None] & (cols < HEAD_DIM)[None, :])


@triton.jit
def _bwd_q_tile(
    dq1, dq2, q1, q2, do, lse, delta, positions, start_n,
    k_ptr, v_ptr, k_base, v_base, stride_kn, stride_vn, cos_ptr, sin_ptr, cs_base,
    M, lo_d, hi_d, scale, cap_scale, softcap, seed, rng_rows, dropout_p,
    inv_keep, MASKED, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One key tile's contribution to the dq (of the rotated q) of a query block."""
    keys = start_n + tl.arange(0, BLOCK_N)
    key_mask = keys < M
    k1, k2 = _load_rotated(k_ptr, k_base, keys, stride_kn, key_mask, cos_ptr, sin_ptr, cs_base,
                           keys, HEAD_DIM, BLOCK_H, ROPE, INTERPRETED)
    v = _load_rows(v_ptr, v_base, keys, stride_vn, key_mask, HEAD_DIM, BLOCK_D)
    p, th = _recomputed_probs(_scores(q1, q2, k1, k2, ROPE, INTERPRETED), lse[:, None], scale,
                              cap_scale, softcap, SOFTCAP)
    if MASKED:
        key_pos = tl.where(key_mask, keys, _OUT)
        p = tl.where(_visible(positions[:, None], key_pos[None, :], lo_d, hi_d), p, 0.0)
    dp = _dot(do, tl.trans(v), tl.zeros([do.shape[0], BLOCK_N], dtype=tl.float32), INTERPRETED)
    if DROPOUT:
        keep = _dropout_keep(seed, rng_rows[:, None] + keys[None, :], dropout_p)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = _round(_times_logit_grad(p * (dp - delta[:, None]), th, scale, SOFTCAP), do.dtype,
                INTERPRETED)
    dq1 = _dot(ds, k1, dq1, INTERPRETED)
    if ROPE:
        dq2 = _dot(ds, k2, dq2, INTERPRETED)
    return dq1, dq2


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cos_ptr, sin_ptr, rng_ptr,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh, cs_stride_b,
    N, M, GROUP, scale, cap_scale, softcap, left, right, dropout_p, inv_keep,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    ROPE: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """dq of one query block x (query head, batch), over its visible key tiles in order (the
    deterministic mode). Grid (query blocks, Hq, B), query blocks last-first."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    num_heads = tl.num_programs(1)
    kv_head = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    positions = rows + (M - N)
    cs_base = b * cs_stride_b
    q1, q2 = _load_rotated(q_ptr, b * stride_qb + h * stride_qh, rows, stride_qn, row_mask,
                           cos_ptr, sin_ptr, cs_base, positions, HEAD_DIM, BLOCK_H, ROPE,
                           INTERPRETED)
    do = _load_rows(do_ptr, b * stride_dob + h * stride_doh, rows, stride_don, row_mask,
                    HEAD_DIM, BLOCK_D)
    row_ids = (b * num_heads + h) * N + rows
    lse = tl.load(lse_ptr + row_ids, mask=row_mask, other=0.0)
    delta = tl.load(delta_ptr + row_ids, mask=row_mask, other=0.0)
    k_base = b * stride_kb + kv_head * stride_kh
    v_base = b * stride_vb + kv_head * stride_vh
    if DROPOUT:
        seed = tl.load(rng_ptr)
        rng_rows = tl.load(rng_ptr + 1) + row_ids * M
    else:
        seed = 0
        rng_rows = row_ids
    dq1 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    if ROPE:
        dq2 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    else:
        dq2 = tl.zeros([1, 1], dtype=tl.float32)
    lo, hi, int_start, int_end = _key_range(start_m, N, M, left, right, BLOCK_M, BLOCK_N)
    lo_d, hi_d = _offset_bounds(left, right)
    for start_n in range(lo, hi, BLOCK_N):
        dq1, dq2 = _bwd_q_tile(
            dq1, dq2, q1, q2, do, lse, delta, positions, start_n,
            k_ptr, v_ptr, k_base, v_base, stride_kn, stride_vn, cos_ptr, sin_ptr, cs_base,
            M, lo_d, hi_d, scale, cap_scale, softcap, seed, rng_rows, dropout_p, inv_keep,
            (start_n < int_start) | (start_n >= int_end), HEAD_DIM, BLOCK_D, BLOCK_H, BLOCK_N,
            ROPE, SOFTCAP, DROPOUT, INTERPRETED)
    # dq is contiguous [B, N, Hq, D].
    _store_unrotated(dq_ptr, (b * N * num_heads + h) * HEAD_DIM, rows, num_heads * HEAD_DIM,
                     row_mask, dq1, dq2, cos_ptr, sin_ptr, cs_base, positions, HEAD_DIM,
                     BLOCK_H, ROPE, INTERPRETED)


@triton.jit
def _attn_bwd_dq_postprocess_kernel(
    dq_acc_ptr, dq_ptr, cos_ptr, sin_ptr, cs_stride_b, N, M,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """dq = rope_rotate_grad(dq_acc) rounded to dq's dtype, for one row block x (head, batch);
    both [B, N, Hq, D] contiguous, dq_acc fp32 (the fast mode's atomic buffer)."""
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    num_heads = tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    base = (b * N * num_heads + h) * HEAD_DIM
    row_stride = num_heads * HEAD_DIM
    cols = tl.arange(0, BLOCK_H)
    offsets = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    if ROPE:
        half: tl.constexpr = HEAD_DIM // 2
        mask = row_mask[:, None] & (cols < half)[None, :]
        g1 = tl.load(dq_acc_ptr + offsets, mask=mask, other=0.0)
        g2 = tl.load(dq_acc_ptr + offsets + half, mask=mask, other=0.0)
    else:
        g1 = tl.load(dq_acc_ptr + offsets,
                     mask=row_mask[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)
        g2 = g1
    _store_unrotated(dq_ptr, base, rows, row_stride, row_mask, g1, g2, cos_ptr, sin_ptr,
                     b * cs_stride_b, rows + (M - N), HEAD_DIM, BLOCK_H, ROPE, INTERPRETED)


# True when TRITON_INTERPRET=1 was set before this module was imported: the kernels are then
# interpreter objects, not JITFunctions.
_INTERPRETED = not isinstance(_attn_fwd_kernel, triton.runtime.JITFunction)
_AUTOTUNE = os.environ.get("REMAT_ATTENTION_AUTOTUNE", "1") != "0"

# Rows per program of the preprocess and postprocess passes: elementwise work over [rows, D],
# 64 x 256 fp32 products at most, 32 per thread over 4 warps.
_ROWS_PER_PROGRAM = 64
_ELEMENTWISE_WARPS = 4
# Under the interpreter programs run one after another in numpy: one small tile keeps the CPU
# tests fast and still crosses tile edges at lengths 17 and 33.
_INTERPRETER_BLOCK = 16


def _config(block_m, block_n, num_warps, num_stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n},
                         num_warps=num_warps, num_stages=num_stages)


def _configs(*entries):
    return [_config(*entry) for entry in entries]


# (kernel, padded head dim class, dtype class, heavy) -> configurations (BLOCK_M = query tile,
# BLOCK_N = key tile, warps, stages); the first is the default, used without autotuning and by
# aot_specs. Head-dim classes: 64 (D 16-64), 128, 256. "heavy": RoPE (two more [tile, D/2]
# operands and the fp32 cos/sin tiles) or dropout (Philox per score element) is on.
# Measured with ptxas (cuobjdump --dump-resource-usage) on sm_80 and sm_90a builds compiled with
# the 16-byte divisibility an aligned launch gets (pointers, strides) and each config's
# num_stages, bf16, heavy measured with RoPE + softcap and with RoPE + softcap + dropout. The
# 16-bit defaults use 115-255 registers per thread, 28-168 KiB of shared memory (within sm_80's
# 163 KiB where it matters: every default fits both archs) and do not spill, except on sm_80:
# the atomic dK/dV kernel at D 256 (32 bytes per thread); heavy, the dK/dV kernels at D 64
# (64-160 bytes) and D 256 (24-120), the dQ kernel at D 64 with dropout (72); every candidate
# tried there spilled at least as much. The other entries are autotuning candidates, some fit
# only sm_90 (the autotuner drops a config that fails to launch). What costs registers: the
# dK/dV kernel keeps k, v and the fp32 dk, dv accumulators of its key block for the whole loop,
# so its tiles stay at 16-32 rows for D >= 128; the forward and dQ kernels keep a [BLOCK_M, D]
# fp32 accumulator. Measured and dropped: e.g. the dK/dV kernel at D 64 with a 64 x 64 tile, or
# at D 128 with 32 x 128, made ptxas fall back to 32 registers and 3-8 KiB of spills on sm_80.
# fp32 (IEEE products on the FMA units, operands held in registers): small tiles; the defaults
# do not spill except dK/dV at D 128 on sm_90 (16 bytes), but with RoPE or dropout they spill
# 16-550 bytes, and halving the tiles did not help (fp32 is the accuracy path, not a fast one).
_CONFIGS = {
    ("fwd", 64, "16bit", False): _configs((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3),
                                          (64, 64, 4, 3)),
    ("fwd", 64, "16bit", True): _configs((128, 64, 8, 3), (64, 64, 4, 3)),
    ("fwd", 128, "16bit", False): _configs((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                                           (64, 32, 4, 3)),
    ("fwd", 128, "16bit", True): _configs((64, 32, 4, 3), (128, 64, 8, 3)),
    ("fwd", 256, "16bit", False): _configs((64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2),
                                           (32, 32, 4, 2)),
    ("fwd", 256, "16bit", True): _configs((32, 64, 8, 2), (64, 32, 8, 2)),
    ("dq", 64, "16bit", False): _configs((128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3),
                                         (64, 64, 4, 3)),
    ("dq", 64, "16bit", True): _configs((64, 32, 8, 3), (32, 32, 4, 3), (64, 32, 4, 3)),
    ("dq", 128, "16bit", False): _configs((64, 64, 8, 2), (64, 32, 4, 3), (32, 32, 4, 3)),
    ("dq", 128, "16bit", True): _configs((32, 32, 4, 3), (64, 32, 4, 3)),
    ("dq", 256, "16bit", False): _configs((32, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2)),
    ("dq", 256, "16bit", True): _configs((32, 32, 8, 2), (16, 32, 8, 2)),
    ("dkdv", 64, "16bit", False): _configs((32, 128, 8, 3), (16, 64, 4, 3), (32, 64, 8, 3)),
    ("dkdv", 64, "16bit", True): _configs((16, 64, 8, 3), (16, 64, 4, 3), (16, 32, 4, 3)),
    ("dkdv", 128, "16bit", False): _configs((32, 64, 8, 2), (16, 64, 4, 2), (16, 32, 4, 2)),
    ("dkdv", 128, "16bit", True): _configs((32, 32, 8, 2), (16, 32, 8, 2), (16, 32, 4, 2)),
    ("dkdv", 256, "16bit", False): _configs((32, 32, 8, 2), (16, 32, 4, 2), (16, 64, 8, 2)),
    ("dkdv", 256, "16bit", True): _configs((16, 32, 8, 2), (32, 16, 8, 2)),
    ("dkdv_atomic", 64, "16bit", False): _configs((16, 64, 4, 3), (32, 64, 8, 3),
                                                  (32, 128, 8, 3)),
    ("dkdv_atomic", 64, "16bit", True): _configs((16, 64, 8, 3), (16, 32, 4, 3)),
    ("dkdv_atomic", 128, "16bit", False): _configs((32, 64, 8, 2), (16, 32, 4, 2)),
    ("dkdv_atomic", 128, "16bit", True): _configs((32, 32, 8, 2), (16, 32, 8, 2)),
    ("dkdv_atomic", 256, "16bit", False): _configs((32, 32, 8, 2), (16, 64, 8, 2),
                                                   (16, 32, 4, 2)),
    ("dkdv_atomic", 256, "16bit", True): _configs((16, 32, 8, 2), (32, 16, 8, 2)),
    ("fwd", 64, "fp32", False): _configs((32, 32, 4, 2), (64, 32, 4, 2)),
    ("fwd", 128, "fp32", False): _configs((64, 32, 8, 2), (32, 32, 4, 2)),
    ("fwd", 256, "fp32", False): _configs((16, 32, 4, 1), (32, 32, 8, 1)),
    ("dq", 64, "fp32", False): _configs((32, 32, 4, 2), (64, 32, 8, 2)),
    ("dq", 128, "fp32", False): _configs((32, 32, 8, 2), (32, 16, 4, 2)),
    ("dq", 256, "fp32", False): _configs((32, 16, 8, 1), (16, 16, 4, 1)),
    ("dkdv", 64, "fp32", False): _configs((32, 32, 4, 2), (32, 64, 8, 2)),
    ("dkdv", 128, "fp32", False): _configs((32, 32, 8, 2), (16, 32, 4, 2)),
    ("dkdv", 256, "fp32", False): _configs((16, 32, 8, 1), (16, 16, 4, 1)),
}
# fp32 takes the same tiles with the heavy features (fp32 attention is the accuracy path, not
# a tuned one), and the atomic dK/dV kernel the deterministic one's.
for (_name, _size, _kind, _heavy), _entries in list(_CONFIGS.items()):
    if _kind == "fp32":
        _CONFIGS[(_name, _size, _kind, True)] = _entries
        if _name == "dkdv":
            _CONFIGS[("dkdv_atomic", _size, _kind, False)] = _entries
            _CONFIGS[("dkdv_atomic", _size, _kind, True)] = _entries


def _configs_for(kernel_name, constexprs, dtype):
    """The configuration list of a launch: by kernel (the fast mode's dK/dV kernel has its
    own), padded head dim, dtype and whether RoPE or dropout is on."""
    if kernel_name == "dkdv" and constexprs.get("ATOMIC_DQ"):
        kernel_name = "dkdv_atomic"
    size = max(constexprs["BLOCK_D"], 64)
    kind = "fp32" if dtype == torch.float32 else "16bit"
    heavy = bool(constexprs["ROPE"] or constexprs["DROPOUT"])
    return _CONFIGS[(kernel_name, size, kind, heavy)]


def _autotuned(kernel, kernel_name, **options):
    """kernel under triton.autotune over the candidates of its kernel name, pruned per launch
    to `_configs_for`'s list. Keyed on the head dim (padded and exact) and the feature flags;
    the autotuner adds the tensors' dtypes to the key itself."""
    names = (kernel_name, "dkdv_atomic") if kernel_name == "dkdv" else (kernel_name,)
    candidates = [config for key, entries in _CONFIGS.items() if key[0] in names
                  for config in entries]

    def prune(configs, named_args, **kwargs):
        del configs
        return _configs_for(kernel_name, kwargs, named_args["q_ptr"].dtype)

    return triton.autotune(
        configs=candidates,
        key=["HEAD_DIM", "BLOCK_D", "ROPE", "SOFTCAP", "DROPOUT"]
            + (["ATOMIC_DQ"] if kernel_name == "dkdv" else []),
        prune_configs_by={"early_config_prune": prune},
        **options,
    )(kernel)


if not _INTERPRETED:
    _FWD_TUNED = _autotuned(_attn_fwd_kernel, "fwd")
    _DKDV_TUNED = _autotuned(_attn_bwd_dkdv_kernel, "dkdv")
    # The fast mode's dq buffer accumulates with atomics: zero it before every benchmarked run
    # (the autotuner zeroes it again before the real launch).
    _DKDV_ATOMIC_TUNED = _autotuned(_attn_bwd_dkdv_kernel, "dkdv", reset_to_zero=["dq_ptr"])
    _DQ_TUNED = _autotuned(_attn_bwd_dq_kernel, "dq")


def _launch(kernel, tuned, kernel_name, grid_of, args, constexprs, dtype):
    """Launch with the autotuner when compiled (and enabled), else with one fixed config:
    the interpreter's 16 x 16 tile, or the launch's default config."""
    if _INTERPRETED:
        block_m = block_n = _INTERPRETER_BLOCK
        kernel[grid_of(block_m, block_n)](
            *args, **constexprs, BLOCK_M=block_m, BLOCK_N=block_n, INTERPRETED=True)
    elif _AUTOTUNE:
        tuned[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](
            *args, **constexprs, INTERPRETED=False)
    else:
        config = _configs_for(kernel_name, constexprs, dtype)[0]
        kernel[grid_of(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"])](
            *args, **constexprs, **config.kwargs, INTERPRETED=False,
            num_warps=config.num_warps, num_stages=config.num_stages)


def _describe(tensor):
    return f"shape {tuple(tensor.shape)}, {tensor.dtype} on {tensor.device}"


def _check_operand(name, tensor, dtype, device):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    if tensor.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D tensor [B, L, H, D], got {_describe(tensor)}")
    if dtype is None:
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {tensor.dtype}")
    elif tensor.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype} like q, got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} like q, got {_describe(tensor)}")
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        raise ValueError(f"{name}: expected a unit stride in the last dimension, got strides "
                         f"{tuple(tensor.stride())}")


def _prepare(q, k, v, cos, sin, rng, scale, softcap, dropout_p):
    """Checks the shared arguments; returns the kernels' common arguments and constexprs."""
    _check_operand("q", q, None, None)
    _check_operand("k", k, q.dtype, q.device)
    _check_operand("v", v, q.dtype, q.device)
    batch, n, num_heads, head_dim = q.shape
    m, num_kv_heads = k.shape[1], k.shape[2]
    if not 16 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"q: head dim {head_dim} unsupported, expected 16 to {_MAX_HEAD_DIM}")
    if k.shape[0] != batch or k.shape[3] != head_dim or num_kv_heads < 1:
        raise ValueError(f"k: expected [{batch}, M, Hkv, {head_dim}], got {_describe(k)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {_describe(v)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"k: {num_kv_heads} kv heads do not divide the {num_heads} query heads")
    if min(batch, n, m) < 1 or max(n, m) >= _MAX_LENGTH:
        raise ValueError(f"q, k: expected B >= 1 and 1 <= N, M < 2^28, got {_describe(q)} "
                         f"and {_describe(k)}")
    if max(batch, num_heads) > _MAX_GRID_YZ:
        # The grids put heads on axis 1 and the batch on axis 2 (at most 65535 each).
        raise ValueError(f"q: expected at most {_MAX_GRID_YZ} batch entries and heads, got "
                         f"{_describe(q)}")
    rope = cos is not None
    if (cos is None) != (sin is None):
        raise ValueError("cos, sin: give both or neither")
    cs_stride_b = 0
    if rope:
        if head_dim % 2:
            raise ValueError(f"q: RoPE needs an even head dim, got {head_dim}")
        if n > m:
            raise ValueError(f"q: RoPE needs N <= M (query i sits at key position i + M - N), "
                             f"got N = {n}, M = {m}")
        for name, table in (("cos", cos), ("sin", sin)):
            if not isinstance(table, torch.Tensor) or table.dtype != torch.float32:
                raise TypeError(f"{name}: expected a float32 tensor")
            if (table.dim() != 3 or table.shape[0] not in (1, batch) or table.shape[1] < m
                    or table.shape[2] != head_dim // 2 or not table.is_contiguous()
                    or table.device != q.device):
                raise ValueError(
                    f"{name}: expected a contiguous [1 or {batch}, S >= {m}, {head_dim // 2}] "
                    f"tensor on {q.device}, got {_describe(table)}")
        if tuple(sin.shape) != tuple(cos.shape):
            raise ValueError(f"sin: expected the shape of cos {tuple(cos.shape)}, got "
                             f"{_describe(sin)}")
        if cos.shape[0] > 1:
            cs_stride_b = cos.stride(0)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    dropout = dropout_p > 0.0
    if dropout and (not isinstance(rng, torch.Tensor) or rng.dtype != torch.int64
                    or rng.numel() != 2 or rng.device != q.device):
        raise ValueError(f"rng: dropout needs an int64 tensor [2] (seed, offset) on {q.device}")
    if not scale > 0.0:
        raise ValueError(f"scale: expected a positive float, got {scale}")
    if softcap < 0.0:
        raise ValueError(f"softcap: expected 0 (off) or a positive float, got {softcap}")
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(head_dim // 2)) if rope else block_d
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, ROPE=rope,
                      SOFTCAP=softcap > 0.0, DROPOUT=dropout)
    scalars = dict(
        cap_scale=scale / softcap if softcap > 0.0 else 0.0,
        dropout_p=float(dropout_p),
        inv_keep=1.0 / (1.0 - dropout_p),
    )
    # Placeholders for absent tensors: the constexpr flags keep the kernels from reading them.
    tables = (cos if rope else q, sin if rope else q, rng.reshape(2) if dropout else q)
    return (batch, n, m, num_heads, num_kv_heads), cs_stride_b, tables, scalars, constexprs


def _window(extent):
    """A window side for the kernels: -1 when unbounded, else clamped to _FAR = 2^28, which
    already reaches every key for N, M < 2^28."""
    extent = int(extent)
    return -1 if extent < 0 else min(extent, _FAR.value)


def _strides(tensor):
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def attention_fwd(q, k, v, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p):
    """Flash-attention forward. Returns (o, lse).

    q [B, N, Hq, D]; k, v [B, M, Hkv, D], one of fp32/fp16/bf16, unit stride in the last
    dimension, any other strides; Hq % Hkv == 0; D in 16..256. cos, sin: None or fp32
    contiguous [1 or B, S >= M, D/2] (RoPE, D even, N <= M; key j uses row j, query i row
    i + M - N). rng: None or an int64 tensor [2] (seed, offset) on q's device, read there (no
    host sync); required when dropout_p > 0. scale > 0; softcap: 0 (off) or > 0;
    window_left/right: ints, -1 = unbounded (causal: right = 0). dropout_p in [0, 1).
    o: new contiguous [B, N, Hq, D] in q's dtype (0 in rows that see no key); lse: new
    contiguous fp32 [B, Hq, N], natural-log logsumexp of the undropped logits (+inf in rows
    that see no key). The module docstring gives the rounding points and the dropout counter.
    """
    sizes, cs_stride_b, tables, scalars, constexprs = _prepare(
        q, k, v, cos, sin, rng, scale, softcap, dropout_p)
    batch, n, m, num_heads, num_kv_heads = sizes
    o = torch.empty((batch, n, num_heads, q.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_heads, n), dtype=torch.float32, device=q.device)
    args = (q, k, v, o, lse, *tables, *_strides(q), *_strides(k), *_strides(v), cs_stride_b,
            n, m, num_heads // num_kv_heads, float(scale), scalars["cap_scale"], float(softcap),
            _window(window_left), _window(window_right), scalars["dropout_p"], scalars["inv_keep"])
    _launch(_attn_fwd_kernel, None if _INTERPRETED else _FWD_TUNED, "fwd",
            lambda block_m, block_n: (triton.cdiv(n, block_m), num_heads, batch),
            args, constexprs, q.dtype)
    return o, lse


def attention_bwd(dout, q, k, v, o, lse, cos, sin, rng, scale, softcap, window_left,
                  window_right, dropout_p, deterministic):
    """Flash-attention backward, recomputing P (and the dropout mask and RoPE) from q, k, lse.
    Returns (dq, dk, dv).

    q, k, v, cos, sin, rng, scale, softcap, window_left/right, dropout_p: as given to
    attention_fwd; o, lse: its outputs (o may be any strided [B, N, Hq, D] view with a unit
    last stride); dout: like q, any such strides. dq [B, N, Hq, D], dk, dv [B, M, Hkv, D]: new
    contiguous, q's dtype, accumulated in fp32 and rounded once (dk, dv summed over each kv
    head's query heads inside the kernel). deterministic=True: no atomics (a dK/dV and a dQ
    kernel), so a rerun gives the same bits; False: the dK/dV kernel also accumulates dq with
    fp32 atomics (summation order varies between runs), then a pass rotates and casts it.
    """
    sizes, cs_stride_b, tables, scalars, constexprs = _prepare(
        q, k, v, cos, sin, rng, scale, softcap, dropout_p)
    batch, n, m, num_heads, num_kv_heads = sizes
    _check_operand("dout", dout, q.dtype, q.device)
    _check_operand("o", o, q.dtype, q.device)
    for name, tensor in (("dout", dout), ("o", o)):
        if tuple(tensor.shape) != tuple(q.shape):
            raise ValueError(f"{name}: expected the shape of q {tuple(q.shape)}, got "
                             f"{_describe(tensor)}")
    if (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32
            or tuple(lse.shape) != (batch, num_heads, n) or lse.device != q.device):
        raise ValueError(f"lse: expected float32 [{batch}, {num_heads}, {n}] on {q.device}")
    lse = lse.contiguous()
    head_dim = q.shape[3]
    device = q.device
    dq = torch.empty((batch, n, num_heads, head_dim), dtype=q.dtype, device=device)
    dk = torch.empty((batch, m, num_kv_heads, head_dim), dtype=q.dtype, device=device)
    dv = torch.empty((batch, m, num_kv_heads, head_dim), dtype=q.dtype, device=device)
    delta = torch.empty((batch, num_heads, n), dtype=torch.float32, device=device)
    rows = _INTERPRETER_BLOCK if _INTERPRETED else _ROWS_PER_PROGRAM
    elementwise_grid = (triton.cdiv(n, rows), num_heads, batch)
    _attn_bwd_preprocess_kernel[elementwise_grid](
        o, dout, delta, *_strides(o), *_strides(dout), n,
        HEAD_DIM=head_dim, BLOCK_D=constexprs["BLOCK_D"], BLOCK_M=rows,
        num_warps=_ELEMENTWISE_WARPS)
    group = num_heads // num_kv_heads
    common = (*tables, *_strides(q), *_strides(k), *_strides(v), *_strides(dout), cs_stride_b,
              n, m, group, float(scale), scalars["cap_scale"], float(softcap),
              _window(window_left), _window(window_right),
              scalars["dropout_p"], scalars["inv_keep"])
    kv_grid = lambda block_m, block_n: (triton.cdiv(m, block_n), num_kv_heads, batch)  # noqa: E731
    if deterministic:
        _launch(_attn_bwd_dkdv_kernel, None if _INTERPRETED else _DKDV_TUNED, "dkdv", kv_grid,
                (q, k, v, dout, lse, delta, dk, dv, dk, *common),
                dict(constexprs, ATOMIC_DQ=False), q.dtype)
        _launch(_attn_bwd_dq_kernel, None if _INTERPRETED else _DQ_TUNED, "dq",
                lambda block_m, block_n: (triton.cdiv(n, block_m), num_heads, batch),
                (q, k, v, dout, lse, delta, dq, *common), constexprs, q.dtype)
    else:
        dq_acc = torch.zeros((batch, n, num_heads, head_dim), dtype=torch.float32, device=device)
        _launch(_attn_bwd_dkdv_kernel, None if _INTERPRETED else _DKDV_ATOMIC_TUNED, "dkdv",
                kv_grid, (q, k, v, dout, lse, delta, dk, dv, dq_acc, *common),
                dict(constexprs, ATOMIC_DQ=True), q.dtype)
        _attn_bwd_dq_postprocess_kernel[elementwise_grid](
            dq_acc, dq, tables[0], tables[1], cs_stride_b, n, m,
            HEAD_DIM=head_dim, BLOCK_H=constexprs["BLOCK_H"], ROPE=constexprs["ROPE"],
            BLOCK_M=rows, INTERPRETED=_INTERPRETED, num_warps=_ELEMENTWISE_WARPS)
    return dq, dk, dv


def aot_specs():
    """Yield (name, kernel, signature, constexprs, num_warps) for ahead-of-time compile checks.

    `signature` and `constexprs` are in the form `triton.compiler.ASTSource` takes; names are
    'attn_<kernel>-<dtype>-d<D>[-rope-softcap-dropout]'. bf16 and fp16 at head dims 64 and
    128: the forward, the backward preprocess, the deterministic dK/dV and dQ kernels, the fast
    (atomic dQ) dK/dV kernel and its postprocess, without RoPE, softcap or dropout (the window,
    causal or not, is a runtime argument). fp32 at head dim 64: the forward, dK/dV and dQ
    kernels (FMA dots). bf16 at head dim 80 (padded to 128) with RoPE, softcap and dropout:
    the forward, the dQ kernel, the atomic dK/dV kernel and the postprocess. Each main kernel
    takes its default configuration (`_configs_for`); the compile check passes num_warps only,
    so num_stages is Triton's default 3. Sizes are 32-bit and strides 64-bit (a launch gets i64
    for a stride past 2^31 - 1). About 35 s of compiling for both archs on 2 CPU cores.
    """
    main_kinds = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "bwd_dkdv_atomic",
                  "bwd_dq_postprocess")
    cases = [(kind, type_name, head_dim, False) for type_name in ("bf16", "fp16")
             for head_dim in (64, 128) for kind in main_kinds]
    cases += [(kind, "fp32", 64, False) for kind in ("fwd", "bwd_dkdv", "bwd_dq")]
    cases += [(kind, "bf16", 80, True) for kind in
              ("fwd", "bwd_dq", "bwd_dkdv_atomic", "bwd_dq_postprocess")]
    torch_types = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    scalars = {"scale": "fp32", "cap_scale": "fp32", "softcap": "fp32", "left": "i32",
               "right": "i32", "dropout_p": "fp32", "inv_keep": "fp32"}
    strides = dict.fromkeys(
        ("stride_qb", "stride_qn", "stride_qh", "stride_kb", "stride_kn", "stride_kh",
         "stride_vb", "stride_vn", "stride_vh"), "i64")
    do_strides = dict.fromkeys(("stride_dob", "stride_don", "stride_doh"), "i64")
    tables = {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    for kind, type_name, head_dim, features in cases:
        element = f"*{type_name}"
        block_d = max(16, triton.next_power_of_2(head_dim))
        block_h = max(16, triton.next_power_of_2(head_dim // 2)) if features else block_d
        flags = dict(ROPE=features, SOFTCAP=features, DROPOUT=features)
        constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, **flags)
        config_name = None
        if kind == "fwd":
            kernel, config_name = _attn_fwd_kernel, "fwd"
            signature = {"q_ptr": element, "k_ptr": element, "v_ptr": element, "o_ptr": element,
                         "lse_ptr": "*fp32", **tables, "rng_ptr": "*i64", **strides,
                         "cs_stride_b": "i64", "N": "i32", "M": "i32", "GROUP": "i32",
                         **scalars}
        elif kind == "bwd_preprocess":
            kernel = _attn_bwd_preprocess_kernel
            signature = {"o_ptr": element, "do_ptr": element, "delta_ptr": "*fp32",
                         "stride_ob": "i64", "stride_on": "i64", "stride_oh": "i64",
                         **do_strides, "N": "i32"}
            constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=_ROWS_PER_PROGRAM)
        elif kind == "bwd_dq_postprocess":
            kernel = _attn_bwd_dq_postprocess_kernel
            signature = {"dq_acc_ptr": "*fp32", "dq_ptr": element, **tables,
                         "cs_stride_b": "i64", "N": "i32", "M": "i32"}
            constexprs = dict(HEAD_DIM=head_dim, BLOCK_H=block_h, ROPE=features,
                              BLOCK_M=_ROWS_PER_PROGRAM, INTERPRETED=False)
        else:
            common = {**tables, "rng_ptr": "*i64", **strides, **do_strides,
                      "cs_stride_b": "i64", "N": "i32", "M": "i32", "GROUP": "i32", **scalars}
            inputs = {"q_ptr": element, "k_ptr": element, "v_ptr": element, "do_ptr": element,
                      "lse_ptr": "*fp32", "delta_ptr": "*fp32"}
            if kind == "bwd_dq":
                kernel, config_name = _attn_bwd_dq_kernel, "dq"
                signature = {**inputs, "dq_ptr": element, **common}
            else:
                kernel, config_name = _attn_bwd_dkdv_kernel, "dkdv"
                atomic = kind == "bwd_dkdv_atomic"
                signature = {**inputs, "dk_ptr": element, "dv_ptr": element,
                             "dq_ptr": "*fp32" if atomic else element, **common}
                constexprs["ATOMIC_DQ"] = atomic
        if config_name is not None:
            config = _configs_for(config_name, constexprs, torch_types[type_name])[0]
            constexprs.update(config.kwargs, INTERPRETED=False)
            num_warps = config.num_warps
        else:
            num_warps = _ELEMENTWISE_WARPS
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        suffix = "-rope-softcap-dropout" if features else ""
        yield (f"attn_{kind}-{type_name}-d{head_dim}{suffix}", kernel, signature, constexprs,
               num_warps)
