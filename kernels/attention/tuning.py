"""Block sizes of the attention kernels, their autotuning, and the one launch helper.

Compiled, each launch takes a configuration from `_configs_for`'s short list (per kernel, padded
head dim, dtype class and feature weight) through `Tuner`, remat's own small tuner; under the
interpreter, a fixed 16 x 16 tile. The candidates set tiles, warps and stages only: the column
tiles (BLOCK_D, BLOCK_D2, and the forward's RoPE rotation halves BLOCK_H, BLOCK_H2,
launch.ROPE_SPLIT_HALVES) are the launch's. The backward kernels take no RoPE (q and k come
rotated), so their constexprs, keys and candidates have no RoPE field. The tuner's key holds the
kernel, the device, the dtype, the head dim and its column tiles (compiled variants of their
own), the feature flags (TF32 included), the dK/dV kernel's head split, the
query-group size, the window sides (unbounded, 0 = causal, or a bucketed extent) and the sequence lengths (N and
M, or the packed maxima) bucketed to the next power of two in [64, 65536], so a shape in another
bucket is tuned again instead of inheriting the first call's tiles. Candidates whose compiled kernel needs
more shared memory per block than the device grants (e.g. 99 KiB on sm_86/89/120) are dropped
before any launch.

On a miss the tuner times each remaining candidate with CUDA events on the real launch
arguments (one warm-up and `_TIMED_RUNS` timed runs each, the median kept), writing only the
outputs the launcher already allocated (the atomic dK/dV kernel's fp32 dq accumulator is zeroed
before each run and before the real launch). It allocates no buffer of its own: no L2 flush
buffer (triton.testing.do_bench allocates 256 MB), only CUDA events. Inside CUDA graph capture
it times nothing: a cached choice is used, else the first candidate that fits, uncached (a
later tuned choice outside capture may differ). REMAT_ATTENTION_AUTOTUNE=0 (read at import)
takes the first candidate that fits the device without timing, so every process on the same
device type picks the same tiles: the deterministic backward is then bitwise reproducible
across processes too, not only within one (another tile changes the summation order).
"""

import functools
import os
import statistics
from typing import NamedTuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from .._common import _INTERPRETED

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
# aot_specs. Head-dim classes: 64 (D 1-64), 128, 256, by the columns the kernels hold
# (BLOCK_D + BLOCK_D2: a split head dim of 80 or 96 is class 128, 192 class 256): the split
# tiles hold fewer columns than the class's, so its tiles fit them (not timed on a GPU yet); with
# RoPE the forward's q/k rotation halves hold 2 * (BLOCK_H + BLOCK_H2) columns, never more than the
# class (80, 96: 2 x 48 of 128; 192: 2 x 96 of 256). The shared-memory pruning needs no estimate of
# its own: it reads each candidate's compiled kernel (`_launch`), built with all the tile
# constexprs (BLOCK_H2 included). Stack
# bytes per thread (cuobjdump --dump-resource-usage, bf16, no alignment hints, split vs padded at
# the same default tile): sm_90, never more (fwd 0 vs 0-208, dq 0-144 vs 32-176, dkdv 0 vs 0)
# except the atomic dK/dV (24/48/96 vs 8/8/32 at 80/96/192); sm_80, less for fwd at 80/96 (0 vs
# 8), the atomic dK/dV (168/192/160 vs 208/208/192) and dq at 192 (248 vs 392), more for dq at
# 80/96 (200/312 vs 0), dK/dV at 80/96 (40/128 vs 0) and fwd at 192 (816 vs 352), with
# less shared memory for every backward kernel (23-41%): a few dozen bytes either way on sm_90, so the
# v-side split stays the default of every kernel (the autotuner's smaller candidates of the
# class may win on sm_80). With RoPE in the forward (bf16, RoPE + softcap + dropout, each
# config's warps and stages, no alignment hints), the split rotation halves (BLOCK_H2 > 0) vs the
# padded ones at the same tile (v side split in both): shared memory 19-35% less, stack bytes per
# thread about equal or less (d80 8 vs 0, d96 0-8 vs 8-24, d192 0 vs 56-64 at the default tiles).
# The padded halves stay the default (REMAT_ATTENTION_ROPE_SPLIT_HALVES=1 splits them, for timing
# on a GPU): when the backward kernels still rotated, the forward and backward had to hold the
# halves alike, and the split ones spilled 4-25x more in the backward. The atomic dq postprocess
# takes padded columns (launch._postprocess_block_d: at 64 rows and D = 192 the split ones
# spilled 168 vs 40 bytes, sm_90; within 32 bytes at 80/96).
# None of this is timed on a GPU.
# "heavy": in the forward RoPE (two more [tile, D/2] operands and the fp32 cos/sin tiles) or
# dropout, in the backward kernels dropout (a Philox call per four scores since the four-words
# stream; the measurements below predate it, when it was one call per score, and the backward
# kernels still took RoPE) is on.
# Measured with ptxas (cuobjdump --dump-resource-usage) on sm_80 and sm_90a builds compiled with
# the 16-byte divisibility an aligned launch gets (pointers, strides) and each config's
# num_stages, bf16, heavy measured with RoPE + softcap and with RoPE + softcap + dropout. The
# 16-bit defaults use 115-255 registers per thread, 28-168 KiB of shared memory (within sm_80's
# 163 KiB where it matters: every default fits both archs) and do not spill, except on sm_80:
# the atomic dK/dV kernel at D 256 (32 bytes per thread); heavy, the dK/dV kernels at D 64
# (64-160 bytes) and D 256 (24-120), the dQ kernel at D 64 with dropout (72); every candidate
# tried there spilled at least as much. The other entries are autotuning candidates, some fit
# only sm_90 (the tuner drops a config whose shared memory exceeds the device's, e.g. 99 KiB
# on sm_86/89/120, or that fails to launch). What costs registers: the
# dK/dV kernel keeps k, v and the fp32 dk, dv accumulators of its key block for the whole loop,
# so its tiles stay at 16-32 rows for D >= 128; the forward and dQ kernels keep a [BLOCK_M, D]
# fp32 accumulator. Measured and dropped: e.g. the dK/dV kernel at D 64 with a 64 x 64 tile, or
# at D 128 with 32 x 128, made ptxas fall back to 32 registers and 3-8 KiB of spills on sm_80.
# fp32 (IEEE products on the FMA units, operands held in registers): small tiles; the defaults
# do not spill except dK/dV at D 128 on sm_90 (16 bytes), but with RoPE or dropout they spill
# 16-550 bytes, and halving the tiles did not help (fp32 is the accuracy path, not a fast one).
# These fp32 figures predate the two-level sums of IEEE fp32 dots (kernels/_common.py `_dot`),
# which cost 12-36 more registers in the fp32 GEMM and attention kernels (ptxas, sm_90); the fp32
# dK/dV kernel at D 64 then spilled 812 bytes per thread instead of 676. Not re-measured per tile.
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
    own), head-dim class (the next power of two of the held columns BLOCK_D + BLOCK_D2, at least
    64; the forward's RoPE rotation halves, 2 * (BLOCK_H + BLOCK_H2) columns, never exceed it),
    dtype and whether RoPE (the forward's only: backward constexprs have no ROPE) or dropout is
    on. constexprs: the launch's, with the head dim's column parts (`launch._head_dim_parts`).
    The configurations set BLOCK_M, BLOCK_N (and warps, stages) only, never the column tiles: the
    rotation halves are the launch's (launch.ROPE_SPLIT_HALVES)."""
    if kernel_name == "dkdv" and constexprs.get("ATOMIC_DQ"):
        kernel_name = "dkdv_atomic"
    size = max(triton.next_power_of_2(constexprs["BLOCK_D"] + constexprs.get("BLOCK_D2", 0)), 64)
    kind = "fp32" if dtype == torch.float32 else "16bit"
    heavy = bool(constexprs.get("ROPE", False) or constexprs["DROPOUT"])
    return _CONFIGS[(kernel_name, size, kind, heavy)]


# Sequence-length buckets of the tuning key: the next power of two within these bounds.
_MIN_LENGTH_BUCKET = 64
_MAX_LENGTH_BUCKET = 1 << 16
# Timed runs per candidate on a tuning miss (after one warm-up run), the median kept.
_TIMED_RUNS = 5


def _length_bucket(length):
    """The tuning bucket of a sequence length or window extent: 0 for 0 (empty), else the next
    power of two clamped to [_MIN_LENGTH_BUCKET, _MAX_LENGTH_BUCKET]."""
    length = int(length)
    if length <= 0:
        return 0
    return min(max(triton.next_power_of_2(length), _MIN_LENGTH_BUCKET), _MAX_LENGTH_BUCKET)


def _window_class(extent):
    """-1 for an unbounded window side, 0 for a side of 0 (causal: right = 0), else the bucket
    of the extent."""
    extent = int(extent)
    return extent if extent <= 0 else _length_bucket(extent)


class LaunchShape(NamedTuple):
    """What a launch's best tile depends on besides the constexprs: the query and key lengths
    (packed launches: the maxima), the query-group size Hq / Hkv, the window sides as passed to
    the kernels (-1 = unbounded) and the device index of the operands (-1: not a CUDA device)."""

    n: int
    m: int
    group: int
    window_left: int
    window_right: int
    device_index: int


def tuning_key(kernel_name, dtype, constexprs, shape):
    """The tuner's cache key of a launch: kernel ("dkdv_atomic" for the fast mode's dK/dV),
    device, dtype, head dim and the launch's column tiles (the forward's BLOCK_H, BLOCK_H2: the
    rotation halves' layout, launch.ROPE_SPLIT_HALVES, is another compiled variant whose best tile
    may differ), feature flags (ROPE in the forward only), TF32 (another compiled variant), the
    dK/dV kernel's head split (another grid), group size, window classes, length buckets. Flags a
    kernel's constexprs lack (the backward's RoPE fields) are not in its key."""
    flags = tuple((name, constexprs[name]) for name in sorted(constexprs)
                  if name in ("HEAD_DIM", "BLOCK_D", "BLOCK_D2", "BLOCK_H", "BLOCK_H2", "ROPE", "SOFTCAP", "DROPOUT",
                              "VARLEN", "HEAD_SPLITS", "TF32"))
    return (kernel_name, shape.device_index, dtype, flags, shape.group,
            _window_class(shape.window_left), _window_class(shape.window_right),
            _length_bucket(shape.n), _length_bucket(shape.m))


def _capturing():
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@functools.cache
def _device_shared_memory(device_index):
    """Bytes of shared memory one block may opt into on the device: the limit Triton itself
    checks before a launch (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def _timing_event():
    return torch.cuda.Event(enable_timing=True)


def _time_with_events(run, reset, make_event=_timing_event):
    """Median milliseconds of `_TIMED_RUNS` runs of `run` on the current stream after one
    warm-up run, `reset` (or nothing) before each run and outside the timed span. make_event:
    a CUDA timing event factory (tests pass fakes)."""
    events = [(make_event(), make_event()) for _ in range(_TIMED_RUNS)]
    if reset is not None:
        reset()
    run()
    for start, end in events:
        if reset is not None:
            reset()
        start.record()
        run()
        end.record()
    events[-1][1].synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


class Tuner:
    """Process cache of tile choices per `tuning_key`, and the launch through it.

    autotune: time the candidates on a miss (False: take the first that fits, untimed).
    shared_memory_limit(device_index) -> bytes per block; capturing() -> whether the current
    stream is capturing a CUDA graph; time_candidate(run, reset) -> milliseconds. The defaults
    read the device; tests inject fakes. name: what the errors say ran out of tiles (the GEMM
    kernels share this class).
    """

    def __init__(self, autotune, shared_memory_limit=_device_shared_memory, capturing=_capturing,
                 time_candidate=_time_with_events, name="remat attention"):
        self.name = name
        self.autotune = autotune
        self.shared_memory_limit = shared_memory_limit
        self.capturing = capturing
        self.time_candidate = time_candidate
        self.choices = {}

    def _fitting(self, candidates, shared_memory_of, device_index, first_only):
        limit = self.shared_memory_limit(device_index)
        fitting = []
        for config in candidates:
            try:
                needed = shared_memory_of(config)
            except OutOfResources:
                continue
            if needed <= limit:
                fitting.append(config)
                if first_only:
                    break
        if not fitting:
            raise RuntimeError(
                f"{self.name}: no tile configuration fits the device's {limit} bytes of shared "
                f"memory per block (candidates {[str(config) for config in candidates]})")
        return fitting

    def launch(self, key, candidates, shared_memory_of, run, reset=None):
        """Launch `run(config)` once with the configuration chosen for `key`; returns it.

        candidates: triton.Config list in preference order; shared_memory_of(config) -> bytes
        per block of its compiled kernel (compiles it); reset: None, or a callable that restores
        the outputs a run accumulates into (called before every timed run and before the real
        launch when timing ran). A cached choice launches directly. A miss inside CUDA graph
        capture launches the first fitting candidate and caches nothing; a miss with autotune
        off caches the first fitting candidate; otherwise each fitting candidate is timed (one
        that fails to launch for lack of resources is dropped) and the fastest cached.
        """
        device_index = key[1]
        config = self.choices.get(key)
        if config is not None:
            run(config)
            return config
        if self.capturing() or not self.autotune:
            config = self._fitting(candidates, shared_memory_of, device_index, first_only=True)[0]
            if not self.autotune:
                self.choices[key] = config
            run(config)
            return config
        timings = []
        for candidate in self._fitting(candidates, shared_memory_of, device_index, first_only=False):
            try:
                milliseconds = self.time_candidate(functools.partial(run, candidate), reset)
            except OutOfResources:
                continue
            timings.append((milliseconds, candidate))
        if not timings:
            raise RuntimeError(f"{self.name}: no tile configuration of {[str(c) for c in candidates]} "
                               "could launch on this device")
        config = min(timings, key=lambda timing: timing[0])[1]
        self.choices[key] = config
        if reset is not None:
            reset()
        run(config)
        return config


# Under the interpreter nothing is compiled (no shared memory to check: 0 bytes of a 0 limit)
# and nothing timed (no CUDA events): the first candidate, as with REMAT_ATTENTION_AUTOTUNE=0.
_TUNER = Tuner(False, shared_memory_limit=lambda device_index: 0) if _INTERPRETED else Tuner(_AUTOTUNE)
# The interpreter's one candidate: no constexprs of its own (the tile is INTERPRETER_TILE, read at
# each launch so that tests may set it; warps and stages mean nothing there).
_INTERPRETER_CANDIDATES = (triton.Config({}),)


def _launch(kernel, kernel_name, grid_of, args, constexprs, dtype, shape, accumulator=None):
    """Launch kernel over grid_of(BLOCK_M, BLOCK_N) with the configuration `_TUNER` chooses among
    `_configs_for`'s list (under the interpreter: `_INTERPRETER_CANDIDATES` with the fixed
    INTERPRETER_TILE) and return that configuration; it sets the tile (and warps, stages), the
    column tiles are `constexprs`'. shape: the launch's LaunchShape; accumulator: None, or the
    tensor the kernel accumulates into (the fast mode's fp32 dq, zero on entry), zeroed again
    before each timed run and before the real launch after timing."""
    candidates = _configs_for(kernel_name, constexprs, dtype)
    if _INTERPRETED:
        block_m, block_n = INTERPRETER_TILE
        candidates = list(_INTERPRETER_CANDIDATES)

        def options(config):
            return dict(constexprs, **config.kwargs, BLOCK_M=block_m, BLOCK_N=block_n, INTERPRETED=True)

        def grid(config):
            return grid_of(block_m, block_n)

        def shared_memory_of(config):
            return 0
    else:
        def options(config):
            return dict(constexprs, **config.kwargs, INTERPRETED=False, num_warps=config.num_warps,
                        num_stages=config.num_stages)

        def grid(config):
            return grid_of(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"])

        def shared_memory_of(config):
            return kernel.warmup(*args, grid=grid(config), **options(config)).metadata.shared

    def run(config):
        kernel[grid(config)](*args, **options(config))

    name = "dkdv_atomic" if kernel_name == "dkdv" and constexprs.get("ATOMIC_DQ") else kernel_name
    return _TUNER.launch(tuning_key(name, dtype, constexprs, shape), candidates, shared_memory_of, run,
                         None if accumulator is None else accumulator.zero_)
