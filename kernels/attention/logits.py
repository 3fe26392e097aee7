"""Logits of the attention kernels, forward and backward alike, so the backward's are the
forward's bit for bit.

QK^T accumulates in fp32 (`rope._scores`); the logit is t = dot * scale, or softcap *
tanh(dot * scale / softcap) (`_tanh`: Triton has no tanh the interpreter can run), in natural
units. The backward recomputes the probabilities P = exp2((t - lse) * log2 e) from those t and
the forward's lse (forward.py says why t - lse is taken before the scaling by log2 e), and the
logit's derivative dt/ddot: scale, or scale * (1 - tanh^2) with softcap (attention_logit_grad).
"""

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)

# tanh(x) = x + x^3 R(x^2) for |x| < 0.75, R a degree-6 polynomial fitted to tanh on [0, 0.75]
# (least squares on Chebyshev nodes, reweighted toward minimax relative error); evaluated in fp32
# it is within 0.75 ulp of tanh there. Above 0.75, tanh = 1 - 2e / (1 + e) with e = exp(-2|x|)
# <= 0.22, within 1.6 ulp (numpy's exp; ex2.approx on the GPU adds up to about 2 ulp of e, which
# the factor 2e / (1 + e) <= 0.37 shrinks). The exp form alone near 0 loses all relative
# accuracy (1 - e cancels), which softcap then multiplies by the cap (30-50).
_TANH_LIMIT = tl.constexpr(0.75)
_TANH_R0 = tl.constexpr(-3.3333332231e-01)
_TANH_R1 = tl.constexpr(1.3333280960e-01)
_TANH_R2 = tl.constexpr(-5.3959888259e-02)
_TANH_R3 = tl.constexpr(2.1805848495e-02)
_TANH_R4 = tl.constexpr(-8.6003612189e-03)
_TANH_R5 = tl.constexpr(2.9743004571e-03)
_TANH_R6 = tl.constexpr(-6.3505479826e-04)


@triton.jit
def _tanh(x):
    """tanh of fp32 x from a polynomial and exp: Triton has tanh only in libdevice, which the
    interpreter cannot run; one formula keeps the CPU tests on the compiled arithmetic."""
    ax = tl.abs(x)
    x2 = ax * ax
    poly = _TANH_R5 + x2 * _TANH_R6
    poly = _TANH_R4 + x2 * poly
    poly = _TANH_R3 + x2 * poly
    poly = _TANH_R2 + x2 * poly
    poly = _TANH_R1 + x2 * poly
    poly = _TANH_R0 + x2 * poly
    small = ax + ax * x2 * poly
    e = tl.exp(-2.0 * ax)
    large = 1.0 - tl.math.div_rn(2.0 * e, 1.0 + e)
    magnitude = tl.where(ax < _TANH_LIMIT, small, large)
    return tl.where(x < 0.0, -magnitude, magnitude)


@triton.jit
def _logits(dot, scale, cap_scale, softcap, SOFTCAP: tl.constexpr):
    """(t, tanh term) for the fp32 dot products: the logit t = dot * scale, or softcap *
    tanh(dot * scale / softcap), in natural units; the tanh (for the logit's derivative) with
    SOFTCAP, else `dot` as a placeholder. Forward and backward share this, so the backward's
    logits are the forward's bit for bit."""
    if SOFTCAP:
        th = _tanh(dot * cap_scale)
        t = th * softcap
    else:
        th = dot
        t = dot * scale
    return t, th


@triton.jit
def _recomputed_probs(dot, lse, scale, cap_scale, softcap, SOFTCAP: tl.constexpr):
    """(P, tanh term) of the backward from the fp32 dot products and the rows' lse:
    P = exp2((t - lse) * log2 e), with `_logits`'s t and tanh term."""
    t, th = _logits(dot, scale, cap_scale, softcap, SOFTCAP)
    return tl.math.exp2((t - lse) * _LOG2E), th


@triton.jit
def _times_logit_grad(value, th, scale, SOFTCAP: tl.constexpr):
    """value * dt/ddot: scale * (1 - tanh^2) with softcap (attention_logit_grad), else scale."""
    if SOFTCAP:
        result = value * (scale * (1.0 - th * th))
    else:
        result = value * scale
    return result
