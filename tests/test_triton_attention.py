"""The Triton attention backend at head dims below one tile (D 1, 2, 3, 8, 15: the kernels pad
D to BLOCK_D = 16 columns and mask the rest) against a float64 eager reference, under the
2x-stock-PyTorch rule (DESIGN.md section 7): forward and dq, dk, dv, fp32 and bf16, plain,
causal with GQA and N != M, and RoPE (even D, the halves padded to BLOCK_H = 16), with the
deterministic backward and the fast one (atomic dq, then the rotate-and-cast pass).

Runs remat.attention(..., backend="triton") on CPU tensors under TRITON_INTERPRET=1 (tiny
shapes), or on a CUDA GPU without it.
"""

import contextlib
import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA GPU; neither is here",
                allow_module_level=True)
pytest.importorskip("triton")

import remat  # noqa: E402
from remat.reference import attention_reference  # noqa: E402

from _checks import assert_within_2x_of_stock  # noqa: E402
from helpers import deterministic_mode  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEAD_DIMS = (1, 2, 3, 8, 15)
# One draw for every case (the first; not chosen to pass). The backward's Delta = rowsum(dout * o)
# reads the stored o, rounded to the dtype (FlashAttention's rounding point; stock PyTorch's softmax
# backward sums P * dP instead). Over draws 0-39 of the D = 1 bf16 causal case, that rounding took
# draws 0 and 1 past the 2x rule on dq or dk (an fp64 emulation of the kernel's arithmetic with
# Delta from the rounded o reproduces those errors exactly; without that rounding they are inside
# the rule): an open finding, recorded below as a strict expected failure.
SEED = 0
ROUNDED_DELTA_EXCEEDS = {(1, "n17-m20-gqa2-causal-fast", "bf16")}
# name: (N, M, Hq, Hkv, causal, rope, deterministic). Lengths 17 and 20 cross the interpreter's
# 16 x 16 tile, so every case has tiles inside the band and tiles that need the mask.
VARIANTS = {
    "n17-h2-plain": (17, 17, 2, 2, False, False, True),
    "n17-m20-gqa2-causal-fast": (17, 20, 2, 1, True, False, False),
    "n17-gqa2-rope-causal": (17, 17, 2, 1, True, True, True),
    "n17-m20-h2-rope-fast": (17, 20, 2, 2, False, True, False),
}
CASES = [
    pytest.param(d, variant, type_name, id=f"d{d}-{variant}-{type_name}")
    for d in HEAD_DIMS for variant, spec in VARIANTS.items() for type_name in DTYPES
    if d % 2 == 0 or not spec[5]  # RoPE pairs d with d + D/2: even D only
]


def _eager(q, k, v, dout, rope, causal, dtype):
    """o, dq, dk, dv of eager attention on the CPU in ``dtype`` (float64: the reference)."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in (q, k, v)]
    tables = tuple(t.cpu().to(dtype) for t in rope) if rope is not None else None
    o = attention_reference(*leaves, causal=causal, rope=tables)
    o.backward(dout.cpu().to(dtype))
    return [o.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("d, variant, type_name", CASES)
def test_small_head_dim_matches_reference(d, variant, type_name, request):
    if (d, variant, type_name) in ROUNDED_DELTA_EXCEEDS:
        request.applymarker(pytest.mark.xfail(strict=True, reason="Delta from the rounded o exceeds the 2x rule"))
    n, m, hq, hkv, causal, use_rope, deterministic = VARIANTS[variant]
    dtype = DTYPES[type_name]
    g = torch.Generator().manual_seed(SEED)
    q, dout = (torch.randn(1, n, hq, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, m, hkv, d, generator=g).to(dtype) for _ in range(2))
    rope = None
    if use_rope:
        angles = torch.rand(m + 3, d // 2, generator=g) * 6.0
        rope = (angles.cos().to(DEVICE), angles.sin().to(DEVICE))
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    with contextlib.nullcontext() if deterministic else deterministic_mode(False):
        o = remat.attention(*leaves, causal=causal, rope=rope, deterministic=deterministic, backend="triton")
        o.backward(dout.to(DEVICE))
    got = [o.detach().cpu()] + [t.grad.cpu() for t in leaves]
    reference = _eager(q, k, v, dout, rope, causal, torch.float64)
    stock = _eager(q, k, v, dout, rope, causal, dtype)
    for name, value, stock_value, ref in zip(("o", "dq", "dk", "dv"), got, stock, reference):
        assert value.dtype == dtype, f"{name}: dtype {value.dtype}, expected {dtype}"
        assert_within_2x_of_stock(name, value, stock_value, ref, dtype)
