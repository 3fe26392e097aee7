"""Property-based versions of the float64-reference tests (issue #11): hypothesis draws the shapes,
strides (contiguous, row-strided = a column slice of a wider tensor, column-strided = every other
column), dtypes (fp32/fp16/bf16), value scales and options of each block, and every draw must pass
the same 2x-stock-PyTorch rule as the parametrized tests (tests/_checks.py, DESIGN.md section 7),
forward and every gradient, against the float64 references of remat.reference / tests/helpers.py.

- norms: rms_norm / layer_norm with and without weight, bias and a fused residual (each of x,
  residual and dy in its own layout);
- MLPs: remat.gated_mlp (silu / gelu / gelu_tanh; recompute none / activation / block; each bias
  present or not) and remat.gelu_mlp (erf / tanh, biases present or not);
- attention: remat.attention over N, M, Hq, Hkv, D, causal, window, rope (D even, N <= M) and
  layout (bnhd, bhnd, row-strided slices). Softcap, and draws where no query sees two keys, are
  outside the domain: hypothesis found counterexamples there, kept below as strict xfails on
  explicit examples.

On the cpp and torch backends; on triton (interpreted on the CPU) with tiny shapes and a few
examples, as the interpreter is slow.

Reproducible: every test runs with ``derandomize=True`` and ``database=None``, so hypothesis draws
the same fixed examples, derived from the test itself, in every run and in CI, and nothing is
stored between runs. A failing example is shrunk and printed, with ``note()`` lines giving the
case's layout and strides. The whole file takes about 70 s on a shared 2-core CPU (50 s of CPU time).
"""

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, example, given, note, settings
from hypothesis import strategies as st

import remat
from remat.reference import layer_norm_reference, rms_norm_reference, stock_layer_norm, stock_rms_norm

from _checks import assert_within_2x_of_stock
from helpers import DTYPES, cpu_backends, eager_gated, eager_gelu, grads, run_and_check, run_norm, strided

CPU_BACKENDS = [b for b in cpu_backends() if b != "triton"]
needs_triton = pytest.mark.skipif("triton" not in cpu_backends(),
                                  reason="Triton runs on the CPU only under TRITON_INTERPRET=1")
LAYOUTS = ["contiguous", "row_strided", "col_strided"]
# Widths near powers of two and the odd ones DESIGN.md section 7 names, beside small random ones.
EDGE_WIDTHS = [31, 32, 33, 63, 64, 65, 80, 127, 128, 129, 199, 255, 256, 257, 1000]


def reproducible(max_examples):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def widths(max_width):
    small = st.integers(1, min(max_width, 24))
    edges = [w for w in EDGE_WIDTHS if w <= max_width]
    return st.one_of(small, st.sampled_from(edges)) if edges else small


def describe(name, t):
    if t is not None:
        note(f"{name}: shape {tuple(t.shape)} strides {tuple(t.stride())} dtype {t.dtype}")


def to64(t):
    return None if t is None else t.detach().double()


# ---------------------------------------------------------------------------------------- norms


@st.composite
def norm_cases(draw, max_rows, max_width):
    kind = draw(st.sampled_from(["rms", "layer"]))
    return dict(
        kind=kind,
        lead=tuple(draw(st.lists(st.integers(1, max_rows), min_size=1, max_size=2))),
        n=draw(widths(max_width)),
        dtype=draw(st.sampled_from(DTYPES)),
        x_layout=draw(st.sampled_from(LAYOUTS)),
        weight=draw(st.booleans()),
        bias=kind == "layer" and draw(st.booleans()),
        residual=draw(st.sampled_from([None] + LAYOUTS)),
        dy_layout=draw(st.sampled_from(LAYOUTS)),
        scale=draw(st.sampled_from([1.0, 0.01, 30.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_norm(case, backend):
    g = torch.Generator().manual_seed(case["seed"])
    dtype, kind, n = case["dtype"], case["kind"], case["n"]
    shape = (*case["lead"], n)
    x = strided(shape, dtype, "cpu", g, case["x_layout"])
    x.mul_(case["scale"])
    weight = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype) if case["weight"] else None
    bias = (0.5 * torch.randn(n, generator=g)).to(dtype) if case["bias"] else None
    residual = strided(shape, dtype, "cpu", g, case["residual"]) if case["residual"] else None
    dy = strided(shape, dtype, "cpu", g, case["dy_layout"])
    dh = strided(shape, dtype, "cpu", g, "col_strided") if residual is not None else None
    for name, t in [("x", x), ("residual", residual), ("dy", dy), ("dh", dh)]:
        describe(name, t)
    eps = 1e-6 if kind == "rms" else 1e-5
    remat_fn = remat.rms_norm if kind == "rms" else remat.layer_norm
    stock_fn = stock_rms_norm if kind == "rms" else stock_layer_norm
    ref_fn = rms_norm_reference if kind == "rms" else layer_norm_reference
    got = run_norm(remat_fn, kind, x, weight, bias, residual, dy, dh, eps, backend=backend)
    stock = run_norm(stock_fn, kind, x, weight, bias, residual, dy, dh, eps)
    ref = run_norm(ref_fn, kind, to64(x), to64(weight), to64(bias), to64(residual), to64(dy), to64(dh), eps)
    assert set(got) == set(ref)
    for name in ref:
        assert got[name].dtype == dtype, f"{name} has dtype {got[name].dtype}"
        assert_within_2x_of_stock(name, got[name], stock[name], ref[name], dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@reproducible(100)
@given(case=norm_cases(max_rows=12, max_width=1000))
def test_norm_property(backend, case):
    check_norm(case, backend)


@needs_triton
@reproducible(8)
@given(case=norm_cases(max_rows=3, max_width=40))
def test_norm_property_triton(case):
    check_norm(case, "triton")


# ----------------------------------------------------------------------------------------- MLPs


@st.composite
def mlp_cases(draw, gated, max_tokens, max_hidden, max_inter):
    if gated:
        activation = draw(st.sampled_from(["silu", "gelu", "gelu_tanh"]))
        biases = tuple(draw(st.booleans()) for _ in range(3))
    else:
        activation = draw(st.sampled_from(["gelu", "gelu_tanh"]))
        biases = (draw(st.booleans()), None, draw(st.booleans()))
    return dict(
        activation=activation,
        biases=biases,
        recompute=draw(st.sampled_from(["none", "activation", "block"])),
        lead=tuple(draw(st.lists(st.integers(1, max_tokens), min_size=1, max_size=2))),
        hidden=draw(widths(max_hidden)),
        inter=draw(widths(max_inter)),
        dtype=draw(st.sampled_from(DTYPES)),
        x_layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_mlp(case, backend, gated):
    g = torch.Generator().manual_seed(case["seed"])
    dtype, hidden, inter, activation = case["dtype"], case["hidden"], case["inter"], case["activation"]
    x = strided((*case["lead"], hidden), dtype, "cpu", g, case["x_layout"])
    describe("x", x)

    def weight(rows, cols):
        return (torch.randn(rows, cols, generator=g) / cols**0.5).to(dtype)

    def bias(size, present):
        return (0.1 * torch.randn(size, generator=g)).to(dtype) if present else None

    with_bg, with_bu, with_bd = case["biases"]
    if gated:
        params = [weight(inter, hidden), weight(inter, hidden), weight(hidden, inter),
                  bias(inter, with_bg), bias(inter, with_bu), bias(hidden, with_bd)]

        def fn(x, wg, wu, wd, bg, bu, bd):
            return remat.gated_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, activation=activation,
                                   recompute=case["recompute"], backend=backend)

        def ref(*tensors):
            return eager_gated(*tensors, activation)
    else:
        params = [weight(inter, hidden), bias(inter, with_bg), weight(hidden, inter), bias(hidden, with_bd)]

        def fn(x, wfc, bfc, wproj, bproj):
            return remat.gelu_mlp(x, wfc, bfc, wproj, bproj, approximate="tanh" if activation == "gelu_tanh" else
                                  "none", recompute=case["recompute"], backend=backend)

        def ref(*tensors):
            return eager_gelu(*tensors, activation)

    dy = strided((*case["lead"], hidden), dtype, "cpu", g, "contiguous")
    tensors = [x] + params
    got = grads(fn, tensors, dy)
    stock = grads(ref, tensors, dy)
    want = grads(ref, [to64(t) for t in tensors], dy.double())
    names = ["y", "dx"] + [f"d(param {i})" for i, t in enumerate(params) if t is not None]
    assert len(got) == len(want) == len(names)
    for name, value, stock_value, reference in zip(names, got, stock, want):
        assert value.dtype == dtype, f"{name} has dtype {value.dtype}"
        assert_within_2x_of_stock(name, value, stock_value, reference, dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@reproducible(60)
@given(case=mlp_cases(gated=True, max_tokens=9, max_hidden=129, max_inter=199))
def test_gated_mlp_property(backend, case):
    check_mlp(case, backend, gated=True)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@reproducible(40)
@given(case=mlp_cases(gated=False, max_tokens=9, max_hidden=129, max_inter=199))
def test_gelu_mlp_property(backend, case):
    check_mlp(case, backend, gated=False)


@needs_triton
@reproducible(4)
@given(case=mlp_cases(gated=True, max_tokens=3, max_hidden=20, max_inter=24))
def test_gated_mlp_property_triton(case):
    check_mlp(case, "triton", gated=True)


@needs_triton
@reproducible(3)
@given(case=mlp_cases(gated=False, max_tokens=3, max_hidden=20, max_inter=24))
def test_gelu_mlp_property_triton(case):
    check_mlp(case, "triton", gated=False)


# ------------------------------------------------------------------------------------ attention


def keys_seen(spec):
    """How many keys each query row sees (query i at position i + M - N; causal and window as in
    remat.reference.attention_reference)."""
    n, m = spec["n"], spec["m"]
    left, right = spec["window"] or (None, None)
    if spec["causal"]:
        right = 0 if right is None else min(right, 0)
    counts = []
    for i in range(n):
        position = i + m - n
        lo = 0 if left is None else max(0, position - left)
        hi = m - 1 if right is None else min(m - 1, position + right)
        counts.append(max(0, hi - lo + 1))
    return counts


@st.composite
def attention_specs(draw, max_len, max_d, softcap):
    n, m = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    hkv = draw(st.integers(1, 2))
    d = draw(widths(max_d))
    bound = st.one_of(st.none(), st.integers(0, max_len))
    layout = draw(st.sampled_from(["bnhd", "bhnd", "noncontiguous"]))
    spec = dict(
        b=draw(st.integers(1, 2)), n=n, m=m, hq=hkv * draw(st.integers(1, 3)), hkv=hkv, d=d,
        causal=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.tuples(bound, bound))),
        softcap=draw(st.sampled_from([2.0, 10.0, 50.0])) if softcap else None,
        rope=draw(st.sampled_from([None, "shared", "per_batch"])) if d % 2 == 0 and n <= m else None,
        layout="bhnd" if layout == "bhnd" else "bnhd",
        noncontiguous=layout == "noncontiguous",
    )
    # Out of the domain, with a strict xfail below: no query row sees two keys, so the exact dq is 0.
    assume(max(keys_seen(spec)) >= 2)
    return spec, draw(st.sampled_from(DTYPES))


# Softcap is outside the property's domain: about 10% of fp32 draws and 2-3% of fp16/bf16 draws
# break the 2x rule there (see the strict xfails below); its parametrized cases are in
# tests/test_attention.py.
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@reproducible(60)
@given(spec_dtype=attention_specs(max_len=40, max_d=128, softcap=False))
def test_attention_property(backend, spec_dtype):
    spec, dtype = spec_dtype
    note(f"spec {spec}, dtype {dtype}, keys seen per query row {keys_seen(spec)}")
    run_and_check(spec, dtype, backend)


@needs_triton
@reproducible(4)
@given(spec_dtype=attention_specs(max_len=9, max_d=16, softcap=False))
def test_attention_property_triton(spec_dtype):
    spec, dtype = spec_dtype
    note(f"spec {spec}, dtype {dtype}, keys seen per query row {keys_seen(spec)}")
    run_and_check(spec, dtype, "triton")


# Open findings (issue #11): the shrunk counterexamples hypothesis found, each a strict xfail on one
# explicit example, so that the day it passes the marker must go. "With delta from the exact o": the
# torch backend's backward rerun with the float64 reference's o in place of the stored one.


def _spec(**options):
    spec = dict(b=1, causal=False, window=None, softcap=None, rope=None, layout="bnhd", noncontiguous=False)
    spec.update(options)
    return spec


def _counterexample(backend, dtype, spec, reason):
    @pytest.mark.skipif(backend not in CPU_BACKENDS, reason=f"the {backend} backend is not available")
    @pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)
    @settings(phases=[Phase.explicit], database=None, deadline=None)
    @given(spec_dtype=attention_specs(max_len=40, max_d=128, softcap=True))
    @example(spec_dtype=(spec, dtype))
    def test(spec_dtype):
        run_and_check(spec_dtype[0], spec_dtype[1], backend)

    return test


ONE_KEY = ("every query sees one key, so the exact dq is 0 (softmax of one logit is constant); stock's eager "
           "backward gets exactly 0, the flash backward's ds = p (dp - rowsum(dO o)) leaves fp32 rounding noise "
           "(~1e-6 here) above the floor, which scales with |dq| = 0")
ROUNDED_O = ("delta = rowsum(dO o) is taken from the stored o rounded to the dtype; with two visible keys ds "
             "cancels and that rounding dominates: dq 3.3x (fp16) / 17x (bf16) stock's error, 5x / 120x less with "
             "delta from the exact o")
test_attention_counterexample_one_key_torch = _counterexample(
    "torch", torch.float32, _spec(n=1, m=1, hq=1, hkv=1, d=32), ONE_KEY)
test_attention_counterexample_one_key_cpp_softcap = _counterexample(
    "cpp", torch.float32, _spec(n=1, m=1, hq=1, hkv=1, d=32, softcap=2.0), ONE_KEY)
test_attention_counterexample_rounded_o_fp16 = _counterexample(
    "torch", torch.float16, _spec(n=1, m=2, hq=4, hkv=2, d=64), ROUNDED_O)
test_attention_counterexample_rounded_o_bf16_softcap = _counterexample(
    "torch", torch.bfloat16, _spec(n=1, m=2, hq=1, hkv=1, d=1, softcap=10.0), ROUNDED_O)
test_attention_counterexample_rounded_o_bf16_softcap_cpp = _counterexample(
    "cpp", torch.bfloat16, _spec(n=1, m=2, hq=1, hkv=1, d=4, softcap=2.0),
    "bf16 dq on the C++ kernel 8.4x stock's error; its backward also takes delta from the stored o "
    "(presumably the same cause, not isolated)")
test_attention_counterexample_fp32_softcap_torch = _counterexample(
    "torch", torch.float32, _spec(n=1, m=27, hq=2, hkv=1, d=14, softcap=10.0),
    "fp32 softcap: dq 7.4x stock's error; 2x less with delta from the exact o (then within the rule)")
test_attention_counterexample_fp32_softcap_cpp = _counterexample(
    "cpp", torch.float32, _spec(n=1, m=2, hq=2, hkv=1, d=32, softcap=2.0),
    "fp32 softcap on the C++ kernel: dq 11x stock's error; 3x less with delta from the exact o")
