"""Tests added for surviving mutants of `make mutate` (mutation/<block>.md names the mutant each one
kills). Test names start with the block (norm_, mlp_, attention_), which is how mutation/run.py
selects them for that block."""

import pytest
import torch
import torch.nn.functional as F

import remat

from _checks import assert_within_2x_of_stock
from helpers import cpu_backends, eager_gated, eager_gelu, grads


def test_norm_triton_block_config_matches_its_documented_limits():
    """kernels/norm.py holds rows of up to 16384 (forward) / 8192 (backward) columns whole in one
    tile and tiles wider rows in 4096-column tiles, with 256 columns per warp from 1 to 16 warps
    (the ptxas-measured register budget of its comments; the interpreter ignores it, so no numerical
    test notices a shifted boundary)."""
    pytest.importorskip("triton")
    from remat.kernels import norm

    fwd, bwd = norm._MAX_SINGLE_TILE_COLS_FWD, norm._MAX_SINGLE_TILE_COLS_BWD
    assert (fwd, bwd, norm._TILED_BLOCK) == (16384, 8192, 4096)
    expected = {
        (1, fwd): (1, True, 1), (7, fwd): (8, True, 1), (256, fwd): (256, True, 1), (257, fwd): (512, True, 2),
        (512, fwd): (512, True, 2), (4096, fwd): (4096, True, 16), (8192, fwd): (8192, True, 16),
        (16384, fwd): (16384, True, 16), (16385, fwd): (4096, False, 16), (70000, fwd): (4096, False, 16),
        (8192, bwd): (8192, True, 16), (8193, bwd): (4096, False, 16),
    }
    for (cols, limit), config in expected.items():
        got = norm._block_config(cols, limit)
        assert got == config and all(type(a) is type(b) for a, b in zip(got, config)), (cols, limit, got)


def test_norm_triton_backward_partials_fill_one_wave_per_gpu(monkeypatch):
    """On a GPU the backward launches one wave: sm_count x (16 warps // num_warps) programs, at most
    one per row and at least one, an int (checked without a GPU, on a faked SM count)."""
    pytest.importorskip("triton")
    from remat.kernels import norm

    class Properties:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    cuda = torch.device("cuda")
    cases = {(10**6, 16): 132, (10**6, 4): 4 * 132, (10**6, 32): 132, (5, 1): 5, (0, 1): 1}
    for (rows, num_warps), programs in cases.items():
        got = norm._num_partials(rows, num_warps, cuda)
        assert got == programs and type(got) is int, (rows, num_warps, got)  # a grid size and a tensor dim
    assert norm._num_partials(10**6, 1, torch.device("cpu")) == norm._CPU_NUM_PARTIALS


def test_norm_default_eps_is_documented():
    """rms_norm's default eps is 1e-6 and layer_norm's 1e-5 (torch.nn.LayerNorm's), as documented;
    the float64-reference tests pass eps explicitly, so only this test pins the defaults."""
    x = 0.01 * torch.randn(4, 33, generator=torch.Generator().manual_seed(0))
    assert torch.equal(remat.rms_norm(x, backend="torch"), remat.rms_norm(x, None, 1e-6, backend="torch"))
    assert torch.equal(remat.layer_norm(x, backend="torch"), remat.layer_norm(x, None, None, 1e-5, backend="torch"))
    assert not torch.equal(remat.layer_norm(x, backend="torch"), remat.layer_norm(x, None, None, 1e-6, backend="torch"))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_mlp_gelu_recompute_modes_agree_bitwise(backend, approximate):
    """The GELU MLP's "block" backward (recomputing the fc GEMM, in the fused kernel where the
    backend has one) reproduces "activation"'s rounding points bit for bit, as the gated MLP's does
    (tests/test_mlp.py::test_recompute_modes_agree_bitwise), biases included."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    params = [(0.1 * torch.randn(*shape, generator=gen)).bfloat16() for shape in [(160, 64), (160,), (64, 160), (64,)]]
    dy = torch.randn(9, 64, generator=gen).bfloat16()
    results = [grads(lambda *a, m=mode: remat.gelu_mlp(*a, approximate=approximate, recompute=m, backend=backend),
                     [x] + params, dy) for mode in ("activation", "block")]
    for name, a, b in zip(["y", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj"], *results):
        assert torch.equal(a, b), name


def _mlp_calls():
    """(name, function, tensors): each MLP entry point with every optional bias present, small odd
    sizes, fp32 (gradients compared bitwise between runs, so any dtype works)."""
    gen = torch.Generator().manual_seed(3)

    def rnd(*shape, scale=0.3):
        return scale * torch.randn(*shape, generator=gen)

    hidden, inter = 12, 20
    x = rnd(5, hidden, scale=1.0)
    gated = [rnd(inter, hidden), rnd(inter, hidden), rnd(hidden, inter), rnd(inter), rnd(inter), rnd(hidden)]
    plain = [rnd(inter, hidden), rnd(inter), rnd(hidden, inter), rnd(hidden)]
    norm = [1 + rnd(hidden), rnd(hidden)]
    return [
        ("gated_mlp", lambda x, wg, wu, wd, bg, bu, bd, backend: remat.gated_mlp(
            x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, backend=backend), [x] + gated),
        ("gelu_mlp", lambda x, wfc, bfc, wp, bp, backend: remat.gelu_mlp(x, wfc, bfc, wp, bp, backend=backend),
         [x] + plain),
        ("norm_mlp", lambda x, nw, nb, wg, wu, wd, bg, bu, bd, backend: remat.norm_mlp(
            x, nw, wg, wu, wd, norm_bias=nb, norm="layer", b_gate=bg, b_up=bu, b_down=bd, backend=backend),
         [x] + norm + gated),
        ("norm_gelu_mlp", lambda x, nw, nb, wfc, bfc, wp, bp, backend: remat.norm_gelu_mlp(
            x, nw, nb, wfc, bfc, wp, bp, backend=backend), [x] + norm + plain),
    ]


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("call", _mlp_calls(), ids=lambda c: c[0])
def test_mlp_frozen_parameters_get_no_gradient_and_the_others_the_same(call, backend):
    """Each input alone requiring a gradient (x for input gradients, one weight or bias for
    fine-tuning a subset): exactly that input gets a gradient, bitwise the one of the run where
    everything requires one. The reference tests make every input require a gradient, so a
    backward that gates a gradient on another input's needs_input_grad slot passes them."""
    _, fn, tensors = call
    dy = torch.randn(5, 12, generator=torch.Generator().manual_seed(4))
    leaves = [t.clone().requires_grad_() for t in tensors]
    full = torch.autograd.grad(fn(*leaves, backend=backend), leaves, dy)
    for i in range(len(tensors)):
        leaves = [t.clone().requires_grad_(j == i) for j, t in enumerate(tensors)]
        fn(*leaves, backend=backend).backward(dy)
        for j, t in enumerate(leaves):
            if j == i:
                assert t.grad is not None and torch.equal(t.grad, full[j]), (i, j)
            else:
                assert t.grad is None, (i, j)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("present", [(True, False, False), (False, True, False), (False, False, True)],
                         ids=["b_gate", "b_up", "b_down"])
def test_mlp_norm_mlp_with_one_bias_matches_reference(backend, present):
    """norm_mlp with only one of b_gate, b_up, b_down: every gradient against the float64 reference
    (the reference tests give all three or none)."""
    gen = torch.Generator().manual_seed(5)
    hidden, inter = 12, 20
    x, nw, nb = torch.randn(7, hidden, generator=gen), 1 + 0.2 * torch.randn(hidden, generator=gen), None
    weights = [0.3 * torch.randn(*s, generator=gen) for s in [(inter, hidden), (inter, hidden), (hidden, inter)]]
    biases = [0.1 * torch.randn(s, generator=gen) if p else None for s, p in zip((inter, inter, hidden), present)]
    dy = torch.randn(7, hidden, generator=gen)

    def fn(x, nw, nb, wg, wu, wd, bg, bu, bd):
        return remat.norm_mlp(x, nw, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, backend=backend)

    def ref(x, nw, nb, wg, wu, wd, bg, bu, bd):
        return eager_gated(F.rms_norm(x, (hidden,), nw, 1e-6), wg, wu, wd, bg, bu, bd, "silu")

    tensors = [x, nw, nb] + weights + biases
    got, stock = grads(fn, tensors, dy), grads(ref, tensors, dy)
    want = grads(ref, [None if t is None else t.double() for t in tensors], dy.double())
    for i, (a, s, w) in enumerate(zip(got, stock, want)):
        assert_within_2x_of_stock(f"output {i}", a, s, w, torch.float32)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("present", [(True, False), (False, True)], ids=["b_fc", "b_proj"])
def test_mlp_norm_gelu_mlp_with_one_bias_matches_reference(backend, present):


    gen = torch.Generator().manual_seed(6)
    hidden, inter = 12, 20
    x = torch.randn(7, hidden, generator=gen)
    nw, nb = 1 + 0.2 * torch.randn(hidden, generator=gen), 0.1 * torch.randn(hidden, generator=gen)
    w_fc, w_proj = 0.3 * torch.randn(inter, hidden, generator=gen), 0.3 * torch.randn(hidden, inter, generator=gen)
    b_fc = 0.1 * torch.randn(inter, generator=gen) if present[0] else None
    b_proj = 0.1 * torch.randn(hidden, generator=gen) if present[1] else None
    dy = torch.randn(7, hidden, generator=gen)

    def fn(x, nw, nb, w_fc, b_fc, w_proj, b_proj):
        return remat.norm_gelu_mlp(x, nw, nb, w_fc, b_fc, w_proj, b_proj, backend=backend)

    def ref(x, nw, nb, w_fc, b_fc, w_proj, b_proj):
        return F.linear(F.gelu(F.linear(F.layer_norm(x, (hidden,), nw, nb, 1e-5), w_fc, b_fc)), w_proj, b_proj)

    tensors = [x, nw, nb, w_fc, b_fc, w_proj, b_proj]
    got, stock = grads(fn, tensors, dy), grads(ref, tensors, dy)
    want = grads(ref, [None if t is None else t.double() for t in tensors], dy.double())
    for i, (a, s, w) in enumerate(zip(got, stock, want)):
        assert_within_2x_of_stock(f"output {i}", a, s, w, torch.float32)


@pytest.mark.parametrize("recompute", ["activation", "block"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_mlp_intermediate_size_one_matches_reference(backend, recompute):
    """An intermediate size of 1 (one column in the Triton GEMM kernels' outputs), gated and plain,
    against the float64 reference."""
    gen = torch.Generator().manual_seed(7)
    x, dy = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    gated = [0.3 * torch.randn(*s, generator=gen) for s in [(1, 8), (1, 8), (8, 1)]]
    plain = [0.3 * torch.randn(*s, generator=gen) for s in [(1, 8), (1,), (8, 1), (8,)]]
    cases = [(lambda x, wg, wu, wd: remat.gated_mlp(x, wg, wu, wd, recompute=recompute, backend=backend),
              lambda x, wg, wu, wd: eager_gated(x, wg, wu, wd, None, None, None, "silu"), gated),
             (lambda *a: remat.gelu_mlp(*a, recompute=recompute, backend=backend),
              lambda *a: eager_gelu(*a, "gelu"), plain)]
    for fn, ref, params in cases:
        tensors = [x] + params
        got, stock = grads(fn, tensors, dy), grads(ref, tensors, dy)
        want = grads(ref, [t.double() for t in tensors], dy.double())
        for i, (a, s, w) in enumerate(zip(got, stock, want)):
            assert_within_2x_of_stock(f"output {i}", a, s, w, torch.float32)


def test_mlp_norm_gelu_mlp_rejects_a_bad_input_before_any_kernel():


    x, w = torch.randn(3, 8), torch.randn(16, 8)
    with pytest.raises(TypeError, match="x must be float32"):
        remat.norm_gelu_mlp(x.int(), torch.ones(8), torch.zeros(8), w, None, w.t().contiguous(), None)


def test_mlp_triton_norm_prologue_rejects_a_non_tensor_norm_weight():
    pytest.importorskip("triton")
    from remat.kernels import matmul

    x, w = torch.randn(3, 8), torch.randn(16, 8)
    rstd = torch.ones(3)
    with pytest.raises(TypeError, match="norm_weight: expected a tensor"):
        matmul.glu_matmul(x, w, w, "silu", norm="rms", rstd=rstd, norm_weight=[1.0] * 8)
