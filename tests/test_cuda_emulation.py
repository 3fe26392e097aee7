"""The CUDA flash-attention kernels (csrc/attention/attention_kernel.cuh) run on the CPU through the
emulation of tests/cuda_emulation (threads as fibers, barriers, shuffles, WMMA with scrambled
fragment layouts, deferred cp.async; see emu.h for what is and is not emulated), with the real
launch logic (csrc/attention/attention_launch.h). Forward and both backward modes are checked
against the float64 reference under the 2x-stock rule, over fp16/bf16, every head-dim bucket, odd
head dims, tails, causal with N < M and N > M (empty rows, lse = +inf), GQA/MQA, windows, softcap,
dropout (the reference applies the same Philox mask), rope with shared and per-batch tables,
non-contiguous inputs and the element-wise (non-16-byte) load paths. Every tensor the kernels see
sits between NaN guards: the outputs' guards must stay NaN and the inputs must stay bitwise
unchanged. Each launch runs in a forked child, writing its outputs to shared memory, so that a
kernel that crashes or hangs fails its test instead of the test run.

The emulator is built with g++ against the CUDA headers of the toolkit the extension was built with
(remat._build_info.CUDA_ROOT), once per content of its sources, under build/cuda_emulation/."""

import ctypes
import faulthandler
import hashlib
import math
import mmap
import os
import select
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from remat.checks import window_bounds
from remat.reference import attention_dropout_keep

from _checks import assert_within_2x_of_stock
from helpers import attention_eager, case, make_inputs

ROOT = Path(__file__).resolve().parents[1]
EMU_DIR = ROOT / "tests" / "cuda_emulation"
BUILD_DIR = ROOT / "build" / "cuda_emulation"
# UBSan's alignment check stands in for the GPU's fault on a misaligned vector access (float4,
# uint4), its bounds check catches indexing past a fragment or register array.
CXX_FLAGS = ["-std=c++20", "-O2", "-fPIC", "-shared", "-fsanitize=alignment,bounds", "-fno-sanitize-recover=all"]
KIND = {torch.float16: 1, torch.bfloat16: 2}  # remat::ScalarKind
CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_LAUNCH_FAILURE = 0, 1, 719
GUARD = 64  # NaN elements before and after every tensor the kernels see
LAUNCH_TIMEOUT_S = 120


def _cuda_root():
    try:
        from remat import _build_info
    except ImportError:
        return None
    root = getattr(_build_info, "CUDA_ROOT", None)
    return root if root and (Path(root) / "include" / "cuda_runtime.h").is_file() else None


def _sources():
    """Every file the emulator's translation unit may include from the repository."""
    files = sorted(EMU_DIR.glob("*.h")) + sorted(EMU_DIR.glob("*.cpp"))
    for folder in ("attention", "common"):
        files += sorted(p for p in (ROOT / "csrc" / folder).iterdir() if p.suffix in (".h", ".cuh"))
    return files


def _build(cxx, cuda_root):
    """The emulator library, compiled unless this content was compiled before."""
    command = [cxx, *CXX_FLAGS, f"-I{ROOT / 'csrc'}", f"-I{EMU_DIR}", f"-I{Path(cuda_root) / 'include'}",
               str(EMU_DIR / "emu_attention.cpp")]
    digest = hashlib.sha256(" ".join(command).encode())
    for path in _sources():
        digest.update(path.name.encode() + path.read_bytes())
    library = BUILD_DIR / f"libemu_attention-{digest.hexdigest()[:16]}.so"
    if not library.exists():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True)
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            pytest.fail(f"building the CUDA emulator failed:\n{' '.join(command)}\n{result.stderr[-8000:]}")
        os.replace(partial, library)
        for stale in BUILD_DIR.glob("libemu_attention-*.so"):
            if stale != library:
                stale.unlink(missing_ok=True)
    return library


class FwdParams(ctypes.Structure):
    """remat::AttentionFwdParams (csrc/attention/attention.h)."""

    _fields_ = ([(name, ctypes.c_void_p) for name in ("q", "k", "v", "o", "lse", "cos", "sin", "rng")]
                + [(name, ctypes.c_int64) for name in (
                    "batch", "n", "m", "hq", "hkv", "head_dim",
                    "q_batch_stride", "q_row_stride", "q_head_stride", "k_batch_stride", "k_row_stride",
                    "k_head_stride", "v_batch_stride", "v_row_stride", "v_head_stride", "rope_batch_stride",
                    "window_left", "window_right")]
                + [(name, ctypes.c_float) for name in ("scale", "softcap", "dropout_p")]
                + [(name, ctypes.c_void_p) for name in ("cu_seqlens_q", "cu_seqlens_k")]
                + [(name, ctypes.c_int64) for name in ("total_q", "rope_token_stride")])


class BwdParams(ctypes.Structure):
    """remat::AttentionBwdParams (csrc/attention/attention.h)."""

    _fields_ = ([(name, ctypes.c_void_p) for name in (
                    "dout", "q", "k", "v", "o", "lse", "cos", "sin", "rng", "dq", "dk", "dv", "delta",
                    "dq_accum")]
                + [(name, ctypes.c_int64) for name in (
                    "batch", "n", "m", "hq", "hkv", "head_dim",
                    "dout_batch_stride", "dout_row_stride", "dout_head_stride", "q_batch_stride",
                    "q_row_stride", "q_head_stride", "k_batch_stride", "k_row_stride", "k_head_stride",
                    "v_batch_stride", "v_row_stride", "v_head_stride", "o_batch_stride", "o_row_stride",
                    "o_head_stride", "rope_batch_stride", "window_left", "window_right")]
                + [(name, ctypes.c_float) for name in ("scale", "softcap", "dropout_p")]
                + [("deterministic", ctypes.c_bool)]
                + [(name, ctypes.c_void_p) for name in ("cu_seqlens_q", "cu_seqlens_k")]
                + [(name, ctypes.c_int64) for name in ("total_q", "rope_token_stride")])


@pytest.fixture(scope="module")
def emu():
    cuda_root = _cuda_root()
    if cuda_root is None:
        pytest.skip("no CUDA toolkit headers (remat._build_info.CUDA_ROOT is unset: built without CUDA)")
    cxx = shutil.which("g++")
    if cxx is None or not sys.platform.startswith("linux"):
        pytest.skip("the CUDA emulation needs g++ on Linux")
    lib = ctypes.CDLL(str(_build(cxx, cuda_root)))
    for name in ("emu_attention_fwd", "emu_attention_bwd"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int
    lib.emu_last_error.restype = ctypes.c_char_p
    for name in ("fwd", "bwd"):
        for what in ("size", "scale_offset"):
            getattr(lib, f"emu_{name}_params_{what}").restype = ctypes.c_size_t
    assert lib.emu_fwd_params_size() == ctypes.sizeof(FwdParams)
    assert lib.emu_fwd_params_scale_offset() == FwdParams.scale.offset
    assert lib.emu_bwd_params_size() == ctypes.sizeof(BwdParams)
    assert lib.emu_bwd_params_scale_offset() == BwdParams.scale.offset
    return lib


class Guarded:
    """A tensor with the given shape and strides inside a NaN-filled buffer, GUARD elements from
    either end (plus ``misalign`` at the start). The buffer is shared memory: a forked launch
    writes into it."""

    def __init__(self, shape, strides, dtype, misalign=0):
        span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
        self.start = GUARD + misalign
        self.end = self.start + span
        count = self.end + GUARD
        self.memory = mmap.mmap(-1, count * torch.empty(0, dtype=dtype).element_size())
        self.buffer = torch.frombuffer(self.memory, dtype=dtype, count=count).fill_(float("nan"))
        self.tensor = self.buffer.as_strided(shape, strides, self.start)

    @classmethod
    def copy_of(cls, t, misalign=0):
        """A copy of t with its strides and its storage offset (so its alignment) kept."""
        guarded = cls(t.shape, t.stride(), t.dtype, misalign + t.storage_offset())
        guarded.tensor.copy_(t)
        return guarded

    @classmethod
    def empty(cls, shape, dtype, misalign=0):
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        return cls(shape, strides, dtype, misalign)

    def ptr(self):
        return self.tensor.data_ptr()

    def guards_intact(self):
        return bool(self.buffer[:self.start].isnan().all() and self.buffer[self.end:].isnan().all())

    def bits(self):
        return self.buffer.view(torch.int16 if self.buffer.element_size() == 2 else torch.int32).clone()


def _launch(lib, entry, params, kind, what):
    """Calls the emulator's ``entry`` in a forked child: (cudaError_t value, error message). Fails
    the test if the child crashes (UBSan reports go to the test's captured stderr) or hangs."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process
        pid = os.fork()
    if pid == 0:
        status = 1
        try:
            faulthandler.disable()
            os.close(read_end)
            rc = getattr(lib, entry)(ctypes.byref(params), kind)
            message = lib.emu_last_error().decode() if rc == CUDA_ERROR_LAUNCH_FAILURE else ""
            os.write(write_end, f"{rc} {message}".encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], LAUNCH_TIMEOUT_S)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        with os.fdopen(read_end, "rb", closefd=False) as pipe:
            report = pipe.read().decode() if ready else ""
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    if not ready:
        pytest.fail(f"{what}: no result after {LAUNCH_TIMEOUT_S} s (killed)")
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        how = signal.Signals(-code).name if code < 0 else f"exit status {code}"
        pytest.fail(f"{what}: the emulated kernels crashed ({how}; see the captured stderr)")
    rc, _, message = report.partition(" ")
    return int(rc), message


def _check_launch(lib, entry, params, kind, what):
    rc, message = _launch(lib, entry, params, kind, what)
    assert rc == CUDA_SUCCESS, f"{what}: cudaError {rc} {message}"


def visible_keys(n, m, spec):
    """Bool [N, M]: the keys each query sees under the spec's causal mask and window (query i at
    key position i + M - N)."""
    left, right = window_bounds(spec.get("window"), spec.get("causal", False))
    position = torch.arange(n)[:, None] + (m - n)
    key = torch.arange(m)[None, :]
    visible = torch.ones(n, m, dtype=torch.bool)
    if left >= 0:
        visible &= key >= position - left
    if right >= 0:
        visible &= key <= position + right
    return visible


def _lse_reference(q, k, rope, spec, dtype):
    """logsumexp over the visible keys of each query row ([B, Hq, N]; +inf where none), with the
    logits computed in ``dtype`` (float64: the reference; the low-precision dtype: stock)."""
    b, n, hq, d = q.shape
    m, hkv = k.shape[1], k.shape[2]
    q, k = q.to(dtype), k.to(dtype)
    if rope is not None:
        cos, sin = (t.to(dtype) for t in rope)
        cos, sin = (t if t.dim() == 3 else t[None] for t in (cos, sin))

        def rotate(x, first):
            c = cos[:, first:first + x.shape[1], None, :]
            s = sin[:, first:first + x.shape[1], None, :]
            x1, x2 = x[..., :d // 2], x[..., d // 2:]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

        q, k = rotate(q, m - n), rotate(k, 0)
    logits = q.transpose(1, 2) @ k.transpose(1, 2).repeat_interleave(hq // hkv, dim=1).transpose(-1, -2)
    logits = logits * d**-0.5
    if spec.get("softcap"):
        logits = spec["softcap"] * torch.tanh(logits / spec["softcap"])
    visible = visible_keys(n, m, spec)
    lse = torch.logsumexp(logits.masked_fill(~visible, float("-inf")).to(torch.float64), dim=-1)
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


# Shapes and options. scalar=True misaligns every input, the rope tables and o by one element,
# which turns off every 16-byte path (D % 8 != 0 and the sliced layouts do so for some operands).
CASES = [
    case("f16-d64-n17-tails", 2, 17, 17, 2, 2, 64),
    case("bf16-d128-n37-m100-gqa-causal", 1, 37, 100, 4, 2, 128, dtype=torch.bfloat16, causal=True),
    case("f16-d13-n9-m3-mqa-causal-emptyrows", 2, 9, 3, 3, 1, 13, causal=True),
    case("bf16-d80-n70-m20-window-emptyrows-dropout", 1, 70, 20, 2, 1, 80, dtype=torch.bfloat16, window=(10, 0),
         dropout=0.15),
    case("f16-d40-rope-shared-window", 1, 70, 70, 2, 1, 40, rope="shared", window=(16, 3)),
    case("f16-d96-n40-m72-rope-batch-dropout-causal-gqa", 2, 40, 72, 2, 1, 96, rope="per_batch", dropout=0.2,
         causal=True),
    case("bf16-d256-n33-m45-softcap-dropout", 1, 33, 45, 2, 2, 256, dtype=torch.bfloat16, softcap=5.0, dropout=0.3),
    case("f16-d192-softcap-window", 2, 40, 40, 1, 1, 192, softcap=20.0, window=(9, 2)),
    case("bf16-d200-rope-window-right", 1, 34, 34, 1, 1, 200, dtype=torch.bfloat16, rope="shared", window=(5, 7)),
    case("bf16-d32-n130-window-left", 1, 130, 130, 1, 1, 32, dtype=torch.bfloat16, window=(20, None)),
    case("f16-d64-n130-gqa4-causal-dropout", 1, 130, 130, 4, 1, 64, causal=True, dropout=0.1),
    # The window's first key (q0 - 21) is not a multiple of 4: the forward and dq key loops start at
    # a Philox group (Geometry::key_range rounds down) and mask the keys in front.
    case("f16-d64-n130-window-misaligned-dropout", 1, 130, 130, 2, 1, 64, window=(21, 2), dropout=0.2),
    case("bf16-d128-n100-m257-rope-batch-causal-dropout-gqa", 1, 100, 257, 2, 1, 128, dtype=torch.bfloat16,
         rope="per_batch", causal=True, dropout=0.1),
    case("bf16-d128-diagonal-only", 1, 70, 70, 2, 2, 128, dtype=torch.bfloat16, window=(0, 0)),
    case("f16-d16-m1", 3, 9, 1, 2, 2, 16),
    case("bf16-bhnd-d64-n33-m65-causal", 2, 33, 65, 2, 2, 64, dtype=torch.bfloat16, causal=True, layout="bhnd"),
    case("f16-slices-d72-n33-m17", 1, 33, 17, 2, 1, 72, noncontiguous=True),
    case("f16-scalar-d128-rope-batch-softcap", 2, 20, 40, 2, 2, 128, scalar=True, rope="per_batch", softcap=8.0),
    case("bf16-scalar-d64-causal-gqa", 1, 33, 65, 4, 2, 64, dtype=torch.bfloat16, scalar=True, causal=True),
]


def _inputs(spec):
    dtype = spec.get("dtype", torch.float16)
    q, k, v, dout, rope = make_inputs(spec, dtype)
    if spec.get("layout") == "bhnd":
        q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))
    return dtype, q, k, v, dout, rope


@pytest.mark.parametrize("spec", CASES)
def test_emulated_cuda_attention_matches_reference(emu, spec):
    dtype, q, k, v, dout, rope = _inputs(spec)
    b, n, hq, d = q.shape
    m, hkv = k.shape[1], k.shape[2]
    misalign = 1 if spec.get("scalar") else 0
    inputs = {name: Guarded.copy_of(t, misalign) for name, t in zip(("q", "k", "v", "dout"), (q, k, v, dout))}
    cos = sin = None
    rope_batch_stride = 0
    if rope is not None:
        tables = [t if t.dim() == 3 else t[None] for t in rope]
        cos, sin = (Guarded.copy_of(t.contiguous(), misalign) for t in tables)
        rope_batch_stride = 0 if tables[0].shape[0] == 1 else tables[0].shape[1] * tables[0].shape[2]
        inputs.update(cos=cos, sin=sin)
    dropout = spec.get("dropout", 0.0)
    rng = torch.tensor([0x123456789ABC, 2**33 + 7], dtype=torch.int64)
    left, right = window_bounds(spec.get("window"), spec.get("causal", False))
    softcap = float(spec.get("softcap") or 0.0)
    before = {name: g.bits() for name, g in inputs.items()}

    o = Guarded.empty((b, n, hq, d), dtype, misalign)
    lse = Guarded.empty((b, hq, n), torch.float32)
    fwd = FwdParams(q=inputs["q"].ptr(), k=inputs["k"].ptr(), v=inputs["v"].ptr(), o=o.ptr(), lse=lse.ptr(),
                    cos=cos.ptr() if cos else None, sin=sin.ptr() if sin else None,
                    rng=rng.data_ptr() if dropout else None, batch=b, n=n, m=m, hq=hq, hkv=hkv, head_dim=d,
                    rope_batch_stride=rope_batch_stride, window_left=left, window_right=right, scale=d**-0.5,
                    softcap=softcap, dropout_p=dropout)
    for name in ("q", "k", "v"):
        for dim, stride in zip(("batch", "row", "head"), inputs[name].tensor.stride()[:3]):
            setattr(fwd, f"{name}_{dim}_stride", stride)
    _check_launch(emu, "emu_attention_fwd", fwd, KIND[dtype], "forward")

    keep = attention_dropout_keep(rng[0], rng[1], (b, hq, n, m), dropout) if dropout else None
    reference = attention_eager(q, k, v, dout, rope, spec, keep, torch.float64)
    stock = attention_eager(q, k, v, dout, rope, spec, keep, dtype)
    assert_within_2x_of_stock("o", o.tensor, stock[0], reference[0], dtype)
    lse_reference = _lse_reference(q, k, rope, spec, torch.float64)
    lse_stock = _lse_reference(q, k, rope, spec, dtype)
    finite = torch.isfinite(lse_reference)
    assert torch.equal(torch.isinf(lse.tensor), ~finite), "lse must be +inf exactly for the rows that see no key"
    assert (lse.tensor[~finite] > 0).all()
    assert_within_2x_of_stock("lse", lse.tensor[finite], lse_stock[finite], lse_reference[finite], dtype)

    for deterministic in (True, False):
        dq = Guarded.empty((b, n, hq, d), dtype)
        dk, dv = (Guarded.empty((b, m, hkv, d), dtype) for _ in range(2))
        delta = Guarded.empty((b, hq, n), torch.float32)
        dq_accum = None if deterministic else Guarded.empty((b, n, hq, d), torch.float32)
        if dq_accum is not None:
            dq_accum.tensor.zero_()
        bwd = BwdParams(dout=inputs["dout"].ptr(), q=inputs["q"].ptr(), k=inputs["k"].ptr(), v=inputs["v"].ptr(),
                        o=o.ptr(), lse=lse.ptr(), cos=fwd.cos, sin=fwd.sin, rng=fwd.rng, dq=dq.ptr(), dk=dk.ptr(),
                        dv=dv.ptr(), delta=delta.ptr(), dq_accum=dq_accum.ptr() if dq_accum else None, batch=b,
                        n=n, m=m, hq=hq, hkv=hkv, head_dim=d, rope_batch_stride=rope_batch_stride,
                        window_left=left, window_right=right, scale=d**-0.5, softcap=softcap, dropout_p=dropout,
                        deterministic=deterministic)
        for name, t in (("dout", inputs["dout"].tensor), ("q", inputs["q"].tensor), ("k", inputs["k"].tensor),
                        ("v", inputs["v"].tensor), ("o", o.tensor)):
            for dim, stride in zip(("batch", "row", "head"), t.stride()[:3]):
                setattr(bwd, f"{name}_{dim}_stride", stride)
        mode = "deterministic" if deterministic else "atomic"
        _check_launch(emu, "emu_attention_bwd", bwd, KIND[dtype], f"{mode} backward")
        for name, got, want, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), stock[1:], reference[1:]):
            assert_within_2x_of_stock(f"{name} ({mode})", got.tensor, want, ref, dtype)
        expected_delta = (dout.double() * o.tensor.double()).sum(-1).transpose(1, 2)
        torch.testing.assert_close(delta.tensor.double(), expected_delta, rtol=1e-4, atol=1e-3)
        for name, guarded in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv), ("delta", delta),
                              ("dq_accum", dq_accum)):
            assert guarded is None or guarded.guards_intact(), f"{name}: written outside its bounds ({mode})"
    for name, guarded in inputs.items():
        assert torch.equal(guarded.bits(), before[name]), f"input {name} was modified"


def test_emulated_launch_rejects_what_the_kernels_do_not_take(emu):
    """The shared launch checks: fp32, head dim above 256, Hq not a multiple of Hkv."""
    q = Guarded.empty((1, 4, 3, 264), torch.float16)
    o = Guarded.empty((1, 4, 3, 264), torch.float16)
    lse = Guarded.empty((1, 3, 4), torch.float32)
    strides = dict(zip(("batch", "row", "head"), q.tensor.stride()[:3]))
    for kind, hkv, d in ((0, 1, 64), (1, 1, 264), (1, 2, 64)):
        fwd = FwdParams(q=q.ptr(), k=q.ptr(), v=q.ptr(), o=o.ptr(), lse=lse.ptr(), batch=1, n=4, m=4, hq=3, hkv=hkv,
                        head_dim=d, window_left=-1, window_right=-1, scale=0.125)
        for name in ("q", "k", "v"):
            for dim, stride in strides.items():
                setattr(fwd, f"{name}_{dim}_stride", stride)
        assert _launch(emu, "emu_attention_fwd", fwd, kind, "forward")[0] == CUDA_ERROR_INVALID_VALUE
    assert o.buffer.isnan().all() and lse.buffer.isnan().all()
