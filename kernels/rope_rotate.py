"""Triton rotary embedding applied once to a whole q or k tensor (remat.ops.rope states the
contract): one read of x and of its tokens' cos/sin rows, one write of the rotated tensor in x's
dtype. It replaces the chain of PyTorch ops (upcast, four products, two sums, cat, rounding) that
rotated q and k around the attention cores, each a full pass over an fp32 temporary.

Rounding: each product and each sum is rounded to fp32 separately, and the result once to the
dtype, as PyTorch's ``x1 * c - x2 * s`` does: the kernel is launched with ``enable_fp_fusion=False``,
so no product is contracted into an FMA (the AOT test checks the PTX has none), and the rotation is
bitwise equal to PyTorch's on the same inputs, on every GPU and under the interpreter.
"""

import torch
import triton
import triton.language as tl

from ._common import _INTERPRETED, _round

# Elements of one half-rotation per program step: BLOCK_T tokens x HALF_PAD pairs. 1024 pairs
# (2048 elements of x, 8 pairs per thread at 4 warps) keep each load 16-byte vectorised for fp32
# and 8-byte for bf16 while the table rows stay in registers across the head loop.
_PAIRS_PER_STEP = 1024
_NUM_WARPS = 4


@triton.jit
def _rope_rotate_kernel(x_ptr, cos_ptr, sin_ptr, rows_ptr, y_ptr, tokens, length, heads, half, stride_xb, stride_xl,
                        stride_xh, first_position, table_batch_stride, HAS_ROWS: tl.constexpr,
                        INVERSE: tl.constexpr, BLOCK_T: tl.constexpr, HALF_PAD: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    """One program: BLOCK_T tokens (flat index t = b * length + l) and every head. The table row of
    token (b, l) is rows[t] with HAS_ROWS, else b * table_batch_stride + first_position + l; it is
    loaded once and reused for all heads. y is contiguous [tokens, heads, 2 * half]."""
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    pair = tl.arange(0, HALF_PAD)
    token_ok = token < tokens
    mask = token_ok[:, None] & (pair < half)[None, :]
    batch, position = token // length, token % length
    if HAS_ROWS:
        row = tl.load(rows_ptr + token, mask=token_ok, other=0)
    else:
        row = batch * table_batch_stride + first_position + position
    table = row[:, None] * half + pair[None, :]
    c = tl.load(cos_ptr + table, mask=mask, other=0.0)
    s = tl.load(sin_ptr + table, mask=mask, other=0.0)
    # Element offsets of each token's current head, int64 and advanced per head (a product
    # head * stride_xh could wrap int32: heads-first storage seen as [B, L, H, D] has stride_xh = L * D).
    x_head = batch * stride_xb + position * stride_xl
    y_head = token * heads * (2 * half)
    for _ in range(heads):
        x_first = x_ptr + x_head[:, None] + pair[None, :]
        x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_first + half, mask=mask, other=0.0).to(tl.float32)
        if INVERSE:
            y1 = x1 * c + x2 * s
            y2 = x2 * c - x1 * s
        else:
            y1 = x1 * c - x2 * s
            y2 = x2 * c + x1 * s
        y_first = y_ptr + y_head[:, None] + pair[None, :]
        tl.store(y_first, _round(y1, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        tl.store(y_first + half, _round(y2, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        x_head += stride_xh
        y_head += 2 * half


def _tile(half):
    """(BLOCK_T, HALF_PAD) for pairs of length ``half`` (D / 2)."""
    half_pad = triton.next_power_of_2(half)
    return max(1, _PAIRS_PER_STEP // half_pad), half_pad


def rope_rotate(x, cos, sin, rows, first_position, table_batch_stride, inverse):
    """The launcher of remat.ops.rope.rope_rotate (arguments checked there): y contiguous
    [B, L, H, D] in x's dtype."""
    batch, length, heads, head_dim = x.shape
    y = torch.empty((batch, length, heads, head_dim), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    tokens = batch * length
    block_t, half_pad = _tile(head_dim // 2)
    _rope_rotate_kernel[(triton.cdiv(tokens, block_t),)](
        x, cos, sin, rows if rows is not None else cos, y, tokens, length, heads, head_dim // 2, x.stride(0),
        x.stride(1), x.stride(2), first_position, table_batch_stride, HAS_ROWS=rows is not None, INVERSE=inverse,
        BLOCK_T=block_t, HALF_PAD=half_pad, INTERPRETED=_INTERPRETED, num_warps=_NUM_WARPS, enable_fp_fusion=False)
    return y


def _aot_cases():
    """(dtype, head dim, has_rows, inverse): every dtype at a power-of-two and a padded head dim,
    dense rows forward and per-token rows inverse (the two ways the rope path uses it), plus the
    other two pairings once."""
    for type_name in ("fp32", "fp16", "bf16"):
        for head_dim in (80, 128):
            yield type_name, head_dim, False, False
            yield type_name, head_dim, True, True
    yield "bf16", 128, False, True
    yield "bf16", 128, True, False


def aot_specs():
    """(name, kernel, signature, constexprs, num_warps, options) for the ahead-of-time compile test,
    compiled as the launcher runs it: enable_fp_fusion off, and the sizes and strides 32-bit, as
    the JIT specializes them below 2^31 (the int64 index math is in the kernel either way)."""
    for type_name, head_dim, has_rows, inverse in _aot_cases():
        block_t, half_pad = _tile(head_dim // 2)
        signature = {"x_ptr": f"*{type_name}", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                     "rows_ptr": "*i64" if has_rows else "*fp32", "y_ptr": f"*{type_name}", "tokens": "i32",
                     "length": "i32", "heads": "i32", "half": "i32", "stride_xb": "i32", "stride_xl": "i32",
                     "stride_xh": "i32", "first_position": "i32", "table_batch_stride": "i32",
                     "HAS_ROWS": "constexpr", "INVERSE": "constexpr", "BLOCK_T": "constexpr",
                     "HALF_PAD": "constexpr", "INTERPRETED": "constexpr"}
        constexprs = {"HAS_ROWS": has_rows, "INVERSE": inverse, "BLOCK_T": block_t, "HALF_PAD": half_pad,
                      "INTERPRETED": False}
        kind = f"{'rows' if has_rows else 'dense'}-{'inverse' if inverse else 'forward'}"
        name = f"rope_rotate-{type_name}-d{head_dim}-{kind}"
        yield name, _rope_rotate_kernel, signature, constexprs, _NUM_WARPS, {"enable_fp_fusion": False}
