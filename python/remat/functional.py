"""Public functions: argument checks and reshaping, then the autograd Function.

Every function checks its inputs and raises TypeError / ValueError naming the argument before any
kernel runs, and never writes into a tensor it was handed.
"""

import contextlib
import math

import torch

from remat.autograd.attention import AttentionFunction
from remat.autograd.dropout import PhiloxDropoutFunction
from remat.autograd.mlp import (
    RECOMPUTE_MODES,
    GatedMLPFunction,
    GELUMLPFunction,
    NormGatedMLPFunction,
    NormGELUMLPFunction,
)
from remat.autograd.norm import LayerNormFunction, RMSNormFunction
from remat.backend import resolve_backend
from remat.ops.mlp import ACTIVATIONS

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_input(x, name="x"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a last (hidden) dimension of size >= 1, got shape {tuple(x.shape)}")


def _check_vector(t, name, x):
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.shape != (x.shape[-1],):
        raise ValueError(f"{name} must have shape ({x.shape[-1]},) to match x's last dimension, got {tuple(t.shape)}")
    if t.dtype != x.dtype:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def _check_residual(residual, x):
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"residual must be on x's device {x.device}, got {residual.device}")


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a positive finite number, got {eps}")


def _as_rows(t):
    """[..., cols] -> [rows, cols] with unit column stride (a view where possible, else one copy)."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def rms_norm(x, weight=None, eps=1e-6, *, residual=None, backend=None):
    """RMSNorm over the last dimension: ``y = h / sqrt(mean(h^2) + eps) * weight``.

    Args:
        x: ``[..., hidden]`` float32, float16 or bfloat16; any strides.
        weight: ``[hidden]`` in x's dtype, or None (no scaling).
        eps: added to the mean square; positive. Default 1e-6.
        residual: optional tensor shaped like x. Then ``h = x + residual`` (rounded to x's dtype)
            is computed in the same kernel and ``(y, h)`` is returned, the residual stream for
            the next block.
        backend: ``"cuda"``, ``"cpp"``, ``"triton"``, ``"torch"`` or None (see remat.backend).

    Returns:
        y shaped like x, or ``(y, h)`` when ``residual`` is given.

    Saved for backward: the norm input (x, or h) and fp32 rstd per row; x_hat is recomputed.
    """
    _check_input(x)
    _check_vector(weight, "weight", x)
    _check_residual(residual, x)
    _check_eps(eps)
    name = resolve_backend(backend, x)
    x_rows = _as_rows(x)
    residual_rows = _as_rows(residual) if residual is not None else None
    out = RMSNormFunction.apply(x_rows, weight, residual_rows, float(eps), name)
    if residual is None:
        return out.view(x.shape)
    y, h = out
    return y.view(x.shape), h.view(x.shape)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, backend=None):
    """LayerNorm over the last dimension: ``y = (h - mean) / sqrt(var + eps) * weight + bias``.

    Args:
        x: ``[..., hidden]`` float32, float16 or bfloat16; any strides.
        weight, bias: ``[hidden]`` in x's dtype, or None.
        eps: added to the (biased) variance; positive. Default 1e-5.
        residual: optional tensor shaped like x; then ``h = x + residual`` and ``(y, h)`` is
            returned, as in :func:`rms_norm`.
        backend: ``"cuda"``, ``"cpp"``, ``"triton"``, ``"torch"`` or None.

    Returns:
        y shaped like x, or ``(y, h)`` when ``residual`` is given.

    Saved for backward: the norm input (x, or h), fp32 mean and rstd per row; x_hat is recomputed.
    """
    _check_input(x)
    _check_vector(weight, "weight", x)
    _check_vector(bias, "bias", x)
    _check_residual(residual, x)
    _check_eps(eps)
    name = resolve_backend(backend, x)
    x_rows = _as_rows(x)
    residual_rows = _as_rows(residual) if residual is not None else None
    out = LayerNormFunction.apply(x_rows, weight, bias, residual_rows, float(eps), name)
    if residual is None:
        return out.view(x.shape)
    y, h = out
    return y.view(x.shape), h.view(x.shape)


def _check_weight(w, name, shape, x, optional=False):
    if w is None:
        if optional:
            return
        raise TypeError(f"{name} must be a torch.Tensor, got None")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(w).__name__}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(w.shape)}")
    autocast = x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)
    if w.dtype != x.dtype and not autocast:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
    if not w.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {w.device}")


def _check_choice(value, name, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_matrix(w, name):
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [intermediate, hidden], got shape {tuple(w.shape)}")


def _autocast_cast(x, *tensors):
    """Under autocast, the MLP's GEMMs run in the autocast dtype: x and the parameters are cast
    (differentiably) here, and the Function then runs with autocast off, so that its backward (which
    autocast does not cover) sees the same dtypes as its forward."""
    device_type = x.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return (x, *tensors), contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    cast = [t if t is None or t.dtype == dtype else t.to(dtype) for t in (x, *tensors)]
    return cast, torch.autocast(device_type, enabled=False)


def _check_gated_weights(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    """Checks a gated MLP's weights ([I, H], [I, H], [H, I]) and biases; returns H."""
    _check_matrix(w_gate, "w_gate")
    hidden, inter = x.shape[-1], w_gate.shape[0]
    _check_weight(w_gate, "w_gate", (inter, hidden), x)
    _check_weight(w_up, "w_up", (inter, hidden), x)
    _check_weight(w_down, "w_down", (hidden, inter), x)
    _check_weight(b_gate, "b_gate", (inter,), x, optional=True)
    _check_weight(b_up, "b_up", (inter,), x, optional=True)
    _check_weight(b_down, "b_down", (hidden,), x, optional=True)
    return hidden


def _gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, recompute, backend):
    _check_input(x)
    hidden = _check_gated_weights(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    _check_choice(recompute, "recompute", RECOMPUTE_MODES)
    _check_choice(activation, "activation", ACTIVATIONS)
    name = resolve_backend(backend, x)
    (x_rows, *params), autocast_off = _autocast_cast(_as_rows(x), w_gate, w_up, w_down, b_gate, b_up, b_down)
    with autocast_off:
        y = GatedMLPFunction.apply(x_rows, *params, activation, recompute, name)
    return y.view(*x.shape[:-1], hidden)


def swiglu_mlp(x, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None, recompute="block", backend=None):
    """Llama-style MLP: ``down(silu(gate(x)) * up(x))``.

    Args:
        x: ``[..., H]`` float32, float16 or bfloat16.
        w_gate, w_up: ``[I, H]``; w_down: ``[H, I]`` (``nn.Linear`` layout), x's dtype and device.
        b_gate, b_up: optional ``[I]``; b_down: optional ``[H]``.
        recompute: ``"block"`` (default; keeps x only, recomputes the up/gate GEMMs in backward),
            ``"activation"`` (keeps x, gate, up) or ``"none"`` (keeps what eager PyTorch keeps).
        backend: as for :func:`rms_norm`; it chooses the fused activation kernels, the GEMMs are
            PyTorch's (cuBLAS, or ATen on the CPU).

    Returns:
        ``[..., H]``.
    """
    return _gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, "silu", recompute, backend)


def geglu_mlp(x, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None, approximate="none",
              recompute="block", backend=None):
    """GeGLU MLP: ``down(gelu(gate(x)) * up(x))`` with ``approximate`` "none" (erf) or "tanh";
    arguments as :func:`swiglu_mlp`."""
    _check_choice(approximate, "approximate", ("none", "tanh"))
    activation = "gelu" if approximate == "none" else "gelu_tanh"
    return _gated_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, recompute, backend)


def _check_plain_mlp_weights(x, w_fc, b_fc, w_proj, b_proj):
    """Checks a plain MLP's weights ([I, H], [H, I]) and biases ([I], [H]); returns H."""
    _check_matrix(w_fc, "w_fc")
    hidden, inter = x.shape[-1], w_fc.shape[0]
    _check_weight(w_fc, "w_fc", (inter, hidden), x)
    _check_weight(b_fc, "b_fc", (inter,), x, optional=True)
    _check_weight(w_proj, "w_proj", (hidden, inter), x)
    _check_weight(b_proj, "b_proj", (hidden,), x, optional=True)
    return hidden


def gelu_mlp(x, w_fc, b_fc, w_proj, b_proj, *, approximate="none", recompute="block", backend=None):
    """GPT-2-style MLP: ``proj(gelu(fc(x)))``.

    Args:
        x: ``[..., H]``; w_fc: ``[I, H]``; b_fc: ``[I]`` or None; w_proj: ``[H, I]``; b_proj:
            ``[H]`` or None (``nn.Linear`` layout, x's dtype and device).
        approximate: ``"none"`` (erf) or ``"tanh"`` (GPT-2's ``gelu_new``).
        recompute: ``"block"`` (keeps x), ``"activation"`` (keeps x and fc(x)) or ``"none"``.
        backend: as for :func:`swiglu_mlp`.

    Returns:
        ``[..., H]``.
    """
    _check_input(x)
    _check_choice(approximate, "approximate", ("none", "tanh"))
    _check_choice(recompute, "recompute", RECOMPUTE_MODES)
    hidden = _check_plain_mlp_weights(x, w_fc, b_fc, w_proj, b_proj)
    name = resolve_backend(backend, x)
    activation = "gelu" if approximate == "none" else "gelu_tanh"
    (x_rows, *params), autocast_off = _autocast_cast(_as_rows(x), w_fc, b_fc, w_proj, b_proj)
    with autocast_off:
        y = GELUMLPFunction.apply(x_rows, *params, activation, recompute, name)
    return y.view(*x.shape[:-1], hidden)


def norm_mlp(x, norm_weight, w_gate, w_up, w_down, *, norm_bias=None, norm="rms", eps=None, activation="silu",
             b_gate=None, b_up=None, b_down=None, recompute="block", backend=None):
    """Pre-norm gated MLP sub-block: ``gated_mlp(norm(x))``, keeping only x and the fp32 norm
    statistics for backward (the normalized input is recomputed in backward and never stored).
    ``recompute="activation"`` also keeps gate and up, so no GEMM is recomputed.

    Args:
        x: ``[..., H]``.
        norm_weight: ``[H]`` or None; norm_bias: ``[H]`` or None (LayerNorm only).
        w_gate, w_up, w_down, b_gate, b_up, b_down: as for :func:`swiglu_mlp`.
        norm: ``"rms"`` or ``"layer"``. eps: default 1e-6 (rms) or 1e-5 (layer).
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU).
        recompute: ``"block"`` (default; keeps x and the statistics) or ``"activation"`` (also
            keeps gate and up).
        backend: as for :func:`rms_norm`.

    Returns:
        ``[..., H]`` (the MLP output; add the residual outside).
    """
    _check_input(x)
    _check_choice(norm, "norm", ("rms", "layer"))
    _check_choice(recompute, "recompute", ("block", "activation"))
    _check_choice(activation, "activation", ACTIVATIONS)
    _check_vector(norm_weight, "norm_weight", x)
    _check_vector(norm_bias, "norm_bias", x)
    if norm == "rms" and norm_bias is not None:
        raise ValueError("norm_bias is only for norm='layer'")
    eps = (1e-6 if norm == "rms" else 1e-5) if eps is None else eps
    _check_eps(eps)
    hidden = _check_gated_weights(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    name = resolve_backend(backend, x)
    (x_rows, *params), autocast_off = _autocast_cast(_as_rows(x), norm_weight, norm_bias, w_gate, w_up, w_down,
                                                     b_gate, b_up, b_down)
    with autocast_off:
        y = NormGatedMLPFunction.apply(x_rows, *params, norm, float(eps), activation, recompute, name)
    return y.view(*x.shape[:-1], hidden)


def norm_gelu_mlp(x, norm_weight, norm_bias, w_fc, b_fc, w_proj, b_proj, *, norm="layer", eps=None,
                  approximate="none", recompute="block", backend=None):
    """Pre-norm plain MLP sub-block (GPT-2): ``proj(gelu(fc(norm(x))))``, keeping x and the fp32
    norm statistics for backward; the normalized input is recomputed in backward, never stored.

    Args:
        x: ``[..., H]``.
        norm_weight, norm_bias: ``[H]`` or None (norm_bias for ``norm="layer"`` only).
        w_fc, b_fc, w_proj, b_proj: as for :func:`gelu_mlp` (``nn.Linear`` layout; any strides).
        norm: ``"layer"`` (default) or ``"rms"``. eps: default 1e-5 (layer) or 1e-6 (rms).
        approximate: ``"none"`` (erf) or ``"tanh"`` (GPT-2's ``gelu_new``).
        recompute: ``"block"`` (default; the fc GEMM is recomputed) or ``"activation"`` (also
            keeps fc's output).
        backend: as for :func:`rms_norm`; the GEMMs are PyTorch's.

    Returns:
        ``[..., H]`` (the MLP output; add the residual outside).
    """
    _check_input(x)
    _check_choice(norm, "norm", ("rms", "layer"))
    _check_choice(approximate, "approximate", ("none", "tanh"))
    _check_choice(recompute, "recompute", ("block", "activation"))
    _check_vector(norm_weight, "norm_weight", x)
    _check_vector(norm_bias, "norm_bias", x)
    if norm == "rms" and norm_bias is not None:
        raise ValueError("norm_bias is only for norm='layer'")
    eps = (1e-6 if norm == "rms" else 1e-5) if eps is None else eps
    _check_eps(eps)
    hidden = _check_plain_mlp_weights(x, w_fc, b_fc, w_proj, b_proj)
    name = resolve_backend(backend, x)
    activation = "gelu" if approximate == "none" else "gelu_tanh"
    (x_rows, *params), autocast_off = _autocast_cast(_as_rows(x), norm_weight, norm_bias, w_fc, b_fc, w_proj,
                                                     b_proj)
    with autocast_off:
        y = NormGELUMLPFunction.apply(x_rows, *params, norm, float(eps), activation, recompute, name)
    return y.view(*x.shape[:-1], hidden)


ATTENTION_LAYOUTS = ("bnhd", "bhnd")
MAX_HEAD_DIM = 256


def _check_qkv_types(q, k, v, layout):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({layout} layout), got shape {tuple(t.shape)}")


def _check_qkv_shapes(q, k, v, layout):
    """q, k, v in [B, N, H, D] order (after any layout transpose)."""
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, n, hq, head_dim = q.shape
    _, m, hkv, _ = k.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k must be [B={batch}, M, Hkv, D={head_dim}] in {layout} layout, got {tuple(k.shape)}")
    if min(batch, n, hq, m, hkv) < 1:
        raise ValueError(f"attention needs batch, lengths and heads >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k/v's heads ({hkv}) (GQA/MQA)")


def _check_rope(rope, q, k):
    _check_rope_tables(rope, q.shape[0], q.shape[1], k.shape[1], q.shape[-1], q.device)


def _check_rope_tables(rope, batch, n, m, head_dim, device):
    """rope: None or (cos, sin) for N queries and M keys of dim D on ``device``."""
    if rope is None:
        return
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise TypeError("rope must be a (cos, sin) pair of tensors or None")
    if head_dim % 2:
        raise ValueError(f"rope needs an even head dim, got {head_dim}")
    if n > m:
        raise ValueError(f"rope needs N <= M (query i sits at position i + M - N), got N={n}, M={m}")
    for name, t in zip(("cos", "sin"), rope):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"rope {name} must be a floating-point tensor")
        if t.device != device:
            raise ValueError(f"rope {name} must be on q's device {device}, got {t.device}")
        if (t.dim() not in (2, 3) or t.shape[-1] not in (head_dim // 2, head_dim) or t.shape[-2] < m
                or (t.dim() == 3 and t.shape[0] not in (1, batch))):
            raise ValueError(f"rope {name} must be [S, D/2], [B, S, D/2], [S, D] or [B, S, D] with S >= M={m}, "
                             f"D={head_dim}, B={batch}; got {tuple(t.shape)}")
    if rope[0].shape != rope[1].shape:
        raise ValueError(f"rope cos and sin must have one shape, got {tuple(rope[0].shape)} and {tuple(rope[1].shape)}")


def _window_bounds(window, causal):
    """(left, right) for the kernels, -1 = unbounded; causal caps right at 0."""
    left = right = -1
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError("window must be a (left, right) pair of ints >= 0 or None")
        for name, side in zip(("left", "right"), window):
            if side is None:
                continue
            if isinstance(side, bool) or not isinstance(side, int) or side < 0:
                raise ValueError(f"window {name} must be an int >= 0 or None, got {side!r}")
        left = -1 if window[0] is None else int(window[0])
        right = -1 if window[1] is None else int(window[1])
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _check_positive(value, name, allow_none=True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number{' or None' if allow_none else ''}, got {value!r}")


def check_attention_dtype(backend, dtype):
    """The cuda attention kernels take float16/bfloat16 only."""
    if backend == "cuda" and dtype == torch.float32:
        raise ValueError("the cuda attention kernels take float16/bfloat16, got float32; use backend='triton' or "
                         "'torch', or autocast")


def attention(q, k, v, *, causal=False, scale=None, dropout_p=0.0, rope=None, window=None, softcap=None,
              deterministic=True, layout="bnhd", backend=None):
    """Flash attention: ``softmax(q k^T * scale) v`` without storing the attention matrix.

    Args:
        q: ``[B, N, Hq, D]`` (``layout="bnhd"``, the default, as flash_attn) or ``[B, Hq, N, D]``
            (``layout="bhnd"``, as ``scaled_dot_product_attention``); float32, float16 or
            bfloat16; any strides (a tensor whose last dim is strided is copied once).
        k, v: ``[B, M, Hkv, D]`` (or ``[B, Hkv, M, D]``) in q's dtype and device; Hq a multiple of
            Hkv (GQA; Hkv = 1 is MQA). N, M >= 1 any length; D in 1..256 (the cuda backend takes
            float16/bfloat16 only).
        causal: mask keys after the query. With N != M the last query is aligned with the last
            key (bottom-right, as FlashAttention >= 2.1): query i sits at position i + M - N.
        scale: logit scale; default ``1 / sqrt(D)``.
        dropout_p: dropout on the probabilities, in [0, 1). Applied whenever > 0 (pass 0.0 in
            eval). The mask is a Philox stream keyed by a (seed, offset) drawn from PyTorch's
            generator, so ``torch.manual_seed`` reproduces it; backward regenerates it.
        rope: ``(cos, sin)`` rotary tables, ``[S, D/2]`` or ``[B, S, D/2]``, or Hugging Face's
            ``[S, D]`` / ``[B, S, D]`` with equal halves, S >= M; rotate-half convention. k at
            position j uses row j, q row i uses row i + M - N (needs N <= M). Applied inside the
            kernels in forward and again in the backward recompute; rotated copies are never stored.
        window: ``(left, right)`` sliding window: query at position p sees keys p - left .. p +
            right; None on a side is unbounded. Combines with ``causal``.
        softcap: Gemma-2 logit capping, ``softcap * tanh(logits / softcap)``; None (default) off.
        deterministic: GPU backward without atomics (bitwise reproducible); False uses fp32
            atomics for dq (faster). The CPU backends are always deterministic.
        layout: ``"bnhd"`` or ``"bhnd"``, for q, k, v and the output.
        backend: ``"cuda"``, ``"cpp"``, ``"triton"``, ``"torch"`` or None (see remat.backend).

    Returns:
        o in q's layout, shape and dtype (a new tensor). Rows that see no key give 0.

    Saved for backward: q, k, v, o, fp32 logsumexp [B, Hq, N] (and 16 bytes of RNG state with
    dropout, the cos/sin tables with rope); the probabilities are recomputed.
    """
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f"layout must be one of {ATTENTION_LAYOUTS}, got {layout!r}")
    _check_qkv_types(q, k, v, layout)
    if layout == "bhnd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    _check_qkv_shapes(q, k, v, layout)
    _check_rope(rope, q, k)
    _check_positive(scale, "scale")
    _check_positive(softcap, "softcap")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if not isinstance(causal, bool) or not isinstance(deterministic, bool):
        raise TypeError("causal and deterministic must be bools")
    left, right = _window_bounds(window, causal)
    name = resolve_backend(backend, q)
    head_dim = q.shape[-1]
    cos, sin = rope if rope is not None else (None, None)
    (q, k, v), autocast_off = _autocast_cast(q, k, v)
    check_attention_dtype(name, q.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = float(scale) if scale is not None else head_dim**-0.5
    with autocast_off:
        o = AttentionFunction.apply(q, k, v, cos, sin, scale, float(softcap or 0.0), left, right, float(dropout_p),
                                    deterministic, name)
    return o.transpose(1, 2) if layout == "bhnd" else o


def dropout(x, p=0.5, training=True, *, backend=None):
    """Dropout that keeps no mask for backward: the mask is a Philox stream keyed by a (seed,
    offset) pair drawn from PyTorch's generator (16 bytes saved), regenerated in backward. Every
    backend draws the same mask for the same generator state.

    Args:
        x: float32, float16 or bfloat16 tensor, any shape (a non-contiguous one is copied first).
        p: drop probability in [0, 1). training: False returns x unchanged (as F.dropout).
        backend: ``"cuda"``, ``"cpp"``, ``"triton"``, ``"torch"`` or None (see remat.backend).

    Returns:
        ``x * keep / (1 - p)``, a new tensor; x itself when not training or p == 0.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"p must be a number in [0, 1), got {p!r}")
    name = resolve_backend(backend, x)
    if not training or p == 0:
        return x
    return PhiloxDropoutFunction.apply(x.contiguous(), float(p), name)
