"""RMSNorm and LayerNorm, every backend that runs here, against a float64 reference: forward and
every gradient, under the 2x-stock-PyTorch rule, over dtypes, odd widths, weights/biases present
or not, a fused residual, and non-contiguous inputs and gradients."""

import pytest
import torch

import remat
from remat.memory import saved_bytes

from helpers import DTYPES, check_against_reference, cpu_backends, gpu_backends, make_case, run_norm

# (leading shape, hidden): widths 1, 7, 1000, 4099 and 70000 (past one 64K tile).
SHAPES = [((5,), 1), ((3, 5), 7), ((9,), 1000), ((3,), 4099), ((2,), 70000)]
# Enough rows that the C++ weight-gradient reduction (32 fixed row chunks) sums several rows per
# chunk, and column-strided inputs (every other element of a wider row).
MULTI_ROW_SHAPES = [((101,), 33), ((4, 50), 200)]
VARIANTS = ["plain", "residual", "no_affine", "noncontiguous"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lead,n", SHAPES, ids=[f"{'x'.join(map(str, s))}x{n}" for s, n in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_matches_float64_reference(kind, backend, dtype, lead, n, variant):
    check_against_reference(kind, lead, n, dtype, variant, backend)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_residual_output_is_rounded_sum_and_stats_use_it(kind, backend):
    """h = x + residual rounded to bf16, bit for bit as torch adds, and the norm of h equals the
    norm computed from that rounded h (the rounding point the backward reproduces)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 300, generator=g).bfloat16()
    r = torch.randn(7, 300, generator=g).bfloat16()
    fn = remat.rms_norm if kind == "rms" else remat.layer_norm
    y, h = fn(x, None, residual=r, backend=backend)
    assert torch.equal(h, x + r)
    y_from_h = fn(h, None, backend=backend)
    assert torch.equal(y, y_from_h)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_weight_gradients_are_deterministic(kind, backend):
    """dw (and db) are bitwise identical across runs and thread counts: per-chunk partials summed
    in a fixed order, no atomics."""
    x, weight, bias, residual, dy, dh = make_case(kind, (64,), 257, torch.float32, "plain", seed=3)
    fn = remat.rms_norm if kind == "rms" else remat.layer_norm
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (1, max(2, threads)):
            torch.set_num_threads(n_threads)
            results.append(run_norm(fn, kind, x, weight, bias, None, dy, None, 1e-5, backend=backend))
    finally:
        torch.set_num_threads(threads)
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


@pytest.mark.parametrize("backend", cpu_backends())
def test_inputs_are_not_written(backend):
    x, weight, bias, residual, dy, dh = make_case("layer", (4,), 33, torch.float32, "residual")
    before = [t.clone() for t in (x, weight, bias, residual)]
    y, h = remat.layer_norm(x, weight, bias, residual=residual, backend=backend)
    for t, b in zip((x, weight, bias, residual), before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_empty_rows(kind, backend):
    """No rows: empty outputs and zero weight (and bias) gradients, as stock PyTorch gives."""
    x = torch.randn(2, 0, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    b = torch.zeros(16, requires_grad=True)
    y = remat.rms_norm(x, w, backend=backend) if kind == "rms" else remat.layer_norm(x, w, b, backend=backend)
    y.sum().backward()
    assert y.shape == (2, 0, 16)
    assert torch.equal(x.grad, torch.zeros(2, 0, 16))
    assert torch.equal(w.grad, torch.zeros(16))
    if kind == "layer":
        assert torch.equal(b.grad, torch.zeros(16))



@pytest.mark.parametrize("variant", ["plain", "col_strided"])
@pytest.mark.parametrize("lead,n", MULTI_ROW_SHAPES, ids=[f"{'x'.join(map(str, s))}x{n}" for s, n in MULTI_ROW_SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_multi_row_chunks_and_column_strides(kind, backend, dtype, lead, n, variant):
    check_against_reference(kind, lead, n, dtype, variant, backend)


# On a GPU (marked gpu; skipped where none is present): the same float64-reference checks at real
# sizes, the vectorized and scalar paths, bitwise determinism and the saved-bytes contract.

# Narrow (warp per row), wide (block per row), past one 64K tile; odd widths take the scalar path.
GPU_SHAPES = [((4099,), 1), ((3, 333), 7), ((1000,), 1000), ((64,), 4096), ((17,), 4099), ((2, 8), 8192),
          ((3,), 70000), ((16384,), 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lead,n", GPU_SHAPES, ids=[f"{'x'.join(map(str, s))}x{n}" for s, n in GPU_SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_gpu_norm_matches_float64_reference(kind, backend, dtype, lead, n, variant):
    check_against_reference(kind, lead, n, dtype, variant, backend, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_misaligned_input_takes_scalar_path_correctly(backend, offset):
    """A view starting one element into its storage is not 16-byte aligned: the kernels must
    detect it and still be right."""
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(64 * 1024 + 1, generator=g, device="cuda").bfloat16()
    x = base[offset:offset + 64 * 1024].view(64, 1024)
    w = torch.randn(1024, generator=g, device="cuda").bfloat16()
    got = remat.rms_norm(x, w, backend=backend)
    want = remat.rms_norm(x.cpu(), w.cpu(), backend="torch")
    torch.testing.assert_close(got.cpu(), want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_gpu_gradients_bitwise_deterministic(kind, backend):
    x, weight, bias, residual, dy, dh = make_case(kind, (4096,), 4096, torch.bfloat16, "residual", device="cuda")
    fn = remat.rms_norm if kind == "rms" else remat.layer_norm
    first = run_norm(fn, kind, x, weight, bias, residual, dy, dh, 1e-5, backend=backend)
    second = run_norm(fn, kind, x, weight, bias, residual, dy, dh, 1e-5, backend=backend)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_saved_bytes_contract(backend):
    x = torch.randn(8, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.nn.Parameter(torch.ones(1024, device="cuda", dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.zeros(1024, device="cuda", dtype=torch.bfloat16))
    rows = 8 * 512
    assert saved_bytes(remat.rms_norm, x, w, residual=r, backend=backend) == rows * 1024 * 2 + rows * 4
    assert saved_bytes(remat.layer_norm, x, w, b, residual=r, backend=backend) == rows * 1024 * 2 + rows * 8


@pytest.mark.gpu
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_compile_fullgraph(backend):
    torch._dynamo.reset()
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda x, w: remat.rms_norm(x, w, backend=backend), fullgraph=True)
    torch.testing.assert_close(compiled(x, w), remat.rms_norm(x, w, backend=backend))
