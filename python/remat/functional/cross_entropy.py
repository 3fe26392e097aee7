"""Public output loss: linear (lm_head) + cross-entropy fused, the logits never stored."""

import math
import numbers

import torch

from remat import checks
from remat.autograd.cross_entropy import REDUCTIONS, LinearCrossEntropyFunction
from remat.autograd.cross_entropy import chunk_size as _chunk_size_rule
from remat.backend import BackendUnavailableError, resolve_backend
from remat.ops.cross_entropy import OPS
from remat.tiles import resolve_tile_tokens

__all__ = ["chunk_size", "linear_cross_entropy"]

# The chunk rule (stated in its docstring), public under this name.
chunk_size = _chunk_size_rule


def _check_weight_and_target(x, weight, bias, target):
    """weight [V, H] and bias [V] in x's dtype and device; target int64 shaped like x without its
    last dimension, on x's device. Returns V."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    hidden = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != hidden:
        raise ValueError(f"weight must be [vocab, hidden={hidden}] (the lm_head / embedding layout), got shape "
                         f"{tuple(weight.shape)}")
    vocab = weight.shape[0]
    if vocab < 1:
        raise ValueError("weight must have at least one row (vocabulary size >= 1)")
    checks.check_weight(weight, "weight", (vocab, hidden), x)
    checks.check_weight(bias, "bias", (vocab,), x, optional=True)
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype != torch.int64:
        raise TypeError(f"target must be int64 class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target must have x's shape without the hidden dimension, {tuple(x.shape[:-1])}, got "
                         f"{tuple(target.shape)}")
    if target.device != x.device:
        raise ValueError(f"target must be on x's device {x.device}, got {target.device}")
    return vocab


def _check_options(ignore_index, reduction, label_smoothing, softcap, z_loss, chunk, return_lse):
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    checks.check_choice(reduction, "reduction", REDUCTIONS)
    if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real)
            or not 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    checks.check_positive(softcap, "softcap")
    if (isinstance(z_loss, bool) or not isinstance(z_loss, numbers.Real) or not math.isfinite(z_loss)
            or z_loss < 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1):
        raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")


def check_targets(target, vocab, ignore_index):
    """Every target is in [0, vocab) or equals ignore_index, else ValueError. On the CPU the test
    is free. On a GPU it costs one host sync: a device reduction to one bool, copied back (about
    10 us, before any remat kernel runs). Under torch.compile it is traced as
    ``torch._assert_async`` instead: no sync and no graph break, but on a GPU the failure is a
    device-side assert at the next synchronisation (as F.cross_entropy's own check)."""
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if checks.values_unknown(target):
        torch._assert_async(~bad.any(), "linear_cross_entropy: target out of range")
        return
    if bool(bad.any()):
        first = target[bad].flatten()[0].item()
        raise ValueError(f"target holds class index {first} outside [0, {vocab}) that is not ignore_index "
                         f"({ignore_index})")


def linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         softcap=None, z_loss=0.0, return_lse=False, chunk_size=None, tile_tokens=None, backend=None):
    """The output block: ``F.cross_entropy(F.linear(x, weight, bias).float(), target, ...)`` without
    ever holding the [tokens, vocab] logits.

    The logits are computed by a GEMM in x's dtype and rounded to it (as ``F.linear``), then in
    fp32: capped (``softcap * tanh(z / softcap)``, Gemma 2's final logit cap, applied to the fp32
    logits), log-softmaxed, smoothed and reduced as ``F.cross_entropy``; vocabulary chunk by chunk
    in the forward (an online logsumexp) and again in the backward, which recomputes each chunk's
    logits from x.

    Args:
        x: ``[..., H]`` float32, float16 or bfloat16; any strides.
        weight: ``[V, H]`` (``nn.Linear`` / lm_head layout, also a tied embedding), x's dtype and
            device (under autocast both are cast to the autocast dtype).
        target: int64 ``[...]`` (x's shape without H), class indices in [0, V) or ignore_index.
        bias: ``[V]`` or None.
        ignore_index: targets equal to it contribute no loss and no gradient (default -100).
        reduction: ``"mean"`` (over the non-ignored tokens; nan when all are ignored, as
            ``F.cross_entropy``), ``"sum"`` or ``"none"`` (fp32 ``[...]``, 0 at ignored tokens).
        label_smoothing: in [0, 1], as ``F.cross_entropy``.
        softcap: None or a positive cap.
        z_loss: PaLM's auxiliary term: ``z_loss * lse^2`` per non-ignored token is added to that
            token's loss (so reduced like it).
        return_lse: also return the fp32 logsumexp per token (``[...]``, computed for ignored
            tokens too), through which gradients flow as well.
        chunk_size: vocabulary columns per chunk; None chooses it from the tokens (of one tile),
            the vocabulary and the free memory (:func:`remat.functional.cross_entropy.chunk_size`).
        tile_tokens: None (default), an int >= 1 or ``"auto"`` (from the free memory:
            remat.tiles): both passes run over tiles of that many tokens, so the working set
            inside the op (a chunk of logits, the fp32 dx accumulator) is [tile, *] instead of
            [tokens, *]; dW and db are then summed over the tiles in fp32
            (remat.autograd.cross_entropy). Results equal the untiled call under the 2x rule.
        backend: ``"cuda"``, ``"cpp"``, ``"triton"``, ``"torch"`` or None (see remat.backend).

    Returns:
        The fp32 loss (a scalar, or ``[...]`` with ``reduction="none"``), and the lse with
        ``return_lse``.

    Saved for backward: x, the int64 target and one fp32 lse per token (s*H + 12 bytes per token);
    the logits are recomputed chunk by chunk.

    Target values are checked before any kernel runs (ValueError); on a GPU the check costs one
    host sync (see :func:`check_targets`).
    """
    checks.check_input(x)
    vocab = _check_weight_and_target(x, weight, bias, target)
    _check_options(ignore_index, reduction, label_smoothing, softcap, z_loss, chunk_size, return_lse)
    tile_tokens = checks.check_tile_tokens(tile_tokens) or None
    name = resolve_backend(backend, x)
    if name not in OPS:
        raise BackendUnavailableError(f"remat backend {name!r} has no linear_cross_entropy; use one of {tuple(OPS)}")
    target_rows = target.reshape(-1)
    check_targets(target_rows, vocab, ignore_index)
    (x_rows, weight, bias), autocast_off = checks.autocast_cast(checks.as_rows(x), weight, bias)
    tokens = x_rows.shape[0]
    # A tile's working set inside the op: the fp32 dx accumulator and product (8 H) and the tile's
    # rows and dx rows in x's dtype (2 s H); the chunk of logits has its own rule.
    element = x_rows.element_size()
    tile_tokens = resolve_tile_tokens(tile_tokens, tokens, (8 + 2 * element) * x_rows.shape[1], x.device)
    tile = tile_tokens if tile_tokens and tile_tokens < tokens else None
    rows_per_call = tile or tokens
    chunk = int(chunk_size) if chunk_size is not None else _chunk_size_rule(rows_per_call, vocab, x.device)
    with autocast_off:
        loss, lse = LinearCrossEntropyFunction.apply(
            x_rows, weight, bias, target_rows, int(ignore_index), reduction, float(label_smoothing),
            float(softcap) if softcap is not None else 0.0, float(z_loss), chunk, name, tile)
    if reduction == "none":
        loss = loss.view(target.shape)
    if return_lse:
        return loss, lse.view(target.shape)
    return loss
