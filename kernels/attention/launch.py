"""Host launchers of the attention kernels: argument checks, outputs, grids; and the specs of
the ahead-of-time compile check (tests/test_triton_aot.py)."""

import functools
import os
from typing import NamedTuple

import torch
import triton

from .._common import _INTERPRETED, allow_tf32
from . import tuning
from .backward import (
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_dq_postprocess_kernel,
    _attn_bwd_preprocess_kernel,
)
from .forward import _attn_fwd_kernel
from .masks import _FAR
from .tuning import (
    _ELEMENTWISE_WARPS,
    _INTERPRETER_BLOCK,
    _ROWS_PER_PROGRAM,
    LaunchShape,
    _configs_for,
    _launch,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
# Sequence lengths below 2^28 keep the kernels' position arithmetic (see masks._OUT) inside int32.
_MAX_LENGTH = 1 << 28
_MAX_GRID_YZ = 65535

# RoPE's q/k rotation halves in the forward kernel at head dims where they split (80, 96, 192, ...:
# `_head_dim_parts`): False (default), padded halves; True (REMAT_ATTENTION_ROPE_SPLIT_HALVES=1,
# read at import; any other value leaves it False), the split halves. Only the forward kernel
# rotates (a call with a backward rotates q and k outside the kernels in both passes:
# remat.ops.attention rope_rotated_once), so the layout concerns no backward kernel. Padded by
# default (measured: tuning.py's notes); the option is for timing the split on a GPU. Tests set it
# here.
ROPE_SPLIT_HALVES = os.environ.get("REMAT_ATTENTION_ROPE_SPLIT_HALVES", "0") == "1"

# The backward launchers' answer to rotary tables.
_BACKWARD_ROPE_ERROR = ("cos, sin: the Triton attention backward kernels take q and k already rotated: "
                        "remat.ops.attention rotates them once per pass outside the kernels (rope_rotated_once); "
                        "pass cos = sin = None")


class _Features(NamedTuple):
    """A launch's feature arguments (`_features`): rope_tables, (cos, sin) or placeholders, and
    rope_constexprs (ROPE, BLOCK_H, BLOCK_H2), the forward kernel's only; rng, the dropout state
    or a placeholder; scalars (cap_scale, dropout_p, inv_keep) and constexprs (HEAD_DIM, BLOCK_D,
    BLOCK_D2, SOFTCAP, DROPOUT, TF32), every kernel's."""

    rope_tables: tuple
    rope_constexprs: dict
    rng: torch.Tensor
    scalars: dict
    constexprs: dict


def _refuse_rope(cos, sin):
    """The backward launchers' first check: no rotary tables (the backward kernels never rotate)."""
    if cos is not None or sin is not None:
        raise ValueError(_BACKWARD_ROPE_ERROR)


def _describe(tensor):
    return f"shape {tuple(tensor.shape)}, {tensor.dtype} on {tensor.device}"


def _check_operand(name, tensor, dtype, device):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    if tensor.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D tensor [B, L, H, D], got {_describe(tensor)}")
    if dtype is None:
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {tensor.dtype}")
    elif tensor.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype} like q, got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} like q, got {_describe(tensor)}")
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        raise ValueError(f"{name}: expected a unit stride in the last dimension, got strides "
                         f"{tuple(tensor.stride())}")


def _prepare(q, k, v, cos, sin, rng, scale, softcap, dropout_p):
    """Checks the shared arguments; returns (sizes (B, N, M, Hq, Hkv), the rotary tables' batch
    stride, `_Features`)."""
    _check_operand("q", q, None, None)
    _check_operand("k", k, q.dtype, q.device)
    _check_operand("v", v, q.dtype, q.device)
    batch, n, num_heads, head_dim = q.shape
    m, num_kv_heads = k.shape[1], k.shape[2]
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"q: head dim {head_dim} unsupported, expected 1 to {_MAX_HEAD_DIM}")
    if k.shape[0] != batch or k.shape[3] != head_dim or num_kv_heads < 1:
        raise ValueError(f"k: expected [{batch}, M, Hkv, {head_dim}], got {_describe(k)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {_describe(v)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"k: {num_kv_heads} kv heads do not divide the {num_heads} query heads")
    if min(batch, n, m) < 1 or max(n, m) >= _MAX_LENGTH:
        raise ValueError(f"q, k: expected B >= 1 and 1 <= N, M < 2^28, got {_describe(q)} "
                         f"and {_describe(k)}")
    if max(batch, num_heads) > _MAX_GRID_YZ:
        # The grids put heads on axis 1 and the batch on axis 2 (at most 65535 each).
        raise ValueError(f"q: expected at most {_MAX_GRID_YZ} batch entries and heads, got "
                         f"{_describe(q)}")
    rope = cos is not None
    if (cos is None) != (sin is None):
        raise ValueError("cos, sin: give both or neither")
    cs_stride_b = 0
    if rope:
        if head_dim % 2:
            raise ValueError(f"q: RoPE needs an even head dim, got {head_dim}")
        if n > m:
            raise ValueError(f"q: RoPE needs N <= M (query i sits at key position i + M - N), "
                             f"got N = {n}, M = {m}")
        for name, table in (("cos", cos), ("sin", sin)):
            if not isinstance(table, torch.Tensor) or table.dtype != torch.float32:
                raise TypeError(f"{name}: expected a float32 tensor")
            if (table.dim() != 3 or table.shape[0] not in (1, batch) or table.shape[1] < m
                    or table.shape[2] != head_dim // 2 or not table.is_contiguous()
                    or table.device != q.device):
                raise ValueError(
                    f"{name}: expected a contiguous [1 or {batch}, S >= {m}, {head_dim // 2}] "
                    f"tensor on {q.device}, got {_describe(table)}")
        if tuple(sin.shape) != tuple(cos.shape):
            raise ValueError(f"sin: expected the shape of cos {tuple(cos.shape)}, got "
                             f"{_describe(sin)}")
        if cos.shape[0] > 1:
            cs_stride_b = cos.stride(0)
    return (batch, n, m, num_heads, num_kv_heads), cs_stride_b, _features(q, head_dim, cos, sin, rng, scale,
                                                                          softcap, dropout_p)


def _two_parts(width):
    """(first, second): the power-of-two column parts (each >= 16, Triton's smallest dot K) that
    hold `width` columns: the padded tile's half and max(16, next_pow2(the rest)) when that is
    narrower than the padded tile, else (the padded tile max(16, next_pow2(width)), 0)."""
    padded = max(16, triton.next_power_of_2(width))
    first = padded // 2
    second = max(16, triton.next_power_of_2(width - first)) if width > first else 0
    return (first, second) if first >= 16 and 0 < second and first + second < padded else (padded, 0)


def _head_dim_parts(head_dim, rope, split_halves):
    """(BLOCK_D, BLOCK_H, BLOCK_D2, BLOCK_H2): the column tiles of a head dim (rope.py); the
    backward kernels (never RoPE) take BLOCK_D, BLOCK_D2 only.

    BLOCK_D, BLOCK_D2 (v, o, dout, dv and, outside the forward's RoPE, q, k, dq, dk) = `_two_parts(D)`: split
    when D is not a power of two and the two parts are narrower than the padded tile: BLOCK_D =
    the largest power of two below D, BLOCK_D2 = max(16, next_pow2(the rest)), e.g. 80 -> 64 + 16,
    96 -> 64 + 32, 192 -> 128 + 64, 48 -> 32 + 16; else padded, BLOCK_D = max(16, next_pow2(D))
    and BLOCK_D2 = 0 (112 -> 64 + 64 is no narrower than 128). Without RoPE BLOCK_H = BLOCK_D and
    BLOCK_H2 = 0. With RoPE the forward holds q, k by rotation halves of D/2 columns each: with
    split_halves (`ROPE_SPLIT_HALVES` at a launch) (BLOCK_H, BLOCK_H2) = `_two_parts(D / 2)` by the
    same rule: D = 80 -> 2 x (32 + 16) for 2 x 40, 96 -> 2 x (32 + 16), 192 -> 2 x (64 + 32),
    144 -> 2 x (64 + 16), padded where the split is no narrower (D = 40: 2 x 32 for 2 x 20, since
    16 + 16 is not below 32; 112: 2 x 64); without it padded, BLOCK_H = max(16, next_pow2(D / 2)),
    BLOCK_H2 = 0 (80 -> 2 x 64).
    """
    block_d, block_d2 = _two_parts(head_dim)
    if not rope:
        return block_d, block_d, block_d2, 0
    if split_halves:
        block_h, block_h2 = _two_parts(head_dim // 2)
    else:
        block_h, block_h2 = max(16, triton.next_power_of_2(head_dim // 2)), 0
    return block_d, block_h, block_d2, block_h2


def _postprocess_block_d(head_dim):
    """The atomic dq postprocess's columns: padded, never split, max(16, next_pow2(D)). It reads
    the fp32 dq buffer as stored, so its tile need not match the dK/dV kernel's; at its 64 rows
    the split one spilled more at D = 192 (ptxas, sm_80/sm_90: tuning.py's notes)."""
    return max(16, triton.next_power_of_2(head_dim))


def _features(q, head_dim, cos, sin, rng, scale, softcap, dropout_p):
    """Checks the scalar options and rng (the tables are checked by the caller); returns the
    launch's `_Features` (table arguments placeholders where absent)."""
    rope = cos is not None
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    dropout = dropout_p > 0.0
    if dropout and (not isinstance(rng, torch.Tensor) or rng.dtype != torch.int64
                    or rng.numel() != 2 or rng.device != q.device):
        raise ValueError(f"rng: dropout needs an int64 tensor [2] (seed, offset) on {q.device}")
    if not scale > 0.0:
        raise ValueError(f"scale: expected a positive float, got {scale}")
    if softcap < 0.0:
        raise ValueError(f"softcap: expected 0 (off) or a positive float, got {softcap}")
    # The forward's rotation halves as ROPE_SPLIT_HALVES says (the backward kernels take none).
    block_d, block_h, block_d2, block_h2 = _head_dim_parts(head_dim, rope, ROPE_SPLIT_HALVES)
    # TF32: fp32 dots follow PyTorch's fp32 matmul setting at this call (a compiled variant of
    # its own); 16-bit operands ignore it, so it stays False for them (no second variant).
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_D2=block_d2, SOFTCAP=softcap > 0.0, DROPOUT=dropout,
                      TF32=q.dtype == torch.float32 and allow_tf32())
    scalars = dict(
        cap_scale=scale / softcap if softcap > 0.0 else 0.0,
        dropout_p=float(dropout_p),
        inv_keep=1.0 / (1.0 - dropout_p),
    )
    # Placeholders for absent tensors: the constexpr flags keep the kernels from reading them.
    return _Features((cos, sin) if rope else (q, q), dict(ROPE=rope, BLOCK_H=block_h, BLOCK_H2=block_h2),
                     rng.reshape(2) if dropout else q, scalars, constexprs)


def _window(extent):
    """A window side for the kernels: -1 when unbounded, else clamped to _FAR = 2^28, which
    already reaches every key for N, M < 2^28."""
    extent = int(extent)
    return -1 if extent < 0 else min(extent, _FAR.value)


def _launch_shape(q, n, m, group, window_left, window_right):
    """The tuner's LaunchShape of a launch (windows as given by the caller, -1 = unbounded)."""
    device_index = q.device.index if q.device.type == "cuda" else -1
    if device_index is None:
        device_index = torch.cuda.current_device()
    return LaunchShape(int(n), int(m), int(group), _window(window_left), _window(window_right), device_index)


def _strides(tensor):
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


# Tests set an int here to force the dK/dV head split (a divisor of the group size; ignored when the
# group size is 1) on any device, e.g. under the interpreter, which has no multiprocessors to count;
# None: `_dkdv_head_splits` chooses from the device.
DKDV_HEAD_SPLITS = None


@functools.cache
def _multiprocessors(device):
    """The device's streaming multiprocessor count; None off CUDA (the interpreter's CPU tensors)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dkdv_head_splits(programs, group, multiprocessors):
    """How many programs share each kv head's query heads in the dK/dV kernel (HEAD_SPLITS).

    programs: the per-kv-head grid's size (key blocks * Hkv * B, or * S packed); group: Hq / Hkv;
    multiprocessors: the device's SM count, or None (no device to fill). 1 when that grid already
    covers the device, the group is 1, or there is no count; else the smallest divisor s of the
    group with programs * s >= multiprocessors (the group itself if none): each further split
    costs a workspace slice per kv head (`_launch_dkdv`), so no more than fill the device.
    DKDV_HEAD_SPLITS overrides the choice when the group is above 1.
    """
    if group == 1:
        return 1
    if DKDV_HEAD_SPLITS is not None:
        if group % DKDV_HEAD_SPLITS:
            raise ValueError(f"DKDV_HEAD_SPLITS: {DKDV_HEAD_SPLITS} does not divide the group size {group}")
        return DKDV_HEAD_SPLITS
    if multiprocessors is None or programs >= multiprocessors:
        return 1
    return next(s for s in range(2, group + 1) if group % s == 0 and (programs * s >= multiprocessors or s == group))


def _launch_dkdv(inputs, dk, dv, dq_arg, common, constexprs, shape, batch):
    """Launch the dK/dV kernel for dk, dv (new contiguous [B, M, Hkv, D] or [total_k, Hkv, D]),
    splitting each kv head's query heads over HEAD_SPLITS programs (`_dkdv_head_splits`, judged
    on the default tile's key blocks: the autotuner may pick another tile later).

    inputs: (q, k, v, dout, lse, delta); dq_arg: the fast mode's fp32 dq accumulator, or a
    placeholder; common: the kernels' shared arguments; constexprs with VARLEN and ATOMIC_DQ;
    shape: the launch's LaunchShape (its m: M, or max_seqlen_k packed); batch: B, or the sequence
    count S.

    With HEAD_SPLITS = s > 1 the kernel writes each program's fp32 partial dk and dv
    into two workspaces [.., Hkv * s, D]: 2 * 4 * B * M * Hkv * s * D bytes (B * M = total_k
    packed), plus a 4 * B * M * Hkv * D byte sum per tensor, allocated here per backward call
    and freed on return (never saved for backward). They are summed over each kv head's s partials
    by torch.sum in fp32 (deterministic: a fixed order per shape and device) and rounded once into
    dk, dv.
    """
    key_length = shape.m
    dtype = inputs[0].dtype
    num_kv_heads = dk.shape[-2]
    if _INTERPRETED:
        block_n = tuning.INTERPRETER_TILE[1]
    else:
        block_n = _configs_for("dkdv", constexprs, dtype)[0].kwargs["BLOCK_N"]
    key_blocks = triton.cdiv(max(key_length, 1), block_n)
    splits = _dkdv_head_splits(key_blocks * num_kv_heads * batch, shape.group, _multiprocessors(dk.device))
    if splits > 1:
        partial_shape = (*dk.shape[:-2], num_kv_heads * splits, dk.shape[-1])
        dk_out = torch.empty(partial_shape, dtype=torch.float32, device=dk.device)
        dv_out = torch.empty_like(dk_out)
    else:
        dk_out, dv_out = dk, dv
    _launch(_attn_bwd_dkdv_kernel, "dkdv",
            lambda block_m, block_n: (triton.cdiv(max(key_length, 1), block_n), num_kv_heads * splits, batch),
            (*inputs, dk_out, dv_out, dq_arg, *common), dict(constexprs, HEAD_SPLITS=splits), dtype, shape,
            accumulator=dq_arg if constexprs["ATOMIC_DQ"] else None)
    if splits > 1:
        for partial, out in ((dk_out, dk), (dv_out, dv)):
            out.copy_(partial.view(*out.shape[:-1], splits, out.shape[-1]).sum(-2))


def attention_fwd(q, k, v, cos, sin, rng, scale, softcap, window_left, window_right, dropout_p):
    """Flash-attention forward. Returns (o, lse).

    q [B, N, Hq, D]; k, v [B, M, Hkv, D], one of fp32/fp16/bf16, unit stride in the last
    dimension, any other strides; Hq % Hkv == 0; D in 1..256. cos, sin: None or fp32
    contiguous [1 or B, S >= M, D/2] (RoPE, D even, N <= M; key j uses row j, query i row
    i + M - N). rng: None or an int64 tensor [2] (seed, offset) on q's device, read there (no
    host sync); required when dropout_p > 0. scale > 0; softcap: 0 (off) or > 0;
    window_left/right: ints, -1 = unbounded (causal: right = 0). dropout_p in [0, 1).
    o: new contiguous [B, N, Hq, D] in q's dtype (0 in rows that see no key); lse: new
    contiguous fp32 [B, Hq, N], natural-log logsumexp of the undropped logits (+inf in rows
    that see no key). forward.py, logits.py and rope.py give the rounding points, masks.py
    the dropout counter.
    """
    sizes, cs_stride_b, features = _prepare(q, k, v, cos, sin, rng, scale, softcap, dropout_p)
    batch, n, m, num_heads, num_kv_heads = sizes
    scalars = features.scalars
    o = torch.empty((batch, n, num_heads, q.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_heads, n), dtype=torch.float32, device=q.device)
    args = (q, k, v, o, lse, *features.rope_tables, features.rng, q, q, *_strides(q), *_strides(k), *_strides(v),
            cs_stride_b, n, m, num_heads // num_kv_heads, float(scale), scalars["cap_scale"], float(softcap),
            _window(window_left), _window(window_right), scalars["dropout_p"], scalars["inv_keep"])
    _launch(_attn_fwd_kernel, "fwd",
            lambda block_m, block_n: (triton.cdiv(n, block_m), num_heads, batch),
            args, dict(features.constexprs, **features.rope_constexprs, VARLEN=False), q.dtype,
            _launch_shape(q, n, m, num_heads // num_kv_heads, window_left, window_right))
    return o, lse


def attention_bwd(dout, q, k, v, o, lse, cos, sin, rng, scale, softcap, window_left,
                  window_right, dropout_p, deterministic):
    """Flash-attention backward, recomputing P (and the dropout mask) from q, k, lse. Returns
    (dq, dk, dv).

    q, k, v, rng, scale, softcap, window_left/right, dropout_p: as given to attention_fwd, which
    ran without RoPE; cos, sin: None (the backward kernels never rotate: with RoPE the caller
    rotates q and k once per pass outside the kernels, remat.ops.attention rope_rotated_once;
    tables raise ValueError before any kernel). o, lse: its outputs (o may be any strided
    [B, N, Hq, D] view with a unit last stride); dout: like q, any such strides. dq [B, N, Hq, D],
    dk, dv [B, M, Hkv, D]: new contiguous, q's dtype, accumulated in fp32 and rounded once (dk,
    dv summed over each kv head's query heads inside the kernel, or, when that grid would leave a
    GPU's multiprocessors idle, over parts of the group in several programs whose fp32 partials are then added in a
    fixed order: `_launch_dkdv`). deterministic=True: no atomics (a dK/dV and a dQ
    kernel), so a rerun gives the same bits; False: the dK/dV kernel also accumulates dq with
    fp32 atomics (summation order varies between runs), then a pass casts it.
    """
    _refuse_rope(cos, sin)
    sizes, _, features = _prepare(q, k, v, None, None, rng, scale, softcap, dropout_p)
    batch, n, m, num_heads, num_kv_heads = sizes
    scalars, constexprs = features.scalars, features.constexprs
    _check_operand("dout", dout, q.dtype, q.device)
    _check_operand("o", o, q.dtype, q.device)
    for name, tensor in (("dout", dout), ("o", o)):
        if tuple(tensor.shape) != tuple(q.shape):
            raise ValueError(f"{name}: expected the shape of q {tuple(q.shape)}, got "
                             f"{_describe(tensor)}")
    if (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32
            or tuple(lse.shape) != (batch, num_heads, n) or lse.device != q.device):
        raise ValueError(f"lse: expected float32 [{batch}, {num_heads}, {n}] on {q.device}")
    lse = lse.contiguous()
    head_dim = q.shape[3]
    device = q.device
    dq = torch.empty((batch, n, num_heads, head_dim), dtype=q.dtype, device=device)
    dk = torch.empty((batch, m, num_kv_heads, head_dim), dtype=q.dtype, device=device)
    dv = torch.empty((batch, m, num_kv_heads, head_dim), dtype=q.dtype, device=device)
    delta = torch.empty((batch, num_heads, n), dtype=torch.float32, device=device)
    rows = _INTERPRETER_BLOCK if _INTERPRETED else _ROWS_PER_PROGRAM
    elementwise_grid = (triton.cdiv(n, rows), num_heads, batch)
    _attn_bwd_preprocess_kernel[elementwise_grid](
        o, dout, delta, *_strides(o), *_strides(dout), n,
        HEAD_DIM=head_dim, BLOCK_D=constexprs["BLOCK_D"], BLOCK_D2=constexprs["BLOCK_D2"], BLOCK_M=rows,
        num_warps=_ELEMENTWISE_WARPS)
    group = num_heads // num_kv_heads
    common = (features.rng, q, q, *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
              n, m, group, float(scale), scalars["cap_scale"], float(softcap),
              _window(window_left), _window(window_right),
              scalars["dropout_p"], scalars["inv_keep"])
    inputs = (q, k, v, dout, lse, delta)
    shape = _launch_shape(q, n, m, group, window_left, window_right)
    if deterministic:
        _launch_dkdv(inputs, dk, dv, dk, common, dict(constexprs, VARLEN=False, ATOMIC_DQ=False), shape, batch)
        _launch(_attn_bwd_dq_kernel, "dq",
                lambda block_m, block_n: (triton.cdiv(n, block_m), num_heads, batch),
                (q, k, v, dout, lse, delta, dq, *common), dict(constexprs, VARLEN=False), q.dtype, shape)
    else:
        dq_acc = torch.zeros((batch, n, num_heads, head_dim), dtype=torch.float32, device=device)
        _launch_dkdv(inputs, dk, dv, dq_acc, common, dict(constexprs, VARLEN=False, ATOMIC_DQ=True), shape, batch)
        _attn_bwd_dq_postprocess_kernel[elementwise_grid](
            dq_acc, dq, n, HEAD_DIM=head_dim, BLOCK_D=_postprocess_block_d(head_dim), BLOCK_M=rows,
            INTERPRETED=_INTERPRETED, num_warps=_ELEMENTWISE_WARPS)
    return dq, dk, dv


def _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, rng, scale,
                    softcap, dropout_p):
    """Checks a packed call's arguments (the offsets' values are the caller's: remat.checks reads
    them once before the first kernel). Returns ((Hq, Hkv), the rotary tables' stride per packed
    key token (D/2 for per-token tables [1, T, D/2], 0 for tables [S_rows, D/2] that restart at
    every sequence), `_Features`, and the number of sequences)."""
    _check_operand("q", q[None], None, None)
    _check_operand("k", k[None], q.dtype, q.device)
    _check_operand("v", v[None], q.dtype, q.device)
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, k_dim = k.shape
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"q: head dim {head_dim} unsupported, expected 1 to {_MAX_HEAD_DIM}")
    if k_dim != head_dim or num_kv_heads < 1 or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k, v: expected [total_k, Hkv, {head_dim}], got {_describe(k)} and {_describe(v)}")
    if num_heads % num_kv_heads or num_heads > _MAX_GRID_YZ:
        raise ValueError(f"k: {num_kv_heads} kv heads must divide the {num_heads} query heads (at most "
                         f"{_MAX_GRID_YZ})")
    for name, offsets in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if (not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.dim() != 1
                or offsets.numel() < 2 or not offsets.is_contiguous() or offsets.device != q.device):
            raise ValueError(f"{name}: expected a contiguous int32 tensor [S + 1] on {q.device}")
    sequences = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != sequences + 1 or sequences > _MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_k: expected {sequences + 1} offsets like cu_seqlens_q, and at most "
                         f"{_MAX_GRID_YZ} sequences (grid axis 2)")
    lengths_ok = 0 <= max_seqlen_q < _MAX_LENGTH and 0 <= max_seqlen_k < _MAX_LENGTH
    if max(q.shape[0], k.shape[0]) >= 2**31 or not lengths_ok:
        raise ValueError(f"max_seqlen_q, max_seqlen_k: expected 0 <= length < 2^28 (and totals < 2^31), got "
                         f"{max_seqlen_q}, {max_seqlen_k}")
    if (cos is None) != (sin is None):
        raise ValueError("cos, sin: give both or neither")
    per_token = cos is not None and cos.dim() == 3
    if cos is not None:
        if head_dim % 2:
            raise ValueError(f"q: RoPE needs an even head dim, got {head_dim}")
        for name, table in (("cos", cos), ("sin", sin)):
            restart = table.dim() == 2 and table.shape[0] >= max_seqlen_k
            token = table.dim() == 3 and table.shape[0] == 1 and table.shape[1] >= k.shape[0]
            if (not (restart or token) or table.dtype != torch.float32 or table.shape[-1] != head_dim // 2
                    or not table.is_contiguous() or table.device != q.device or table.shape != cos.shape):
                raise ValueError(f"{name}: expected contiguous float32 [S >= max_seqlen_k = {max_seqlen_k}, "
                                 f"{head_dim // 2}] or [1, T >= total_k = {k.shape[0]}, {head_dim // 2}] tables on "
                                 f"{q.device} of one shape, got {_describe(table)}")
    features = _features(q, head_dim, cos, sin, rng, scale, softcap, dropout_p)
    cs_stride = head_dim // 2 if per_token else 0
    return (num_heads, num_kv_heads), cs_stride, features, sequences


def _packed_strides(tensor):
    """(batch, row, head) strides of a packed [total, H, D] operand: no batch stride (VARLEN
    kernels place each sequence by its first row)."""
    return 0, tensor.stride(0), tensor.stride(1)


def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, rng, scale,
                         softcap, window_left, window_right, dropout_p):
    """Packed (variable-length) flash-attention forward: the forward kernel with VARLEN, a
    program per (query block of max_seqlen_q, query head, sequence). Returns (o, lse).

    q [total_q, Hq, D]; k, v [total_k, Hkv, D] (unit last stride); cu_seqlens_q / _k: int32
    [S + 1] offsets on q's device, checked by the caller; max_seqlen_q / _k: upper bounds of the
    lengths (the grid; the dropout counter grid). cos, sin: None, fp32 contiguous [S_rows, D/2]
    (positions restart per sequence) or [1, T, D/2] (per packed key token). The rest as
    attention_fwd. o: new contiguous [total_q, Hq, D]; lse: new contiguous fp32 [Hq, total_q].
    """
    (num_heads, num_kv_heads), cs_stride, features, sequences = _prepare_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin, rng, scale, softcap, dropout_p)
    scalars = features.scalars
    total_q = q.shape[0]
    o = torch.empty((total_q, num_heads, q.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((num_heads, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0:
        return o, lse
    args = (q, k, v, o, lse, *features.rope_tables, features.rng, cu_seqlens_q, cu_seqlens_k, *_packed_strides(q),
            *_packed_strides(k),
            *_packed_strides(v), cs_stride, max_seqlen_q, max_seqlen_k, num_heads // num_kv_heads, float(scale),
            scalars["cap_scale"], float(softcap), _window(window_left), _window(window_right),
            scalars["dropout_p"], scalars["inv_keep"])
    _launch(_attn_fwd_kernel, "fwd",
            lambda block_m, block_n: (triton.cdiv(max(max_seqlen_q, 1), block_m), num_heads, sequences),
            args, dict(features.constexprs, **features.rope_constexprs, VARLEN=True), q.dtype,
            _launch_shape(q, max_seqlen_q, max_seqlen_k, num_heads // num_kv_heads, window_left, window_right))
    return o, lse


def attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cos, sin,
                         rng, scale, softcap, window_left, window_right, dropout_p, deterministic):
    """Backward of attention_varlen_fwd (run without RoPE), recomputing P (and the dropout mask)
    from q, k, lse: the backward kernels with VARLEN, grids over (block, head, sequence). cos,
    sin: None, as for attention_bwd (tables raise ValueError before any kernel). Returns (dq,
    dk, dv), new contiguous [total, H, D] in q's dtype; keys of a sequence without queries get 0."""
    _refuse_rope(cos, sin)
    (num_heads, num_kv_heads), _, features, sequences = _prepare_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, None, rng, scale, softcap, dropout_p)
    scalars, constexprs = features.scalars, features.constexprs
    total_q, head_dim = q.shape[0], q.shape[2]
    for name, tensor in (("dout", dout), ("o", o)):
        if (not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(q.shape) or tensor.dtype != q.dtype
                or tensor.device != q.device or (tensor.stride(-1) != 1 and head_dim > 1)):
            raise ValueError(f"{name}: expected q's shape {tuple(q.shape)}, dtype and device, unit last stride")
    if (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32
            or tuple(lse.shape) != (num_heads, total_q) or lse.device != q.device):
        raise ValueError(f"lse: expected float32 [{num_heads}, {total_q}] on {q.device}")
    lse = lse.contiguous()
    device = q.device
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty((k.shape[0], num_kv_heads, head_dim), dtype=q.dtype, device=device)
    dv = torch.empty_like(dk)
    if total_q == 0 or k.shape[0] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty((num_heads, total_q), dtype=torch.float32, device=device)
    rows = _INTERPRETER_BLOCK if _INTERPRETED else _ROWS_PER_PROGRAM
    # Delta = rowsum(dout * o) needs no sequence boundaries: the packed rows as one batch entry.
    _attn_bwd_preprocess_kernel[(triton.cdiv(total_q, rows), num_heads, 1)](
        o[None], dout[None], delta, *_strides(o[None]), *_strides(dout[None]), total_q,
        HEAD_DIM=head_dim, BLOCK_D=constexprs["BLOCK_D"], BLOCK_D2=constexprs["BLOCK_D2"], BLOCK_M=rows,
        num_warps=_ELEMENTWISE_WARPS)
    common = (features.rng, cu_seqlens_q, cu_seqlens_k, *_packed_strides(q), *_packed_strides(k), *_packed_strides(v),
              *_packed_strides(dout), max_seqlen_q, max_seqlen_k, num_heads // num_kv_heads,
              float(scale), scalars["cap_scale"], float(softcap), _window(window_left), _window(window_right),
              scalars["dropout_p"], scalars["inv_keep"])
    inputs = (q, k, v, dout, lse, delta)
    constexprs = dict(constexprs, VARLEN=True)
    shape = _launch_shape(q, max_seqlen_q, max_seqlen_k, num_heads // num_kv_heads, window_left, window_right)
    if deterministic:
        _launch_dkdv(inputs, dk, dv, dk, common, dict(constexprs, ATOMIC_DQ=False), shape, sequences)
        _launch(_attn_bwd_dq_kernel, "dq",
                lambda block_m, block_n: (triton.cdiv(max(max_seqlen_q, 1), block_m), num_heads, sequences),
                (q, k, v, dout, lse, delta, dq, *common), constexprs, q.dtype, shape)
    else:
        dq_acc = torch.zeros((total_q, num_heads, head_dim), dtype=torch.float32, device=device)
        _launch_dkdv(inputs, dk, dv, dq_acc, common, dict(constexprs, ATOMIC_DQ=True), shape, sequences)
        # The packed rows as one batch entry, as for the preprocess.
        _attn_bwd_dq_postprocess_kernel[(triton.cdiv(total_q, rows), num_heads, 1)](
            dq_acc, dq, total_q, HEAD_DIM=head_dim, BLOCK_D=_postprocess_block_d(head_dim), BLOCK_M=rows,
            INTERPRETED=_INTERPRETED, num_warps=_ELEMENTWISE_WARPS)
    return dq, dk, dv


def aot_specs():
    """Yield (name, kernel, signature, constexprs, num_warps) for ahead-of-time compile checks.

    `signature` and `constexprs` are in the form `triton.compiler.ASTSource` takes; names are
    'attn_<kernel>-<dtype>-d<D>[-rope][-softcap-dropout][-varlen][-splithalves]'. bf16 and fp16
    at head dims 64 and 128: the forward, the backward preprocess, the deterministic dK/dV and dQ
    kernels, the fast (atomic dQ) dK/dV kernel and its postprocess, without RoPE, softcap or
    dropout (the window, causal or not, is a runtime argument). fp32 at head dim 64: the forward,
    dK/dV and dQ kernels (FMA dots). bf16 at split head dims (`_head_dim_parts`) with the heavy
    features: the forward with RoPE, softcap and dropout (the rotation halves padded as by
    default, ROPE_SPLIT_HALVES off), the backward kernels with softcap and dropout (they never
    take RoPE): at 80 (64 + 16, halves 64) and 96 (64 + 32, halves 64) the forward, the
    deterministic and atomic dK/dV kernels and the dQ kernel; at 192 (128 + 64, halves 128) the
    forward, dK/dV and dQ kernels. The forward's split rotation halves of ROPE_SPLIT_HALVES (names
    '-splithalves'): bf16 with RoPE, softcap and dropout at 80 (halves 32 + 16) and 192 (halves
    64 + 32). bf16 at head dim 8 (padded to the smallest tile, 16): the forward, dK/dV and dQ
    kernels. Packed sequences (VARLEN, names '-varlen'): bf16 at head dim 64, the forward and the
    deterministic dK/dV and dQ kernels; bf16 at head dim 80 the forward with RoPE, softcap and
    dropout and the atomic dK/dV kernel with softcap and dropout. fp32 with TF32 dots (names
    'fp32-tf32') at head dim 64: the forward, dK/dV and dQ kernels. The dK/dV kernel with its
    query heads split (HEAD_SPLITS = 4, names '-split4', fp32 dk/dv workspaces): bf16 at head dims
    64 and 128, fp32 at 64, bf16 at 80 with softcap and dropout (deterministic and atomic), packed
    bf16 at 64. Split head dims without the features (`_head_dim_parts`, q and k split too): bf16
    at 80 (64 + 16) every main kind, at 96 (64 + 32) and 192 (128 + 64) the forward, dK/dV and dQ
    kernels, packed bf16 at 80 the forward and dK/dV kernels. The postprocess (padded columns,
    `_postprocess_block_d`) takes no feature. Each main kernel takes its default configuration
    (`_configs_for`); the compile check passes num_warps only, so num_stages is Triton's default
    3. Sizes are 32-bit and strides 64-bit (a launch gets i64 for a stride past 2^31 - 1). 71
    specs.
    """
    main_kinds = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "bwd_dkdv_atomic",
                  "bwd_dq_postprocess")
    # (kind, dtype, head dim, heavy features, varlen): the heavy features are RoPE, softcap and
    # dropout in the forward, softcap and dropout in the backward kernels.
    cases = [(kind, type_name, head_dim, False, False) for type_name in ("bf16", "fp16")
             for head_dim in (64, 128) for kind in main_kinds]
    cases += [(kind, "fp32", 64, False, False) for kind in ("fwd", "bwd_dkdv", "bwd_dq")]
    heavy_kinds = ("fwd", "bwd_dkdv", "bwd_dq", "bwd_dkdv_atomic")
    cases += [(kind, "bf16", head_dim, True, False) for head_dim in (80, 96) for kind in heavy_kinds]
    cases += [(kind, "bf16", 192, True, False) for kind in ("fwd", "bwd_dkdv", "bwd_dq")]
    cases += [(kind, "bf16", 8, False, False) for kind in ("fwd", "bwd_dkdv", "bwd_dq")]
    cases += [(kind, "bf16", 64, False, True) for kind in ("fwd", "bwd_dkdv", "bwd_dq")]
    cases += [(kind, "bf16", 80, True, True) for kind in ("fwd", "bwd_dkdv_atomic")]
    cases += [(kind, "fp32-tf32", 64, False, False) for kind in ("fwd", "bwd_dkdv", "bwd_dq")]
    cases += [("bwd_dkdv_split4", "bf16", 64, False, False), ("bwd_dkdv_split4", "bf16", 128, False, False),
              ("bwd_dkdv_split4", "fp32", 64, False, False), ("bwd_dkdv_split4", "bf16", 80, True, False),
              ("bwd_dkdv_atomic_split4", "bf16", 80, True, False), ("bwd_dkdv_split4", "bf16", 64, False, True)]
    cases += [(kind, "bf16", 80, False, False) for kind in main_kinds]
    cases += [(kind, "bf16", head_dim, False, False) for head_dim in (96, 192)
              for kind in ("fwd", "bwd_dkdv", "bwd_dq")]
    cases += [(kind, "bf16", 80, False, True) for kind in ("fwd", "bwd_dkdv")]
    # The last field: the forward's split rotation halves (ROPE_SPLIT_HALVES) instead of the padded ones.
    cases = [case + (False,) for case in cases]
    cases += [("fwd", "bf16", head_dim, True, False, True) for head_dim in (80, 192)]
    torch_types = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                   "fp32-tf32": torch.float32}
    scalars = {"scale": "fp32", "cap_scale": "fp32", "softcap": "fp32", "left": "i32",
               "right": "i32", "dropout_p": "fp32", "inv_keep": "fp32"}
    strides = dict.fromkeys(
        ("stride_qb", "stride_qn", "stride_qh", "stride_kb", "stride_kn", "stride_kh",
         "stride_vb", "stride_vn", "stride_vh"), "i64")
    do_strides = dict.fromkeys(("stride_dob", "stride_don", "stride_doh"), "i64")
    offsets = {"cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}
    for kind, type_name, head_dim, features, varlen, split_halves in cases:
        element = "*fp32" if type_name == "fp32-tf32" else f"*{type_name}"
        rope = features and kind == "fwd"
        block_d, block_h, block_d2, block_h2 = _head_dim_parts(head_dim, rope, split_halves)
        constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_D2=block_d2, SOFTCAP=features, DROPOUT=features,
                          VARLEN=varlen, TF32=type_name == "fp32-tf32")
        config_name = None
        if kind == "fwd":
            kernel, config_name = _attn_fwd_kernel, "fwd"
            signature = {"q_ptr": element, "k_ptr": element, "v_ptr": element, "o_ptr": element,
                         "lse_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "rng_ptr": "*i64", **offsets,
                         **strides, "cs_stride_b": "i64", "N": "i32", "M": "i32", "GROUP": "i32", **scalars}
            constexprs.update(ROPE=rope, BLOCK_H=block_h, BLOCK_H2=block_h2)
        elif kind == "bwd_preprocess":
            kernel = _attn_bwd_preprocess_kernel
            signature = {"o_ptr": element, "do_ptr": element, "delta_ptr": "*fp32",
                         "stride_ob": "i64", "stride_on": "i64", "stride_oh": "i64",
                         **do_strides, "N": "i32"}
            constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_D2=block_d2, BLOCK_M=_ROWS_PER_PROGRAM)
        elif kind == "bwd_dq_postprocess":
            kernel = _attn_bwd_dq_postprocess_kernel
            signature = {"dq_acc_ptr": "*fp32", "dq_ptr": element, "N": "i32"}
            constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=_postprocess_block_d(head_dim), BLOCK_M=_ROWS_PER_PROGRAM,
                              INTERPRETED=False)
        else:
            common = {"rng_ptr": "*i64", **offsets, **strides, **do_strides, "N": "i32", "M": "i32", "GROUP": "i32",
                      **scalars}
            inputs = {"q_ptr": element, "k_ptr": element, "v_ptr": element, "do_ptr": element,
                      "lse_ptr": "*fp32", "delta_ptr": "*fp32"}
            if kind == "bwd_dq":
                kernel, config_name = _attn_bwd_dq_kernel, "dq"
                signature = {**inputs, "dq_ptr": element, **common}
            else:
                kernel, config_name = _attn_bwd_dkdv_kernel, "dkdv"
                atomic = kind.startswith("bwd_dkdv_atomic")
                splits = 4 if kind.endswith("_split4") else 1
                # Split: dk, dv are the fp32 workspaces of the partial sums.
                output = "*fp32" if splits > 1 else element
                signature = {**inputs, "dk_ptr": output, "dv_ptr": output,
                             "dq_ptr": "*fp32" if atomic else element, **common}
                constexprs.update(ATOMIC_DQ=atomic, HEAD_SPLITS=splits)
        if config_name is not None:
            config = _configs_for(config_name, constexprs, torch_types[type_name])[0]
            constexprs.update(config.kwargs, INTERPRETED=False)
            num_warps = config.num_warps
        else:
            num_warps = _ELEMENTWISE_WARPS
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        suffix = (("-rope" if rope else "") + ("-softcap-dropout" if features else "") + ("-varlen" if varlen else "")
                  + ("-splithalves" if split_halves else ""))
        yield (f"attn_{kind}-{type_name}-d{head_dim}{suffix}", kernel, signature, constexprs,
               num_warps)
