"""Non-finite inputs propagate as stock PyTorch's do (issue 31): NaN, +inf and -inf in q, k, v or the
upstream gradient of attention, on every backend the CPU runs (cpp, torch, Triton interpreted, the aten
core, and the CUDA kernels through the emulator of tests/test_cuda_emulation.py), with GQA, softcap,
rope, causal and windowed masks, rows that see no key and packed sequences; a NaN row of the norms'
and MLPs' input stays in that row; attention with no queries or no keys returns what stock returns,
without running a kernel.

What stock does, and the side remat takes where PyTorch's CPU kernels disagree (torch 2.14: SDPA's
math and flash backends on the same inputs, test_stock_kernels_disagree_where_documented):

- A row with a +inf logit (from a +inf in q or k): the math backend's softmax is NaN for the whole row
  (exp(t - max) with max = +inf is NaN at the +inf logit, so the row's sum is), so dv = P^T dout is NaN
  at every key; the flash kernel, at some shapes and on some CPUs, keeps lse = +inf, so its P = exp(t - lse) is NaN
  only at the +inf logits and 0 elsewhere, and only those keys' dv rows turn NaN. remat follows math:
  its lse is NaN for such a row (csrc/common/attention_math.h, OnlineSoftmax).
- A key or query a mask hides from a row: math adds the -inf mask to the logits (NaN + -inf = NaN), so
  a NaN key a causal query cannot see still makes that query's row NaN; the flash kernel never reads a
  masked logit. remat follows flash. All of them still multiply operands by the exact 0 of masked
  probabilities (P V, P^T dout, dS K, dS^T Q: 0 * NaN = NaN) wherever a kernel's tile holds a masked
  pair, so a NaN or infinite v, dout, q or k reaches masked pairs or not depending on the tiling; never
  across packed sequences, and a row that sees no key keeps o = 0 whatever the keys hold.
- Without keys, stock adds 0 * (a sum over all of q) to its zero output, so one NaN in q makes all of
  o NaN; remat's o stays 0 (no query has a key to read).

The checks, per output and gradient: without a mask, non-finite exactly where stock's math attention
has it (the eager references below, which test_reference_is_stock_math checks against SDPA's math
backend); with one (causal, window, packed sequences), non-finite at least where stock's math over
each query's visible keys alone has it (the dependencies: the "lower" reference) and at most where
stock's math over all keys of the sequence, masked logits set to -inf, has it (every masked pair in
one tile: the "upper" one), so exactly where those agree. The aten core, which is PyTorch's flash
kernel, is checked against SDPA's flash backend. Finite values follow the 2x-stock rule (_checks.py)
against the per-query reference in float64.
"""

import pytest
import torch
import torch.nn.functional as F
from test_cuda_emulation import (  # noqa: F401 (emu: a fixture)
    KIND,
    BwdParams,
    FwdParams,
    Guarded,
    _check_launch,
    emu,
    visible_keys,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

import remat
from remat.backend import unavailable_reason
from remat.checks import window_bounds
from remat.reference import stock_layer_norm, stock_rms_norm

from _checks import assert_within_2x_of_stock
from helpers import OpCalls, cpu_backends, eager_gated, eager_gelu

NONFINITE = (float("nan"), float("inf"), float("-inf"))
NAMES = ("o", "dq", "dk", "dv")
TENSORS = ("q", "k", "v", "dout")
CPU = torch.device("cpu")


def attention_backends():
    return cpu_backends() + (["aten"] if unavailable_reason("aten", CPU) is None else [])


NATIVE = [b for b in cpu_backends() if b != "triton"]


def spec(name, n, m, hq, hkv, d=16, **options):
    return pytest.param(dict(n=n, m=m, hq=hq, hkv=hkv, d=d, **options), id=name)


# Dense calls: one batch entry per (position, value) pair poisons one tensor (batch entries do not
# interact), so one call checks NaN, +inf and -inf at both positions (_dense_inputs).
SPECS = [
    spec("plain", 8, 8, 2, 2),
    spec("gqa-softcap-rope-n7-m9", 7, 9, 4, 2, softcap=5.0, rope=True),
    spec("f16-gqa-n5-m11", 5, 11, 2, 1, dtype=torch.float16),
    spec("causal-gqa", 8, 8, 4, 2, causal=True),
    spec("causal-n9-m5-emptyrows", 9, 5, 2, 1, causal=True),
    spec("window-softcap-n10-m12", 10, 12, 2, 1, window=(2, 1), softcap=5.0),
]
# Packed calls: sequence 1 has keys but no queries, sequence 3 queries but no keys.
VARLEN_SPECS = [
    spec("varlen-causal", [3, 0, 4, 2], [3, 2, 5, 0], 2, 1, causal=True),
    spec("varlen-softcap", [3, 0, 4, 2], [4, 2, 5, 0], 2, 1, softcap=5.0),
]


def _masked(spec):
    return bool(spec.get("causal") or spec.get("window"))


def _rope_tables(m, d):
    angles = torch.rand(m, d // 2, generator=torch.Generator().manual_seed(3)) * 6.0
    return angles.cos(), angles.sin()


def _rotate(x, cos, sin, first):
    """Rotate-half rope of x [B, L, H, D] at positions first .. first + L - 1."""
    half = x.shape[-1] // 2
    c, s = (t[first : first + x.shape[1], None, :].to(x.dtype) for t in (cos, sin))
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _math_attention(q, k, v, softcap, mask, per_query):
    """Stock's math attention on heads-first q [B, H, N, D], k, v [B, H, M, D]: logits, softcap,
    masked logits set to -inf, SDPA math's softmax (_safe_softmax: 0 for a row whose logits are all
    -inf; in fp32 for 16-bit inputs), P V. ``per_query``: each query over the keys ``mask`` lets it
    see alone, as products per (query, key) pair whose operands are zeroed where the pair is masked,
    so that nothing of a hidden key (or of a query, for a key it cannot see) enters them, forward or
    backward. Otherwise the products span all keys, masked pairs with P = 0 (or None: no mask)."""
    scale = q.shape[-1] ** -0.5
    if per_query:
        pairs = mask[..., None]
        logits = (torch.where(pairs, q[..., :, None, :], 0.0) * torch.where(pairs, k[..., None, :, :], 0.0)).sum(-1)
    else:
        logits = q @ k.transpose(-1, -2)
    logits = logits * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch._safe_softmax(logits if q.dtype == torch.float64 else logits.float(), -1).to(q.dtype)
    if per_query:
        return (probs[..., None] * torch.where(pairs, v[..., None, :, :], 0.0)).sum(-2)
    return probs @ v


def _eager_heads(q, k, v, spec, visible, per_query):
    """o [B, N, Hq, D] of stock's math attention (_math_attention) with rope and GQA."""
    n, hq, d = q.shape[1:]
    m, hkv = k.shape[1], k.shape[2]
    if spec.get("rope"):
        cos, sin = _rope_tables(m, d)
        q, k = _rotate(q, cos, sin, m - n), _rotate(k, cos, sin, 0)
    qh = q.transpose(1, 2)
    kh, vh = (t.transpose(1, 2).repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    return _math_attention(qh, kh, vh, spec.get("softcap"), visible, per_query).transpose(1, 2)


def _with_grads(fn, q, k, v, dout, dtype):
    """[o, dq, dk, dv] of fn(q, k, v) in ``dtype`` (a gradient nothing reaches is zeros)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    grads = torch.autograd.grad(o, leaves, dout.to(dtype), allow_unused=True)
    return [o.detach()] + [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def _dense_reference(q, k, v, dout, spec, per_query, dtype):
    visible = visible_keys(q.shape[1], k.shape[1], spec)
    return _with_grads(lambda *t: _eager_heads(*t, spec, visible, per_query), q, k, v, dout, dtype)


def _varlen_reference(q, k, v, dout, spec, per_query, dtype):
    """As _dense_reference for packed q [total_q, Hq, D], k, v [total_k, Hkv, D]: each sequence alone."""

    def packed(q, k, v):
        outputs, q0, k0 = [], 0, 0
        for n, m in zip(spec["n"], spec["m"]):
            if n and m:
                seq = [t[None, start : start + length] for t, start, length in ((q, q0, n), (k, k0, m), (v, k0, m))]
                outputs.append(_eager_heads(*seq, spec, visible_keys(n, m, spec), per_query)[0])
            elif n:
                outputs.append(q.new_zeros(n, *q.shape[1:]))
            q0, k0 = q0 + n, k0 + m
        return torch.cat(outputs)

    return _with_grads(packed, q, k, v, dout, dtype)


def _bounds(reference, q, k, v, dout, spec, dtype):
    """(lower, upper, stock, reference64): the non-finite bounds (float64), stock's per-query
    computation in ``dtype`` and in float64."""
    lower = reference(q, k, v, dout, spec, True, torch.float64)
    upper = reference(q, k, v, dout, spec, False, torch.float64) if _masked(spec) else lower
    stock = reference(q, k, v, dout, spec, True, dtype)
    return lower, upper, stock, lower


def _where(mask):
    return mask.nonzero()[:4].tolist()


def assert_propagates(got, lower, upper, stock, reference, dtype, what):
    for name, value, low, up, stock_value, ref in zip(NAMES, got, lower, upper, stock, reference):
        bad = ~torch.isfinite(value)
        missing = ~torch.isfinite(low) & ~bad
        assert not missing.any(), f"{what}: {name} is finite at {_where(missing)}, where stock's is not"
        extra = bad & torch.isfinite(up)
        assert not extra.any(), f"{what}: {name} is not finite at {_where(extra)}, where stock's is"
        finite = ~bad
        assert_within_2x_of_stock(f"{what}: {name}", value[finite], stock_value[finite], ref[finite], dtype)


POSITIONS = {"first": lambda rows, heads, d: (0, 0, 1), "last": lambda rows, heads, d: (rows - 1, heads - 1, d - 1)}


def _dense_inputs(spec, tensor, positions, seed=0):
    """q, k, v, dout of a dense spec, one batch entry per (position, value) pair of ``positions`` x
    NONFINITE, poisoned with the value in ``tensor`` at the position: "first" (row 0, head 0, dim 1)
    or "last" (last row, last head, last dim)."""
    g = torch.Generator().manual_seed(seed)
    dtype = spec.get("dtype", torch.float32)
    shapes = {"q": (spec["n"], spec["hq"]), "k": (spec["m"], spec["hkv"]), "v": (spec["m"], spec["hkv"]),
              "dout": (spec["n"], spec["hq"])}
    scale = 2.0 if spec.get("softcap") else 1.0
    t = {name: (torch.randn(len(positions) * len(NONFINITE), *shape, spec["d"], generator=g) * scale).to(dtype)
         for name, shape in shapes.items()}
    for b, (at, value) in enumerate((at, value) for at in positions for value in NONFINITE):
        t[tensor][(b, *POSITIONS[at](*shapes[tensor], spec["d"]))] = value
    return t["q"], t["k"], t["v"], t["dout"]


def _varlen_inputs(spec, tensor, value, seed=0):
    """Packed q, k, v, dout of a varlen spec with ``value`` in ``tensor`` at both positions of
    _dense_inputs (the first query and key are sequence 0's; the last query is one of a sequence
    without keys, the last key one of the longest sequence), and the int32 offsets."""
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(spec["n"]), sum(spec["m"])
    shapes = {"q": (total_q, spec["hq"]), "k": (total_k, spec["hkv"]), "v": (total_k, spec["hkv"]),
              "dout": (total_q, spec["hq"])}
    t = {name: torch.randn(*shape, spec["d"], generator=g) for name, shape in shapes.items()}
    for position in POSITIONS.values():
        t[tensor][position(*shapes[tensor], spec["d"])] = value
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
                  for lengths in (spec["n"], spec["m"]))
    return t["q"], t["k"], t["v"], t["dout"], cu_q, cu_k


def _remat(q, k, v, dout, spec, backend, **packed):
    rope = _rope_tables(k.shape[-3], q.shape[-1]) if spec.get("rope") else None
    return _with_grads(lambda *t: remat.attention(*t, causal=spec.get("causal", False), window=spec.get("window"),
                                                  softcap=spec.get("softcap"), rope=rope, backend=backend, **packed),
                       q, k, v, dout, q.dtype)


def _aten_takes(spec):
    return not (spec.get("softcap") or spec.get("window") or spec.get("rope")
                or (spec.get("causal") and spec["n"] != spec["m"]) or spec.get("dtype", torch.float32) != torch.float32)


# The Triton kernels run interpreted, about a second a program grid: a sample of the runs (one position
# a call), every spec option and tensor at least once.
TRITON_DENSE_RUNS = [("gqa-softcap-rope-n7-m9", "q", "first"), ("causal-n9-m5-emptyrows", "v", "first"),
                     ("causal-n9-m5-emptyrows", "dout", "last"), ("window-softcap-n10-m12", "k", "last"),
                     ("causal-gqa", "k", "first")]
TRITON_VARLEN_RUNS = [("varlen-causal", "v", float("nan")), ("varlen-softcap", "q", float("inf")),
                      ("varlen-causal", "dout", float("-inf"))]


def _dense_runs():
    """pytest params (backend, spec, tensor, positions): both positions of every tensor of every spec
    the backend takes, on Triton TRITON_DENSE_RUNS."""
    runs = []
    for backend in attention_backends():
        for s in SPECS:
            if backend == "triton":
                combos = [(tensor, (at,)) for sid, tensor, at in TRITON_DENSE_RUNS if sid == s.id]
            elif backend != "aten" or _aten_takes(s.values[0]):
                combos = [(tensor, tuple(POSITIONS)) for tensor in TENSORS]
            else:
                combos = []
            runs += [pytest.param(backend, s.values[0], tensor, positions,
                                  id="-".join([backend, s.id, tensor, *positions])) for tensor, positions in combos]
    return runs


def _varlen_runs():
    """pytest params (backend, spec, tensor, value): every combination, on Triton TRITON_VARLEN_RUNS."""
    runs = []
    for backend in cpu_backends():
        for s in VARLEN_SPECS:
            combos = [(tensor, value) for tensor in TENSORS for value in NONFINITE]
            if backend == "triton":
                combos = [(tensor, value) for sid, tensor, value in TRITON_VARLEN_RUNS if sid == s.id]
            runs += [pytest.param(backend, s.values[0], tensor, value, id=f"{backend}-{s.id}-{tensor}-{value}")
                     for tensor, value in combos]
    return runs


@pytest.mark.parametrize("backend, spec, tensor, positions", _dense_runs())
def test_attention_nonfinite_propagates_as_stock(backend, spec, tensor, positions):
    dtype = spec.get("dtype", torch.float32)
    q, k, v, dout = _dense_inputs(spec, tensor, positions)
    got = _remat(q, k, v, dout, spec, backend)
    what = f"{backend} {tensor}{list(positions)}"
    if backend == "aten":
        # PyTorch's CPU flash kernel itself: the stock backend it corresponds to is SDPA's flash one.
        flash = _with_grads(lambda *t: _sdpa(*t, spec, SDPBackend.FLASH_ATTENTION), q, k, v, dout, dtype)
        for name, value, want in zip(NAMES, got, flash):
            torch.testing.assert_close(value, want, rtol=0, atol=0, equal_nan=True, msg=f"{what}: {name}")
        return
    assert_propagates(got, *_bounds(_dense_reference, q, k, v, dout, spec, dtype), dtype, what)


@pytest.mark.parametrize("backend, spec, tensor, value", _varlen_runs())
def test_packed_attention_nonfinite_stays_in_its_sequence(backend, spec, tensor, value):
    q, k, v, dout, cu_q, cu_k = _varlen_inputs(spec, tensor, value)
    got = _remat(q, k, v, dout, spec, backend, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    bounds = _bounds(_varlen_reference, q, k, v, dout, spec, torch.float32)
    assert_propagates(got, *bounds, torch.float32, f"{backend} {tensor} = {value}")


def _sdpa(q, k, v, spec, kernel):
    """SDPA on remat's [B, L, H, D] inputs with the given stock backend (GQA, causal top-left = remat's
    bottom-right for N == M)."""
    with sdpa_kernel(kernel):
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=spec.get("causal", False),
                                           enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


@pytest.mark.parametrize("spec", [s for s in SPECS if _aten_takes(s.values[0]) and not _masked(s.values[0])])
def test_reference_is_stock_math(spec):
    """Without a mask, the eager reference's non-finite positions are SDPA math's, over the dense runs'
    inputs (with one, math's are a superset: test_stock_kernels_disagree_where_documented)."""
    for tensor in TENSORS:
        q, k, v, dout = _dense_inputs(spec, tensor, tuple(POSITIONS))
        math = _with_grads(lambda *t: _sdpa(*t, spec, SDPBackend.MATH), q, k, v, dout, torch.float32)
        ours = _dense_reference(q, k, v, dout, spec, False, torch.float32)
        for name, a, b in zip(NAMES, ours, math):
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"{tensor}: {name}"


def test_stock_kernels_disagree_where_documented():
    """The two disagreements of the module docstring (B 1, N = M = 8, one head of 16; the flash
    kernel's answer to the first depends on the shape, with N = 6 it is math's, and on the CPU),
    and the side remat's kernels take on each (Triton's: the property tests above)."""
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 8, 1, 16, generator=g) for _ in range(4))
    plain, causal = dict(n=8, m=8, hq=1, hkv=1, d=16), dict(n=8, m=8, hq=1, hkv=1, d=16, causal=True)

    def stock(q, k, v, spec, kernel):
        return _with_grads(lambda *t: _sdpa(*t, spec, kernel), q, k, v, dout, torch.float32)

    # A +inf in q (row 0): math makes every dv row NaN, flash only those of the keys with a +inf logit.
    q_inf = q.clone()
    q_inf[0, 0, 0, 5] = float("inf")
    math, flash = (stock(q_inf, k, v, plain, kernel) for kernel in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION))
    assert not torch.isfinite(math[3]).any()
    # PyTorch's CPU flash kernel gives one answer or the other depending on the shape and on the
    # CPU it runs on (the build machine's AMD EPYC of 2026-12-03 gives math's at this shape):
    # either way remat's kernels give math's.
    flash_rows = torch.isfinite(flash[3]).all(dim=-1)[0, :, 0]
    assert torch.equal(flash_rows, k[0, :, 0, 5] < 0) or not torch.isfinite(flash[3]).any()
    for backend in NATIVE:
        got = _remat(q_inf, k, v, dout, plain, backend)
        assert torch.equal(torch.isfinite(got[3]), torch.isfinite(math[3])), backend
    # A NaN in the last key under a causal mask: math makes every row NaN, flash only the last one.
    k_nan = k.clone()
    k_nan[0, 7, 0, 3] = float("nan")
    math, flash = (stock(q, k_nan, v, causal, kernel) for kernel in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION))
    assert not torch.isfinite(math[0]).any()
    assert torch.equal(torch.isfinite(flash[0]).all(dim=-1)[0, :, 0], torch.arange(8) < 7)
    for backend in NATIVE:
        got = _remat(q, k_nan, v, dout, causal, backend)
        assert torch.equal(torch.isfinite(got[0]), torch.isfinite(flash[0])), backend


# The CUDA kernels through the emulator (fp16: the kernels take 16-bit inputs), dense specs, forward
# and both backward modes.
EMULATED_SPECS = [
    spec("gqa-softcap-n7-m9", 7, 9, 4, 2, softcap=5.0),
    spec("causal-n9-m5-emptyrows", 9, 5, 2, 1, causal=True),
    spec("window-n10-m12", 10, 12, 2, 1, window=(2, 1)),
]


def _emulated(lib, q, k, v, dout, spec):
    """[o, dq, dk, dv] of the emulated CUDA kernels, once per backward mode: {deterministic: outputs}."""
    b, n, hq, d = q.shape
    m, hkv = k.shape[1], k.shape[2]
    dtype = q.dtype
    inputs = {name: Guarded.copy_of(t) for name, t in zip(TENSORS, (q, k, v, dout))}
    left, right = window_bounds(spec.get("window"), spec.get("causal", False))
    common = dict(batch=b, n=n, m=m, hq=hq, hkv=hkv, head_dim=d, window_left=left, window_right=right,
                  scale=d**-0.5, softcap=float(spec.get("softcap") or 0.0))
    o = Guarded.empty((b, n, hq, d), dtype)
    lse = Guarded.empty((b, hq, n), torch.float32)
    fwd = FwdParams(q=inputs["q"].ptr(), k=inputs["k"].ptr(), v=inputs["v"].ptr(), o=o.ptr(), lse=lse.ptr(), **common)
    for name in ("q", "k", "v"):
        for dim, stride in zip(("batch", "row", "head"), inputs[name].tensor.stride()[:3]):
            setattr(fwd, f"{name}_{dim}_stride", stride)
    _check_launch(lib, "emu_attention_fwd", fwd, KIND[dtype], "forward")
    results = {}
    for deterministic in (True, False):
        dq = Guarded.empty((b, n, hq, d), dtype)
        dk, dv = (Guarded.empty((b, m, hkv, d), dtype) for _ in range(2))
        delta = Guarded.empty((b, hq, n), torch.float32)
        dq_accum = None if deterministic else Guarded.empty((b, n, hq, d), torch.float32)
        if dq_accum is not None:
            dq_accum.tensor.zero_()
        bwd = BwdParams(dout=inputs["dout"].ptr(), q=inputs["q"].ptr(), k=inputs["k"].ptr(), v=inputs["v"].ptr(),
                        o=o.ptr(), lse=lse.ptr(), dq=dq.ptr(), dk=dk.ptr(), dv=dv.ptr(), delta=delta.ptr(),
                        dq_accum=dq_accum.ptr() if dq_accum else None, deterministic=deterministic, **common)
        for name, t in (*((name, inputs[name].tensor) for name in TENSORS), ("o", o.tensor)):
            for dim, stride in zip(("batch", "row", "head"), t.stride()[:3]):
                setattr(bwd, f"{name}_{dim}_stride", stride)
        _check_launch(lib, "emu_attention_bwd", bwd, KIND[dtype], "backward")
        results[deterministic] = [t.tensor.clone() for t in (o, dq, dk, dv)]
    return results


@pytest.mark.parametrize("tensor, at", [("q", "first"), ("k", "last"), ("v", "first"), ("dout", "last"),
                                        ("k", "first")])
@pytest.mark.parametrize("spec", EMULATED_SPECS)
def test_emulated_cuda_attention_nonfinite_propagates_as_stock(emu, spec, tensor, at):  # noqa: F811 (the fixture)
    q, k, v, dout = _dense_inputs(dict(spec, dtype=torch.float16), tensor, (at,))
    bounds = _bounds(_dense_reference, q, k, v, dout, spec, torch.float16)
    for deterministic, got in _emulated(emu, q, k, v, dout, spec).items():
        assert_propagates(got, *bounds, torch.float16, f"cuda ({'deterministic' if deterministic else 'atomic'})")


# The norms and MLPs: a NaN in one row of x stays in its row of the output and dx, with exactly stock's
# non-finite positions in every output and gradient.
def _poisoned_rows(rows, cols, seed=0):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[1, 3] = float("nan")
    return x


def _assert_same_nonfinite(got, want, what):
    for name, a, b in zip(("out", *(f"d{i}" for i in range(len(got) - 1))), got, want):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"{what}: {name}"


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_norm_nan_row_stays_in_its_row(backend, kind):
    g = torch.Generator().manual_seed(1)
    x = _poisoned_rows(5, 24)
    dy = torch.randn(5, 24, generator=g)
    params = [1 + torch.randn(24, generator=g) * 0.1] + ([torch.randn(24, generator=g)] if kind == "layer" else [])
    fn = remat.rms_norm if kind == "rms" else remat.layer_norm
    stock_fn = stock_rms_norm if kind == "rms" else stock_layer_norm

    def run(f, **kw):
        leaves = [t.clone().requires_grad_() for t in (x, *params)]
        y = f(*leaves, **kw)
        return [y.detach(), *torch.autograd.grad(y, leaves, dy)]

    got, want = run(fn, backend=backend), run(stock_fn)
    _assert_same_nonfinite(got, want, f"{backend} {kind}_norm")
    assert torch.equal(torch.isfinite(got[0]).all(dim=1), torch.arange(5) != 1)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_mlp_nan_row_stays_in_its_row(backend, mlp):
    g = torch.Generator().manual_seed(2)
    x = _poisoned_rows(4, 16)
    if mlp == "swiglu":
        weights = [torch.randn(24, 16, generator=g) * 0.2, torch.randn(24, 16, generator=g) * 0.2,
                   torch.randn(16, 24, generator=g) * 0.2]
        fn = lambda x, wg, wu, wd: remat.swiglu_mlp(x, wg, wu, wd, backend=backend)  # noqa: E731
        stock = lambda x, wg, wu, wd: eager_gated(x, wg, wu, wd, None, None, None, "silu")  # noqa: E731
    else:
        weights = [torch.randn(24, 16, generator=g) * 0.2, torch.randn(24, generator=g) * 0.1,
                   torch.randn(16, 24, generator=g) * 0.2, torch.randn(16, generator=g) * 0.1]
        fn = lambda x, wf, bf, wp, bp: remat.gelu_mlp(x, wf, bf, wp, bp, backend=backend)  # noqa: E731
        stock = lambda x, wf, bf, wp, bp: eager_gelu(x, wf, bf, wp, bp, "gelu")  # noqa: E731
    dy = torch.randn(4, 16, generator=g)

    def run(f):
        leaves = [t.clone().requires_grad_() for t in (x, *weights)]
        y = f(*leaves)
        return [y.detach(), *torch.autograd.grad(y, leaves, dy)]

    got, want = run(fn), run(stock)
    _assert_same_nonfinite(got, want, f"{backend} {mlp}")
    assert torch.equal(torch.isfinite(got[0]).all(dim=1), torch.arange(4) != 1)


# Attention with no queries, no keys or no batch entries: what stock returns (an empty o, or zeros
# where queries have no key; gradients of the inputs' shapes), and no kernel runs on an empty grid.
def _kernel_ops():
    ops = [torch.ops.remat_triton.attention_fwd.default, torch.ops.remat_triton.attention_bwd.default,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
    if hasattr(torch.ops.remat, "attention_fwd"):
        ops += [torch.ops.remat.attention_fwd.default, torch.ops.remat.attention_bwd.default]
    return ops


@pytest.mark.parametrize("b, n, m", [(2, 0, 5), (2, 4, 0), (0, 3, 3), (1, 0, 0)],
                         ids=["no-queries", "no-keys", "no-batch", "nothing"])
@pytest.mark.parametrize("backend", attention_backends())
def test_attention_without_queries_or_keys_returns_what_stock_returns(backend, b, n, m):
    """Stock without keys adds 0 * (a sum over all of q) to its zeros (its o's grad_fn is an add),
    so one NaN in q makes its whole o NaN; remat's o stays 0 there (no query has a key to read)."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, n, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(b, m, 2, 8, generator=g) for _ in range(2))
    causal = backend != "aten"  # the aten core refuses causal calls with N != M
    want = _with_grads(lambda *t: _sdpa(*t, {}, SDPBackend.MATH), q, k, v, dout, torch.float32)
    with OpCalls(_kernel_ops()) as spy:
        got = _remat(q, k, v, dout, dict(causal=causal), backend)
        q[..., 0] = float("nan")
        assert torch.equal(_remat(q, k, v, dout, dict(causal=causal), backend)[0], got[0])
    assert spy.calls == []
    for name, value, expected in zip(NAMES, got, want):
        assert value.shape == expected.shape and torch.equal(value, expected), name


@pytest.mark.parametrize("lengths_q, lengths_k", [([0, 0], [3, 2]), ([2, 3], [0, 0])], ids=["no-queries", "no-keys"])
@pytest.mark.parametrize("backend", cpu_backends())
def test_packed_attention_without_queries_or_keys(backend, lengths_q, lengths_k):
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(sum(lengths_q), 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(sum(lengths_k), 2, 8, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
                  for lengths in (lengths_q, lengths_k))
    got = _remat(q, k, v, dout, dict(causal=True), backend, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for name, value, like in zip(NAMES, got, (q, q, k, v)):
        assert value.shape == like.shape and torch.equal(value, torch.zeros_like(like)), name
