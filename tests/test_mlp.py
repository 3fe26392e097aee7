"""MLP blocks (SwiGLU, GeGLU, GELU MLP, pre-norm gated MLP): every backend that runs here against a
float64 reference under the 2x-stock-PyTorch rule, for every recompute mode; the saved-bytes
contract byte for byte; drop-in modules; torch.compile and autocast."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import _extension
from remat import backend as backend_mod
from remat.memory import saved_bytes

from _checks import assert_within_2x_of_stock
from helpers import DTYPES, eager_gated, eager_gelu, gpu_backends, grads

MODES = ["none", "activation", "block"]
# (tokens, hidden, intermediate): odd token counts and sizes that are not multiples of a block.
SHAPES = [(1, 64, 96), (3, 96, 200), (127, 64, 173), (3, 1000, 257)]


def mlp_backends():
    names = ["torch"]
    if _extension.LOADED and torch._C._dispatch_has_kernel_for_dispatch_key("remat::glu_fwd", "CPU"):
        names.append("cpp")
    if (backend_mod.unavailable_reason("triton", torch.device("cpu")) is None
            and importlib.util.find_spec("remat.kernels.mlp") is not None):
        names.append("triton")
    return names


def _params(shapes, dtype, gen, scale):
    return [None if s is None else (scale(s) * torch.randn(*s, generator=gen)).to(dtype) for s in shapes]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,hidden,inter", SHAPES, ids=[f"{t}x{h}x{i}" for t, h, i in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", mlp_backends())
@pytest.mark.parametrize("kind", ["swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh"])
def test_mlp_matches_float64_reference(kind, backend, dtype, tokens, hidden, inter, mode):
    gen = torch.Generator().manual_seed(tokens * 7 + hidden)
    gated = kind.startswith(("swiglu", "geglu"))
    activation = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "gelu": "gelu",
                  "gelu_tanh": "gelu_tanh"}[kind]
    # Row-strided x (a column slice of a wider tensor) for odd token counts.
    x = torch.randn(tokens, hidden + (5 if tokens % 2 else 0), generator=gen).to(dtype)[:, :hidden]
    if gated:
        # GeGLU (erf) with biases takes the unfused GEMMs; without biases, the Triton backend runs
        # the gate/up GEMMs in its fused dual-GEMM kernel.
        with_bias = kind == "geglu"
        shapes = [(inter, hidden), (inter, hidden), (hidden, inter)] + (
            [(inter,), None, (hidden,)] if with_bias else [None, None, None])
    else:
        shapes = [(inter, hidden), (inter,), (hidden, inter), (hidden,)]
    params = _params(shapes, dtype, gen, lambda s: 1 / s[-1] ** 0.5 if len(s) == 2 else 0.1)
    dy = torch.randn(tokens, hidden, generator=gen).to(dtype)
    if gated:
        wg, wu, wd, bg, bu, bd = params
        fn = lambda x, wg, wu, wd, bg, bu, bd: remat.gated_mlp(  # noqa: E731
            x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, activation=activation, recompute=mode, backend=backend)
        ref = lambda *a: eager_gated(*a, activation)  # noqa: E731
    else:
        fn = lambda x, wfc, bfc, wproj, bproj: remat.gelu_mlp(  # noqa: E731
            x, wfc, bfc, wproj, bproj, approximate="none" if activation == "gelu" else "tanh",
            recompute=mode, backend=backend)
        ref = lambda *a: eager_gelu(*a, activation)  # noqa: E731
    tensors = [x] + params
    got = grads(fn, tensors, dy)
    stock = grads(ref, tensors, dy)
    want = grads(ref, [None if t is None else t.double() for t in tensors], dy.double())
    names = ["y", "dx"] + [f"d{i}" for i, t in enumerate(params) if t is not None]
    for name, g, s, w in zip(names, got, stock, want):
        assert g.dtype == dtype
        assert_within_2x_of_stock(name, g, s, w, dtype)


@pytest.mark.parametrize("backend", mlp_backends())
def test_recompute_modes_agree_bitwise(backend):
    """The recompute reproduces the forward's rounding points: "block" (recomputing the GEMMs) and
    "activation" (keeping their outputs) give the same bits. ("none" runs eager's unfused
    backward, which rounds dh * up on its own, and is checked against the reference instead.)"""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    wg, wu, wd = (torch.randn(s, generator=gen).bfloat16() * 0.1 for s in [(160, 64), (160, 64), (64, 160)])
    dy = torch.randn(9, 64, generator=gen).bfloat16()
    results = [grads(lambda *a, m=m: remat.swiglu_mlp(*a, recompute=m, backend=backend), [x, wg, wu, wd], dy)
               for m in ("activation", "block")]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


H, INTER, TOKENS = 4096, 11008, 8


@pytest.mark.parametrize("mode,per_token", [("none", H + 4 * INTER), ("activation", H + 2 * INTER), ("block", H)])
def test_swiglu_saved_bytes_contract_llama_size(mode, per_token):
    """At H=4096, I=11008, bf16 (on the meta device, so nothing is allocated): eager keeps
    (H + 4I) x 2 bytes per token; block mode keeps H x 2."""
    x = torch.randn(TOKENS, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    mlp = remat.nn.SwiGLUMLP(H, INTER, device="meta", dtype=torch.bfloat16, recompute=mode, backend="torch")
    assert saved_bytes(mlp, x) == TOKENS * per_token * 2


def test_eager_llama_mlp_saved_bytes():
    x = torch.randn(TOKENS, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    mlp = remat.nn.SwiGLUMLP(H, INTER, device="meta", dtype=torch.bfloat16)
    eager = saved_bytes(lambda: eager_gated(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                                            None, None, None, "silu"))
    assert eager == TOKENS * (H + 4 * INTER) * 2


@pytest.mark.parametrize("mode,per_token", [("none", 64 + 2 * 256), ("activation", 64 + 256), ("block", 64)])
@pytest.mark.parametrize("backend", mlp_backends())
def test_gelu_mlp_saved_bytes_contract(backend, mode, per_token):
    x = torch.randn(5, 64, requires_grad=True)
    mlp = remat.nn.GELUMLP(64, 256, recompute=mode, backend=backend)
    assert saved_bytes(mlp, x) == 5 * per_token * 4
    eager = saved_bytes(lambda: eager_gelu(x, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias,
                                           "gelu"))
    assert eager == 5 * (64 + 2 * 256) * 4


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("backend", mlp_backends())
def test_norm_mlp_saves_input_and_stats(backend, norm):
    x = torch.randn(7, 64, requires_grad=True)
    nw = nn.Parameter(torch.ones(64))
    nb = nn.Parameter(torch.zeros(64)) if norm == "layer" else None
    mlp = remat.nn.SwiGLUMLP(64, 96)
    stats = 1 if norm == "rms" else 2
    got = saved_bytes(remat.norm_mlp, x, nw, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                      norm_bias=nb, norm=norm, backend=backend)
    assert got == 7 * 64 * 4 + stats * 7 * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("backend", mlp_backends())
def test_norm_mlp_matches_float64_reference(backend, norm, dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(13, 96, generator=gen).to(dtype)
    nw = (1 + 0.2 * torch.randn(96, generator=gen)).to(dtype)
    nb = (0.1 * torch.randn(96, generator=gen)).to(dtype) if norm == "layer" else None
    wg, wu = ((torch.randn(200, 96, generator=gen) / 10).to(dtype) for _ in range(2))
    wd = (torch.randn(96, 200, generator=gen) / 14).to(dtype)
    dy = torch.randn(13, 96, generator=gen).to(dtype)

    def ref(x, nw, nb, wg, wu, wd):
        normed = F.rms_norm(x, (96,), nw, 1e-6) if norm == "rms" else F.layer_norm(x, (96,), nw, nb, 1e-5)
        return eager_gated(normed, wg, wu, wd, None, None, None, "silu")

    def fn(x, nw, nb, wg, wu, wd):
        return remat.norm_mlp(x, nw, wg, wu, wd, norm_bias=nb, norm=norm, backend=backend)

    tensors = [x, nw, nb, wg, wu, wd]
    got, stock = grads(fn, tensors, dy), grads(ref, tensors, dy)
    want = grads(ref, [None if t is None else t.double() for t in tensors], dy.double())
    for i, (g, s, w) in enumerate(zip(got, stock, want)):
        assert_within_2x_of_stock(f"output {i}", g, s, w, dtype)


def test_noncontiguous_input():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 2 * 64, generator=gen)
    x = base[:, ::2]
    mlp = remat.nn.SwiGLUMLP(64, 96)
    torch.testing.assert_close(mlp(x), mlp(x.contiguous()))


def test_modules_from_stock():
    class LlamaMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(32, 80, bias=False), nn.Linear(32, 80, bias=False)
            self.down_proj = nn.Linear(80, 32, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class GPT2MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.c_proj, self.act = nn.Linear(32, 128), nn.Linear(128, 32), nn.GELU(approximate="tanh")

        def forward(self, x):
            return self.c_proj(self.act(self.c_fc(x)))

    x = torch.randn(4, 32)
    llama, gpt2 = LlamaMLP(), GPT2MLP()
    for stock, mine, fresh in [(llama, remat.nn.SwiGLUMLP.from_module(llama), remat.nn.SwiGLUMLP(32, 80)),
                               (gpt2, remat.nn.GELUMLP.from_module(gpt2),
                                remat.nn.GELUMLP(32, 128, approximate="tanh"))]:
        assert mine.state_dict().keys() == stock.state_dict().keys()
        torch.testing.assert_close(mine(x), stock(x))
        fresh.load_state_dict(stock.state_dict())
        torch.testing.assert_close(fresh(x), stock(x))
    with pytest.raises(TypeError, match="gate_proj must be a linear module"):
        remat.nn.SwiGLUMLP.from_module(nn.Linear(2, 2))


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    mlp = remat.nn.SwiGLUMLP(64, 96)
    x = torch.randn(5, 64, requires_grad=True)
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    y_c = compiled(x)
    g_c = torch.autograd.grad(y_c.sum(), [x, mlp.gate_proj.weight])
    y_e = mlp(x)
    g_e = torch.autograd.grad(y_e.sum(), [x, mlp.gate_proj.weight])
    torch.testing.assert_close(y_c, y_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def test_autocast_bf16_cpu_matches_eager_module():
    mlp = remat.nn.SwiGLUMLP(64, 96)
    x = torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(x.bfloat16())
        y_ref = eager_gated(x.bfloat16(), mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                            None, None, None, "silu")
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref.to(torch.bfloat16), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x, w: remat.swiglu_mlp(x, w, w, w), ValueError, "w_down must have shape"),
        (lambda x, w: remat.swiglu_mlp(x, w, w, w.t().contiguous(), recompute="all"), ValueError, "recompute"),
        (lambda x, w: remat.swiglu_mlp(x, w.half(), w, w.t().contiguous()), TypeError, "w_gate must have x's dtype"),
        (lambda x, w: remat.geglu_mlp(x, w, w, w.t().contiguous(), approximate="fast"), ValueError, "approximate"),
        (lambda x, w: remat.gelu_mlp(x.int(), w, None, w.t().contiguous(), None), TypeError, "x must be float32"),
        (lambda x, w: remat.norm_mlp(x, torch.ones(8), w, w, w.t().contiguous(), norm="batch"), ValueError, "norm"),
    ],
    ids=["down-shape", "mode", "dtype", "approximate", "int-x", "norm-kind"],
)
def test_bad_input(call, error, match):
    x, w = torch.randn(3, 8), torch.randn(16, 8)
    with pytest.raises(error, match=match):
        call(x, w)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", mlp_backends())
def test_functional_under_autocast_matches_eager(backend, mode):
    """fp32 input and weights under bf16 autocast: the GEMMs run in bf16 as eager's do, and the
    backward (outside autocast) sees the forward's dtypes."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 64, generator=gen, requires_grad=True)
    wg, wu = (nn.Parameter(torch.randn(96, 64, generator=gen) / 8) for _ in range(2))
    wd = nn.Parameter(torch.randn(64, 96, generator=gen) / 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = remat.swiglu_mlp(x, wg, wu, wd, recompute=mode, backend=backend)
        y_ref = eager_gated(x, wg, wu, wd, None, None, None, "silu")
    assert y.dtype == y_ref.dtype == torch.bfloat16
    got = torch.autograd.grad(y.float().sum(), [x, wg, wd])
    want = torch.autograd.grad(y_ref.float().sum(), [x, wg, wd])
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=3e-2, atol=3e-2)


def test_unknown_activation_raises_before_any_kernel():
    with pytest.raises(ValueError, match="activation must be one of"):
        remat.nn.SwiGLUMLP(8, 16, activation="relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        remat.gated_mlp(torch.randn(2, 8), *(torch.randn(s) for s in [(16, 8), (16, 8), (8, 16)]),
                        activation="relu", recompute="block", backend="torch")
    with pytest.raises(ValueError, match="recompute must be one of"):
        remat.nn.GELUMLP(8, 16, recompute="sometimes")


def test_norm_mlp_activation_mode_matches_block_and_keeps_gate_up():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 48, generator=g, requires_grad=True)
    nw = nn.Parameter(torch.randn(48, generator=g))
    wg, wu = (nn.Parameter(torch.randn(96, 48, generator=g)) for _ in range(2))
    wd = nn.Parameter(torch.randn(48, 96, generator=g))
    dy = torch.randn(7, 48, generator=g)
    results = {}
    for mode in ("block", "activation"):
        y = remat.norm_mlp(x, nw, wg, wu, wd, recompute=mode)
        results[mode] = [y] + list(torch.autograd.grad(y, [x, nw, wg, wu, wd], dy))
    for got, want in zip(results["activation"], results["block"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    block = saved_bytes(remat.norm_mlp, x, nw, wg, wu, wd)
    assert block == 7 * 48 * 4 + 7 * 4
    assert saved_bytes(remat.norm_mlp, x, nw, wg, wu, wd, recompute="activation") == block + 2 * 7 * 96 * 4
    with pytest.raises(ValueError, match="recompute"):
        remat.norm_mlp(x, nw, wg, wu, wd, recompute="none")


@pytest.mark.parametrize("recompute", ["block", "activation"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_gelu_mlp_matches_reference_and_saves_its_contract(dtype, recompute):
    g = torch.Generator().manual_seed(6)
    tokens, hidden, inter = 9, 40, 72
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    params = [torch.randn(hidden, generator=g).to(dtype), torch.randn(hidden, generator=g).to(dtype),
              (torch.randn(inter, hidden, generator=g) / hidden**0.5).to(dtype),
              torch.randn(inter, generator=g).to(dtype),
              (torch.randn(hidden, inter, generator=g) / inter**0.5).to(dtype),
              torch.randn(hidden, generator=g).to(dtype)]
    dy = torch.randn(tokens, hidden, generator=g).to(dtype)

    def eager(x, nw, nb, w_fc, b_fc, w_proj, b_proj):
        normed = F.layer_norm(x, (hidden,), nw, nb, 1e-5)
        return F.linear(F.gelu(F.linear(normed, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)

    def fused(x, *p):
        return remat.norm_gelu_mlp(x, *p, approximate="tanh", recompute=recompute)

    tensors = [x] + params
    got, stock = grads(fused, tensors, dy), grads(eager, tensors, dy)
    want = grads(eager, [t.double() for t in tensors], dy.double())
    for i, (a, s, w) in enumerate(zip(got, stock, want)):
        assert_within_2x_of_stock(f"output {i}", a, s, w, dtype)
    weights = [nn.Parameter(p) for p in params]
    leaf = x.clone().requires_grad_()
    expected = tokens * hidden * leaf.element_size() + 2 * tokens * 4
    if recompute == "activation":
        expected += tokens * inter * leaf.element_size()
    assert saved_bytes(fused, leaf, *weights) == expected


# On a GPU (marked gpu; skipped where none is present): real sizes, every mode and backend.

GPU_MLP_SHAPES = [(1, 64, 96), (127, 96, 200), (1024, 1024, 2816)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "activation", "block"])
@pytest.mark.parametrize("tokens,hidden,inter", GPU_MLP_SHAPES, ids=[f"{t}x{h}x{i}" for t, h, i in GPU_MLP_SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh", "gelu"])
def test_gpu_mlp_matches_float64_reference(kind, backend, dtype, tokens, hidden, inter, mode):
    gen = torch.Generator(device="cuda").manual_seed(tokens + hidden)
    activation = {"swiglu": "silu", "geglu_tanh": "gelu_tanh", "gelu": "gelu"}[kind]
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    dy = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    if kind == "gelu":
        shapes = [(inter, hidden), (inter,), (hidden, inter), (hidden,)]
    else:
        shapes = [(inter, hidden), (inter, hidden), (hidden, inter)]
    params = [(torch.randn(*s, generator=gen, device="cuda") / s[-1] ** 0.5).to(dtype) for s in shapes]
    if kind == "gelu":
        fn = lambda *a: remat.gelu_mlp(*a, recompute=mode, backend=backend)  # noqa: E731
        ref = lambda *a: eager_gelu(*a, activation)  # noqa: E731
    else:
        fn = lambda x, wg, wu, wd: remat.gated_mlp(  # noqa: E731
            x, wg, wu, wd, activation=activation, recompute=mode, backend=backend)
        ref = lambda x, wg, wu, wd: eager_gated(x, wg, wu, wd, None, None, None, activation)  # noqa: E731
    tensors = [x] + params
    got, stock = grads(fn, tensors, dy), grads(ref, tensors, dy)
    want = grads(ref, [t.double().cpu() for t in tensors], dy.double().cpu())
    for i, (g, s, w) in enumerate(zip(got, stock, want)):
        assert_within_2x_of_stock(f"output {i}", g.cpu(), s.cpu(), w, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_mlp_block_saves_only_input(backend):
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mlp = remat.nn.SwiGLUMLP(1024, 2816, device="cuda", dtype=torch.bfloat16, backend=backend)
    assert saved_bytes(mlp, x) == 2048 * 1024 * 2
