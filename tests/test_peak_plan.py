"""remat.patch(policy="auto", budget_bytes=B, seq_len=N): the cheapest configuration whose predicted
device peak fits; the measured peak of a real step (CPU) within the prediction and the budget,
gradients equal to stock's, infeasible budgets refused naming the floor."""

import pytest
import torch
from test_estimate import measured_peak

import remat
from remat.nn.layers import PreNormDecoderLayer
from remat.planning import peak_plan
from remat.replacement import MODULE_KINDS

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, attn_implementation="sdpa")
SEQ = 1024
RNG_STATE_BYTES = torch.get_rng_state().numel()


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def step_grads(model):
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def candidate_peaks():
    peaks = {}
    for candidate in peak_plan.CANDIDATES:
        model = llama()
        peak_plan.configure(model, candidate, MODULE_KINDS, None, peak_plan.DEFAULT_TILE_TOKENS)
        peaks[candidate[0]] = remat.estimate(model, seq_len=SEQ).peak_bytes
    return peaks


def test_each_budget_gets_the_cheapest_fitting_configuration_and_the_real_step_stays_within_it():
    peaks = candidate_peaks()
    names = [c[0] for c in peak_plan.CANDIDATES]
    floor = min(peaks.values())
    stock_loss, stock_grads = step_grads(llama())
    chosen = []
    for budget in sorted({peaks["speed"], peaks["balanced"], peaks["memory"], floor, (peaks["memory"] + floor) // 2},
                         reverse=True):
        model = llama()
        report = remat.patch(model, policy="auto", budget_bytes=budget, seq_len=SEQ)
        plan = report.plan
        expected = next(name for name in names if peaks[name] <= budget)
        assert plan.choice == expected and plan.peak_bytes <= budget
        if plan.base is None:  # every layer on the candidate (a mix is tested below)
            assert plan.peak_bytes == peaks[expected]
        actual = measured_peak(model, 1, SEQ)
        # torch.utils.checkpoint stashes the CPU RNG state (5,056 bytes) per checkpointed layer,
        # made outside the dispatcher, which the estimate does not see (host memory on a GPU).
        unseen = RNG_STATE_BYTES * CONFIG["num_hidden_layers"] if plan.checkpointing else 0
        assert actual <= budget + unseen and abs(actual - plan.peak_bytes) <= 0.01 * actual, (plan.choice, actual)
        loss, grads = step_grads(model)
        torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=2e-6)
        chosen.append(names.index(plan.choice))
        text = plan.explain()
        assert f"{plan.label} " in text and "<- chosen" in text
    assert chosen == sorted(chosen) and len(set(chosen)) >= 3  # tighter budgets, more frugal plans


def layer_settings(model):
    """(policy, checkpointed, offloaded, tile) per fused decoder layer, in forward order."""
    return [(layer.policy, layer.gradient_checkpointing, layer._offload is not None, layer.tile_tokens)
            for layer in model.modules() if isinstance(layer, PreNormDecoderLayer)]


def mixed_peak(candidate, base, layers, mixed_from, seq_len, model_fn=llama):
    model = model_fn()
    peak_plan.configure(model, candidate, MODULE_KINDS, None, peak_plan.DEFAULT_TILE_TOKENS, base=base,
                        mixed_layers=layers, mixed_from=mixed_from)
    return remat.estimate(model, seq_len=seq_len).peak_bytes


@pytest.mark.parametrize("frugal", ["balanced", "memory", "memory+tiled+offload+checkpointed"])
def test_a_budget_between_two_candidates_gets_the_fewest_first_layers_on_the_frugal_one(frugal):
    # Between two candidates' peaks: the first m layers take the frugal one (they keep less, and
    # the first layers' kept tensors are held for most of the step), m the fewest whose estimated
    # step fits; the real step (CPU) within the prediction and the budget, gradients = stock's.
    peaks = candidate_peaks()
    names = [c[0] for c in peak_plan.CANDIDATES]
    candidate = peak_plan.CANDIDATES[names.index(frugal)]
    base = next(c for c in reversed(peak_plan.CANDIDATES[:names.index(frugal)]) if peaks[c[0]] > peaks[frugal])
    budget = (peaks[base[0]] + peaks[frugal]) // 2
    model = llama()
    plan = remat.patch(model, policy="auto", budget_bytes=budget, seq_len=SEQ).plan
    layers = CONFIG["num_hidden_layers"]
    assert (plan.choice, plan.base, plan.mixed_from) == (frugal, base[0], "first") and 0 < plan.mixed_layers < layers
    m = plan.mixed_layers
    tile = min(peak_plan.DEFAULT_TILE_TOKENS, SEQ)
    assert layer_settings(model) == [(c[1], c[4], c[3], tile if c[2] else None)
                                     for c in [candidate] * m + [base] * (layers - m)]
    # The fewest: one layer less on the frugal candidate does not fit; the plan's is its estimate.
    assert mixed_peak(candidate, base, m, "first", SEQ) == plan.peak_bytes <= budget
    assert mixed_peak(candidate, base, m - 1, "first", SEQ) > budget
    actual = measured_peak(model, 1, SEQ)
    unseen = RNG_STATE_BYTES * m if candidate[4] else 0
    assert actual <= budget + unseen and abs(actual - plan.peak_bytes) <= 0.01 * actual
    stock_loss, stock_grads = step_grads(llama())
    loss, grads = step_grads(model)
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=2e-6)
    assert f"{plan.label} " in plan.explain() and f"the first {m} of {layers} layers" in plan.label
    # Recompute FLOPs: the frugal candidate recomputes more per layer; the mix in proportion to its layers.
    recompute = {entry[0]: entry[3][0] for entry in plan.tried}
    assert recompute[frugal] > recompute[base[0]]
    share = m / layers
    assert recompute[plan.label] == pytest.approx(recompute[base[0]] + share * (recompute[frugal] - recompute[base[0]]))


def test_a_budget_below_the_floor_is_refused_naming_it_and_leaves_the_model_alone():
    floor = min(candidate_peaks().values())
    model = llama()
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=f"smallest predicted peak is {floor} bytes"):
        remat.patch(model, policy="auto", budget_bytes=floor - 1, seq_len=SEQ)
    assert [type(m) for m in model.modules()] == before


def test_peak_planning_arguments():
    model = llama()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="from budget_bytes alone"):
        remat.patch(model, policy="auto", budget_bytes=10**9, seq_len=SEQ, example_inputs={"input_ids": ids})
    with pytest.raises(ValueError, match="budget_bytes='auto'"):
        remat.patch(model, policy="auto", budget_bytes="auto", seq_len=SEQ)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="seq_len"):
            remat.patch(model, policy="auto", budget_bytes=10**9, seq_len=bad)
    # A mix: candidates of one prefetch, a count of layers, the first or the last ones.
    *_, checkpointed, no_prefetch = peak_plan.CANDIDATES
    for mix, match in ((dict(base=checkpointed, mixed_layers=2), "prefetch differently"),
                       (dict(base=peak_plan.CANDIDATES[0], mixed_layers=5), "mixed_layers must be"),
                       (dict(base=peak_plan.CANDIDATES[0], mixed_layers=2, mixed_from="middle"), "mixed_from")):
        candidate = no_prefetch if "prefetch" in match else checkpointed
        with pytest.raises(ValueError, match=match):
            peak_plan.configure(model, candidate, MODULE_KINDS, None, 1024, **mix)
        assert not any(isinstance(m, PreNormDecoderLayer) for m in model.modules())


def test_a_fake_cuda_model_is_planned_without_a_gpu_and_offloads_when_it_must():
    from remat.planning.estimator import on_fake_device

    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 6})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    on_fake_device(model)
    results = {}
    for candidate in peak_plan.CANDIDATES:
        peak_plan.configure(model, candidate, MODULE_KINDS, None, peak_plan.DEFAULT_TILE_TOKENS)
        results[candidate[0]] = remat.estimate(model, seq_len=8192)
        remat.unpatch(model)
    tight = results["memory+tiled+offload"].peak_bytes
    report = remat.patch(model, policy="auto", budget_bytes=tight, seq_len=8192)
    assert report.plan.offload and report.plan.host_bytes > 0
    assert report.plan.peak_bytes <= tight
    remat.unpatch(model)
    # A host budget: candidates holding more on the host do not fit either.
    host = results["memory+tiled+offload"].host_bytes
    assert all(r.host_bytes == 0 for name, r in results.items() if "offload" not in name)
    report = remat.patch(model, policy="auto", budget_bytes=tight, seq_len=8192, host_budget_bytes=host)
    assert report.plan.host_bytes <= host and report.plan.peak_bytes <= tight
    remat.unpatch(model)
    # Every candidate that keeps all on the device is over the device budget (offload was chosen).
    assert all(r.peak_bytes > tight for name, r in results.items() if "offload" not in name)
    with pytest.raises(ValueError, match="and 0 host bytes"):
        remat.patch(model, policy="auto", budget_bytes=tight, seq_len=8192, host_budget_bytes=0)
    with pytest.raises(ValueError, match="host_budget_bytes"):
        remat.patch(model, policy="auto", budget_bytes=tight, seq_len=8192, host_budget_bytes=-1)
    with pytest.raises(ValueError, match="host_budget_bytes is for"):
        remat.patch(model, policy="memory", host_budget_bytes=10**9)


def test_a_tiling_mix_takes_the_last_layers_whose_backward_runs_first():
    # memory -> memory+tiled keeps the same bytes and shrinks the backward working set, which counts on
    # top of every earlier layer's kept tensors: the last layers take the tile (fake CUDA, 4 tiles).
    from remat.planning.estimator import on_fake_device

    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 6})

    def fake_llama():
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        return on_fake_device(model)

    seq = 4 * peak_plan.DEFAULT_TILE_TOKENS
    names = [c[0] for c in peak_plan.CANDIDATES]
    base, candidate = peak_plan.CANDIDATES[names.index("memory")], peak_plan.CANDIDATES[names.index("memory+tiled")]
    peaks = [mixed_peak(candidate, base, m, "last", seq, fake_llama) for m in (0, 6)]
    budget = sum(peaks) // 2
    model = fake_llama()
    plan = remat.patch(model, policy="auto", budget_bytes=budget, seq_len=seq).plan
    m = plan.mixed_layers
    assert (plan.choice, plan.base, plan.mixed_from) == ("memory+tiled", "memory", "last") and 0 < m < 6
    assert [s[3] for s in layer_settings(model)] == [None] * (6 - m) + [peak_plan.DEFAULT_TILE_TOKENS] * m
    assert mixed_peak(candidate, base, m, "last", seq, fake_llama) == plan.peak_bytes <= budget
    assert mixed_peak(candidate, base, m - 1, "last", seq, fake_llama) > budget
    # The first m layers tiled instead would not fit.
    assert mixed_peak(candidate, base, m, "first", seq, fake_llama) > budget


def test_a_refused_plan_and_an_unpatched_plan_leave_the_stock_layers_runnable():
    """All or nothing: a budget no candidate fits raises and leaves every stock decoder layer as it
    was (no checkpointing flag without a checkpoint function); so does unpatch after a plan whose
    layers were checkpointed by remat's planner."""
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(5))
    model = llama()
    floor = min(candidate_peaks().values())
    with pytest.raises(ValueError, match="no configuration fits"):
        remat.patch(model, policy="auto", budget_bytes=floor // 2, seq_len=SEQ)
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in model.model.layers)
    reference = model(input_ids=ids, labels=ids).loss
    report = remat.patch(model, policy="auto", budget_bytes=floor, seq_len=SEQ)
    assert report.plan.checkpointing
    remat.unpatch(model)
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in model.model.layers)
    assert torch.equal(model(input_ids=ids, labels=ids).loss, reference)


def test_planning_arguments_without_their_plan_are_refused():
    model = llama()
    with pytest.raises(ValueError, match="seq_len and batch_size are for policy='auto'"):
        remat.patch(model, seq_len=64)
    with pytest.raises(ValueError, match="seq_len and batch_size are for policy='auto'"):
        remat.patch(model, policy="memory", batch_size=2)
    with pytest.raises(ValueError, match="give budget_bytes=<bytes>"):
        remat.patch(model, policy="auto", seq_len=64)
    assert not any(isinstance(m, PreNormDecoderLayer) for m in model.modules())


def test_an_absurd_length_is_refused_in_seconds_naming_the_floor():
    """10**12 tokens: the estimate runs on fake tensors with the tiled loops' first and last tiles
    alone (no list of every tile), so the refusal comes at once."""
    model = llama()
    with pytest.raises(ValueError, match=r"no configuration fits 1073741824 bytes for 1 x 1000000000000 tokens"):
        remat.patch(model, policy="auto", budget_bytes=2**30, seq_len=10**12)
    assert not any(isinstance(m, PreNormDecoderLayer) for m in model.modules())
