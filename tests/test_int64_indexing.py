"""64-bit indexing (issue 27): every kernel that indexes q/k/v/o or [tokens, hidden] tensors computes
element offsets in 64 bits, since long-context tensors pass 2^31 elements ([1M, 4096] bf16 holds
4.3e9; q [1, 1M, 32, 128] too).

C++ CPU kernels, run with indexes past 2^31 elements:
- by default, on strided inputs: views of a lazily mapped buffer (an anonymous private mmap: a
  page takes memory only once touched) whose batch, row or head strides put rows past elements
  2^31 and 2^32; the kernels read those rows while the process touches a few pages (checked), and
  their results must equal the same op on contiguous copies, bitwise. (The outputs are new
  contiguous tensors, small here: offsets past 2^31 into outputs are the opt-in tests'.)
- opt-in (REMAT_BIGMEM=1; up to 9 GiB each, run alone, not under two workers): contiguous bf16
  tensors of more than 2^31 elements (byte offsets past 2^32) through RMSNorm forward and backward,
  the MLP activations, rope, dropout and the cross-entropy epilogues (one [tokens, vocab] chunk of
  logits); rows and slices at the start, across element 2^31 and at the end must equal the op run
  on those rows or slices alone, bitwise (the kernels compute each row, each 1024-element
  activation tile, each token and each dropout group on its own).

CUDA and Triton sources (no GPU here), static rules, each shown to fail on the code it forbids
(mutations of the current sources, and the Triton rope kernel as it was before commit 0c73aaf):
- Triton (every @triton.jit function under kernels/ and python/remat): an abstract interpretation
  of int32 / int64 through each function and its callers; a product computed in int32 of an int32
  value (a program id, tl.arange, an integer kernel argument, which the JIT passes as int32 below
  2^31, a loop counter, an int32 load) with another int32 value or a constant is an error unless
  listed in BOUNDED with the launcher bound that keeps it below 2^31 (row and key indexes, tile
  counts, row widths); offsets into [tokens, hidden] or q/k/v/o tensors must be widened first.
- CUDA and C++ (csrc): a product of blockIdx / gridDim needs a 64-bit factor; no 32-bit variable
  is initialised from blockIdx / gridDim or a tensor's numel / size / stride; no 32-bit loop
  counter runs to a 64-bit extent.
The Triton attention launchers' refusals of grids past 65535 (batch, heads, packed sequences) and of
N, M >= 2^28, which BOUNDED relies on, are checked too.
"""

import ast
import gc
import mmap
import os
import re
import time
from pathlib import Path

import pytest
import torch

from remat import _extension

ROOT = Path(__file__).resolve().parents[1]
BIGMEM = os.environ.get("REMAT_BIGMEM") == "1"

needs_extension = pytest.mark.skipif(not _extension.LOADED, reason="the C++ extension is not built")
bigmem = pytest.mark.skipif(
    not BIGMEM,
    reason="allocates 5-9 GiB (contiguous bf16 tensors past 2^31 elements): opt in with REMAT_BIGMEM=1 "
           "and run it alone, e.g. REMAT_BIGMEM=1 pytest -p no:xdist tests/test_int64_indexing.py -k bigmem")

# A stride in elements that puts row 1 past element 2^31 and row 2 past element 2^32 (byte offsets
# past 2^32 and 2^33 in bf16).
PAST_2_31 = 2**31 + 64


# ---------------------------------------------------------------------------------------------
# C++ CPU kernels on strided views of a lazily mapped buffer.


def _lazy_buffer(numel, dtype=torch.bfloat16):
    """A 1-D tensor of `numel` elements over an anonymous private mapping: address space only, each
    page backed by memory when first touched (not torch.empty, which the suite fills with NaN)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError, ValueError) as error:
        pytest.skip(f"cannot map {nbytes} bytes of address space: {error}")
    return torch.frombuffer(mapping, dtype=dtype)  # keeps the mapping alive


def _resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _StaysSmall:
    """Asserts that the process's resident memory grew by less than `limit` bytes inside the block:
    the test touched a few pages of its multi-GiB mappings, not the mappings."""

    def __init__(self, limit=256 * 2**20):
        self.limit = limit

    def __enter__(self):
        self.before = _resident_bytes() if os.path.exists("/proc/self/statm") else None
        return self

    def __exit__(self, *exc):
        if self.before is not None and exc[0] is None:
            grown = _resident_bytes() - self.before
            assert grown < self.limit, f"resident memory grew by {grown / 2**20:.0f} MiB"


def _fill(view, generator):
    view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
    return view


def _equal(a, b):
    return a.shape == b.shape and torch.equal(a, b)


@needs_extension
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "layer"])
def test_cpp_norms_read_rows_past_2_31_elements(is_rms):
    """x, residual, dy, dh and h rows at element offsets 0, 2^31 + 64 and 2^32 + 128 (row stride
    PAST_2_31): forward and backward equal the op on contiguous copies bitwise."""
    ops = torch.ops.remat
    rows, cols = 3, 256
    g = torch.Generator().manual_seed(0)
    with _StaysSmall():
        base = _lazy_buffer(PAST_2_31 * (rows - 1) + 4 * cols)

        def view(k):
            return _fill(base.as_strided((rows, cols), (PAST_2_31, 1), k * cols), g)

        x, residual, dy, dh = view(0), view(1), view(2), view(3)
        weight = torch.randn(cols, generator=g).to(torch.bfloat16)
        bias = torch.randn(cols, generator=g).to(torch.bfloat16)
        assert x.stride(0) * (rows - 1) > 2**32
        contiguous = [t.contiguous() for t in (x, residual, dy, dh)]
        if is_rms:
            strided = ops.rms_norm_fwd(x, weight, residual, 1e-6)
            reference = ops.rms_norm_fwd(contiguous[0], weight, contiguous[1], 1e-6)
            # The saved input is x itself without a residual: h strided too.
            grads = ops.rms_norm_bwd(dy, dh, x, weight, strided[2])
            grads_ref = ops.rms_norm_bwd(contiguous[2], contiguous[3], contiguous[0], weight, reference[2])
        else:
            strided = ops.layer_norm_fwd(x, weight, bias, residual, 1e-5)
            reference = ops.layer_norm_fwd(contiguous[0], weight, bias, contiguous[1], 1e-5)
            _, _, mean, rstd = ops.layer_norm_fwd(x, weight, bias, None, 1e-5)
            grads = ops.layer_norm_bwd(dy, dh, x, weight, mean, rstd, True)
            grads_ref = ops.layer_norm_bwd(contiguous[2], contiguous[3], contiguous[0], weight, mean, rstd, True)
        for got, want in zip(strided + grads, reference + grads_ref):
            assert _equal(got, want)
        assert torch.isfinite(strided[0].float()).all()


@needs_extension
@pytest.mark.parametrize("layout", ["batch-and-heads", "tokens"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_cpp_rope_reads_tokens_past_2_31_elements(layout, inverse):
    """rope_rotate on x [B, L, H, D] whose batch stride (with heads apart: the per-head widening) or
    token stride (heads adjacent: one widening per token) puts tokens past elements 2^31 and 2^32:
    equal to the rotation of a contiguous copy, bitwise."""
    head_dim = 64
    g = torch.Generator().manual_seed(1)
    if layout == "batch-and-heads":
        shape, strides = (3, 2, 2, head_dim), (PAST_2_31, head_dim, 2**29, 1)
    else:
        shape, strides = (1, 3, 2, head_dim), (3 * PAST_2_31, PAST_2_31, head_dim, 1)
    numel = sum((size - 1) * stride for size, stride in zip(shape, strides)) + 1
    with _StaysSmall():
        x = _fill(_lazy_buffer(numel).as_strided(shape, strides), g)
        assert max(x.stride()) * 2 > 2**32
        cos = torch.randn(8, head_dim // 2, generator=g)
        sin = torch.randn(8, head_dim // 2, generator=g)
        got = torch.ops.remat.rope_rotate(x, cos, sin, None, 3, 0, inverse)
        want = torch.ops.remat.rope_rotate(x.contiguous(), cos, sin, None, 3, 0, inverse)
        assert _equal(got, want)


@needs_extension
def test_cpp_attention_reads_batches_past_2_31_elements():
    """q, k, v, dout and o of batch entries 1 and 2 at element offsets past 2^31 and 2^32 (batch
    stride PAST_2_31), with rope, a causal mask and dropout: the C++ flash forward and backward
    equal the same calls on contiguous copies, bitwise."""
    ops = torch.ops.remat
    batch, n, m, hq, hkv, d = 3, 5, 7, 2, 1, 16
    g = torch.Generator().manual_seed(2)
    with _StaysSmall():
        base = _lazy_buffer((batch - 1) * PAST_2_31 + 3 * n * hq * d + 2 * m * hkv * d)
        offsets = iter((0, n * hq * d, n * hq * d + m * hkv * d, n * hq * d + 2 * m * hkv * d,
                        2 * n * hq * d + 2 * m * hkv * d))

        def view(length, heads):
            return base.as_strided((batch, length, heads, d), (PAST_2_31, heads * d, d, 1), next(offsets))

        q, k, v, dout = (_fill(view(n, hq), g), _fill(view(m, hkv), g), _fill(view(m, hkv), g),
                         _fill(view(n, hq), g))
        o_view = view(n, hq)
        cos = torch.randn(1, m, d // 2, generator=g)
        sin = torch.randn(1, m, d // 2, generator=g)
        rng = torch.tensor([1234, 2**40 + 5], dtype=torch.int64)
        options = (cos, sin, rng, d**-0.5, 0.0, -1, 0, 0.25)
        o, lse = ops.attention_fwd(q, k, v, *options)
        o_ref, lse_ref = ops.attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), *options)
        assert _equal(o, o_ref) and _equal(lse, lse_ref)
        o_view.copy_(o)
        grads = ops.attention_bwd(dout, q, k, v, o_view, lse, *options, True)
        grads_ref = ops.attention_bwd(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o_ref,
                                      lse_ref, *options, True)
        for got, want in zip(grads, grads_ref):
            assert _equal(got, want)


# ---------------------------------------------------------------------------------------------
# C++ CPU kernels on contiguous tensors past 2^31 elements (opt-in).


def _big_bf16(shape, seed):
    """A bf16 tensor of random values in [0.5, 2), drawn as bit patterns (one pass, no fp32
    temporary): 256 values per element, so rows differ and a wrong row is seen."""
    x = torch.empty(shape, dtype=torch.bfloat16)
    x.view(torch.int16).random_(0x3F00, 0x4000, generator=torch.Generator().manual_seed(seed))
    return x


def _windows_around(limit, boundary, width):
    """Starts (multiples of `width`) of the `width`-element windows of [0, limit) at its beginning,
    on both sides of `boundary` and at its end (the last window is the partial one, if any)."""
    below = boundary // width * width - width
    last = (limit - 1) // width * width
    return sorted({0, width, below, below + width, below + 2 * width, last - width, last})


@needs_extension
@bigmem
def test_bigmem_rms_norm_past_2_31_elements():
    """RMSNorm forward and backward over [2^19 + 1024, 4096] bf16 (2^31 + 4M elements; x 4 GiB, y or
    dx 4 GiB): rows 0, 1, 2^19 - 1 (the last before element 2^31), 2^19, 2^19 + 1 and the last equal
    the op on that row alone, bitwise; dw, to which the rows past element 2^31 give 11% (their
    values are scaled by 64, exactly), matches a float64 sum over all rows."""
    ops = torch.ops.remat
    cols = 4096
    rows = 2**19 + 1024
    start = time.time()
    x = _big_bf16((rows, cols), seed=3)
    x[2**19:] *= 64
    assert x.numel() > 2**31 and x[2**19].data_ptr() - x.data_ptr() >= 2**32
    weight = torch.randn(cols, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    checked = [0, 1, 2**19 - 1, 2**19, 2**19 + 1, rows - 1]
    y, _, rstd = ops.rms_norm_fwd(x, weight, None, 1e-6)
    for r in checked:
        y_row, _, rstd_row = ops.rms_norm_fwd(x[r:r + 1].clone(), weight, None, 1e-6)
        assert torch.equal(y[r:r + 1], y_row), f"y row {r}"
        assert torch.equal(rstd[r:r + 1], rstd_row), f"rstd row {r}"
    del y
    gc.collect()
    # dy = h = x (one tensor read twice), so dw[c] = sum_r x[r, c]^2 rstd[r].
    dx, dw = ops.rms_norm_bwd(x, None, x, weight, rstd)
    for r in checked:
        dx_row, _ = ops.rms_norm_bwd(x[r:r + 1].clone(), None, x[r:r + 1].clone(), weight, rstd[r:r + 1].clone())
        assert torch.equal(dx[r:r + 1], dx_row), f"dx row {r}"
    del dx
    gc.collect()
    expected = torch.zeros(cols, dtype=torch.float64)
    for r0 in range(0, rows, 8192):
        block = x[r0:r0 + 8192].float()
        expected += (block * block * rstd[r0:r0 + 8192, None]).sum(0).double()
    torch.testing.assert_close(dw.double(), expected, rtol=1e-2, atol=0.0)
    print(f"rms_norm past 2^31 elements: {time.time() - start:.1f} s")


@needs_extension
@bigmem
def test_bigmem_activations_past_2_31_elements():
    """glu_fwd (silu, gate = up) and act_bwd (gelu_tanh) over 2^31 + 2^20 + 100 bf16 elements (4 GiB
    in, 4 GiB out): 1024-element tiles (the kernels' fixed tiles) at the start, around element 2^31
    and the partial last tile equal the op on that slice alone, bitwise."""
    ops = torch.ops.remat
    numel = 2**31 + 2**20 + 100
    start = time.time()
    x = _big_bf16((numel,), seed=5)
    windows = _windows_around(numel, 2**31, 1024)
    h = ops.glu_fwd(x, x, "silu")
    for s in windows:
        piece = x[s:s + 1024].clone()
        assert torch.equal(h[s:s + 1024], ops.glu_fwd(piece, piece, "silu")), f"h at {s}"
    del h
    gc.collect()
    dpre, _ = ops.act_bwd(x, x, "gelu_tanh", False)
    for s in windows:
        piece = x[s:s + 1024].clone()
        assert torch.equal(dpre[s:s + 1024], ops.act_bwd(piece, piece, "gelu_tanh", False)[0]), f"dpre at {s}"
    print(f"activations past 2^31 elements: {time.time() - start:.1f} s")


@needs_extension
@bigmem
def test_bigmem_rope_past_2_31_elements():
    """rope_rotate over q [1, 2^19 + 64, 32, 128] bf16 (2^31 + 256K elements; 4 GiB in, 4 GiB out):
    tokens at the start, around element 2^31 (token 2^19) and at the end equal the rotation of those
    tokens alone (their table rows through first_position), bitwise, forward and inverse."""
    heads, head_dim = 32, 128
    length = 2**19 + 64
    start = time.time()
    x = _big_bf16((1, length, heads, head_dim), seed=6)
    g = torch.Generator().manual_seed(7)
    cos = torch.randn(length, head_dim // 2, generator=g)
    sin = torch.randn(length, head_dim // 2, generator=g)
    tokens = [0, 1, 2**19 - 1, 2**19, 2**19 + 1, length - 1]
    for inverse in (False, True):
        y = torch.ops.remat.rope_rotate(x, cos, sin, None, 0, 0, inverse)
        for t in tokens:
            alone = torch.ops.remat.rope_rotate(x[:, t:t + 1].clone(), cos, sin, None, t, 0, inverse)
            assert torch.equal(y[:, t:t + 1], alone), f"token {t}, inverse={inverse}"
        del y
        gc.collect()
    print(f"rope past 2^31 elements: {time.time() - start:.1f} s")


@needs_extension
@bigmem
def test_bigmem_dropout_past_2_31_elements():
    """philox_dropout over 2^31 + 2^20 + 102 bf16 elements (4 GiB in, 4 GiB out): slices at the start,
    around element 2^31 and at the end equal the op on the slice alone with the Philox offset moved
    by the slice's start / 4 (element i takes counter offset + i // 4), bitwise."""
    numel = 2**31 + 2**20 + 102
    seed, offset = 0x1234_5678_9ABC, 2**33 - 5
    start = time.time()
    x = _big_bf16((numel,), seed=8)
    y = torch.ops.remat.philox_dropout(x, torch.tensor([seed, offset]), 0.3)
    for s in _windows_around(numel, 2**31, 4096):
        rng = torch.tensor([seed, offset + s // 4])
        alone = torch.ops.remat.philox_dropout(x[s:s + 4096].clone(), rng, 0.3)
        assert torch.equal(y[s:s + 4096], alone), f"slice at {s}"
    print(f"dropout past 2^31 elements: {time.time() - start:.1f} s")


@needs_extension
@bigmem
def test_bigmem_cross_entropy_past_2_31_elements():
    """The fused linear + cross-entropy with one vocabulary chunk of [2^16 + 16, 32768] bf16 logits
    (2^31 + 2^19 elements, 4 GiB). H = 1 keeps the GEMMs cheap and makes each logit one rounded
    product, whatever the GEMM's blocking: loss and lse of the tokens at the start, around element
    2^31 (token 2^16) and at the end equal the op on that token alone, bitwise (the epilogue works
    row by row); their dx (a GEMM over V, which may sum one row in another order) within fp32
    tolerance."""
    ops = torch.ops.remat
    tokens, vocab = 2**16 + 16, 2**15
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(tokens, 1, generator=g) * 4).to(torch.bfloat16)
    weight = torch.randn(vocab, 1, generator=g).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    grad = torch.rand(tokens, generator=g)
    options = (-100, 0.1, 0.0, 0.0, vocab)  # ignore_index, label_smoothing, softcap, z_loss, chunk
    start = time.time()
    loss, lse = ops.linear_cross_entropy_fwd(x, weight, None, target, *options)
    dx, _, _ = ops.linear_cross_entropy_bwd(x, weight, None, target, lse, grad, None, *options, True, False, False)
    for t in (0, 1, 2**16 - 1, 2**16, 2**16 + 1, tokens - 1):
        alone = (x[t:t + 1].clone(), weight, None, target[t:t + 1].clone())
        loss_t, lse_t = ops.linear_cross_entropy_fwd(*alone, *options)
        assert torch.equal(loss[t:t + 1], loss_t) and torch.equal(lse[t:t + 1], lse_t), f"token {t}"
        dx_t, _, _ = ops.linear_cross_entropy_bwd(*alone, lse_t, grad[t:t + 1].clone(), None, *options, True, False,
                                                  False)
        torch.testing.assert_close(dx[t:t + 1].float(), dx_t.float(), rtol=2e-2, atol=1e-3, msg=f"dx of token {t}")
    print(f"cross-entropy past 2^31 elements: {time.time() - start:.1f} s")


# ---------------------------------------------------------------------------------------------
# Triton: int32 products in index arithmetic.

_TRITON_DIRS = (ROOT / "kernels", ROOT / "python" / "remat")
_ORDER = {"i32": 3, "const": 2, "i64": 1, "other": 0}
# The dtypes of integer loads, by the pointer parameter they load from (every other load is treated
# as data): cu_seqlens are int32, the rng state, per-token rope rows and targets int64.
_LOADED = {"cu_q_ptr": "i32", "cu_k_ptr": "i32", "rng_ptr": "i64", "rows_ptr": "i64", "target_ptr": "i64"}

# int32 products the launchers keep below 2^31: (file, function, product) -> why.
_ROW = "a query row or key index: N, M < 2^28 (attention/launch.py), plus one block"
_HEADS = "a row width Hq * D (or Hkv * splits * D): Hq <= 65535 (grid axis 1) and D <= 256"
_TOKENS = ("a token index < T: x [T, H] with T >= 2^31 rows cannot be held (>= 256 GiB at H = 64 in "
           "16 bits)")
_VOCAB = "a vocabulary column < V (and < V + one split)"
_TILES = "GEMM tile counts and row / column indexes < M, N (tokens, features), plus one block"
BOUNDED = {
    ("kernels/attention/backward.py", "_attn_bwd_preprocess_kernel", "tl.program_id(0) * BLOCK_M"): _ROW,
    ("kernels/attention/backward.py", "_attn_bwd_dkdv_kernel", "tl.program_id(0) * BLOCK_N"): _ROW,
    ("kernels/attention/backward.py", "_attn_bwd_dkdv_kernel", "num_out_heads // HEAD_SPLITS * GROUP"):
        "a query head count Hq <= 65535",
    ("kernels/attention/backward.py", "_attn_bwd_dkdv_kernel", "num_heads * HEAD_DIM"): _HEADS,
    ("kernels/attention/backward.py", "_attn_bwd_dkdv_kernel", "num_out_heads * HEAD_DIM"): _HEADS,
    ("kernels/attention/backward.py", "_attn_bwd_dq_kernel", "num_heads * HEAD_DIM"): _HEADS,
    ("kernels/attention/backward.py", "_attn_bwd_dq_postprocess_kernel", "tl.program_id(0) * BLOCK_M"): _ROW,
    ("kernels/attention/backward.py", "_attn_bwd_dq_postprocess_kernel", "num_heads * HEAD_DIM"): _HEADS,
    ("kernels/attention/forward.py", "_attn_fwd_kernel", "num_heads * HEAD_DIM"): _HEADS,
    ("kernels/attention/masks.py", "_interior", "tl.cdiv(tl.maximum(lo_full - lo, 0), BLOCK) * BLOCK"): _ROW,
    ("kernels/attention/masks.py", "_interior", "tl.maximum(hi_full - int_start, 0) // BLOCK * BLOCK"): _ROW,
    ("kernels/attention/masks.py", "_key_range", "tl.maximum(first_pos - left, 0) // BLOCK_N * BLOCK_N"): _ROW,
    ("kernels/attention/masks.py", "_query_block", "(tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M"): _ROW,
    ("kernels/cross_entropy.py", "_lce_fwd_kernel", "tl.program_id(0) * BLOCK_M"): _TOKENS,
    ("kernels/cross_entropy.py", "_lce_fwd_kernel", "split * cols_per_split"): _VOCAB,
    ("kernels/cross_entropy.py", "_lce_dlogits_kernel", "tl.program_id(0) * BLOCK_M"): _TOKENS,
    ("kernels/cross_entropy.py", "_lce_dlogits_kernel", "tl.program_id(1) * BLOCK_N"): _VOCAB,
    ("kernels/matmul.py", "_tile_indices", "GROUP_M * num_col_tiles"): _TILES,
    ("kernels/matmul.py", "_tile_indices", "program // programs_per_group * GROUP_M"): _TILES,
    ("kernels/matmul.py", "_tile_indices", "row_tile * BLOCK_M"): _TILES,
    ("kernels/matmul.py", "_tile_indices", "col_tile * BLOCK_N"): _TILES,
    ("kernels/rope_rotate.py", "_rope_rotate_kernel", "2 * half"): "the head dim D = 2 * half",
}


def _join(*kinds):
    flat = [k for kind in kinds if kind is not None for k in (kind if isinstance(kind, tuple) else (kind,))]
    return max(flat, key=_ORDER.__getitem__) if flat else "other"


def _is_tl(node, *names):
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tl"
            and node.attr in names)


def _is_jit(function):
    return any(ast.unparse(d) in ("triton.jit", "jit") or ast.unparse(d).startswith("triton.jit(")
               for d in function.decorator_list)


class _IndexWidths:
    """Abstract interpretation of the @triton.jit functions of `sources` ({relative path: text}) over
    the kinds i32 (may hold an int32 index), i64 (widened), const (a literal or constexpr) and
    other (data, pointers, floats). Kernels (jit functions no jit function calls) take their
    integer arguments as i32 (the JIT passes those below 2^31 so) and constexprs as const; a helper's
    parameter is the join of what its call sites pass, its results what its returns give, iterated to
    a fixed point. `findings` lists every product computed in int32: (path, function, product)."""

    def __init__(self, sources):
        self.functions = {}
        for path, text in sources.items():
            for node in ast.parse(text).body:
                if isinstance(node, ast.FunctionDef) and _is_jit(node):
                    self.functions.setdefault(node.name, []).append((path, node))
        called = {node.func.id for defs in self.functions.values() for _, fn in defs for node in ast.walk(fn)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.functions}
        self.kernels = set(self.functions) - called
        self.parameters, self.results = {}, {}
        for _ in range(50):
            self.findings, self.call_sites, results = set(), {}, {}
            for name, defs in self.functions.items():
                for path, function in defs:
                    self.where, self.returned = (path, name), []
                    self._block(function.body, self._arguments(name, function))
                    results[name] = self._join_results([results.get(name)] + self.returned)
            parameters = {name: {p: _join(*(site.get(p) for site in sites)) for site in sites for p in site}
                          for name, sites in self.call_sites.items()}
            if parameters == self.parameters and results == self.results:
                break
            self.parameters, self.results = parameters, results
        else:
            raise AssertionError("the index-width analysis did not converge")

    def _arguments(self, name, function):
        kinds = {}
        for arg in function.args.args:
            if arg.annotation is not None and "constexpr" in ast.unparse(arg.annotation):
                kinds[arg.arg] = "const"
            elif name in self.kernels:
                kinds[arg.arg] = "other" if arg.arg.endswith("_ptr") else "i32"
            else:
                kinds[arg.arg] = self.parameters.get(name, {}).get(arg.arg, "other")
        return kinds

    @staticmethod
    def _join_results(results):
        results = [r for r in results if r is not None]
        if not results:
            return None
        if all(isinstance(r, tuple) for r in results) and len({len(r) for r in results}) == 1:
            return tuple(_join(*column) for column in zip(*results))
        return _join(*results)

    def _assign(self, target, kind, env):
        if isinstance(target, ast.Name):
            env[target.id] = _join(kind)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for i, element in enumerate(target.elts):
                same = isinstance(kind, tuple) and len(kind) == len(target.elts)
                self._assign(element, kind[i] if same else kind, env)

    def _merge(self, env, *branches):
        for key in set().union(*branches):
            env[key] = _join(*(branch.get(key) for branch in branches))

    def _block(self, statements, env):
        for statement in statements:
            self._statement(statement, env)

    def _statement(self, s, env):
        if isinstance(s, ast.Assign):
            kind = self._expr(s.value, env)
            for target in s.targets:
                self._assign(target, kind, env)
        elif isinstance(s, ast.AnnAssign) and s.value is not None:
            constexpr = "constexpr" in ast.unparse(s.annotation)
            self._assign(s.target, "const" if constexpr else self._expr(s.value, env), env)
        elif isinstance(s, ast.AugAssign):
            self._assign(s.target, self._binop(s, self._expr(s.target, env), self._expr(s.value, env)), env)
        elif isinstance(s, ast.For):
            counter = _join(*(self._expr(a, env) for a in s.iter.args)) if isinstance(s.iter, ast.Call) else "other"
            for _ in range(2):  # loop-carried values
                before = dict(env)
                self._assign(s.target, counter, env)
                self._block(s.body, env)
                self._merge(env, before, dict(env))
        elif isinstance(s, ast.While):
            for _ in range(2):
                before = dict(env)
                self._expr(s.test, env)
                self._block(s.body, env)
                self._merge(env, before, dict(env))
        elif isinstance(s, ast.If):
            self._expr(s.test, env)
            then, orelse = dict(env), dict(env)
            self._block(s.body, then)
            self._block(s.orelse, orelse)
            self._merge(env, then, orelse)
        elif isinstance(s, ast.Return) and s.value is not None:
            self.returned.append(self._expr(s.value, env))
        elif isinstance(s, ast.Expr):
            self._expr(s.value, env)

    def _binop(self, node, left, right):
        left, right = _join(left), _join(right)
        op = node.op
        if isinstance(op, ast.Div):
            return "other"
        if "i64" in (left, right):
            return "i64"
        if "other" in (left, right):
            return "other"
        if "i32" in (left, right):
            if isinstance(op, ast.Mult):
                product = ast.unparse(node) if isinstance(node, ast.BinOp) else (
                    f"{ast.unparse(node.target)} * {ast.unparse(node.value)}")  # x *= y
                self.findings.add((*self.where, product))
            return "i32"
        return "const"

    def _expr(self, e, env):
        if isinstance(e, ast.Constant):
            return "const" if isinstance(e.value, int) and not isinstance(e.value, bool) else "other"
        if isinstance(e, ast.Name):
            if e.id in env:
                return env[e.id]
            return "const" if e.id.lstrip("_").isupper() else "other"  # module constants: _OUT, _LOG2E
        if isinstance(e, ast.BinOp):
            return self._binop(e, self._expr(e.left, env), self._expr(e.right, env))
        if isinstance(e, ast.UnaryOp):
            operand = self._expr(e.operand, env)
            return "other" if isinstance(e.op, ast.Not) else operand
        if isinstance(e, ast.Subscript):
            self._expr(e.slice, env)
            return self._expr(e.value, env)
        if isinstance(e, ast.IfExp):
            self._expr(e.test, env)
            return _join(self._expr(e.body, env), self._expr(e.orelse, env))
        if isinstance(e, (ast.Tuple, ast.List)):
            return tuple(self._expr(element, env) for element in e.elts)
        if isinstance(e, ast.Call):
            return self._call(e, env)
        for child in ast.iter_child_nodes(e):
            if isinstance(child, ast.expr):
                self._expr(child, env)
        return "other"

    def _call(self, e, env):
        args = [self._expr(a, env) for a in e.args]
        keywords = {k.arg: self._expr(k.value, env) for k in e.keywords}
        f = e.func
        dtype = e.args[1] if len(e.args) > 1 else None
        if _is_tl(f, "program_id", "num_programs", "arange"):
            return "i32"
        if isinstance(f, ast.Attribute) and f.attr == "to":
            self._expr(f.value, env)
            target = e.args[0] if e.args else next((k.value for k in e.keywords if k.arg == "dtype"), None)
            return "i64" if _is_tl(target, "int64") else "i32" if _is_tl(target, "int32") else "other"
        if _is_tl(f, "cast"):
            return "i64" if _is_tl(dtype, "int64") else "i32" if _is_tl(dtype, "int32") else "other"
        if _is_tl(f, "cdiv", "minimum", "maximum") or (isinstance(f, ast.Name) and f.id in ("min", "max")):
            return _join(*args)
        if _is_tl(f, "where"):
            return _join(*args[1:])
        if _is_tl(f, "full"):
            dtype = e.args[2] if len(e.args) > 2 else next((k.value for k in e.keywords if k.arg == "dtype"), None)
            return "i64" if _is_tl(dtype, "int64") else "other"
        if _is_tl(f, "load"):
            root = e.args[0]
            while isinstance(root, ast.BinOp):
                root = root.left
            return _LOADED.get(root.id, "other") if isinstance(root, ast.Name) else "other"
        if isinstance(f, ast.Name) and f.id in self.functions:
            names = [a.arg for a in self.functions[f.id][0][1].args.args]
            self.call_sites.setdefault(f.id, []).append({**dict(zip(names, args)), **keywords})
            result = self.results.get(f.id)
            return result if result is not None else "other"
        if isinstance(f, ast.Attribute):
            self._expr(f.value, env)
        return "other"


def _triton_sources(replace=None):
    """{path relative to the repo: text} of every .py file with a @triton.jit function; `replace`
    maps a relative path to the text to analyse instead of the file's."""
    sources = {}
    for directory in _TRITON_DIRS:
        for path in sorted(directory.rglob("*.py")):
            text = path.read_text()
            if "triton.jit" in text:
                sources[path.relative_to(ROOT).as_posix()] = text
    sources.update(replace or {})
    return sources


def _narrow_products(replace=None):
    return _IndexWidths(_triton_sources(replace)).findings


def test_triton_index_products_are_widened_or_bounded():
    """Every int32 product in the Triton kernels is listed in BOUNDED, and every BOUNDED entry still
    occurs (the list describes the code, not its past)."""
    analysis = _IndexWidths(_triton_sources())
    assert {"_norm_fwd_kernel", "_norm_bwd_kernel", "_act_fwd_kernel", "_act_bwd_kernel", "_philox_dropout_kernel",
            "_rope_rotate_kernel", "_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel",
            "_lce_fwd_kernel", "_lce_dlogits_kernel", "_glu_matmul_fwd_kernel"} <= analysis.kernels
    unlisted = sorted(analysis.findings - set(BOUNDED))
    assert not unlisted, f"int32 products in Triton index arithmetic (widen one factor with .to(tl.int64)): {unlisted}"
    stale = sorted(set(BOUNDED) - analysis.findings)
    assert not stale, f"BOUNDED entries that no longer occur: {stale}"


@pytest.mark.parametrize("case", ["batch", "heads", "queries", "keys", "sequences"])
def test_triton_attention_launchers_refuse_what_bounded_assumes(case):
    """The bounds BOUNDED cites for the attention kernels (N, M < 2^28; B, Hq and the packed
    sequences at most 65535, grid axes 2 and 1) are the launchers' checks: they raise before any
    kernel. Zero-stride views stand for the large tensors."""
    from remat.kernels.attention import launch

    def tensor(*shape):
        return torch.zeros(16, dtype=torch.float32).expand(*shape)

    options = (None, None, None, 0.25, 0.0, -1, -1, 0.0)
    if case == "sequences":
        q, k = tensor(65536, 1, 16), tensor(65536, 1, 16)
        cu = torch.arange(65537, dtype=torch.int32)
        with pytest.raises(ValueError, match="65535 sequences"):
            launch.attention_varlen_fwd(q, k, k, cu, cu, 1, 1, *options)
        return
    q_shape, k_shape = {"batch": ((65536, 1, 1, 16), (65536, 1, 1, 16)),
                        "heads": ((1, 1, 65536, 16), (1, 1, 1, 16)),
                        "queries": ((1, 2**28, 1, 16), (1, 1, 1, 16)),
                        "keys": ((1, 1, 1, 16), (1, 2**28, 1, 16))}[case]
    with pytest.raises(ValueError, match="65535|2\\^28"):
        launch.attention_fwd(tensor(*q_shape), tensor(*k_shape), tensor(*k_shape), *options)


def _mutated(path, old, new):
    text = (ROOT / path).read_text()
    assert old in text, f"{path} no longer contains {old!r}: update this mutation"
    return {path: text.replace(old, new)}


# Each: (file, widened text, the text without the widening, one product the rule must then report).
TRITON_MUTATIONS = {
    "mlp-program-offsets": (
        "kernels/mlp.py", "tl.program_id(0).to(tl.int64) * BLOCK", "tl.program_id(0) * BLOCK",
        ("kernels/mlp.py", "_act_fwd_kernel", "tl.program_id(0) * BLOCK")),
    "norm-forward-row": (
        "kernels/norm.py", "row = tl.program_id(0).to(tl.int64)", "row = tl.program_id(0)",
        ("kernels/norm.py", "_norm_fwd_kernel", "row * x_row_stride")),
    "norm-backward-row": (
        "kernels/norm.py", "row64 = tl.cast(row, tl.int64)", "row64 = row",
        ("kernels/norm.py", "_norm_bwd_kernel", "row64 * dy_row_stride")),
    "dropout-block-start": (
        "kernels/dropout.py", "start = tl.program_id(0).to(tl.int64) * BLOCK", "start = tl.program_id(0) * BLOCK",
        ("kernels/dropout.py", "_philox_dropout_kernel", "tl.program_id(0) * BLOCK")),
    "rope-rotate-token": (
        "kernels/rope_rotate.py", "tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)",
        "tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)",
        ("kernels/rope_rotate.py", "_rope_rotate_kernel", "batch * stride_xb")),
    "attention-operand-rows": (
        "kernels/attention/rope.py", "rows.to(tl.int64)[:, None] * row_stride", "rows[:, None] * row_stride",
        ("kernels/attention/rope.py", "_load_part", "rows[:, None] * row_stride")),
    "attention-batch-index": (
        "kernels/attention/masks.py", "b = tl.program_id(2).to(tl.int64)", "b = tl.program_id(2)",
        ("kernels/attention/masks.py", "_operand_base", "b * stride_b")),
    "attention-packed-first-row": (
        "kernels/attention/masks.py", "q_row0 = q_start.to(tl.int64)", "q_row0 = q_start",
        ("kernels/attention/masks.py", "_operand_base", "row0 * stride_n")),
    "cross-entropy-x-rows": (
        "kernels/cross_entropy.py", "rows.to(tl.int64)[:, None] * x_row_stride", "rows[:, None] * x_row_stride",
        ("kernels/cross_entropy.py", "_logits_tile", "rows[:, None] * x_row_stride")),
    "matmul-weight-columns": (
        "kernels/matmul.py", "cols.to(tl.int64)[None, :] * K", "cols[None, :] * K",
        ("kernels/matmul.py", "_gate_up_tile", "cols[None, :] * K")),
}


@pytest.mark.parametrize("mutation", list(TRITON_MUTATIONS))
def test_triton_rule_reports_an_unwidened_offset(mutation):
    path, old, new, expected = TRITON_MUTATIONS[mutation]
    findings = _narrow_products(_mutated(path, old, new))
    assert expected in findings
    assert findings - set(BOUNDED)


# kernels/rope_rotate.py's head loop before commit 0c73aaf, which advanced the per-head offsets in
# int64: head * stride_xh and head * (2 * half) were int32 products.
ROPE_BEFORE_0C73AAF = '''
    x_rows = batch * stride_xb + position * stride_xl
    y_rows = token * heads * (2 * half)
    for head in range(heads):
        x_first = x_ptr + (x_rows + head * stride_xh)[:, None] + pair[None, :]
        x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_first + half, mask=mask, other=0.0).to(tl.float32)
        if INVERSE:
            y1 = x1 * c + x2 * s
            y2 = x2 * c - x1 * s
        else:
            y1 = x1 * c - x2 * s
            y2 = x2 * c + x1 * s
        y_first = y_ptr + (y_rows + head * (2 * half))[:, None] + pair[None, :]
        tl.store(y_first, _round(y1, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        tl.store(y_first + half, _round(y2, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)
'''


def test_triton_rule_reports_the_rope_kernel_before_0c73aaf():
    path = "kernels/rope_rotate.py"
    text = (ROOT / path).read_text()
    head = text.index("    x_head = batch * stride_xb")
    tail = text.index("        y_head += 2 * half\n") + len("        y_head += 2 * half\n")
    findings = _narrow_products({path: text[:head] + ROPE_BEFORE_0C73AAF.lstrip("\n") + text[tail:]})
    assert {(path, "_rope_rotate_kernel", "head * stride_xh"),
            (path, "_rope_rotate_kernel", "head * (2 * half)")} <= findings


# ---------------------------------------------------------------------------------------------
# CUDA and C++: 32-bit grid indexes, narrowed sizes, 32-bit loop counters.

_I32 = r"(?:unsigned\s+int|unsigned|int|int32_t|uint32_t)"
_I64 = r"(?:int64_t|uint64_t|size_t|ptrdiff_t|long\s+long)"
_DECLARED_32 = re.compile(rf"(?<![\w:<])(?:const\s+)?{_I32}\s+(?=\w+\s*[=,;)])")
_INITIALISED_32 = re.compile(rf"(?<![\w:<])(?:const\s+)?{_I32}\s+(?=\w+\s*=)")
_DECLARED_64 = re.compile(rf"(?<![\w:<])(?:const\s+)?{_I64}\s+")
_FIELDS_64 = re.compile(rf"^[ \t]*(?:const\s+)?{_I64}\s+([\w \t,]+);", re.M)
_SIZE_SOURCE = re.compile(r"\b(?:blockIdx|gridDim)\b|\.numel\(\)|\.stride\(|\.size\(|element_size\(\)")
_LOOP_32 = re.compile(rf"for\s*\(\s*(?:const\s+)?{_I32}\s+(\w+)\s*=[^;]*;\s*(\w+)\s*<=?\s*([^;]*);")


def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _statement_from(text, i):
    """The text from i to the next ';' (or unmatched closing bracket) at bracket depth 0."""
    depth, end = 0, i
    while end < len(text):
        c = text[end]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif c == ";" and depth == 0:
            break
        end += 1
    return text[i:end]


def _declared_names(text, pattern):
    names = set()
    for match in pattern.finditer(text):
        depth, current, parts = 0, "", []
        for c in _statement_from(text, match.end()):
            depth += c in "([{<"
            depth -= c in ")]}>"
            if c == "," and depth == 0:
                parts.append(current)
                current = ""
            else:
                current += c
        for part in parts + [current]:
            name = re.match(r"\s*(\w+)", part)
            if name:
                names.add(name.group(1))
    return names


def _line(text, index):
    number = text.count("\n", 0, index) + 1
    return f"{number}: {text.splitlines()[number - 1].strip()}"


def _cpp_findings(replace=None):
    """Violations of the three rules over csrc ({relative path: text} in `replace` analysed instead of
    the files): [(rule, path, 'line: text')]."""
    sources = {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted((ROOT / "csrc").rglob("*"))
               if path.suffix in (".cu", ".cuh", ".cpp", ".h")}
    sources.update(replace or {})
    sources = {path: _strip_comments(text) for path, text in sources.items()}
    fields_64 = {name.strip() for path, text in sources.items() if path.endswith((".h", ".cuh"))
                 for match in _FIELDS_64.finditer(text) for name in match.group(1).split(",")}
    findings = []
    for path, text in sources.items():
        names_64 = _declared_names(text, _DECLARED_64)
        names_32 = _declared_names(text, _DECLARED_32)
        # Rule 1 (device code): blockIdx / gridDim times a factor that is not 64-bit.
        for match in re.finditer(r"\b(?:blockIdx|gridDim)\.[xyz]\b", text) if path.endswith((".cu", ".cuh")) else ():
            before, after = text[:match.start()], text[match.end():]
            if re.search(rf"static_cast<\s*{_I64}\s*>\(\s*$", before):
                continue
            factors = []
            left = re.search(r"([\w.]+|\))\s*\*\s*$", before)
            if left and left.group(1) == ")":  # a parenthesised factor: is it a 64-bit cast?
                depth, i = 0, left.start(1)
                while i >= 0:
                    depth += {")": 1, "(": -1}.get(before[i], 0)
                    if depth == 0:
                        break
                    i -= 1
                cast = re.search(rf"static_cast<\s*{_I64}\s*>\s*$", before[:max(i, 0)])
                factors.append("static_cast" if cast else ")")
            elif left:
                factors.append(left.group(1))
            right = re.match(rf"\s*\*\s*(static_cast<\s*{_I64}\s*>|[\w.]+|\()", after)
            if right:
                factors.append(right.group(1))
            for factor in factors:
                wide = factor.startswith("static_cast") or factor.split(".")[-1] in names_64 | fields_64
                if not wide:
                    findings.append(("grid-index-product", path, _line(text, match.start())))
        # Rule 2: a 32-bit variable initialised from a grid index or a tensor's numel / size / stride.
        for match in _INITIALISED_32.finditer(text):
            statement = _statement_from(text, match.end())
            if _SIZE_SOURCE.search(statement.split("=", 1)[1]):
                findings.append(("32-bit-from-64-bit", path, _line(text, match.start())))
        # Rule 3: a 32-bit loop counter compared with a 64-bit extent (a 64-bit local or field).
        for match in _LOOP_32.finditer(text):
            counter, compared, bound = match.groups()
            if counter != compared:
                continue
            for token in re.finditer(r"(\.|->)?\b([A-Za-z_]\w*)\b", bound):
                member, name = token.groups()
                if (member and name in fields_64) or (not member and name in names_64 and name not in names_32):
                    findings.append(("32-bit-loop-over-64-bit-extent", path, _line(text, match.start())))
                    break
    return findings


def test_cuda_and_cpp_index_arithmetic_is_64_bit():
    assert not _cpp_findings()


# Each: (file, 64-bit text, its 32-bit version, the rule that must report it).
CPP_MUTATIONS = {
    "act-global-thread": (
        "csrc/mlp/act_kernel.cuh", "return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;",
        "return blockIdx.x * blockDim.x + threadIdx.x;", "grid-index-product"),
    "act-grid-threads": (
        "csrc/mlp/act_kernel.cuh", "return static_cast<int64_t>(gridDim.x) * blockDim.x;",
        "return gridDim.x * blockDim.x;", "grid-index-product"),
    "dropout-group": (
        "csrc/dropout/dropout.cu", "for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;",
        "for (int g = blockIdx.x * blockDim.x + threadIdx.x;", "32-bit-from-64-bit"),
    "cross-entropy-finalize-row": (
        "csrc/cross_entropy/cross_entropy.cu", "blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;",
        "blockIdx.x * blockDim.x + threadIdx.x;", "grid-index-product"),
    "attention-delta-row": (
        "csrc/attention/attention_kernel.cuh", "static_cast<int64_t>(blockIdx.x) * (kSmallThreads / kWarpSize)",
        "blockIdx.x * (kSmallThreads / kWarpSize)", "grid-index-product"),
    "attention-key-block": (
        "csrc/attention/attention_kernel.cuh", "const int64_t k0 = static_cast<int64_t>(blockIdx.x) * L::kBlockN;",
        "const int k0 = blockIdx.x * L::kBlockN;", "32-bit-from-64-bit"),
    "norm-row-group": (
        "csrc/norm/norm_kernel.cuh", "for (int64_t group = blockIdx.x; group < num_row_groups; group += gridDim.x) {\n"
        "    const int64_t row = group * rows_per_block + row_in_block;\n    // Only in warp-per-row mode",
        "for (int group = blockIdx.x; group < num_row_groups; group += gridDim.x) {\n"
        "    const int64_t row = group * rows_per_block + row_in_block;\n    // Only in warp-per-row mode",
        "32-bit-loop-over-64-bit-extent"),
    "act-pack-loop": (
        "csrc/mlp/act_kernel.cuh", "for (int64_t pack = thread; pack < num_packs; pack += num_threads) {\n"
        "    act_fwd_chunk", "for (int pack = thread; pack < num_packs; pack += num_threads) {\n    act_fwd_chunk",
        "32-bit-loop-over-64-bit-extent"),
    "cpu-norm-sizes": (
        "csrc/norm/norm_cpu.cpp", "const int64_t rows = x.size(0), cols = x.size(1);\n  const Storage",
        "const int rows = x.size(0), cols = x.size(1);\n  const Storage", "32-bit-from-64-bit"),
    "cpu-activation-loop": (
        "csrc/mlp/act_cpu.cpp", "for (int64_t i = 0; i < n; ++i) a[i] = activate(kAct, g[i]);",
        "for (int i = 0; i < n; ++i) a[i] = activate(kAct, g[i]);", "32-bit-loop-over-64-bit-extent"),
    "cpu-attention-delta-loop": (
        "csrc/attention/attention_cpu.cpp", "for (int64_t row = begin; row < end; ++row) {\n      float sum",
        "for (int row = begin; row < end; ++row) {\n      float sum", "32-bit-loop-over-64-bit-extent"),
}


@pytest.mark.parametrize("mutation", list(CPP_MUTATIONS))
def test_cpp_rules_report_32_bit_index_arithmetic(mutation):
    path, old, new, rule = CPP_MUTATIONS[mutation]
    findings = _cpp_findings(_mutated(path, old, new))
    assert any(found_rule == rule and found_path == path for found_rule, found_path, _ in findings), findings
