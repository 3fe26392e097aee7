"""Empty queries (remat.attention / remat.norm_attention ``empty_queries``): queries that attend to
nothing whatever their keys, what the pads of a padded batch are in a patched model. Their output
rows are 0 and no gradient flows back from them, as PyTorch's SDPA gives a query whose keys are
all masked; every other row and every gradient is the attention's without them. Checked on every
backend the CPU runs (dense and packed, GQA, causal, rope) against the float64 eager reference with
the empty rows of o and of the upstream gradient zeroed (the 2x rule against stock float32), and for
norm_attention against the same call without empties given that zeroed gradient (bitwise: the same
kernels run). Bad arguments raise before any kernel."""

import pytest
import torch

import remat
from remat.backend import unavailable_reason
from remat.reference import attention_reference

from _checks import assert_within_2x_of_stock
from helpers import cpu_backends

CPU = torch.device("cpu")
BACKENDS = cpu_backends() + (["aten"] if unavailable_reason("aten", CPU) is None else [])


def qkv(batch, n, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, h, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv)]


def masked_reference(q, k, v, dout, empty, **options):
    """o of the eager reference with the empty rows zeroed, and the gradients of q, k, v given dout
    with the empty rows zeroed (the empty rows' outputs are constants)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = attention_reference(q, k, v, **options)
    keep = (~empty)[..., None, None]
    (o * keep).backward(dout * keep)
    return (o * keep).detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_dense_empty_queries_give_zero_rows_and_no_gradient(backend, causal):
    q, k, v = qkv(2, 9)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    empty = torch.zeros(2, 9, dtype=torch.bool)
    empty[1, :3] = True  # a left-padded row
    empty[0, 8] = True  # and a right pad
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    o = remat.attention(*inputs, causal=causal, backend=backend, empty_queries=empty)
    o.backward(dout)
    got = (o.detach(), *(t.grad for t in inputs))
    want = masked_reference(*(t.double() for t in (q, k, v)), dout.double(), empty, causal=causal)
    base = masked_reference(q, k, v, dout, empty, causal=causal)
    assert torch.equal(got[0][empty], torch.zeros_like(got[0][empty]))
    for name, value, stock, reference in zip(("o", "dq", "dk", "dv"), got, base, want, strict=True):
        assert_within_2x_of_stock(name, value, stock, reference, torch.float32)
    assert torch.equal(got[1][empty], torch.zeros_like(got[1][empty]))  # no gradient from an empty query


@pytest.mark.parametrize("backend", cpu_backends())
def test_packed_empty_queries_match_each_sequence_with_its_rows_zeroed(backend):
    """Two packed sequences (lengths 5 and 6), the second's last two queries empty."""
    q, k, v = qkv(1, 11)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    empty = torch.zeros(1, 11, dtype=torch.bool)
    empty[0, 9:] = True
    offsets = torch.tensor([0, 5, 11], dtype=torch.int32)
    inputs = [t[0].clone().requires_grad_() for t in (q, k, v)]
    o = remat.attention(*inputs, causal=True, backend=backend, cu_seqlens_q=offsets, cu_seqlens_k=offsets,
                        empty_queries=empty[0])
    o.backward(dout[0])
    got = (o.detach(), *(t.grad for t in inputs))
    for dtype, results in ((torch.float64, []), (torch.float32, [])):
        for start, end in ((0, 5), (5, 11)):
            part = [t[:, start:end].to(dtype) for t in (q, k, v, dout)]
            results.append(masked_reference(*part, empty[:, start:end], causal=True))
        if dtype == torch.float64:
            want = [torch.cat([r[i][0] for r in results]) for i in range(4)]
        else:
            base = [torch.cat([r[i][0] for r in results]) for i in range(4)]
    for name, value, stock, reference in zip(("o", "dq", "dk", "dv"), got, base, want, strict=True):
        assert_within_2x_of_stock(name, value, stock, reference, torch.float32)
    assert not got[0][9:].any() and not got[1][9:].any()


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("packed", [False, True])
def test_norm_attention_empty_queries_equal_the_call_given_a_zeroed_gradient(backend, packed):
    g = torch.Generator().manual_seed(4)
    batch, n, hidden, heads, d = (1, 10, 32, 4, 8) if packed else (2, 7, 32, 4, 8)
    x = torch.randn(batch, n, hidden, generator=g)
    weights = [torch.randn(hidden, generator=g)] + [torch.randn(heads * d, hidden, generator=g) * 0.2
                                                   for _ in range(3)]
    empty = torch.zeros(batch, n, dtype=torch.bool)
    empty[-1, :2] = True
    varlen = dict(cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen=6) if packed else {}
    dout = torch.randn(batch, n, heads, d, generator=g)

    def run(**extra):
        inputs = [t.clone().requires_grad_() for t in (x, *weights)]
        o = remat.norm_attention(*inputs, num_heads=heads, keep_qkv=False, backend=backend, **varlen, **extra)
        o.backward(dout * (~empty)[..., None, None] if not extra else dout)
        return o.detach(), [t.grad for t in inputs]

    got_o, got_grads = run(empty_queries=empty)
    want_o, want_grads = run()
    assert torch.equal(got_o, want_o * (~empty)[..., None, None])
    for got, want in zip(got_grads, want_grads, strict=True):
        assert torch.equal(got, want)


def test_bad_empty_queries_raise_before_any_kernel():
    q, k, v = qkv(2, 5)
    with pytest.raises(TypeError, match="empty_queries must be None or a bool tensor"):
        remat.attention(q, k, v, empty_queries=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"empty_queries must have the queries' shape \(2, 5\)"):
        remat.attention(q, k, v, empty_queries=torch.zeros(2, 4, dtype=torch.bool))
    offsets = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"queries' shape \(5,\)"):
        remat.attention(q[0], k[0], v[0], cu_seqlens_q=offsets, cu_seqlens_k=offsets,
                        empty_queries=torch.zeros(1, 5, dtype=torch.bool))
