"""Which attention core runs a call, decided in one place (:func:`choose_core`) with its reason:
remat.attention and remat.norm_attention ask once per call, before any kernel runs.

The cores: remat's own kernels (``"cuda"``, ``"triton"``, ``"cpp"``, ``"torch"``) and PyTorch's
(``"aten"``: the CPU flash kernel or FlashAttention-2; ``"cudnn"``: cuDNN's fused attention). A core
asked for by name (the call's ``backend``, or remat.use_backend) must take the call, else
BackendUnavailableError says why and what to use; otherwise the default is the one expected
fastest that takes it (README "Default backends"):

- CPU: PyTorch's flash kernel (the aten core; dense calls only) where it runs the dtype at full
  speed (remat.ops.attention.cpu_flash_is_fast), else remat's C++ kernels;
- CUDA: cuDNN where stock PyTorch tries it first (remat.ops.attention_cudnn.cudnn_preferred), else
  FlashAttention-2 (the aten core), else remat's Triton kernels, else its CUDA kernels.

Two more decisions ride on the core: ``deterministic=False`` under
``torch.use_deterministic_algorithms(True)`` (raises, or warns and runs the deterministic
backward), and whether rope is rotated once per pass outside the kernels (the Triton core with a
backward to follow, remat.ops.attention.rope_rotated_once).
"""

import warnings
from typing import NamedTuple

import torch

from remat import checks
from remat.backend import (
    BackendUnavailableError,
    default_backend,
    requested_backend,
    resolve_backend,
    unavailable_reason,
)
from remat.ops import ops_for
from remat.ops.attention import aten_unsupported_reason, cpu_flash_is_fast, rope_rotated_once
from remat.ops.attention_cudnn import cudnn_preferred, cudnn_unsupported_reason
from remat.options import AttentionOptions


class CoreChoice(NamedTuple):
    """The attention core of a call: ``name`` (a remat backend name), the kernels' ``options``
    (``deterministic`` as the core will run it), ``rotate_once`` (rope rotated once outside the
    kernels) and ``reason``, why this core (for errors, logs and tests)."""

    name: str
    options: AttentionOptions
    rotate_once: bool
    reason: str


def choose_core(explicit, t, batch, sizes, options, *, varlen=False, rope=False, backward_can_follow=False):
    """The :class:`CoreChoice` of an attention call on tensors like ``t`` (its dtype and device):
    ``batch`` sequences of sizes (N, M, Hq, Hkv, D), or for a packed call (``varlen``) sizes
    (max_seqlen_q, max_seqlen_k, Hq, Hkv, D) and batch 1. ``explicit``: the call's backend argument
    (None: remat.use_backend's, else the default). ``options``: the call's AttentionOptions.
    ``rope``: tables given; ``backward_can_follow``: autograd records the call.

    Raises BackendUnavailableError when the core asked for cannot take the call, ValueError when
    the core takes no such dtype (the cuda kernels: float16/bfloat16), RuntimeError for
    ``deterministic=False`` under ``torch.use_deterministic_algorithms(True)`` on a core whose
    backward uses atomics (a warning instead with ``warn_only=True``)."""
    asked = requested_backend(explicit)
    if asked is None:
        name, reason = _default_core(t, batch, sizes, options, varlen)
    else:
        name = resolve_backend(asked, t)
        _check_takes(name, t, batch, sizes, options, varlen)
        reason = f"asked for by name ({asked!r})"
    checks.check_attention_dtype(name, t.dtype)
    return CoreChoice(name, _respect_deterministic_mode(options, name), rope_rotated_once(name, rope,
                                                                                         backward_can_follow), reason)


def _check_takes(name, t, batch, sizes, options, varlen):
    """Raises BackendUnavailableError when the core ``name``, asked for by name, cannot run the call."""
    if name == "aten":
        if varlen and t.device.type != "cuda":
            raise BackendUnavailableError("remat backend 'aten' has packed (cu_seqlens) attention on CUDA only: "
                                          "PyTorch's CPU flash core takes no sequence offsets; use backend='cpp', "
                                          "'triton' or 'torch'")
        reason = aten_unsupported_reason(*sizes, t.dtype, t.device, options, varlen=varlen)
        if reason is not None:
            raise BackendUnavailableError(f"remat backend 'aten' cannot run this attention call: {reason}; use "
                                          "backend='cpp', 'cuda', 'triton' or 'torch'")
    if name == "cudnn":
        if varlen:
            raise BackendUnavailableError("remat backend 'cudnn' has no packed (cu_seqlens) attention; use "
                                          "backend='aten' (FlashAttention-2's variable-length entry), 'triton', "
                                          "'cuda' or 'torch'")
        reason = cudnn_unsupported_reason(batch, *sizes, t.dtype, t.device, options)
        if reason is not None:
            raise BackendUnavailableError(f"remat backend 'cudnn' cannot run this attention call: {reason}; use "
                                          "backend='aten', 'triton' or 'cuda'")
    if varlen and ops_for("attention", name).attention_varlen_fwd is None:
        raise BackendUnavailableError(f"remat backend {name!r} has no packed (cu_seqlens) attention; use "
                                      "backend='aten' (FlashAttention-2's variable-length entry), 'triton', 'cuda' "
                                      "or 'torch'")


def _default_core(t, batch, sizes, options, varlen):
    """(name, reason) of the default core: the one expected fastest that takes the call (the module
    docstring's order; measured on the CPU in benchmarks/results/attention-cpu.csv, by expectation
    on CUDA until GPU numbers replace it)."""
    aten_reason = aten_unsupported_reason(*sizes, t.dtype, t.device, options, varlen=varlen)
    if t.device.type == "cuda":
        if cudnn_preferred(t.device):
            cudnn_reason = cudnn_unsupported_reason(batch, *sizes, t.dtype, t.device, options, varlen=varlen)
            if cudnn_reason is None:
                return "cudnn", "default on this GPU: stock PyTorch tries cuDNN first here"
        if aten_reason is None:
            return "aten", "default on CUDA: FlashAttention-2 takes the call"
        if unavailable_reason("triton", t.device) is None:
            return "triton", f"default on CUDA: FlashAttention-2 cannot ({aten_reason})"
        return default_backend(t.device), f"default on CUDA: neither FlashAttention-2 ({aten_reason}) nor Triton"
    if t.device.type == "cpu" and aten_reason is None and not varlen and cpu_flash_is_fast(t.dtype):
        return "aten", f"default on the CPU: PyTorch's flash kernel runs {t.dtype} at full speed here"
    why = ("packed calls" if varlen else aten_reason if aten_reason is not None
           else f"its {t.dtype} GEMMs are slow on this CPU")
    return default_backend(t.device), f"default on {t.device.type}: not PyTorch's flash kernel ({why})"


def _respect_deterministic_mode(options, backend):
    """``deterministic=False`` selects the GPU backward with fp32 atomics. Under
    ``torch.use_deterministic_algorithms(True)`` it raises RuntimeError, as PyTorch's
    nondeterministic ops do, or with ``warn_only=True`` warns and runs the deterministic backward.
    The CPU backends are always deterministic."""
    if options.deterministic or backend not in ("cuda", "triton") or not torch.are_deterministic_algorithms_enabled():
        return options
    message = ("remat attention with deterministic=False accumulates dq with fp32 atomics, which is not "
               "deterministic, and torch.use_deterministic_algorithms(True) is set")
    if not torch.is_deterministic_algorithms_warn_only_enabled():
        raise RuntimeError(message + "; pass deterministic=True")
    warnings.warn(message + "; running the deterministic backward instead", stacklevel=4)
    return options._replace(deterministic=True)
