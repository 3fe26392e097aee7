"""Public MLP functions (plain, gated and pre-norm sub-blocks): argument checks and reshaping, then
the autograd Function."""

from remat import checks
from remat.autograd.mlp import (
    RECOMPUTE_MODES,
    GatedMLPFunction,
    GELUMLPFunction,
    NormGatedMLPFunction,
    NormGELUMLPFunction,
)
from remat.backend import resolve_backend
from remat.functional.lora import check_lora
from remat.ops.mlp import ACTIVATIONS
from remat.tiles import resolve_tile_tokens


def gated_mlp(x, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None, activation="silu",
              recompute="block", backend=None):
    """Gated MLP ``down(act(gate(x)) * up(x))`` with ``activation`` ``"silu"`` (SwiGLU, default),
    ``"gelu"`` or ``"gelu_tanh"`` (GeGLU); the other arguments as :func:`swiglu_mlp`."""
    checks.check_input(x)
    hidden = checks.check_gated_weights(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    checks.check_choice(recompute, "recompute", RECOMPUTE_MODES)
    checks.check_choice(activation, "activation", ACTIVATIONS)
    name = resolve_backend(backend, x)
    (x_rows, *params), autocast_off = checks.autocast_cast(checks.as_rows(x), w_gate, w_up, w_down, b_gate, b_up,
                                                           b_down)
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
    return gated_mlp(x, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, recompute=recompute,
                     backend=backend)


def geglu_mlp(x, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None, approximate="none",
              recompute="block", backend=None):
    """GeGLU MLP: ``down(gelu(gate(x)) * up(x))`` with ``approximate`` "none" (erf) or "tanh";
    arguments as :func:`swiglu_mlp`."""
    checks.check_choice(approximate, "approximate", checks.GELU_APPROXIMATIONS)
    activation = "gelu" if approximate == "none" else "gelu_tanh"
    return gated_mlp(x, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, activation=activation,
                     recompute=recompute, backend=backend)


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
    checks.check_input(x)
    checks.check_choice(approximate, "approximate", checks.GELU_APPROXIMATIONS)
    checks.check_choice(recompute, "recompute", RECOMPUTE_MODES)
    hidden = checks.check_plain_mlp_weights(x, w_fc, b_fc, w_proj, b_proj)
    name = resolve_backend(backend, x)
    activation = "gelu" if approximate == "none" else "gelu_tanh"
    (x_rows, *params), autocast_off = checks.autocast_cast(checks.as_rows(x), w_fc, b_fc, w_proj, b_proj)
    with autocast_off:
        y = GELUMLPFunction.apply(x_rows, *params, activation, recompute, name)
    return y.view(*x.shape[:-1], hidden)


def norm_mlp(x, norm_weight, w_gate, w_up, w_down, *, norm_bias=None, norm="rms", eps=None, activation="silu",
             b_gate=None, b_up=None, b_down=None, recompute="block", lora=None, backend=None, tile_tokens=None):
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
        lora: None, or ``(gate_adapters, up_adapters, down_adapters)``, each None or a sequence
            of :class:`remat.autograd.lora.LoRAAdapter`: LoRA branches
            ``scaling * b(a(dropout(input)))`` added to that projection with PEFT's arithmetic
            (gate and up read the normalized input, down reads h). Nothing of them is kept per
            token: their rank-r intermediates and dropout masks are recomputed in backward.
        backend: as for :func:`rms_norm`.
        tile_tokens: None (default), an int >= 1 or ``"auto"`` (from the free memory:
            remat.tiles): forward and backward run over tiles of that many tokens, so no
            ``[tokens, intermediate]`` tensor exists beyond one tile (the result equals the
            untiled call up to rounding: weight gradients are summed over the tiles in fp32; what
            is kept is unchanged). With LoRA dropout, a multiple of 4 (the masks are the untiled
            call's).

    Returns:
        ``[..., H]`` (the MLP output; add the residual outside).
    """
    checks.check_input(x)
    checks.check_choice(recompute, "recompute", ("block", "activation"))
    checks.check_choice(activation, "activation", ACTIVATIONS)
    tile = checks.check_tile_tokens(tile_tokens)
    eps = checks.check_norm(norm, norm_weight, norm_bias, eps, x)
    hidden = checks.check_gated_weights(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    inter = w_gate.shape[0]
    # A tile's working set: gate, up, h and their gradients, [tile, I] each in x's dtype.
    tile = resolve_tile_tokens(tile, x.numel() // hidden, 6 * inter * x.element_size(), x.device)
    lora_layout, lora_tensors = check_lora(lora, (hidden, hidden, inter), (inter, inter, hidden), x,
                                           ("gate", "up", "down"))
    if tile % 4 and any(slot.dropout_p > 0 for slot in lora_layout):
        raise ValueError(f"with LoRA dropout, tile_tokens must be a multiple of 4 (a tile's dropout mask starts on "
                         f"a Philox call of four elements), got {tile}")
    name = resolve_backend(backend, x)
    (_, *lora_tensors), _ = checks.autocast_cast(x, *lora_tensors)
    (x_rows, *params), autocast_off = checks.autocast_cast(checks.as_rows(x), norm_weight, norm_bias, w_gate, w_up,
                                                           w_down,
                                                     b_gate, b_up, b_down)
    with autocast_off:
        y = NormGatedMLPFunction.apply(x_rows, *params, norm, float(eps), activation, recompute, name, tile,
                                       lora_layout,
                                       *lora_tensors)
    return y.view(*x.shape[:-1], hidden)


def norm_gelu_mlp(x, norm_weight, norm_bias, w_fc, b_fc, w_proj, b_proj, *, norm="layer", eps=None,
                  approximate="none", recompute="block", backend=None, tile_tokens=None):
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
        tile_tokens: None (default), an int >= 1 or ``"auto"`` (remat.tiles): forward and backward
            run over tiles of that many tokens, as :func:`norm_mlp`'s, so no
            ``[tokens, intermediate]`` tensor exists beyond one tile (weight gradients summed over
            the tiles in fp32; what is kept is unchanged).

    Returns:
        ``[..., H]`` (the MLP output; add the residual outside).
    """
    checks.check_input(x)
    checks.check_choice(approximate, "approximate", checks.GELU_APPROXIMATIONS)
    checks.check_choice(recompute, "recompute", ("block", "activation"))
    tile = checks.check_tile_tokens(tile_tokens)
    eps = checks.check_norm(norm, norm_weight, norm_bias, eps, x)
    hidden = checks.check_plain_mlp_weights(x, w_fc, b_fc, w_proj, b_proj)
    # A tile's working set: fc's output, the activation and their gradients, [tile, I] each.
    tile = resolve_tile_tokens(tile, x.numel() // hidden, 4 * w_fc.shape[0] * x.element_size(), x.device)
    name = resolve_backend(backend, x)
    activation = "gelu" if approximate == "none" else "gelu_tanh"
    (x_rows, *params), autocast_off = checks.autocast_cast(checks.as_rows(x), norm_weight, norm_bias, w_fc, b_fc,
                                                           w_proj,
                                                     b_proj)
    with autocast_off:
        y = NormGELUMLPFunction.apply(x_rows, *params, norm, float(eps), activation, recompute, name, tile)
    return y.view(*x.shape[:-1], hidden)
