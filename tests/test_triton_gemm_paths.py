"""What the Triton GEMM launchers (kernels/matmul.py) launch: the single GEMM (act_matmul, the plain
MLP's up-projection with the bias + activation epilogue) takes its own tiles, not the dual GEMM's,
and every GEMM launcher passes PyTorch's fp32 matmul setting (torch.backends.cuda.matmul.allow_tf32)
to its kernel as the TF32 constexpr.

The launch checks record the constexprs each kernel is launched with, under the interpreter on
the CPU (TRITON_INTERPRET=1) or compiled on a GPU. TF32 dots round both operands to nearest-even
TF32 first (kernels/_common.py `_round_to_tf32`; a tensor-core TF32 dot alone truncates): checked
on both, since the interpreter's IEEE products of rounded operands are TF32 products. On a GPU
(marked gpu) the TF32 GEMMs' error against float64 is at most twice torch's own TF32 matmul
error. That TF32=True compiles to TF32 dots and TF32=False to IEEE ones is checked on the TTIR by
tests/test_triton_aot.py.
"""

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA GPU; neither is here",
                allow_module_level=True)
pytest.importorskip("triton")

from remat.kernels import matmul  # noqa: E402
from remat.ops.mlp import activate  # noqa: E402

from _checks import assert_within_2x_of_stock  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
TILE_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


class _RecordingKernel:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records kwargs (the
    constexprs and launch options) and launches the real kernel; anything else (warmup, on the
    compiled path) goes to the real kernel."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def record_and_launch(*args, **kwargs):
            self.launches.append(kwargs)
            return launch(*args, **kwargs)

        return record_and_launch

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def _record(monkeypatch, *names):
    recorders = [_RecordingKernel(getattr(matmul, name)) for name in names]
    for name, recorder in zip(names, recorders):
        monkeypatch.setattr(matmul, name, recorder)
    return recorders


@pytest.fixture
def set_allow_tf32():
    """Sets torch.backends.cuda.matmul.allow_tf32 (a property of PyTorch's cuBLAS module, which
    monkeypatch cannot restore) and restores it after the test."""
    saved = torch.backends.cuda.matmul.allow_tf32

    def set_flag(value):
        torch.backends.cuda.matmul.allow_tf32 = value

    yield set_flag
    torch.backends.cuda.matmul.allow_tf32 = saved


def _randn(generator, *size, dtype, scale=1.0):
    return (scale * torch.randn(*size, generator=generator)).to(dtype).to(DEVICE)


def _gemm_inputs(rows, inner, cols, dtype, seed):
    """x [rows, inner], w and w_up [cols, inner] scaled so x @ w^T is O(1), b [cols], dh."""
    generator = torch.Generator().manual_seed(seed)
    x = _randn(generator, rows, inner, dtype=dtype)
    w = _randn(generator, cols, inner, dtype=dtype, scale=inner ** -0.5)
    w_up = _randn(generator, cols, inner, dtype=dtype, scale=inner ** -0.5)
    b = _randn(generator, cols, dtype=dtype, scale=0.5)
    dh = _randn(generator, rows, cols, dtype=dtype)
    return x, w, w_up, b, dh


def _run_all_launchers(x, w, w_up, b, dh):
    """One call of each GEMM launcher: glu_matmul, glu_matmul_bwd, act_matmul, act_matmul_bwd."""
    matmul.glu_matmul(x, w, w_up, "silu")
    matmul.glu_matmul_bwd(x, w, w_up, dh, "silu")
    matmul.act_matmul(x, w, b, "gelu")
    matmul.act_matmul_bwd(x, w, b, dh, "gelu")


@pytest.mark.parametrize("allow_tf32", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_gemm_launcher_passes_pytorch_tf32_setting(allow_tf32, dtype, monkeypatch, set_allow_tf32):
    """Each of the four kernels is launched with TF32 = torch.backends.cuda.matmul.allow_tf32,
    read at the call (the fixture restores the flag); for bf16 the flag is passed too and has no
    effect on the dot."""
    recorders = _record(monkeypatch, "_glu_matmul_fwd_kernel", "_glu_matmul_bwd_kernel",
                        "_act_matmul_fwd_kernel", "_act_matmul_bwd_kernel")
    set_allow_tf32(allow_tf32)
    _run_all_launchers(*_gemm_inputs(5, 48, 40, dtype, seed=0))
    for recorder in recorders:
        assert [launch["TF32"] for launch in recorder.launches] == [allow_tf32], recorder.kernel


def test_tf32_flag_is_read_per_call(monkeypatch, set_allow_tf32):
    """Flipping the flag between two calls changes the constexpr of the next launch (no value
    cached at import or first call)."""
    (recorder,) = _record(monkeypatch, "_act_matmul_fwd_kernel")
    x, w, _, b, _ = _gemm_inputs(5, 48, 40, torch.float32, seed=1)
    for allow_tf32 in (True, False, True):
        set_allow_tf32(allow_tf32)
        matmul.act_matmul(x, w, b, "gelu")
    assert [launch["TF32"] for launch in recorder.launches] == [True, False, True]


TILE_CASES = [
    pytest.param(dtype, rows, tf32, id=f"{name}-{rows}rows{'-tf32' if tf32 else ''}")
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp16", torch.float16, False),
                              ("fp32", torch.float32, False), ("fp32", torch.float32, True))
    for rows in (3, 65)
]


@pytest.mark.parametrize("dtype,rows,tf32", TILE_CASES)
def test_single_gemm_launches_its_own_tile(dtype, rows, tf32, monkeypatch, set_allow_tf32):
    """act_matmul and act_matmul_bwd launch one tile, act_matmul_candidates' (the interpreter
    takes its first entry; a GPU the first whose kernels fit, all entries sharing BM/BN/BK), with
    a deeper pipeline than the dual GEMM's for the same shape; the dual GEMM keeps its tile."""
    forward, backward, glu_forward = _record(
        monkeypatch, "_act_matmul_fwd_kernel", "_act_matmul_bwd_kernel", "_glu_matmul_fwd_kernel")
    set_allow_tf32(tf32)
    inner, cols = 48, 40
    x, w, w_up, b, dh = _gemm_inputs(rows, inner, cols, dtype, seed=2)
    matmul.act_matmul(x, w, b, "gelu_tanh")
    matmul.act_matmul_bwd(x, w, b, dh, "gelu_tanh")
    matmul.glu_matmul(x, w, w_up, "silu")

    def tile(launch):
        return tuple(launch[name] for name in TILE_CONSTEXPRS)

    candidates = [tuple(config) for config in matmul.act_matmul_candidates(rows, cols, inner, dtype, tf32)]
    (forward_tile,) = map(tile, forward.launches)
    (backward_tile,) = map(tile, backward.launches)
    assert forward_tile == backward_tile, "the recompute is bit-identical only with one tile"
    assert forward_tile in candidates
    if INTERPRETED:
        assert forward_tile == candidates[0]
    # Entries differ in pipeline depth only (which keeps the K order, hence the bits), deepest
    # first.
    assert len({candidate[:5] for candidate in candidates}) == 1
    assert [candidate[5] for candidate in candidates] == sorted({c[5] for c in candidates}, reverse=True)
    (glu_tile,) = map(tile, glu_forward.launches)
    assert glu_tile == tuple(matmul.glu_matmul_config(rows, cols, inner, dtype))
    assert candidates[0][5] > glu_tile[5], "one accumulator's smaller stage buys a deeper pipeline"


def test_single_gemm_tile_is_chosen_per_row_class_dtype_and_tf32():
    """The rule keys on what the forward and the backward both see: the row class (at most 64
    rows: the decode-sized tile), the dtype and TF32 (fp32 only)."""
    def first(rows, dtype, tf32):
        return matmul.act_matmul_config(rows, 4096, 4096, dtype, tf32)

    assert first(64, torch.bfloat16, False).block_m == 64
    assert first(65, torch.bfloat16, False).block_m == 128
    assert first(4096, torch.bfloat16, True) == first(4096, torch.bfloat16, False)
    assert first(4096, torch.float32, True) != first(4096, torch.float32, False)
    # TF32 runs on tensor cores: a deeper BLOCK_K than the FMA path's.
    assert first(4096, torch.float32, True).block_k > first(4096, torch.float32, False).block_k


def _tf32(t, nearest=True):
    """fp32 ``t`` on TF32's 10 mantissa bits: rounded to nearest-even (what the kernels'
    `_round_to_tf32` does before a TF32 dot) or, with nearest=False, truncated (what a TF32
    tensor-core dot does to unrounded operands). Finite values only."""
    bits = t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if nearest:
        bits = bits + 0xFFF + ((bits >> 13) & 1)
    bits = ((bits >> 13) << 13) & 0xFFFFFFFF
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32).view(t.shape)


def test_tf32_dot_rounds_operands_to_nearest_even(set_allow_tf32):
    """With TF32 on, the GEMM's pre-activation (act_matmul at 64 x 256 -> 96) is the fp32 sum of
    products of operands rounded to nearest-even TF32: within 1e-5 of the float64 product of those
    operands, and at least 10x farther from the product of truncated operands. Compiled (GPU) and
    interpreted alike: rounded operands make the tensor cores' truncation drop zeros."""
    x, w, _, b, _ = _gemm_inputs(64, 256, 96, torch.float32, seed=6)
    set_allow_tf32(True)
    _, pre = matmul.act_matmul(x, w, b, "gelu", store_pre=True)
    pre, x, w, b = (t.cpu() for t in (pre.double(), x, w, b))
    nearest = _tf32(x).double() @ _tf32(w).double().T + b.double()
    truncated = _tf32(x, nearest=False).double() @ _tf32(w, nearest=False).double().T + b.double()
    error_nearest = (pre - nearest).abs().max().item()
    error_truncated = (pre - truncated).abs().max().item()
    assert error_nearest <= 1e-5, error_nearest
    assert error_truncated >= 10 * error_nearest, (error_truncated, error_nearest)


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU TF32 changes the products (gpu tests below)")
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_single_gemm_new_tiles_match_float64_reference(activation, set_allow_tf32):
    """fp32 act_matmul at 127 rows (one 128-row tile of the new fp32 tile, ragged) and K 1000
    (ragged last K step) with the TF32 variant launched: pre and h within 2x of stock PyTorch's
    error against float64, both taken on the operands rounded to TF32 (what the TF32 dot
    multiplies; the interpreter's products of those are exact), and the backward's h is the
    forward's bit for bit."""
    set_allow_tf32(True)
    x, w, _, b, dh = _gemm_inputs(127, 1000, 72, torch.float32, seed=3)
    h, pre = matmul.act_matmul(x, w, b, activation, store_pre=True)
    _, h_recomputed = matmul.act_matmul_bwd(x, w, b, dh, activation)
    reference_pre = _tf32(x).double() @ _tf32(w).double().T + b.double()
    stock_pre = F.linear(_tf32(x), _tf32(w), b)
    assert_within_2x_of_stock("pre", pre, stock_pre, reference_pre, torch.float32)
    reference_h = activate(pre.double(), activation)
    stock_h = activate(stock_pre, activation)
    assert_within_2x_of_stock("h", h, stock_h, reference_h, torch.float32)
    assert torch.equal(h_recomputed, h)


# On a GPU (marked gpu; skipped where none is present).


def _gpu_only():
    if INTERPRETED:
        pytest.skip("compiled Triton on a CUDA GPU (TRITON_INTERPRET is set)")


@pytest.mark.gpu
@pytest.mark.parametrize("allow_tf32", [False, True], ids=["ieee", "tf32"])
def test_gpu_fp32_gemm_error_bounded_like_torch_matmul(allow_tf32, set_allow_tf32):
    """fp32 gate (glu_matmul) and pre (act_matmul) at 1024 x 2048 -> 768: error against float64
    at most 2x the error of torch's own fp32 matmul under the same allow_tf32 (cuBLAS TF32 when
    on, IEEE when off); with TF32 on the result differs from the IEEE one (the flag reached the
    kernel)."""
    _gpu_only()
    x, w, w_up, b, _ = _gemm_inputs(1024, 2048, 768, torch.float32, seed=4)
    set_allow_tf32(allow_tf32)
    _, gate, _ = matmul.glu_matmul(x, w, w_up, "silu", store_pre=True)
    _, pre = matmul.act_matmul(x, w, b, "gelu", store_pre=True)
    stock_gate = F.linear(x, w)
    stock_pre = F.linear(x, w, b)
    set_allow_tf32(False)
    _, ieee_pre = matmul.act_matmul(x, w, b, "gelu", store_pre=True)
    reference_gate = x.double() @ w.double().T
    assert_within_2x_of_stock("gate", gate.cpu(), stock_gate.cpu(), reference_gate.cpu(), torch.float32)
    assert_within_2x_of_stock("pre", pre.cpu(), stock_pre.cpu(), (reference_gate + b.double()).cpu(),
                              torch.float32)
    assert torch.equal(pre, ieee_pre) != allow_tf32


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 4096])
def test_gpu_single_gemm_tile_fits_and_is_shared_by_the_backward(rows):
    """The tile the compiled launcher picks is a candidate, cached under the key the backward
    looks up, and the backward's recomputed h equals the forward's bit for bit."""
    _gpu_only()
    x, w, _, b, dh = _gemm_inputs(rows, 1024, 1536, torch.bfloat16, seed=5)
    h, _ = matmul.act_matmul(x, w, b, "gelu_tanh")
    _, h_recomputed = matmul.act_matmul_bwd(x, w, b, dh, "gelu_tanh")
    key = matmul._act_tile_key(x, matmul.allow_tf32())
    assert matmul._ACT_TUNER.choices[key] in matmul.act_matmul_candidates(rows, 1536, 1024, torch.bfloat16, False)
    assert torch.equal(h_recomputed, h)
