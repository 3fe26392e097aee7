"""The fused loss over token tiles (remat.linear_cross_entropy(tile_tokens=T), and through
remat.patch(tile_tokens=T) on a causal LM): loss, dx, dW and db against the float64 reference
under the 2x rule (odd remainders, every reduction, the full set of options, fp32 and bf16, every
CPU backend), saved bytes unchanged, the in-op working set bounded by the tile (allocator events),
and a patched Llama's tiled loss equal to stock."""

import pytest
import torch
from test_cross_entropy import BACKENDS, IGNORE, REDUCTIONS, VARIANTS, _allocations, make_case, run, stock_loss
from torch import nn

import remat
from remat.autograd import cross_entropy as ce_autograd
from remat.memory import saved_bytes

from _checks import assert_within_2x_of_stock
from helpers import causal_lm, loss_and_grads

# 37 tokens in tiles of 10: three whole tiles and a remainder of 7; vocabulary 1000 in chunks of 256.
TOKENS, HIDDEN, VOCAB, CHUNK, TILE = 37, 48, 1000, 256, 10


def _cases():
    cases = []
    for backend in BACKENDS:
        for dtype in (torch.float32, torch.bfloat16):
            for reduction in REDUCTIONS:
                for variant in ("plain", "everything"):
                    if backend == "triton" and (reduction != "mean" or dtype != torch.bfloat16):
                        continue  # the interpreter is slow: one case
                    cases.append(pytest.param(backend, dtype, reduction, variant,
                                              id=f"{backend}-{str(dtype)[6:]}-{reduction}-{variant}"))
    return cases


def spy_on_the_op_rows(monkeypatch):
    """A list that records ("fwd" | "bwd", rows) for every call of the cross-entropy op from now on."""
    calls = []
    original = ce_autograd.ops_for

    def spy(block, backend):
        ops = original(block, backend)
        return type(ops)(lambda *a: calls.append(("fwd", a[0].shape[0])) or ops.linear_cross_entropy_fwd(*a),
                         lambda *a: calls.append(("bwd", a[0].shape[0])) or ops.linear_cross_entropy_bwd(*a))

    monkeypatch.setattr(ce_autograd, "ops_for", spy)
    return calls


@pytest.mark.parametrize("backend,dtype,reduction,variant", _cases())
def test_tiled_loss_matches_the_float64_reference(backend, dtype, reduction, variant):
    options = dict(VARIANTS[variant])
    bias, ignore, logit_scale = options.pop("bias", False), options.pop("ignore", 0), options.pop("logit_scale", 1.0)
    x, w, b, t = make_case((TOKENS,), HIDDEN, VOCAB, dtype, bias=bias, ignore=ignore, logit_scale=logit_scale)
    g = torch.Generator().manual_seed(7)
    grad = torch.rand(TOKENS, generator=g) + 0.5 if reduction == "none" else torch.tensor(0.75)
    options["reduction"] = reduction

    def tiled(x, w, t, b, **kw):
        return remat.linear_cross_entropy(x, w, t, b, chunk_size=CHUNK, tile_tokens=TILE, backend=backend, **kw)

    got = run(tiled, x, w, b, t, grad, **options)
    stock = run(stock_loss, x, w, b, t, grad, **options)
    ref = run(stock_loss, *(v.double() if v is not None else None for v in (x, w, b)), t, grad.double(), **options)
    for name, value, stock_value, ref_value in zip(["loss", "dx", "dw", "db"], got, stock, ref):
        assert value.dtype == (torch.float32 if name == "loss" else dtype), name
        assert_within_2x_of_stock(name, value, stock_value, ref_value, dtype)
    if ignore:
        assert (got[1][t == IGNORE] == 0).all()


def test_tiles_reach_the_op_and_a_tile_past_the_tokens_runs_untiled(monkeypatch):
    """The op runs once per tile in each pass (ceil(37 / 10) = 4); tile_tokens >= tokens is the
    untiled call; bad values raise before any kernel."""
    x, w, _, t = make_case((TOKENS,), HIDDEN, VOCAB, torch.float32)
    x.requires_grad_()
    seen = spy_on_the_op_rows(monkeypatch)
    remat.linear_cross_entropy(x, w, t, tile_tokens=TILE, backend="torch").backward()
    assert seen == [("fwd", 10)] * 3 + [("fwd", 7)] + [("bwd", 10)] * 3 + [("bwd", 7)]
    seen.clear()
    remat.linear_cross_entropy(x, w, t, tile_tokens=TOKENS, backend="torch").backward()
    assert seen == [("fwd", TOKENS), ("bwd", TOKENS)]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="tile_tokens"):
            remat.linear_cross_entropy(x, w, t, tile_tokens=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_saved_bytes_are_unchanged(backend):
    x = torch.randn(2, 13, 40, dtype=torch.bfloat16, requires_grad=True)
    w = nn.Parameter(torch.randn(700, 40, dtype=torch.bfloat16))
    t = torch.randint(0, 700, (2, 13))
    for tile in (None, 4):
        def fn(x, w, t, tile=tile):
            return remat.linear_cross_entropy(x, w, t, chunk_size=256, tile_tokens=tile, backend=backend)
        assert saved_bytes(fn, x, w, t) == 26 * (2 * 40 + 12)


# 1024 tokens, H 64, V 4000 in chunks of 512, tiles of 64: an fp32 chunk of logits is 2 MiB
# untiled and 128 KiB per tile; dx [T, H] in fp32 is 256 KiB.
MEM_T, MEM_H, MEM_V, MEM_CHUNK, MEM_TILE = 1024, 64, 4000, 512, 64


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_the_working_set_is_bounded_by_the_tile(backend):
    """A frozen lm_head (LoRA): forward + backward allocate nothing larger than one tile's fp32
    chunk of logits or dx itself (profiler allocator events, which see inside the C++ op), where
    the untiled call allocates a whole [T, C] fp32 chunk; the peak above the start drops too."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(MEM_T, MEM_H, generator=g, requires_grad=True)
    w = torch.randn(MEM_V, MEM_H, generator=g)
    t = torch.randint(0, MEM_V, (MEM_T,), generator=g)

    def step(tile):
        def go():
            loss = remat.linear_cross_entropy(x, w, t, chunk_size=MEM_CHUNK, tile_tokens=tile, backend=backend)
            torch.autograd.grad(loss, x)
        return _allocations(go)

    largest, peak = step(None)
    tiled_largest, tiled_peak = step(MEM_TILE)
    assert largest >= MEM_T * MEM_CHUNK * 4  # the measurement sees a whole chunk when untiled
    assert tiled_largest <= max(MEM_TILE * MEM_CHUNK * 4, MEM_T * MEM_H * 4)
    assert tiled_peak < peak / 2


transformers = pytest.importorskip("transformers")


def test_a_patched_llama_tiles_its_loss_and_matches_stock(monkeypatch):
    """remat.patch(tile_tokens=8): the causal LM's fused loss runs over tiles of 8 tokens (46 tokens:
    six op calls per pass, counted) and the loss and every gradient equal stock's; unpatch
    removes the setting."""
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(3))

    stock_loss, stock_grads = loss_and_grads(causal_lm("llama"), ids)
    model = causal_lm("llama")
    remat.patch(model, tile_tokens=8)
    calls = spy_on_the_op_rows(monkeypatch)
    loss, got = loss_and_grads(model, ids)
    assert calls == [("fwd", 8)] * 5 + [("fwd", 6)] + [("bwd", 8)] * 5 + [("bwd", 6)]
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
    for name, grad in got.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=2e-6, msg=name)
    remat.unpatch(model)
    assert "_remat_loss_tile_tokens" not in model.__dict__
