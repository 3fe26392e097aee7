"""The attention sub-block over tiles of the sequence (``norm_attention(tile_tokens=T)``): what
:class:`remat.autograd.norm_attention.NormAttentionFunction` runs when its options carry a tile.

Why: at long context every per-token tensor of the sub-block's backward is a term of the step's
peak. Untiled, that backward holds the normalized input, q, k, v, their rotated copies, dq, dk, dv,
the projections' input gradients and their sum at once, about 100 KiB per token for Llama-3.1-8B
(hidden 4096, 8 KV heads): more than the kept layer inputs of all 32 layers. Tiled, the only
whole-sequence tensors it makes are k and v (rotated k; with per-head norms also the pre-norm k),
fp32 accumulators of dk and dv, and dx; everything of q's width exists one tile at a time.

Forward: the norm and the q/k/v projections (with their LoRA branches) run per tile of rows and
write into whole-size q, k, v; the attention core runs once on them (its working set is q, k, v,
o and lse, no larger). What is saved is unchanged.

Backward, per batch row, query tiles in descending order: tile [a, b) recomputes its normalized
input (and its q under policy "memory"), rotates it and runs the core's backward for its queries
against keys [0, b) with the forward's lse rows: a causal query row's gradient needs its own
lse, o and dout and nothing of the other rows, so the tile's dq is the untiled dq's rows, and the
tile's dk, dv over keys [0, b) add into the fp32 accumulators. Keys [a, b) are seen by no earlier
query tile, so after tile [a, b) their dk, dv are complete: the tile then finishes its whole
backward (inverse rope, per-head norm backward, the projections' and LoRA branches' gradients, the
norm backward into dx rows [a, b)). Weight gradients are summed over the tiles in fp32 and rounded
once at the end.

The cores align a query tile's causal mask differently: remat's own kernels, the torch core and
the aten core on CUDA (FlashAttention-2) put query i of N at key position i + M - N
(bottom-right), so one call over keys [0, b) is the tile's causal band. cuDNN and the aten core on
the CPU (PyTorch's CPU flash kernel) align top-left, so a tile runs two calls there: the
causal square over keys [a, b) and the unmasked rectangle over keys [0, a); both read the full
rows' lse, so their sum is the tile's gradient (dq rounded once from the fp32 sum).

A causal sliding window (query p sees keys p - left .. p) changes nothing of this order: keys
[a, b) are still seen by no query before a, so they are complete after tile [a, b); the tile's
call reads keys [max(0, a - left), b) only, with the window (bottom-right aligned, the band of
each query is its untiled band). cuDNN and the CPU flash kernel have no windows; remat never
runs a windowed call on them.

Packed sequences (cu_seqlens, one row of S sequences) tile the packed row the same way: keys
[a, b) are seen only by queries of their own sequence at or after them, so they too are complete
after tile [a, b). The tile's call is the varlen core's over the sequences it overlaps: its
queries [a, b) cut at the sequence starts, against keys from the start of the sequence holding
query a (or its first query's window) to b, each sequence's queries the last of its keys
(bottom-right alignment, as the untiled call's). Rope tables restarting per sequence ([S_rows, D/2])
are gathered per token once per backward. The sequence starts are read on the host (one copy of
cu_seqlens per backward); under remat.estimate (fake tensors, no values) the row counts as one
sequence, which reads the most keys per tile (an upper bound of the working set, stated in the
estimate's assumptions). Under torch.compile the offsets are traced and the tiles' shapes would be
data: packed rows are not tiled there.

Limits (refused by remat.functional.norm_attention with a ValueError): causal attention only (a
non-causal call would need every query tile before any key is final), no attention dropout.
"""

import torch

from remat import checks
from remat.autograd import lora
from remat.autograd.common import kernel_rope_tables, sequence_tiles, without_empty_queries
from remat.autograd.norm import norm_backward, norm_forward
from remat.ops import ops_for
from remat.ops.attention import dense_rope_tables
from remat.ops.rope import rope_rotate


def _rope_tables(cos, sin, head_dim):
    """The caller's rope tables as rope_rotate's fp32 [R, D/2] tables and the row stride between
    batch entries (remat.ops.attention.dense_rope_tables); (None, None, 0) without rope."""
    cos32, sin32 = kernel_rope_tables(cos, sin, head_dim)
    return (None, None, 0) if cos32 is None else dense_rope_tables(cos32, sin32)


def _rotated(t, tables, first_row, inverse=False):
    """t ``[1, L, H, D]`` rotated at table rows first_row .. (rope_rotate), or t without rope."""
    cos, sin, _ = tables
    if cos is None:
        return t
    return rope_rotate(t, cos, sin, first_position=first_row, inverse=inverse)


def _projection(normed, target, weight, bias, heads, head_dim, adapters, row_offset):
    """One projection (+ its LoRA branches) of the normalized rows ``[L, H]``, as ``[1, L, heads, D]``."""
    out = lora.add_branches(torch.nn.functional.linear(normed, weight, bias), normed, target, *adapters,
                            row_offset=row_offset)
    return out.view(1, normed.shape[0], heads, head_dim)


def project_tiled(rows, norm_weight, norm_bias, weights, biases, shape, adapters, options):
    """Forward: (q, k, v ``[B, N, heads, D]``, mean or None, rstd ``[B N]``) of x's rows ``[B N, H]``,
    the norm and the projections run per tile of ``options.tile_tokens`` rows (no whole-size
    normalized input); the statistics are those the untiled norm gives (row by row)."""
    batch, n, hq, hkv, head_dim = shape
    heads = (hq, hkv, hkv)
    total = rows.shape[0]
    outputs = [rows.new_empty(total, h * head_dim) for h in heads]
    mean = rstd = None
    for start, end in sequence_tiles(total, options.tile_tokens):
        normed, mean_t, rstd_t = norm_forward(rows[start:end], norm_weight, norm_bias, options.norm, options.eps,
                                              options.norm_backend)
        if rstd is None:
            rstd = rstd_t.new_empty(total)
            mean = None if mean_t is None else mean_t.new_empty(total)
        rstd[start:end] = rstd_t
        if mean is not None:
            mean[start:end] = mean_t
        for target, (out, w, b, h) in enumerate(zip(outputs, weights, biases, heads)):
            out[start:end] = _projection(normed, target, w, b, h, head_dim, adapters, start).view(end - start, -1)
        del normed
    return (*(out.view(batch, n, h, head_dim) for out, h in zip(outputs, heads)), mean, rstd)


def _sequence_starts(cu_seqlens, total):
    """The packed row's sequence offsets as ints (cu_seqlens, read on the host), or [0, total] under
    remat.estimate (fake tensors have no values: the row counts as one sequence, an upper bound of
    a tile's keys, and the estimate says so). Traced offsets (torch.compile) raise: the tiles' calls
    take their shapes from the values, so remat.functional.norm_attention and the layers run
    packed rows untiled under compile."""
    from remat.planning import estimator

    if estimator.estimating():
        estimator.note_assumption(PACKED_AS_ONE_SEQUENCE)
        return [0, total]
    if checks.values_unknown(cu_seqlens):
        raise RuntimeError("remat: the tiled attention backward needs packed rows' offsets as values; under "
                           "torch.compile packed rows run untiled")
    return [int(c) for c in cu_seqlens.tolist()]


# What an estimate assumes of a tiled packed row (remat.planning.estimator.Estimate.assumptions).
PACKED_AS_ONE_SEQUENCE = ("a packed row's tiled attention backward reading keys as for one sequence (the most a "
                          "tile can read; the offsets have no values on fake tensors)")


def _per_token_rope(cos, sin, starts, head_dim):
    """Rope tables that restart per packed sequence (``[S_rows, D/2|D]``: token t of the sequence
    starting at s uses row t - s) as per-token fp32 ``[1, T, D/2]`` tables."""
    device = cos.device
    bounds = torch.tensor(starts, dtype=torch.long, device=device)
    total = starts[-1]
    tokens = torch.arange(total, device=device)
    sequence = torch.searchsorted(bounds[1:], tokens, right=True)
    rows = tokens - bounds[sequence]
    return tuple(table[..., : head_dim // 2].to(torch.float32)[rows][None].contiguous() for table in (cos, sin))


def _packed_tiles(starts, tiles, window_left, device):
    """{tile start: (first key, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)} of the
    varlen calls of a packed row's query ``tiles``, the offsets int32 on ``device``, made by one
    host-to-device copy for all tiles (a copy per tile would wait for the device each time)."""
    calls = [_packed_tile(starts, start, end, window_left) for start, end in tiles]
    flat = torch.tensor([c for call in calls for c in (*call[1], *call[2])], dtype=torch.int32).to(device)
    out, at = {}, 0
    for (start, _), (first_key, cu_q, cu_k, max_q, max_k) in zip(tiles, calls, strict=True):
        q_offsets, at = flat[at:at + len(cu_q)], at + len(cu_q)
        k_offsets, at = flat[at:at + len(cu_k)], at + len(cu_k)
        out[start] = (first_key, q_offsets, k_offsets, max_q, max_k)
    return out


def _packed_tile(starts, start, end, window_left):
    """The varlen call of query tile [start, end) of a packed row with sequence offsets ``starts``:
    (first key, cu_seqlens_q, cu_seqlens_k as int lists, max_seqlen_q, max_seqlen_k). Queries
    [start, end) are cut at the sequence starts inside the tile; the keys run from the start of the
    sequence holding query ``start`` (or, under a window, its first query's earliest key) to end."""
    holding = max(c for c in starts if c <= start)
    first_key = max(holding, start - window_left) if window_left >= 0 else holding
    inner = [c for c in starts if start < c < end]
    cu_q = [0, *(c - start for c in inner), end - start]
    cu_k = [0, *(c - first_key for c in inner), end - first_key]
    return (first_key, cu_q, cu_k, max(b - a for a, b in zip(cu_q, cu_q[1:])),
            max(b - a for a, b in zip(cu_k, cu_k[1:])))


def _fp32(weight):
    return None if weight is None else weight.float()


class _Sums:
    """Gradients summed over tiles in fp32, keyed by input position; rounded once by :meth:`result`."""

    def __init__(self):
        self.sums = {}

    def add(self, key, grad):
        if grad is None:
            return
        if key in self.sums:
            self.sums[key].add_(grad)
        else:
            self.sums[key] = grad.float()

    def result(self, key, like):
        total = self.sums.get(key)
        return None if total is None else total.to(like.dtype)


def backward_tiled(ctx, saved, dout, head_norm, head_norm_backward, first_lora_input):
    """The gradients NormAttentionFunction.backward returns, computed over query tiles (module
    docstring). ``saved``: its saved tensors; ``head_norm`` / ``head_norm_backward``: its per-head
    norm helpers (shared, so both paths normalize q and k identically)."""
    (x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, q_norm_weight, k_norm_weight, mean, rstd, q, k, v, o,
     lse, rng, cos, sin, cu_seqlens, empty, *lora_saved) = saved
    options, backend, layout = ctx.options, ctx.backend, ctx.lora_layout
    batch, n, hq, hkv, head_dim = options.shape
    attention = options.attention
    need = ctx.needs_input_grad
    lora_count = lora.TENSORS_PER_ADAPTER * len(layout)
    lora_tensors, lora_rngs = lora_saved[:lora_count], lora_saved[lora_count:]
    adapters = (layout, lora_tensors, lora_rngs, options.norm_backend)
    lora_needs = need[first_lora_input:]
    weights, biases = (w_q, w_k, w_v), (b_q, b_k, b_v)
    starts = None if cu_seqlens is None else _sequence_starts(cu_seqlens, n)
    if starts is not None and cos is not None and cos.dim() == 2:
        cos, sin = _per_token_rope(cos, sin, starts, head_dim)
    rope = _rope_tables(cos, sin, head_dim)
    core = ops_for("attention", backend)
    # cuDNN and PyTorch's CPU flash kernel (the aten core on the CPU) align a causal mask top-left
    # (remat.ops.attention.windowless_top_left_reason); the other cores bottom-right.
    split_causal = backend == "cudnn" or (backend == "aten" and x.device.type == "cpu")
    left = attention.window_left  # -1: no window
    if split_causal and (left >= 0 or starts is not None):
        raise RuntimeError(f"remat: the {backend} attention core has no sliding window or packed rows; this call "
                           "cannot run on it")
    hidden = x.shape[-1]
    rows = x.reshape(batch * n, hidden)
    dx = torch.empty_like(x)
    sums = _Sums()
    qk_norm = options.qk_norm is not None

    def normalized(first, last):
        normed, _, _ = norm_forward(rows[first:last], norm_weight, norm_bias, options.norm, options.eps,
                                    options.norm_backend)
        return normed

    for entry in range(batch):
        first_row = entry * n
        table_row = entry * rope[2]
        # Keys and values of the whole row: kept, or recomputed tile by tile (policy "memory").
        if k is not None:
            k_pre, v_row = k[entry:entry + 1], v[entry:entry + 1]
        else:
            k_pre = x.new_empty(1, n, hkv, head_dim)
            v_row = x.new_empty(1, n, hkv, head_dim)
            for start, end in sequence_tiles(n, options.tile_tokens):
                normed = normalized(first_row + start, first_row + end)
                for target, out in ((1, k_pre), (2, v_row)):
                    out[:, start:end] = _projection(normed, target, weights[target], biases[target], hkv, head_dim,
                                                    adapters, first_row + start)
                del normed
        k_rotated = _rotated(head_norm(k_pre, k_norm_weight, options)[0] if qk_norm else k_pre, rope, table_row)
        if not qk_norm and k is None:
            del k_pre  # the rotated copy is all that is needed (no per-head norm to differentiate)
        dk_sum = torch.zeros(1, n, hkv, head_dim, dtype=torch.float32, device=x.device)
        dv_sum = torch.zeros_like(dk_sum)
        tiles = sequence_tiles(n, options.tile_tokens)
        packed_calls = None if starts is None else _packed_tiles(starts, tiles, left, x.device)
        for start, end in reversed(tiles):
            first, last = first_row + start, first_row + end
            normed = normalized(first, last)
            q_pre = q[entry:entry + 1, start:end] if q is not None else _projection(
                normed, 0, w_q, b_q, hq, head_dim, adapters, first)
            q_in, q_rstd = head_norm(q_pre, q_norm_weight, options) if qk_norm else (q_pre, None)
            q_rotated = _rotated(q_in, rope, table_row + start)
            del q_in
            dout_tile = without_empty_queries(dout[entry:entry + 1, start:end],
                                              None if empty is None else empty[entry:entry + 1, start:end])
            if dout_tile.stride(-1) != 1:
                dout_tile = dout_tile.contiguous()
            o_tile = o[entry:entry + 1, start:end]
            # lse: [B, Hq, N], or [Hq, T] for a packed row.
            lse_tile = (lse[:, start:end] if starts is not None else lse[entry:entry + 1, :, start:end]).contiguous()
            scalars = (attention.scale, attention.softcap, left, 0, 0.0, attention.deterministic)
            if split_causal:
                dq, dk, dv = core.attention_bwd(dout_tile, q_rotated, k_rotated[:, start:end], v_row[:, start:end],
                                                o_tile, lse_tile, None, None, None, *scalars)
                dk_sum[:, start:end] += dk
                dv_sum[:, start:end] += dv
                if start:
                    unmasked = (attention.scale, attention.softcap, -1, -1, 0.0, attention.deterministic)
                    dq_prefix, dk, dv = core.attention_bwd(dout_tile, q_rotated, k_rotated[:, :start],
                                                           v_row[:, :start], o_tile, lse_tile, None, None, None,
                                                           *unmasked)
                    dk_sum[:, :start] += dk
                    dv_sum[:, :start] += dv
                    dq = (dq.float() + dq_prefix.float()).to(dq.dtype)
                    del dq_prefix
            elif packed_calls is not None:
                first_key, cu_q, cu_k, max_q, max_k = packed_calls[start]
                dq, dk, dv = core.attention_varlen_bwd(
                    dout_tile[0], q_rotated[0], k_rotated[0, first_key:end], v_row[0, first_key:end], o_tile[0],
                    lse_tile, cu_q, cu_k, max_q, max_k, None, None, None, *scalars)
                dq = dq[None]
                dk_sum[0, first_key:end] += dk
                dv_sum[0, first_key:end] += dv
            else:
                # Keys [first_key, end): under a window, the earliest key the tile's first query sees.
                first_key = max(0, start - left) if left >= 0 else 0
                dq, dk, dv = core.attention_bwd(dout_tile, q_rotated, k_rotated[:, first_key:end],
                                                v_row[:, first_key:end], o_tile, lse_tile, None, None, None, *scalars)
                dk_sum[:, first_key:end] += dk
                dv_sum[:, first_key:end] += dv
            del dk, dv, q_rotated, dout_tile, o_tile, lse_tile
            # Keys [start, end) have all their gradient now: finish the tile's whole backward.
            dq = _rotated(dq, rope, table_row + start, inverse=True)
            # The summed dk is rotated back in fp32 and rounded once (the untiled path rounds the core's
            # dk, then the rotation's result): the tiles' partial sums carry one rounding each already.
            dk = _rotated(dk_sum[:, start:end], rope, table_row + start, inverse=True)
            dv = dv_sum[:, start:end].to(x.dtype)
            if qk_norm:
                # The per-head norms' backward runs in fp32 on the tile: their weight gradients are
                # sums over every token and head that nearly cancel, and each tile's part would
                # otherwise be rounded to the weight's dtype before the fp32 sum.
                dq, d_q_norm = head_norm_backward(dq.float(), q_pre.float(), _fp32(q_norm_weight), q_rstd, options)
                k_tile = k_pre[:, start:end]
                _, k_rstd = head_norm(k_tile, k_norm_weight, options)
                dk, d_k_norm = head_norm_backward(dk, k_tile.float(), _fp32(k_norm_weight), k_rstd, options)
                sums.add(9, d_q_norm if need[9] else None)
                sums.add(10, d_k_norm if need[10] else None)
                dq = dq.to(x.dtype)
                del k_tile, k_rstd
            dk = dk.to(x.dtype)
            del q_pre
            d_normed = None
            for target, grad in enumerate((dq, dk, dv)):
                grad = grad.reshape(end - start, -1)
                d_in = grad @ weights[target]
                if need[3 + target]:
                    sums.add(3 + target, grad.t() @ normed)
                if need[6 + target] and biases[target] is not None:
                    sums.add(6 + target, grad.sum(0, dtype=torch.float32))
                d_lora, target_grads = lora.branch_grads(grad, normed, target, *adapters[:3], lora_needs,
                                                         adapters[3], row_offset=first)
                if d_lora is not None:
                    d_in += d_lora
                    del d_lora
                for key, g in target_grads.items():
                    sums.add(first_lora_input + key, g)
                d_normed = d_in if d_normed is None else d_normed.add_(d_in)
                del d_in
            del dq, dk, dv, normed
            dx_tile, d_norm_weight, d_norm_bias = norm_backward(
                d_normed.contiguous(), rows[first:last], norm_weight, None if mean is None else mean[first:last],
                rstd[first:last], options.norm, norm_bias is not None, options.norm_backend)
            dx.view(batch * n, hidden)[first:last] = dx_tile
            sums.add(1, d_norm_weight if need[1] else None)
            sums.add(2, d_norm_bias if need[2] else None)
            del d_normed, dx_tile
        del dk_sum, dv_sum, k_rotated, v_row
    inputs = (x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k, b_v, q_norm_weight, k_norm_weight)
    grads = [dx if need[0] else None] + [sums.result(i, inputs[i]) for i in range(1, 11)]
    lora_grads = [sums.result(first_lora_input + i, t) if t is not None else None for i, t in enumerate(lora_tensors)]
    return (*grads, None, None, None, None, None, None, None, None, *lora_grads)
