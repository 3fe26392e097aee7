"""remat.plan_model / remat.patch(policy="auto"): one memory budget for a whole model.

Real tiny Hugging Face models (Llama, GPT-2; six layers): for budgets from the stock model's peak
down to the floor, the peak of saved bytes of a real training step (saved-tensor hooks, forward and
backward) never exceeds the budget and is at most the plan's prediction and at least the
prediction less the bytes several layers share (the rope tables, which the prediction counts as
always alive: an upper bound); loss and every gradient
match the stock model under the 2x rule against float64. Optimality: the dynamic program's cost
equals an exhaustive search over the same choices (measured four-layer costs and random
heterogeneous costs) and is never above a uniform policy or uniform layer checkpointing that fits.
Infeasible budgets raise with the floor; a budget at or above stock keeps every layer stock.
"""

import dataclasses
import itertools
import random

import pytest
import torch

import remat
from remat.memory import PeakSavedBytes
from remat.planning import model_plan
from remat.planning.model_plan import LayerCosts, ModelCosts, Span, Taped

from _checks import assert_within_2x_of_stock
from helpers import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, batch, causal_lm, logits_and_grads

transformers = pytest.importorskip("transformers")

LAYERS = 6


def gpt2(dtype=torch.float32, layers=LAYERS, seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=layers, vocab_size=96, n_positions=32,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
                                     attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).to(dtype)


def build(kind, dtype=torch.float32, layers=LAYERS):
    if kind == "gpt2":
        return gpt2(dtype, layers)
    return causal_lm(kind, dtype, num_hidden_layers=layers)


def example():
    ids, mask, labels = batch()
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def measured_peak(model, inputs):
    with PeakSavedBytes() as peak:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    return peak.peak


def all_stock(costs):
    return [Taped(i, "stock") for i in range(len(costs.layers))]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_budgets_from_stock_to_floor_hold_and_match_stock(kind):
    inputs = example()
    costs = model_plan.measure_model_costs(build(kind), inputs)
    # The unpatched model's peak: every layer stock, Hugging Face's loss.
    stock_loss = next(c for c in costs.loss_choices if c.name == "stock")
    stock_peak, _ = model_plan.peak_and_cost(costs.with_loss(stock_loss), all_stock(costs))
    floor = model_plan.smallest_feasible_budget(costs)
    assert floor < stock_peak / 5
    ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
    reference = logits_and_grads(build(kind, torch.float64), ids, mask, labels)
    stock = logits_and_grads(build(kind), ids, mask, labels)
    seen_choices = set()
    for budget in (stock_peak, (stock_peak + 2 * floor) // 3, (stock_peak + 10 * floor) // 11, floor):
        model = build(kind)
        report = remat.patch(model, policy="auto", budget_bytes=budget, example_inputs=inputs)
        plan = report.plan
        assert plan.predicted_peak_bytes <= budget
        seen_choices |= {type(d).__name__ + ("" if isinstance(d, Span) else d.choice) for d in plan.decisions}
        seen_choices |= {"long span" for s, e in plan.spans() if e - s > 1}
        seen_choices.add(f"loss {plan.loss}")
        peak = measured_peak(model, inputs)
        low = plan.predicted_peak_bytes - costs.shared_bytes
        assert low <= peak <= plan.predicted_peak_bytes <= budget, (budget, peak, plan.explain())
        got = logits_and_grads(model, ids, mask, labels)
        assert_within_2x_of_stock("loss", got[1].reshape(1), stock[1].reshape(1), reference[1].reshape(1),
                                  torch.float32)
        for name in reference[2]:
            assert_within_2x_of_stock(name, got[2][name], stock[2][name], reference[2][name], torch.float32)
    # The budgets exercised stock layers, fused taped layers and checkpointed spans of several layers.
    assert {"Tapedstock", "Span", "long span", "loss stock", "loss fused"} <= seen_choices
    assert seen_choices & {"Tapedspeed", "Tapedbalanced", "Tapedmemory"}


def test_the_loss_is_planned_fused_or_stock_and_runs_as_planned(monkeypatch):
    inputs = example()
    costs = model_plan.measure_model_costs(build("llama"), inputs)
    fused, stock = costs.loss_choices
    assert (fused.name, stock.name) == ("fused", "stock")
    vocab, hidden = build("llama").lm_head.weight.shape
    assert fused.cost == 2 * inputs["input_ids"].numel() * hidden * vocab and stock.cost == 0
    assert stock.post_bytes > fused.post_bytes  # the stock loss keeps the logits
    unpatched_peak = model_plan.peak_and_cost(costs.with_loss(stock), all_stock(costs))[0]

    # A budget that holds every stock layer and the logits: nothing to recompute, nothing fused.
    model = build("llama")
    plan = remat.patch(model, policy="auto", budget_bytes=unpatched_peak, example_inputs=inputs).plan
    assert plan.loss == "stock" and plan.predicted_cost == 0 and "loss: stock" in plan.explain()
    assert measured_peak(model, inputs) <= plan.predicted_peak_bytes <= unpatched_peak
    assert model(**inputs).logits is not None
    # Every layer under "speed" with Hugging Face's loss fits: the fused loss would save bytes the
    # budget does not need and recompute the logits (here more FLOPs than all the layers' speed).
    speed = [Taped(i, "speed") for i in range(len(costs.layers))]
    budget = model_plan.peak_and_cost(costs.with_loss(stock), speed)[0]
    plan = model_plan.plan_for_costs(costs, budget)
    fused_plan = model_plan.plan_for_costs(costs.with_loss(fused), budget)
    assert fused.cost > fused_plan.predicted_cost
    assert plan.loss == "stock" and plan.decisions == tuple(speed)
    assert plan.predicted_cost == fused_plan.predicted_cost
    # The floor keeps no logits: the plan's loss is fused, its recompute counted, and it runs fused.
    floor = model_plan.smallest_feasible_budget(costs)
    assert floor == model_plan.smallest_feasible_budget(costs.with_loss(fused))
    model = build("llama")
    plan = remat.patch(model, policy="auto", budget_bytes=floor, example_inputs=inputs).plan
    assert plan.loss == "fused" and plan.loss_cost == fused.cost
    assert plan.predicted_cost == model_plan.peak_and_cost(plan.costs, plan.decisions)[1] + fused.cost
    assert model(**inputs).logits is None
    # Per-token budgets re-plan the layers at run time: the loss stays fused, not planned.
    model = build("llama")
    plan = remat.patch(model, policy="auto", budget_bytes_per_token=unpatched_peak // inputs["input_ids"].numel(),
                       example_inputs=inputs).plan
    assert plan.loss is None and plan.doubled_costs.loss_choices is None and model(**inputs).logits is None
    # Without labels (or in eval mode) no fused loss runs in the measured forward: nothing to choose.
    unlabelled = {key: value for key, value in inputs.items() if key != "labels"}
    assert model_plan.measure_model_costs(build("llama"), unlabelled).loss_choices is None
    assert model_plan.measure_model_costs(build("llama").eval(), inputs).loss_choices is None
    # A per-token plan made with max_span=1 re-plans longer batches with spans of one layer.
    model = build("llama")
    per_token = (model_plan.smallest_feasible_budget(costs) + unpatched_peak) // 2 // inputs["input_ids"].numel()
    plan = remat.patch(model, policy="auto", budget_bytes_per_token=per_token, example_inputs=inputs,
                       max_span=1).plan
    assert plan.max_span == 1
    limits, plan_for_costs = [], model_plan.plan_for_costs

    def recording(*args, **kwargs):
        limits.append(kwargs.get("max_span"))
        return plan_for_costs(*args, **kwargs)

    monkeypatch.setattr(model_plan, "plan_for_costs", recording)
    model(**model_plan.lengthened_example(inputs)).loss.backward()
    assert limits == [1]


def may_span(costs, start, end):
    """Whether layers [start, end) may form a span: each fusable and allowed in spans, each after
    the first called with the same arguments as the one before it."""
    return all(costs.layers[i].span_cost and costs.layers[i].may_span
               and (i == start or costs.layers[i].same_arguments_as_previous) for i in range(start, end))


def exhaustive(costs, budget):
    """The least predicted cost over every plan of the choice set, by enumeration, with the peak
    and cost computed here (independently of the planner's code). The all-stock plan is priced
    by its own measurement (``costs.all_stock``) where there is one."""
    n, base = len(costs.layers), costs.pre_bytes + costs.shared_bytes
    best = float("inf")
    if costs.all_stock is not None:
        kept, cost, outside = costs.all_stock
        if sum(outside) + sum(kept) <= budget:
            best = sum(cost)
    for cuts in itertools.product((False, True), repeat=n - 1):
        groups, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                groups.append((start, i))
                start = i
        groups.append((start, n))
        # Each group is either one taped layer or a checkpointed span.
        for kinds in itertools.product(("taped", "span"), repeat=len(groups)):
            if any(k == "taped" and e - s > 1 for k, (s, e) in zip(kinds, groups)):
                continue
            if any(k == "span" and not may_span(costs, s, e) for k, (s, e) in zip(kinds, groups)):
                continue
            options = []
            for k, (s, e) in zip(kinds, groups):
                layer_options = [list(costs.layers[i].kept if k == "taped" else costs.layers[i].span_cost)
                                 for i in range(s, e)]
                options.append(list(itertools.product(*layer_options)))
            for picks in itertools.product(*options):
                held, peak, total = 0, 0, 0.0
                for k, (s, e), chosen in zip(kinds, groups, picks):
                    layers = costs.layers[s:e]
                    if k == "taped":
                        held += layers[0].kept[chosen[0]]
                        total += layers[0].cost[chosen[0]]
                    else:
                        peak = max(peak, base + held + sum(x.kept[c] for x, c in zip(layers, chosen)))
                        held += layers[0].input_bytes
                        total += sum(x.span_cost[c] for x, c in zip(layers, chosen))
                all_stock = all(k == "taped" and c == ("stock",) for k, c in zip(kinds, picks))
                if costs.all_stock is not None and all_stock:
                    continue
                if max(peak, base + costs.post_bytes + held) <= budget:
                    best = min(best, total)
    return best


def uniform_plans(costs):
    """Every layer taped with one choice, or checkpointed every k layers with one inner policy
    (where every layer can take it)."""
    n = len(costs.layers)
    for policy in ("stock", "speed", "balanced", "memory"):
        if not all(policy in layer.kept for layer in costs.layers):
            continue
        yield [Taped(i, policy) for i in range(n)]
        for k in range(1, n + 1):  # checkpoint every k layers, inner layers under the policy
            spans = [Span(s, min(s + k, n), (policy,) * (min(s + k, n) - s)) for s in range(0, n, k)]
            if policy != "stock" and all(may_span(costs, span.start, span.end) for span in spans):
                yield spans


def check_optimal(costs):
    if costs.loss_choices is not None:  # each loss alone, then the choice between them
        variants = [(costs.with_loss(choice), choice.cost) for choice in costs.loss_choices]
        for variant, _ in variants:
            check_optimal(variant)
        floor = model_plan.smallest_feasible_budget(costs)
        top = max(model_plan.peak_and_cost(variant, all_stock(variant))[0] for variant, _ in variants)
        for budget in sorted({floor, top, *random.Random(1).sample(range(floor, top + 1), 8)}):
            best = min(exhaustive(variant, budget) + loss_cost for variant, loss_cost in variants)
            plan = model_plan.plan_for_costs(costs, budget)
            assert plan.predicted_peak_bytes <= budget
            assert plan.predicted_cost == pytest.approx(best, rel=1e-12, abs=0)
        return
    stock_peak, _ = model_plan.peak_and_cost(costs, all_stock(costs))
    floor = model_plan.smallest_feasible_budget(costs)
    assert exhaustive(costs, floor) < float("inf") and exhaustive(costs, floor - 1) == float("inf")
    for budget in sorted({floor, stock_peak, *random.Random(0).sample(range(floor, stock_peak + 1), 12)}):
        plan = model_plan.plan_for_costs(costs, budget)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_cost == pytest.approx(exhaustive(costs, budget), rel=1e-12, abs=0)
        for uniform in uniform_plans(costs):
            peak, cost = model_plan.peak_and_cost(costs, uniform)
            if peak <= budget:
                assert plan.predicted_cost <= cost * (1 + 1e-12)


def test_plan_is_optimal_on_a_measured_four_layer_model():
    check_optimal(model_plan.measure_model_costs(build("llama", layers=4), example()))


@pytest.mark.parametrize("seed", range(4))
def test_plan_is_optimal_on_random_heterogeneous_costs(seed):
    rng = random.Random(seed)
    layers = []
    for i in range(5):
        stock = rng.randint(500, 2000)
        fusable = i != 2 or seed % 2 == 0  # a layer remat cannot take: stock only, never in a span
        kept, cost, span_cost = {"stock": stock}, {"stock": 0.0}, {}
        if fusable:
            speed = rng.randint(200, stock)
            balanced, memory = rng.randint(100, speed), None
            memory = rng.randint(50, balanced)
            kept.update(speed=speed, balanced=balanced, memory=memory)
            cost.update(speed=rng.uniform(1, 5), balanced=rng.uniform(5, 20), memory=rng.uniform(20, 40))
            forward = rng.uniform(50, 100)
            span_cost = {p: forward + cost[p] for p in ("speed", "balanced", "memory")}
        # Seeds 2 and 3: layer 3 never in a span (MoE router logits), layer 1 called with other
        # arguments than layer 0 (Gemma 3's layer types).
        layers.append(LayerCosts(f"layer{i}", kept, cost, span_cost, rng.randint(20, 60),
                                 may_span=seed < 2 or i != 3, same_arguments_as_previous=seed < 2 or i != 1))
    # Odd seeds: the all-stock plan measured on its own (as when patching reroutes stock attention).
    all_stock = None
    if seed % 2:
        all_stock = (tuple(x.kept["stock"] + rng.randint(0, 300) for x in layers), (0.0,) * len(layers),
                     (rng.randint(0, 50), rng.randint(0, 50), rng.randint(0, 600)))
    costs = ModelCosts(tuple(layers), rng.randint(0, 50), rng.randint(0, 50), rng.randint(0, 300), (1, 1),
                       "flops", all_stock)
    check_optimal(costs)
    # The loss as a choice: a fused loss (these post bytes, a recompute cost) or a stock one keeping
    # more (up to a layer's stock bytes; its all-stock plan measured on its own on odd seeds).
    stock_post = costs.post_bytes + rng.randint(1, 2000)
    stock_outside = None if all_stock is None else (*all_stock[2][:2], all_stock[2][2] + rng.randint(1, 2000))
    fused_outside = None if all_stock is None else all_stock[2]
    check_optimal(dataclasses.replace(costs, loss_choices=(
        model_plan.LossChoice("fused", costs.post_bytes, rng.uniform(1, 80), fused_outside),
        model_plan.LossChoice("stock", stock_post, 0.0, stock_outside))))


def test_infeasible_budget_names_the_floor_and_big_budget_keeps_stock():
    inputs = example()
    model = build("llama", layers=2)
    costs = model_plan.measure_model_costs(model, inputs)
    floor = model_plan.smallest_feasible_budget(costs)
    with pytest.raises(ValueError, match=f"smallest feasible budget is {floor} bytes"):
        remat.patch(model, policy="auto", budget_bytes=floor - 1, example_inputs=inputs)
    assert not getattr(model, "_remat_patched", False)
    stock_loss = next(choice for choice in costs.loss_choices if choice.name == "stock")
    stock_peak, _ = model_plan.peak_and_cost(costs.with_loss(stock_loss), all_stock(costs))
    report = remat.patch(model, policy="auto", budget_bytes=10 * stock_peak, example_inputs=inputs)
    assert report.plan.predicted_cost == 0 and report.plan.loss == "stock"
    assert {d.choice for d in report.plan.decisions} == {"stock"}
    assert [type(layer).__name__ for layer in model.model.layers] == ["LlamaDecoderLayer"] * 2
    assert measured_peak(model, inputs) <= stock_peak


def test_plan_model_does_not_patch_and_per_token_budgets():
    inputs = example()
    model = build("llama", layers=3)
    layers = list(model.model.layers)
    model.model.layers[0].mlp.up_proj.weight.grad = torch.ones_like(model.model.layers[0].mlp.up_proj.weight)
    rng = torch.get_rng_state()
    tokens = inputs["input_ids"].numel()
    plan = remat.plan_model(model, inputs, budget_bytes_per_token=4000)
    assert list(model.model.layers) == layers and not getattr(model, "_remat_patched", False)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight.grad, torch.ones_like(layers[0].mlp.up_proj.weight))
    assert plan.budget_bytes == 4000 * tokens
    same = remat.plan_model(model, inputs, budget_bytes=4000 * tokens)
    assert same.decisions == plan.decisions
    text = plan.explain()
    assert "model.layers.2" in text and f"budget {4000 * tokens}" in text


def test_bad_arguments_raise():
    inputs = example()
    model = build("llama", layers=2)
    with pytest.raises(ValueError, match="policy='auto'"):
        remat.patch(model, policy="memory", budget_bytes=10)
    with pytest.raises(ValueError, match="max_span"):
        remat.patch(model, policy="memory", max_span=1)
    with pytest.raises(ValueError, match="exactly one"):
        remat.plan_model(model, inputs, budget_bytes=10, budget_bytes_per_token=1)
    with pytest.raises(ValueError, match="exactly one"):
        remat.plan_model(model, inputs)
    with pytest.raises(TypeError, match="example_inputs"):
        remat.plan_model(model, inputs["input_ids"], budget_bytes=10)
    with pytest.raises(ValueError, match="cost"):
        remat.plan_model(model, inputs, budget_bytes=10, cost="joules")
    with pytest.raises(TypeError, match="budget_bytes"):
        remat.plan_model(model, inputs, budget_bytes=1.5)
    with pytest.raises(ValueError, match="modules"):
        remat.patch(model, policy="auto", budget_bytes=10, example_inputs=inputs, modules=("norm",))
    with pytest.raises(ValueError, match="found no decoder layer"):
        remat.plan_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"input": torch.ones(1, 2)}, budget_bytes=1)


def span_model(kind="llama"):
    """A planned model at its floor (which holds multi-layer spans), with its example."""
    inputs = example()
    model = build(kind)
    floor = model_plan.smallest_feasible_budget(model_plan.measure_model_costs(model, inputs))
    report = remat.patch(model, policy="auto", budget_bytes=floor, example_inputs=inputs)
    assert any(e - s > 1 for s, e in report.plan.spans()), report.plan.explain()
    return model, inputs, report


def test_planned_model_refuses_larger_batches_hidden_states_and_gradient_checkpointing():
    model, inputs, _ = span_model()
    shorter = {k: v[:, :7] for k, v in inputs.items()}
    model(**shorter).loss.backward()  # smaller batches fit the plan
    longer = {k: torch.cat([v, v], 0) for k, v in inputs.items()}
    with pytest.raises(ValueError, match="re-plan"):
        model(**longer)
    with pytest.raises(ValueError, match="hidden states"):
        model(**inputs, output_hidden_states=True)
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        model(**inputs)


def test_planned_model_with_spans_compiles():
    torch._dynamo.reset()
    model, inputs, _ = span_model()
    eager_loss = model(**inputs).loss
    eager_loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # AOT autograd traces forward and backward; one graph: the spans are checkpoint regions there.
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(**inputs).loss
    loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[name])


def test_time_costs_plan_within_budget():
    inputs = example()
    model = build("gpt2", layers=2)
    plan = remat.plan_model(model, inputs, budget_bytes=10**9, cost="time")
    assert plan.costs.unit == "time"
    assert all(c > 0 for layer in plan.costs.layers for c in layer.cost.values())
    floor = model_plan.smallest_feasible_budget(plan.costs)
    report = remat.patch(model, policy="auto", budget_bytes=floor, example_inputs=inputs, cost="time")
    assert measured_peak(model, inputs) <= floor
    assert "seconds" in report.plan.explain()


def test_lora_model_plans_within_budget_and_matches_stock_peft():
    """A PEFT LoRA model (B not zero, base frozen): planned at its floor and between, the real step
    keeps at most the budget and the trainable gradients match stock PEFT under the 2x rule."""
    peft = pytest.importorskip("peft")
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
                  init_lora_weights=False)

    def lora(dtype):
        model = build("llama", dtype, layers=3)
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(**config))

    inputs = example()

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    reference, stock = loss_and_grads(lora(torch.float64)), loss_and_grads(lora(torch.float32))
    costs = model_plan.measure_model_costs(lora(torch.float32), inputs)
    floor = model_plan.smallest_feasible_budget(costs)
    stock_peak, _ = model_plan.peak_and_cost(costs, all_stock(costs))
    for budget in (floor, (floor + stock_peak) // 4):
        model = lora(torch.float32)
        report = remat.patch(model, policy="auto", budget_bytes=budget, example_inputs=inputs)
        assert any(isinstance(d, Span) or d.choice != "stock" for d in report.plan.decisions)
        assert measured_peak(model, inputs) <= report.plan.predicted_peak_bytes <= budget
        got = loss_and_grads(model)
        assert len(got[1]) == len(stock[1]) == 3 * 2 * len(config["target_modules"])
        assert_within_2x_of_stock("loss", got[0].reshape(1), stock[0].reshape(1), reference[0].reshape(1),
                                  torch.float32)
        for name in reference[1]:
            assert_within_2x_of_stock(name, got[1][name], stock[1][name], reference[1][name], torch.float32)


def mixtral(dtype=torch.float32, seed=0):
    """A tiny two-layer MixtralForCausalLM (4 experts, top-2, aux loss coefficient 1 so the
    load-balancing loss's router gradient is visible); the float64 one runs the eager experts."""
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
                                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=1.0,
                                        max_position_embeddings=64, use_cache=False, attn_implementation="eager")
    model = transformers.MixtralForCausalLM(config).to(dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")
    return model


GEMMA3_LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"] * 3


def gemma3(dtype=torch.float32, seed=0):
    """A tiny six-layer Gemma3ForCausalLM: layers 0-2 sliding (window 4, local rope base 1e4), 3-5
    full (rope base 1e6), so the decoder loop passes layers 2 and 3 different rope tables and masks."""
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER,
                                           num_hidden_layers=len(GEMMA3_LAYER_TYPES), num_attention_heads=HEADS,
                                           num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                           max_position_embeddings=64, sliding_window=4,
                                           layer_types=GEMMA3_LAYER_TYPES, use_cache=False,
                                           attn_implementation="eager")
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    losses = [out.loss.detach().reshape(1)]
    if getattr(out, "aux_loss", None) is not None:
        losses.append(out.aux_loss.detach().reshape(1))
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return losses, grads


def check_planned_against_stock(build_model, inputs, budgets):
    """For each budget (a function of the measured costs): remat.patch(policy="auto") keeps at most
    the budget in a real step, and the losses and every gradient match the stock model under the 2x
    rule against float64. Returns the plans."""
    reference, stock = loss_and_grads(build_model(torch.float64), inputs), loss_and_grads(build_model(), inputs)
    costs = model_plan.measure_model_costs(build_model(), inputs)
    plans = []
    for budget in budgets(costs):
        model = build_model()
        plan = remat.patch(model, policy="auto", budget_bytes=budget, example_inputs=inputs).plan
        assert measured_peak(model, inputs) <= plan.predicted_peak_bytes <= budget
        got = loss_and_grads(model, inputs)
        assert len(got[0]) == len(stock[0]) and got[1].keys() == stock[1].keys() == reference[1].keys()
        for i, loss in enumerate(got[0]):
            assert_within_2x_of_stock(f"loss {i}", loss, stock[0][i], reference[0][i], torch.float32)
        for name in reference[1]:
            assert_within_2x_of_stock(name, got[1][name], stock[1][name], reference[1][name], torch.float32)
        plans.append(plan)
    return costs, plans


def test_mixtral_plans_with_flops_and_router_logits_keep_the_load_balancing_gradient():
    """MoE layers get FLOP costs (router and experts) and are never put in a span: a span's first
    forward runs without autograd, so router logits Hugging Face records there would carry no
    gradient and the load-balancing loss would not train the router."""
    ids, mask, labels = batch()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)

    def budgets(costs):
        # 64 bytes over the floor: the bytes the aux loss saves vary by up to 16 between measurements.
        floor = model_plan.smallest_feasible_budget(costs) + 64
        return floor, (floor + model_plan.peak_and_cost(costs, all_stock(costs))[0]) // 2

    costs, plans = check_planned_against_stock(mixtral, inputs, budgets)
    assert not any(layer.may_span for layer in costs.layers)
    tokens, hidden, inter = ids.numel(), HIDDEN, 40
    router, experts_up = 2 * tokens * hidden * 4, 4 * tokens * 2 * hidden * inter
    scores = ids.shape[0] * HEADS * HEAD_DIM * ids.shape[1] * (ids.shape[1] + 1)
    assert costs.layers[0].cost["speed"] == scores + router
    assert costs.layers[0].cost["balanced"] == scores + router + experts_up
    assert all(not plan.spans() for plan in plans)
    assert any(choice != "stock" for plan in plans for choice in plan.layer_policies().values())


def test_gemma3_spans_only_layers_called_with_the_same_arguments():
    """Gemma 3's sliding and full layers get different rope tables and masks: the planner never spans
    them together, and a span forced across them refuses at run time instead of running the second
    layer with the first one's arguments."""
    ids, mask, labels = batch()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)

    def assume_same_arguments(costs):
        return ModelCosts(tuple(dataclasses.replace(x, same_arguments_as_previous=True) for x in costs.layers),
                          costs.pre_bytes, costs.shared_bytes, costs.post_bytes, costs.shape, costs.unit,
                          costs.all_stock)

    def crosses_the_types(plan):
        return any(start <= 2 < 3 < end for start, end in plan.spans())

    def budgets(costs):
        # The least budget (in 500-byte steps from the floor) at which a planner taking all the
        # layers' arguments as equal spans layers 2 and 3 together.
        stock_peak = model_plan.peak_and_cost(costs, all_stock(costs))[0]
        return next(budget for budget in range(model_plan.smallest_feasible_budget(costs), stock_peak, 500)
                    if crosses_the_types(model_plan.plan_for_costs(assume_same_arguments(costs), budget))),

    costs, (plan,) = check_planned_against_stock(gemma3, inputs, budgets)
    assert all(layer.may_span for layer in costs.layers)
    assert [layer.same_arguments_as_previous for layer in costs.layers] == [False, True, True, False, True, True]
    assert plan.spans() and not crosses_the_types(plan)
    model = gemma3()
    remat.patch(model, policy="auto", budget_bytes=plan.budget_bytes, example_inputs=inputs)
    forced = model_plan.ModelPlan(costs, (*(Taped(i, "memory") for i in range(2)), Span(2, 4, ("memory",) * 2),
                                          *(Taped(i, "memory") for i in range(4, 6))), plan.budget_bytes)
    model_plan.install(forced, list(model.model.layers))
    with pytest.raises(ValueError, match="different ones"):
        model(**inputs)


def test_per_token_plan_replans_a_batch_twice_as_long_within_its_budget():
    """A plan given per token, made on a length-N example, re-plans a length-2N batch: the real
    step keeps at most budget_bytes_per_token times its tokens and matches stock; a longer batch
    than 2N, or one with more rows, raises."""
    inputs = example()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    other_ids = batch(seed=2)[0]
    long_ids, long_mask = torch.cat([other_ids, ids], 1), torch.cat([torch.ones_like(mask), mask], 1)
    long_labels = long_ids.masked_fill(long_mask == 0, -100)
    long_inputs = dict(input_ids=long_ids, attention_mask=long_mask, labels=long_labels)
    reference = logits_and_grads(build("llama", torch.float64), long_ids, long_mask, long_labels)
    stock = logits_and_grads(build("llama"), long_ids, long_mask, long_labels)
    costs = model_plan.measure_model_costs(build("llama"), inputs)
    floor, stock_peak = model_plan.smallest_feasible_budget(costs), model_plan.peak_and_cost(costs, all_stock(costs))[0]
    for per_token in (floor / ids.numel(), (floor + stock_peak) / 2 / ids.numel()):
        model = build("llama")
        plan = remat.patch(model, policy="auto", budget_bytes_per_token=per_token, example_inputs=inputs).plan
        assert plan.doubled_costs.shape == (ids.shape[0], 2 * ids.shape[1])
        peak = measured_peak(model, long_inputs)
        assert plan.budget_bytes < peak <= per_token * long_ids.numel()
        got = logits_and_grads(model, long_ids, long_mask, long_labels)
        assert_within_2x_of_stock("loss", got[1].reshape(1), stock[1].reshape(1), reference[1].reshape(1),
                                  torch.float32)
        for name in reference[2]:
            assert_within_2x_of_stock(name, got[2][name], stock[2][name], reference[2][name], torch.float32)
        too_long = {k: torch.cat([v, v[:, :1]], 1) for k, v in long_inputs.items()}
        with pytest.raises(ValueError, match="outside that range"):
            model(**too_long)
        with pytest.raises(ValueError, match="outside that range"):
            model(**{k: torch.cat([v, v], 0) for k, v in inputs.items()})


def test_patch_passes_max_span_to_the_planner():
    """remat.patch(policy="auto", max_span=1) plans spans of one layer at that rule's floor (what
    FSDP2 with fully_shard per layer needs), and names that floor when the budget is below it."""
    inputs = example()
    model = build("llama")
    costs = model_plan.measure_model_costs(model, inputs)
    floor = model_plan.smallest_feasible_budget(costs, max_span=1)
    assert floor > model_plan.smallest_feasible_budget(costs)
    with pytest.raises(ValueError, match=str(floor)):
        remat.patch(build("llama"), policy="auto", budget_bytes=floor - 1, example_inputs=inputs, max_span=1)
    report = remat.patch(model, policy="auto", budget_bytes=floor, example_inputs=inputs, max_span=1)
    assert report.plan.spans() and all(end - start == 1 for start, end in report.plan.spans())
