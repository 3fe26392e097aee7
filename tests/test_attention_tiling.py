"""Sequence tiling of the pre-norm attention sub-block (remat.norm_attention(tile_tokens=T),
remat.autograd.norm_attention_tiled): equal to a float64 reference under the 2x rule on every CPU
core (remat's own kernels, the torch core, the aten core whose causal mask aligns top-left), both
policies, per-head q/k norms, LoRA (with dropout: the untiled call's masks), pads, causal sliding
windows, packed rows; the same saved bytes; no tensor of q's width over the sequence in backward;
unsupported calls refused."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import remat
from remat.autograd import norm_attention_tiled
from remat.autograd.lora import LoRAAdapter
from remat.memory import saved_bytes
from remat.nn import layers

from _checks import assert_within_2x_of_stock
from helpers import (
    DTYPES,
    assert_grads_within_2x_of_stock,
    batch,
    causal_lm,
    cpu_backends,
    gpt2_model,
    grads,
    logits_and_grads,
    loss_and_grads,
)

HIDDEN, HQ, HKV, D, RANK = 32, 6, 2, 8, 3


def backends():
    return cpu_backends() + ["aten"]


def rope_tables(batch, n, dtype, head_dim=D):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv[None] + torch.arange(batch)[:, None, None] * 0.37
    emb = torch.cat([angles, angles], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_case(dtype, batch=2, n=37, qk_norm=False, lora=False, bias=False, seed=0, head_dim=D):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    d = head_dim
    tensors = {"x": rand(batch, n, HIDDEN, scale=1.0), "nw": 1 + rand(HIDDEN, scale=0.2),
               "wq": rand(HQ * d, HIDDEN), "wk": rand(HKV * d, HIDDEN), "wv": rand(HKV * d, HIDDEN)}
    if bias:
        tensors.update(bq=rand(HQ * d, scale=0.1), bk=rand(HKV * d, scale=0.1), bv=rand(HKV * d, scale=0.1))
    if qk_norm:
        tensors.update(qn=1 + rand(d, scale=0.2), kn=1 + rand(d, scale=0.2))
    if lora:
        tensors.update(aq=rand(RANK, HIDDEN), bq_lora=rand(HQ * d, RANK), av=rand(RANK, HIDDEN),
                       bv_lora=rand(HKV * d, RANK))
    dy = rand(batch, n, HQ, d, scale=1.0)
    return tensors, dy


def remat_fn(names, rope, backend, keep_qkv, tile, empty=None, lora_dropout=0.0, window=None):
    def fn(*values):
        t = dict(zip(names, values, strict=True))
        lora = None
        if "aq" in t:
            lora = ([LoRAAdapter(t["aq"], t["bq_lora"], None, 0.5, lora_dropout)], None,
                    [LoRAAdapter(t["av"], t["bv_lora"], None, 2.0, lora_dropout)])
        extra = dict(qk_norm="rms", q_norm_weight=t["qn"], k_norm_weight=t["kn"]) if "qn" in t else {}
        return remat.norm_attention(t["x"], t["nw"], t["wq"], t["wk"], t["wv"], b_q=t.get("bq"), b_k=t.get("bk"),
                                    b_v=t.get("bv"), num_heads=HQ, num_kv_heads=HKV, rope=rope, keep_qkv=keep_qkv,
                                    lora=lora, backend=backend, tile_tokens=tile, empty_queries=empty, window=window,
                                    **extra)
    return fn


def _rotate(t, cos, sin):
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos[:, :, None] + rotated * sin[:, :, None]


def reference_fn(names, rope, empty=None, window_left=None):
    """Stock PyTorch ops: the same arithmetic in whatever dtype the inputs have (causal; with
    ``window_left``, query p sees keys p - window_left .. p)."""
    def fn(*values):
        t = dict(zip(names, values, strict=True))
        x = t["x"]
        batch, n, _ = x.shape
        normed = F.rms_norm(x, (HIDDEN,), t["nw"], 1e-6)

        def project(w, b, a=None, b_lora=None, scaling=None):
            out = F.linear(normed, w, b)
            if a is not None:
                out = out + scaling * F.linear(F.linear(normed, a), b_lora)
            return out

        d = t["wq"].shape[0] // HQ
        q = project(t["wq"], t.get("bq"), t.get("aq"), t.get("bq_lora"), 0.5).view(batch, n, HQ, d)
        k = project(t["wk"], t.get("bk")).view(batch, n, HKV, d)
        v = project(t["wv"], t.get("bv"), t.get("av"), t.get("bv_lora"), 2.0).view(batch, n, HKV, d)
        if "qn" in t:
            q = F.rms_norm(q, (d,), t["qn"], 1e-6)
            k = F.rms_norm(k, (d,), t["kn"], 1e-6)
        cos, sin = (table.to(x.dtype) for table in rope)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        band = None
        if window_left is not None:
            offset = torch.arange(n)[:, None] - torch.arange(n)[None]
            band = (offset >= 0) & (offset <= window_left)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=band, is_causal=band is None, enable_gqa=True).transpose(1, 2)
        if empty is not None:
            o = o.masked_fill(empty[:, :, None, None], 0)
        return o
    return fn


# variant -> (keep_qkv, qk_norm, lora)
_VARIANTS = {"speed": (True, False, False), "memory-lora": (False, False, True),
             "speed-qknorm-lora": (True, True, True), "memory-qknorm": (False, True, False)}


# The Triton kernels run under the interpreter here, where each tile's launches cost seconds: each
# variant once, in its own dtype, over the 3-tile split (a remainder too), and the 8-tile split
# (tiles of 5) once in fp32. The tiling itself is the same Python over every core, which the other
# backends run in every variant, dtype and split; the kernels' own cases are tests/test_attention.py's.
_TRITON_CASES = {("speed", torch.float32, 5), ("speed", torch.float32, 16), ("memory-lora", torch.bfloat16, 16),
                 ("speed-qknorm-lora", torch.float16, 16), ("memory-qknorm", torch.bfloat16, 16)}


def _reference_cases():
    """(backend, variant, dtype, tile) cases: every one on the backends other than Triton, which
    takes :data:`_TRITON_CASES`."""
    for backend in backends():
        for variant, flags in _VARIANTS.items():
            for dtype in DTYPES:
                for tile in (5, 16):
                    if backend == "triton" and (variant, dtype, tile) not in _TRITON_CASES:
                        continue
                    yield pytest.param(backend, *flags, dtype, tile, id=f"{backend}-{variant}-{dtype}-{tile}")


@pytest.mark.parametrize("backend,keep_qkv,qk_norm,lora,dtype,tile", list(_reference_cases()))
def test_tiled_norm_attention_matches_float64_reference(backend, keep_qkv, qk_norm, lora, dtype, tile):
    # B = 2 rows of 37 tokens with per-row rope tables; tiles of 5 leave a remainder of 2, tiles of
    # 16 one of 5. Pads at the start of the first row. Projection biases as in Qwen2 (no per-head
    # norms); with the per-head norms (Qwen3, Gemma 3: no biases) a k bias's bf16 gradient is a sum
    # that nearly cancels, where the untiled call already exceeds twice stock's error on the CPU
    # aten core (2.3x on this case).
    tensors, dy = make_case(dtype, qk_norm=qk_norm, lora=lora, bias=not qk_norm)
    names, values = list(tensors), list(tensors.values())
    rope = rope_tables(2, 37, dtype)
    empty = torch.zeros(2, 37, dtype=torch.bool)
    empty[0, :3] = True
    got = grads(remat_fn(names, rope, backend, keep_qkv, tile, empty), values, dy)
    stock = grads(reference_fn(names, rope, empty), values, dy)
    want = grads(reference_fn(names, tuple(t.double() for t in rope), empty), [t.double() for t in values],
                 dy.double())
    for name, g, s, w in zip(["o", *names], got, stock, want, strict=True):
        assert_within_2x_of_stock(name, g, s, w, dtype)


def _window_cases():
    for backend in cpu_backends():  # the aten core on the CPU has no sliding window
        for keep_qkv in (True, False):
            for dtype in DTYPES:
                for tile, window in ((5, 3), (5, 11), (16, 11)):
                    if backend == "triton" and (keep_qkv, dtype, tile) != (False, torch.float32, 16):
                        continue  # the interpreter (~15 s a case): one case; the tiling is the same Python
                    yield pytest.param(backend, keep_qkv, dtype, tile, window,
                                       id=f"{backend}-keep_qkv={keep_qkv}-{dtype}-tile={tile}-window={window}")


@pytest.mark.parametrize("backend,keep_qkv,dtype,tile,window", list(_window_cases()))
def test_tiled_sliding_window_matches_float64_reference(backend, keep_qkv, dtype, tile, window):
    # Query p sees keys p - window .. p: a window shorter than a tile (3 of 5), longer than two
    # (11 of 5) and within one (11 of 16) over 37 tokens; each tile's call reads keys from its first
    # query's window on.
    tensors, dy = make_case(dtype, qk_norm=not keep_qkv, lora=keep_qkv)
    names, values = list(tensors), list(tensors.values())
    rope = rope_tables(2, 37, torch.float32)
    _, stock, want = assert_grads_within_2x_of_stock(remat_fn(names, rope, backend, keep_qkv, tile, window=(window, 0)),
                                                     reference_fn(names, rope, window_left=window), values, dy, dtype)
    untiled = grads(remat_fn(names, rope, backend, keep_qkv, None, window=(window, 0)), values, dy)
    # The window is applied: the full causal result differs (not vacuous).
    causal = grads(reference_fn(names, rope), [t.double() for t in values], dy.double())
    assert not torch.allclose(causal[0], want[0], atol=1e-3)
    assert_within_2x_of_stock("untiled output", untiled[0], stock[0], want[0], dtype)


# A packed row of 37 tokens: sequences of 9, 0, 13 and 15 tokens (an empty one among them).
PACKED_STARTS = [0, 9, 9, 22, 37]


def _packed_cases():
    """Rope restarting per sequence in every case; per-token tables (the same rows, no gather) in
    fp32 only."""
    for backend in cpu_backends():  # the aten core on the CPU takes no packed rows
        for keep_qkv in (True, False):
            for dtype in DTYPES:
                for tile, window in ((5, None), (16, None), (5, 4)):
                    if backend == "triton" and (keep_qkv, dtype, tile, window) != (False, torch.float32, 16, None):
                        continue  # the interpreter: one case; the tiling is the same Python on every core
                    for rope_layout in ("restart", "per-token") if dtype == torch.float32 else ("restart",):
                        if backend == "triton" and rope_layout != "restart":
                            continue
                        yield pytest.param(backend, keep_qkv, dtype, tile, window, rope_layout,
                                           id=f"{backend}-keep_qkv={keep_qkv}-{dtype}-tile={tile}-window={window}-"
                                              f"{rope_layout}")


@pytest.mark.parametrize("backend,keep_qkv,dtype,tile,window,rope_layout", list(_packed_cases()))
def test_tiled_packed_rows_match_float64_reference(backend, keep_qkv, dtype, tile, window, rope_layout):
    # Tiles of 5 cut every sequence; the tile holding token 20 starts inside the 13-token one (keys
    # from its start at 9), tiles of 16 hold sequence ends inside them. The reference runs each
    # sequence alone. Rope restarts per sequence: tables [S_rows, D/2|D] or per packed token.
    tensors, dy = make_case(dtype, batch=1, n=37, qk_norm=not keep_qkv, lora=keep_qkv)
    names, values = list(tensors), list(tensors.values())
    cos, sin = rope_tables(1, 37, torch.float32)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(PACKED_STARTS, PACKED_STARTS[1:])])
    rope = (cos[0], sin[0]) if rope_layout == "restart" else (cos[:, positions], sin[:, positions])
    cu_seqlens = torch.tensor(PACKED_STARTS, dtype=torch.int32)

    def packed(tile):
        def fn(*values):
            t = dict(zip(names, values, strict=True))
            lora = None
            if "aq" in t:
                lora = ([LoRAAdapter(t["aq"], t["bq_lora"], None, 0.5)], None,
                        [LoRAAdapter(t["av"], t["bv_lora"], None, 2.0)])
            extra = dict(qk_norm="rms", q_norm_weight=t["qn"], k_norm_weight=t["kn"]) if "qn" in t else {}
            return remat.norm_attention(t["x"], t["nw"], t["wq"], t["wk"], t["wv"], num_heads=HQ, num_kv_heads=HKV,
                                        rope=rope, keep_qkv=keep_qkv, lora=lora, backend=backend, tile_tokens=tile,
                                        cu_seqlens=cu_seqlens, window=None if window is None else (window, 0), **extra)
        return fn

    def alone(*values):
        x, rest = values[0], values[1:]
        outs = []
        for a, b in zip(PACKED_STARTS, PACKED_STARTS[1:]):
            if b > a:
                tables = (cos[:, : b - a].to(torch.float64), sin[:, : b - a].to(torch.float64))
                outs.append(reference_fn(names, tables, window_left=window)(x[:, a:b], *rest))
        return torch.cat(outs, 1)

    assert_grads_within_2x_of_stock(packed(tile), alone, values, dy, dtype)


@pytest.mark.parametrize("starts,tile", [([0, 5, 10, 15], 5), ([0, 12, 12], 5), ([0, 0, 12], 4),
                                         ([0, 4, 4, 4, 8, 13], 3), ([0, 1, 2, 9], 1)],
                         ids=["tile-starts-at-sequences", "empty-last", "empty-first", "empty-runs", "single-rows"])
@pytest.mark.parametrize("window", [None, 0, 2])
def test_tiled_packed_rows_at_sequence_edges_equal_untiled(starts, tile, window):
    # Tiles starting exactly at a sequence start, zero-length sequences first, last or in runs,
    # one-token sequences and tiles, windows of 0 and 2 keys: tiled = untiled (fp32, cpp).
    n = starts[-1]
    tensors, dy = make_case(torch.float32, batch=1, n=n, lora=True)
    names, values = list(tensors), list(tensors.values())
    cos, sin = rope_tables(1, n, torch.float32)
    cu_seqlens = torch.tensor(starts, dtype=torch.int32)

    def fn(tile_tokens):
        def call(*vals):
            t = dict(zip(names, vals, strict=True))
            lora = ([LoRAAdapter(t["aq"], t["bq_lora"], None, 0.5)], None,
                    [LoRAAdapter(t["av"], t["bv_lora"], None, 2.0)])
            return remat.norm_attention(t["x"], t["nw"], t["wq"], t["wk"], t["wv"], num_heads=HQ, num_kv_heads=HKV,
                                        rope=(cos[0], sin[0]), keep_qkv=False, lora=lora, backend="cpp",
                                        tile_tokens=tile_tokens, cu_seqlens=cu_seqlens,
                                        window=None if window is None else (window, 0))
        return call

    for got, want in zip(grads(fn(tile), values, dy), grads(fn(None), values, dy), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("keep_qkv", [True, False])
def test_tiling_keeps_the_same_saved_bytes(keep_qkv):
    tensors, _ = make_case(torch.float32, qk_norm=True, lora=True)
    names = list(tensors)
    leaves = [t.requires_grad_() for t in tensors.values()]
    rope = rope_tables(2, 37, torch.float32)
    untiled = saved_bytes(remat_fn(names, rope, "torch", keep_qkv, None), *leaves)
    for tile in (1, 5, 37, 100):
        assert saved_bytes(remat_fn(names, rope, "torch", keep_qkv, tile), *leaves) == untiled


class LargestTensor(TorchDispatchMode):
    """The most elements of any storage an operator made while active (views of its inputs, such
    as a tile of the incoming gradient, make none)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("keep_qkv", [True, False])
def test_no_tensor_of_query_width_over_the_sequence_in_backward(backend, keep_qkv):
    # remat's kernels (the torch core, a reference, expands k and v to Hq heads in fp32 by design).
    # Untiled, the backward makes [N, Hq * D] tensors (the normalized input is [N, H], rotated q,
    # dq, the projections' input gradients); tiled, q's width exists one tile at a time and the
    # largest per-token tensors are dx [N, H] and the fp32 dk/dv sums [N, Hkv * D]. H < Hq * D here.
    if backend not in backends():
        pytest.skip(f"{backend} is not built here")
    n, tile = 64, 8
    tensors, dy = make_case(torch.float32, batch=1, n=n, lora=True)
    names = list(tensors)
    rope = rope_tables(1, n, torch.float32)
    sizes = {}
    for tiled in (None, tile):
        leaves = [t.clone().requires_grad_() for t in tensors.values()]
        o = remat_fn(names, rope, backend, keep_qkv, tiled)(*leaves)
        with LargestTensor() as backward:
            o.backward(dy)
        sizes[tiled] = backward.largest
    assert sizes[None] >= n * HQ * D
    assert sizes[tile] <= max(n * HIDDEN, HQ * D * HIDDEN, tile * HQ * D)
    assert n * HIDDEN < n * HQ * D


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_tiles_draw_the_untiled_calls_lora_dropout_masks(backend):
    if backend not in backends():
        pytest.skip(f"{backend} is not built here")
    tensors, dy = make_case(torch.float32, n=22, lora=True, seed=4)
    names, values = list(tensors), list(tensors.values())
    rope = rope_tables(2, 22, torch.float32)

    def run(tile, seed=11):
        torch.manual_seed(seed)
        return grads(remat_fn(names, rope, backend, False, tile, lora_dropout=0.25), values, dy)

    untiled = run(None)
    for tile in (4, 8, 12):  # 22 tokens: remainders 2, 6, 10
        for got, want in zip(run(tile), untiled, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # Another seed draws other masks and changes the output: the comparison is not vacuous.
    assert not torch.allclose(run(4, seed=12)[0], untiled[0])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "aten", "triton", "cuda"])
@pytest.mark.parametrize("keep_qkv", [True, False])
def test_gpu_tiled_norm_attention_matches_float64_reference(backend, keep_qkv):
    # cuDNN aligns causal masks top-left (two calls per tile); the aten core on CUDA is
    # FlashAttention-2 (one bottom-right call). 300 tokens, D 64, tiles of 128: remainder 44.
    from remat import backend as backend_mod

    reason = backend_mod.unavailable_reason(backend, torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    tensors, dy = make_case(torch.bfloat16, n=300, lora=True, bias=True, head_dim=64)
    names = list(tensors)
    values = [t.cuda() for t in tensors.values()]
    dy = dy.cuda()
    rope = tuple(t.cuda() for t in rope_tables(2, 300, torch.bfloat16, head_dim=64))
    got = grads(remat_fn(names, rope, backend, keep_qkv, 128), values, dy)
    untiled = grads(remat_fn(names, rope, backend, keep_qkv, None), values, dy)
    stock = grads(reference_fn(names, rope), values, dy)
    want = grads(reference_fn(names, tuple(t.double() for t in rope)), [t.double() for t in values], dy.double())
    for name, g, u, s, w in zip(["o", *names], got, untiled, stock, want, strict=True):
        assert_within_2x_of_stock(name, g, s, w, torch.bfloat16)
        assert_within_2x_of_stock(f"{name} (untiled)", u, s, w, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aten", "triton", "cuda"])  # cuDNN takes neither windows nor packed rows
@pytest.mark.parametrize("layout", ["window", "packed"])
def test_gpu_tiled_window_and_packed_rows_match_float64_reference(backend, layout):
    # 300 tokens, D 64, tiles of 128: a window of 50 keys (dense, two rows), or one packed row of
    # sequences of 100, 0 and 200 tokens (rope restarting per sequence), against float64 run alone.
    from remat import backend as backend_mod

    reason = backend_mod.unavailable_reason(backend, torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    packed = layout == "packed"
    tensors, dy = make_case(torch.bfloat16, batch=1 if packed else 2, n=300, lora=True, head_dim=64)
    names = list(tensors)
    values = [t.cuda() for t in tensors.values()]
    dy = dy.cuda()
    cos, sin = (t.cuda() for t in rope_tables(1 if packed else 2, 300, torch.float32, head_dim=64))
    starts = [0, 100, 100, 300]

    def remat_call(tile):
        def fn(*vals):
            t = dict(zip(names, vals, strict=True))
            lora = ([LoRAAdapter(t["aq"], t["bq_lora"], None, 0.5)], None,
                    [LoRAAdapter(t["av"], t["bv_lora"], None, 2.0)])
            extra = (dict(cu_seqlens=torch.tensor(starts, dtype=torch.int32, device="cuda"), rope=(cos[0], sin[0]))
                     if packed else dict(window=(50, 0), rope=(cos, sin)))
            return remat.norm_attention(t["x"], t["nw"], t["wq"], t["wk"], t["wv"], num_heads=HQ, num_kv_heads=HKV,
                                        keep_qkv=False, lora=lora, backend=backend, tile_tokens=tile, **extra)
        return fn

    def reference(*vals):
        if not packed:
            return reference_fn(names, (cos, sin), window_left=50)(*vals)
        return torch.cat([reference_fn(names, (cos[:, : b - a], sin[:, : b - a]))(vals[0][:, a:b], *vals[1:])
                          for a, b in zip(starts, starts[1:]) if b > a], 1)

    got = grads(remat_call(128), values, dy)
    stock = grads(reference, values, dy)
    want = grads(reference, [t.double() for t in values], dy.double())
    for name, g, s, w in zip(["o", *names], got, stock, want, strict=True):
        assert_within_2x_of_stock(name, g, s, w, torch.bfloat16)


def test_tile_tokens_arguments_are_checked():
    tensors, _ = make_case(torch.float32, lora=True)
    names, values = list(tensors), list(tensors.values())
    x, nw, wq, wk, wv = values[:5]
    base = dict(num_heads=HQ, num_kv_heads=HKV)
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="tile_tokens"):
            remat.norm_attention(x, nw, wq, wk, wv, tile_tokens=bad, **base)
    for extra, match in ((dict(causal=False), "causal"), (dict(causal=False, window=(4, 2)), "causal"),
                         (dict(dropout_p=0.1), "dropout")):
        with pytest.raises(ValueError, match=match):
            remat.norm_attention(x, nw, wq, wk, wv, tile_tokens=8, **base, **extra)
    packed = x[:1]
    cu_seqlens = torch.tensor([0, 20, 37], dtype=torch.int32)
    with pytest.raises(ValueError, match="dropout"):  # packed rows tile, attention dropout does not
        remat.norm_attention(packed, nw, wq, wk, wv, tile_tokens=8, cu_seqlens=cu_seqlens, dropout_p=0.1, **base)
    with pytest.raises(ValueError, match="multiple of 4"):
        remat_fn(names, rope_tables(2, 37, torch.float32), "torch", True, 6, lora_dropout=0.1)(*values)


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("policy", ["speed", "memory"])
def test_patched_models_tile_their_attention_and_match_stock(kind, policy, monkeypatch):
    calls = []
    original = norm_attention_tiled.backward_tiled
    monkeypatch.setattr(norm_attention_tiled, "backward_tiled", lambda *a, **k: calls.append(1) or original(*a, **k))

    def build():
        return gpt2_model() if kind == "gpt2" else causal_lm(kind)

    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(3))

    stock_loss, stock_grads = loss_and_grads(build(), ids)
    model = build()
    remat.patch(model, policy=policy, tile_tokens=4)
    loss, got = loss_and_grads(model, ids)
    layers = model.config.num_hidden_layers if kind != "gpt2" else model.config.n_layer
    assert len(calls) == layers  # every layer's attention backward ran over query tiles
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == stock_grads.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_padded_rows_and_a_sliding_window_run_tiled(kind, monkeypatch):
    calls = []
    original = norm_attention_tiled.backward_tiled
    monkeypatch.setattr(norm_attention_tiled, "backward_tiled", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids, mask, labels = batch()  # right padding: pads are empty queries of dense rows
    _, stock_loss, stock_grads = logits_and_grads(causal_lm(kind), ids, mask, labels)
    model = causal_lm(kind)  # Mistral's window of 4 keys, shorter than a row and than two tiles
    remat.patch(model, policy="memory", tile_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing runs untiled
        _, loss, got = logits_and_grads(model, ids, mask, labels)
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
    for name, grad in got.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=2e-6, msg=name)


def test_attention_dropout_warns_once_and_runs_untiled(monkeypatch):
    calls = []
    original = norm_attention_tiled.backward_tiled
    monkeypatch.setattr(norm_attention_tiled, "backward_tiled", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = causal_lm("llama", attention_dropout=0.1)
    remat.patch(model, policy="memory", tile_tokens=4)
    layers._UNTILED_ATTENTION_WARNED.clear()
    ids, mask, labels = batch()
    with pytest.warns(UserWarning, match="attention sub-block of .* runs untiled .*attention dropout") as record:
        logits_and_grads(model, ids, mask, labels)
    assert len([w for w in record if "runs untiled" in str(w.message)]) == 1 and not calls
