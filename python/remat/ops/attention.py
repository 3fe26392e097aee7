"""The attention operators of every backend, behind one signature.

Every backend implements the same two functions (the recompute contract of DESIGN.md section 2):

- ``attention_fwd(q, k, v, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p)
  -> (o, lse)``
- ``attention_bwd(dout, q, k, v, o, lse, cos, sin, rng, scale, softcap, window_left, window_right,
  dropout_p, deterministic) -> (dq, dk, dv)``
- ``attention_varlen_fwd`` / ``attention_varlen_bwd``: packed (variable-length) sequences, every
  backend but cudnn (remat.ops.attention_cudnn) and aten on the CPU (the contract is stated above
  torch_attention_varlen_fwd below).

One exception: the Triton backward ops take no rope tables (cos = sin = None, else ValueError,
also when traced): a call with rope and a backward rotates q and k once per pass outside the
Triton kernels (:func:`rotated_once`, chosen by :func:`rope_rotated_once`).

Shapes: q, o, dout ``[B, N, Hq, D]``; k, v ``[B, M, Hkv, D]`` with Hq a multiple of Hkv (query head
h reads kv head h // (Hq // Hkv)); any strides with unit stride in the last dim. o, dq, dk, dv are
new contiguous tensors in q's dtype; lse is fp32 ``[B, Hq, N]``.

Math, shared by every backend (csrc/common/attention_math.h and philox.h hold the C++ versions):

- Query i sits at position i + M - N (bottom-right alignment, as FlashAttention >= 2.1). It sees
  key j when ``window_left < 0 or j >= i + M - N - window_left`` and ``window_right < 0 or
  j <= i + M - N + window_right``; causal is window_right = 0.
- cos, sin: None or fp32 contiguous ``[1 or B, S >= M, D/2]``; q at position p and k at position
  j are rotated (rotate-half convention) in fp32 and rounded to the dtype: the operands of QK^T.
- logit = softcap * tanh(scale * q.k / softcap) with softcap > 0, else scale * q.k; softmax in
  fp32; lse = logsumexp over the visible keys, +inf (and o = 0) for a row that sees none.
- Non-finite values propagate as in stock's softmax (exp(t - max) / sum): a NaN or +inf logit
  makes its whole row NaN (o, and lse, so that the backward's probabilities are NaN too), a -inf
  logit weighs 0. A key a query does not see never enters its logits, though a NaN or infinite
  operand can still reach it through a product by an exact 0 (a masked probability times v, dS
  times k or q, P times dout) where a kernel's tile holds both, as in PyTorch's kernels; a row
  that sees no key keeps o = 0.
- Dropout: rng is an int64 ``[2]`` = (seed, offset) tensor when dropout_p > 0. Probability
  (b, h, i, j) is kept when the uniform of its word of remat's Philox4x32-10 stream (row (b*Hq + h)*N + i
  of rows of length M, four keys per Philox call: remat.reference.philox_stream_words) is >= dropout_p,
  and then scaled by 1 / (1 - dropout_p); lse is of the undropped softmax. The aten core on CUDA
  is the exception: there rng is an int64 ``[2]`` buffer its forward fills with the seed and offset
  FlashAttention-2 drew for its own mask (see the comment above _FLASH_MAJORS), which its backward
  reads back.
- The probabilities (after dropout) are rounded to the dtype before the PV product, dS before the
  dq/dk products; everything accumulates in fp32. The backward recomputes the probabilities from
  q, k and lse and the mask from rng: nothing of size N x M is ever stored.
- ``deterministic`` selects the GPU backward without atomics; the CPU and torch backwards are
  always deterministic.
"""

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from remat import _extension
from remat.backend import device_capability
from remat.ops.device import on_tensor_device
from remat.ops.rope import rope_rotate, torch_rope_rotate
from remat.options import AttentionOptions
from remat.reference import attention_dropout_keep, philox_stream_words, philox_uniform

# Query rows per step of the torch backend: bounds its [B, Hq, rows, M] fp32 temporaries.
_TORCH_ROWS_PER_STEP = 256


class AttentionOps(NamedTuple):
    attention_fwd: object
    attention_bwd: object
    attention_varlen_fwd: object = None
    attention_varlen_bwd: object = None


def _round(x, dtype):
    return x.to(dtype).float()


def _rotate(x, cos, sin, first_position):
    """x [B, L, H, D] -> [B, H, L, D] fp32, rotated at positions first_position .. and rounded to
    x's dtype when cos/sin are given (remat.ops.rope's PyTorch rotation)."""
    if cos is None:
        return x.transpose(1, 2).float()
    cos, sin, batch_stride = dense_rope_tables(cos, sin)
    return torch_rope_rotate(x, cos, sin, None, first_position, batch_stride, False).transpose(1, 2).float()


def _unrotate(grad, cos, sin, first_position):
    """The transpose of _rotate for a gradient [B, H, L, D] fp32."""
    if cos is None:
        return grad
    cos, sin, batch_stride = dense_rope_tables(cos, sin)
    return torch_rope_rotate(grad.transpose(1, 2), cos, sin, None, first_position, batch_stride, True).transpose(1, 2)


def _visible(i0, i1, n, m, window_left, window_right, device):
    """Bool [i1 - i0, M]: which keys query rows i0 .. i1 - 1 see."""
    position = torch.arange(i0, i1, device=device)[:, None] + (m - n)
    key = torch.arange(m, device=device)[None, :]
    visible = torch.ones(i1 - i0, m, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= key >= position - window_left
    if window_right >= 0:
        visible &= key <= position + window_right
    return visible


def _logits(q_rows, k_heads, scale, softcap):
    dots = torch.matmul(q_rows, k_heads.transpose(-1, -2))
    if softcap > 0:
        return softcap * torch.tanh(dots * scale / softcap)
    return dots * scale


def _row_lse(logits):
    """The rows' logsumexp over the last dim as the kernels keep it (csrc/common/attention_math.h
    OnlineSoftmax): +inf for a row that sees no key (torch.logsumexp gives -inf), NaN for a row with
    a NaN or +inf logit. torch.logsumexp gives +inf for the latter, and exp(t - inf) would then be 0
    at the row's finite logits, where stock's softmax (exp(t - max) / sum) is NaN for the whole row;
    finite logits cannot make it +inf."""
    lse = torch.logsumexp(logits, dim=-1)
    lse = torch.where(torch.isposinf(lse), torch.full_like(lse, float("nan")), lse)
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def _row_outputs(probs, v_heads, row_lse, dtype):
    """probs @ v with the probabilities rounded to ``dtype``, exactly 0 in rows that see no key
    (lse = +inf): the product alone is NaN there when a v row the row does not see is NaN or infinite
    (0 * NaN)."""
    return torch.where(torch.isposinf(row_lse)[..., None], 0.0, torch.matmul(_round(probs, dtype), v_heads))


def _keep_factor(rng, shape, rows, dropout_p, device):
    """1/(1-p) where the mask keeps, 0 where it drops ([B, Hq, rows, M] fp32), or None."""
    if dropout_p == 0:
        return None
    keep = attention_dropout_keep(rng[0], rng[1], shape, dropout_p, device, rows=rows)
    return keep.float() / (1.0 - dropout_p)


def torch_attention_fwd(q, k, v, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p):
    """Plain-PyTorch flash-attention contract: the probabilities exist only for one block of query
    rows at a time and are not kept."""
    batch, n, hq, _ = q.shape
    m, group = k.shape[1], hq // k.shape[2]
    q_heads = _rotate(q, cos, sin, m - n)
    k_heads = _rotate(k, cos, sin, 0).repeat_interleave(group, dim=1)
    v_heads = v.transpose(1, 2).float().repeat_interleave(group, dim=1)
    o = torch.empty(batch, hq, n, q.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, hq, n, dtype=torch.float32, device=q.device)
    for i0 in range(0, n, _TORCH_ROWS_PER_STEP):
        i1 = min(n, i0 + _TORCH_ROWS_PER_STEP)
        logits = _logits(q_heads[:, :, i0:i1], k_heads, scale, softcap)
        logits = logits.masked_fill(~_visible(i0, i1, n, m, window_left, window_right, q.device), float("-inf"))
        row_lse = _row_lse(logits)
        probs = torch.exp(logits - row_lse[..., None])
        keep = _keep_factor(rng, (batch, hq, n, m), (i0, i1), dropout_p, q.device)
        if keep is not None:
            probs = probs * keep
        o[:, :, i0:i1] = _row_outputs(probs, v_heads, row_lse, q.dtype)
        lse[:, :, i0:i1] = row_lse
    return o.transpose(1, 2).to(q.dtype).contiguous(), lse


def torch_attention_bwd(dout, q, k, v, o, lse, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p,
                        deterministic):
    """Backward of torch_attention_fwd: recomputes each block of probabilities from q, k and lse."""
    batch, n, hq, head_dim = q.shape
    m, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    q_heads = _rotate(q, cos, sin, m - n)
    k_heads = _rotate(k, cos, sin, 0).repeat_interleave(group, dim=1)
    v_heads = v.transpose(1, 2).float().repeat_interleave(group, dim=1)
    dout_heads = dout.transpose(1, 2).float()
    delta = (dout_heads * o.transpose(1, 2).float()).sum(dim=-1)
    dq = torch.empty(batch, hq, n, head_dim, dtype=torch.float32, device=q.device)
    dk = torch.zeros(batch, hq, m, head_dim, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for i0 in range(0, n, _TORCH_ROWS_PER_STEP):
        i1 = min(n, i0 + _TORCH_ROWS_PER_STEP)
        logits = _logits(q_heads[:, :, i0:i1], k_heads, scale, softcap)
        visible = _visible(i0, i1, n, m, window_left, window_right, q.device)
        probs = torch.exp(logits - lse[:, :, i0:i1, None]).masked_fill(~visible, 0.0)
        keep = _keep_factor(rng, (batch, hq, n, m), (i0, i1), dropout_p, q.device)
        dprobs = torch.matmul(dout_heads[:, :, i0:i1], v_heads.transpose(-1, -2))
        if keep is not None:
            dprobs = dprobs * keep
        dv += torch.matmul(_round(probs * keep if keep is not None else probs, q.dtype).transpose(-1, -2),
                           dout_heads[:, :, i0:i1])
        logit_grad = scale * (1 - (logits / softcap) ** 2) if softcap > 0 else scale
        # dS of a masked pair is 0 by selection, as the kernels' (probs * (dP - Delta) is 0 * NaN there
        # when the row's Delta or the pair's dP is NaN).
        dlogits = _round((probs * (dprobs - delta[:, :, i0:i1, None]) * logit_grad).masked_fill(~visible, 0.0),
                         q.dtype)
        dq[:, :, i0:i1] = torch.matmul(dlogits, k_heads)
        dk += torch.matmul(dlogits.transpose(-1, -2), q_heads[:, :, i0:i1])
    dq = _unrotate(dq, cos, sin, m - n)
    dk = _unrotate(dk.view(batch, hkv, group, m, head_dim).sum(dim=2), cos, sin, 0)
    dv = dv.view(batch, hkv, group, m, head_dim).sum(dim=2)
    return tuple(g.transpose(1, 2).to(q.dtype).contiguous() for g in (dq, dk, dv))


# Packed (variable-length) attention: S sequences in one row, FlashAttention's varlen convention.
#
# - attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin,
#   rng, scale, softcap, window_left, window_right, dropout_p) -> (o, lse)
# - attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
#   max_seqlen_k, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p,
#   deterministic) -> (dq, dk, dv)
#
# q, o, dout [total_q, Hq, D]; k, v [total_k, Hkv, D]; lse fp32 [Hq, total_q]. cu_seqlens_*: int32
# [S + 1] offsets (checked by remat.checks.check_varlen_offsets: from 0, non-decreasing, ending at
# the totals; zero-length sequences allowed); max_seqlen_*: upper bounds of the lengths. Sequence s
# holds queries cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1 (N_s of them) and keys likewise (M_s); its
# query i sees only its own keys, with the dense masks at position p = i + M_s - N_s.
# cos, sin: None, fp32 contiguous [S_rows, D/2] (positions restart per sequence: key j uses row j,
# query i row p) or [1, T, D/2] (a row per packed key token: key j of sequence s uses row
# cu_seqlens_k[s] + j, query i row cu_seqlens_k[s] + p).
# Dropout: the Philox stream of the dense call on the zero-padded batch [S, max_seqlen_q] x
# [S, max_seqlen_k]: (s, h, i, j) is stream word (row (s*Hq + h)*max_seqlen_q + i, column j) of rows of
# length max_seqlen_k (so the mask depends on the max_seqlen_* bounds passed).


class _VarlenGeometry(NamedTuple):
    """The rope table row of each packed query (int64 [total_q]: its key-space position p = i + M_s
    - N_s, plus cu_seqlens_k[s] with per-token tables) and key (j, plus cu_seqlens_k[s])."""

    query_row: Tensor
    key_row: Tensor


def _varlen_geometry(cu_seqlens_q, cu_seqlens_k, total_q, total_k, per_token_rope):
    device = cu_seqlens_q.device
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    seq_q = torch.searchsorted(cu_q[1:], torch.arange(total_q, device=device), right=True)
    seq_k = torch.searchsorted(cu_k[1:], torch.arange(total_k, device=device), right=True)
    key_position = torch.arange(total_k, device=device) - cu_k[seq_k]
    query_position = torch.arange(total_q, device=device) - cu_q[seq_q] + (cu_k.diff() - cu_q.diff())[seq_q]
    if per_token_rope:
        return _VarlenGeometry(query_position + cu_k[seq_q], key_position + cu_k[seq_k])
    return _VarlenGeometry(query_position, key_position)


def _rotate_rows(x, cos, sin, rows):
    """x [T, H, D] -> [H, T, D] fp32, token t rotated with table row rows[t] and rounded to x's
    dtype when cos/sin ([S, D/2] or [1, S, D/2]) are given (remat.ops.rope's PyTorch rotation)."""
    if cos is None:
        return x.transpose(0, 1).float()
    cos, sin = _packed_tables(cos, sin)
    return torch_rope_rotate(x[None], cos, sin, rows, 0, 0, False)[0].transpose(0, 1).float()


def _unrotate_rows(grad, cos, sin, rows):
    """The transpose of _rotate_rows for a gradient [H, T, D] fp32."""
    if cos is None:
        return grad
    cos, sin = _packed_tables(cos, sin)
    return torch_rope_rotate(grad.transpose(0, 1)[None], cos, sin, rows, 0, 0, True)[0].transpose(0, 1)


def _varlen_operands(q, k, v, cos, sin, geometry):
    """Rotated q [Hq, Tq, D] and k [Hq, Tk, D] (kv heads repeated for GQA), v [Hq, Tk, D], fp32."""
    group = q.shape[1] // k.shape[1]
    q_heads = _rotate_rows(q, cos, sin, geometry.query_row)
    k_heads = _rotate_rows(k, cos, sin, geometry.key_row).repeat_interleave(group, dim=0)
    v_heads = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
    return q_heads, k_heads, v_heads


class _VarlenGroup(NamedTuple):
    """Sequences of a packed call that run as one zero-padded dense batch: their indices, first
    packed query and key and lengths N_s, M_s (int64 [C] each), and the padded lengths width_q >=
    N_s, width_k >= M_s (ints)."""

    sequences: Tensor
    q_start: Tensor
    k_start: Tensor
    n: Tensor
    m: Tensor
    width_q: int
    width_k: int


def _varlen_groups(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k):
    """The sequences of a packed call in groups, each a zero-padded dense batch of at most
    _TORCH_ROWS_PER_STEP padded queries (or one sequence), so that no product meets two sequences:
    a block of packed rows against every packed key, masked by sequence, would multiply the masked
    zeros by the other sequences' operands, and 0 * NaN = NaN would carry a non-finite value from
    one sequence into the others. Widths come from host ints alone (no sync, so this traces under
    torch.compile): sorted longest first by L_s = max(N_s, M_s), the sequence of rank r (from 1) has
    L_s <= sum(L) // r, where sum(L) <= total_q + total_k, or = total_q when q and k share one
    offsets tensor (self-attention). The padded work, the sum over groups of C * width_q * width_k,
    is therefore at most S * max_seqlen_q * max_seqlen_k and at most about 1.6 sum(L)^2 (sum of
    1 / r^2); the unpadded one is sum(N_s M_s), and the segment-masked alternative's total_q *
    total_k."""
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    n, m = cu_q.diff(), cu_k.diff()
    order = torch.argsort(torch.maximum(n, m), descending=True, stable=True)
    lengths = total_q if cu_seqlens_k is cu_seqlens_q else total_q + total_k
    groups, rank = [], 0
    while rank < order.shape[0]:
        bound = lengths // (rank + 1)
        width_q, width_k = min(max_seqlen_q, bound), min(max_seqlen_k, bound)
        if width_q == 0:
            break  # no queries from here on: nothing to compute, those keys' dk, dv are 0
        count = max(1, _TORCH_ROWS_PER_STEP // width_q)
        s = order[rank : rank + count]
        groups.append(_VarlenGroup(s, cu_q[s], cu_k[s], n[s], m[s], width_q, width_k))
        rank += count
    return groups


def _with_pad_row(x, value):
    """x [H, T, ...] with one more row (index T) filled with ``value``: where padded slots read and write."""
    return torch.cat([x, torch.full_like(x[:, :1], value)], dim=1)


def _padded_index(start, length, width, total):
    """int64 [C, width]: the packed row of slot i of each sequence, ``total`` (the pad row) past its length."""
    slots = torch.arange(width, device=start.device)
    return torch.where(slots < length[:, None], start[:, None] + slots, total)


def _gathered(x, index):
    """Rows ``index`` [C, L] of x [H, T + 1, ...] as a [C, H, L, ...] batch."""
    return x[:, index].transpose(0, 1)


def _group_masks(group, i0, i1, hq, max_seqlen_q, max_seqlen_k, rng, window_left, window_right, dropout_p):
    """For padded query rows i0 .. i1 - 1 of a group against its padded keys: visible (bool [C, 1,
    rows, width_k]: a real query and key, inside the window at position p = i + M_s - N_s) and the
    dropout factor (fp32 [C, Hq, rows, width_k]: 1/(1-p) where the padded-batch Philox stream keeps,
    0 where it drops; None without dropout)."""
    device = group.n.device
    i = torch.arange(i0, i1, device=device)[None, :, None]
    j = torch.arange(group.width_k, device=device)[None, None, :]
    n, m = group.n[:, None, None], group.m[:, None, None]
    position = i + m - n
    visible = (i < n) & (j < m)
    if window_left >= 0:
        visible &= j >= position - window_left
    if window_right >= 0:
        visible &= j <= position + window_right
    if dropout_p == 0:
        return visible[:, None], None
    heads = torch.arange(hq, device=device)[None, :, None, None]
    rows = (group.sequences[:, None, None, None] * hq + heads) * max_seqlen_q + i[:, None]
    keep = philox_uniform(philox_stream_words(rng[0], rng[1], rows, j[:, None], max_seqlen_k)) >= dropout_p
    return visible[:, None], keep.float() / (1.0 - dropout_p)


def torch_attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, rng, scale,
                               softcap, window_left, window_right, dropout_p):
    """Packed attention in plain PyTorch: the sequences in groups, each group a zero-padded dense
    batch (_varlen_groups: no host sync, so it traces under torch.compile), its probabilities for
    one block of rows at a time."""
    total_q, hq, head_dim = q.shape
    total_k = k.shape[0]
    geometry = _varlen_geometry(cu_seqlens_q, cu_seqlens_k, total_q, total_k, cos is not None and cos.dim() == 3)
    q_heads, k_heads, v_heads = (_with_pad_row(t, 0.0) for t in _varlen_operands(q, k, v, cos, sin, geometry))
    o = torch.empty(hq, total_q + 1, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(hq, total_q + 1, dtype=torch.float32, device=q.device)
    for group in _varlen_groups(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k):
        index_q = _padded_index(group.q_start, group.n, group.width_q, total_q)
        index_k = _padded_index(group.k_start, group.m, group.width_k, total_k)
        k_group, v_group = _gathered(k_heads, index_k), _gathered(v_heads, index_k)
        for i0 in range(0, group.width_q, _TORCH_ROWS_PER_STEP):
            i1 = min(group.width_q, i0 + _TORCH_ROWS_PER_STEP)
            visible, keep = _group_masks(group, i0, i1, hq, max_seqlen_q, max_seqlen_k, rng, window_left,
                                         window_right, dropout_p)
            rows = index_q[:, i0:i1]
            logits = _logits(_gathered(q_heads, rows), k_group, scale, softcap).masked_fill(~visible, float("-inf"))
            row_lse = _row_lse(logits)
            probs = torch.exp(logits - row_lse[..., None])
            if keep is not None:
                probs = probs * keep
            o[:, rows] = _row_outputs(probs, v_group, row_lse, q.dtype).transpose(0, 1)
            lse[:, rows] = row_lse.transpose(0, 1)
    return o[:, :total_q].transpose(0, 1).to(q.dtype).contiguous(), lse[:, :total_q].contiguous()


def torch_attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin,
                               rng, scale, softcap, window_left, window_right, dropout_p, deterministic):
    """Backward of torch_attention_varlen_fwd: each block of probabilities recomputed from q, k, lse."""
    total_q, hq, head_dim = q.shape
    total_k, hkv = k.shape[0], k.shape[1]
    group_size = hq // hkv
    geometry = _varlen_geometry(cu_seqlens_q, cu_seqlens_k, total_q, total_k, cos is not None and cos.dim() == 3)
    q_heads, k_heads, v_heads = (_with_pad_row(t, 0.0) for t in _varlen_operands(q, k, v, cos, sin, geometry))
    dout_heads = dout.transpose(0, 1).float()
    delta = _with_pad_row((dout_heads * o.transpose(0, 1).float()).sum(dim=-1), 0.0)
    dout_heads, lse = _with_pad_row(dout_heads, 0.0), _with_pad_row(lse, float("inf"))
    dq = torch.empty(hq, total_q + 1, head_dim, dtype=torch.float32, device=q.device)
    dk = torch.zeros(hq, total_k + 1, head_dim, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for group in _varlen_groups(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k):
        index_q = _padded_index(group.q_start, group.n, group.width_q, total_q)
        index_k = _padded_index(group.k_start, group.m, group.width_k, total_k)
        k_group, v_group = _gathered(k_heads, index_k), _gathered(v_heads, index_k)
        dk_group, dv_group = torch.zeros_like(k_group), torch.zeros_like(v_group)
        for i0 in range(0, group.width_q, _TORCH_ROWS_PER_STEP):
            i1 = min(group.width_q, i0 + _TORCH_ROWS_PER_STEP)
            visible, keep = _group_masks(group, i0, i1, hq, max_seqlen_q, max_seqlen_k, rng, window_left,
                                         window_right, dropout_p)
            rows = index_q[:, i0:i1]
            q_rows, dout_rows = _gathered(q_heads, rows), _gathered(dout_heads, rows)
            logits = _logits(q_rows, k_group, scale, softcap)
            probs = torch.exp(logits - _gathered(lse, rows)[..., None]).masked_fill(~visible, 0.0)
            dprobs = torch.matmul(dout_rows, v_group.transpose(-1, -2))
            if keep is not None:
                dprobs = dprobs * keep
            dv_group += torch.matmul(_round(probs * keep if keep is not None else probs, q.dtype).transpose(-1, -2),
                                     dout_rows)
            logit_grad = scale * (1 - (logits / softcap) ** 2) if softcap > 0 else scale
            # dS = 0 by selection at masked pairs, as in torch_attention_bwd.
            dlogits = _round((probs * (dprobs - _gathered(delta, rows)[..., None]) * logit_grad).masked_fill(
                ~visible, 0.0), q.dtype)
            dq[:, rows] = torch.matmul(dlogits, k_group).transpose(0, 1)
            dk_group += torch.matmul(dlogits.transpose(-1, -2), q_rows)
        dk[:, index_k] = dk_group.transpose(0, 1)
        dv[:, index_k] = dv_group.transpose(0, 1)
    dq = _unrotate_rows(dq[:, :total_q], cos, sin, geometry.query_row)
    dk = _unrotate_rows(dk[:, :total_k].view(hkv, group_size, total_k, head_dim).sum(dim=1), cos, sin,
                        geometry.key_row)
    dv = dv[:, :total_k].view(hkv, group_size, total_k, head_dim).sum(dim=1)
    return tuple(g.transpose(0, 1).to(q.dtype).contiguous() for g in (dq, dk, dv))


TORCH_OPS = AttentionOps(torch_attention_fwd, torch_attention_bwd, torch_attention_varlen_fwd,
                         torch_attention_varlen_bwd)


# The "aten" core: PyTorch's own fused attention kernels, which keep exactly remat's contract (q, k,
# v, o and an fp32 logsumexp; the probabilities recomputed in backward): the CPU flash kernel
# (aten::_scaled_dot_product_flash_attention_for_cpu and its backward) and, on CUDA,
# FlashAttention-2 (aten::_flash_attention_forward / _flash_attention_backward, which take remat's
# [B, N, H, D] layout, GQA with Hkv dividing Hq, sliding windows, the bottom-right causal mask,
# packed sequences through cum_seq_q / cum_seq_k, and dropout). Rope stays remat's: q and k are
# rotated (fp32, rounded to the dtype, as every backend's kernels do; rotated_once below) into
# temporaries before the core, again in backward from the saved unrotated q and k, and the core's
# dq/dk (which it returns in the input dtype) are rotated back in fp32 and rounded again: with rope,
# dq and dk are two roundings from the exact value where remat's own kernels take one. With GQA,
# FlashAttention-2 also rounds each query head's dk/dv to the dtype before summing a group (one
# rounding more than remat's kernels). The rotated copies are never saved.
#
# Dropout on FlashAttention-2 is its own: its forward takes a Philox seed and offset from PyTorch's
# CUDA generator (advancing it by B * Hq * 32 counters; graph-capture safe) and returns them as
# rng_state, uint64 [2] written on the device, which its backward takes to regenerate the mask. The
# forward copies rng_state into the 16-byte int64 [2] buffer the Function passes as ``rng``
# (remat.autograd.attention.attention_rng_state), which is what gets saved: the same 16 bytes as
# remat's (seed, offset). The mask is FlashAttention-2's, the one SDPA's flash backend draws for the
# same generator state, not remat's stream (remat.reference.attention_dropout_keep), which remat's
# own kernels keep drawing. It keeps an element when a random byte is <= floor(255 (1 - p)), so the
# keep probability is quantised to 1/256 (230/256 = 0.898 at p = 0.1) while kept values are scaled
# by 1 / (1 - p), as in stock SDPA.

# FlashAttention-2 in PyTorch runs on sm_8x, sm_90, sm_10x and sm_120/121 (flash_api.cpp's arch check;
# sdp_utils.cpp check_flash_attention_hardware_support), and its backward takes head dims above 192 on
# sm_80 and sm_90 only (upstream: 193..224, or any above 192 with dropout, need them; PyTorch's SDPA
# refuses all above 192 on sm_86/89/120, and remat does so everywhere but sm_80/sm_90).
_FLASH_MAJORS = (8, 10)
_FLASH_EXACT = ((9, 0), (12, 0), (12, 1))
_FLASH_BIG_HEAD_ARCHS = ((8, 0), (9, 0))


@torch.compiler.assume_constant_result
def _flash_built():
    """Whether this PyTorch build has FlashAttention-2 for CUDA (not a ROCm build, whose flash op
    masks windows and returns lse differently)."""
    return torch.version.hip is None and torch.backends.cuda.is_flash_attention_available()


def _flash_window_differs(n, m, window_left, window_right, varlen):
    """Whether FlashAttention-2's rewrite of the window (flash_api.cpp: a side of at least seqlen_k
    keys (max_seqlen_k packed) becomes unbounded, and an unbounded right side beside a left window
    becomes seqlen_k) changes the band remat masks. It does only when some query sits at least two
    positions before the first key (N >= M + 2, bottom-right alignment): a right window of >= M keys
    then still hides keys from those rows in remat's band, and the seqlen_k bound FlashAttention-2
    puts on an unbounded right side hides keys that remat's shows. Packed calls are judged on the
    bounds: n, m = max_seqlen_q, max_seqlen_k, and any right window >= max_seqlen_k is refused (a
    sequence's own M_s may be shorter)."""
    if window_right > 0 and window_right >= m:
        return varlen or n >= m + 2
    return window_left >= 0 and window_right < 0 and n >= m + 2


def _flash_backward_is_deterministic():
    """FlashAttention-2's backward in PyTorch accumulates dq with atomics unless
    torch.use_deterministic_algorithms(True) is on without warn_only
    (aten/src/ATen/native/transformers/cuda/attention_backward.cu)."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


@torch.compiler.assume_constant_result
def _onednn_has_native_gemm(kind):
    """Whether oneDNN runs ``kind`` ("bf16" or "fp16") GEMMs natively on this CPU (AVX512-core or
    AMX for bf16; AVX512-FP16 or AMX-FP16 for fp16): the check ATen's cpublas::gemm makes before it
    falls back to its scalar loops (mkldnn_bf16_device_check), a constant to torch.compile."""
    if kind == "bf16":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def cpu_flash_is_fast(dtype):
    """Whether PyTorch's CPU flash kernel runs ``dtype`` at full speed on this CPU, so that the aten
    core is the CPU's fastest attention: float32 and float64 always; float16/bfloat16 only where
    oneDNN has native GEMMs for them (_onednn_has_native_gemm). Elsewhere, on an AVX2-only CPU, the
    kernel's 16-bit GEMMs take ATen's scalar fallback: on a 2-core AVX2 EPYC (2026-12-01, B1 H8
    N512 D64, full step) SDPA flash's bf16 step took 3.7x its fp32 one, and remat's C++ kernel
    (fp32 arithmetic inside) 0.33-0.54x the aten core's time in bf16 and 0.36-0.69x in fp16, where
    in fp32 it took 1.2-2.0x the flash kernel's."""
    if dtype == torch.bfloat16:
        return _onednn_has_native_gemm("bf16")
    if dtype == torch.float16:
        return _onednn_has_native_gemm("fp16")
    return True


def aten_unsupported_reason(n, m, hq, hkv, head_dim, dtype, device, options, varlen=False):
    """Why the aten core cannot run attention of N queries and M keys (Hq / Hkv heads of dim D,
    ``dtype`` on ``device``) with these :class:`remat.options.AttentionOptions`, or None. Packed
    calls (``varlen``) pass max_seqlen_q, max_seqlen_k as N, M.

    Neither core has a logit softcap. On the CPU (the flash kernel, dense only): no dropout, no
    sliding window, and its causal mask aligns top-left, so causal needs N == M. On CUDA
    (FlashAttention-2): a CUDA (not ROCm) build with it, an sm_8x/90/10x/120/121 GPU,
    float16/bfloat16, head dims that are multiples of 8 up to 256 (up to 192 but on sm_80/sm_90),
    windows whose band FlashAttention-2 keeps (_flash_window_differs), and a deterministic backward
    only under PyTorch's deterministic mode (so ``options.deterministic`` needs it); dropout
    included, with FlashAttention-2's own mask (see the comment above _FLASH_MAJORS)."""
    if options.softcap > 0:
        return "PyTorch's fused attention has no logit softcap"
    if device.type == "cuda":
        return _flash_unsupported_reason(n, m, head_dim, dtype, device, options, varlen)
    if device.type != "cpu":
        return f"no PyTorch fused attention kernel for {device.type} tensors"
    if options.dropout_p > 0:
        return "PyTorch's CPU flash attention has no dropout"
    return windowless_top_left_reason("PyTorch's CPU flash attention", n, m, options)


def windowless_top_left_reason(kernel, n, m, options):
    """Why ``kernel``, a PyTorch attention kernel without sliding windows whose causal mask aligns
    the first query with the first key (the CPU flash kernel, cuDNN), cannot run remat's call of N
    queries and M keys with these options, or None: no window, and causal needs N == M."""
    if options.window_left >= 0 or options.window_right > 0:
        return f"{kernel} has no sliding window"
    if options.window_right == 0 and n != m:
        return f"{kernel} aligns the causal mask top-left; remat aligns it bottom-right (N != M)"
    return None


def _flash_unsupported_reason(n, m, head_dim, dtype, device, options, varlen):
    """aten_unsupported_reason for a CUDA tensor: FlashAttention-2's limits (see there)."""
    if not _flash_built():
        return "this PyTorch build has no CUDA FlashAttention-2 (a ROCm build, or built without it)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = device_capability(index)
    if capability[0] not in _FLASH_MAJORS and capability not in _FLASH_EXACT:
        return (f"PyTorch's FlashAttention-2 runs on sm_8x, sm_90, sm_10x and sm_120/121 GPUs; this one is "
                f"sm_{capability[0]}{capability[1]}")
    if dtype not in (torch.float16, torch.bfloat16):
        return "FlashAttention-2 takes float16/bfloat16"
    if head_dim % 8 or head_dim > 256:
        return "FlashAttention-2 takes head dims that are multiples of 8 up to 256"
    if head_dim > 192 and capability not in _FLASH_BIG_HEAD_ARCHS:
        return "FlashAttention-2's backward takes head dims above 192 on sm_80 and sm_90 only"
    if _flash_window_differs(n, m, options.window_left, options.window_right, varlen):
        return ("FlashAttention-2 rewrites windows of at least M keys, which changes the band for queries two or "
                "more positions before the first key (N >= M + 2)")
    if options.deterministic and not _flash_backward_is_deterministic():
        return ("FlashAttention-2's backward accumulates dq with atomics unless "
                "torch.use_deterministic_algorithms(True) is set (without warn_only), and this call asks for a "
                "deterministic backward (deterministic=True, or PyTorch's deterministic mode with warn_only)")
    return None


def _flash_window(window_left, window_right):
    """(is_causal, window_size_left, window_size_right) of FlashAttention-2 for remat's window:
    both count keys from the query's bottom-right-aligned position, -1 / None unbounded."""
    causal = window_right == 0
    left = window_left if window_left >= 0 else None
    right = window_right if window_right > 0 else None
    return causal, left, right


def _check_aten_call(q, k, options, max_seqlens=None):
    """Raises ValueError when the aten core cannot run this dense call (q [B, N, Hq, D]) or packed
    call (q [total_q, Hq, D], max_seqlens = (max_seqlen_q, max_seqlen_k))."""
    n, m = max_seqlens if max_seqlens is not None else (q.shape[1], k.shape[1])
    reason = aten_unsupported_reason(n, m, q.shape[-2], k.shape[-2], q.shape[-1], q.dtype, q.device, options,
                                     varlen=max_seqlens is not None)
    if reason is not None:
        raise ValueError(f"the aten attention core cannot run this call: {reason}")


def no_rope_tables(cos, sin):
    """The PyTorch cores (the aten core below, remat.ops.attention_cudnn) take q and k already
    rotated (their OPS wrap them in rotated_once); tables reaching them would be ignored, so they
    are refused."""
    if cos is not None or sin is not None:
        raise ValueError("cos, sin: the aten attention core takes q and k rotated (use ATEN_OPS)")


def _aten_core_fwd(q, k, v, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p):
    """Forward through PyTorch's fused attention core (see aten_unsupported_reason), q and k rotated."""
    no_rope_tables(cos, sin)
    _check_aten_call(q, k, AttentionOptions(scale, softcap, window_left, window_right, dropout_p, False))
    if q.device.type == "cpu":
        o, lse = _cpu_flash_forward(q, k, v, scale, window_right == 0)
        return o, lse.contiguous()
    causal, left, right = _flash_window(window_left, window_right)
    o, lse, rng_state = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, causal, False, scale=scale, window_size_left=left,
        window_size_right=right)[:3]
    _keep_flash_rng_state(rng, rng_state, dropout_p)
    # FlashAttention-2 allocates o like q (empty_like): strided when q is (e.g. a "bhnd" caller's view).
    return o.contiguous(), lse


def cpu_flash_attention(q, k, v, options):
    """Dense attention of CPU tensors without rope through PyTorch's CPU flash kernel and its own
    autograd node (derivatives.yaml: the node saves q, k, v, o and the fp32 logsumexp and its
    backward is _scaled_dot_product_flash_attention_for_cpu_backward): exactly the aten core's
    contract and arithmetic (_aten_core_fwd / _aten_core_bwd), without a Python autograd.Function
    around it. Why: on a 2-core Xeon (2026-12-02, B1 H8 N512 D64 bf16 causal, forward + backward,
    200 interleaved rounds) even a minimal Python Function around the same two kernels measured
    1.02 of SDPA's step and remat's AttentionFunction 1.05, against a C++ node's 1.00. q [B, N, Hq, D],
    k, v [B, M, Hkv, D]; returns o [B, N, Hq, D], contiguous. Checks the call like the core."""
    if q.device.type != "cpu":
        raise ValueError(f"cpu_flash_attention runs CPU tensors, and q is on {q.device}")
    _check_aten_call(q, k, options)
    return _cpu_flash_forward(q, k, v, options.scale, options.window_right == 0)[0]


def _cpu_flash_forward(q, k, v, scale, causal):
    """PyTorch's CPU flash kernel on remat's q [B, N, Hq, D], k, v [B, M, Hkv, D]: o [B, N, Hq, D]
    (contiguous without a copy: the kernel allocates o as a [B, H, N, D] view of [B, N, H, D]
    storage) and the kernel's fp32 lse [B, Hq, N] as it returns it (a strided view)."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)[:2]
    return o.transpose(1, 2).contiguous(), lse


def _keep_flash_rng_state(rng, rng_state, dropout_p):
    """With dropout, copies FlashAttention-2's rng_state (its Philox seed and offset, uint64 [2] on
    the device) into ``rng``, the int64 [2] buffer the Function saves (see the comment above
    _FLASH_MAJORS)."""
    if dropout_p > 0:
        if rng is None or rng.shape != (2,) or rng.dtype != torch.int64 or rng.device != rng_state.device:
            raise ValueError("rng: the aten core with dropout takes an int64 [2] buffer on the inputs' device for "
                             "FlashAttention-2's seed and offset (remat.autograd.attention.attention_rng_state)")
        rng.copy_(rng_state.view(torch.int64))


def _flash_rng_state(rng, dropout_p, device):
    """(rng_state, unused) for FlashAttention-2's backward: with dropout the forward's seed and
    offset (the saved buffer viewed as uint64), else zeros it does not read."""
    state = rng.view(torch.uint64) if dropout_p > 0 else torch.zeros(2, dtype=torch.uint64, device=device)
    return state, torch.empty(0, device=device)


def _aten_core_bwd(dout, q, k, v, o, lse, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p,
                   deterministic):
    """Backward through PyTorch's fused attention core, q and k rotated: the probabilities
    recomputed from q, k and lse by its backward kernel. The CPU kernel is deterministic;
    FlashAttention-2's backward is deterministic under PyTorch's deterministic mode only, which the
    backend choice checked (aten_unsupported_reason)."""
    no_rope_tables(cos, sin)
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.transpose(1, 2) for t in (dout, q, k, v, o)), lse, 0.0, window_right == 0, scale=scale)
        return tuple(g.transpose(1, 2).to(q.dtype).contiguous() for g in (dq, dk, dv))
    causal, left, right = _flash_window(window_left, window_right)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, o, lse, None, None, q.shape[1], k.shape[1], dropout_p, causal,
        *_flash_rng_state(rng, dropout_p, q.device), scale=scale, window_size_left=left, window_size_right=right)
    return tuple(g.to(q.dtype).contiguous() for g in (dq, dk, dv))


def _aten_core_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, rng, scale,
                          softcap, window_left, window_right, dropout_p):
    """Packed attention through FlashAttention-2's variable-length entry (CUDA only; the CPU flash
    kernel has none): q [total_q, Hq, D] (rotated), k, v [total_k, Hkv, D] with int32 offsets.
    Returns o [total_q, Hq, D], lse [Hq, total_q]."""
    no_rope_tables(cos, sin)
    if q.device.type != "cuda":
        raise ValueError("the aten attention core has packed (cu_seqlens) attention on CUDA only")
    _check_aten_call(q, k, AttentionOptions(scale, softcap, window_left, window_right, dropout_p, False),
                     (max_seqlen_q, max_seqlen_k))
    causal, left, right = _flash_window(window_left, window_right)
    o, lse, rng_state = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal, False, scale=scale,
        window_size_left=left, window_size_right=right)[:3]
    _keep_flash_rng_state(rng, rng_state, dropout_p)
    return o.contiguous(), lse


def _aten_core_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin,
                          rng, scale, softcap, window_left, window_right, dropout_p, deterministic):
    """Backward of _aten_core_varlen_fwd: FlashAttention-2's variable-length backward on the
    rotated q, k."""
    no_rope_tables(cos, sin)
    causal, left, right = _flash_window(window_left, window_right)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
        *_flash_rng_state(rng, dropout_p, q.device), scale=scale, window_size_left=left, window_size_right=right)
    return tuple(g.to(q.dtype).contiguous() for g in (dq, dk, dv))


def _packed_tables(cos, sin):
    """Packed rope tables ([S_rows, D/2] or [1, T, D/2]) as the [R, D/2] tables rope_rotate takes."""
    half = cos.shape[-1]
    return cos.reshape(-1, half), sin.reshape(-1, half)


def _rotated_varlen_operands(q, k, cos, sin, geometry):
    """Packed q [total_q, Hq, D] and k [total_k, Hkv, D] rotated per token (table row
    geometry.query_row / key_row) into new contiguous tensors of the same shapes and dtype."""
    cos, sin = _packed_tables(cos, sin)
    return (rope_rotate(q[None], cos, sin, rows=geometry.query_row)[0],
            rope_rotate(k[None], cos, sin, rows=geometry.key_row)[0])


# Rope rotated once per pass, outside a backend's kernels: q and k are rotated (fp32, rounded to the
# dtype) into temporaries before the forward kernel and again before the backward kernels, from the
# saved unrotated q and k; the kernels run without rope and the backward's dq, dk are rotated back
# in fp32 and rounded again (two roundings). The rotations are remat.ops.rope's kernel (one pass
# over the tensor, in [B, L, H, D] order, so the cores take and return contiguous tensors; it
# replaced six PyTorch ops over fp32 temporaries: 69-77 us instead of 186-193 us (fp32; bf16 71-85
# instead of 245-281 us) for a Llama layer's q and k of 256 tokens on the 2-core CPU). The rotated copies are
# never saved. The aten core always runs this way (ATEN_OPS: PyTorch's kernels have no rope); the
# Triton backend when a backward follows (rope_rotated_once): on an H200 (B1 H16 N4096 D128 bf16
# causal), with the rotation still in PyTorch ops (heads-first temporaries, before remat.ops.rope),
# the full step took 0.90 [0.87, 0.95] of the time with rope inside the kernels (a second run read
# 0.97 against a baseline row the harness flagged suspect; backward 0.76 in both, the in-kernel
# rotation being redone per (query block, key tile) pair in three kernels; forward 1.3x slower, so
# forward-only calls keep the rotation in the forward kernel). Forward and backward rotate with the
# same function, so the backward recomputes the probabilities from the very q and k the forward's
# lse came from.


def rope_rotated_once(backend, rope, needs_grad):
    """Whether a call on ``backend`` with rope (``rope``: tables given) rotates q and k once per
    pass outside the kernels (:func:`rotated_once`) rather than inside them: the Triton backend
    when a backward will follow (``needs_grad``; see the comment above for the measurement)."""
    return backend == "triton" and rope and needs_grad


def dense_rope_tables(cos, sin):
    """Dense rope tables [1 or B, S, D/2] as rope_rotate's [R, D/2] tables and the row stride
    between batch entries (0 when one table serves the whole batch)."""
    tables, length, half = cos.shape
    return cos.reshape(-1, half), sin.reshape(-1, half), length if tables > 1 else 0


def _rotated_operands(q, k, cos, sin):
    """q [B, N, Hq, D] (query i at key position i + M - N) and k [B, M, Hkv, D] rotated into new
    contiguous tensors of the same shapes and dtype."""
    n, m = q.shape[1], k.shape[1]
    cos, sin, batch_stride = dense_rope_tables(cos, sin)
    return (rope_rotate(q, cos, sin, first_position=m - n, table_batch_stride=batch_stride),
            rope_rotate(k, cos, sin, table_batch_stride=batch_stride))


def _rotated_once_fwd(ops, q, k, v, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p):
    if cos is None:
        return ops.attention_fwd(q, k, v, None, None, rng, scale, softcap, window_left, window_right, dropout_p)
    q_rotated, k_rotated = _rotated_operands(q, k, cos, sin)
    return ops.attention_fwd(q_rotated, k_rotated, v, None, None, rng, scale, softcap, window_left, window_right,
                             dropout_p)


def _rotated_once_bwd(ops, dout, q, k, v, o, lse, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p,
                      deterministic):
    if cos is None:
        return ops.attention_bwd(dout, q, k, v, o, lse, None, None, rng, scale, softcap, window_left, window_right,
                                 dropout_p, deterministic)
    n, m = q.shape[1], k.shape[1]
    q_rotated, k_rotated = _rotated_operands(q, k, cos, sin)
    dq, dk, dv = ops.attention_bwd(dout, q_rotated, k_rotated, v, o, lse, None, None, rng, scale, softcap, window_left,
                                   window_right, dropout_p, deterministic)
    cos, sin, batch_stride = dense_rope_tables(cos, sin)
    dq = rope_rotate(dq, cos, sin, first_position=m - n, table_batch_stride=batch_stride, inverse=True)
    dk = rope_rotate(dk, cos, sin, table_batch_stride=batch_stride, inverse=True)
    return dq, dk, dv


def _rotated_once_varlen_fwd(ops, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, rng,
                             scale, softcap, window_left, window_right, dropout_p):
    if cos is None:
        return ops.attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, None,
                                        rng, scale, softcap, window_left, window_right, dropout_p)
    geometry = _varlen_geometry(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], cos.dim() == 3)
    q_rotated, k_rotated = _rotated_varlen_operands(q, k, cos, sin, geometry)
    return ops.attention_varlen_fwd(q_rotated, k_rotated, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    None, None, rng, scale, softcap, window_left, window_right, dropout_p)


def _rotated_once_varlen_bwd(ops, dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos,
                             sin, rng, scale, softcap, window_left, window_right, dropout_p, deterministic):
    if cos is None:
        return ops.attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        None, None, rng, scale, softcap, window_left, window_right, dropout_p,
                                        deterministic)
    geometry = _varlen_geometry(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], cos.dim() == 3)
    q_rotated, k_rotated = _rotated_varlen_operands(q, k, cos, sin, geometry)
    dq, dk, dv = ops.attention_varlen_bwd(dout, q_rotated, k_rotated, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, None, None, rng, scale, softcap, window_left,
                                          window_right, dropout_p, deterministic)
    cos, sin = _packed_tables(cos, sin)
    dq = rope_rotate(dq[None], cos, sin, rows=geometry.query_row, inverse=True)[0]
    dk = rope_rotate(dk[None], cos, sin, rows=geometry.key_row, inverse=True)[0]
    return dq, dk, dv


def rotated_once(ops):
    """``ops`` (an AttentionOps) with rope rotated once per pass outside its kernels (see the comment
    above): the same signatures; the kernels get cos = sin = None. Calls without tables go
    straight through. Packed operators stay None where ``ops`` has none."""
    packed = ops.attention_varlen_fwd is not None
    return AttentionOps(functools.partial(_rotated_once_fwd, ops), functools.partial(_rotated_once_bwd, ops),
                        functools.partial(_rotated_once_varlen_fwd, ops) if packed else None,
                        functools.partial(_rotated_once_varlen_bwd, ops) if packed else None)


# The aten core: PyTorch's kernels have no rope, so remat's is applied around them by rotated_once.
ATEN_OPS = rotated_once(AttentionOps(_aten_core_fwd, _aten_core_bwd, _aten_core_varlen_fwd, _aten_core_varlen_bwd))
aten_attention_fwd, aten_attention_bwd, aten_attention_varlen_fwd, aten_attention_varlen_bwd = ATEN_OPS


def _fake_attention_fwd(q, k, v, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p):
    batch, n, hq, head_dim = q.shape
    return q.new_empty(batch, n, hq, head_dim), q.new_empty(batch, hq, n, dtype=torch.float32)


def _fake_attention_bwd(dout, q, k, v, o, lse, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p,
                        deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fake_attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, rng, scale,
                               softcap, window_left, window_right, dropout_p):
    total_q, hq, head_dim = q.shape
    return q.new_empty(total_q, hq, head_dim), q.new_empty(hq, total_q, dtype=torch.float32)


def _fake_attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin,
                               rng, scale, softcap, window_left, window_right, dropout_p, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


EXTENSION_OPS = None
if _extension.LOADED:
    torch.library.register_fake("remat::attention_fwd")(_fake_attention_fwd)
    torch.library.register_fake("remat::attention_bwd")(_fake_attention_bwd)
    torch.library.register_fake("remat::attention_varlen_fwd")(_fake_attention_varlen_fwd)
    torch.library.register_fake("remat::attention_varlen_bwd")(_fake_attention_varlen_bwd)
    EXTENSION_OPS = AttentionOps(torch.ops.remat.attention_fwd, torch.ops.remat.attention_bwd,
                                 torch.ops.remat.attention_varlen_fwd, torch.ops.remat.attention_varlen_bwd)


@torch.library.custom_op("remat_triton::attention_fwd", mutates_args=())
@on_tensor_device
def triton_attention_fwd(q: Tensor, k: Tensor, v: Tensor, cos: Optional[Tensor], sin: Optional[Tensor],
                         rng: Optional[Tensor], scale: float, softcap: float, window_left: int, window_right: int,
                         dropout_p: float) -> tuple[Tensor, Tensor]:
    from remat.kernels import attention

    return attention.attention_fwd(q, k, v, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p)


@torch.library.custom_op("remat_triton::attention_bwd", mutates_args=())
@on_tensor_device
def triton_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cos: Optional[Tensor],
                         sin: Optional[Tensor], rng: Optional[Tensor], scale: float, softcap: float,
                         window_left: int, window_right: int, dropout_p: float,
                         deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    from remat.kernels import attention

    return attention.attention_bwd(dout, q, k, v, o, lse, cos, sin, rng, scale, softcap, window_left, window_right,
                                   dropout_p, deterministic)


@torch.library.custom_op("remat_triton::attention_varlen_fwd", mutates_args=())
@on_tensor_device
def triton_attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                max_seqlen_q: int, max_seqlen_k: int, cos: Optional[Tensor], sin: Optional[Tensor],
                                rng: Optional[Tensor], scale: float, softcap: float, window_left: int,
                                window_right: int, dropout_p: float) -> tuple[Tensor, Tensor]:
    from remat.kernels import attention

    return attention.attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin,
                                          rng, scale, softcap, window_left, window_right, dropout_p)


@torch.library.custom_op("remat_triton::attention_varlen_bwd", mutates_args=())
@on_tensor_device
def triton_attention_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                                cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                cos: Optional[Tensor], sin: Optional[Tensor], rng: Optional[Tensor], scale: float,
                                softcap: float, window_left: int, window_right: int, dropout_p: float,
                                deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    from remat.kernels import attention

    return attention.attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, cos, sin, rng, scale, softcap, window_left, window_right,
                                          dropout_p, deterministic)


triton_attention_fwd.register_fake(_fake_attention_fwd)
def _refuse_rope_tables(cos, sin):
    """The Triton backward launchers' refusal of rotary tables, in the fake kernels too."""
    if cos is not None or sin is not None:
        from remat.kernels.attention.launch import _BACKWARD_ROPE_ERROR

        raise ValueError(_BACKWARD_ROPE_ERROR)


def _fake_triton_attention_bwd(dout, q, k, v, o, lse, cos, sin, *args):
    _refuse_rope_tables(cos, sin)
    return _fake_attention_bwd(dout, q, k, v, o, lse, cos, sin, *args)


def _fake_triton_attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      cos, sin, *args):
    _refuse_rope_tables(cos, sin)
    return _fake_attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      cos, sin, *args)


triton_attention_bwd.register_fake(_fake_triton_attention_bwd)
triton_attention_varlen_fwd.register_fake(_fake_attention_varlen_fwd)
triton_attention_varlen_bwd.register_fake(_fake_triton_attention_varlen_bwd)

TRITON_OPS = AttentionOps(triton_attention_fwd, triton_attention_bwd, triton_attention_varlen_fwd,
                          triton_attention_varlen_bwd)


# Read by remat.ops.ops_for; None where the extension is not built.
OPS = {"torch": TORCH_OPS, "triton": TRITON_OPS, "cpp": EXTENSION_OPS, "cuda": EXTENSION_OPS, "aten": ATEN_OPS}
