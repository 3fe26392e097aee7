"""Whole layers: one Llama decoder layer and a small stack at Llama-like shapes, forward / backward /
full, remat.nn.LlamaLayer with each policy against the stock Hugging Face layer (SDPA attention,
what `transformers` runs by default), the stock layer under per-layer torch.utils.checkpoint, and
torch.compile of the stock layer. Reports saved-for-backward bytes per token per layer (everywhere),
peak memory (GPU) and time ratios to the stock layer; FLOPs are not counted here. Plus LoRA rows
(lora_rows): PEFT LoRA layers, stock, checkpointed and fused, full-step ratios from interleaved rounds.
Plus one Mixtral (mixture-of-experts) layer against remat's MixtralLayer (_moe_rows), full-step
ratios from interleaved rounds."""

import torch
import torch.utils.checkpoint

import remat
from benchmarks.common import Progress, environment_tags, interleaved_ratios, measure, peak_memory_bytes
from remat.memory import saved_bytes


def _config(hidden, inter, heads, kv_heads):
    import transformers

    return transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                                    num_attention_heads=heads, num_key_value_heads=kv_heads, use_cache=False,
                                    attn_implementation="sdpa")


class Stack(torch.nn.Module):
    """``depth`` layers applied in order; ``wrap`` turns each layer call into the timed variant."""

    def __init__(self, layers, wrap=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.wrap = wrap

    def forward(self, x, rope):
        for layer in self.layers:
            x = self.wrap(layer, x, rope) if self.wrap else layer(x, position_embeddings=rope)
        return x


def _checkpointed(layer, x, rope):
    return torch.utils.checkpoint.checkpoint(lambda h: layer(h, position_embeddings=rope), x, use_reentrant=False)


def providers(stock_layers):
    out = [("torch", Stack(stock_layers)),
           ("torch+checkpoint", Stack(stock_layers, _checkpointed)),
           ("torch.compile", torch.compile(Stack(stock_layers), dynamic=False))]
    for policy in ("speed", "balanced", "memory"):
        layers = [remat.nn.LlamaLayer.from_module(s, policy=policy) for s in stock_layers]
        out.append((f"remat-{policy}", Stack(layers)))
    return out


def run(device, quick=False):
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if device.type == "cuda":
        shape = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, tokens=4096)
        depths, dtype, budget = ([1] if quick else [1, 4]), torch.bfloat16, 0.5
    else:
        shape = dict(hidden=512, inter=1376, heads=8, kv_heads=4, tokens=128 if quick else 256)
        depths, dtype, budget = ([1] if quick else [1, 4]), torch.float32, 0.3
    config = _config(shape["hidden"], shape["inter"], shape["heads"], shape["kv_heads"])
    tags = environment_tags()
    rows = []
    progress = Progress(len(depths) * 6, "layers")
    for depth in depths:
        torch.manual_seed(0)
        stock_layers = [LlamaDecoderLayer(config, i).to(device=device, dtype=dtype) for i in range(depth)]
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).to(device)
        tokens = shape["tokens"]
        x = torch.randn(1, tokens, shape["hidden"], device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        rope = rotary(x, torch.arange(tokens, device=device)[None])
        params = [p for layer in stock_layers for p in layer.parameters()]
        results = []
        for name, model in providers(stock_layers):

            def forward():
                with torch.no_grad():
                    model(x, rope)

            def setup_backward():
                return model(x, rope)

            def backward(out):
                torch.autograd.grad(out, [x, *params], dy)

            def full():
                torch.autograd.grad(model(x, rope), [x, *params], dy)

            full()
            saved = saved_bytes(model, x, rope)
            peak = peak_memory_bytes(full, device)
            timings = {"forward": measure(forward, device, budget_s=budget, min_reps=3),
                       "backward": measure(backward, device, budget_s=budget, min_reps=3, setup=setup_backward),
                       "full": measure(full, device, budget_s=budget, min_reps=3)}
            for mode, (median, q20, q80) in timings.items():
                results.append({"block": "llama_layer", "depth": depth, "tokens": tokens, **shape,
                                "dtype": str(dtype).replace("torch.", ""), "provider": name, "mode": mode,
                                "median_ms": median, "q20_ms": q20, "q80_ms": q80, "saved_bytes": saved,
                                "saved_bytes_per_token_per_layer": saved / (tokens * depth),
                                "peak_mem_bytes": peak})
            progress.step(f"layers depth {depth} {name}")
        stock = {r["mode"]: r for r in results if r["provider"] == "torch"}
        for r in results:
            r["time_vs_eager"] = r["median_ms"] / stock[r["mode"]]["median_ms"]
            r["saved_vs_eager"] = r["saved_bytes"] / stock[r["mode"]]["saved_bytes"]
            rows.append({**r, **tags})
    rows.extend(_moe_rows(device, quick, tags))
    rows.extend(lora_rows(device, quick, tags))
    return same_columns(rows)


def _moe_rows(device, quick, tags):
    """One Mixtral decoder layer (8 experts, top-2; Hugging Face's default experts path, grouped_mm)
    against remat.models.mixtral.MixtralLayer with each policy: the full step's time ratio to the
    stock layer from interleaved rounds (benchmarks.common.interleaved_ratios), saved bytes per token."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

    from remat.models.mixtral import MixtralLayer

    if device.type == "cuda":
        shape = dict(hidden=4096, inter=14336, experts=8, top_k=2, heads=32, kv_heads=8, tokens=4096)
        dtype = torch.bfloat16
    else:
        shape = dict(hidden=512, inter=1376, experts=8, top_k=2, heads=8, kv_heads=4, tokens=128 if quick else 256)
        dtype = torch.float32
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                                        num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                                        num_hidden_layers=1, num_attention_heads=shape["heads"],
                                        num_key_value_heads=shape["kv_heads"], use_cache=False,
                                        attn_implementation="sdpa", experts_implementation="grouped_mm")
    torch.manual_seed(0)
    stock = MixtralDecoderLayer(config, 0).to(device=device, dtype=dtype)
    for p in stock.parameters():
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.02)
    tokens = shape["tokens"]
    x = torch.randn(1, tokens, shape["hidden"], device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    rope = MixtralRotaryEmbedding(config).to(device)(x, torch.arange(tokens, device=device)[None])
    params = list(stock.parameters())
    layers = {"torch": stock, **{f"remat-{p}": MixtralLayer.from_module(stock, policy=p) for p in
                                 ("speed", "balanced", "memory")}}

    def full_step(layer):
        return lambda: torch.autograd.grad(layer(x, position_embeddings=rope), [x, *params], dy)

    ratios = interleaved_ratios({name: full_step(layer) for name, layer in layers.items()}, "torch", device,
                                rounds=5 if quick else 11)
    rows = []
    for name, layer in layers.items():
        saved = saved_bytes(layer, x, position_embeddings=rope)
        median, q20, q80 = ratios[name]
        rows.append({"block": "mixtral_layer", "depth": 1, **shape, "dtype": str(dtype).replace("torch.", ""),
                     "provider": name, "mode": "full", "time_vs_eager": median, "ratio_q20": q20, "ratio_q80": q80,
                     "saved_bytes": saved, "saved_bytes_per_token_per_layer": saved / tokens, **tags})
    return rows



def same_columns(rows):
    """Rows of different blocks carry different columns (the LoRA rows: ratios from interleaved
    rounds and no absolute times); every row gets every column ("" where it has none), so one CSV
    (benchmarks.common.write_csv takes the first row's columns) and one table hold them all."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key, "") for key in columns} for row in rows]


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_rows(device, quick, tags):
    """LoRA fine-tuning of Llama decoder layers (PEFT LoRA, rank 16, alpha 32, lora_dropout 0 and
    0.05, on every projection; base weights frozen, as PEFT leaves them): stock layers with PEFT
    ("peft", the baseline), the same under per-layer torch.utils.checkpoint (what Hugging Face's
    gradient_checkpointing=True runs, "peft+checkpoint"), remat.nn.LlamaLayer built from the
    adapted layers with each policy ("remat-<policy>", the adapters inside the fused blocks), and
    the balanced layer with its own gradient checkpointing ("remat-balanced+checkpoint"). One full
    step (forward, backward to the input and the adapters) per provider, timed in interleaved
    rounds (benchmarks.common.interleaved_ratios: median ratio to "peft" and its 20-80% band);
    saved-for-backward bytes per token per layer."""
    import transformers
    from peft import LoraConfig, inject_adapter_in_model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if device.type == "cuda":
        shape = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, tokens=4096)
        depths, dtype = ([1] if quick else [1, 4]), torch.bfloat16
    else:
        shape = dict(hidden=512, inter=1376, heads=8, kv_heads=4, tokens=128 if quick else 256)
        depths, dtype = ([1] if quick else [1, 4]), torch.float32
    rank = 16
    config = _config(shape["hidden"], shape["inter"], shape["heads"], shape["kv_heads"])
    rows = []
    cases = [(depth, dropout) for depth in depths for dropout in (0.0, 0.05)]
    progress = Progress(len(cases), "layers+lora")
    for depth, dropout in cases:
        lora_config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=LORA_TARGETS)
        torch.manual_seed(0)
        stock_layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(depth)).to(device, dtype)
        inject_adapter_in_model(lora_config, stock_layers)
        for name, p in stock_layers.named_parameters():
            p.requires_grad_("lora_" in name)
        stock_layers.train()
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).to(device)
        tokens = shape["tokens"]
        x = torch.randn(1, tokens, shape["hidden"], device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        rope = rotary(x, torch.arange(tokens, device=device)[None])
        adapters = [p for p in stock_layers.parameters() if p.requires_grad]
        models = {"peft": Stack(stock_layers), "peft+checkpoint": Stack(stock_layers, _checkpointed)}
        for policy in ("speed", "balanced", "memory"):
            models[f"remat-{policy}"] = Stack([remat.nn.LlamaLayer.from_module(s, policy=policy) for s in stock_layers])
        checkpointed = [remat.nn.LlamaLayer.from_module(s, policy="balanced") for s in stock_layers]
        for layer in checkpointed:
            layer.gradient_checkpointing = True
        models["remat-balanced+checkpoint"] = Stack(checkpointed)

        def full_step(model):
            return lambda: torch.autograd.grad(model(x, rope), [x, *adapters], dy)

        ratios = interleaved_ratios({name: full_step(model) for name, model in models.items()}, "peft", device,
                                    rounds=5 if quick else 11)
        baseline = saved_bytes(models["peft"], x, rope)
        for name, model in models.items():
            saved = saved_bytes(model, x, rope)
            median, q20, q80 = ratios[name]
            rows.append({"block": "llama_layer_lora", "depth": depth, **shape, "rank": rank, "lora_dropout": dropout,
                         "dtype": str(dtype).replace("torch.", ""), "provider": name, "mode": "full",
                         "time_vs_eager": median, "ratio_q20": q20, "ratio_q80": q80, "saved_bytes": saved,
                         "saved_bytes_per_token_per_layer": saved / (tokens * depth),
                         "saved_vs_eager": saved / baseline, **tags})
        progress.step(f"layers+lora depth {depth} lora_dropout {dropout}")
    return rows


summary_columns = ["depth", "tokens", "hidden", "dtype", "provider", "mode", "median_ms", "q20_ms", "q80_ms",
                   "time_vs_eager", "saved_bytes_per_token_per_layer", "saved_vs_eager", "peak_mem_bytes"]
