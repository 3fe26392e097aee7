"""remat.patch / unpatch as operations on a model: all or nothing (a failure anywhere inside patch,
of any exception type, leaves every module, hook, config and forward as it was, and a later patch
works); a patched model saved whole (torch.save / torch.load, pickle, deepcopy) loads patched, with
the same outputs and gradients, and unpatches; patch + unpatch leaves exactly the hooks the model
had; modules remat's kernels cannot run (head dim 320, float64) are refused at patch time with the
reason; a model of no family remat knows warns and keeps no state."""

import copy
import importlib
import io
import pickle
import warnings

import pytest
import torch

import remat
from remat.models import causal_lm as causal_lm_module
from remat.models import outputs, registry
from remat.planning import model_plan

from helpers import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, MOE_EXPERT_INTER, MOE_TOP_K, batch, causal_lm

transformers = pytest.importorskip("transformers")
patch_module = importlib.import_module("remat.replacement")  # what remat.patch applies

# Every hook dict of an nn.Module (torch 2.14).
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def mixtral(dtype=torch.float32, seed=0):
    """A tiny MixtralForCausalLM from a config (2 layers, 4 experts, top-2, aux loss coefficient 1)."""
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=MOE_EXPERT_INTER, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=4,
        num_experts_per_tok=MOE_TOP_K, router_aux_loss_coef=1.0, max_position_embeddings=64, use_cache=False,
        attn_implementation="eager")
    return transformers.MixtralForCausalLM(config).to(dtype)


def build(kind, dtype=torch.float32, **overrides):
    return mixtral(dtype) if kind == "mixtral" else causal_lm(kind, dtype, **overrides)


def hooks_of(model):
    """{qualified name: {hook dict name: [(hook id, hook), ...]}} of every module."""
    return {name: {key: list(getattr(module, key).items()) for key in HOOK_DICTS}
            for name, module in model.named_modules()}


def model_state(model):
    """What a failed or empty patch must leave as it was, per module (by qualified name): the module
    object, its attribute names, its children, its hooks, its config (the object and its values)
    and an instance forward."""
    state = {}
    for name, module in model.named_modules():
        config = module.__dict__.get("config")
        state[name] = dict(module=module, attributes=sorted(module.__dict__), children=dict(module._modules),
                           hooks={key: list(getattr(module, key).items()) for key in HOOK_DICTS},
                           config=config, config_values=None if config is None else config.to_dict(),
                           forward=module.__dict__.get("forward"))
    return state


def step(model, kind="llama"):
    """One training step and one evaluation forward: the loss, every gradient, the logits and the
    hidden states (and, for a mixture-of-experts model, the router logits of a recorded call)."""
    ids, mask, labels = batch()
    model.zero_grad(set_to_none=True)
    extra = dict(output_router_logits=True) if kind == "mixtral" else {}
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **extra)
    out.loss.backward()
    result = {"loss": out.loss.detach()}
    result.update({f"grad {name}": p.grad.detach().clone() for name, p in model.named_parameters()})
    if kind == "mixtral":
        result.update({f"router logits {i}": r.detach() for i, r in enumerate(out.router_logits)})
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    result["logits"] = out.logits
    result.update({f"hidden state {i}": h for i, h in enumerate(out.hidden_states)})
    return result


def assert_same(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def four_d_mask(mask):
    n = mask.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


# ---------------------------------------------------------------------------------------------
# All or nothing


class Injected(RuntimeError):
    pass


def fail_at_call(function, k, error):
    """``function`` that, on its k-th call, runs and then raises ``error`` (what it changed stays
    changed: the rollback must undo it too)."""
    calls = [0]

    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        calls[0] += 1
        if calls[0] == k:
            raise error("injected failure")
        return result

    return wrapper


def inject(monkeypatch, point, k, error):
    """Makes the k-th call of one step of patch raise ``error`` after doing its work."""
    if point == "build":  # the family builders (layers, norms), through the table's matches
        match = registry.match
        failing = {}

        def matched(module):
            found = match(module)
            if found is None or found.build is None:
                return found
            failing.setdefault("build", fail_at_call(lambda build, *a, **kw: build(*a, **kw), k, error))
            return found._replace(build=lambda *a, **kw: failing["build"](found.build, *a, **kw))

        monkeypatch.setattr(registry, "match", matched)
        return
    owner, name = {
        "check_runnable": (patch_module, "check_runnable"),
        "install_recorders": (outputs, "install_recorders"),
        "carry_recorders": (outputs, "carry_recorders"),
        "loss install": (causal_lm_module, "install"),
        "plan install": (model_plan, "install"),
        "checkpoint counting": (patch_module, "_install_checkpoint_counting"),
        "config copies": (patch_module, "_give_private_configs"),
        "register attention": (patch_module, "register_attention"),
        "mask check": (patch_module, "_install_mask_check"),
    }[point]
    monkeypatch.setattr(owner, name, fail_at_call(getattr(owner, name), k, error))


FAILURES = [
    ("llama", "build", 1, Injected), ("llama", "build", 2, Injected), ("llama", "build", 3, Injected),
    ("llama", "build", 2, KeyboardInterrupt), ("llama", "check_runnable", 2, Injected),
    ("llama", "install_recorders", 1, Injected), ("llama", "carry_recorders", 2, Injected),
    ("llama", "loss install", 1, Injected), ("llama", "checkpoint counting", 1, Injected),
    ("llama", "config copies", 1, Injected), ("llama", "register attention", 1, Injected),
    ("llama", "mask check", 1, Injected), ("llama", "mask check", 1, TypeError),
    ("mixtral", "build", 2, Injected), ("mixtral", "carry_recorders", 2, Injected),
]


@pytest.mark.parametrize("kind, point, k, error", FAILURES,
                         ids=[f"{kind}-{point}-call{k}-{error.__name__}" for kind, point, k, error in FAILURES])
def test_failure_anywhere_in_patch_leaves_the_model_as_it_was(monkeypatch, kind, point, k, error):
    model, stock = build(kind), build(kind)
    before = model_state(model)
    want = step(stock, kind)
    with monkeypatch.context() as patched:
        inject(patched, point, k, error)
        with pytest.raises(error, match="injected failure"):
            remat.patch(model)
    assert model_state(model) == before
    assert not getattr(model, "_remat_patched", False)
    with pytest.raises(ValueError, match="not patched"):
        remat.unpatch(model)
    assert_same(step(model, kind), want)
    # A later patch works, as on a fresh model.
    fresh = build(kind)
    remat.patch(model)
    remat.patch(fresh)
    assert_same(step(model, kind), step(fresh, kind))
    remat.unpatch(model)
    assert_same(step(model, kind), want)


def test_failure_while_installing_a_plan_leaves_the_model_as_it_was(monkeypatch):
    model, stock = build("llama"), build("llama")
    before = model_state(model)
    ids, mask, labels = batch()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    inject(monkeypatch, "plan install", 1, Injected)
    with pytest.raises(Injected):
        remat.patch(model, policy="auto", budget_bytes=10**9, example_inputs=inputs)
    assert model_state(model) == before
    assert_same(step(model), step(stock))


def test_builder_refusals_leave_one_layer_stock_and_other_errors_roll_back(monkeypatch):
    """TypeError / ValueError from a family's build is a refusal, not a failure: that layer stays
    stock, with the reason in the report, and the rest is patched. Any other exception from the
    same place rolls the whole patch back and propagates."""
    match = registry.match
    raised = []

    def matched(module):
        found = match(module)
        if found is not None and found.kind == "layer" and type(module).__name__ == "LlamaDecoderLayer":
            def build(stock, **kwargs):
                if stock is model.model.layers[1]:
                    raise raised[-1]("refused for the test")
                return found.build(stock, **kwargs)
            return found._replace(build=build)
        return found

    monkeypatch.setattr(registry, "match", matched)
    model = build("llama")
    before = model_state(model)
    raised.append(Injected)
    with pytest.raises(Injected):
        remat.patch(model)
    assert model_state(model) == before
    for refusal in (TypeError, ValueError):
        raised.append(refusal)
        report = remat.patch(model)
        assert ("model.layers.1", "LlamaDecoderLayer", "refused for the test") in report.left_alone
        assert type(model.model.layers[0]).__name__ == "HFLlamaLayer"
        assert type(model.model.layers[1]).__name__ == "LlamaDecoderLayer"
        remat.unpatch(model)


# ---------------------------------------------------------------------------------------------
# Saving a patched model whole


def set_checkpointing(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias is what Trainer and users call
        model.gradient_checkpointing_enable(**kwargs)


def round_trip(model, how):
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    return copy.deepcopy(model)


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_patched_model_saves_whole_and_loads_patched(kind, how):
    model = build(kind)
    remat.patch(model)
    want = step(model, kind)
    loaded = round_trip(model, how)
    assert type(loaded.model.layers[0]).__name__.startswith("HF")
    assert all(p is not q for p, q in zip(loaded.parameters(), model.parameters(), strict=True))
    assert_same(step(loaded, kind), want)
    # Still patched: the mask check runs, the checkpoint-counting setter counts remat's layers.
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="2-D"):
        loaded(input_ids=ids, attention_mask=four_d_mask(mask))
    # (on another copy: Hugging Face's gradient_checkpointing_enable puts a closure on the embeddings)
    again = round_trip(model, how)
    set_checkpointing(again, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in again.model.layers] == [True, False]
    # ... and unpatches to the stock model, with the stock model's outputs and hooks.
    stock = build(kind)
    remat.unpatch(loaded)
    assert [type(layer) for layer in loaded.model.layers] == [type(layer) for layer in stock.model.layers]
    fresh_hooks = hooks_of(build(kind))
    assert {name: {k: len(v) for k, v in hooks.items()} for name, hooks in hooks_of(loaded).items()} == \
        {name: {k: len(v) for k, v in hooks.items()} for name, hooks in fresh_hooks.items()}
    pickle.dumps(loaded)
    assert_same(step(loaded, kind), step(stock, kind))


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
def test_planned_model_saves_whole_and_loads_planned(how):
    """policy="auto" at its floor budget (every layer re-run from its input in spans): the loaded
    copy runs the same plan (its layers' forwards are objects of a module-level class, not bound
    methods, which pickle saves by name and cannot load) and unpatches."""
    model = build("llama", num_hidden_layers=4)
    ids, mask, labels = batch()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    costs = model_plan.measure_model_costs(build("llama", num_hidden_layers=4), inputs)
    floor = model_plan.smallest_feasible_budget(costs)
    report = remat.patch(model, policy="auto", budget_bytes=floor, example_inputs=inputs)
    assert report.plan.spans()
    want = step(model)
    loaded = round_trip(model, how)
    assert_same(step(loaded), want)
    remat.unpatch(loaded)
    assert_same(step(loaded), step(build("llama", num_hidden_layers=4)))


# ---------------------------------------------------------------------------------------------
# patch + unpatch leaves the hooks as they were


@pytest.mark.parametrize("recorded_first", [False, True], ids=["fresh", "recorded_before_patch"])
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_unpatch_removes_every_hook_patch_added(kind, recorded_first):
    model = build(kind)
    ids, mask, _ = batch()
    if recorded_first:  # Hugging Face installs its recording hooks (closures) on this first call
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    else:
        pickle.dumps(model)
    before, attributes = hooks_of(model), {name: sorted(m.__dict__) for name, m in model.named_modules()}
    want = step(build(kind), kind)
    remat.patch(model)
    step(model, kind)
    remat.unpatch(model)
    assert hooks_of(model) == before
    assert {name: sorted(m.__dict__) for name, m in model.named_modules()} == attributes
    if not recorded_first:
        pickle.dumps(model)  # a model that pickled before patching still does
    # Hugging Face installs its hooks again on the next recorded call, as on a model never patched.
    assert_same(step(model, kind), want)


# ---------------------------------------------------------------------------------------------
# Refused at patch time


def test_head_dim_remat_cannot_run_is_refused_at_patch_time():
    report = remat.patch(build("llama", head_dim=256))  # the largest remat runs: replaced
    assert [name for name, _, _ in report.replaced][:2] == ["model.layers.0", "model.layers.1"]
    stock, model = build("llama", head_dim=320), build("llama", head_dim=320)
    report = remat.patch(model)
    left = {name: why for name, _, why in report.left_alone}
    for name in ("model.layers.0", "model.layers.1"):
        assert "head dim 320" in left[name] and "1..256" in left[name]
    assert [type(layer).__name__ for layer in model.model.layers] == ["LlamaDecoderLayer"] * 2
    torch.testing.assert_close(step(model), step(stock), rtol=1e-5, atol=1e-5)
    remat.unpatch(model)
    attention = build("llama", head_dim=320)
    with pytest.warns(UserWarning, match="replaced nothing"):
        report = remat.patch(attention, modules=("attention",))
    assert [name for name, _, _ in report.left_alone] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all("head dim 320" in why for _, _, why in report.left_alone)
    assert type(attention.model.layers[0].self_attn).__name__ == "LlamaAttention"


def test_float64_model_is_refused_at_patch_time():
    stock, model = build("llama", torch.float64), build("llama", torch.float64)
    before = model_state(model)
    with pytest.warns(UserWarning, match="replaced nothing") as record:
        report = remat.patch(model)
    assert len(record) == 1
    assert report.replaced == []
    left = {name: why for name, _, why in report.left_alone}
    assert set(left) == {"model.layers.0", "model.layers.1", "model.norm", "LlamaForCausalLM"}
    assert all("torch.float64" in why and "float32, float16 and bfloat16" in why for why in left.values())
    remat.unpatch(model)  # unpatchable: removes the one mark the empty patch left
    assert model_state(model) == before
    assert_same(step(model), step(stock))
    with pytest.raises(ValueError, match="not patched"):
        remat.unpatch(model)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8)).double()
    with pytest.warns(UserWarning, match="float64"):
        assert remat.patch(plain).replaced == []


# ---------------------------------------------------------------------------------------------
# Families remat does not know


def olmo2():
    if not hasattr(transformers, "Olmo2ForCausalLM"):
        pytest.skip("this transformers has no OLMo 2")
    torch.manual_seed(0)
    config = transformers.Olmo2Config(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, eos_token_id=None,
                                      use_cache=False, attn_implementation="eager")
    return transformers.Olmo2ForCausalLM(config)


def test_unknown_family_warns_and_leaves_no_state():
    model = olmo2()
    before = model_state(model)
    pickle.dumps(model)
    for _ in range(2):  # patchable again: every call warns once and changes nothing
        with pytest.warns(UserWarning) as record:
            report = remat.patch(model)
        assert len(record) == 1
        message = str(record[0].message)
        assert "Olmo2DecoderLayer" in message
        assert "llama (LlamaDecoderLayer" in message and "gpt2 (GPT2Block)" in message
        assert report.replaced == []
        pickle.dumps(model)
        remat.unpatch(model)  # nothing to restore: removes the empty patch's mark, leaving no state
        assert model_state(model) == before
    with pytest.warns(UserWarning, match="Olmo2DecoderLayer"):
        remat.patch(model)
        remat.patch(model)  # an empty patch does not block the next one
    remat.unpatch(model)
    assert model_state(model) == before
    with warnings.catch_warnings():  # a family remat knows: no warning
        warnings.simplefilter("error")
        assert remat.patch(build("llama")).replaced


def test_model_without_known_modules_warns():
    with pytest.warns(UserWarning, match="holds no module of a class remat knows"):
        assert remat.patch(torch.nn.Sequential(torch.nn.Linear(4, 4))).replaced == []
