"""The CUDA and Triton kernels on a GPU (marked `gpu`; skipped where no GPU is present): the same
float64-reference checks as on the CPU at real sizes, the vectorized and scalar paths, bitwise
determinism, and the saved-bytes contract."""

import pytest
import torch

import remat
from remat import backend as backend_mod
from remat.memory import saved_bytes

from _checks import assert_within_2x_of_stock
from remat.autograd.attention import draw_rng_state
from remat.reference import attention_dropout_keep
from test_attention import case, make_inputs, mask_from_output, run_and_check
from test_mlp import _grads, eager_gated, eager_gelu
from test_norm import check_against_reference, make_case, run_norm

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Narrow (warp per row), wide (block per row), past one 64K tile; odd widths take the scalar path.
SHAPES = [((4099,), 1), ((3, 333), 7), ((1000,), 1000), ((64,), 4096), ((17,), 4099), ((2, 8), 8192),
          ((3,), 70000), ((16384,), 4096)]
VARIANTS = ["plain", "residual", "no_affine", "noncontiguous"]


def gpu_backends():
    device = torch.device("cuda")
    return [b for b in ("cuda", "triton") if backend_mod.unavailable_reason(b, device) is None] if \
        torch.cuda.is_available() else ["cuda", "triton"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lead,n", SHAPES, ids=[f"{'x'.join(map(str, s))}x{n}" for s, n in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_gpu_norm_matches_float64_reference(kind, backend, dtype, lead, n, variant):
    check_against_reference(kind, lead, n, dtype, variant, backend, device="cuda")


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


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_gpu_gradients_bitwise_deterministic(kind, backend):
    x, weight, bias, residual, dy, dh = make_case(kind, (4096,), 4096, torch.bfloat16, "residual", device="cuda")
    fn = remat.rms_norm if kind == "rms" else remat.layer_norm
    first = run_norm(fn, kind, x, weight, bias, residual, dy, dh, 1e-5, backend=backend)
    second = run_norm(fn, kind, x, weight, bias, residual, dy, dh, 1e-5, backend=backend)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_saved_bytes_contract(backend):
    x = torch.randn(8, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.nn.Parameter(torch.ones(1024, device="cuda", dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.zeros(1024, device="cuda", dtype=torch.bfloat16))
    rows = 8 * 512
    assert saved_bytes(remat.rms_norm, x, w, residual=r, backend=backend) == rows * 1024 * 2 + rows * 4
    assert saved_bytes(remat.layer_norm, x, w, b, residual=r, backend=backend) == rows * 1024 * 2 + rows * 8


@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_compile_fullgraph(backend):
    torch._dynamo.reset()
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda x, w: remat.rms_norm(x, w, backend=backend), fullgraph=True)
    torch.testing.assert_close(compiled(x, w), remat.rms_norm(x, w, backend=backend))


MLP_SHAPES = [(1, 64, 96), (127, 96, 200), (1024, 1024, 2816)]


@pytest.mark.parametrize("mode", ["none", "activation", "block"])
@pytest.mark.parametrize("tokens,hidden,inter", MLP_SHAPES, ids=[f"{t}x{h}x{i}" for t, h, i in MLP_SHAPES])
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
        fn = lambda x, wg, wu, wd: remat.functional._gated_mlp(  # noqa: E731
            x, wg, wu, wd, None, None, None, activation, mode, backend)
        ref = lambda x, wg, wu, wd: eager_gated(x, wg, wu, wd, None, None, None, activation)  # noqa: E731
    tensors = [x] + params
    got, stock = _grads(fn, tensors, dy), _grads(ref, tensors, dy)
    want = _grads(ref, [t.double().cpu() for t in tensors], dy.double().cpu())
    for i, (g, s, w) in enumerate(zip(got, stock, want)):
        assert_within_2x_of_stock(f"output {i}", g.cpu(), s.cpu(), w, dtype)


@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_mlp_block_saves_only_input(backend):
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mlp = remat.nn.SwiGLUMLP(1024, 2816, device="cuda", dtype=torch.bfloat16, backend=backend)
    assert saved_bytes(mlp, x) == 2048 * 1024 * 2


# Real sizes, odd lengths, every feature; the float64 reference runs on the CPU.
GPU_ATTENTION_CASES = [
    case("b2-n1024-d128-gqa4-causal", 2, 1024, 1024, 8, 2, 128, causal=True),
    case("b1-n1000-d64", 1, 1000, 1000, 4, 4, 64),
    case("n1-m4099-d64-mqa-causal", 1, 1, 4099, 8, 1, 64, causal=True),
    case("n257-m100-d80-causal-emptyrows", 1, 257, 100, 4, 2, 80, causal=True),
    case("n300-m511-d96-rope-window-softcap-dropout", 2, 300, 511, 4, 2, 96, causal=True, rope="per_batch",
         window=(100, None), softcap=30.0, dropout=0.1),
    case("n333-d192-noncontig-bhnd", 1, 333, 333, 2, 1, 192, layout="bhnd"),
    case("n129-d256-window-both", 1, 129, 129, 2, 2, 256, window=(17, 9)),
    case("n77-d16-dropout", 2, 77, 77, 2, 1, 16, dropout=0.3),
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomics"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", GPU_ATTENTION_CASES)
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_attention_matches_float64_reference(backend, spec, dtype, deterministic):
    if backend == "cuda" and dtype == torch.float32:
        pytest.skip("the cuda attention kernels take float16/bfloat16 (fp32 raises ValueError)")
    run_and_check(spec, dtype, backend, deterministic=deterministic, device="cuda")


@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_attention_fp32_on_cuda_backend_raises_or_runs(backend):
    q = torch.randn(1, 8, 2, 64, device="cuda")
    if backend == "cuda":
        with pytest.raises(ValueError, match="float16/bfloat16"):
            remat.attention(q, q, q, backend=backend)
    else:
        assert torch.isfinite(remat.attention(q, q, q, backend=backend)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_dropout_masks_agree_across_backends(dtype):
    """The CUDA and Triton kernels draw the reference Philox stream: the same mask for the same
    generator state."""
    b, hq, n, m, p = 2, 3, 70, 64, 0.25
    torch.manual_seed(5)
    rng = draw_rng_state("cuda").cpu()
    expected = attention_dropout_keep(rng[0], rng[1], (b, hq, n, m), p)
    for backend in gpu_backends():
        assert torch.equal(mask_from_output(backend, b, hq, n, m, p, seed=5, device="cuda", dtype=dtype), expected)


@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_attention_deterministic_backward_bitwise(backend):
    spec = dict(b=2, n=1024, m=1024, hq=8, hkv=2, d=128, causal=True)
    runs = []
    for _ in range(2):
        q, k, v, dout, _ = make_inputs(spec, torch.bfloat16, device="cuda")
        leaves = [t.requires_grad_() for t in (q, k, v)]
        remat.attention(*leaves, causal=True, deterministic=True, backend=backend).backward(dout)
        runs.append([t.grad for t in leaves])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_attention_saves_no_attention_matrix(backend):
    b, n, hq, hkv, d = 2, 2048, 8, 2, 128
    q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    contract = (2 * q.numel() + k.numel() + v.numel()) * 2 + b * hq * n * 4 + 16
    assert saved_bytes(remat.attention, q, k, v, causal=True, dropout_p=0.1, backend=backend) == contract


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_philox_dropout_is_the_reference_stream(backend, dtype):
    from remat.reference import philox_randint, philox_uniform

    x = torch.randn(1000, 4099, device="cuda").to(dtype).requires_grad_()
    torch.manual_seed(2)
    rng = draw_rng_state("cuda")
    torch.manual_seed(2)
    y = remat.dropout(x, 0.2, backend=backend)
    keep = (philox_uniform(philox_randint(rng[0], torch.arange(x.numel(), device="cuda") + rng[1])) >= 0.2)
    divisor = torch.full((), 0.8, device="cuda")  # a tensor divisor: IEEE division, as the kernels
    want = torch.where(keep.view(x.shape), x.detach().float() / divisor, 0.0).to(dtype)
    assert torch.equal(y, want)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.where(keep.view(x.shape), torch.ones_like(x).float() / divisor, 0.0).to(dtype))
