"""Whole layers: one Llama decoder layer and a small stack at Llama-like shapes, forward / backward /
full, remat.nn.LlamaLayer with each policy against the stock Hugging Face layer (SDPA attention,
what `transformers` runs by default), the stock layer under per-layer torch.utils.checkpoint, and
torch.compile of the stock layer. Reports saved-for-backward bytes per token per layer (everywhere),
peak memory (GPU) and time ratios to the stock layer; FLOPs are not counted here."""

import torch
import torch.utils.checkpoint

import remat
from benchmarks.common import Progress, environment_tags, measure, peak_memory_bytes
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
    return rows


summary_columns = ["depth", "tokens", "hidden", "dtype", "provider", "mode", "median_ms", "q20_ms", "q80_ms",
                   "time_vs_eager", "saved_bytes_per_token_per_layer", "saved_vs_eager", "peak_mem_bytes"]
