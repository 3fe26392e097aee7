"""Triton linear + cross-entropy that never stores the [tokens, vocab] logits.

Forward (`_lce_fwd_kernel`): a GEMM x W^T whose epilogue is an online softmax. Program (m, s)
owns BLOCK_M tokens and the s-th of SPLITS contiguous vocabulary ranges; it walks its range in
BLOCK_N tiles, computes each logits tile in registers (fp32 accumulation over H in BLOCK_K steps,
+ bias in fp32, rounded to x's dtype as F.linear stores logits, up-cast, capped), and folds it
into per-token running statistics (max, sum of exp, sum of logits, the target's logit). The
partials [4, SPLITS, T] are merged by the launcher (a logsumexp over SPLITS values per token). No
logits tile ever leaves registers. SPLITS gives the GPU enough programs when T is small.

Backward, per vocabulary chunk of C columns (the chunk rule of remat.autograd.cross_entropy):
`_lce_dlogits_kernel` recomputes the chunk's logits tile by tile exactly as the forward does and
writes their gradient dz, rounded to x's dtype (where autograd's cast of the fp32 logits rounds
it), into one [T, C] buffer, the only chunk-sized tensor; then `_matmul_kernel` forms the chunk's
dW rows = dz^T x (one GEMM over all tokens, rounded once, as F.linear's backward) and adds
dz W_chunk into an fp32 [T, H] accumulator of dx (rounded once after the last chunk, as one GEMM
over the whole vocabulary; with a single chunk, that GEMM writes dx in x's dtype directly). Both
GEMMs read dz in place through strides (no transpose copy); db is the chunk's column sum. No
atomics: every output element is written by one program, and the chunks run in order, so results
are deterministic.

Rounding points and arithmetic order are those of remat.ops.cross_entropy's torch backend (which
F.linear + F.cross_entropy computes): logits rounded to x's dtype, softmax and gradient in fp32,
dz rounded to x's dtype. `_round` and `_dot` are kernels/_common.py's (interpreter-safe bf16);
`_tanh` is the attention kernels' (Triton has tanh only in libdevice, which the interpreter cannot
run); `_tile_indices` and the GEMM tiles are kernels/matmul.py's.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import _INTERPRETED, _dot, _round
from .attention.logits import _tanh
from .matmul import _tile_indices, glu_matmul_config


class Tiles(NamedTuple):
    """Tile sizes and launch options of the logits kernels."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The logits kernels hold one fp32 accumulator tile and its softmax terms. Measured with
# cuobjdump -res-usage on the sm_80 / sm_90 builds of aot_specs() (softcap and bias on, the most
# registers): 16-bit, 128 x 64 tiles with BLOCK_K 64 (kernels/matmul.py's GEMM tile) spill in the
# forward (255 registers and a 96-112 byte stack frame), BLOCK_K 32 does not (252-255 registers
# forward, 197-214 dlogits, no stack); 64 x 64 x 32 over 4 warps for at most 64 tokens does not
# either. fp32 (IEEE dot on the FMA units): 64 x 64 x 16 over 8 warps, 128-194 registers, no stack;
# 128 rows spill.
_LARGE_16BIT = Tiles(128, 64, 32, 8, 3)
_SMALL_16BIT = Tiles(64, 64, 32, 4, 3)
_FP32 = Tiles(64, 64, 16, 8, 3)
# Forward programs aimed at per SM (splitting the vocabulary when T alone gives too few).
_PROGRAMS_PER_SM = 2
# Vocabulary splits under the interpreter (programs run one after another on the CPU): a few, so
# the merge of partial statistics is exercised.
_CPU_SPLITS = 3


def logits_tiles(tokens, dtype):
    """Tiles of the forward and dlogits kernels for T = tokens and x's dtype."""
    if dtype == torch.float32:
        return _FP32
    return _LARGE_16BIT if tokens > 64 else _SMALL_16BIT


@triton.jit
def _logits_tile(x_ptr, w_ptr, bias_ptr, rows, cols, T, col_end, H, x_row_stride, w_row_stride, w_col_stride,
                 softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_K: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """(z, tanh term), fp32 [BLOCK_M, BLOCK_N], for tokens `rows` and vocabulary columns `cols`
    (global indices; columns at or past col_end and rows at or past T load zeros): z = x W^T
    accumulated in fp32, + bias in fp32, rounded to x's dtype (F.linear's output), up-cast, then
    softcap * tanh(z / softcap) with SOFTCAP. The tanh term is returned for the derivative (z
    itself, unused, without SOFTCAP)."""
    dtype = x_ptr.dtype.element_ty
    row_mask = rows < T
    col_mask = cols < col_end
    # 64-bit before the multiplies: row * stride and col * stride can pass 2^31.
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * w_row_stride
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    for k_start in range(0, H, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        a = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_cols + ks.to(tl.int64)[:, None] * w_col_stride, mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0)
        acc = _dot(a, b, acc, INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    z = _round(acc, dtype, INTERPRETED).to(tl.float32)
    th = z
    if SOFTCAP:
        th = _tanh(tl.math.div_rn(z, softcap))
        z = th * softcap
    return z, th


@triton.jit
def _lce_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, target_ptr, partial_ptr,
    T, V, H, x_row_stride, w_row_stride, w_col_stride, cols_per_split, softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Program (m, s): tokens m*BLOCK_M.., vocabulary [s * cols_per_split, (s + 1) * cols_per_split)
    clipped to V. Writes its running max, sum of exp(z - max), sum of z and target logit (0 when
    the target is not in its range) to partial[0..3, s, rows]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    row_mask = rows < T
    target = tl.load(target_ptr + rows, mask=row_mask, other=-1)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    sum_exp = tl.zeros([BLOCK_M], dtype=tl.float32)
    sum_z = tl.zeros([BLOCK_M], dtype=tl.float32)
    z_target = tl.zeros([BLOCK_M], dtype=tl.float32)
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, V)
    for n_start in range(start, end, BLOCK_N):
        cols = n_start + tl.arange(0, BLOCK_N)
        z, _ = _logits_tile(x_ptr, w_ptr, bias_ptr, rows, cols, T, end, H, x_row_stride, w_row_stride,
                            w_col_stride, softcap, HAS_BIAS, SOFTCAP, BLOCK_K, INTERPRETED)
        inside = (cols < end)[None, :]
        masked = tl.where(inside, z, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(masked, axis=1))
        sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(masked - new_max[:, None]), axis=1)
        row_max = new_max
        sum_z += tl.sum(tl.where(inside, z, 0.0), axis=1)
        z_target += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
    plane = tl.num_programs(1).to(tl.int64) * T
    offsets = split.to(tl.int64) * T + rows
    tl.store(partial_ptr + offsets, row_max, mask=row_mask)
    tl.store(partial_ptr + plane + offsets, sum_exp, mask=row_mask)
    tl.store(partial_ptr + 2 * plane + offsets, sum_z, mask=row_mask)
    tl.store(partial_ptr + 3 * plane + offsets, z_target, mask=row_mask)


@triton.jit
def _lce_dlogits_kernel(
    x_ptr, w_ptr, bias_ptr, target_ptr, lse_ptr, scale_ptr, smooth_ptr, hit_ptr, dz_ptr,
    T, col_start, col_end, H, x_row_stride, w_row_stride, w_col_stride, softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of the chunk [col_start, col_end): the logits recomputed as the
    forward computes them, then dz = p * scale - smooth - hit [j == target] (times 1 - tanh^2
    with SOFTCAP), p = exp(z - lse), rounded to x's dtype into dz [T, col_end - col_start]. The
    per-token fp32 terms come from the launcher: scale = g (1 + 2 z_loss lse) + grad_lse,
    smooth = g eps / V, hit = g (1 - eps), g the token's loss gradient (0 if ignored)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_start + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < T
    z, th = _logits_tile(x_ptr, w_ptr, bias_ptr, rows, cols, T, col_end, H, x_row_stride, w_row_stride,
                         w_col_stride, softcap, HAS_BIAS, SOFTCAP, BLOCK_K, INTERPRETED)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    smooth = tl.load(smooth_ptr + rows, mask=row_mask, other=0.0)
    hit = tl.load(hit_ptr + rows, mask=row_mask, other=0.0)
    target = tl.load(target_ptr + rows, mask=row_mask, other=-1)
    dz = tl.exp(z - lse[:, None]) * scale[:, None]
    dz = dz - smooth[:, None]
    dz = dz - tl.where(cols[None, :] == target[:, None], hit[:, None], 0.0)
    if SOFTCAP:
        dz = dz * (1.0 - th * th)
    width = col_end - col_start
    offsets = rows.to(tl.int64)[:, None] * width + (cols - col_start)[None, :]
    mask = row_mask[:, None] & (cols < col_end)[None, :]
    tl.store(dz_ptr + offsets, _round(dz, dz_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """C [M, N] (+)= A [M, K] @ B [K, N], any strides for A and B (C has unit column stride),
    accumulated in fp32; with ACCUMULATE, C (fp32) is read and the product added in fp32. The
    result is rounded once to C's dtype."""
    rows, cols = _tile_indices(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    row_mask = rows < M
    col_mask = cols < N
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = (k_start + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_mask = ks < K
        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None] * stride_bk, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(a, b, acc, INTERPRETED)
    offsets = rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptr + offsets, mask=mask, other=0.0)
    tl.store(c_ptr + offsets, _round(acc, c_ptr.dtype.element_ty, INTERPRETED), mask=mask)


def _matmul(a, b, c, accumulate):
    """c (+)= a @ b for 2-D views a [M, K], b [K, N] (any strides) and c [M, N] (unit column
    stride), with kernels/matmul.py's tiles for the shape and a's dtype."""
    n_rows, n_inner = a.shape
    n_cols = b.shape[1]
    if n_rows == 0 or n_cols == 0:
        return
    config = glu_matmul_config(n_rows, n_cols, n_inner, a.dtype)
    grid = (triton.cdiv(n_rows, config.block_m) * triton.cdiv(n_cols, config.block_n),)
    _matmul_kernel[grid](
        a, b, c, n_rows, n_cols, n_inner, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        ACCUMULATE=accumulate, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, INTERPRETED=_INTERPRETED, num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _check(x, weight, bias, target):
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x: expected [T, H] with unit column stride, got shape {tuple(x.shape)} and strides "
                         f"{tuple(x.stride())}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.dtype != x.dtype:
        raise ValueError(f"weight: expected [V, {x.shape[1]}] of {x.dtype}, got {tuple(weight.shape)} of "
                         f"{weight.dtype}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias: expected [{weight.shape[0]}] of {x.dtype}, got {tuple(bias.shape)} of {bias.dtype}")
    if tuple(target.shape) != (x.shape[0],) or target.dtype != torch.int64:
        raise ValueError(f"target: expected int64 [{x.shape[0]}], got {tuple(target.shape)} of {target.dtype}")


def _splits(tokens, vocab, tiles, device):
    """(splits, columns per split): enough programs for the GPU, each split a whole number of
    BLOCK_N tiles, none empty."""
    n_tiles = triton.cdiv(vocab, tiles.block_n)
    if device.type == "cuda":
        target = torch.cuda.get_device_properties(device).multi_processor_count * _PROGRAMS_PER_SM
        splits = triton.cdiv(target, triton.cdiv(max(tokens, 1), tiles.block_m))
    else:
        splits = _CPU_SPLITS
    splits = max(1, min(splits, n_tiles))
    columns = triton.cdiv(n_tiles, splits) * tiles.block_n
    return triton.cdiv(vocab, columns), columns


def linear_cross_entropy_fwd(x, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss):
    """Per-token loss and lse, fp32 [T] each, without storing logits (see the module docstring
    and remat.ops.cross_entropy for the arguments and the formula)."""
    _check(x, weight, bias, target)
    tokens, hidden = x.shape
    vocab = weight.shape[0]
    tiles = logits_tiles(tokens, x.dtype)
    splits, columns = _splits(tokens, vocab, tiles, x.device)
    partial = torch.empty((4, splits, tokens), dtype=torch.float32, device=x.device)
    target = target.contiguous()
    if tokens > 0:
        grid = (triton.cdiv(tokens, tiles.block_m), splits)
        _lce_fwd_kernel[grid](
            x, weight, bias if bias is not None else x, target, partial,
            tokens, vocab, hidden, x.stride(0), weight.stride(0), weight.stride(1), columns, float(softcap),
            HAS_BIAS=bias is not None, SOFTCAP=softcap > 0, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, INTERPRETED=_INTERPRETED, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    row_max, sum_exp, sum_z, z_target = partial
    top = row_max.amax(dim=0)
    lse = top + torch.log((sum_exp * torch.exp(row_max - top)).sum(dim=0))
    loss = lse - (1.0 - label_smoothing) * z_target.sum(dim=0)
    if label_smoothing > 0:
        loss = loss - (label_smoothing / vocab) * sum_z.sum(dim=0)
    if z_loss > 0:
        loss = loss + z_loss * lse * lse
    return torch.where(target != ignore_index, loss, 0.0), lse


def linear_cross_entropy_bwd(x, weight, bias, target, lse, grad_loss, grad_lse, ignore_index, label_smoothing,
                             softcap, z_loss, chunk, need_dx, need_dw, need_db):
    """(dx, dw, db) chunk by chunk (see the module docstring and remat.ops.cross_entropy)."""
    _check(x, weight, bias, target)
    tokens, hidden = x.shape
    vocab = weight.shape[0]
    target = target.contiguous()
    g = torch.where(target != ignore_index, grad_loss, 0.0)
    scale = g * (1.0 + 2.0 * z_loss * lse) if z_loss > 0 else g
    if grad_lse is not None:
        scale = scale + grad_lse
    scale = scale.contiguous()
    smooth = g * (label_smoothing / vocab)
    hit = g * (1.0 - label_smoothing)
    lse = lse.contiguous()
    chunk = max(1, min(int(chunk), vocab))
    # One chunk: dx is one GEMM rounded once to x's dtype; several: an fp32 sum rounded at the end.
    one_chunk = chunk == vocab
    dx_acc = dx = None
    if need_dx and one_chunk:
        dx = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    elif need_dx:
        dx_acc = torch.zeros((tokens, hidden), dtype=torch.float32, device=x.device)
    dw = torch.empty((vocab, hidden), dtype=weight.dtype, device=x.device) if need_dw else weight.new_empty(0)
    db = torch.empty(vocab, dtype=bias.dtype, device=x.device) if need_db else x.new_empty(0)
    buffer = torch.empty(tokens * chunk, dtype=x.dtype, device=x.device)
    tiles = logits_tiles(tokens, x.dtype)
    for start in range(0, vocab, chunk):
        end = min(vocab, start + chunk)
        dz = buffer[: tokens * (end - start)].view(tokens, end - start)
        if tokens > 0:
            grid = (triton.cdiv(tokens, tiles.block_m), triton.cdiv(end - start, tiles.block_n))
            _lce_dlogits_kernel[grid](
                x, weight, bias if bias is not None else x, target, lse, scale, smooth, hit, dz,
                tokens, start, end, hidden, x.stride(0), weight.stride(0), weight.stride(1), float(softcap),
                HAS_BIAS=bias is not None, SOFTCAP=softcap > 0, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                BLOCK_K=tiles.block_k, INTERPRETED=_INTERPRETED, num_warps=tiles.num_warps,
                num_stages=tiles.num_stages,
            )
        if need_dw:
            _matmul(dz.t(), x, dw[start:end], accumulate=False)
        if need_db:
            torch.sum(dz, dim=0, out=db[start:end])
        if need_dx and tokens > 0:
            _matmul(dz, weight[start:end], dx if one_chunk else dx_acc, accumulate=not one_chunk)
    if dx_acc is not None:
        dx = dx_acc.to(x.dtype)
    return (dx if need_dx else x.new_empty(0)), dw, db


def aot_specs():
    """Yield (name, kernel, signature, constexprs, num_warps) for ahead-of-time compile checks.

    `signature` and `constexprs` are in the form `triton.compiler.ASTSource` takes. Names:
    'lce_<fwd|dlogits>-<dtype>-<plain|bias_softcap>' for the logits kernels (the many-token tiles
    for bf16 and fp16, both variants for bf16; the fp32 tiles) and
    'lce_matmul-<dtype>-<dw|dx_accumulate>' for the GEMM, with the tiles glu_matmul_config picks
    for a 4096-sized launch (dW: 16-bit output; dx: fp32 accumulator).
    """
    cases = [("bf16", torch.bfloat16, False), ("bf16", torch.bfloat16, True), ("fp16", torch.float16, True),
             ("fp32", torch.float32, True)]
    for type_name, dtype, with_options in cases:
        tiles = logits_tiles(4096, dtype)
        element = f"*{type_name}"
        common = dict(HAS_BIAS=with_options, SOFTCAP=with_options, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                      BLOCK_K=tiles.block_k, INTERPRETED=False)
        variant = "bias_softcap" if with_options else "plain"
        fwd = {"x_ptr": element, "w_ptr": element, "bias_ptr": element, "target_ptr": "*i64",
               "partial_ptr": "*fp32", "T": "i32", "V": "i32", "H": "i32", "x_row_stride": "i64",
               "w_row_stride": "i64", "w_col_stride": "i64", "cols_per_split": "i32", "softcap": "fp32"}
        dlogits = {"x_ptr": element, "w_ptr": element, "bias_ptr": element, "target_ptr": "*i64",
                   "lse_ptr": "*fp32", "scale_ptr": "*fp32", "smooth_ptr": "*fp32", "hit_ptr": "*fp32",
                   "dz_ptr": element, "T": "i32", "col_start": "i32", "col_end": "i32", "H": "i32",
                   "x_row_stride": "i64", "w_row_stride": "i64", "w_col_stride": "i64", "softcap": "fp32"}
        for name, kernel, signature in (("fwd", _lce_fwd_kernel, fwd), ("dlogits", _lce_dlogits_kernel, dlogits)):
            yield (f"lce_{name}-{type_name}-{variant}", kernel, dict(signature, **dict.fromkeys(common, "constexpr")),
                   common, tiles.num_warps)
    for type_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        config = glu_matmul_config(4096, 4096, 4096, dtype)
        element = f"*{type_name}"
        for name, output, accumulate in (("dw", element, False), ("dx_accumulate", "*fp32", True)):
            constexprs = dict(ACCUMULATE=accumulate, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                              BLOCK_K=config.block_k, GROUP_M=config.group_m, INTERPRETED=False)
            signature = {"a_ptr": element, "b_ptr": element, "c_ptr": output, "M": "i32", "N": "i32", "K": "i32",
                         "stride_am": "i64", "stride_ak": "i64", "stride_bk": "i64", "stride_bn": "i64",
                         "stride_cm": "i64"}
            signature.update(dict.fromkeys(constexprs, "constexpr"))
            yield f"lce_matmul-{type_name}-{name}", _matmul_kernel, signature, constexprs, config.num_warps
