"""The Triton attention backend at head dims below one tile (D 1, 2, 3, 8, 15: the kernels pad
D to BLOCK_D = 16 columns and mask the rest) against a float64 eager reference, under the
2x-stock-PyTorch rule (DESIGN.md section 7): forward and dq, dk, dv, fp32 and bf16, plain,
causal with GQA and N != M, and RoPE (even D; with a backward q and k are rotated once per pass
outside the kernels), with the deterministic backward and the fast one (atomic dq, then the
cast pass); and forward-only calls with RoPE, where the forward kernel rotates q and k itself
(the halves padded to BLOCK_H = 16), at square and non-square tiles.

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


# Cases whose lengths cross several tiles of either size, with every feature that indexes tiles.
TILE_CASES = {
    "n40-m40-gqa2-causal-rope": (40, 40, 2, 1, True, True, True),
    "n21-m40-window-fast": (21, 40, 2, 2, False, False, False),
}


@pytest.mark.skipif(not INTERPRETED, reason="the tile override is for the interpreter's launches")
@pytest.mark.parametrize("tile", [(16, 32), (32, 16)], ids=["m16-n32", "m32-n16"])
@pytest.mark.parametrize("variant", list(TILE_CASES))
def test_non_square_tiles_match_reference(variant, tile, monkeypatch):
    """The interpreter launches 16 x 16 tiles by default, where BLOCK_M and BLOCK_N cannot be told
    apart; with non-square tiles a mix-up of the two in any kernel (forward, dK/dV, dQ, both
    backward modes) fails this float64-reference check."""
    from remat.kernels.attention import tuning

    monkeypatch.setattr(tuning, "INTERPRETER_TILE", tile)
    n, m, hq, hkv, causal, use_rope, deterministic = TILE_CASES[variant]
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, n, hq, 32, generator=g) for _ in range(2))
    k, v = (torch.randn(1, m, hkv, 32, generator=g) for _ in range(2))
    rope = None
    if use_rope:
        angles = torch.rand(m, 16, generator=g) * 6.0
        rope = (angles.cos(), angles.sin())
    window = None if causal else (7, 5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with contextlib.nullcontext() if deterministic else deterministic_mode(False):
        o = remat.attention(*leaves, causal=causal, rope=rope, window=window, deterministic=deterministic,
                            backend="triton")
        o.backward(dout)
    got = [o.detach()] + [t.grad for t in leaves]

    def eager(dtype):
        ts = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        tables = tuple(t.to(dtype) for t in rope) if rope is not None else None
        out = attention_reference(*ts, causal=causal, rope=tables, window=window)
        out.backward(dout.to(dtype))
        return [out.detach()] + [t.grad for t in ts]

    for name, value, stock, ref in zip(("o", "dq", "dk", "dv"), got, eager(torch.float32), eager(torch.float64)):
        assert_within_2x_of_stock(name, value, stock, ref, torch.float32)


# Forward-only calls with RoPE (no input needs a gradient): the forward kernel rotates q and k on
# load. name: (D, N, M, Hq, Hkv, causal, interpreter tile or None for the default).
FORWARD_ROPE_CASES = {
    "d2-n17-m20-gqa2-causal": (2, 17, 20, 2, 1, True, None),
    "d8-n17-h2": (8, 17, 17, 2, 2, False, None),
    "d32-n21-m40-gqa2-causal-m16-n32": (32, 21, 40, 2, 1, True, (16, 32)),
    "d32-n40-gqa2-causal-m32-n16": (32, 40, 40, 2, 1, True, (32, 16)),
}


@pytest.mark.parametrize("type_name", list(DTYPES))
@pytest.mark.parametrize("variant", list(FORWARD_ROPE_CASES))
def test_forward_only_rope_matches_reference(variant, type_name, monkeypatch):
    """o of a forward-only call with RoPE (the forward kernel's own rotation, query i at key
    position i + M - N) within the 2x rule of the float64 reference, and the forward kernel the
    only launch, with RoPE on."""
    from remat.kernels.attention import launch, tuning

    d, n, m, hq, hkv, causal, tile = FORWARD_ROPE_CASES[variant]
    if tile is not None:
        if not INTERPRETED:
            pytest.skip("the tile override is for the interpreter's launches")
        monkeypatch.setattr(tuning, "INTERPRETER_TILE", tile)
    launched = []
    original = launch._launch

    def recording(kernel, kernel_name, grid_of, args, constexprs, *rest, **options):
        launched.append((kernel_name, constexprs["ROPE"]))
        return original(kernel, kernel_name, grid_of, args, constexprs, *rest, **options)

    monkeypatch.setattr(launch, "_launch", recording)
    dtype = DTYPES[type_name]
    g = torch.Generator().manual_seed(SEED)
    q, dout = (torch.randn(1, n, hq, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, m, hkv, d, generator=g).to(dtype) for _ in range(2))
    angles = torch.rand(m + 3, d // 2, generator=g) * 6.0
    rope = (angles.cos(), angles.sin())
    o = remat.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal=causal,
                        rope=tuple(t.to(DEVICE) for t in rope), backend="triton").cpu()
    reference = _eager(q, k, v, dout, rope, causal, torch.float64)[0]
    stock = _eager(q, k, v, dout, rope, causal, dtype)[0]
    assert o.dtype == dtype
    assert_within_2x_of_stock("o", o, stock, reference, dtype)
    assert launched == [("fwd", True)]
