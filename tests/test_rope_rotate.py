"""The once-per-pass rope rotation (remat.ops.rope): every implementation bitwise equal to the
PyTorch rotation (the C++ kernel here, the Triton kernel under the interpreter, and compiled on a
GPU in the gpu-marked test), the PyTorch rotation against a float64 complex rotation, the inverse
as its transpose, the attention paths that rotate once using it, argument checks and opcheck."""

import itertools

import pytest
import torch

from remat import _extension
from remat.ops import attention as attention_ops
from remat.ops import rope as rope_ops

from helpers import DTYPES, cpu_backends

needs_extension = pytest.mark.skipif(not _extension.LOADED, reason="remat._C is not built")


def _kernel_implementations():
    """(label, function) of every kernel implementation that runs on the CPU here."""
    found = []
    if _extension.LOADED:
        found.append(("cpp", rope_ops.EXTENSION_ROPE_ROTATE))
    if "triton" in cpu_backends():
        found.append(("triton", rope_ops.triton_rope_rotate))
    return found


IMPLEMENTATIONS = _kernel_implementations()


def _x(batch, length, heads, head_dim, dtype, layout, g, device="cpu"):
    """x [B, L, H, D] in one of four layouts: contiguous, heads-first storage seen through a
    transpose ([B, H, L, D] -> [B, L, H, D]), a slice of a wider tensor (padded L, H and D), or
    the q of a fused qkv projection (a token's heads adjacent, tokens 3 H D apart)."""
    if layout == "fused_qkv":
        return torch.randn(batch, length, 3 * heads, head_dim, generator=g).to(dtype).to(device)[:, :, :heads]
    if layout == "contiguous":
        return torch.randn(batch, length, heads, head_dim, generator=g).to(dtype).to(device)
    if layout == "heads_first":
        return torch.randn(batch, heads, length, head_dim, generator=g).to(dtype).to(device).transpose(1, 2)
    wide = torch.randn(batch, length + 3, heads + 2, head_dim + 6, generator=g).to(dtype).to(device)
    return wide[:, 2:length + 2, 1:heads + 1, 3:head_dim + 3]


def _tables(rows, half, g, device="cpu", angles=False):
    """fp32 [rows, half] cos/sin: of real angles (cos^2 + sin^2 = 1) or independent normals."""
    if angles:
        theta = torch.rand(rows, half, generator=g, dtype=torch.float64) * 20 - 10
        return theta.cos().float().to(device), theta.sin().float().to(device)
    return (torch.randn(rows, half, generator=g).to(device), torch.randn(rows, half, generator=g).to(device))


# (B, L, H, D, table batch entries, first_position): odd lengths and head counts, D = 2 (one pair),
# padded halves (D 80 -> 64 + masked, D 6), per-batch tables and an offset first position.
SHAPES = [(1, 1, 1, 2, 1, 0), (2, 7, 3, 8, 2, 2), (1, 33, 5, 80, 1, 4), (3, 5, 2, 128, 3, 0), (2, 9, 4, 6, 1, 1)]


@pytest.mark.skipif(not IMPLEMENTATIONS, reason="no rope kernel runs here (no extension, no interpreter)")
@pytest.mark.parametrize("label,function", IMPLEMENTATIONS, ids=[label for label, _ in IMPLEMENTATIONS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-l{}-h{}-d{}-t{}-p{}".format(*s))
@pytest.mark.parametrize("layout", ["contiguous", "heads_first", "sliced", "fused_qkv"])
@pytest.mark.parametrize("inverse", [False, True], ids=["rotate", "inverse"])
def test_kernels_equal_the_pytorch_rotation_bitwise(label, function, dtype, shape, layout, inverse):
    batch, length, heads, head_dim, table_batches, first = shape
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    x = _x(batch, length, heads, head_dim, dtype, layout, g)
    table_length = first + length + 2
    cos, sin = _tables(table_batches * table_length, head_dim // 2, g)
    stride = table_length if table_batches > 1 else 0
    before = x.clone()
    expected = rope_ops.torch_rope_rotate(x, cos, sin, None, first, stride, inverse)
    got = function(x, cos, sin, None, first, stride, inverse)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got, expected), f"max difference {(got.float() - expected.float()).abs().max()}"
    rows = torch.randint(0, cos.shape[0], (batch * length,), generator=g)
    assert torch.equal(function(x, cos, sin, rows, 0, 0, inverse),
                       rope_ops.torch_rope_rotate(x, cos, sin, rows, 0, 0, inverse))
    assert torch.equal(x, before), "the input was written"


@pytest.mark.skipif(not IMPLEMENTATIONS, reason="no rope kernel runs here (no extension, no interpreter)")
@pytest.mark.parametrize("label,function", IMPLEMENTATIONS, ids=[label for label, _ in IMPLEMENTATIONS])
def test_kernels_rotate_empty_tensors(label, function):
    for shape in ((0, 3, 2, 8), (2, 0, 2, 8), (2, 3, 0, 8), (2, 3, 2, 0)):
        x = torch.randn(shape)
        cos, sin = _tables(4, shape[-1] // 2, torch.Generator().manual_seed(0))
        assert function(x, cos, sin, None, 0, 0, False).shape == shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inverse", [False, True], ids=["rotate", "inverse"])
def test_pytorch_rotation_against_float64_complex_rotation(dtype, inverse):
    """(x1 + i x2) (c + i s) in float64, or times (c - i s) for the inverse: the rotation is the
    rotate-half convention with the right signs, within one rounding to the dtype plus fp32's."""
    g = torch.Generator().manual_seed(7)
    x = _x(2, 11, 3, 16, dtype, "contiguous", g)
    cos, sin = _tables(32, 8, g)
    first = 5
    got = rope_ops.torch_rope_rotate(x, cos, sin, None, first, 16, inverse)
    rows = (torch.arange(2)[:, None] * 16 + first + torch.arange(11)).reshape(2, 11, 1)
    c, s = cos.double()[rows], sin.double()[rows]
    x1, x2 = x[..., :8].double(), x[..., 8:].double()
    pair = torch.complex(x1, x2)
    turned = pair * torch.complex(c, -s if inverse else s)
    expected = torch.cat([turned.real, turned.imag], dim=-1)
    magnitude = torch.cat([(x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()], dim=-1)
    bound = (torch.finfo(dtype).eps + 2 * torch.finfo(torch.float32).eps) * magnitude + torch.finfo(dtype).tiny
    assert ((got.double() - expected).abs() <= bound).all()


def test_inverse_is_the_transpose_and_undoes_a_rotation():
    """<rotate(x), g> = <x, inverse(g)> for any tables (float64 inputs rounded from fp32, so only
    the fp32 roundings differ); with real angles the inverse undoes the rotation."""
    g = torch.Generator().manual_seed(3)
    x, grad = (_x(2, 9, 3, 12, torch.float32, "contiguous", g) for _ in range(2))
    cos, sin = _tables(9, 6, g)
    forward = rope_ops.torch_rope_rotate(x, cos, sin, None, 0, 0, False).double()
    back = rope_ops.torch_rope_rotate(grad, cos, sin, None, 0, 0, True).double()
    left, right = (forward * grad.double()).sum(), (x.double() * back).sum()
    assert torch.allclose(left, right, rtol=1e-5, atol=1e-4), (left, right)
    cos, sin = _tables(9, 6, g, angles=True)
    undone = rope_ops.torch_rope_rotate(rope_ops.torch_rope_rotate(x, cos, sin, None, 0, 0, False), cos, sin, None, 0,
                                        0, True)
    assert torch.allclose(undone, x, rtol=1e-5, atol=1e-5)


def test_rope_implementation_per_device(monkeypatch):
    """Which rotation each device gets: compiled Triton for CUDA tensors (not under the
    interpreter), the C++ kernel for CPU tensors (where the extension loaded), PyTorch's ops
    everywhere else (CUDA without Triton or under the interpreter, CPU without the extension,
    other devices)."""
    for triton, interpreted, loaded in itertools.product((False, True), repeat=3):
        monkeypatch.setattr(rope_ops, "triton_available", lambda t=triton: t)
        monkeypatch.setattr(rope_ops, "triton_interpreted", lambda i=interpreted: i)
        monkeypatch.setattr(rope_ops._extension, "LOADED", loaded)
        expected = {"cuda": "triton" if triton and not interpreted else "torch", "cpu": "cpp" if loaded else "torch",
                    "meta": "torch"}
        for device, want in expected.items():
            assert rope_ops.rope_implementation(device) == want, (device, triton, interpreted, loaded)


@needs_extension
def test_cpu_tensors_use_the_cpp_kernel_and_attention_paths_rotate_with_it(monkeypatch):
    """rope_implementation picks the C++ kernel for CPU tensors; the aten core's rotate-once path
    rotates q and k (forward), again in backward, and rotates dq and dk back, all through it."""
    assert rope_ops.rope_implementation("cpu") == "cpp"
    calls = []
    real = rope_ops.EXTENSION_ROPE_ROTATE

    def spy(x, cos, sin, rows, first_position, table_batch_stride, inverse):
        calls.append((tuple(x.shape), first_position, inverse))
        return real(x, cos, sin, rows, first_position, table_batch_stride, inverse)

    monkeypatch.setattr(rope_ops, "EXTENSION_ROPE_ROTATE", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 16, generator=g, requires_grad=True) for _ in range(3))
    cos, sin = (t[:, :8].contiguous() for t in _tables(6, 16, g, angles=True))
    out = attention_ops.ATEN_OPS.attention_fwd(q.detach(), k.detach(), v.detach(), cos[None], sin[None], None,
                                                0.25, 0.0, -1, 0, 0.0)
    assert [inverse for _, _, inverse in calls] == [False, False]
    attention_ops.ATEN_OPS.attention_bwd(torch.ones_like(out[0]), q.detach(), k.detach(), v.detach(), *out,
                                         cos[None], sin[None], None, 0.25, 0.0, -1, 0, 0.0, True)
    assert [inverse for _, _, inverse in calls] == [False, False, False, False, True, True]


@needs_extension
def test_aten_core_with_rope_is_the_core_on_rotated_operands():
    """The aten core with tables equals, bitwise, the core without tables on q and k rotated by
    the PyTorch rotation (forward), and its dq, dk are the core's rotated back (backward)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 7, 4, 16, generator=g)
    k, v = torch.randn(2, 9, 2, 16, generator=g), torch.randn(2, 9, 2, 16, generator=g)
    cos, sin = _tables(2 * 9, 8, g, angles=True)
    tables = (cos.view(2, 9, 8), sin.view(2, 9, 8))
    args = (0.25, 0.0, -1, -1, 0.0)
    o, lse = attention_ops.ATEN_OPS.attention_fwd(q, k, v, *tables, None, *args)
    q_rot = rope_ops.torch_rope_rotate(q, cos, sin, None, 2, 9, False)
    k_rot = rope_ops.torch_rope_rotate(k, cos, sin, None, 0, 9, False)
    o_ref, lse_ref = attention_ops.ATEN_OPS.attention_fwd(q_rot, k_rot, v, None, None, None, *args)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    dout = torch.randn(o.shape, generator=g)
    dq, dk, dv = attention_ops.ATEN_OPS.attention_bwd(dout, q, k, v, o, lse, *tables, None, *args, True)
    dq_ref, dk_ref, dv_ref = attention_ops.ATEN_OPS.attention_bwd(dout, q_rot, k_rot, v, o, lse, None, None, None,
                                                                  *args, True)
    assert torch.equal(dq, rope_ops.torch_rope_rotate(dq_ref, cos, sin, None, 2, 9, True))
    assert torch.equal(dk, rope_ops.torch_rope_rotate(dk_ref, cos, sin, None, 0, 9, True))
    assert torch.equal(dv, dv_ref)


def _valid_args():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=g)
    cos, sin = _tables(10, 4, g)
    return x, cos, sin


@pytest.mark.parametrize("change,message", [
    (lambda a: {**a, "x": a["x"][..., :7]}, "even head dim"),
    (lambda a: {**a, "x": a["x"][0]}, r"\[B, L, H, D\]"),
    (lambda a: {**a, "x": a["x"].to(torch.int32)}, "float32/float16/bfloat16"),
    (lambda a: {**a, "x": a["x"].transpose(2, 3)}, "unit last stride"),
    (lambda a: {**a, "cos": a["cos"].double()}, "contiguous fp32"),
    (lambda a: {**a, "cos": a["cos"][:, :3]}, r"D/2 = 4"),
    (lambda a: {**a, "sin": a["sin"].t().contiguous().t()}, "contiguous fp32"),
    (lambda a: {**a, "cos": a["cos"][:9], "sin": a["sin"][:8]}, "one shape"),
    (lambda a: {**a, "rows": torch.zeros(9, dtype=torch.int64)}, r"rows must be a contiguous int64 \[B \* L = 10\]"),
    (lambda a: {**a, "rows": torch.zeros(10, dtype=torch.int32)}, "rows must be a contiguous int64"),
    (lambda a: {**a, "rows": torch.arange(20)[::2]}, "rows must be a contiguous int64"),
    (lambda a: {**a, "first_position": 6}, "the tables have 10 rows; tokens read up to row 10"),
    (lambda a: {**a, "table_batch_stride": 5, "first_position": 1}, "tokens read up to row 10"),
    (lambda a: {**a, "first_position": -1}, ">= 0"),
])
def test_bad_arguments_raise_before_any_kernel(change, message):
    x, cos, sin = _valid_args()
    args = change({"x": x, "cos": cos, "sin": sin, "rows": None, "first_position": 0, "table_batch_stride": 0})
    with pytest.raises(ValueError, match=message):
        rope_ops.rope_rotate(**args)


@needs_extension
def test_cpp_kernel_refuses_rows_out_of_range():
    x, cos, sin = _valid_args()
    with pytest.raises(RuntimeError, match="out of range"):
        rope_ops.EXTENSION_ROPE_ROTATE(x, cos, sin, torch.full((10,), 10, dtype=torch.int64), 0, 0, False)


def _opcheck_cases():
    x, cos, sin = _valid_args()
    rows = torch.arange(10, dtype=torch.int64).flip(0)
    samples = [(x, cos, sin, None, 1, 0, False), (x.to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2),
                                                   cos, sin, rows, 0, 0, True)]
    cases = []
    if _extension.LOADED:
        cases += [pytest.param("remat", args, id=f"cpp-{i}") for i, args in enumerate(samples)]
    if "triton" in cpu_backends():
        cases += [pytest.param("remat_triton", args, id=f"triton-{i}") for i, args in enumerate(samples)]
    return cases


@pytest.mark.parametrize("namespace,args", _opcheck_cases())
def test_opcheck(namespace, args):
    torch.library.opcheck(getattr(torch.ops, namespace).rope_rotate, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inverse", [False, True], ids=["rotate", "inverse"])
def test_compiled_triton_kernel_equals_the_pytorch_rotation_on_the_gpu(dtype, inverse):
    """On a GPU (compiled, fp fusion off): bitwise PyTorch's CUDA rotation, dense with per-batch
    tables, per-token rows, a padded head dim and a strided input; and it is what CUDA tensors use."""
    assert rope_ops.rope_implementation("cuda") == "triton"
    g = torch.Generator().manual_seed(11)
    for batch, length, heads, head_dim in ((2, 300, 8, 128), (1, 77, 5, 80)):
        x = _x(batch, length, heads, head_dim, dtype, "heads_first", g, device="cuda")
        cos, sin = _tables(batch * (length + 4), head_dim // 2, g, device="cuda")
        expected = rope_ops.torch_rope_rotate(x, cos, sin, None, 4, length + 4, inverse)
        assert torch.equal(rope_ops.rope_rotate(x, cos, sin, None, 4, length + 4, inverse), expected)
        rows = torch.randint(0, cos.shape[0], (batch * length,), generator=g).cuda()
        assert torch.equal(rope_ops.rope_rotate(x, cos, sin, rows, inverse=inverse),
                           rope_ops.torch_rope_rotate(x, cos, sin, rows, 0, 0, inverse))
