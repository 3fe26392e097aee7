"""The composed estimate (remat.planning.composed) against the full simulation it stands for
(``remat.estimate(..., exact=True)``): tiny models of every family on fake CUDA tensors, under stock,
Hugging Face checkpointing, remat's policies, tiling, offload, checkpointing and per-layer mixes;
the sparse tiles against the whole loops; the check that catches a wrong composition; and the
pinned host rounding. The 8B configuration at a few lengths per setup is in
tests/test_estimate_composed_8b.py (marker ``slow``, ``make test-slow``)."""

import pytest
import torch

import remat
from remat.autograd.common import sequence_tiles, sparse_tiles
from remat.planning import composed, peak_plan
from remat.planning.estimator import estimate as simulate
from remat.planning.estimator import pinned_host_bytes
from remat.planning.fit import build_model, set_up
from remat.replacement import MODULE_KINDS, unpatch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

LAYERS = 6  # the fewest that compose: 3, 4 and 5 repetitions simulated, fewer than the model's
COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=8192)
# Per family what its config needs beyond COMMON (Gemma 2/3: alternating local and global layers).
FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=96),
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=96, num_hidden_layers=12,
                   layer_types=["sliding_attention", "full_attention"] * 6),
    "gemma3_text": dict(head_dim=16, sliding_window=96, num_hidden_layers=12,
                        layer_types=["sliding_attention", "full_attention"] * 6),
    "phi3": dict(sliding_window=None, pad_token_id=0),
    "gpt2": dict(n_embd=64, n_layer=LAYERS, n_head=4, n_positions=8192, vocab_size=384),
    "mixtral": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(head_dim=16, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2),
}


def config_of(family, **changes):
    options = dict(FAMILIES[family]) if family == "gpt2" else {**COMMON, **FAMILIES[family]}
    options.update(changes)
    return transformers.AutoConfig.for_model(family, **options)


def assert_composed_equals_exact(model, **kwargs):
    """The composed estimate (checked) equals the full simulation: peak, host, every phase and the
    bytes after the forward within 0.5% (in every case here: to the byte), and it was composed (not
    the whole-model fallback)."""
    fast = remat.estimate(model, **kwargs)
    exact = remat.estimate(model, exact=True, **kwargs)
    assert fast.method.startswith("composed from"), fast.method
    assert fast.peak_bytes == pytest.approx(exact.peak_bytes, rel=5e-3)
    assert fast.host_bytes == pytest.approx(exact.host_bytes, rel=5e-3)
    assert fast.after_forward_bytes == pytest.approx(exact.after_forward_bytes, rel=5e-3)
    for phase, value in exact.phases.items():
        assert fast.phases[phase] == pytest.approx(value, rel=5e-3), phase
    return fast, exact


@pytest.mark.parametrize("setup", ["stock+checkpointing", "remat:speed", "remat:balanced"])
def test_llama_setups_with_adam_full_fine_tuning(setup):
    model = set_up(build_model(config_of("llama")), setup)
    fast, exact = assert_composed_equals_exact(model, seq_len=512, batch_size=2, optimizer="adam")
    assert fast.peak_bytes == exact.peak_bytes


@pytest.mark.parametrize("candidate", peak_plan.CANDIDATES[4:6], ids=lambda c: c[0])
def test_every_tiled_candidate_and_its_mix_with_the_one_before(candidate):
    model = build_model(config_of("llama", num_hidden_layers=8), lora_rank=4)  # runs of 2 and 6 layers
    previous = peak_plan.CANDIDATES[peak_plan.CANDIDATES.index(candidate) - 1]
    mixes = [{}]
    if previous[5] == candidate[5]:
        mixes.append(dict(base=previous, mixed_layers=2, mixed_from="first"))
    for mix in mixes:
        report = peak_plan.configure(model, candidate, MODULE_KINDS, None, 32, **mix)
        if report.offload is not None:
            report.offload.min_bytes = 0
        try:
            fast, exact = assert_composed_equals_exact(model, seq_len=200)  # 7 tiles: 5 run sparse
            assert (fast.peak_bytes, fast.host_bytes) == (exact.peak_bytes, exact.host_bytes)
        finally:
            unpatch(model)


def test_sparse_tiles_reach_the_whole_loops_peak_on_a_tiled_step():
    model = build_model(config_of("llama", num_hidden_layers=2), lora_rank=4)
    remat.patch(model, policy="memory", offload=True, tile_tokens=32)
    whole = simulate(model, seq_len=1000)
    with sparse_tiles():
        sparse = simulate(model, seq_len=1000)
    assert (sparse.peak_bytes, sparse.host_bytes, sparse.phases) == (whole.peak_bytes, whole.host_bytes, whole.phases)
    assert len(sequence_tiles(1000, 32)) == 32
    with sparse_tiles():
        assert sequence_tiles(1000, 32) == [(0, 32), (32, 64), (928, 960), (960, 992), (992, 1000)]
        assert sequence_tiles(150, 32) == [(0, 32), (32, 64), (64, 96), (96, 128), (128, 150)]


def test_a_composition_that_misses_its_check_simulates_the_whole_model():
    """The first 3 layers offloaded, the rest not: told that all 8 are alike, the composition
    extrapolates the wrong run and the check view (5 layers, 3 of them offloaded) catches it."""
    model = build_model(config_of("llama", num_hidden_layers=8), lora_rank=4)
    report = peak_plan.configure(model, peak_plan.CANDIDATES[4], MODULE_KINDS, None, 64,
                                 base=peak_plan.CANDIDATES[3], mixed_layers=3, mixed_from="first")
    report.offload.min_bytes = 0  # the tiny layers' kept tensors are below the default 1 MiB
    composer = composed.Composer(model)
    assert [(start, repeats) for start, _, repeats in composer.runs] == [(0, 3), (3, 5)]
    composer.runs = [(0, 1, 8)]
    with sparse_tiles():
        result = composer.estimate(seq_len=700)
    exact = simulate(model, seq_len=700)
    assert result.method.startswith("simulated whole: the composition missed the check view"), result.method
    assert (result.peak_bytes, result.host_bytes) == (exact.peak_bytes, exact.host_bytes)


def test_the_view_puts_everything_back():
    model = build_model(config_of("gemma2"), lora_rank=4)
    remat.patch(model, policy="memory", offload=True)
    where = composed._find_layers(model)
    layers, config = list(where.layers), model.config
    types = list(config.layer_types)
    indices = [layer._offload_index for layer in layers]
    with composed._view(model, where, [0, 1, 6, 7]):
        assert len(where.owner._modules[where.attribute]) == 4 and config.num_hidden_layers == 4
        assert config.layer_types == [types[i] for i in (0, 1, 6, 7)]
        assert [where.owner._modules[where.attribute][i]._offload_index for i in range(4)] == [0, 1, 2, 3]
    assert where.owner._modules[where.attribute] is where.layers and config.num_hidden_layers == 12
    assert all(a is b for a, b in zip(where.layers, layers, strict=True))
    assert config.layer_types == types and [layer._offload_index for layer in layers] == indices


def test_segments_find_runs_and_periods():
    assert composed.segments([0] * 8) == [(0, 1, 8)]
    assert composed.segments([0, 0, 0, 1, 1, 1, 1, 1]) == [(0, 1, 3), (3, 1, 5)]
    assert composed.segments([0, 1] * 5) == [(0, 2, 5)]
    assert composed.segments([0, 0, 0, 1] * 3 + [0, 0]) == [(0, 4, 3), (12, 1, 2)]
    assert composed.segments([3]) == [(0, 1, 1)]


def test_layers_that_differ_only_in_place_share_a_signature():
    model = build_model(config_of("gemma2"), lora_rank=4)
    layers = composed._find_layers(model).layers
    signatures = [composed.layer_signature(layer) for layer in layers]
    assert signatures[0] == signatures[2] != signatures[1] == signatures[3]  # local, global alternate
    assert composed.Composer(model).runs == [(0, 2, 6)]


class _SumOfLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x.sum()


def test_a_step_with_the_callers_inputs_is_simulated_whole():
    model = _SumOfLinear()
    result = remat.estimate(model, seq_len=4, inputs={"x": torch.randn(4, 8)})
    assert result.method == "simulated whole: the step's inputs are the caller's"
    assert result.peak_bytes == simulate(model, seq_len=4, inputs={"x": torch.randn(4, 8)}).peak_bytes


def test_pinned_host_bytes_follow_the_caching_host_allocators_power_of_two_rounding():
    assert [pinned_host_bytes(n) for n in (0, 1, 4096, 4097, 3 * 2**20)] == [0, 1, 4096, 8192, 4 * 2**20]
    assert pinned_host_bytes(int(8.5 * 2**30)) == 16 * 2**30
    assert pinned_host_bytes(2**33) == 2**33


def test_exact_must_be_a_bool():
    model = build_model(config_of("llama", num_hidden_layers=2))
    with pytest.raises(TypeError, match="exact must be a bool"):
        remat.estimate(model, seq_len=8, exact="yes")
