"""tile_tokens="auto" (remat.tiles): the tile rule from the free memory, the same tile reaching each
tiled block (MLP, attention, loss) of a patched model, results equal to the explicit tile, and a
simulated GPU's tile fixed by the device's budget alone (so estimates are reproducible)."""

import pytest
import torch

import remat
from remat import tiles
from remat.autograd import cross_entropy as ce_autograd
from remat.autograd import mlp as mlp_autograd
from remat.autograd import norm_attention as attention_autograd
from remat.backend import simulated_gpu

from helpers import causal_lm

MIB = 2**20


def test_the_rule(monkeypatch):
    free = {"value": None}
    monkeypatch.setattr(tiles, "free_memory_bytes", lambda kind, index: free["value"])
    cpu = torch.device("cpu")
    # 256 MiB on the CPU at 4 KiB per token: 65,536 tokens; untiled when that covers the sequence.
    assert tiles.auto_tile_tokens(10**6, 4096, cpu) == 65536
    assert tiles.auto_tile_tokens(65536, 4096, cpu) == 0
    # Free memory / 8 when smaller: 80 MiB free -> 10 MiB -> 2,560 tokens.
    free["value"] = 80 * MIB
    assert tiles.auto_tile_tokens(10**6, 4096, cpu) == 2560
    # Rounded down to a multiple of 256, never below 256.
    assert tiles.auto_tile_tokens(10**6, 4000, cpu) == 2560
    assert tiles.auto_tile_tokens(10**6, 10 * MIB, cpu) == 256
    assert tiles.resolve_tile_tokens(96, 10**6, 4096, cpu) == 96 and tiles.resolve_tile_tokens(0, 10, 1, cpu) == 0


def test_a_simulated_gpu_takes_its_budget_alone():
    """remat.estimate's fake GPU has no free-memory query: 2 GiB decides. Llama-3.1-8B's MLP (6 x
    14336 x 2 bytes per token) gets 12,288-token tiles, as the module docstring says."""
    with simulated_gpu((9, 0)):
        assert tiles.auto_tile_tokens(10**6, 6 * 14336 * 2, torch.device("cuda")) == 12288


def test_bad_values_raise():
    x = torch.randn(4, 8)
    w = torch.randn(16, 8)
    for bad in ("automatic", "", 0, 1.5):
        with pytest.raises(ValueError, match="tile_tokens"):
            remat.linear_cross_entropy(x, w, torch.zeros(4, dtype=torch.long), tile_tokens=bad)
        with pytest.raises(ValueError, match="tile_tokens"):
            remat.patch(causal_lm("llama"), tile_tokens=bad)


pytest.importorskip("transformers")


def test_a_patched_llama_with_auto_tiles_each_block_by_its_own_rule(monkeypatch):
    """8 MiB free (monkeypatched): a 1 MiB budget per tile. The tiny Llama's blocks (fp32, H 64,
    intermediate 160, 4 heads of 16) state 3,840 (MLP: 6 I s), 1,536 (attention: (3s + 4) Hq D +
    2 s H) and 1,024 (loss: (8 + 2s) H) bytes per token, so over 1,100 tokens they run in tiles of
    256, 512 and 1,024 (seen at each Function), and the step equals stock's."""
    monkeypatch.setattr(tiles, "free_memory_bytes", lambda kind, index: 8 * MIB)
    seen = {"mlp": set(), "attention": set(), "loss": set()}

    def spy_on(cls, name, tile_of):
        original = cls.forward

        def spy(ctx, *args):
            seen[name].add(tile_of(args))
            return original(ctx, *args)

        monkeypatch.setattr(cls, "forward", staticmethod(spy))

    spy_on(mlp_autograd.NormGatedMLPFunction, "mlp", lambda args: args[14])
    spy_on(attention_autograd.NormAttentionFunction, "attention", lambda args: args[15].tile_tokens)
    spy_on(ce_autograd.LinearCrossEntropyFunction, "loss", lambda args: args[11])
    ids = torch.randint(0, 96, (1, 1100), generator=torch.Generator().manual_seed(0))

    def step(model):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    stock_loss, stock_grads = step(causal_lm("llama"))
    model = causal_lm("llama")
    remat.patch(model, tile_tokens="auto")
    loss, grads = step(model)
    assert seen == {"mlp": {256}, "attention": {512}, "loss": {1024}}
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=2e-6, msg=name)
