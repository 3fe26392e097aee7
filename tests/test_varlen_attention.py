"""Packed (variable-length) attention, remat.attention with cu_seqlens_q / cu_seqlens_k, and
norm_attention with cu_seqlens: every backend that has packed kernels, against the float64
reference run on each sequence alone (2x-stock rule, forward and dq, dk, dv) and against the dense
call on each sequence alone; lengths 0, 1, a long one beside short ones, none a multiple of a tile;
GQA, causal, window, softcap, dropout (the padded-batch Philox stream), rope with restarting and
per-token tables; the saved-bytes contract; bad offsets."""

import pytest
import torch
from test_cuda_emulation import KIND, BwdParams, FwdParams, Guarded, _check_launch, emu  # noqa: F401 (fixture)

import remat
from remat.autograd.common import draw_rng_state
from remat.checks import window_bounds
from remat.memory import SavedTensorLog
from remat.ops import ops_for
from remat.reference import attention_dropout_keep, attention_varlen_reference

from _checks import assert_within_2x_of_stock
from helpers import DTYPES, CompileCounter, cpu_backends, deterministic_mode, gpu_backends, triton_bwd_sample


def varlen_backends():
    """The CPU-runnable backends with packed attention kernels."""
    return [b for b in cpu_backends() if ops_for("attention", b).attention_varlen_fwd is not None]


def native_varlen_backends():
    """varlen_backends() without Triton, which the interpreter runs slowly: it gets TRITON_CASES."""
    return [b for b in varlen_backends() if b != "triton"]


def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def vcase(name, lens_q, lens_k, hq, hkv, d, **options):
    return pytest.param(dict(lens_q=lens_q, lens_k=lens_k, hq=hq, hkv=hkv, d=d, **options), id=name)


CASES = [
    vcase("self-1-0-37-3", [1, 0, 37, 3], [1, 0, 37, 3], 2, 2, 16),
    vcase("self-causal-gqa", [5, 1, 70, 0, 9], [5, 1, 70, 0, 9], 4, 2, 32, causal=True),
    vcase("cross-causal-mqa-zero-keys", [3, 1, 20, 2], [7, 4, 33, 0], 4, 1, 16, causal=True),
    vcase("window-softcap", [17, 40, 2], [17, 40, 2], 2, 1, 64, causal=True, window=(6, None), softcap=5.0),
    vcase("window-both-sides", [13, 30], [13, 30], 2, 2, 16, window=(4, 3)),
    # A causal window with fewer queries than keys in every sequence (bottom-right alignment: the
    # window is counted from each query's aligned key, as in cached decoding).
    vcase("cross-window", [1, 3, 1, 5], [6, 9, 2, 5], 4, 2, 16, causal=True, window=(3, None)),
    vcase("rope-restart-causal", [1, 33, 6, 0], [4, 33, 6, 0], 4, 2, 32, causal=True, rope="restart"),
    vcase("rope-per-token-gqa", [9, 2, 23], [9, 5, 23], 4, 2, 32, causal=True, rope="per_token"),
    vcase("dropout-rope-softcap", [7, 0, 19], [7, 3, 19], 2, 1, 16, causal=True, dropout=0.2, softcap=8.0,
          rope="restart"),
]

# The interpreter's cases (16 x 16 tiles): lengths 0, 1, one across two tiles, queries fewer than
# keys, every feature.
TRITON_CASES = [
    vcase("self-causal-gqa", [5, 1, 20, 0], [5, 1, 20, 0], 4, 2, 32, causal=True),
    vcase("cross-window-softcap-zero-keys", [3, 1, 18], [7, 0, 21], 2, 1, 16, causal=True, window=(6, None),
          softcap=5.0),
    vcase("rope-per-token-dropout", [9, 0, 17], [9, 3, 19], 2, 2, 32, causal=True, rope="per_token", dropout=0.2),
    vcase("rope-restart-window", [2, 17], [4, 17], 2, 1, 16, window=(4, 3), rope="restart"),
]


def make_varlen_inputs(spec, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = offsets(spec["lens_q"]), offsets(spec["lens_k"])
    total_q, total_k, hq, hkv, d = int(cu_q[-1]), int(cu_k[-1]), spec["hq"], spec["hkv"], spec["d"]
    scale_up = 3.0 if spec.get("softcap") else 1.0
    q = (torch.randn(total_q, hq, d, generator=g) * scale_up).to(dtype)
    k = (torch.randn(total_k, hkv, d, generator=g) * scale_up).to(dtype)
    v = torch.randn(total_k, hkv, d, generator=g).to(dtype)
    dout = torch.randn(total_q, hq, d, generator=g).to(dtype)
    rope = None
    if spec.get("rope") == "restart":
        angles = torch.rand(max(spec["lens_k"]) + 3, d // 2, generator=g) * 6.0
        rope = (angles.cos(), angles.sin())
    elif spec.get("rope") == "per_token":
        angles = torch.rand(1, total_k, d, generator=g) * 6.0  # Hugging Face's [.., D] tables, equal halves
        angles[..., d // 2:] = angles[..., : d // 2]
        rope = (angles.cos(), angles.sin())
    return q, k, v, dout, cu_q, cu_k, rope


def sequence_keeps(spec, rng):
    """Per sequence, the dropout keep mask [1, Hq, N_s, M_s]: the dense mask of the zero-padded
    batch [S, max N] x [S, max M] (sequence s at batch index s)."""
    if not spec.get("dropout"):
        return None
    max_q, max_k = max(spec["lens_q"]), max(spec["lens_k"])
    hq = spec["hq"]
    keep = attention_dropout_keep(rng[0], rng[1], (len(spec["lens_q"]), hq, max_q, max_k), spec["dropout"])
    return [keep[s : s + 1, :, :n, :m] for s, (n, m) in enumerate(zip(spec["lens_q"], spec["lens_k"]))]


def reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, keeps, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    rope_d = tuple(t.to(dtype) for t in rope) if rope is not None else None
    o = attention_varlen_reference(*leaves, cu_q, cu_k, causal=spec.get("causal", False), keeps=keeps,
                                   dropout_p=spec.get("dropout", 0.0), rope=rope_d, window=spec.get("window"),
                                   softcap=spec.get("softcap"))
    grads = torch.autograd.grad(o, leaves, dout.to(dtype), allow_unused=True)
    return [o.detach()] + [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def run_varlen(spec, q, k, v, dout, cu_q, cu_k, rope, backend, device="cpu", **extra):
    """o, dq, dk, dv of remat.attention on the packed inputs, run on ``device``, returned on the CPU."""
    leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
    rope = tuple(t.to(device) for t in rope) if rope is not None else None
    o = remat.attention(*leaves, cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
                        causal=spec.get("causal", False), rope=rope, window=spec.get("window"),
                        softcap=spec.get("softcap"), dropout_p=spec.get("dropout", 0.0), backend=backend, **extra)
    o.backward(dout.to(device))
    return [o.detach().cpu()] + [t.grad.cpu() for t in leaves]


def check_against_float64(backend, spec, dtype, device="cpu", **extra):
    q, k, v, dout, cu_q, cu_k, rope = make_varlen_inputs(spec, dtype)
    torch.manual_seed(77)
    rng = draw_rng_state(device).cpu()
    torch.manual_seed(77)
    got = run_varlen(spec, q, k, v, dout, cu_q, cu_k, rope, backend, device=device, **extra)
    keeps = sequence_keeps(spec, rng)
    reference = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, keeps, torch.float64)
    stock = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, keeps, dtype)
    for name, value, stock_value, ref in zip(("o", "dq", "dk", "dv"), got, stock, reference):
        assert value.dtype == dtype
        assert_within_2x_of_stock(name, value, stock_value, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CASES)
@pytest.mark.parametrize("backend", native_varlen_backends())
def test_varlen_matches_float64_reference(backend, spec, dtype):
    check_against_float64(backend, spec, dtype)


# Every interpreter case in fp32 and bf16 with the deterministic backward; the atomic-dq backward
# (its postprocess included) on the two cases with rope, window, softcap and dropout, in bf16.
TRITON_RUNS = [pytest.param(spec, dtype, True, id=f"{spec.id}-{str(dtype)[6:]}-deterministic")
               for spec in TRITON_CASES for dtype in (torch.float32, torch.bfloat16)]
TRITON_RUNS += [pytest.param(spec, torch.bfloat16, False, id=f"{spec.id}-bfloat16-atomic-dq")
                for spec in TRITON_CASES[1:3]]


@pytest.mark.skipif("triton" not in varlen_backends(), reason="Triton is not installed")
@pytest.mark.parametrize("spec,dtype,deterministic", TRITON_RUNS)
def test_triton_varlen_matches_float64_reference(spec, dtype, deterministic):
    spec = spec.values[0]
    if deterministic:
        check_against_float64("triton", spec, dtype)
    else:
        with deterministic_mode(False):
            check_against_float64("triton", spec, dtype, deterministic=False)


@pytest.mark.parametrize("spec", [p for p in CASES if not p.values[0].get("dropout")])
@pytest.mark.parametrize("backend", native_varlen_backends())
def test_varlen_equals_dense_call_per_sequence(backend, spec):
    """Each sequence's output and gradients are the dense call's on that sequence alone (the same
    backend; keys of a sequence with no queries get zero gradients)."""
    q, k, v, dout, cu_q, cu_k, rope = make_varlen_inputs(spec, torch.float32)
    got = run_varlen(spec, q, k, v, dout, cu_q, cu_k, rope, backend)
    for s, (n, m) in enumerate(zip(spec["lens_q"], spec["lens_k"])):
        q0, k0 = int(cu_q[s]), int(cu_k[s])
        if n == 0 or m == 0:
            assert torch.equal(got[2][k0 : k0 + m], torch.zeros_like(got[2][k0 : k0 + m]))
            assert torch.equal(got[1][q0 : q0 + n], torch.zeros_like(got[1][q0 : q0 + n]))
            assert torch.equal(got[0][q0 : q0 + n], torch.zeros_like(got[0][q0 : q0 + n]))
            continue
        sequence_rope = rope
        if spec.get("rope") == "per_token":
            sequence_rope = tuple(t[0, k0:] for t in rope)
        parts = [t[None, q0 : q0 + n] for t in (q, dout)] + [t[None, k0 : k0 + m] for t in (k, v)]
        leaves = [t.clone().requires_grad_() for t in (parts[0], parts[2], parts[3])]
        o = remat.attention(*leaves, causal=spec.get("causal", False), rope=sequence_rope, window=spec.get("window"),
                            softcap=spec.get("softcap"), backend=backend)
        o.backward(parts[1])
        dense = [o.detach()[0], leaves[0].grad[0], leaves[1].grad[0], leaves[2].grad[0]]
        packed = [got[0][q0 : q0 + n], got[1][q0 : q0 + n], got[2][k0 : k0 + m], got[3][k0 : k0 + m]]
        for name, a, b in zip(("o", "dq", "dk", "dv"), packed, dense):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"sequence {s} {name}")


@pytest.mark.parametrize("backend", varlen_backends())
def test_varlen_max_seqlen_bounds_and_all_empty(backend):
    """Larger max_seqlen bounds give the same result without dropout (bit for bit, but on the torch
    backend, whose padded batches the bounds widen: more zeros in its sums can change their rounding);
    a batch whose sequences are all empty gives empty outputs and gradients."""
    spec = dict(lens_q=[3, 11, 1], lens_k=[3, 11, 1], hq=2, hkv=1, d=16, causal=True)
    q, k, v, dout, cu_q, cu_k, rope = make_varlen_inputs(spec, torch.float32)
    tight = run_varlen(spec, q, k, v, dout, cu_q, cu_k, rope, backend)
    loose = run_varlen(spec, q, k, v, dout, cu_q, cu_k, rope, backend, max_seqlen_q=40, max_seqlen_k=64)
    tolerance = 1e-6 if backend == "torch" else 0
    for a, b in zip(tight, loose):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
    empty = dict(lens_q=[0, 0], lens_k=[0, 0], hq=2, hkv=1, d=16)
    q, k, v, dout, cu_q, cu_k, rope = make_varlen_inputs(empty, torch.float32)
    got = run_varlen(empty, q, k, v, dout, cu_q, cu_k, rope, backend)
    assert [tuple(t.shape) for t in got] == [(0, 2, 16), (0, 2, 16), (0, 1, 16), (0, 1, 16)]


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["plain", "dropout"])
@pytest.mark.parametrize("backend", varlen_backends())
def test_varlen_saves_the_dense_contract_plus_offsets(backend, dropout):
    lens = [5, 0, 30, 2]
    cu = offsets(lens)
    total, hq, hkv, d = int(cu[-1]), 4, 2, 16
    q = torch.randn(total, hq, d, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, hkv, d, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, hkv, d, dtype=torch.bfloat16, requires_grad=True)
    angles = torch.rand(max(lens), d // 2)
    with SavedTensorLog() as log:
        # Separate offset tensors for q and k: each is saved (one shared tensor would count once).
        remat.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), causal=True,
                        rope=(angles.cos(), angles.sin()), dropout_p=dropout, backend=backend)
    expected = (2 * q.numel() + k.numel() + v.numel()) * 2 + hq * total * 4 + 2 * cu.numel() * 4
    expected += 2 * angles.numel() * 4 + (16 if dropout else 0)
    assert log.total_bytes == expected
    shapes = sorted((tuple(s.shape), s.dtype) for s in log.saved)
    contract = [((total, hq, d), torch.bfloat16)] * 2 + [((total, hkv, d), torch.bfloat16)] * 2 + [
        ((hq, total), torch.float32), ((len(lens) + 1,), torch.int32), ((len(lens) + 1,), torch.int32),
        ((max(lens), d // 2), torch.float32), ((max(lens), d // 2), torch.float32)] + (
        [((2,), torch.int64)] if dropout else [])
    assert shapes == sorted(contract)


def _packed(total_q=6, total_k=6, hq=2, hkv=1, d=16):
    return torch.randn(total_q, hq, d), torch.randn(total_k, hkv, d), torch.randn(total_k, hkv, d)


@pytest.mark.parametrize("cu_q,cu_k,match", [
    (torch.tensor([0, 2, 6], dtype=torch.int64), offsets([2, 4]), "int32"),
    (torch.tensor([0, 2, 6], dtype=torch.float32), offsets([2, 4]), "int32"),
    (torch.tensor([[0, 2, 6]], dtype=torch.int32), offsets([2, 4]), "1-D"),
    (torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), "1-D"),
    (torch.tensor([1, 2, 6], dtype=torch.int32), offsets([2, 4]), "start at 0"),
    (torch.tensor([0, 4, 2, 6], dtype=torch.int32), offsets([2, 4, 0]), "non-decreasing"),
    (torch.tensor([0, 2, 5], dtype=torch.int32), offsets([2, 4]), "end at the packed length 6"),
    (offsets([2, 4]), torch.tensor([0, 2, 7], dtype=torch.int32), "end at the packed length 6"),
    (offsets([2, 4]), offsets([2, 2, 2]), "one number of sequences"),
], ids=["int64", "float", "2-D", "no-sequence", "start", "decreasing", "last-q", "last-k", "S-differs"])
def test_bad_offsets_raise_before_any_kernel(cu_q, cu_k, match, monkeypatch):
    def no_kernel(*args):
        raise AssertionError("a kernel ran")

    table = remat.ops.attention.OPS
    monkeypatch.setitem(table, "torch", table["torch"]._replace(attention_varlen_fwd=no_kernel,
                                                                attention_varlen_bwd=no_kernel))
    with pytest.raises(ValueError, match=match):
        remat.attention(*_packed(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="torch")


def test_bad_varlen_arguments_raise():
    q, k, v = _packed()
    cu = offsets([2, 4])
    with pytest.raises(ValueError, match="both cu_seqlens_q and cu_seqlens_k"):
        remat.attention(q, k, v, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="both cu_seqlens_q and cu_seqlens_k"):
        remat.attention(q, k, v, max_seqlen_q=4)
    with pytest.raises(ValueError, match="layout 'bnhd' only"):
        remat.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, layout="bhnd")
    with pytest.raises(ValueError, match="3-D"):
        remat.attention(q[None], k[None], v[None], cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="below the longest sequence"):
        remat.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int"):
        remat.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=4.0)
    angles = torch.rand(4, 8)
    rope = (angles.cos(), angles.sin())
    with pytest.raises(ValueError, match="N <= M in every sequence"):
        remat.attention(*_packed(6, 6), cu_seqlens_q=offsets([3, 3]), cu_seqlens_k=offsets([2, 4]), rope=rope)
    with pytest.raises(ValueError, match="S >= max_seqlen_k=5"):
        remat.attention(*_packed(6, 6), cu_seqlens_q=offsets([1, 5]), cu_seqlens_k=offsets([1, 5]), rope=rope)
    per_token = tuple(t[None] for t in rope)
    with pytest.raises(ValueError, match="T >= total_k=6"):
        remat.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, rope=per_token)
    with pytest.raises(remat.BackendUnavailableError, match="aten"):
        remat.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="aten")


def _norm_attention_weights(hidden, hq, hkv, d, dtype, g):
    def w(rows):
        return (torch.randn(rows, hidden, generator=g) * hidden**-0.5).to(dtype).requires_grad_()

    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).requires_grad_()
    return norm_weight, w(hq * d), w(hkv * d), w(hkv * d)


# Every combination on the native backends; one under the Triton interpreter (slow there).
NORM_ATTENTION_CASES = [(b, rope_kind, keep) for b in native_varlen_backends()
                        for rope_kind in (None, "restart", "per_token") for keep in (True, False)]
NORM_ATTENTION_CASES += [(b, "per_token", False) for b in varlen_backends() if b == "triton"]


@pytest.mark.parametrize("backend,rope_kind,keep_qkv", NORM_ATTENTION_CASES)
def test_norm_attention_packed_equals_each_sequence_alone(backend, rope_kind, keep_qkv):
    """norm_attention on one packed row equals it on each sequence alone (outputs, dx, and the
    weight gradients summed over sequences)."""
    g = torch.Generator().manual_seed(3)
    lens, hidden, hq, hkv, d = [6, 1, 0, 23, 4], 32, 4, 2, 16
    cu = offsets(lens)
    total = int(cu[-1])
    x = torch.randn(1, total, hidden, generator=g)
    dout = torch.randn(1, total, hq, d, generator=g)
    params = _norm_attention_weights(hidden, hq, hkv, d, torch.float32, g)
    angles = torch.rand(max(lens), d // 2, generator=g) * 6.0
    per_sequence_angles = [angles[:n] for n in lens]
    if rope_kind == "per_token":  # tables from positions that restart at 0, as Hugging Face builds them
        angles = torch.cat(per_sequence_angles)[None]
    rope = None if rope_kind is None else (angles.cos(), angles.sin())
    kwargs = dict(num_heads=hq, num_kv_heads=hkv, causal=True, keep_qkv=keep_qkv, backend=backend)

    x_packed = x.clone().requires_grad_()
    o = remat.functional.norm_attention(x_packed, *params, rope=rope, cu_seqlens=cu, **kwargs)
    o.backward(dout)
    packed_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    outputs, dxs = [], []
    for s, n in enumerate(lens):
        if n == 0:
            continue
        t0 = int(cu[s])
        x_s = x[:, t0 : t0 + n].clone().requires_grad_()
        rope_s = None if rope_kind is None else (per_sequence_angles[s].cos(), per_sequence_angles[s].sin())
        o_s = remat.functional.norm_attention(x_s, *params, rope=rope_s, **kwargs)
        o_s.backward(dout[:, t0 : t0 + n])
        outputs.append(o_s.detach())
        dxs.append(x_s.grad)
    torch.testing.assert_close(o.detach(), torch.cat(outputs, dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_packed.grad, torch.cat(dxs, dim=1), rtol=1e-5, atol=1e-5)
    for packed, p in zip(packed_grads, params):
        torch.testing.assert_close(packed, p.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep_qkv", [True, False], ids=["keep", "recompute"])
@pytest.mark.parametrize("backend", varlen_backends())
def test_norm_attention_packed_saves_dense_bytes_plus_offsets(backend, keep_qkv):
    g = torch.Generator().manual_seed(4)
    lens, hidden, hq, hkv, d = [9, 0, 14, 3], 32, 4, 2, 16
    cu = offsets(lens)
    total = int(cu[-1])
    x = torch.randn(1, total, hidden, generator=g, dtype=torch.bfloat16).requires_grad_()
    params = [torch.nn.Parameter(p.detach()) for p in _norm_attention_weights(hidden, hq, hkv, d, torch.bfloat16, g)]
    kwargs = dict(num_heads=hq, num_kv_heads=hkv, causal=True, keep_qkv=keep_qkv, backend=backend)
    with SavedTensorLog() as dense:
        remat.functional.norm_attention(x, *params, **kwargs)
    with SavedTensorLog() as packed:
        remat.functional.norm_attention(x, *params, cu_seqlens=cu, **kwargs)
    # The dense contract at the same T: x, fp32 norm statistics, o, fp32 lse (and q, k, v with keep_qkv).
    contract = x.numel() * 2 + total * 4 + total * hq * d * 2 + hq * total * 4
    if keep_qkv:
        contract += total * (hq + 2 * hkv) * d * 2
    assert dense.total_bytes == contract
    assert packed.total_bytes == contract + cu.numel() * 4


def test_norm_attention_packed_bad_arguments_raise():
    g = torch.Generator().manual_seed(5)
    params = _norm_attention_weights(32, 2, 2, 16, torch.float32, g)
    x = torch.randn(2, 6, 32)
    with pytest.raises(ValueError, match="one packed row"):
        remat.functional.norm_attention(x, *params, num_heads=2, cu_seqlens=offsets([2, 4]))
    with pytest.raises(ValueError, match="end at the packed length 6"):
        remat.functional.norm_attention(x[:1], *params, num_heads=2, cu_seqlens=offsets([2, 5]))
    with pytest.raises(ValueError, match="max_seqlen needs cu_seqlens"):
        remat.functional.norm_attention(x[:1], *params, num_heads=2, max_seqlen=6)


def _varlen_op_samples():
    g = torch.Generator().manual_seed(6)
    cu_q, cu_k = offsets([3, 0, 9, 1]), offsets([5, 2, 9, 1])
    q = torch.randn(13, 4, 16, generator=g)
    k = torch.randn(17, 2, 24, generator=g)[..., :16]
    v = torch.randn(17, 2, 16, generator=g)
    restart = torch.rand(12, 8, generator=g)
    per_token = torch.rand(1, 17, 8, generator=g)
    rng = torch.tensor([5, 6])
    fwd = [(q, k, v, cu_q, cu_k, 9, 9, None, None, None, 0.25, 0.0, -1, 0, 0.0),
           (q, k, v, cu_q, cu_k, 9, 9, restart.cos(), restart.sin(), rng, 0.3, 2.0, 3, 1, 0.2),
           (q, k, v, cu_q, cu_k, 12, 10, per_token.cos(), per_token.sin(), None, 0.3, 0.0, -1, 0, 0.0)]
    bwd = []
    for args in fwd:
        o, lse = remat.ops.attention.TORCH_OPS.attention_varlen_fwd(*args)
        bwd.append((torch.randn_like(o), q, k, v, o, lse, *args[3:], True))
    return {"attention_varlen_fwd": fwd, "attention_varlen_bwd": bwd}


def _varlen_opcheck_cases():
    """Every sample on the C++ op; the first (no rope, no dropout) and the last (per-token rope)
    under the Triton interpreter, where opcheck's repeated runs are slow."""
    cases = []
    for namespace, label in (("remat", "cpp"), ("remat_triton", "triton")):
        if label not in varlen_backends():
            continue
        for name, samples in _varlen_op_samples().items():
            for i, args in enumerate(samples):
                if label == "cpp" or i != 1:
                    cases.append(pytest.param(namespace, name, triton_bwd_sample(label, name, args, 10),
                                              id=f"{label}-{name}-{i}"))
    return cases


@pytest.mark.parametrize("namespace,name,args", _varlen_opcheck_cases())
def test_varlen_opcheck(namespace, name, args):
    torch.library.opcheck(getattr(getattr(torch.ops, namespace), name), args)


@pytest.mark.parametrize("backend", native_varlen_backends())
def test_varlen_compile_fullgraph_matches_eager(backend):
    """One graph (no break: the offsets are checked by in-graph asserts, max_seqlen passed)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(7)
    cu = offsets([4, 0, 11, 1])
    q = torch.randn(16, 4, 32, generator=g, requires_grad=True)
    k = torch.randn(16, 2, 32, generator=g, requires_grad=True)
    v = torch.randn(16, 2, 32, generator=g, requires_grad=True)
    angles = torch.rand(11, 16, generator=g)
    rope = (angles.cos(), angles.sin())

    def block(q, k, v, cu):
        o = remat.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=11, max_seqlen_k=11, causal=True,
                            rope=rope, softcap=30.0, backend=backend)
        return (o**2).sum()

    counter = CompileCounter()
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    loss_c = compiled(q, k, v, cu)
    grads_c = torch.autograd.grad(loss_c, [q, k, v])
    loss_e = block(q, k, v, cu)
    grads_e = torch.autograd.grad(loss_e, [q, k, v])
    assert counter.frames == 1
    torch.testing.assert_close(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge)


def test_varlen_compile_requires_max_seqlen():
    torch._dynamo.reset()
    cu = offsets([2, 4])

    def block(q, k, v):
        return remat.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="torch")

    with pytest.raises(Exception, match="pass max_seqlen_q and max_seqlen_k"):
        torch.compile(block, fullgraph=True)(*_packed())


# The CUDA kernels' packed path, run on the CPU through tests/cuda_emulation (the emulator of
# tests/test_cuda_emulation.py, built from csrc/ as it is now): the kernels with cu_seqlens in their
# params, against the float64 reference per sequence, forward and both backward modes.
EMULATION_CASES = [
    vcase("f16-d64-causal-gqa-zero-lengths", [5, 0, 40, 1, 3], [5, 2, 40, 1, 0], 4, 2, 64, dtype=torch.float16,
          causal=True),
    vcase("bf16-d80-rope-per-token-dropout-softcap", [9, 17, 1], [12, 17, 4], 2, 1, 80, dtype=torch.bfloat16,
          causal=True, rope="per_token", dropout=0.2, softcap=8.0),
    vcase("f16-d32-rope-restart-window", [33, 2, 70], [33, 6, 70], 2, 2, 32, dtype=torch.float16, rope="restart",
          window=(9, 4)),
]


@pytest.mark.parametrize("spec", EMULATION_CASES)
def test_emulated_cuda_varlen_matches_reference(emu, spec):  # noqa: F811 (the imported fixture)
    dtype = spec["dtype"]
    q, k, v, dout, cu_q, cu_k, rope = make_varlen_inputs(spec, dtype)
    total_q, hq, d = q.shape
    total_k, hkv = k.shape[:2]
    max_q, max_k = max(spec["lens_q"]), max(spec["lens_k"])
    inputs = {name: Guarded.copy_of(t) for name, t in zip(("q", "k", "v", "dout"), (q, k, v, dout))}
    offsets_q, offsets_k = cu_q.clone(), cu_k.clone()
    cos = sin = None
    per_token_stride = 0
    if rope is not None:
        cos, sin = (Guarded.copy_of(t[..., : d // 2].float().contiguous()) for t in rope)
        per_token_stride = d // 2 if rope[0].dim() == 3 else 0
    dropout = spec.get("dropout", 0.0)
    rng = torch.tensor([0x123456789ABC, 2**33 + 7], dtype=torch.int64)
    left, right = window_bounds(spec.get("window"), spec.get("causal", False))
    softcap = float(spec.get("softcap") or 0.0)
    packed = dict(cos=cos.ptr() if cos else None, sin=sin.ptr() if sin else None,
                  rng=rng.data_ptr() if dropout else None, batch=len(spec["lens_q"]), n=max_q, m=max_k, hq=hq,
                  hkv=hkv, head_dim=d, window_left=left, window_right=right, scale=d**-0.5, softcap=softcap,
                  dropout_p=dropout, cu_seqlens_q=offsets_q.data_ptr(), cu_seqlens_k=offsets_k.data_ptr(),
                  total_q=total_q, rope_token_stride=per_token_stride)
    o = Guarded.empty((total_q, hq, d), dtype)
    lse = Guarded.empty((hq, total_q), torch.float32)
    fwd = FwdParams(q=inputs["q"].ptr(), k=inputs["k"].ptr(), v=inputs["v"].ptr(), o=o.ptr(), lse=lse.ptr(), **packed)
    for name in ("q", "k", "v"):
        fwd_strides = inputs[name].tensor.stride()
        setattr(fwd, f"{name}_row_stride", fwd_strides[0])
        setattr(fwd, f"{name}_head_stride", fwd_strides[1])
    _check_launch(emu, "emu_attention_fwd", fwd, KIND[dtype], "packed forward")

    torch.manual_seed(0)
    keeps = sequence_keeps(spec, rng)
    reference = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, keeps, torch.float64)
    stock = reference_outputs(q, k, v, dout, cu_q, cu_k, rope, spec, keeps, dtype)
    assert_within_2x_of_stock("o", o.tensor, stock[0], reference[0], dtype)
    lengths_k = cu_k.diff().repeat_interleave(cu_q.diff().long())
    assert torch.equal(torch.isinf(lse.tensor), (lengths_k == 0)[None].expand(hq, -1)), "lse +inf without keys"
    for deterministic in (True, False):
        dq = Guarded.empty((total_q, hq, d), dtype)
        dk, dv = (Guarded.empty((total_k, hkv, d), dtype) for _ in range(2))
        delta = Guarded.empty((hq, total_q), torch.float32)
        dq_accum = None if deterministic else Guarded.empty((total_q, hq, d), torch.float32)
        if dq_accum is not None:
            dq_accum.tensor.zero_()
        bwd = BwdParams(dout=inputs["dout"].ptr(), q=inputs["q"].ptr(), k=inputs["k"].ptr(), v=inputs["v"].ptr(),
                        o=o.ptr(), lse=lse.ptr(), dq=dq.ptr(), dk=dk.ptr(), dv=dv.ptr(), delta=delta.ptr(),
                        dq_accum=dq_accum.ptr() if dq_accum else None, deterministic=deterministic, **packed)
        for name, t in (("dout", inputs["dout"].tensor), ("q", inputs["q"].tensor), ("k", inputs["k"].tensor),
                        ("v", inputs["v"].tensor), ("o", o.tensor)):
            setattr(bwd, f"{name}_row_stride", t.stride()[0])
            setattr(bwd, f"{name}_head_stride", t.stride()[1])
        mode = "deterministic" if deterministic else "atomic"
        _check_launch(emu, "emu_attention_bwd", bwd, KIND[dtype], f"packed {mode} backward")
        for name, got, want, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), stock[1:], reference[1:]):
            assert_within_2x_of_stock(f"{name} ({mode})", got.tensor, want, ref, dtype)
        for name, guarded in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv), ("delta", delta)):
            assert guarded.guards_intact(), f"{name}: written outside its bounds ({mode})"


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomics"])
@pytest.mark.parametrize("spec", CASES + EMULATION_CASES)
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_varlen_matches_float64_reference(backend, spec, deterministic):
    """Not run here (no GPU): the cuda and Triton packed kernels on a GPU, bf16, both backwards."""
    dtype = spec.get("dtype", torch.bfloat16)
    if deterministic:
        check_against_float64(backend, spec, dtype, device="cuda")
    else:
        with deterministic_mode(False):
            check_against_float64(backend, spec, dtype, device="cuda", deterministic=False)
