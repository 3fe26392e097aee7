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


def build(patched, lora, policy="balanced"):
    """A tiny Llama (2 layers, 96 tokens), optionally with LoRA (the README's recipe: adapters,
    then remat.patch) and/or patched; fused-forward calls of each patched layer are counted (twice
    per step under gradient checkpointing)."""
    model = causal_lm("llama")
    if lora:
        model = with_lora(model)
    calls = []
    if patched:
        report = remat.patch(model, policy=policy)
        replaced = [name for name, _, new in report.replaced if new.endswith("Layer")]
        assert len(replaced) == 2, str(report)
        for name in replaced:
            layer = model.get_submodule(name)
            layer._fused_forward = _counting(layer._fused_forward, calls)
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


def sft_losses(model, tokenizer, tmp_path, checkpointing, bf16=False):
    args = trl.SFTConfig(max_length=32, **common_arguments(tmp_path, checkpointing, bf16))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": TEXTS}),
                             processing_class=tokenizer)
    return logged_losses(trainer)


def assert_fp32_losses_equal(got, want):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-5, atol=0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
@pytest.mark.parametrize("trainer", ["hf", "sft"])
def test_patched_model_trains_as_stock(trainer, checkpointing, tokenizer, tmp_path):
    run = hf_trainer_losses if trainer == "hf" else sft_losses
    want = run(build(False, False)[0], tokenizer, tmp_path / "stock", False)
    model, calls = build(True, False)
    got = run(model, tokenizer, tmp_path / "patched", checkpointing)
    assert len(calls) == 2 * STEPS * (2 if checkpointing else 1)  # two layers; recomputed once under checkpointing
    assert_fp32_losses_equal(got, want)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
@pytest.mark.parametrize("trainer", ["hf", "sft"])
def test_lora_recipe_trains_as_stock_peft(trainer, checkpointing, tokenizer, tmp_path):
    run = hf_trainer_losses if trainer == "hf" else sft_losses
    stock, _ = build(False, True)
    want = run(stock, tokenizer, tmp_path / "stock", False)
    model, calls = build(True, True)
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
    fp32 = torch.tensor(sft_losses(build(False, False)[0], tokenizer, tmp_path / "fp32", False))
    stock = torch.tensor(sft_losses(build(False, False)[0], tokenizer, tmp_path / "stock", False, bf16=True))
    got = torch.tensor(sft_losses(build(True, False)[0], tokenizer, tmp_path / "patched", False, bf16=True))
    bound = 2 * (stock - fp32).abs() + fp32.abs() * 2.0 ** -8
    assert ((got - fp32).abs() <= bound).all(), (got, stock, fp32)
