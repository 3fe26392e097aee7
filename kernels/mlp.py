"""Triton MLP activation kernels: the elementwise part of a (gated) MLP, with recompute backward.

Forward saves only the pre-activations (gate and up for a GLU, pre for a plain activation);
backward recomputes act(.) and act'(.) from them, and can also hand back the forward output h,
so a caller that recomputes the block does not need a second forward launch.

The formulas, and the order of their operations, are those of csrc/common/activation.h, so every
backend computes the same arithmetic: math in fp32 from the loaded values, every output rounded
once to the input dtype (nearest even). Divisions are IEEE round-to-nearest (`div_rn`), as in
the C++ code, instead of Triton's approximate `/`. One departure: Triton has no tanh outside
libdevice, which the interpreter cannot run, so gelu_tanh evaluates 1 + tanh(u) and 1 - tanh(u)^2
as the equal sigmoid expressions (see _activation_and_grad): the same function, rounded
differently, and more accurate than the tanh form near |tanh(u)| = 1.

One kernel pair serves both the GLU and the plain activation (GATED constexpr), like the CUDA
launchers (up == nullptr). The grid is 1-D over the flattened elements with 64-bit offsets.
"""

import torch
import triton
import triton.language as tl

from ._common import _INTERPRETED, _round

# Elements per program. With 4 warps (128 threads) a program gives each thread 8 elements: one
# 16-byte load or store per tensor for fp16/bf16, two for fp32, the widest accesses there are.
# The kernels are memory-bound (a few exp/erf/div per element against 4 to 24 bytes moved), so a
# larger tile would not move bytes faster; it would only waste more of the last program and give
# fewer programs to spread over the SMs for small tensors.
_BLOCK = 1024
_NUM_WARPS = 4

_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The constants of csrc/common/activation.h; fp32 arithmetic rounds each to the same float.
_INV_SQRT2 = tl.constexpr(0.70710678118654752440)
_INV_SQRT2PI = tl.constexpr(0.39894228040143267794)
_SQRT2_OVER_PI = tl.constexpr(0.79788456080286535588)
_GELU_TANH_COEFF = tl.constexpr(0.044715)


@triton.jit
def _activation_and_grad(g, ACTIVATION: tl.constexpr):
    """(act(g), act'(g)) in fp32 for fp32 g, sharing the exp/erf between the two.

    silu and gelu compute exactly activation.h's expressions (its act and act_grad, each of
    which recomputes the exp/erf); gelu_tanh the same function through sigmoids (see below).
    Past the fp32 range of exp the results still come out right: exp(-g) = inf for silu gives
    silu = -0 and silu' = 0.
    """
    if ACTIVATION == "silu":
        # silu(g) = g / (1 + exp(-g)); silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g).
        denominator = 1.0 + tl.exp(-g)
        value = tl.math.div_rn(g, denominator)
        s = tl.math.div_rn(1.0, denominator)
        grad = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu":
        # Exact (erf) gelu: gelu(g) = g * Phi(g); gelu'(g) = Phi(g) + g * phi(g).
        one_plus_erf = 1.0 + tl.math.erf(g * _INV_SQRT2)
        value = 0.5 * g * one_plus_erf
        cdf = 0.5 * one_plus_erf
        pdf = _INV_SQRT2PI * tl.exp(-0.5 * g * g)
        grad = cdf + g * pdf
    else:
        tl.static_assert(ACTIVATION == "gelu_tanh", "activation: silu, gelu or gelu_tanh")
        inner = _SQRT2_OVER_PI * (g + _GELU_TANH_COEFF * g * g * g)
        # activation.h: t = tanh(inner), value = 0.5 * g * (1 + t),
        # grad = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * d_inner. Without a tanh, t comes from
        # sigmoids: 1 + t = 2 * sigmoid(2 inner), 1 - t * t = 4 * sigmoid(2 inner) *
        # sigmoid(-2 inner). Evaluated that way, 1 + t near t = -1 and 1 - t * t near |t| = 1
        # carry no cancellation; through t = 2 * sigmoid(2 inner) - 1 they did, and the fp32
        # gradient's largest error was 2.4 times stock PyTorch's (tanhf-based) error.
        # e = exp(-2 |inner|) lies in (0, 1], so it never overflows.
        e = tl.exp(-2.0 * tl.abs(inner))
        sigmoid_abs = tl.math.div_rn(1.0, 1.0 + e)
        sigmoid_neg_abs = tl.math.div_rn(e, 1.0 + e)
        # sigmoid(2 inner) = (1 + t) / 2.
        half_one_plus_t = tl.where(inner >= 0.0, sigmoid_abs, sigmoid_neg_abs)
        value = g * half_one_plus_t
        d_inner = _SQRT2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_COEFF * g * g)
        # 0.5 * g * (1 - t * t) = 2 * g * sigmoid(2 |inner|) * sigmoid(-2 |inner|).
        grad = half_one_plus_t + 2.0 * g * (sigmoid_abs * sigmoid_neg_abs) * d_inner
    return value, grad


@triton.jit
def _act_fwd_kernel(
    gate_ptr, up_ptr, h_ptr, n_elements,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """h = act(gate) * up (GATED) or h = act(gate), over n_elements contiguous elements."""
    # int64 before the multiply: program_id * BLOCK overflows int32 past 2^31 elements.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    activated, _ = _activation_and_grad(gate, ACTIVATION)
    if GATED:
        up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        h = activated * up
    else:
        h = activated
    tl.store(h_ptr + offsets, _round(h, h_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _act_bwd_kernel(
    dh_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, h_ptr, n_elements,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, NEED_H: tl.constexpr, BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """GATED: dgate = dh * up * act'(gate), dup = dh * act(gate), h = act(gate) * up.
    Otherwise: dgate = dh * act'(gate), h = act(gate). h is stored only when NEED_H.

    act(gate) stays fp32 in dup, as the forward never rounds it before multiplying by up.
    """
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    dh = tl.load(dh_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    activated, grad = _activation_and_grad(gate, ACTIVATION)
    dtype = dgate_ptr.dtype.element_ty
    if GATED:
        up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dgate_ptr + offsets, _round(dh * up * grad, dtype, INTERPRETED), mask=mask)
        tl.store(dup_ptr + offsets, _round(dh * activated, dtype, INTERPRETED), mask=mask)
        if NEED_H:
            tl.store(h_ptr + offsets, _round(activated * up, dtype, INTERPRETED), mask=mask)
    else:
        tl.store(dgate_ptr + offsets, _round(dh * grad, dtype, INTERPRETED), mask=mask)
        if NEED_H:
            tl.store(h_ptr + offsets, _round(activated, dtype, INTERPRETED), mask=mask)


def _check_inputs(activation, reference_name, reference, **others):
    """ValueError/TypeError naming the argument, before any launch."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {_ACTIVATIONS}, got {activation!r}")
    if not isinstance(reference, torch.Tensor):
        raise TypeError(f"{reference_name}: expected a tensor, got {type(reference).__name__}")
    if reference.dtype not in _DTYPES:
        raise TypeError(
            f"{reference_name}: expected float32, float16 or bfloat16, got {reference.dtype}")
    for name, tensor in ((reference_name, reference), *others.items()):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")
        if (tensor.shape != reference.shape or tensor.dtype != reference.dtype
                or tensor.device != reference.device):
            raise ValueError(
                f"{name}: expected shape {tuple(reference.shape)}, {reference.dtype} on "
                f"{reference.device} like {reference_name}, got shape {tuple(tensor.shape)}, "
                f"{tensor.dtype} on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous tensor, got strides {tuple(tensor.stride())}")


def _grid(n_elements):
    return (triton.cdiv(n_elements, _BLOCK),)


def _act_fwd(gate, up, activation):
    h = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n_elements = gate.numel()
    if n_elements > 0:
        _act_fwd_kernel[_grid(n_elements)](
            gate, up if up is not None else gate, h, n_elements,
            ACTIVATION=activation, GATED=up is not None, BLOCK=_BLOCK, INTERPRETED=_INTERPRETED,
            num_warps=_NUM_WARPS,
        )
    return h


def _act_bwd(dh, gate, up, activation, need_h):
    def new():
        return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)

    dgate = new()
    dup = new() if up is not None else None
    h = new() if need_h else torch.empty(0, dtype=gate.dtype, device=gate.device)
    n_elements = gate.numel()
    if n_elements > 0:
        # Absent tensors are passed as a placeholder pointer that GATED / NEED_H keep the kernel
        # from touching.
        _act_bwd_kernel[_grid(n_elements)](
            dh, gate, up if up is not None else gate, dgate, dup if dup is not None else dgate,
            h if need_h else dgate, n_elements,
            ACTIVATION=activation, GATED=up is not None, NEED_H=bool(need_h), BLOCK=_BLOCK,
            INTERPRETED=_INTERPRETED, num_warps=_NUM_WARPS,
        )
    return dgate, dup, h


def glu_fwd(gate, up, activation):
    """Gated activation forward: h = act(gate) * up.

    gate, up: contiguous tensors of one shape (any, any number of elements including 0) and one
    dtype, fp32/fp16/bf16, on one device. activation: "silu", "gelu" (exact, erf) or "gelu_tanh".
    Returns h: like gate, computed in fp32 and rounded once to gate's dtype.
    Backward needs gate and up only.
    """
    _check_inputs(activation, "gate", gate, up=up)
    return _act_fwd(gate, up, activation)


def glu_bwd(dh, gate, up, activation, need_h):
    """Gated activation backward, recomputing act(gate) and act'(gate) from the saved gate.

    dh: gradient of h; gate, up: the forward inputs; all contiguous, of one shape, dtype
    (fp32/fp16/bf16) and device. activation: as for glu_fwd. need_h: whether to return h too.
    Returns (dgate, dup, h), each like gate, computed in fp32 and rounded once:
    dgate = dh * up * act'(gate), dup = dh * act(gate) (act(gate) unrounded, as in the forward),
    h = act(gate) * up, computed as glu_fwd computes it, or empty(0) when need_h is false.
    """
    _check_inputs(activation, "gate", gate, dh=dh, up=up)
    return _act_bwd(dh, gate, up, activation, need_h)


def act_fwd(pre, activation):
    """Activation forward: h = act(pre).

    pre: contiguous, any shape and number of elements (including 0), fp32/fp16/bf16.
    activation: "silu", "gelu" (exact, erf) or "gelu_tanh".
    Returns h: like pre, computed in fp32 and rounded once to pre's dtype.
    Backward needs pre only.
    """
    _check_inputs(activation, "pre", pre)
    return _act_fwd(pre, None, activation)


def act_bwd(dh, pre, activation, need_h):
    """Activation backward, recomputing act'(pre) (and act(pre) if asked) from the saved pre.

    dh: gradient of h, like pre; pre: the forward input; both contiguous, of one shape, dtype
    (fp32/fp16/bf16) and device. activation: as for act_fwd. need_h: whether to return h too.
    Returns (dpre, h), each like pre, computed in fp32 and rounded once: dpre = dh * act'(pre);
    h = act(pre), computed as act_fwd computes it, or empty(0) when need_h is false.
    """
    _check_inputs(activation, "pre", pre, dh=dh)
    dpre, _, h = _act_bwd(dh, pre, None, activation, need_h)
    return dpre, h


def aot_specs():
    """Yield (name, kernel, signature, constexprs, num_warps) for ahead-of-time compile checks.

    `signature` and `constexprs` are in the form `triton.compiler.ASTSource` takes; name is
    '<glu|act>_<fwd|bwd>-<dtype>-<activation>'. Covers both kernels, gated and not, with every
    activation for bf16 and one each for fp16 (silu) and fp32 (gelu). The bf16 backward stores h
    (NEED_H), the others do not; the fp32 specs take a 64-bit element count, as the launcher
    passes one past 2^31 - 1 elements, the others a 32-bit one.
    """
    for type_name, activations, need_h, count_type in (
        ("bf16", _ACTIVATIONS, True, "i32"),
        ("fp16", ("silu",), False, "i32"),
        ("fp32", ("gelu",), False, "i64"),
    ):
        element = f"*{type_name}"
        for activation in activations:
            for gated in (True, False):
                op = "glu" if gated else "act"
                constexprs = dict(ACTIVATION=activation, GATED=gated, BLOCK=_BLOCK,
                                  INTERPRETED=False)
                fwd_signature = {"gate_ptr": element, "up_ptr": element, "h_ptr": element,
                                 "n_elements": count_type}
                bwd_signature = {"dh_ptr": element, "gate_ptr": element, "up_ptr": element,
                                 "dgate_ptr": element, "dup_ptr": element, "h_ptr": element,
                                 "n_elements": count_type}
                for kind, kernel, signature, kind_constexprs in (
                    ("fwd", _act_fwd_kernel, fwd_signature, constexprs),
                    ("bwd", _act_bwd_kernel, bwd_signature, dict(constexprs, NEED_H=need_h)),
                ):
                    full_signature = dict(signature,
                                          **dict.fromkeys(kind_constexprs, "constexpr"))
                    yield (f"{op}_{kind}-{type_name}-{activation}", kernel, full_signature,
                           kind_constexprs, _NUM_WARPS)
