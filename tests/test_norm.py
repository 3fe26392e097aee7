"""RMSNorm and LayerNorm, every backend that runs here, against a float64 reference: forward and
every gradient, under the 2x-stock-PyTorch rule, over dtypes, odd widths, weights/biases present
or not, a fused residual, and non-contiguous inputs and gradients."""

import pytest
import torch

import remat
from remat import backend as backend_mod
from remat.reference import layer_norm_reference, rms_norm_reference, stock_layer_norm, stock_rms_norm

from _checks import assert_within_2x_of_stock

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (leading shape, hidden): widths 1, 7, 1000, 4099 and 70000 (past one 64K tile).
SHAPES = [((5,), 1), ((3, 5), 7), ((9,), 1000), ((3,), 4099), ((2,), 70000)]
VARIANTS = ["plain", "residual", "no_affine", "noncontiguous"]


def cpu_backends():
    names = ["torch"]
    if backend_mod.unavailable_reason("cpp", torch.device("cpu")) is None:
        names.append("cpp")
    if backend_mod.unavailable_reason("triton", torch.device("cpu")) is None:
        names.append("triton")
    return names


def _strided(shape, dtype, device, generator, mode):
    """A tensor of `shape` whose layout is: contiguous, row-strided (a column slice of a wider
    tensor) or column-strided (every other column)."""
    *lead, n = shape
    if mode == "row_strided":
        base = torch.randn(*lead, n + 3, generator=generator, device=device).to(dtype)
        return base[..., :n]
    if mode == "col_strided":
        base = torch.randn(*lead, 2 * n, generator=generator, device=device).to(dtype)
        return base[..., ::2]
    return torch.randn(*shape, generator=generator, device=device).to(dtype)


def make_case(kind, lead, n, dtype, variant, device="cpu", seed=0):
    """Inputs (x, weight, bias, residual) and upstream gradients (dy, dh) for one test case."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (*lead, n)
    noncontig = variant == "noncontiguous"
    x = _strided(shape, dtype, device, g, "row_strided" if noncontig else "contiguous")
    affine = variant != "no_affine"
    weight = (1 + 0.5 * torch.randn(n, generator=g, device=device)).to(dtype) if affine else None
    bias = (0.5 * torch.randn(n, generator=g, device=device)).to(dtype) if affine and kind == "layer" else None
    use_residual = variant in ("residual", "noncontiguous")
    residual = _strided(shape, dtype, device, g, "col_strided" if noncontig else "contiguous") if use_residual else None
    dy = _strided(shape, dtype, device, g, "col_strided" if noncontig else "contiguous")
    dh = torch.randn(shape, generator=g, device=device).to(dtype) if use_residual else None
    return x, weight, bias, residual, dy, dh


def _leaf(t):
    """A fresh leaf with t's values and t's strides (clone() would make strided views contiguous)."""
    if t is None:
        return None
    leaf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        leaf.copy_(t)
    return leaf.requires_grad_(True)


def run_norm(fn, kind, x, weight, bias, residual, dy, dh, eps, **kwargs):
    """Forward and backward of one implementation; returns outputs and gradients by name."""
    leaves = {"x": _leaf(x), "weight": _leaf(weight), "bias": _leaf(bias), "residual": _leaf(residual)}
    args = (leaves["x"], leaves["weight"]) + ((leaves["bias"],) if kind == "layer" else ())
    out = fn(*args, eps, residual=leaves["residual"], **kwargs)
    outputs = {"y": out[0], "h": out[1]} if residual is not None else {"y": out}
    grads_out = [dy] + ([dh] if residual is not None else [])
    inputs = [(k, v) for k, v in leaves.items() if v is not None]
    grads = torch.autograd.grad(list(outputs.values()), [v for _, v in inputs], grads_out)
    result = {k: v.detach() for k, v in outputs.items()}
    result.update({f"d{k}": gr for (k, _), gr in zip(inputs, grads)})
    return result


def check_against_reference(kind, lead, n, dtype, variant, backend, device="cpu"):
    x, weight, bias, residual, dy, dh = make_case(kind, lead, n, dtype, variant, device)
    eps = 1e-6 if kind == "rms" else 1e-5
    remat_fn = remat.rms_norm if kind == "rms" else remat.layer_norm
    stock_fn = stock_rms_norm if kind == "rms" else stock_layer_norm
    ref_fn = rms_norm_reference if kind == "rms" else layer_norm_reference

    def to64(t):
        return None if t is None else t.detach().cpu().double()

    got = run_norm(remat_fn, kind, x, weight, bias, residual, dy, dh, eps, backend=backend)
    stock = run_norm(stock_fn, kind, x, weight, bias, residual, dy, dh, eps)
    ref = run_norm(ref_fn, kind, to64(x), to64(weight), to64(bias), to64(residual), to64(dy), to64(dh), eps)
    assert set(got) == set(ref)
    for name in ref:
        assert got[name].dtype == dtype, f"{name} has dtype {got[name].dtype}"
        assert_within_2x_of_stock(name, got[name].cpu(), stock[name].cpu(), ref[name], dtype)


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
