"""Flash attention, every backend that runs here, against a float64 eager reference: forward and
dq, dk, dv under the 2x-stock-PyTorch rule (DESIGN.md section 7), over dtypes, lengths 1, 17,
100, 257 with N != M, head dims 16, 64, 80, 128, GQA 4:1 and MQA, causal, sliding windows, softcap,
rope and dropout (the reference applies the same Philox mask); plus the dropout mask itself, bitwise
determinism, the saved-bytes contract, torch.compile, opcheck and bad input."""

import importlib

import numpy as np
import pytest
import torch

import remat
from remat import _extension
from remat.autograd.common import draw_rng_state
from remat.memory import SavedTensorLog, saved_bytes
from remat.reference import attention_dropout_keep, attention_reference

from _checks import assert_within_2x_of_stock
from helpers import (
    DTYPES,
    CompileCounter,
    OpCalls,
    case,
    cpu_backends,
    gpu_backends,
    make_inputs,
    mask_from_output,
    run_and_check,
    triton_bwd_sample,
)

functional_attention = importlib.import_module("remat.functional.attention")

# Shapes and options for the C++ CPU and torch backends.
CASES = [
    case("b2-n17-d64", 2, 17, 17, 2, 2, 64),
    case("b2-n17-d64-causal", 2, 17, 17, 2, 2, 64, causal=True),
    case("n1-m100-d16-mqa-causal", 1, 1, 100, 4, 1, 16, causal=True),
    case("n100-m257-d80-gqa4-causal", 1, 100, 257, 8, 2, 80, causal=True),
    case("n257-m100-d128-gqa4-causal-emptyrows", 1, 257, 100, 4, 1, 128, causal=True),
    case("n257-d128-rope-causal", 1, 257, 257, 2, 1, 128, causal=True, rope="shared"),
    case("n100-d64-window16-8", 1, 100, 100, 2, 2, 64, window=(16, 8)),
    case("n100-m140-d64-window32-causal", 1, 100, 140, 2, 1, 64, window=(32, None), causal=True),
    case("n17-m33-d64-softcap", 2, 17, 33, 2, 2, 64, softcap=5.0),
    case("n17-m40-d64-rope-causal-gqa", 1, 17, 40, 4, 2, 64, causal=True, rope="per_batch"),
    case("n33-d64-dropout", 2, 33, 33, 2, 1, 64, dropout=0.25),
    case("n100-d80-rope-batch-window-softcap-dropout-gqa", 2, 100, 100, 4, 2, 80, causal=True,
         rope="per_batch", window=(40, None), softcap=20.0, dropout=0.1),
    case("n1-m1-d16", 1, 1, 1, 1, 1, 16),
    case("noncontig-bhnd-n17-d64-causal", 2, 17, 17, 4, 2, 64, causal=True, layout="bhnd"),
    case("noncontig-slices-n33-m17-d72", 1, 33, 17, 2, 1, 72, noncontiguous=True),
]

# Every head-dim range the API takes (1..256) on the CPU backends: tiny and odd D (no rope, which
# needs an even D), and the large D the CUDA kernels bucket at 192 and 256.
HEAD_DIM_CASES = [case(f"n9-m13-d{d}-causal", 1, 9, 13, 2, 1, d, causal=True) for d in (1, 2, 3, 8, 15)] + [
    case(f"n9-m13-d{d}-rope-causal", 1, 9, 13, 2, 1, d, causal=True, rope="shared") for d in (16, 160, 200, 256)]

def _interpreter_sized(param):
    """The interpreter runs Triton kernels as Python, one program at a time: cases up to
    4 x 100 x 100 scores (the larger ones take 10-15 s each there)."""
    spec = param.values[0]
    return spec["n"] * spec["m"] * spec["hq"] <= 40_000


# Small cases for the interpreter, beyond the CASES it also runs.
TRITON_CASES = [
    case("b2-n17-d64-causal", 2, 17, 17, 2, 2, 64, causal=True),
    case("n1-m33-d16-mqa-causal", 1, 1, 33, 4, 1, 16, causal=True),
    case("n33-m17-d80-gqa-causal-emptyrows", 1, 33, 17, 4, 1, 80, causal=True),
    case("n20-d64-rope-window", 1, 20, 20, 2, 1, 64, rope="per_batch", window=(5, 3)),
    case("n17-m24-d64-softcap-dropout", 1, 17, 24, 2, 2, 64, softcap=5.0, dropout=0.25),
    case("noncontig-bhnd-n17-d32", 1, 17, 17, 2, 1, 32, layout="bhnd"),
    # CASES' combined case at 70 tokens (two query and key blocks of 64, the second partial), half
    # its interpreted cost: every feature at once on the Triton kernels.
    case("n70-d80-rope-batch-window-softcap-dropout-gqa", 2, 70, 70, 4, 2, 80, causal=True,
         rope="per_batch", window=(40, None), softcap=20.0, dropout=0.1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CASES)
@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
def test_attention_matches_reference(backend, spec, dtype):
    run_and_check(spec, dtype, backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", HEAD_DIM_CASES)
@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
def test_attention_every_head_dim_range(backend, spec, dtype, request):
    if (backend, spec["d"], dtype) == ("cpp", 15, torch.bfloat16):
        # Open finding (issue 11): on this draw the C++ CPU kernel's bf16 dq has 3.5x stock's error
        # (one element 11 ulps off the float64 value, where the torch backend is 1.6 ulps off); other
        # seeds and D 13-17 are within the rule. strict: the day it passes, this marker must go.
        request.applymarker(pytest.mark.xfail(strict=True, reason="cpp bf16 dq at D=15 exceeds the 2x rule"))
    run_and_check(spec, dtype, backend)


def _triton_cases():
    """(spec, dtype) for the interpreter: every small case in every dtype; the case combining every
    feature in bfloat16 only (about 30 s per dtype there), its roundings being those of the small
    cases in each dtype, at 70 tokens (TRITON_CASES) instead of CASES' 100 (65 s)."""
    combined = "n70-d80-rope-batch-window-softcap-dropout-gqa"
    cases = []
    for spec in TRITON_CASES + [c for c in CASES if _interpreter_sized(c) and "-rope-batch-window-" not in c.id]:
        dtypes = [torch.bfloat16] if spec.id == combined else DTYPES
        cases += [pytest.param(spec.values[0], dtype, id=f"{spec.id}-{dtype}") for dtype in dtypes]
    assert any(combined in case.id for case in cases)
    return cases


@pytest.mark.parametrize("spec,dtype", _triton_cases())
@pytest.mark.skipif("triton" not in cpu_backends(), reason="Triton runs on the CPU only under TRITON_INTERPRET=1")
def test_triton_attention_matches_reference(spec, dtype):
    run_and_check(spec, dtype, "triton", deterministic=True)


@pytest.mark.skipif("triton" not in cpu_backends(), reason="Triton runs on the CPU only under TRITON_INTERPRET=1")
def test_triton_rope_rotates_once_per_pass_when_training(monkeypatch):
    """Triton with rope (remat.ops.attention.rope_rotated_once): a call with a backward runs the
    forward and backward kernels without rope tables (q and k rotated once per pass outside, as
    measured faster on an H200) and saves what the torch backend saves (the rotated copies never);
    a forward-only call (torch.no_grad(), even on tensors that require grad) keeps the tables in the
    forward kernel, with the same output; tables that alone require grad (q, k, v do not) take the
    rotated-once path and the backward runs."""
    from remat.kernels import attention as kernels

    launched = []
    for name in ("attention_fwd", "attention_bwd"):
        real = getattr(kernels, name)

        def record(*args, name=name, real=real):
            cos = args[3] if name == "attention_fwd" else args[6]
            launched.append((name, cos is not None))
            return real(*args)

        monkeypatch.setattr(kernels, name, record)
    spec = dict(b=1, n=9, m=12, hq=2, hkv=1, d=32, causal=True, rope="per_batch")
    q, k, v, dout, rope = make_inputs(spec, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    trained = remat.attention(*leaves, causal=True, rope=rope, backend="triton")
    trained.backward(dout)
    assert launched == [("attention_fwd", False), ("attention_bwd", False)]
    launched.clear()
    with torch.no_grad():
        inferred = remat.attention(*leaves, causal=True, rope=rope, backend="triton")
    assert launched == [("attention_fwd", True)]
    assert torch.equal(inferred, trained.detach())
    launched.clear()
    tables = [t.detach().clone().requires_grad_() for t in rope]
    remat.attention(q, k, v, causal=True, rope=tuple(tables), backend="triton").sum().backward()
    assert launched == [("attention_fwd", False), ("attention_bwd", False)]
    saved = {backend: saved_bytes(remat.attention, *leaves, causal=True, rope=rope, backend=backend)
             for backend in ("triton", "torch")}
    assert saved["triton"] == saved["torch"]


def test_triton_backward_ops_refuse_rope_tables_when_traced():
    """The Triton backward ops' fake (meta) kernels refuse rope tables as the launchers do, so a
    traced graph fails at trace time rather than at run time (remat.ops.attention)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(1, 5, 2, 8), torch.empty(1, 6, 1, 8), torch.empty(1, 6, 1, 8)
        o, lse, tables = torch.empty(1, 5, 2, 8), torch.empty(1, 2, 5), torch.empty(1, 6, 4)
        with pytest.raises(ValueError, match="already rotated"):
            torch.ops.remat_triton.attention_bwd(o, q, k, v, o, lse, tables, tables, None, 0.35, 0.0, -1, 0, 0.0,
                                                 True)
        cu = torch.zeros(2, dtype=torch.int32)
        with pytest.raises(ValueError, match="already rotated"):
            torch.ops.remat_triton.attention_varlen_bwd(o[0], q[0], k[0], v[0], o[0], lse[0], cu, cu, 5, 6, tables,
                                                        tables, None, 0.35, 0.0, -1, 0, 0.0, True)


@pytest.mark.skipif("triton" not in cpu_backends(), reason="Triton runs on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("spec", [TRITON_CASES[0], TRITON_CASES[2], TRITON_CASES[4]])
def test_triton_fast_backward_matches_reference(spec):
    """deterministic=False: dq accumulated with fp32 atomics."""
    run_and_check(spec, torch.float32, "triton", deterministic=False)


@pytest.mark.parametrize("backend", cpu_backends())
def test_dropout_mask_is_the_reference_philox_stream(backend):
    b, hq, n, m, p = 2, 3, 5, 32, 0.3
    torch.manual_seed(7)
    rng = draw_rng_state("cpu")
    expected = attention_dropout_keep(rng[0], rng[1], (b, hq, n, m), p)
    got = mask_from_output(backend, b, hq, n, m, p, seed=7)
    assert torch.equal(got, expected)
    assert 0.5 < expected.float().mean().item() < 0.9
    # A different generator state gives a different mask.
    assert not torch.equal(mask_from_output(backend, b, hq, n, m, p, seed=8), expected)


@pytest.mark.parametrize("backend", cpu_backends())
def test_deterministic_backward_is_bitwise_reproducible(backend):
    spec = dict(b=1, n=17, m=24, hq=4, hkv=2, d=32, causal=True, dropout=0.2)
    runs = []
    for _ in range(2):
        q, k, v, dout, _ = make_inputs(spec, torch.float32)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        torch.manual_seed(3)
        remat.attention(*leaves, causal=True, dropout_p=0.2, deterministic=True, backend=backend).backward(dout)
        runs.append([t.grad for t in leaves])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["plain", "dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", cpu_backends() + ["aten"])
def test_saves_qkv_o_lse_and_rng_only(backend, dtype, dropout):
    if backend == "aten" and dropout:
        pytest.skip("PyTorch's CPU flash kernel takes no dropout: refused, tested above")
    b, n, m, hq, hkv, d = 2, 24, 40, 4, 2, 32
    q = torch.randn(b, n, hq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, m, hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, m, hkv, d, dtype=dtype, requires_grad=True)
    element = q.element_size()
    contract = (2 * q.numel() + k.numel() + v.numel()) * element + b * hq * n * 4 + (16 if dropout else 0)
    causal = backend != "aten"  # N != M here, where the aten core's top-left causal mask is refused
    assert saved_bytes(remat.attention, q, k, v, causal=causal, dropout_p=dropout, backend=backend) == contract
    # Eager attention at the same shape keeps the [B, Hq, N, M] probabilities (and more).
    eager = saved_bytes(attention_reference, q, k, v, causal=True)
    assert eager >= contract - b * hq * n * 4 + b * hq * n * m * element


def test_saved_tensors_are_the_contract_tensors_with_rope():
    b, n, hq, d = 1, 9, 2, 16
    q, k, v = (torch.randn(b, n, hq, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    angles = torch.rand(n, d // 2)
    cos, sin = angles.cos(), angles.sin()
    with SavedTensorLog() as log:
        remat.attention(q, k, v, rope=(cos, sin), dropout_p=0.5, backend="torch")
    shapes = sorted((tuple(s.shape), s.dtype) for s in log.saved)
    expected = [((b, hq, n), torch.float32), ((n, d // 2), torch.float32), ((n, d // 2), torch.float32),
                ((2,), torch.int64)] + [((b, n, hq, d), torch.bfloat16)] * 4
    assert shapes == sorted(expected)


@pytest.mark.skipif(not _extension.LOADED, reason="remat._C is not built")
def test_cpp_and_torch_backends_agree():
    spec = dict(b=2, n=33, m=40, hq=4, hkv=2, d=64, causal=True, rope="per_batch", softcap=10.0, dropout=0.2)
    results = {}
    for backend in ("cpp", "torch"):
        q, k, v, dout, rope = make_inputs(spec, torch.float32)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)
        o = remat.attention(*leaves, causal=True, rope=rope, softcap=10.0, dropout_p=0.2, backend=backend)
        o.backward(dout)
        results[backend] = [o] + [t.grad for t in leaves]
    for got, want in zip(results["cpp"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"] + ["aten"])
def test_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 12, 4, 32, generator=g, requires_grad=True)
    k = torch.randn(2, 12, 2, 32, generator=g, requires_grad=True)
    v = torch.randn(2, 12, 2, 32, generator=g, requires_grad=True)
    angles = torch.rand(12, 16, generator=g)
    rope = (angles.cos(), angles.sin())

    def block(q, k, v):
        softcap = None if backend == "aten" else 30.0  # the aten core has no softcap
        return (remat.attention(q, k, v, causal=True, rope=rope, softcap=softcap, backend=backend) ** 2).sum()

    counter = CompileCounter()
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    loss_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(loss_c, [q, k, v])
    loss_e = block(q, k, v)
    grads_e = torch.autograd.grad(loss_e, [q, k, v])
    assert counter.frames == 1
    torch.testing.assert_close(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge)


def test_compile_takes_a_scale_that_became_symbolic():
    """dynamo makes a Python float that changed between calls a SymFloat (two models of one class
    with different head sizes meet this in one process): the argument checks still trace, one graph
    per call, and the results are eager's."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g, requires_grad=True) for _ in range(3))
    counter = CompileCounter()
    compiled = torch.compile(lambda q, k, v, scale: remat.attention(q, k, v, causal=True, scale=scale),
                             backend=counter, fullgraph=True)
    for scale in (0.25, 0.3, 0.35):
        torch.testing.assert_close(compiled(q, k, v, scale), remat.attention(q, k, v, causal=True, scale=scale))


def _op_samples():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 7, 4, 16, generator=g)
    k = torch.randn(1, 9, 2, 24, generator=g)[..., :16]
    v = torch.randn(1, 9, 2, 16, generator=g)
    angles = torch.rand(1, 9, 8, generator=g)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    rng = torch.tensor([5, 6])
    fwd = [(q, k, v, None, None, None, 0.25, 0.0, -1, 0, 0.0), (q, k, v, cos, sin, rng, 0.3, 2.0, 3, 1, 0.2)]
    bwd = []
    for args in fwd:
        o, lse = remat.ops.attention.TORCH_OPS.attention_fwd(*args)
        bwd.append((torch.randn_like(o), q, k, v, o, lse, *args[3:], True))
    return {"attention_fwd": fwd, "attention_bwd": bwd}


def _opcheck_cases():
    namespaces = []
    if _extension.LOADED:
        namespaces.append(("remat", "cpp"))
    if "triton" in cpu_backends():
        namespaces.append(("remat_triton", "triton"))
    return [pytest.param(ns, name, triton_bwd_sample(label, name, args, 6), id=f"{label}-{name}-{i}")
            for ns, label in namespaces for name, samples in _op_samples().items() for i, args in enumerate(samples)]


@pytest.mark.parametrize("namespace,name,args", _opcheck_cases())
def test_opcheck(namespace, name, args):
    torch.library.opcheck(getattr(getattr(torch.ops, namespace), name), args)


def _qkv(b=1, n=5, m=5, hq=2, hkv=1, d=16, dtype=torch.float32):
    return torch.randn(b, n, hq, d, dtype=dtype), torch.randn(b, m, hkv, d, dtype=dtype), torch.randn(
        b, m, hkv, d, dtype=dtype)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(), TypeError, "float32, float16 or bfloat16"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(window=(-1, 2)), ValueError, "window left"),
    (dict(window=5), TypeError, "window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(layout="nbhd"), ValueError, "layout"),
    (dict(causal=1), TypeError, "causal"),
], ids=["int-q", "dropout", "window-left", "window-type", "softcap", "scale", "layout", "causal"])
def test_bad_options_raise(kwargs, error, match):
    q, k, v = _qkv()
    if match.startswith("float32"):
        q = q.to(torch.int32)
    with pytest.raises(error, match=match):
        remat.attention(q, k, v, **kwargs)


def test_bad_shapes_raise():
    q, k, v = _qkv(hq=3, hkv=2)
    with pytest.raises(ValueError, match="multiple of k/v's heads"):
        remat.attention(q, k, v)
    q, k, v = _qkv(d=264)
    with pytest.raises(ValueError, match="head dim"):
        remat.attention(q, k, v)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"k must be \[B=1"):
        remat.attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match=r"D=16\] in bnhd layout"):
        remat.attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="one shape"):
        remat.attention(q, k, v[:, :3])
    with pytest.raises(TypeError, match="q's dtype"):
        remat.attention(q, k.half(), v.half())
    with pytest.raises(ValueError, match="4-D"):
        remat.attention(q[0], k, v)
    angles = torch.rand(5, 8)
    with pytest.raises(ValueError, match="N <= M"):
        remat.attention(*_qkv(n=6, m=5), rope=(angles.cos(), angles.sin()))
    with pytest.raises(ValueError, match="S >= M"):
        remat.attention(*_qkv(m=6, n=6), rope=(angles.cos(), angles.sin()))
    with pytest.raises(ValueError, match="even head dim"):
        remat.attention(*_qkv(d=15), rope=(angles.cos(), angles.sin()))


def test_cuda_backend_on_cpu_tensors_raises():
    with pytest.raises(remat.BackendUnavailableError, match="cuda"):
        remat.attention(*_qkv(), backend="cuda")


def test_inputs_are_not_modified():
    q, k, v = (t.requires_grad_() for t in _qkv(n=9, m=9, hq=4, hkv=2))
    copies = [t.detach().clone() for t in (q, k, v)]
    angles = torch.rand(9, 8)
    remat.attention(q, k, v, causal=True, rope=(angles.cos(), angles.sin())).sum().backward()
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t.detach(), c)


def test_second_backward_raises():
    q, k, v = (t.requires_grad_() for t in _qkv())
    o = remat.attention(q, k, v)
    o.sum().backward(retain_graph=False)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        o.sum().backward()


def _eager_attention_module(module, x, position_ids):
    """What the stock Llama attention computes, in x's dtype, with the module's weights."""
    batch, n, _ = x.shape
    w = {name: getattr(module, name).weight.to(x.dtype) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    q = (x @ w["q_proj"].T).view(batch, n, module.num_heads, module.head_dim)
    k = (x @ w["k_proj"].T).view(batch, n, module.num_kv_heads, module.head_dim)
    v = (x @ w["v_proj"].T).view(batch, n, module.num_kv_heads, module.head_dim)
    cos, sin = module.rope_tables(position_ids, x.device)
    o = attention_reference(q, k, v, causal=True, rope=(cos.to(x.dtype), sin.to(x.dtype)))
    return o.reshape(batch, n, -1) @ w["o_proj"].T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_module_matches_eager_llama_attention(dtype):
    torch.manual_seed(0)
    module = remat.nn.Attention(64, num_heads=4, num_kv_heads=2, rope_theta=10000.0)
    x = torch.randn(2, 11, 64)
    position_ids = torch.stack([torch.arange(11), torch.arange(3, 14)])
    xs = [x.to(dtype).requires_grad_() for _ in range(3)]
    module64 = remat.nn.Attention(64, num_heads=4, num_kv_heads=2, rope_theta=10000.0, dtype=torch.float64)
    module64.load_state_dict(module.state_dict())
    reference = _eager_attention_module(module64, xs[0].detach().double().requires_grad_(), position_ids)
    stock = _eager_attention_module(module.to(dtype), xs[1], position_ids)
    got = module.to(dtype)(xs[2], position_ids=position_ids)
    assert_within_2x_of_stock("out", got.detach(), stock.detach(), reference.detach(), dtype)
    grad = torch.randn_like(reference)
    ref_x = xs[0].detach().double().requires_grad_()
    reference = _eager_attention_module(module64, ref_x, position_ids)
    reference.backward(grad)
    stock.backward(grad.to(dtype))
    got.backward(grad.to(dtype))
    assert_within_2x_of_stock("dx", xs[2].grad, xs[1].grad, ref_x.grad, dtype)


def test_attention_module_from_module_shares_parameters():
    class LlamaLikeAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
                                                  attention_dropout=0.0))()
            self.head_dim = 8
            self.q_proj = torch.nn.Linear(32, 32, bias=False)
            self.k_proj = torch.nn.Linear(32, 8, bias=False)
            self.v_proj = torch.nn.Linear(32, 8, bias=False)
            self.o_proj = torch.nn.Linear(32, 32, bias=False)

    stock = LlamaLikeAttention()
    module = remat.nn.Attention.from_module(stock)
    assert (module.num_heads, module.num_kv_heads, module.head_dim, module.rope_theta) == (4, 1, 8, 500000.0)
    assert module.q_proj.weight is stock.q_proj.weight and module.o_proj.weight is stock.o_proj.weight
    assert set(module.state_dict()) == {f"{p}_proj.weight" for p in "qkvo"}
    with pytest.raises(TypeError, match="q_proj"):
        remat.nn.Attention.from_module(torch.nn.Linear(4, 4))


def test_attention_module_dropout_only_in_training():
    torch.manual_seed(0)
    module = remat.nn.Attention(32, num_heads=2, dropout=0.5)
    x = torch.randn(1, 6, 32)
    module.eval()
    assert torch.equal(module(x), module(x))
    module.train()
    torch.manual_seed(1)
    first = module(x)
    torch.manual_seed(1)
    assert torch.equal(first, module(x))
    torch.manual_seed(2)
    assert not torch.equal(first, module(x))


def test_attention_module_saves_no_attention_matrix():
    module = remat.nn.Attention(64, num_heads=4, num_kv_heads=2, rope_theta=10000.0).to(torch.bfloat16)
    x = torch.randn(2, 50, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = saved_bytes(module, x)
    # x (for the three input projections), q, k, v, o (for o_proj's weight gradient and attention),
    # fp32 lse, the fp32 rope tables [1, N, D/2] x 2.
    tokens = 2 * 50
    expected = tokens * (64 + 64 + 32 + 32 + 64) * 2 + 2 * 4 * 50 * 4 + 2 * 50 * 8 * 4
    assert saved == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", cpu_backends())
def test_philox_dropout_regenerates_its_mask_and_stores_none(backend, dtype):
    from remat.reference import dropout_keep

    x = torch.randn(4, 2053).to(dtype).requires_grad_()
    torch.manual_seed(3)
    rng = draw_rng_state("cpu")
    torch.manual_seed(3)
    y = remat.dropout(x, 0.3, backend=backend)
    keep = dropout_keep(rng[0], rng[1], x.numel(), 0.3).view(x.shape)
    # IEEE fp32 division by float32(0.7), computed by numpy, not by any remat code path.
    kept = torch.from_numpy(x.detach().float().numpy() / np.float32(0.7))
    want = torch.where(keep, kept, 0.0).to(dtype)
    assert torch.equal(y, want)
    assert 0.6 < keep.float().mean().item() < 0.8
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, torch.where(keep, torch.from_numpy(dy.float().numpy() / np.float32(0.7)), 0.0).to(dtype))
    torch.manual_seed(3)
    assert saved_bytes(remat.dropout, x, 0.3, backend=backend) == 16
    assert remat.dropout(x, 0.3, training=False) is x
    with pytest.raises(ValueError, match="p must be"):
        remat.dropout(x, 1.0)


def _dropout_opcheck_cases():
    x = torch.randn(3, 1000).bfloat16()
    rng = torch.tensor([7, 2**40 + 3])
    cases = []
    if _extension.LOADED:
        cases.append(pytest.param("remat", id="cpp"))
    if "triton" in cpu_backends():
        cases.append(pytest.param("remat_triton", id="triton"))
    return [pytest.param(c.values[0], (x, rng, 0.25), id=c.id) for c in cases]


@pytest.mark.parametrize("namespace,args", _dropout_opcheck_cases())
def test_philox_dropout_opcheck(namespace, args):
    torch.library.opcheck(getattr(torch.ops, namespace).philox_dropout, args)



@pytest.mark.skipif("triton" not in cpu_backends(), reason="Triton runs on the CPU only under TRITON_INTERPRET=1")
def test_deterministic_algorithms_mode_refuses_atomics():
    """Under torch.use_deterministic_algorithms(True), deterministic=False (the atomic GPU
    backward) raises, or with warn_only warns and runs the deterministic backward."""
    q = torch.randn(1, 17, 2, 16, requires_grad=True)
    want = torch.autograd.grad(remat.attention(q, q, q, causal=True, backend="triton").sum(), q)[0]
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="deterministic=False"):
            remat.attention(q, q, q, causal=True, deterministic=False, backend="triton")
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="deterministic backward instead"):
            out = remat.attention(q, q, q, causal=True, deterministic=False, backend="triton")
        assert torch.equal(torch.autograd.grad(out.sum(), q)[0], want)
        # The CPU backends are always deterministic: nothing to refuse.
        remat.attention(q, q, q, causal=True, deterministic=False, backend="torch")
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])



def _aten_takes(spec):
    """Whether the aten core (PyTorch's flash kernel) takes this CPU case: no softcap, window or
    dropout, and causal only with N == M (its causal mask aligns top-left)."""
    return not (spec.get("softcap") or spec.get("window") or spec.get("dropout")
                or (spec.get("causal") and spec["n"] != spec["m"]))


ATEN_CASES = [c for c in CASES + HEAD_DIM_CASES if _aten_takes(c.values[0])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ATEN_CASES)
def test_aten_core_matches_reference(spec, dtype):
    """PyTorch's CPU flash kernel inside remat's Function (rope applied around it): the 2x rule
    against the float64 reference, on every CPU case it takes (rope, GQA/MQA, layouts, odd D)."""
    run_and_check(spec, dtype, "aten")


@pytest.mark.parametrize("options,match", [
    (dict(softcap=5.0), "softcap"), (dict(window=(4, None)), "sliding window"), (dict(dropout_p=0.1), "dropout"),
    (dict(window=(0, None)), "sliding window"), (dict(causal=True, n=5, m=9), "top-left"),
])
def test_aten_core_refuses_what_it_lacks(options, match):
    options = dict(options)
    n, m = options.pop("n", 7), options.pop("m", 7)
    q, k = torch.randn(1, n, 2, 16), torch.randn(1, m, 2, 16)
    with pytest.raises(remat.BackendUnavailableError, match=match):
        remat.attention(q, k, k, backend="aten", **options)
    with pytest.raises(remat.BackendUnavailableError, match="no norm operators"):
        remat.rms_norm(torch.randn(2, 8), None, backend="aten")


def _record_attention_backends(monkeypatch):
    """A list that records the backend of each attention pass: the operator lookups of remat's
    Functions (forward and backward; the fused layers take theirs from the same place), and "aten"
    once per call that runs PyTorch's CPU flash kernel with its own autograd node
    (remat.ops.attention.cpu_flash_attention)."""
    import remat.autograd.attention as attention_function

    used = []
    real_ops_for, real_native = attention_function.ops_for, functional_attention.cpu_flash_attention
    monkeypatch.setattr(attention_function, "ops_for",
                        lambda block, name: used.append(name) or real_ops_for(block, name))
    monkeypatch.setattr(functional_attention, "cpu_flash_attention",
                        lambda *args: used.append("aten") or real_native(*args))
    monkeypatch.delenv("REMAT_BACKEND", raising=False)
    return used


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cpu_aten_call_without_a_function_equals_the_aten_core(dtype, causal):
    """A plain CPU call on the aten core (remat.ops.attention.cpu_flash_attention: PyTorch's flash
    kernel with its own autograd node) gives o and dq, dk, dv bitwise equal to the aten core inside
    remat's AttentionFunction (the same kernels), saves the same bytes (q, k, v, o, fp32 lse), and
    leaves its strided inputs alone; GQA, N != M without a mask."""
    from remat.autograd.attention import AttentionFunction
    from remat.options import AttentionOptions

    torch.manual_seed(0)
    m = 23 if causal else 31
    q = torch.randn(2, 23, 3, 8, 16).to(dtype)[:, :, :, 2]
    k, v = (torch.randn(2, m, 1, 16).to(dtype) for _ in range(2))
    dout = torch.randn(2, 23, 3, 16).to(dtype)
    q_before = q.clone()
    options = AttentionOptions(16 ** -0.5, 0.0, -1, 0 if causal else -1, 0.0, False)

    def run(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        return (o.detach(), *torch.autograd.grad(o, leaves, dout)), saved_bytes(fn, *leaves)

    # backend="aten" named: the CPU default for bf16 is the aten core only where oneDNN has native
    # 16-bit GEMMs (cpp on an AVX2-only EPYC, remat.backend), and this test is about that core.
    native, native_saved = run(lambda q, k, v: remat.attention(q, k, v, causal=causal, backend="aten"))
    core, core_saved = run(lambda q, k, v: AttentionFunction.apply(q, k, v, None, None, options, "aten", False))
    for got, want in zip(native, core, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert native_saved == core_saved
    contiguous = [t.contiguous().requires_grad_() for t in (q, k, v)]
    assert saved_bytes(lambda q, k, v: remat.attention(q, k, v, causal=causal, backend="aten"), *contiguous) == \
        (2 * q.numel() + k.numel() + v.numel()) * q.element_size() + 2 * 3 * 23 * 4
    assert torch.equal(q, q_before)


def test_cpu_flash_attention_checks_its_call():
    """Called directly, cpu_flash_attention refuses what the aten core refuses and non-CPU
    tensors, before any kernel runs."""
    from remat.ops.attention import cpu_flash_attention
    from remat.options import AttentionOptions

    q = torch.randn(1, 5, 2, 16)
    with pytest.raises(ValueError, match="softcap"):
        cpu_flash_attention(q, q, q, AttentionOptions(0.25, 5.0, -1, -1, 0.0, False))
    with pytest.raises(ValueError, match="CPU tensors"):
        cpu_flash_attention(q.to("meta"), q.to("meta"), q.to("meta"), AttentionOptions(0.25, 0.0, -1, -1, 0.0, False))


def test_default_on_cpu_is_the_aten_core_when_it_takes_the_call(monkeypatch):
    """Per op: CPU attention defaults to PyTorch's flash kernel (faster than remat's C++ kernel)
    when it takes the call, and to cpp for what it lacks; the fused layers too. A plain call (no
    rope) runs the kernel with PyTorch's own autograd node: its backward kernel once, no Function."""
    used = _record_attention_backends(monkeypatch)
    q = torch.randn(1, 9, 4, 16, requires_grad=True)
    k = torch.randn(1, 9, 2, 16, requires_grad=True)
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    with OpCalls([backward_op]) as spy:
        o = remat.attention(q, k, k, causal=True)
        o.sum().backward()
    assert used == ["aten"] and len(spy.calls) == 1
    assert type(o.grad_fn).__name__ != "AttentionFunctionBackward"
    used.clear()
    remat.attention(q, k, k, causal=True, softcap=20.0).sum().backward()
    assert used == ["cpp", "cpp"] if remat._extension.LOADED else ["torch", "torch"]
    used.clear()
    layer = remat.nn.LlamaLayer(64, 96, 4, 2)
    layer(torch.randn(2, 9, 64, requires_grad=True)).sum().backward()
    assert used == ["aten", "aten"]
    used.clear()
    remat.nn.LlamaLayer(64, 96, 4, 2, sliding_window=4)(torch.randn(2, 9, 64)).sum().backward()
    assert "aten" not in used and used


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_default_for_16_bit_attention_follows_the_cpus_gemms(monkeypatch, dtype):
    """A 16-bit CPU call defaults to the aten core only where oneDNN has native GEMMs for the
    dtype (else PyTorch's flash kernel takes its scalar GEMM fallback, measured 1.5-3x slower than
    remat's C++ kernel on an AVX2 CPU): both answers substituted, the same call, the fused layers
    too; float32 is the aten core's either way."""
    import remat.ops.attention as attention_ops

    used = _record_attention_backends(monkeypatch)
    fallback = "cpp" if remat._extension.LOADED else "torch"
    q = torch.randn(1, 9, 4, 16, dtype=dtype)
    k = torch.randn(1, 9, 2, 16, dtype=dtype)
    layer = remat.nn.LlamaLayer(64, 96, 4, 2).to(dtype)
    x = torch.randn(2, 9, 64, dtype=dtype)
    kind = "bf16" if dtype == torch.bfloat16 else "fp16"
    for native in (True, False):
        monkeypatch.setattr(attention_ops, "_onednn_has_native_gemm", lambda name, native=native: native)
        assert attention_ops.cpu_flash_is_fast(dtype) is native
        assert attention_ops.cpu_flash_is_fast(torch.float32) and attention_ops.cpu_flash_is_fast(torch.float64)
        used.clear()
        remat.attention(q, k, k, causal=True)
        layer(x)
        assert used == ["aten" if native else fallback] * 2, (kind, native, used)
    used.clear()
    remat.attention(q.float(), k.float(), k.float(), causal=True)
    assert used == ["aten"]


def test_onednn_native_gemm_check_is_pytorchs():
    """The check asks PyTorch's own oneDNN test (the one cpublas::gemm makes) per dtype."""
    import remat.ops.attention as attention_ops

    assert attention_ops._onednn_has_native_gemm("bf16") is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert attention_ops._onednn_has_native_gemm("fp16") is bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


# On a GPU (marked gpu; skipped where none is present): real sizes, every feature, masks across
# backends, bitwise determinism, the saved-bytes contract, Philox dropout.

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


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomics"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", GPU_ATTENTION_CASES)
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_attention_matches_float64_reference(backend, spec, dtype, deterministic):
    if backend == "cuda" and dtype == torch.float32:
        pytest.skip("the cuda attention kernels take float16/bfloat16 (fp32 raises ValueError)")
    run_and_check(spec, dtype, backend, deterministic=deterministic, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_attention_fp32_on_cuda_backend_raises_or_runs(backend):
    q = torch.randn(1, 8, 2, 64, device="cuda")
    if backend == "cuda":
        with pytest.raises(ValueError, match="float16/bfloat16"):
            remat.attention(q, q, q, backend=backend)
    else:
        assert torch.isfinite(remat.attention(q, q, q, backend=backend)).all()


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("backend", gpu_backends() + ["aten"])
def test_gpu_attention_saves_no_attention_matrix(backend):
    b, n, hq, hkv, d = 2, 2048, 8, 2, 128
    q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    contract = (2 * q.numel() + k.numel() + v.numel()) * 2 + b * hq * n * 4 + 16
    assert saved_bytes(remat.attention, q, k, v, causal=True, dropout_p=0.1, backend=backend) == contract


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_philox_dropout_is_the_reference_stream(backend, dtype):
    from remat.reference import dropout_keep

    x = torch.randn(1000, 4099, device="cuda").to(dtype).requires_grad_()
    torch.manual_seed(2)
    rng = draw_rng_state("cuda")
    torch.manual_seed(2)
    y = remat.dropout(x, 0.2, backend=backend)
    keep = dropout_keep(rng[0], rng[1], x.numel(), 0.2, device="cuda")
    divisor = torch.full((), 0.8, device="cuda")  # a tensor divisor: IEEE division, as the kernels
    want = torch.where(keep.view(x.shape), x.detach().float() / divisor, 0.0).to(dtype)
    assert torch.equal(y, want)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.where(keep.view(x.shape), torch.ones_like(x).float() / divisor, 0.0).to(dtype))
