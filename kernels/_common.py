"""Helpers every Triton kernel module shares: rounding to the storage dtype, the dot, and whether
the kernels run under the interpreter.

Known interpreter gaps these helpers work around (DESIGN.md section 7), so the kernels' bf16 paths
stay testable on the CPU; the compiled paths are covered by the ahead-of-time compile
(tests/test_triton_aot.py) and by the GPU tests:
- Triton 3.8's interpreter truncates fp32 -> bf16 casts (compiled code rounds to nearest even):
  `_round` rounds on the bits instead when INTERPRETED;
- it multiplies bf16 `tl.dot` operands as raw bit patterns (triton-lang/triton#11584): `_dot`
  upcasts them to fp32 first when INTERPRETED.
Kernels take INTERPRETED as a constexpr, and launchers pass `_INTERPRETED`.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _round(value, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 value rounded to nearest-even in dtype.

    The Triton 3.8 interpreter truncates fp32 -> bf16 casts (compiled code rounds to nearest
    even), so interpreted bf16 rounding is done on the bits instead, to keep the CPU tests exact.
    """
    if INTERPRETED and dtype == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        rounded = value.to(dtype)
    return rounded


@triton.jit
def _round_to_tf32(value):
    """fp32 value rounded to nearest-even on TF32's 10 mantissa bits (the low 13 bits zeroed);
    inf and NaN pass unchanged.

    Compiled TF32 dots drop the low 13 bits of each fp32 operand (truncation, triton-lang/triton
    #4574), which on an H200 put the Triton GEMM and attention outputs at 2.3-2.6x the error of
    cuBLAS's TF32 matmul (which rounds); rounding first makes the dropped bits zero. Under the
    interpreter, whose fp32 dot is IEEE, it makes the products those of TF32 operands (exact in
    fp32), so the CPU tests see TF32 numerics too.
    """
    bits = value.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0xFFF + ((bits >> 13) & 1)) >> 13) << 13
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded, bits).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr, TF32: tl.constexpr = False):
    """acc + a @ b, accumulated in fp32: a [BLOCK_M, BLOCK_K], b [BLOCK_K, BLOCK_N], acc fp32.

    Under the interpreter (INTERPRETED), bf16 operands are upcast to fp32 first: Triton 3.8's
    interpreter multiplies bf16 dots as raw bit patterns (triton-lang/triton#11584). bf16
    products are exact in fp32, so only the summation order can differ from the compiled dot.
    Compiled code multiplies bf16/fp16 natively on tensor cores. fp32 operands use IEEE products
    unless TF32 (the launcher passes `allow_tf32()`, PyTorch's fp32 matmul setting): then both
    operands are rounded to nearest-even TF32 first (`_round_to_tf32`), compiled and interpreted.
    IEEE fp32 dots sum each call's products apart from acc and add them after (two-level
    summation, see below).
    """
    if INTERPRETED and a.dtype == tl.bfloat16:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif a.dtype == tl.float32 and TF32:
        result = tl.dot(_round_to_tf32(a), _round_to_tf32(b), acc, input_precision="tf32")
    elif a.dtype == tl.float32:
        # Two-level summation: this step's products are summed from zero, then added to the
        # running sum, so the fp32 rounding chain is one tile deep plus one add per step instead
        # of the whole K (H200, a K = 1000 GEMM: max error 7.1e-6 against float64, cuBLAS 1.4e-6;
        # CPU emulation of the two: 5.9e-6 and 1.0e-6 at BLOCK_K 32). The zero is "acc where acc is
        # NaN, else 0" (NaN stays NaN either way): a constant zero would be folded back, since
        # Triton's combine pass rewrites addf(dot(a, b, 0), acc) as dot(a, b, acc).
        fresh = tl.where(acc != acc, acc, 0.0)
        result = acc + tl.dot(a, b, fresh, input_precision="ieee")
    else:
        result = tl.dot(a, b, acc)
    return result


def allow_tf32():
    """Whether fp32 Triton dots may round their operands to TF32: PyTorch's setting for fp32
    matmuls on CUDA (``torch.backends.cuda.matmul.allow_tf32``, which
    ``torch.set_float32_matmul_precision("high")`` also turns on). Off by default, as in PyTorch.
    Launchers read it per call and pass it as the TF32 constexpr (a compile-time variant)."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


# True when TRITON_INTERPRET=1 was set before the kernels were imported: `@triton.jit` then makes
# interpreter objects, not JITFunctions, and every kernel module (each imports this one) is in
# the same state.
_INTERPRETED = not isinstance(_round, triton.runtime.JITFunction)
