"""The registered operators: torch.library.opcheck on each (schema, fake kernel, autograd
registration, dispatch), and torch.compile(fullgraph=True) through remat.rms_norm and
remat.layer_norm with no graph break and eager's results."""

import pytest
import torch

import remat
from remat import _extension
from remat.ops import norm as norm_ops

from helpers import CompileCounter, cpu_backends, gpu_backends

needs_extension = pytest.mark.skipif(not _extension.LOADED, reason="remat._C is not built")


def _norm_op_samples(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    rows, cols = 5, 33

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, r, w, b = rnd(rows, cols), rnd(rows, cols), rnd(cols), rnd(cols)
    x_strided = rnd(rows, cols + 4)[:, :cols]
    dy, dh = rnd(rows, cols), rnd(rows, cols)
    rstd = torch.rand(rows, generator=g) + 0.5
    mean = torch.randn(rows, generator=g)
    return {
        "rms_norm_fwd": [(x, w, None, 1e-6), (x_strided, None, r, 1e-5)],
        "layer_norm_fwd": [(x, w, b, None, 1e-5), (x_strided, w, None, r, 1e-5)],
        "rms_norm_bwd": [(dy, None, x, w, rstd), (dy, dh, x_strided, None, rstd)],
        "layer_norm_bwd": [(dy, None, x, w, mean, rstd, True), (dy, dh, x_strided, w, mean, rstd, False)],
    }


def _mlp_op_samples(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    gate, up, dh = (torch.randn(7, 45, generator=g).to(dtype) for _ in range(3))
    return {
        "glu_fwd": [(gate, up, "silu"), (gate, up, "gelu_tanh")],
        "glu_bwd": [(dh, gate, up, "silu", True), (dh, gate, up, "gelu", False)],
        "act_fwd": [(gate, "gelu"), (gate, "silu")],
        "act_bwd": [(dh, gate, "gelu_tanh", True), (dh, gate, "gelu", False)],
    }


def _fused_matmul_op_samples(dtype=torch.float16):
    """The Triton backend's fused-GEMM ops (remat_triton only): the gate/up dual GEMM with its
    activation epilogue and norm prologue, its backward recompute, the prologue's statistics, and
    the single GEMM with a bias + activation epilogue. Odd sizes, one tile each."""
    g = torch.Generator().manual_seed(2)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    tokens, hidden, inter = 7, 24, 20
    x, dh = rnd(tokens, hidden), rnd(tokens, inter)
    w_gate, w_up = rnd(inter, hidden, scale=0.2), rnd(inter, hidden, scale=0.2)
    bias, norm_weight, norm_bias = rnd(inter), rnd(hidden), rnd(hidden)
    mean = torch.randn(tokens, generator=g)
    rstd = torch.rand(tokens, generator=g) + 0.5
    return {
        "glu_matmul": [(x, w_gate, w_up, "silu", True, "none", None, None, None, None),
                       (x, w_gate, w_up, "gelu", False, "rms", None, rstd, norm_weight, None),
                       (x, w_gate, w_up, "gelu_tanh", False, "layer", mean, rstd, norm_weight, norm_bias)],
        "glu_matmul_bwd": [(x, w_gate, w_up, dh, "silu", True, "none", None, None, None, None),
                           (x, w_gate, w_up, dh, "gelu", False, "layer", mean, rstd, norm_weight, norm_bias)],
        "norm_stats": [(x, 1e-6, True), (x, 1e-5, False)],
        "act_matmul": [(x, w_gate, bias, "gelu_tanh", True), (x, w_gate, None, "silu", False)],
        "act_matmul_bwd": [(x, w_gate, bias, dh, "gelu", True), (x, w_gate, None, dh, "silu", False)],
    }


# Opchecked in tests/test_attention.py, tests/test_varlen_attention.py, tests/test_cross_entropy.py,
# tests/test_rope_rotate.py
# with their own samples.
_OPCHECKED_ELSEWHERE = {"attention_fwd", "attention_bwd", "attention_varlen_fwd", "attention_varlen_bwd",
                        "philox_dropout", "linear_cross_entropy_fwd", "linear_cross_entropy_bwd", "rope_rotate"}


def _namespaces():
    namespaces = []
    if _extension.LOADED:
        namespaces.append(("remat", "cpp"))
    if "triton" in cpu_backends():
        namespaces.append(("remat_triton", "triton"))
    return namespaces


def _samples(namespace):
    samples = {**_norm_op_samples(), **_mlp_op_samples()}
    if namespace == "remat_triton":
        samples.update(_fused_matmul_op_samples())
    return samples


def _op_cases():
    cases = []
    for namespace, label in _namespaces():
        for name, op_samples in _samples(namespace).items():
            for i, args in enumerate(op_samples):
                cases.append(pytest.param(namespace, name, args, id=f"{label}-{name}-{i}"))
    return cases


@pytest.mark.parametrize("namespace", [namespace for namespace, _ in _namespaces()])
def test_every_registered_op_is_opchecked(namespace):
    registered = {name.split("::", 1)[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith(f"{namespace}::")}
    assert registered, f"no {namespace} ops registered"
    unchecked = registered - set(_samples(namespace)) - _OPCHECKED_ELSEWHERE
    assert not unchecked, f"{namespace} ops without an opcheck case: {sorted(unchecked)}"


@pytest.mark.parametrize("namespace,name,args", _op_cases())
def test_opcheck(namespace, name, args):
    op = getattr(getattr(torch.ops, namespace), name)
    # test_aot_dispatch_dynamic compiles the op; the rest check schema, fake kernel and autograd
    # registration against the real kernel.
    torch.library.opcheck(op, args)


@needs_extension
@pytest.mark.parametrize("name", ["rms_norm_fwd", "layer_norm_fwd", "rms_norm_bwd", "layer_norm_bwd"])
def test_torch_backend_matches_cpp_ops(name):
    """The plain-PyTorch backend and the C++ CPU kernels implement the same contract."""
    torch_fn = getattr(norm_ops.TORCH_OPS, name)
    cpp_fn = getattr(norm_ops.EXTENSION_OPS, name)
    for args in _norm_op_samples(torch.float32)[name]:
        for got, want in zip(cpp_fn(*args), torch_fn(*args)):
            if want is None:
                continue
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
def test_compile_fullgraph_matches_eager(kind, backend):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 96, generator=g, requires_grad=True)
    r = torch.randn(4, 6, 96, generator=g, requires_grad=True)
    w = torch.randn(96, generator=g, requires_grad=True)
    b = torch.randn(96, generator=g, requires_grad=True)

    def block(x, r, w, b):
        if kind == "rms":
            y, h = remat.rms_norm(x, w, residual=r, backend=backend)
        else:
            y, h = remat.layer_norm(x, w, b, residual=r, backend=backend)
        return (y * h).sum()

    counter = CompileCounter()
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    loss_c = compiled(x, r, w, b)
    grads_c = torch.autograd.grad(loss_c, [x, r, w, b], allow_unused=True)
    loss_e = block(x, r, w, b)
    grads_e = torch.autograd.grad(loss_e, [x, r, w, b], allow_unused=True)
    assert counter.frames == 1
    torch.testing.assert_close(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        if ge is None:
            assert gc is None
        else:
            torch.testing.assert_close(gc, ge)


@needs_extension
def test_compile_inductor_runs_cpp_op():
    """With the default inductor backend the C++ op stays one extern call and gives eager's result."""
    torch._dynamo.reset()
    x = torch.randn(8, 64)
    w = torch.randn(64)
    compiled = torch.compile(lambda x, w: remat.rms_norm(x, w, backend="cpp") * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x, w), remat.rms_norm(x, w, backend="cpp") * 2)


def _dropout_op_matches_the_reference_stream(backend, device, dtype, numel, misaligned):
    """ops_for("dropout", backend).philox_dropout on a contiguous x of `numel` elements (starting
    one element into its buffer when misaligned, which is off every packed path) equals the
    reference stream (remat.reference.dropout_keep: word i % 4 of the Philox call at offset + i // 4)
    bitwise, with counters past 2^32 (offset high word set)."""
    from remat.ops import ops_for
    from remat.reference import dropout_keep

    g = torch.Generator().manual_seed(numel)
    buffer = torch.randn(numel + 1, generator=g).to(dtype).to(device)
    x = buffer[1:] if misaligned else buffer[:numel]
    rng = torch.tensor([0x1234_5678_9ABC_DEF0, (1 << 40) + 2**32 - 3], dtype=torch.int64, device=device)
    y = ops_for("dropout", backend).philox_dropout(x, rng, 0.35)
    keep = dropout_keep(rng[0], rng[1], numel, 0.35, device=device)
    divisor = torch.full((), 0.65, device=device)  # a tensor divisor: IEEE division in fp32
    assert torch.equal(y, torch.where(keep, x.float() / divisor, 0.0).to(dtype))


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("numel", [1, 6, 4097, 9003])
@pytest.mark.parametrize("backend", cpu_backends())
def test_dropout_op_is_the_reference_stream_at_any_length(backend, numel, misaligned):
    """Tails of 1-3 elements (a partial Philox group), the C++ kernel's 4096-element chunks and the
    Triton kernel's 1024-element blocks."""
    _dropout_op_matches_the_reference_stream(backend, "cpu", torch.float32, numel, misaligned)


@pytest.mark.gpu
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", [1, 6, 1023, 4 * 256 * 3 + 2, 70001])
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_dropout_op_is_the_reference_stream_at_any_length(backend, dtype, numel, misaligned):
    """The CUDA kernel's packed groups (aligned x, y) and element path (misaligned), its partial last
    group and grid tails; the Triton kernel's block tails."""
    _dropout_op_matches_the_reference_stream(backend, "cuda", dtype, numel, misaligned)
