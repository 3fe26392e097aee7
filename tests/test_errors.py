"""Bad input raises TypeError / ValueError naming the argument, before any kernel runs."""

import pytest
import torch

import remat
from remat.backend import BackendUnavailableError


def _good():
    return torch.randn(3, 8), torch.ones(8), torch.zeros(8)


@pytest.mark.parametrize("fn", ["rms", "layer"])
@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda a: {**a, "x": a["x"].to(torch.int32)}, TypeError, "x must be float32"),
        (lambda a: {**a, "x": a["x"].double()}, TypeError, "x must be float32"),
        (lambda a: {**a, "x": [1.0, 2.0]}, TypeError, "x must be a torch.Tensor"),
        (lambda a: {**a, "x": torch.randn(3, 0)}, ValueError, "x must have a last"),
        (lambda a: {**a, "x": torch.tensor(1.0)}, ValueError, "x must have a last"),
        (lambda a: {**a, "weight": torch.ones(7)}, ValueError, r"weight must have shape \(8,\)"),
        (lambda a: {**a, "weight": torch.ones(8, 1)}, ValueError, "weight must have shape"),
        (lambda a: {**a, "weight": torch.ones(8, dtype=torch.float16)}, TypeError, "weight must have x's dtype"),
        (lambda a: {**a, "weight": torch.ones(8, device="meta")}, ValueError, "weight must be on x's device"),
        (lambda a: {**a, "residual": torch.randn(3, 7)}, ValueError, "residual must have x's shape"),
        (lambda a: {**a, "residual": torch.randn(3, 8).half()}, TypeError, "residual must have x's dtype"),
        (lambda a: {**a, "eps": 0.0}, ValueError, "eps must be a positive"),
        (lambda a: {**a, "eps": -1e-5}, ValueError, "eps must be a positive"),
        (lambda a: {**a, "eps": float("nan")}, ValueError, "eps must be a positive"),
        (lambda a: {**a, "eps": "1e-5"}, TypeError, "eps must be a float"),
        (lambda a: {**a, "backend": "tpu"}, ValueError, "backend must be one of"),
    ],
    ids=[
        "int-x", "float64-x", "list-x", "zero-width", "scalar-x", "weight-length", "weight-2d",
        "weight-dtype", "weight-device", "residual-shape", "residual-dtype", "eps-zero",
        "eps-negative", "eps-nan", "eps-str", "unknown-backend",
    ],
)
def test_bad_input_raises(fn, mutate, error, match):
    x, w, b = _good()
    args = mutate({"x": x, "weight": w, "residual": None, "eps": 1e-5, "backend": None})
    with pytest.raises(error, match=match):
        if fn == "rms":
            remat.rms_norm(args["x"], args["weight"], args["eps"], residual=args["residual"], backend=args["backend"])
        else:
            remat.layer_norm(args["x"], args["weight"], b, args["eps"], residual=args["residual"],
                             backend=args["backend"])


def test_layer_norm_bias_checked():
    x, w, _ = _good()
    with pytest.raises(ValueError, match="bias must have shape"):
        remat.layer_norm(x, w, torch.zeros(9))
    with pytest.raises(TypeError, match="bias must have x's dtype"):
        remat.layer_norm(x, w, torch.zeros(8, dtype=torch.bfloat16))


def test_unavailable_backend_raises_with_reason():
    x, w, _ = _good()
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' cannot run here: .*backend='cpp'"):
        remat.rms_norm(x, w, backend="cuda")


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, _ = _good()
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        remat.rms_norm(x, w, backend="triton")


def test_bad_environment_backend_raises(monkeypatch):
    monkeypatch.setenv("REMAT_BACKEND", "fast")
    x, w, _ = _good()
    with pytest.raises(ValueError, match="REMAT_BACKEND"):
        remat.rms_norm(x, w)


def test_second_backward_raises():
    x = torch.randn(4, 16, requires_grad=True)
    y = remat.rms_norm(x, torch.ones(16))
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


def test_direct_op_call_checks_arguments():
    """Direct callers of torch.ops.remat get the operator's own checks."""
    from remat import _extension

    if not _extension.LOADED:
        pytest.skip("remat._C is not built")
    with pytest.raises(RuntimeError, match="weight must have shape"):
        torch.ops.remat.rms_norm_fwd(torch.randn(3, 8), torch.ones(5), None, 1e-6)
    with pytest.raises(RuntimeError, match="eps must be positive"):
        torch.ops.remat.rms_norm_fwd(torch.randn(3, 8), None, None, 0.0)
