"""Sequence tiling of the pre-norm gated MLP (remat.norm_mlp(tile_tokens=T), remat.patch(tile_tokens=T))
and of the plain (GPT-2) one (remat.norm_gelu_mlp(tile_tokens=T)): equal to the untiled call under
the 2x rule, the same saved bytes, no [tokens, intermediate] tensor beyond a tile, odd remainders;
a patched GPT-2 runs its MLPs tiled and equals stock."""

import pytest
import torch
import torch.nn.functional as F
from test_mlp import mlp_backends
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import remat
from remat.autograd.lora import LoRAAdapter
from remat.memory import saved_bytes

from helpers import DTYPES, assert_grads_within_2x_of_stock, eager_gated, gpt2_model, grads, loss_and_grads

ROWS, HIDDEN, INTER, RANK = 13, 96, 200, 4


def case(dtype, seed=3, norm="rms", lora=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype)
    nw = (1 + 0.2 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    nb = (0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype) if norm == "layer" else None
    wg, wu = ((torch.randn(INTER, HIDDEN, generator=gen) / 10).to(dtype) for _ in range(2))
    wd = (torch.randn(HIDDEN, INTER, generator=gen) / 14).to(dtype)
    dy = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype)
    adapters = []
    if lora:
        for inp, out in ((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)):
            adapters += [(torch.randn(RANK, inp, generator=gen) / 10).to(dtype),
                         (torch.randn(out, RANK, generator=gen) / 10).to(dtype)]
    return [x, nw, nb, wg, wu, wd, *adapters], dy


def remat_fn(norm, recompute, backend, tile):
    def fn(x, nw, nb, wg, wu, wd, *adapters):
        lora = None
        if adapters:
            lora = tuple([LoRAAdapter(adapters[2 * i], adapters[2 * i + 1], None, 0.5)] for i in range(3))
        return remat.norm_mlp(x, nw, wg, wu, wd, norm_bias=nb, norm=norm, recompute=recompute, lora=lora,
                              backend=backend, tile_tokens=tile)
    return fn


def reference_fn(norm):
    def ref(x, nw, nb, wg, wu, wd, *adapters):
        normed = F.rms_norm(x, (HIDDEN,), nw, 1e-6) if norm == "rms" else F.layer_norm(x, (HIDDEN,), nw, nb, 1e-5)
        if not adapters:
            return eager_gated(normed, wg, wu, wd, None, None, None, "silu")
        a = adapters
        gate = F.linear(normed, wg) + 0.5 * F.linear(F.linear(normed, a[0]), a[1])
        up = F.linear(normed, wu) + 0.5 * F.linear(F.linear(normed, a[2]), a[3])
        h = F.silu(gate) * up
        return F.linear(h, wd) + 0.5 * F.linear(F.linear(h, a[4]), a[5])
    return ref


@pytest.mark.parametrize("tile", [1, 5, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm,recompute,lora", [("rms", "block", False), ("layer", "activation", False),
                                                  ("rms", "block", True), ("rms", "activation", True)],
                         ids=["rms-block", "layer-activation", "rms-block-lora", "rms-activation-lora"])
@pytest.mark.parametrize("backend", mlp_backends())
def test_tiled_norm_mlp_matches_float64_reference(backend, norm, recompute, lora, dtype, tile):
    # 13 rows: tiles of 5 leave a remainder of 3, tiles of 8 one of 5, tiles of 1 are single rows.
    tensors, dy = case(dtype, norm=norm, lora=lora)
    assert_grads_within_2x_of_stock(remat_fn(norm, recompute, backend, tile), reference_fn(norm), tensors, dy, dtype)


@pytest.mark.parametrize("recompute", ["block", "activation"])
def test_tiling_keeps_the_same_saved_bytes(recompute):
    tensors, _ = case(torch.float32, lora=True)
    leaves = [t.requires_grad_() if t is not None else None for t in tensors]
    untiled = saved_bytes(remat_fn("rms", recompute, None, None), *leaves)
    for tile in (1, 5, 13, 100):
        assert saved_bytes(remat_fn("rms", recompute, None, tile), *leaves) == untiled


class LargestTensor(TorchDispatchMode):
    """The most elements any operator output had while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("recompute", ["block", "activation"])
def test_no_tokens_by_intermediate_tensor_beyond_a_tile(recompute):
    rows, tile = 64, 8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, HIDDEN, generator=gen, requires_grad=True)
    nw = torch.ones(HIDDEN, requires_grad=True)
    wg, wu = (torch.randn(INTER, HIDDEN, generator=gen, requires_grad=True) for _ in range(2))
    wd = torch.randn(HIDDEN, INTER, generator=gen, requires_grad=True)
    # Untiled, gate/up/h reach [rows, intermediate]; tiled, the largest per-token tensor is the
    # [rows, hidden] output or input gradient, or a [tile, intermediate] temporary; the weights
    # and their gradients are [intermediate, hidden]. With "activation" the kept gate and up are
    # whole-size by contract.
    assert_intermediates_bounded_by_the_tile(
        lambda tiled: remat.norm_mlp(x, nw, wg, wu, wd, recompute=recompute, tile_tokens=tiled), rows, tile,
        forward_too=recompute == "block")


def assert_intermediates_bounded_by_the_tile(call, rows, tile, forward_too):
    """``call(tile_tokens)`` (an MLP output over ``rows`` tokens), run untiled and tiled, forward and
    backward: untiled, some tensor reaches [rows, INTER] in backward (and in forward, with
    ``forward_too``); tiled, none passes the [rows, HIDDEN], [tile, INTER] or [INTER, HIDDEN] sizes."""
    sizes = {}
    for tiled in (None, tile):
        with LargestTensor() as forward:
            y = call(tiled)
        with LargestTensor() as backward:
            y.backward(torch.ones_like(y))
        sizes[tiled] = (forward.largest, backward.largest)
    assert sizes[None][1] >= rows * INTER
    bound = max(rows * HIDDEN, tile * INTER, INTER * HIDDEN)
    assert sizes[tile][1] <= bound
    if forward_too:
        assert sizes[tile][0] <= bound and sizes[None][0] >= rows * INTER


def dropout_adapters(gen, dtype=torch.float32, p=0.25):
    return tuple([LoRAAdapter((torch.randn(RANK, i, generator=gen) / 10).to(dtype),
                              (torch.randn(o, RANK, generator=gen) / 10).to(dtype), None, 0.5, dropout_p=p)]
                 for i, o in ((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)))


def run_with_seed(fn, tensors, dy, seed=11):
    torch.manual_seed(seed)
    return grads(fn, tensors, dy)


@pytest.mark.parametrize("backend", mlp_backends())
def test_tiles_draw_the_untiled_calls_lora_dropout_masks(backend):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(22, HIDDEN, generator=gen)
    nw = 1 + 0.2 * torch.randn(HIDDEN, generator=gen)
    wg, wu = (torch.randn(INTER, HIDDEN, generator=gen) / 10 for _ in range(2))
    wd = torch.randn(HIDDEN, INTER, generator=gen) / 14
    dy = torch.randn(22, HIDDEN, generator=gen)
    adapters = dropout_adapters(gen)
    flat = [t for per in adapters for adapter in per for t in (adapter.a, adapter.b)]

    def fn(tile):
        def call(x, nw, wg, wu, wd, *flat):
            lora = tuple([adapters[i][0]._replace(a=flat[2 * i], b=flat[2 * i + 1])] for i in range(3))
            return remat.norm_mlp(x, nw, wg, wu, wd, lora=lora, backend=backend, tile_tokens=tile)
        return call

    tensors = [x, nw, wg, wu, wd, *flat]
    untiled = run_with_seed(fn(None), tensors, dy)
    for tile in (4, 8, 12):  # 22 rows: remainders 2, 6, 10
        tiled = run_with_seed(fn(tile), tensors, dy)
        # The output and the input gradient row by row: the same masks, the same operations (a
        # GEMM over fewer rows may block differently: fp32 rounding only).
        torch.testing.assert_close(tiled[0], untiled[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tiled[1], untiled[1], rtol=1e-5, atol=1e-5)
        for got, want in zip(tiled[2:], untiled[2:], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # fp32 sums over tiles: order differs
    # A different mask (another seed) changes the result: the comparison above is not vacuous.
    assert not torch.allclose(run_with_seed(fn(4), tensors, dy, seed=12)[0], untiled[0])


def test_lora_branches_over_row_chunks_equal_one_chunk(monkeypatch):
    from remat.autograd import lora as lora_module

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(37, 40, generator=gen).to(torch.bfloat16)
    w = (torch.randn(24, 40, generator=gen) / 6).to(torch.bfloat16)
    a, b = torch.randn(RANK, 40, generator=gen) / 6, torch.randn(24, RANK, generator=gen) / 6
    dy = torch.randn(37, 24, generator=gen).to(torch.bfloat16)

    def fn(x, w, a, b):
        return remat.lora_linear(x, w, None, [LoRAAdapter(a, b, None, 2.0, dropout_p=0.3)])

    whole = run_with_seed(fn, [x, w, a, b], dy)
    # 4-row chunks of the fp32 temporaries (37 rows: a remainder of 1).
    monkeypatch.setattr(lora_module, "CHUNK_BYTES", 4 * 4 * 40)
    assert len(lora_module._row_chunks(37, 40)) == 10
    chunked = run_with_seed(fn, [x, w, a, b], dy)
    for i, (got, want) in enumerate(zip(chunked, whole, strict=True)):
        if i < 3:  # y, dx, dW: row-wise or untouched by the chunking
            assert torch.equal(got, want), i
        else:  # the adapters' gradients: fp32 sums over the chunks
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_tile_tokens_arguments_are_checked():
    tensors, _ = case(torch.float32)
    x, nw, _, wg, wu, wd = tensors
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="tile_tokens"):
            remat.norm_mlp(x, nw, wg, wu, wd, tile_tokens=bad)
    adapters = dropout_adapters(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="multiple of 4"):
        remat.norm_mlp(x, nw, wg, wu, wd, lora=adapters, tile_tokens=6)


# The plain pre-norm MLP (GPT-2's): proj(gelu(fc(norm(x)))).


def gelu_case(dtype, norm, seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype)
    nw = (1 + 0.2 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    nb = (0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype) if norm == "layer" else None
    w_fc = (torch.randn(INTER, HIDDEN, generator=gen) / 10).to(dtype)
    b_fc = (0.1 * torch.randn(INTER, generator=gen)).to(dtype)
    w_proj = (torch.randn(HIDDEN, INTER, generator=gen) / 14).to(dtype)
    b_proj = (0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    dy = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype)
    return [x, nw, nb, w_fc, b_fc, w_proj, b_proj], dy


def gelu_fn(norm, recompute, backend, tile):
    def fn(x, nw, nb, w_fc, b_fc, w_proj, b_proj):
        return remat.norm_gelu_mlp(x, nw, nb, w_fc, b_fc, w_proj, b_proj, norm=norm, approximate="tanh",
                                   recompute=recompute, backend=backend, tile_tokens=tile)
    return fn


def gelu_reference(norm):
    def ref(x, nw, nb, w_fc, b_fc, w_proj, b_proj):
        normed = F.rms_norm(x, (HIDDEN,), nw, 1e-6) if norm == "rms" else F.layer_norm(x, (HIDDEN,), nw, nb, 1e-5)
        return F.linear(F.gelu(F.linear(normed, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)
    return ref


@pytest.mark.parametrize("tile", [1, 5, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm,recompute", [("layer", "block"), ("rms", "activation")])
@pytest.mark.parametrize("backend", mlp_backends())
def test_tiled_norm_gelu_mlp_matches_float64_reference(backend, norm, recompute, dtype, tile):
    tensors, dy = gelu_case(dtype, norm)
    assert_grads_within_2x_of_stock(gelu_fn(norm, recompute, backend, tile), gelu_reference(norm), tensors, dy, dtype)


@pytest.mark.parametrize("recompute", ["block", "activation"])
def test_tiled_norm_gelu_mlp_keeps_the_same_bytes_and_no_intermediate_beyond_a_tile(recompute):
    rows, tile = 64, 8
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(rows, HIDDEN, generator=gen), torch.ones(HIDDEN), torch.zeros(HIDDEN),
               torch.randn(INTER, HIDDEN, generator=gen), torch.zeros(INTER), torch.randn(HIDDEN, INTER, generator=gen),
               torch.zeros(HIDDEN)]
    leaves = [t.requires_grad_() for t in tensors]
    untiled_bytes = saved_bytes(gelu_fn("layer", recompute, None, None), *leaves)
    assert saved_bytes(gelu_fn("layer", recompute, None, tile), *leaves) == untiled_bytes
    # Untiled, fc's output and the activation reach [rows, intermediate]; tiled, no per-token
    # tensor but the [rows, hidden] ones and [tile, intermediate] temporaries (with "activation",
    # fc's output is kept whole by contract).
    assert_intermediates_bounded_by_the_tile(lambda tiled: gelu_fn("layer", recompute, None, tiled)(*leaves), rows,
                                             tile, forward_too=recompute == "block")


def test_norm_gelu_mlp_tile_tokens_are_checked():
    tensors, _ = gelu_case(torch.float32, "layer")
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="tile_tokens"):
            gelu_fn("layer", "block", None, bad)(*tensors)


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("policy", ["speed", "memory"])
def test_patched_gpt2_tiles_its_mlps_and_matches_stock(policy, monkeypatch):
    from remat.autograd import mlp as mlp_module

    rows_seen = []
    original = mlp_module._gelu_mlp_rows_backward
    monkeypatch.setattr(mlp_module, "_gelu_mlp_rows_backward",
                        lambda ctx, x, *a: rows_seen.append(x.shape[0]) or original(ctx, x, *a))
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(3))
    stock_loss, stock_grads = loss_and_grads(gpt2_model(), ids)
    model = gpt2_model()
    remat.patch(model, policy=policy, tile_tokens=4)
    loss, got = loss_and_grads(model, ids)
    # 46 rows per layer: eleven tiles of 4 and one of 2, in every layer's backward.
    assert sorted(rows_seen) == sorted(([4] * 11 + [2]) * model.config.n_layer)
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == stock_grads.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=2e-6, msg=name)
