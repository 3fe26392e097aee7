"""The composed estimate (remat.planning.composed) against the full simulation on a tiny model of
every family remat knows, and of one it does not patch (Gemma), on fake CUDA tensors: stock (four
families) and remat "memory" with tiling and offload (every family). Equal to the byte. (The rest of
the composed estimate's tests: tests/test_estimate_composed.py; a file of its own so that the two
pytest workers share them.)"""

import pytest
from test_estimate_composed import FAMILIES, assert_composed_equals_exact, config_of

import remat
from remat.planning.fit import build_model

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_stock_and_remat_tiled_offloaded(family):
    lora = 0 if family in ("mixtral", "qwen3_moe") else 4
    if family in ("llama", "gpt2", "gemma2", "qwen3_moe"):  # stock: a dense, a LayerNorm, a periodic, an MoE family
        stock = build_model(config_of(family), lora_rank=lora)
        fast, exact = assert_composed_equals_exact(stock, seq_len=300)
        assert fast.peak_bytes == exact.peak_bytes  # to the byte
    model = build_model(config_of(family), lora_rank=lora)
    report = remat.patch(model, policy="memory", offload=True, tile_tokens=32)
    if report.offload is not None:
        report.offload.min_bytes = 0  # the tiny layers' kept tensors are below the default 1 MiB
    fast, exact = assert_composed_equals_exact(model, seq_len=200)  # 7 tiles of 32: 5 run sparse
    assert (fast.peak_bytes, fast.host_bytes) == (exact.peak_bytes, exact.host_bytes)
