"""Triton Philox dropout: y = keep ? x / (1 - p) : 0 with keep(i) = (uniform of word i % 4 of
Philox4x32-10 at counter offset + i // 4) >= p: the stream of csrc/common/philox.h and
remat.reference.dropout_keep (one row of n elements), so the mask is never stored: the backward
applies the same kernel to dy. One tl.randint4x call per four elements, all four words used. The
seed and offset are read on the device from the int64 rng = [seed, offset] tensor. x is
contiguous; the division is IEEE (div_rn), done in fp32 and rounded once, as the C++ and CUDA
kernels and the torch backend do.
"""

import torch
import triton
import triton.language as tl

from ._common import _INTERPRETED, _round

# 1024 elements per program (256 Philox calls): 8 elements, 2 calls per thread at 4 warps. A
# multiple of 4, so every program starts at a group of four.
_BLOCK = 1024
_NUM_WARPS = 4


@triton.jit
def _philox_dropout_kernel(x_ptr, y_ptr, rng_ptr, n_elements, p, keep_divisor, BLOCK: tl.constexpr,
                           INTERPRETED: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = offsets < n_elements
    seed = tl.load(rng_ptr)
    counters = tl.load(rng_ptr + 1) + start // 4 + tl.arange(0, BLOCK // 4).to(tl.int64)
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    # tl.join(tl.join(w0, w2), tl.join(w1, w3)) is [BLOCK / 4, 2, 2] with word 2 * a + b at
    # [g, a, b], so the row-major reshape puts element 4 * g + w at word w of call g.
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK])
    keep = tl.random.uint_to_uniform_float(words) >= p
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(keep, tl.math.div_rn(x, keep_divisor), 0.0)
    tl.store(y_ptr + offsets, _round(y, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


def philox_dropout(x, rng, p):
    """y = x * keep / (1 - p) for contiguous x (fp32/fp16/bf16) and rng int64 [2] on x's device."""
    if not x.is_contiguous() or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be a contiguous float32/float16/bfloat16 tensor, got {x.dtype}")
    if rng.shape != (2,) or rng.dtype != torch.int64 or rng.device != x.device:
        raise ValueError("rng must be an int64 [2] = (seed, offset) tensor on x's device")
    if not 0 <= p < 1:
        raise ValueError(f"p must be in [0, 1), got {p}")
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _philox_dropout_kernel[(triton.cdiv(n, _BLOCK),)](
            x, y, rng, n, float(p), float(1.0 - p), BLOCK=_BLOCK, INTERPRETED=_INTERPRETED,
            num_warps=_NUM_WARPS)
    return y


def aot_specs():
    """(name, kernel, signature, constexprs, num_warps) for the ahead-of-time compile test: one
    spec per dtype."""
    for type_name in ("fp32", "fp16", "bf16"):
        element = f"*{type_name}"
        signature = {"x_ptr": element, "y_ptr": element, "rng_ptr": "*i64", "n_elements": "i64",
                     "p": "fp32", "keep_divisor": "fp32", "BLOCK": "constexpr",
                     "INTERPRETED": "constexpr"}
        yield (f"philox_dropout-{type_name}", _philox_dropout_kernel, signature,
               {"BLOCK": _BLOCK, "INTERPRETED": False}, _NUM_WARPS)
