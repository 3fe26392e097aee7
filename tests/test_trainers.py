"""Real trainers on patched models: Hugging Face's Trainer and TRL's SFTTrainer train a patched
tiny Llama (from a config; an in-memory dataset; a character tokenizer built here; CPU, no
downloads) for a few steps, without and with gradient_checkpointing=True, without and with PEFT
LoRA on every projection, and log the losses of the same stack unpatched. fp32 runs agree within
float rounding; TRL's default bf16 autocast within twice stock's own distance from fp32. The LoRA
runs use the README's recipe (get_peft_model, then remat.patch, then the Trainer)."""

import pytest
import torch

import remat

from helpers import causal_lm

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["the cat sat on the mat", "a dog ran in the park today", "remat saves memory", "hello world",
         "fused kernels recompute in backward", "small models train fast", "lora adapters are small", "one more line"]
STEPS = 3
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tokenizer():
    """A character-level tokenizer over TEXTS (WordLevel on single characters), ids < 96."""
    chars = sorted(set("".join(TEXTS)))
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def with_lora(model):
    """PEFT LoRA (r 8, alpha 16) on every projection of ``model``. init_lora_weights=False (not in
    the README) makes B non-zero, so the adapters change the loss from the first step."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, task_type="CAUSAL_LM",
                                            init_lora_weights=False))


def build(patched, lora, policy="balanced", patch_first=False):
    """A tiny Llama (2 layers, 96 tokens), optionally with LoRA and/or patched: the README's order
    (adapters, then remat.patch), or with ``patch_first`` remat.patch before get_peft_model.
    Fused-forward calls of each patched layer are counted (twice per step under gradient
    checkpointing)."""
    model = causal_lm("llama")
    if lora and not patch_first:
        model = with_lora(model)
    calls = []
    if patched:
        report = remat.patch(model, policy=policy)
        replaced = [name for name, _, new in report.replaced if new.endswith("Layer")]
        assert len(replaced) == 2, str(report)
        for name in replaced:
            layer = model.get_submodule(name)
            layer._fused_forward = _counting(layer._fused_forward, calls)
    if lora and patch_first:
        model = with_lora(model)
    return model, calls


def _counting(function, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def logged_losses(trainer):
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS
    return losses


def common_arguments(tmp_path, checkpointing, bf16=False):
    return dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
                logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0, bf16=bf16,
                gradient_checkpointing=checkpointing, dataloader_num_workers=0)


def hf_trainer_losses(model, tokenizer, tmp_path, checkpointing):
    dataset = datasets.Dataset.from_dict({"text": TEXTS}).map(lambda rows: tokenizer(rows["text"]), batched=True,
                                                             remove_columns=["text"])
    args = transformers.TrainingArguments(**common_arguments(tmp_path, checkpointing))
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)  # right padding, -100 labels
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    return logged_losses(trainer)


def sft_losses(model, tokenizer, tmp_path, checkpointing, bf16=False, padding_free=False):
    """SFTTrainer's logged losses; ``padding_free``: TRL packs each batch into one row whose
    position_ids restart per document (no attention mask; TRL then takes no max_length)."""
    args = trl.SFTConfig(max_length=None if padding_free else 32, padding_free=padding_free,
                         **common_arguments(tmp_path, checkpointing, bf16))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": TEXTS}),
                             processing_class=tokenizer)
    return logged_losses(trainer)


def assert_fp32_losses_equal(got, want):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-5, atol=0)


def sft_padding_free_losses(model, tokenizer, tmp_path, checkpointing):
    return sft_losses(model, tokenizer, tmp_path, checkpointing, padding_free=True)


TRAINERS = {"hf": hf_trainer_losses, "sft": sft_losses, "sft_padding_free": sft_padding_free_losses}


_STOCK_LOSSES = {}


def stock_losses(trainer, lora, tokenizer, tmp_path):
    """The unpatched stack's logged losses (fp32, no checkpointing) for ``trainer`` (a TRAINERS key),
    with or without LoRA: computed once per module run, shared by the tests that compare with it."""
    if (trainer, lora) not in _STOCK_LOSSES:
        _STOCK_LOSSES[trainer, lora] = TRAINERS[trainer](build(False, lora)[0], tokenizer, tmp_path / "stock", False)
    return _STOCK_LOSSES[trainer, lora]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_patched_model_trains_as_stock(trainer, checkpointing, tokenizer, tmp_path):
    run = TRAINERS[trainer]
    want = stock_losses(trainer, False, tokenizer, tmp_path)
    model, calls = build(True, False)
    got = run(model, tokenizer, tmp_path / "patched", checkpointing)
    assert len(calls) == 2 * STEPS * (2 if checkpointing else 1)  # two layers; recomputed once under checkpointing
    assert_fp32_losses_equal(got, want)


@pytest.mark.parametrize(("trainer", "checkpointing", "patch_first"), [
    ("hf", False, False), ("hf", True, False), ("sft", False, False), ("sft", True, False), ("hf", True, True)],
    ids=["hf-plain", "hf-gradient_checkpointing", "sft-plain", "sft-gradient_checkpointing",
         "hf-gradient_checkpointing-patched_before_peft"])
def test_lora_recipe_trains_as_stock_peft(trainer, checkpointing, patch_first, tokenizer, tmp_path):
    run = hf_trainer_losses if trainer == "hf" else sft_losses
    want = stock_losses(trainer, True, tokenizer, tmp_path)
    model, calls = build(True, True, patch_first=patch_first)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    got = run(model, tokenizer, tmp_path / "patched", checkpointing)
    assert len(calls) == 2 * STEPS * (2 if checkpointing else 1)
    assert_fp32_losses_equal(got, want)
    for name, p in model.named_parameters():  # the base stays frozen, the adapters train
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    assert any("lora_B" in name for name, p in model.named_parameters() if p.requires_grad)


def test_sft_default_bf16_autocast_within_twice_stock_rounding(tokenizer, tmp_path):
    """SFTConfig's default (bf16=True: CPU autocast): the patched run's losses are no further from
    the fp32 run than twice the stock bf16 run's, plus one bf16 ulp of the loss."""
    fp32 = torch.tensor(stock_losses("sft", False, tokenizer, tmp_path))
    stock = torch.tensor(sft_losses(build(False, False)[0], tokenizer, tmp_path / "stock", False, bf16=True))
    got = torch.tensor(sft_losses(build(True, False)[0], tokenizer, tmp_path / "patched", False, bf16=True))
    bound = 2 * (stock - fp32).abs() + fp32.abs() * 2.0 ** -8
    assert ((got - fp32).abs() <= bound).all(), (got, stock, fp32)


def readme_lora_recipe():
    """The Python block of the README's "LoRA fine-tuning with remat" section, as written there."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("### LoRA fine-tuning with remat"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]


def test_readme_lora_recipe_trains_as_stock_peft(tokenizer, tmp_path, monkeypatch):
    """Runs the README's recipe block as it stands, on a tiny Llama and this module's dataset,
    with the Trainer's arguments shortened (3 steps, CPU, no reports or saves), once as written and
    once with remat.patch left out: the same logged losses; the layers fused, the fused forward
    re-run under the recipe's gradient checkpointing, the base frozen, the adapters trained."""
    import functools
    import types

    monkeypatch.chdir(tmp_path)  # the recipe's output_dir
    dataset = datasets.Dataset.from_dict({"text": TEXTS}).map(lambda rows: tokenizer(rows["text"]), batched=True,
                                                             remove_columns=["text"])
    shortened = {key: value for key, value in common_arguments(tmp_path, True).items()
                 if key not in ("output_dir", "gradient_checkpointing")}
    recipe = readme_lora_recipe()

    def run(with_remat):
        calls, trainers = [], []

        def patch(model):
            report = remat.patch(model)
            for name, _, new in report.replaced:
                if new.endswith("Layer"):
                    layer = model.get_submodule(name)
                    layer._fused_forward = _counting(layer._fused_forward, calls)
            return report

        def trainer(**kwargs):
            trainers.append(transformers.Trainer(**kwargs))
            return trainers[-1]

        namespace = {"model": causal_lm("llama"), "dataset": dataset, "Trainer": trainer,
                     "collator": transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
                     "TrainingArguments": functools.partial(transformers.TrainingArguments, **shortened),
                     "remat": types.SimpleNamespace(patch=patch if with_remat else lambda model: None)}
        frozen = {n: p.detach().clone() for n, p in namespace["model"].named_parameters()}
        exec(recipe, namespace)
        losses = [entry["loss"] for entry in trainers[0].state.log_history if "loss" in entry]
        assert len(losses) == STEPS
        return losses, namespace, frozen, calls

    want, _, _, _ = run(False)
    got, namespace, frozen, calls = run(True)
    assert_fp32_losses_equal(got, want)
    assert len(calls) == 2 * STEPS * 2  # two fused layers, each re-run once per step under checkpointing
    assert sum(new.endswith("Layer") for _, _, new in namespace["report"].replaced) == 2
    model = namespace["model"]
    originals = {name.replace(".base_layer", ""): p for name, p in model.get_base_model().named_parameters()
                 if "lora_" not in name}
    assert set(originals) == set(frozen)
    for name, p in originals.items():  # every original parameter: frozen and unchanged
        assert not p.requires_grad and torch.equal(p, frozen[name]), name
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # zero-initialised, trained


def test_unpatch_after_sft_trainer_keeps_its_forward(tokenizer, tmp_path):
    """SFTTrainer replaces the model's forward with its fused LM head around the one remat.patch
    installed; remat.unpatch then leaves that forward in place (the mask check inside passes
    through), so the trainer trains the stock model; patching that model again is refused."""
    model, calls = build(True, False)
    args = trl.SFTConfig(max_length=32, **common_arguments(tmp_path / "unpatched", False))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": TEXTS}),
                             processing_class=tokenizer)
    remat.unpatch(model)
    assert_fp32_losses_equal(logged_losses(trainer), stock_losses("sft", False, tokenizer, tmp_path))
    assert not calls  # the stock layers ran
    with pytest.raises(ValueError, match="wrapped after an earlier remat.patch"):
        remat.patch(model)
