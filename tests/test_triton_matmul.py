"""The Triton dual GEMM with norm prologue and GLU epilogue (kernels/matmul.py) against a float64
reference of the unfused computation, under the 2x-stock-PyTorch rule, and its recompute
guarantees: the backward's h is the forward's bit for bit, and the stored gate/up are the values
the epilogue used (kernels/mlp.py's GLU kernels give the same bits from them). Likewise for the
single-GEMM variant of the plain (GPT-2 style) MLP, act_matmul / act_matmul_bwd: pre = x @ w^T + b
rounded to the dtype, h = act(pre), dpre = dh * act'(pre).

Runs on CPU tensors under TRITON_INTERPRET=1 (small shapes), or on a CUDA GPU without it.
"""

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("the Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA GPU; neither is here",
                allow_module_level=True)
pytest.importorskip("triton")

from remat.kernels import matmul  # noqa: E402
from remat.kernels import mlp as mlp_kernels  # noqa: E402
from remat.ops.mlp import (  # noqa: E402
    activate,
    activate_grad,
    torch_act_bwd,
    torch_act_fwd,
    torch_glu_bwd,
    torch_glu_fwd,
)
from remat.ops.norm import torch_layer_norm_fwd, torch_rms_norm_fwd  # noqa: E402

from _checks import assert_within_2x_of_stock  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
NORMS = (None, "rms", "layer")
# (M, K, N): 1 and 3 rows (one ragged row tile), 127 (two 64-row tiles for fp32, one ragged
# 128-row tile for fp16/bf16); K 64 and 96 (one or two K steps) and 1000 (ragged last step); N
# 96, 173 and 200 (ragged column tiles).
SHAPES = ((1, 64, 96), (3, 96, 173), (127, 1000, 200))
EPS = 1e-5


def _main_cases():
    """Every dtype x activation x norm, each with one shape and layout: the shape index is a
    Latin square over the three factors (every pair of factors meets every shape), and x is a
    row-strided view where the dtype and activation indices differ in parity (so every dtype x
    norm and shape x norm pair meets both layouts)."""
    cases = []
    for d, type_name in enumerate(DTYPES):
        for a, activation in enumerate(ACTIVATIONS):
            for n, norm in enumerate(NORMS):
                shape = SHAPES[(d + a + n) % len(SHAPES)]
                layout = ("contiguous", "row_strided")[(d + a) % 2]
                case_id = "-".join((type_name, activation, norm or "plain",
                                    "x".join(map(str, shape)), layout))
                cases.append(pytest.param(type_name, activation, norm, shape, layout, id=case_id))
    return cases


def _make_inputs(type_name, shape, layout, norm, seed, norm_weight=True, norm_bias=True):
    """x [M, K] (contiguous or a column slice of a wider tensor), weights [N, K], dh [M, N],
    and the norm arguments with the statistics stock PyTorch computes, plus its normed x."""
    dtype = DTYPES[type_name]
    rows, inner, cols = shape
    generator = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*size, generator=generator)).to(dtype).to(DEVICE)

    if layout == "row_strided":
        x = randn(rows, inner + 7)[:, 3:3 + inner]
    else:
        x = randn(rows, inner)
    # Weights scaled by 1 / sqrt(K), so gate and up are O(1) and the activation's curved part
    # is exercised.
    w_gate = randn(cols, inner, scale=inner ** -0.5)
    w_up = randn(cols, inner, scale=inner ** -0.5)
    dh = randn(rows, cols)
    norm_args = {}
    normed = x
    if norm is not None:
        weight = randn(inner, scale=0.5, offset=1.0) if norm_weight else None
        if norm == "rms":
            normed, _, rstd = torch_rms_norm_fwd(x, weight, None, EPS)
            norm_args = dict(rstd=rstd, norm_weight=weight)
        else:
            bias = randn(inner, scale=0.5) if norm_bias else None
            normed, _, mean, rstd = torch_layer_norm_fwd(x, weight, bias, None, EPS)
            norm_args = dict(mean=mean, rstd=rstd, norm_weight=weight, norm_bias=bias)
    return x, w_gate, w_up, dh, norm_args, normed


def _f64(tensor):
    return tensor.detach().cpu().double()


def _reference(x, w_gate, w_up, dh, activation, norm, norm_args):
    """float64 results of the unfused computation, rounded where it stores: the normed input and
    gate/up are rounded to x's dtype; act, h, dgate and dup are float64 and left unrounded."""
    dtype = x.dtype
    normed = _f64(x)
    if norm is not None:
        rstd = _f64(norm_args["rstd"])[:, None]
        if norm == "layer":
            normed = (normed - _f64(norm_args["mean"])[:, None]) * rstd
        else:
            normed = normed * rstd
        if norm_args.get("norm_weight") is not None:
            normed = normed * _f64(norm_args["norm_weight"])
        if norm_args.get("norm_bias") is not None:
            normed = normed + _f64(norm_args["norm_bias"])
        normed = normed.to(dtype).double()
    gate = normed @ _f64(w_gate).T
    up = normed @ _f64(w_up).T
    gate_rounded = gate.to(dtype).double()
    up_rounded = up.to(dtype).double()
    activated = activate(gate_rounded, activation)
    return {
        "gate": gate,
        "up": up,
        "h": activated * up_rounded,
        "dgate": _f64(dh) * up_rounded * activate_grad(gate_rounded, activation),
        "dup": _f64(dh) * activated,
    }


def _stock(normed, w_gate, w_up, dh, activation):
    """The same computation by stock PyTorch in the dtype: F.linear, then remat's torch GLU."""
    gate = F.linear(normed, w_gate)
    up = F.linear(normed, w_up)
    h = torch_glu_fwd(gate, up, activation)
    dgate, dup, _ = torch_glu_bwd(dh, gate, up, activation, False)
    return {"gate": gate, "up": up, "h": h, "dgate": dgate, "dup": dup}


def _run_and_check(type_name, activation, norm, shape, layout, seed, **input_options):
    x, w_gate, w_up, dh, norm_args, normed = _make_inputs(type_name, shape, layout, norm, seed,
                                                          **input_options)
    h, gate, up = matmul.glu_matmul(x, w_gate, w_up, activation, norm=norm, store_pre=True,
                                    **norm_args)
    dgate, dup, h_recomputed = matmul.glu_matmul_bwd(x, w_gate, w_up, dh, activation, norm=norm,
                                                     **norm_args)
    got = {"gate": gate, "up": up, "h": h, "dgate": dgate, "dup": dup}
    reference = _reference(x, w_gate, w_up, dh, activation, norm, norm_args)
    stock = _stock(normed, w_gate, w_up, dh, activation)
    for name, value in got.items():
        assert value.dtype == x.dtype and value.device == x.device, name
        assert_within_2x_of_stock(name, value.cpu(), stock[name].cpu(), reference[name],
                                  x.dtype)
    assert torch.equal(h_recomputed, h), "glu_matmul_bwd's h differs from glu_matmul's"
    # The stored gate/up are the epilogue's rounded values: the standalone GLU kernels, which
    # share the activation code, give the same bits from them.
    assert torch.equal(mlp_kernels.glu_fwd(gate, up, activation), h)
    for name, standalone, fused in zip(("dgate", "dup", "h"),
                                       mlp_kernels.glu_bwd(dh.contiguous(), gate, up, activation,
                                                           True),
                                       (dgate, dup, h_recomputed)):
        assert torch.equal(standalone, fused), f"{name}: differs from kernels/mlp.py's glu_bwd"


@pytest.mark.parametrize("type_name,activation,norm,shape,layout", _main_cases())
def test_matches_float64_reference(type_name, activation, norm, shape, layout):
    _run_and_check(type_name, activation, norm, shape, layout, seed=sum(shape))


@pytest.mark.parametrize("type_name", ["bf16", "fp16"])
def test_small_tiles_with_ragged_group(type_name, monkeypatch):
    """Tiles of 16 x 32 x 32 over 127 x 96 x 200 with GROUP_M 3: 8 row tiles in groups of 3,
    3 and 2 (the ragged last group of the swizzle), 7 column tiles, 3 K steps; LayerNorm with a
    bias but no weight. Every element is written (torch.empty is NaN-filled) and right."""
    config = matmul.MatmulConfig(block_m=16, block_n=32, block_k=32, group_m=3, num_warps=4,
                                 num_stages=3)
    monkeypatch.setattr(matmul, "glu_matmul_config", lambda *args: config)
    _run_and_check(type_name, "silu", "layer", (127, 96, 200), "row_strided", seed=1,
                   norm_weight=False)


def test_optional_outputs_do_not_change_results():
    """store_pre=False and need_h=False give the same bits for what they do return, and empty
    tensors for what they skip; RMSNorm without a weight."""
    x, w_gate, w_up, dh, norm_args, _ = _make_inputs("bf16", (3, 96, 173), "contiguous", "rms",
                                                     seed=2, norm_weight=False)
    h, gate, up = matmul.glu_matmul(x, w_gate, w_up, "gelu", norm="rms", store_pre=True,
                                    **norm_args)
    h_only, no_gate, no_up = matmul.glu_matmul(x, w_gate, w_up, "gelu", norm="rms", **norm_args)
    assert torch.equal(h_only, h)
    assert no_gate.numel() == 0 and no_up.numel() == 0
    dgate, dup, h_recomputed = matmul.glu_matmul_bwd(x, w_gate, w_up, dh, "gelu", norm="rms",
                                                     **norm_args)
    dgate_only, dup_only, no_h = matmul.glu_matmul_bwd(x, w_gate, w_up, dh, "gelu", norm="rms",
                                                       need_h=False, **norm_args)
    assert torch.equal(h_recomputed, h)
    assert torch.equal(dgate_only, dgate) and torch.equal(dup_only, dup)
    assert no_h.numel() == 0
    assert torch.equal(mlp_kernels.glu_fwd(gate, up, "gelu"), h)


def _bad_call_cases():
    """(id, changes to a valid glu_matmul call, exception type, text the message must hold)."""
    rows, inner, cols = 3, 64, 96

    def tensor(*size, dtype=torch.bfloat16):
        return torch.zeros(*size, dtype=dtype, device=DEVICE)

    stats = torch.ones(rows, device=DEVICE)
    return [
        ("x_int", dict(x=tensor(rows, inner, dtype=torch.int32)), TypeError, "x:"),
        ("x_list", dict(x=[[1.0]]), TypeError, "x:"),
        ("x_3d", dict(x=tensor(1, rows, inner)), ValueError, "x:"),
        ("x_col_strided", dict(x=tensor(rows, 2 * inner)[:, ::2]), ValueError, "x:"),
        ("w_gate_k", dict(w_gate=tensor(cols, inner + 1)), ValueError, "w_gate:"),
        ("w_up_shape", dict(w_up=tensor(cols + 1, inner)), ValueError, "w_up:"),
        ("w_up_dtype", dict(w_up=tensor(cols, inner, dtype=torch.float16)), TypeError, "w_up:"),
        ("w_gate_transposed", dict(w_gate=tensor(inner, cols).T), ValueError, "w_gate:"),
        ("activation", dict(activation="relu"), ValueError, "activation:"),
        ("norm_kind", dict(norm="batch"), ValueError, "norm:"),
        ("rstd_without_norm", dict(rstd=stats), ValueError, "rstd:"),
        ("rms_without_rstd", dict(norm="rms"), ValueError, "rstd:"),
        ("rms_with_mean", dict(norm="rms", rstd=stats, mean=stats), ValueError, "mean:"),
        ("rms_with_bias", dict(norm="rms", rstd=stats, norm_bias=tensor(inner)), ValueError,
         "norm_bias:"),
        ("layer_without_mean", dict(norm="layer", rstd=stats), ValueError, "mean:"),
        ("rstd_dtype", dict(norm="rms", rstd=stats.bfloat16()), TypeError, "rstd:"),
        ("rstd_shape", dict(norm="rms", rstd=torch.ones(rows + 1, device=DEVICE)), ValueError,
         "rstd:"),
        ("norm_weight_shape", dict(norm="rms", rstd=stats, norm_weight=tensor(inner + 1)),
         ValueError, "norm_weight:"),
        ("norm_weight_int", dict(norm="rms", rstd=stats,
                                 norm_weight=tensor(inner, dtype=torch.int64)),
         TypeError, "norm_weight:"),
        ("dh_shape", dict(dh=tensor(rows, cols + 1)), ValueError, "dh:"),
        ("dh_dtype", dict(dh=tensor(rows, cols, dtype=torch.float32)), TypeError, "dh:"),
    ]


@pytest.mark.parametrize("changes,error,text",
                         [pytest.param(*case[1:], id=case[0]) for case in _bad_call_cases()])
def test_bad_arguments_raise_naming_the_argument(changes, error, text):
    """Both launchers reject the bad argument (dh: the backward), before any launch."""
    rows, inner, cols = 3, 64, 96
    call = dict(x=torch.zeros(rows, inner, dtype=torch.bfloat16, device=DEVICE),
                w_gate=torch.zeros(cols, inner, dtype=torch.bfloat16, device=DEVICE),
                w_up=torch.zeros(cols, inner, dtype=torch.bfloat16, device=DEVICE),
                dh=torch.zeros(rows, cols, dtype=torch.bfloat16, device=DEVICE),
                activation="silu")
    call.update(changes)
    positional = [call.pop(name) for name in ("x", "w_gate", "w_up", "dh", "activation")]
    if "dh" not in changes:
        with pytest.raises(error, match=text):
            matmul.glu_matmul(*positional[:3], positional[4], **call)
    with pytest.raises(error, match=text):
        matmul.glu_matmul_bwd(*positional, **call)


# act_matmul: the single-GEMM variant for the plain (GPT-2 style) MLP.
ACT_ACTIVATIONS = ("gelu", "gelu_tanh")


def _act_cases():
    """Every dtype x activation x bias, each with one shape and layout: the shape index
    (dtype + activation + bias) mod 3 gives every dtype, activation and bias setting every
    shape; x is row-strided where dtype + bias is odd (every dtype, activation and shape meets
    both layouts)."""
    cases = []
    for d, type_name in enumerate(DTYPES):
        for a, activation in enumerate(ACT_ACTIVATIONS):
            for b, has_bias in enumerate((False, True)):
                shape = SHAPES[(d + a + b) % len(SHAPES)]
                layout = ("contiguous", "row_strided")[(d + b) % 2]
                case_id = "-".join((type_name, activation, "bias" if has_bias else "nobias",
                                    "x".join(map(str, shape)), layout))
                cases.append(pytest.param(type_name, activation, has_bias, shape, layout,
                                          id=case_id))
    return cases


def _make_act_inputs(type_name, shape, layout, has_bias, seed):
    """x [M, K] (contiguous or a column slice of a wider tensor), w [N, K], b [N] or None,
    dh [M, N]."""
    dtype = DTYPES[type_name]
    rows, inner, cols = shape
    generator = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=generator)).to(dtype).to(DEVICE)

    if layout == "row_strided":
        x = randn(rows, inner + 7)[:, 3:3 + inner]
    else:
        x = randn(rows, inner)
    # pre is O(1), so the activation's curved part is exercised; the bias shifts it by O(0.5).
    w = randn(cols, inner, scale=inner ** -0.5)
    b = randn(cols, scale=0.5) if has_bias else None
    dh = randn(rows, cols)
    return x, w, b, dh


def _act_reference(x, w, b, dh, activation):
    """float64 results of the unfused computation: pre = x @ w^T + b, rounded to x's dtype as
    the addmm stores it; h and dpre in float64 from the rounded pre, unrounded."""
    pre = _f64(x) @ _f64(w).T
    if b is not None:
        pre = pre + _f64(b)
    pre_rounded = pre.to(x.dtype).double()
    return {
        "pre": pre,
        "h": activate(pre_rounded, activation),
        "dpre": _f64(dh) * activate_grad(pre_rounded, activation),
    }


def _act_stock(x, w, b, dh, activation):
    """The same computation by stock PyTorch in the dtype: F.linear, then remat's torch act."""
    pre = F.linear(x, w, b)
    dpre, _ = torch_act_bwd(dh, pre, activation, False)
    return {"pre": pre, "h": torch_act_fwd(pre, activation), "dpre": dpre}


def _run_and_check_act(type_name, activation, has_bias, shape, layout, seed):
    x, w, b, dh = _make_act_inputs(type_name, shape, layout, has_bias, seed)
    h, pre = matmul.act_matmul(x, w, b, activation, store_pre=True)
    dpre, h_recomputed = matmul.act_matmul_bwd(x, w, b, dh, activation)
    got = {"pre": pre, "h": h, "dpre": dpre}
    reference = _act_reference(x, w, b, dh, activation)
    stock = _act_stock(x, w, b, dh, activation)
    for name, value in got.items():
        assert value.dtype == x.dtype and value.device == x.device, name
        assert value.is_contiguous(), name
        assert_within_2x_of_stock(name, value.cpu(), stock[name].cpu(), reference[name],
                                  x.dtype)
    assert torch.equal(h_recomputed, h), "act_matmul_bwd's h differs from act_matmul's"
    # The stored pre is the epilogue's rounded value: kernels/mlp.py's act kernels, which share
    # the activation code, give the same bits from it.
    assert torch.equal(mlp_kernels.act_fwd(pre, activation), h)
    standalone_dpre, standalone_h = mlp_kernels.act_bwd(dh.contiguous(), pre, activation, True)
    assert torch.equal(standalone_dpre, dpre), "dpre: differs from kernels/mlp.py's act_bwd"
    assert torch.equal(standalone_h, h_recomputed), "h: differs from kernels/mlp.py's act_bwd"


@pytest.mark.parametrize("type_name,activation,has_bias,shape,layout", _act_cases())
def test_act_matmul_matches_float64_reference(type_name, activation, has_bias, shape, layout):
    _run_and_check_act(type_name, activation, has_bias, shape, layout, seed=sum(shape) + 1)


def test_act_matmul_small_tiles_with_ragged_group_and_silu(monkeypatch):
    """Tiles of 16 x 32 x 32 over 127 x 96 x 200 with GROUP_M 3 (the ragged last group of the
    swizzle, ragged column tiles, 3 K steps), bf16 with a bias, and silu, which act_matmul also
    takes."""
    config = matmul.MatmulConfig(block_m=16, block_n=32, block_k=32, group_m=3, num_warps=4,
                                 num_stages=3)
    monkeypatch.setattr(matmul, "act_matmul_config", lambda *args: config)
    _run_and_check_act("bf16", "silu", True, (127, 96, 200), "row_strided", seed=3)


def test_act_matmul_optional_outputs_do_not_change_results():
    """store_pre=False and need_h=False give the same bits for what they do return, and empty
    tensors for what they skip."""
    x, w, b, dh = _make_act_inputs("fp16", (3, 96, 173), "contiguous", True, seed=4)
    h, pre = matmul.act_matmul(x, w, b, "gelu_tanh", store_pre=True)
    h_only, no_pre = matmul.act_matmul(x, w, b, "gelu_tanh")
    assert torch.equal(h_only, h)
    assert no_pre.numel() == 0
    dpre, h_recomputed = matmul.act_matmul_bwd(x, w, b, dh, "gelu_tanh")
    dpre_only, no_h = matmul.act_matmul_bwd(x, w, b, dh, "gelu_tanh", need_h=False)
    assert torch.equal(h_recomputed, h)
    assert torch.equal(dpre_only, dpre)
    assert no_h.numel() == 0
    assert torch.equal(mlp_kernels.act_fwd(pre, "gelu_tanh"), h)


def _act_bad_call_cases():
    """(id, changes to a valid act_matmul call, exception type, text the message must hold)."""
    rows, inner, cols = 3, 64, 96

    def tensor(*size, dtype=torch.bfloat16):
        return torch.zeros(*size, dtype=dtype, device=DEVICE)

    return [
        ("x_int", dict(x=tensor(rows, inner, dtype=torch.int32)), TypeError, "x:"),
        ("x_list", dict(x=[[1.0]]), TypeError, "x:"),
        ("x_3d", dict(x=tensor(1, rows, inner)), ValueError, "x:"),
        ("x_col_strided", dict(x=tensor(rows, 2 * inner)[:, ::2]), ValueError, "x:"),
        ("w_list", dict(w=[[1.0]]), TypeError, "w:"),
        ("w_k", dict(w=tensor(cols, inner + 1)), ValueError, "w:"),
        ("w_1d", dict(w=tensor(inner)), ValueError, "w:"),
        ("w_dtype", dict(w=tensor(cols, inner, dtype=torch.float16)), TypeError, "w:"),
        ("w_transposed", dict(w=tensor(inner, cols).T), ValueError, "w:"),
        ("b_shape", dict(b=tensor(cols + 1)), ValueError, "b:"),
        ("b_2d", dict(b=tensor(1, cols)), ValueError, "b:"),
        ("b_dtype", dict(b=tensor(cols, dtype=torch.float32)), TypeError, "b:"),
        ("activation", dict(activation="relu"), ValueError, "activation:"),
        ("dh_shape", dict(dh=tensor(rows, cols + 1)), ValueError, "dh:"),
        ("dh_dtype", dict(dh=tensor(rows, cols, dtype=torch.float32)), TypeError, "dh:"),
        ("dh_col_strided", dict(dh=tensor(rows, 2 * cols)[:, ::2]), ValueError, "dh:"),
    ]


@pytest.mark.parametrize("changes,error,text",
                         [pytest.param(*case[1:], id=case[0]) for case in _act_bad_call_cases()])
def test_act_matmul_bad_arguments_raise_naming_the_argument(changes, error, text):
    """Both launchers reject the bad argument (dh: the backward), before any launch."""
    rows, inner, cols = 3, 64, 96
    call = dict(x=torch.zeros(rows, inner, dtype=torch.bfloat16, device=DEVICE),
                w=torch.zeros(cols, inner, dtype=torch.bfloat16, device=DEVICE),
                b=torch.zeros(cols, dtype=torch.bfloat16, device=DEVICE),
                dh=torch.zeros(rows, cols, dtype=torch.bfloat16, device=DEVICE),
                activation="gelu")
    call.update(changes)
    positional = [call.pop(name) for name in ("x", "w", "b", "dh", "activation")]
    if "dh" not in changes:
        with pytest.raises(error, match=text):
            matmul.act_matmul(*positional[:3], positional[4], **call)
    with pytest.raises(error, match=text):
        matmul.act_matmul_bwd(*positional, **call)
