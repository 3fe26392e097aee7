"""The composed estimate on the Llama-3.1-8B configuration (benchmarks/configs/llama-3.1-8b.json,
bf16, LoRA r=32 on every linear layer unless said) against the full simulation of all 32 layers
and every tile, at a few lengths per setup. Slow (minutes per exact estimate at 131,072 tokens):
marked ``slow``, skipped by ``make test``, run by ``make test-slow``."""

import json
from pathlib import Path

import pytest

import remat
from remat.planning import peak_plan
from remat.planning.fit import build_model, set_up
from remat.replacement import MODULE_KINDS

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "llama-3.1-8b.json"


def llama_8b(lora_rank=32):
    config = transformers.AutoConfig.for_model(**json.loads(CONFIG.read_text()))
    return build_model(config, lora_rank=lora_rank)


def assert_within_half_a_percent(model, **kwargs):
    fast = remat.estimate(model, **kwargs)
    exact = remat.estimate(model, exact=True, **kwargs)
    assert fast.method.startswith("composed from"), fast.method
    assert fast.peak_bytes == pytest.approx(exact.peak_bytes, rel=5e-3)
    assert fast.host_bytes == pytest.approx(exact.host_bytes, rel=5e-3)
    return fast, exact


@pytest.mark.parametrize(("setup", "seq_len"), [("stock", 8192), ("stock", 32768), ("stock+checkpointing", 32768),
                                                ("remat:speed", 16384), ("remat:memory", 65536)])
def test_fixed_setups(setup, seq_len):
    assert_within_half_a_percent(set_up(llama_8b(), setup), seq_len=seq_len)


@pytest.mark.parametrize("candidate", [4, 5, 6])
def test_tiled_offloaded_candidates_at_131072_tokens(candidate):
    model = llama_8b()
    peak_plan.configure(model, peak_plan.CANDIDATES[candidate], MODULE_KINDS, None, peak_plan.DEFAULT_TILE_TOKENS)
    assert_within_half_a_percent(model, seq_len=131072)


def test_the_per_layer_mix_at_131072_tokens():
    """14 of 32 layers offloaded, the rest tiled on the device (the plan of the long-context guide)."""
    model = llama_8b()
    peak_plan.configure(model, peak_plan.CANDIDATES[4], MODULE_KINDS, None, peak_plan.DEFAULT_TILE_TOKENS,
                        base=peak_plan.CANDIDATES[3], mixed_layers=14, mixed_from="first")
    assert_within_half_a_percent(model, seq_len=131072)


def test_full_fine_tuning_with_adam():
    model = set_up(llama_8b(lora_rank=0), "remat:memory")
    assert_within_half_a_percent(model, seq_len=16384, optimizer="adam")
