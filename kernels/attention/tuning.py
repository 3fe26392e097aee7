"""Block sizes of the attention kernels, their autotuning, and the one launch helper.

`triton.autotune` over a few configurations per kernel, padded head dim, dtype class and
feature weight (`_CONFIGS`, `_configs_for`) when compiled; a fixed 16 x 16 tile under the
interpreter. REMAT_ATTENTION_AUTOTUNE=0 (read at import) launches the first configuration of
each list without benchmarking, so every process picks the same tiles: the deterministic
backward is then bitwise reproducible across processes too, not only within one (the autotuner
caches its choice per process, and another choice changes the summation order).
"""

import os

import torch
import triton

from .._common import _INTERPRETED
from .backward import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel
from .forward import _attn_fwd_kernel

_AUTOTUNE = os.environ.get("REMAT_ATTENTION_AUTOTUNE", "1") != "0"

# Rows per program of the preprocess and postprocess passes: elementwise work over [rows, D],
# 64 x 256 fp32 products at most, 32 per thread over 4 warps.
_ROWS_PER_PROGRAM = 64
_ELEMENTWISE_WARPS = 4
# Under the interpreter programs run one after another in numpy: one small tile keeps the CPU
# tests fast and still crosses tile edges at lengths 17 and 33.
_INTERPRETER_BLOCK = 16
# (BLOCK_M, BLOCK_N) of the interpreter's launches. Square by default; tests set non-square tiles
# here (tests/test_triton_attention.py), so that a BLOCK_M / BLOCK_N mix-up in a kernel shows on
# the CPU too.
INTERPRETER_TILE = (_INTERPRETER_BLOCK, _INTERPRETER_BLOCK)


def _config(block_m, block_n, num_warps, num_stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n},
                         num_warps=num_warps, num_stages=num_stages)


def _configs(*entries):
    return [_config(*entry) for entry in entries]


# (kernel, padded head dim class, dtype class, heavy) -> configurations (BLOCK_M = query tile,
# BLOCK_N = key tile, warps, stages); the first is the default, used without autotuning and by
# aot_specs. Head-dim classes: 64 (D 1-64), 128, 256. "heavy": RoPE (two more [tile, D/2]
# operands and the fp32 cos/sin tiles) or dropout (Philox per score element) is on.
# Measured with ptxas (cuobjdump --dump-resource-usage) on sm_80 and sm_90a builds compiled with
# the 16-byte divisibility an aligned launch gets (pointers, strides) and each config's
# num_stages, bf16, heavy measured with RoPE + softcap and with RoPE + softcap + dropout. The
# 16-bit defaults use 115-255 registers per thread, 28-168 KiB of shared memory (within sm_80's
# 163 KiB where it matters: every default fits both archs) and do not spill, except on sm_80:
# the atomic dK/dV kernel at D 256 (32 bytes per thread); heavy, the dK/dV kernels at D 64
# (64-160 bytes) and D 256 (24-120), the dQ kernel at D 64 with dropout (72); every candidate
# tried there spilled at least as much. The other entries are autotuning candidates, some fit
# only sm_90 (the autotuner drops a config that fails to launch). What costs registers: the
# dK/dV kernel keeps k, v and the fp32 dk, dv accumulators of its key block for the whole loop,
# so its tiles stay at 16-32 rows for D >= 128; the forward and dQ kernels keep a [BLOCK_M, D]
# fp32 accumulator. Measured and dropped: e.g. the dK/dV kernel at D 64 with a 64 x 64 tile, or
# at D 128 with 32 x 128, made ptxas fall back to 32 registers and 3-8 KiB of spills on sm_80.
# fp32 (IEEE products on the FMA units, operands held in registers): small tiles; the defaults
# do not spill except dK/dV at D 128 on sm_90 (16 bytes), but with RoPE or dropout they spill
# 16-550 bytes, and halving the tiles did not help (fp32 is the accuracy path, not a fast one).
_CONFIGS = {
    ("fwd", 64, "16bit", False): _configs((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3),
                                          (64, 64, 4, 3)),
    ("fwd", 64, "16bit", True): _configs((128, 64, 8, 3), (64, 64, 4, 3)),
    ("fwd", 128, "16bit", False): _configs((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                                           (64, 32, 4, 3)),
    ("fwd", 128, "16bit", True): _configs((64, 32, 4, 3), (128, 64, 8, 3)),
    ("fwd", 256, "16bit", False): _configs((64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2),
                                           (32, 32, 4, 2)),
    ("fwd", 256, "16bit", True): _configs((32, 64, 8, 2), (64, 32, 8, 2)),
    ("dq", 64, "16bit", False): _configs((128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3),
                                         (64, 64, 4, 3)),
    ("dq", 64, "16bit", True): _configs((64, 32, 8, 3), (32, 32, 4, 3), (64, 32, 4, 3)),
    ("dq", 128, "16bit", False): _configs((64, 64, 8, 2), (64, 32, 4, 3), (32, 32, 4, 3)),
    ("dq", 128, "16bit", True): _configs((32, 32, 4, 3), (64, 32, 4, 3)),
    ("dq", 256, "16bit", False): _configs((32, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2)),
    ("dq", 256, "16bit", True): _configs((32, 32, 8, 2), (16, 32, 8, 2)),
    ("dkdv", 64, "16bit", False): _configs((32, 128, 8, 3), (16, 64, 4, 3), (32, 64, 8, 3)),
    ("dkdv", 64, "16bit", True): _configs((16, 64, 8, 3), (16, 64, 4, 3), (16, 32, 4, 3)),
    ("dkdv", 128, "16bit", False): _configs((32, 64, 8, 2), (16, 64, 4, 2), (16, 32, 4, 2)),
    ("dkdv", 128, "16bit", True): _configs((32, 32, 8, 2), (16, 32, 8, 2), (16, 32, 4, 2)),
    ("dkdv", 256, "16bit", False): _configs((32, 32, 8, 2), (16, 32, 4, 2), (16, 64, 8, 2)),
    ("dkdv", 256, "16bit", True): _configs((16, 32, 8, 2), (32, 16, 8, 2)),
    ("dkdv_atomic", 64, "16bit", False): _configs((16, 64, 4, 3), (32, 64, 8, 3),
                                                  (32, 128, 8, 3)),
    ("dkdv_atomic", 64, "16bit", True): _configs((16, 64, 8, 3), (16, 32, 4, 3)),
    ("dkdv_atomic", 128, "16bit", False): _configs((32, 64, 8, 2), (16, 32, 4, 2)),
    ("dkdv_atomic", 128, "16bit", True): _configs((32, 32, 8, 2), (16, 32, 8, 2)),
    ("dkdv_atomic", 256, "16bit", False): _configs((32, 32, 8, 2), (16, 64, 8, 2),
                                                   (16, 32, 4, 2)),
    ("dkdv_atomic", 256, "16bit", True): _configs((16, 32, 8, 2), (32, 16, 8, 2)),
    ("fwd", 64, "fp32", False): _configs((32, 32, 4, 2), (64, 32, 4, 2)),
    ("fwd", 128, "fp32", False): _configs((64, 32, 8, 2), (32, 32, 4, 2)),
    ("fwd", 256, "fp32", False): _configs((16, 32, 4, 1), (32, 32, 8, 1)),
    ("dq", 64, "fp32", False): _configs((32, 32, 4, 2), (64, 32, 8, 2)),
    ("dq", 128, "fp32", False): _configs((32, 32, 8, 2), (32, 16, 4, 2)),
    ("dq", 256, "fp32", False): _configs((32, 16, 8, 1), (16, 16, 4, 1)),
    ("dkdv", 64, "fp32", False): _configs((32, 32, 4, 2), (32, 64, 8, 2)),
    ("dkdv", 128, "fp32", False): _configs((32, 32, 8, 2), (16, 32, 4, 2)),
    ("dkdv", 256, "fp32", False): _configs((16, 32, 8, 1), (16, 16, 4, 1)),
}
# fp32 takes the same tiles with the heavy features (fp32 attention is the accuracy path, not
# a tuned one), and the atomic dK/dV kernel the deterministic one's.
for (_name, _size, _kind, _heavy), _entries in list(_CONFIGS.items()):
    if _kind == "fp32":
        _CONFIGS[(_name, _size, _kind, True)] = _entries
        if _name == "dkdv":
            _CONFIGS[("dkdv_atomic", _size, _kind, False)] = _entries
            _CONFIGS[("dkdv_atomic", _size, _kind, True)] = _entries


def _configs_for(kernel_name, constexprs, dtype):
    """The configuration list of a launch: by kernel (the fast mode's dK/dV kernel has its
    own), padded head dim, dtype and whether RoPE or dropout is on."""
    if kernel_name == "dkdv" and constexprs.get("ATOMIC_DQ"):
        kernel_name = "dkdv_atomic"
    size = max(constexprs["BLOCK_D"], 64)
    kind = "fp32" if dtype == torch.float32 else "16bit"
    heavy = bool(constexprs["ROPE"] or constexprs["DROPOUT"])
    return _CONFIGS[(kernel_name, size, kind, heavy)]


def _autotuned(kernel, kernel_name, **options):
    """kernel under triton.autotune over the candidates of its kernel name, pruned per launch
    to `_configs_for`'s list. Keyed on the head dim (padded and exact) and the feature flags;
    the autotuner adds the tensors' dtypes to the key itself."""
    names = (kernel_name, "dkdv_atomic") if kernel_name == "dkdv" else (kernel_name,)
    candidates = [config for key, entries in _CONFIGS.items() if key[0] in names
                  for config in entries]

    def prune(configs, named_args, **kwargs):
        del configs
        return _configs_for(kernel_name, kwargs, named_args["q_ptr"].dtype)

    return triton.autotune(
        configs=candidates,
        key=["HEAD_DIM", "BLOCK_D", "ROPE", "SOFTCAP", "DROPOUT", "VARLEN"]
            + (["ATOMIC_DQ"] if kernel_name == "dkdv" else []),
        prune_configs_by={"early_config_prune": prune},
        **options,
    )(kernel)


if not _INTERPRETED:
    _FWD_TUNED = _autotuned(_attn_fwd_kernel, "fwd")
    _DKDV_TUNED = _autotuned(_attn_bwd_dkdv_kernel, "dkdv")
    # The fast mode's dq buffer accumulates with atomics: zero it before every benchmarked run
    # (the autotuner zeroes it again before the real launch).
    _DKDV_ATOMIC_TUNED = _autotuned(_attn_bwd_dkdv_kernel, "dkdv", reset_to_zero=["dq_ptr"])
    _DQ_TUNED = _autotuned(_attn_bwd_dq_kernel, "dq")
else:
    # The interpreter launches the plain kernels with _INTERPRETER_BLOCK tiles (`_launch`).
    _FWD_TUNED = _DKDV_TUNED = _DKDV_ATOMIC_TUNED = _DQ_TUNED = None


def _launch(kernel, tuned, kernel_name, grid_of, args, constexprs, dtype):
    """Launch with the autotuner when compiled (and enabled), else with one fixed config:
    the interpreter's 16 x 16 tile, or the launch's default config."""
    if _INTERPRETED:
        block_m, block_n = INTERPRETER_TILE
        kernel[grid_of(block_m, block_n)](
            *args, **constexprs, BLOCK_M=block_m, BLOCK_N=block_n, INTERPRETED=True)
    elif _AUTOTUNE:
        tuned[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](
            *args, **constexprs, INTERPRETED=False)
    else:
        config = _configs_for(kernel_name, constexprs, dtype)[0]
        kernel[grid_of(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"])](
            *args, **constexprs, **config.kwargs, INTERPRETED=False,
            num_warps=config.num_warps, num_stages=config.num_stages)
