"""Argument checks and input preparation shared by the public functions (remat.functional) and the
modules (remat.nn, remat.models).

Every check raises TypeError (wrong kind or dtype) or ValueError (wrong shape, device or value)
naming the argument and what was expected, before any kernel runs.
"""

import contextlib
import math
import numbers

import torch
from torch._subclasses.fake_tensor import FakeTensor

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ATTENTION_LAYOUTS = ("bnhd", "bhnd")
MAX_HEAD_DIM = 256
NORMS = ("rms", "layer", "gemma")
GELU_APPROXIMATIONS = ("none", "tanh")


def values_unknown(*tensors):
    """Whether the values of ``tensors`` cannot be read on the host: under torch.compile (traced
    tensors) or on fake tensors (``remat.estimate``'s runs). Checks that read values then run in
    the graph (``torch._assert_async``) or not at all, and layouts take their value-free form."""
    return torch.compiler.is_compiling() or any(isinstance(t, FakeTensor) for t in tensors)


def check_tile_tokens(tile_tokens):
    """tile_tokens: None (no tiling: returns 0), an int >= 1 (returned) or ``"auto"`` (returned:
    chosen per call from the free memory, remat.tiles)."""
    if tile_tokens is None:
        return 0
    if tile_tokens == "auto":
        return "auto"
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, numbers.Integral) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be None, an int >= 1 or 'auto', got {tile_tokens!r}")
    return int(tile_tokens)


def check_input(x, name="x"):
    """x: a float32/float16/bfloat16 tensor with a last (hidden) dimension of size >= 1."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a last (hidden) dimension of size >= 1, got shape {tuple(x.shape)}")


def check_hidden_states(x):
    """hidden_states of a layer: a 3-D [B, N, hidden] tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"hidden_states must be [B, N, hidden], got shape {tuple(x.shape)}")


def check_vector(t, name, x):
    """t: None or a [hidden] vector in x's dtype and device (a norm weight or bias)."""
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


def check_residual(residual, x):
    """residual: None or a tensor with x's shape, dtype and device."""
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


def check_eps(eps):
    """eps: a positive finite Python number."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a positive finite number, got {eps}")


def check_choice(value, name, choices):
    """value must be one of choices."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_positive(value, name, allow_none=True):
    """value: a positive finite number (or None when allow_none)."""
    if value is None and allow_none:
        return
    # Traced by torch.compile a Python float may be symbolic (dynamo makes a float that changed
    # between calls a SymFloat), which math.isfinite cannot trace: the sign is still checked there.
    if (isinstance(value, bool) or not isinstance(value, (int, float, torch.SymInt, torch.SymFloat))
            or not (value > 0 and (torch.compiler.is_compiling() or math.isfinite(value)))):
        raise ValueError(f"{name} must be a positive finite number{' or None' if allow_none else ''}, got {value!r}")


def check_probability(p, name):
    """p: a Python number in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"{name} must be a number in [0, 1), got {p!r}")


def check_matrix(w, name):
    """w: a 2-D tensor (a weight in nn.Linear layout)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [intermediate, hidden], got shape {tuple(w.shape)}")


def check_weight(w, name, shape, x, optional=False):
    """w: a floating-point tensor of ``shape`` on x's device, in x's dtype unless autocast is on
    (then the caller casts it)."""
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


def check_gated_weights(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    """Checks a gated MLP's weights ([I, H], [I, H], [H, I]) and biases; returns H."""
    check_matrix(w_gate, "w_gate")
    hidden, inter = x.shape[-1], w_gate.shape[0]
    check_weight(w_gate, "w_gate", (inter, hidden), x)
    check_weight(w_up, "w_up", (inter, hidden), x)
    check_weight(w_down, "w_down", (hidden, inter), x)
    check_weight(b_gate, "b_gate", (inter,), x, optional=True)
    check_weight(b_up, "b_up", (inter,), x, optional=True)
    check_weight(b_down, "b_down", (hidden,), x, optional=True)
    return hidden


def check_plain_mlp_weights(x, w_fc, b_fc, w_proj, b_proj):
    """Checks a plain MLP's weights ([I, H], [H, I]) and biases ([I], [H]); returns H."""
    check_matrix(w_fc, "w_fc")
    hidden, inter = x.shape[-1], w_fc.shape[0]
    check_weight(w_fc, "w_fc", (inter, hidden), x)
    check_weight(b_fc, "b_fc", (inter,), x, optional=True)
    check_weight(w_proj, "w_proj", (hidden, inter), x)
    check_weight(b_proj, "b_proj", (hidden,), x, optional=True)
    return hidden


def check_norm(norm, norm_weight, norm_bias, eps, x):
    """A pre-norm sub-block's norm arguments (norm "rms", "layer" or "gemma": RMSNorm with weight
    1 + w in fp32, see remat.autograd.norm.norm_forward); returns eps with its default (1e-5 for
    "layer", else 1e-6) filled in."""
    check_choice(norm, "norm", NORMS)
    check_vector(norm_weight, "norm_weight", x)
    check_vector(norm_bias, "norm_bias", x)
    if norm != "layer" and norm_bias is not None:
        raise ValueError("norm_bias is only for norm='layer'")
    eps = (1e-5 if norm == "layer" else 1e-6) if eps is None else eps
    check_eps(eps)
    return eps


def _check_qkv_tensors(q, k, v, dims, form):
    """q, k, v: ``dims``-D float32/float16/bfloat16 tensors; ``form(name)`` says the expected form."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() != dims:
            raise ValueError(f"{form(name)}, got shape {tuple(t.shape)}")


def _check_kv_like_q(q, k, v):
    """k and v: q's dtype and device, one shape."""
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")


def _check_heads(hq, hkv, head_dim):
    """D in 1..MAX_HEAD_DIM, Hq a multiple of Hkv."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k/v's heads ({hkv}) (GQA/MQA)")


def check_qkv_types(q, k, v, layout):
    """q, k, v: 4-D float32/float16/bfloat16 tensors."""
    _check_qkv_tensors(q, k, v, 4, lambda name: f"{name} must be 4-D ({layout} layout)")


def check_qkv_shapes(q, k, v, layout):
    """q [B, N, Hq, D], k and v [B, M, Hkv, D] (after any layout transpose), one dtype and device,
    D in 1..MAX_HEAD_DIM, Hq a multiple of Hkv; B, N and M may be 0 (as for stock's attention)."""
    _check_kv_like_q(q, k, v)
    batch, n, hq, head_dim = q.shape
    _, m, hkv, _ = k.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k must be [B={batch}, M, Hkv, D={head_dim}] in {layout} layout, got {tuple(k.shape)}")
    if min(hq, hkv) < 1:
        raise ValueError(f"attention needs heads >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    _check_heads(hq, hkv, head_dim)


def _check_rope_pair(rope, head_dim):
    """rope: a (cos, sin) pair, for an even head dim."""
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise TypeError("rope must be a (cos, sin) pair of tensors or None")
    if head_dim % 2:
        raise ValueError(f"rope needs an even head dim, got {head_dim}")


def _check_rope_tables(rope, device, shape_ok, shape_form):
    """cos and sin: floating-point tensors on ``device`` of one shape, each accepted by
    ``shape_ok(t)``; ``shape_form(name)`` says the accepted shapes (the error adds " got <shape>")."""
    for name, t in zip(("cos", "sin"), rope):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"rope {name} must be a floating-point tensor")
        if t.device != device:
            raise ValueError(f"rope {name} must be on q's device {device}, got {t.device}")
        if not shape_ok(t):
            raise ValueError(f"{shape_form(name)} got {tuple(t.shape)}")
    if rope[0].shape != rope[1].shape:
        raise ValueError(f"rope cos and sin must have one shape, got {tuple(rope[0].shape)} and {tuple(rope[1].shape)}")


def check_rope(rope, batch, n, m, head_dim, device):
    """rope: None or a (cos, sin) pair for N queries and M keys of dim D on ``device``."""
    if rope is None:
        return
    _check_rope_pair(rope, head_dim)
    if n > m:
        raise ValueError(f"rope needs N <= M (query i sits at position i + M - N), got N={n}, M={m}")

    def shape_ok(t):
        return (t.dim() in (2, 3) and t.shape[-1] in (head_dim // 2, head_dim) and t.shape[-2] >= m
                and (t.dim() == 2 or t.shape[0] in (1, batch)))

    _check_rope_tables(rope, device, shape_ok,
                       lambda name: f"rope {name} must be [S, D/2], [B, S, D/2], [S, D] or [B, S, D] with S >= M={m}, "
                                    f"D={head_dim}, B={batch};")


def window_bounds(window, causal):
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


def check_attention_dtype(backend, dtype):
    """The cuda attention kernels take float16/bfloat16 only."""
    if backend == "cuda" and dtype == torch.float32:
        raise ValueError("the cuda attention kernels take float16/bfloat16, got float32; use backend='triton' or "
                         "'torch', or autocast")


def normalized_shape_tuple(normalized_shape):
    """An int or a sequence of ints as a tuple of ints."""
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def flatten_hidden(x, normalized_shape):
    """[..., *normalized_shape] -> [..., prod(normalized_shape)], checking the trailing dims."""
    k = len(normalized_shape)
    if tuple(x.shape[x.dim() - k:]) != normalized_shape or x.dim() < k:
        raise ValueError(f"input's trailing dimensions must be {normalized_shape}, got shape {tuple(x.shape)}")
    return x.reshape(*x.shape[: x.dim() - k], -1)


def as_rows(t):
    """[..., cols] -> [rows, cols] with unit column stride (a view where possible, else one copy)."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def cast_like(p, x):
    """p in x's dtype (a differentiable cast when they differ), or None."""
    if p is None:
        return None
    return p if p.dtype == x.dtype else p.to(x.dtype)


def vector_like(p, x):
    """A norm parameter as a [hidden] vector in x's dtype, or None."""
    if p is None:
        return None
    return cast_like(p if p.dim() == 1 else p.reshape(-1), x)


def autocast_cast(x, *tensors):
    """Under autocast, the fused blocks' GEMMs run in the autocast dtype: x and the parameters are
    cast (differentiably) here, and the Function then runs with autocast off, so that its backward
    (which autocast does not cover) sees the same dtypes as its forward. Returns the (possibly
    cast) tensors and the context to run the Function in."""
    device_type = x.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return (x, *tensors), contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    cast = [t if t is None or t.dtype == dtype else t.to(dtype) for t in (x, *tensors)]
    return cast, torch.autocast(device_type, enabled=False)


def check_varlen_qkv(q, k, v):
    """Packed q ``[total_q, Hq, D]``, k and v ``[total_k, Hkv, D]``: 3-D float tensors of one dtype
    and device, D in 1..MAX_HEAD_DIM, Hq a multiple of Hkv (totals may be 0)."""
    _check_qkv_tensors(q, k, v, 3, lambda name: f"with cu_seqlens, {name} must be 3-D [total, heads, D]")
    _check_kv_like_q(q, k, v)
    _, hq, head_dim = q.shape
    _, hkv, k_dim = k.shape
    if k_dim != head_dim:
        raise ValueError(f"k must be [total_k, Hkv, D={head_dim}], got {tuple(k.shape)}")
    if min(hq, hkv) < 1:
        raise ValueError(f"attention needs heads >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    _check_heads(hq, hkv, head_dim)


def _check_max_seqlen(value, name):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")


def check_varlen_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k, device,
                         keys_cover_queries=False):
    """Cumulative sequence lengths of a packed (variable-length) attention call: int32 1-D tensors
    of S + 1 >= 2 values on ``device``, starting at 0, non-decreasing (zero-length sequences
    allowed), ending at total_q / total_k, one S for q and k. max_seqlen_q / max_seqlen_k: None
    (computed here) or ints at least the longest sequence. ``keys_cover_queries`` (rope) also
    needs N_s <= M_s in every sequence. Returns (max_seqlen_q, max_seqlen_k) as ints.

    The values are read on the host (one device sync). Under torch.compile they are checked by
    ``torch._assert_async`` in the graph instead (no sync, no graph break; on a GPU a failure is a
    device-side assert), and max_seqlen_q / max_seqlen_k must be given.
    """
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (FlashAttention's varlen convention), got {cu.dtype}")
        if cu.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be 1-D with S + 1 >= 2 values, got shape {tuple(cu.shape)}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold one number of sequences, got "
                         f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    _check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    if torch.compiler.is_compiling():
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("under torch.compile, pass max_seqlen_q and max_seqlen_k (norm_attention: max_seqlen); "
                             "computing them reads the offsets on the host")
        for name, cu, total, bound in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                       ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
            lengths = cu.diff()
            torch._assert_async(cu[0] == 0, f"{name} must start at 0")
            torch._assert_async((lengths >= 0).all(), f"{name} must be non-decreasing")
            # The message names no size: formatting a symbolic size into a string specialises it
            # (a guard on its value), so every new length would compile a new graph.
            torch._assert_async(cu[-1] == total, f"{name} must end at the packed length (q/k/v's first dim)")
            torch._assert_async((lengths <= bound).all(), f"{name} has a sequence longer than its max_seqlen")
        if keys_cover_queries:
            torch._assert_async((cu_seqlens_q.diff() <= cu_seqlens_k.diff()).all(),
                                "rope needs every sequence's query count <= its key count")
        return max_seqlen_q, max_seqlen_k
    offsets_q, offsets_k = torch.stack([cu_seqlens_q, cu_seqlens_k]).tolist()
    lengths = {}
    for name, offsets, total in (("cu_seqlens_q", offsets_q, total_q), ("cu_seqlens_k", offsets_k, total_k)):
        if offsets[0] != 0:
            raise ValueError(f"{name} must start at 0, got {offsets[0]}")
        step = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        if min(step) < 0:
            raise ValueError(f"{name} must be non-decreasing, got {offsets}")
        if offsets[-1] != total:
            raise ValueError(f"{name} must end at the packed length {total} (q/k/v's first dim), got {offsets[-1]}")
        lengths[name] = step
    longest_q, longest_k = max(lengths["cu_seqlens_q"]), max(lengths["cu_seqlens_k"])
    for name, given, longest in (("max_seqlen_q", max_seqlen_q, longest_q), ("max_seqlen_k", max_seqlen_k, longest_k)):
        if given is not None and given < longest:
            raise ValueError(f"{name} ({given}) is below the longest sequence ({longest})")
    if keys_cover_queries and any(n > m for n, m in zip(lengths["cu_seqlens_q"], lengths["cu_seqlens_k"])):
        raise ValueError("rope needs N <= M in every sequence (query i sits at key position i + M - N)")
    return (longest_q if max_seqlen_q is None else max_seqlen_q,
            longest_k if max_seqlen_k is None else max_seqlen_k)


def check_varlen_rope(rope, total_k, max_seqlen_k, head_dim, device):
    """rope of a packed attention call: None or (cos, sin), each ``[S, D/2]`` / ``[S, D]`` with
    S >= max_seqlen_k (positions restart in each sequence) or ``[1, T, D/2]`` / ``[1, T, D]`` with
    T >= total_k (a row per packed key token)."""
    if rope is None:
        return
    _check_rope_pair(rope, head_dim)

    def shape_ok(t):
        width_ok = t.dim() in (2, 3) and t.shape[-1] in (head_dim // 2, head_dim)
        return width_ok and not ((t.dim() == 2 and t.shape[0] < max_seqlen_k) or (
            t.dim() == 3 and (t.shape[0] != 1 or t.shape[1] < total_k)))

    _check_rope_tables(rope, device, shape_ok,
                       lambda name: f"with cu_seqlens, rope {name} must be [S, D/2] or [S, D] with S >= max_seqlen_k="
                                    f"{max_seqlen_k} (positions restart per sequence), or [1, T, D/2] or [1, T, D] "
                                    f"with T >= total_k={total_k} (per token); D={head_dim},")


def check_empty_queries(empty, shape, device):
    """The ``empty_queries`` argument of remat.attention / remat.norm_attention: None, or a bool
    tensor of the queries' leading ``shape`` (``[B, N]``; ``[total_q]`` packed) on ``device``.
    Raises TypeError / ValueError otherwise."""
    if empty is None:
        return None
    if not isinstance(empty, torch.Tensor) or empty.dtype != torch.bool:
        raise TypeError(f"empty_queries must be None or a bool tensor, got {getattr(empty, 'dtype', type(empty))}")
    if tuple(empty.shape) != tuple(shape):
        raise ValueError(f"empty_queries must have the queries' shape {tuple(shape)}, got {tuple(empty.shape)}")
    if empty.device != device:
        raise ValueError(f"empty_queries must be on the queries' device {device}, got {empty.device}")
    return empty
