"""Whole layers: one Llama decoder layer and a small stack at Llama-like shapes, forward / backward /
full, remat.nn.LlamaLayer with each policy against the stock Hugging Face layer (SDPA attention,
what `transformers` runs by default), the stock layer under per-layer torch.utils.checkpoint, and
torch.compile of the stock layer. Reports saved-for-backward bytes per token per layer (everywhere),
peak memory (GPU) and time ratios to the stock layer; FLOPs are not counted here. Plus LoRA rows
(lora_rows): PEFT LoRA layers, stock, checkpointed and fused. Plus one Mixtral (mixture-of-experts)
layer against remat's MixtralLayer (_moe_rows) and one layer of each other family, Qwen3, Phi-3,
Gemma 2/3, GPT-2, Qwen3-MoE (family_rows), against its remat layer. Every time is measured with the
providers of a case side by side in interleaved rounds (benchmarks.common.interleaved_timings); the
time_vs_* columns are medians of per-round ratios with their 20-80% bands."""

import copy
import functools
import sys

import torch
import torch.utils.checkpoint

import remat
from benchmarks.common import (
    Progress,
    autograd_step,
    environment_tags,
    interleaved_timings,
    peak_memory_bytes,
    run_step,
    timing_summary,
    with_end_load,
)
from remat.memory import saved_bytes

# time_vs_<label> columns: the provider's time over the named provider's in the same round.
BASELINES = {"eager": "torch", "checkpoint": "torch+checkpoint", "compile": "torch.compile"}

# The blocks of the last run() that failed the pre-timing check (_policy_rows), one line each.
CHECK_FAILURES = []


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

    CHECK_FAILURES.clear()
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if device.type == "cuda":
        shape = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, tokens=4096)
        depths, dtype, rounds = ([1] if quick else [1, 4]), torch.bfloat16, (4 if quick else 20)
    else:
        shape = dict(hidden=512, inter=1376, heads=8, kv_heads=4, tokens=128 if quick else 256)
        depths, dtype, rounds = ([1] if quick else [1, 4]), torch.float32, (2 if quick else 12)
    config = _config(shape["hidden"], shape["inter"], shape["heads"], shape["kv_heads"])
    tags = environment_tags()
    rows = []
    progress = Progress(len(depths), "layers")
    for depth in depths:
        torch.manual_seed(0)
        stock_layers = [LlamaDecoderLayer(config, i).to(device=device, dtype=dtype) for i in range(depth)]
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).to(device)
        tokens = shape["tokens"]
        x = torch.randn(1, tokens, shape["hidden"], device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        rope = rotary(x, torch.arange(tokens, device=device)[None])
        params = [p for layer in stock_layers for p in layer.parameters()]
        steps, memory = {}, {}
        for name, model in providers(stock_layers):
            steps[name] = step = autograd_step(model, (x, rope), [x, *params], dy)
            run_step(step)  # compiles where needed, before the peak is measured
            memory[name] = (saved_bytes(model, x, rope), peak_memory_bytes(functools.partial(run_step, step),
                                                                            device))
        case = f"layers depth {depth}"
        for (name, mode), columns in timing_summary(interleaved_timings(steps, device, rounds=rounds), BASELINES,
                                                    case).items():
            saved, peak = memory[name]
            rows.append({"block": "llama_layer", "depth": depth, "tokens": tokens, **shape,
                         "dtype": str(dtype).replace("torch.", ""), "provider": name, "mode": mode, **columns,
                         "saved_bytes": saved, "saved_bytes_per_token_per_layer": saved / (tokens * depth),
                         "saved_vs_eager": saved / memory["torch"][0], "peak_mem_bytes": peak, **tags})
        progress.step(case)
    rows.extend(_moe_rows(device, quick, tags))
    rows.extend(family_rows(device, quick, tags))
    rows.extend(lora_rows(device, quick, tags))
    return with_end_load(same_columns(rows))


def _moe_rows(device, quick, tags):
    """One Mixtral decoder layer (8 experts, top-2; Hugging Face's default experts path, grouped_mm)
    against remat.models.mixtral.MixtralLayer with each policy: time ratios to the stock layer from
    interleaved rounds (see _policy_rows), saved bytes per token."""
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
    stock = _normal_init(MixtralDecoderLayer(config, 0).to(device=device, dtype=dtype))
    x = torch.randn(1, shape["tokens"], shape["hidden"], device=device, dtype=dtype, requires_grad=True)
    rope = MixtralRotaryEmbedding(config).to(device)(x, torch.arange(shape["tokens"], device=device)[None])
    return _policy_rows("mixtral_layer", shape, stock, MixtralLayer, x, {"position_embeddings": rope},
                        {"position_embeddings": rope}, device, quick, tags)


def _normal_init(stock):
    """Norm weights ~ N(1, 0.02), biases and matrices ~ N(0, 0.02) (stock initialises some norms to
    zeros and leaves routers tiny); returns ``stock``."""
    for name, p in stock.named_parameters():
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 and not name.endswith("bias") else 0.0, 0.02)
    return stock


def _float32(value):
    """``value`` with every floating tensor in it (nested tuples, lists, dicts) cast to fp32."""
    if torch.is_tensor(value):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_float32(v) for v in value)
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    return value


def _output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


# Absolute floor of the 16-bit check, relative to the output's largest magnitude: about half a
# unit in the last place (as tests/_checks.py).
_FLOOR = {torch.bfloat16: 4e-3, torch.float16: 5e-4}


def _check_same_computation(what, got, want, want32, routed):
    """Raises unless remat's layer output ``got`` ([B, N, hidden]) is the stock layer's
    computation. fp32: within 1e-3 of the stock output ``want`` on every element. 16-bit: the
    2x rule of DESIGN.md section 7 against ``want32`` (the stock layer run in fp32 on the same
    inputs): remat's largest per-token error at most twice stock's (``want``) plus a floor. A
    mixture of experts (``routed``) compares the 99th percentile of the per-token errors: a
    router logit pair closer than the rounding before it picks another expert for a few tokens,
    and stock does the same (Mixtral, bf16, 1024 tokens: stock 3 tokens off its own fp32 run,
    remat 3; the H200 saw 17 of 4096 between remat and stock). A wrong mask or rope table puts
    most tokens off."""
    got, want = _output(got), _output(want)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3, msg=lambda m: f"{what}: {m}")
        return
    want32 = _output(want32)
    quantile = 0.99 if routed else 1.0

    def token_error(value):
        return torch.quantile((value.float() - want32).abs().flatten(0, -2).amax(-1), quantile).item()

    error, stock_error = token_error(got), token_error(want)
    bound = 2 * stock_error + _FLOOR[got.dtype] * max(1.0, want32.abs().max().item())
    if error > bound:
        raise AssertionError(f"{what}: error against the fp32 stock layer {error:.3g} > 2 x stock's {stock_error:.3g} "
                             f"+ floor = {bound:.3g} ({'99th percentile' if routed else 'largest'} per-token error)")


def _policy_rows(block, shape, stock, remat_cls, x, stock_kwargs, remat_kwargs, device, quick, tags):
    """Rows for one stock decoder layer against ``remat_cls.from_module(stock, policy=p)`` for each
    policy: forward, backward (to x and every parameter) and full step timed in interleaved rounds
    (benchmarks.common.interleaved_timings), their time ratios to the stock layer ("time_vs_eager",
    with the 20-80% band and verdict) and saved-for-backward bytes per token. The stock layer is
    called with ``stock_kwargs`` (its rope tables, mask), remat's with ``remat_kwargs``; before
    timing, each remat layer's output is checked against the stock layer's (a wrong mask or rope
    argument would otherwise time a different computation)."""
    dy = torch.randn_like(x)
    params = list(stock.parameters())
    layers = {"torch": (stock, stock_kwargs),
              **{f"remat-{p}": (remat_cls.from_module(stock, policy=p), remat_kwargs)
                 for p in ("speed", "balanced", "memory")}}
    with torch.no_grad():
        want = stock(x, **stock_kwargs)
        want32 = None if x.dtype == torch.float32 else copy.deepcopy(stock).float()(x.float(), **_float32(stock_kwargs))
        try:
            for name, (layer, kwargs) in layers.items():
                _check_same_computation(f"{block} {name}", layer(x, **kwargs), want, want32, routed="experts" in shape)
        except AssertionError as error:
            # Not timed, and said so: the other blocks' rows still get written, then
            # benchmarks.run exits non-zero (CHECK_FAILURES).
            CHECK_FAILURES.append(f"{block} not timed, its remat layer is not the stock computation: {error}")
            print(f"WARNING: {CHECK_FAILURES[-1]}", file=sys.stderr)
            return []
        del want32
    steps = {name: autograd_step(functools.partial(layer, **kwargs), (x,), [x, *params], dy)
             for name, (layer, kwargs) in layers.items()}
    times = interleaved_timings(steps, device, rounds=2 if quick else 12)
    saved_by_name = {name: saved_bytes(layer, x, **kwargs) for name, (layer, kwargs) in layers.items()}
    rows = []
    for (name, mode), columns in timing_summary(times, {"eager": "torch"}, block).items():
        saved = saved_by_name[name]
        rows.append({"block": block, "depth": 1, **shape, "dtype": str(x.dtype).replace("torch.", ""),
                     "provider": name, "mode": mode, **columns, "saved_bytes": saved,
                     "saved_bytes_per_token_per_layer": saved / shape["tokens"], **tags})
    return rows


def family_rows(device, quick, tags):
    """One decoder layer of each other patched family against its remat layer with each policy (time
    ratios from interleaved rounds, saved bytes per token; see _policy_rows): Qwen3, Phi-3,
    Gemma 2 (a sliding-window layer, window half the tokens, logit softcap 50; eager attention with
    the sliding mask, as Hugging Face refuses SDPA for softcapping), Gemma 3 (a global layer), GPT-2
    and Qwen3-MoE (8 experts, top-2, grouped_mm). The other stock layers use SDPA without a mask
    (causal). Configs are built here at Llama-like sizes (head dim 64)."""
    import transformers
    from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer, Gemma2RotaryEmbedding
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RotaryEmbedding
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    from remat.models.gemma import GemmaLayer
    from remat.models.gpt2 import GPT2Layer
    from remat.models.phi3 import Phi3Layer
    from remat.models.qwen3 import Qwen3Layer
    from remat.models.qwen3_moe import Qwen3MoeLayer

    if device.type == "cuda":
        base, dtype = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, tokens=4096), torch.bfloat16
    else:
        base, dtype = dict(hidden=512, inter=1376, heads=8, kv_heads=4, tokens=128 if quick else 256), torch.float32
    tokens, window = base["tokens"], base["tokens"] // 2
    common = dict(vocab_size=256, hidden_size=base["hidden"], intermediate_size=base["inter"], num_hidden_layers=1,
                  num_attention_heads=base["heads"], num_key_value_heads=base["kv_heads"],
                  head_dim=base["hidden"] // base["heads"], use_cache=False, attn_implementation="sdpa")
    gemma = dict(common, query_pre_attn_scalar=common["head_dim"], sliding_window=window)
    moe = dict(hidden=base["hidden"], inter=base["inter"] // 2, experts=8, top_k=2, heads=base["heads"],
               kv_heads=base["kv_heads"], tokens=tokens)
    cases = [  # block, shape, config, stock layer class, rotary class (None: GPT-2's learned positions), remat class
        ("qwen3_layer", base, transformers.Qwen3Config(**common), Qwen3DecoderLayer, Qwen3RotaryEmbedding,
         Qwen3Layer),
        ("phi3_layer", base, transformers.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2),
         Phi3DecoderLayer, Phi3RotaryEmbedding, Phi3Layer),
        ("gemma2_sliding_layer", dict(base, window=window, softcap=50.0),
         transformers.Gemma2Config(**dict(gemma, attn_implementation="eager"), attn_logit_softcapping=50.0,
                                   layer_types=["sliding_attention"]), Gemma2DecoderLayer, Gemma2RotaryEmbedding,
         GemmaLayer),
        ("gemma3_layer", base, transformers.Gemma3TextConfig(**gemma, layer_types=["full_attention"]),
         Gemma3DecoderLayer, Gemma3RotaryEmbedding, GemmaLayer),
        ("gpt2_layer", dict(base, inter=4 * base["hidden"], kv_heads=base["heads"]),
         transformers.GPT2Config(vocab_size=256, n_embd=base["hidden"], n_layer=1, n_head=base["heads"],
                                 n_positions=tokens, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                 attn_pdrop=0.0, use_cache=False, attn_implementation="sdpa"),
         GPT2Block, None, GPT2Layer),
        ("qwen3_moe_layer", moe,
         transformers.Qwen3MoeConfig(**dict(common, intermediate_size=moe["inter"]), moe_intermediate_size=moe["inter"],
                                     num_experts=moe["experts"], num_experts_per_tok=moe["top_k"],
                                     norm_topk_prob=True, experts_implementation="grouped_mm"),
         Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding, Qwen3MoeLayer),
    ]
    positions = torch.arange(tokens, device=device)[None]
    rows = []
    for block, shape, config, stock_cls, rotary_cls, remat_cls in cases:
        torch.manual_seed(0)
        stock = _normal_init(stock_cls(config, 0).to(device=device, dtype=dtype))
        x = torch.randn(1, tokens, shape["hidden"], device=device, dtype=dtype, requires_grad=True)
        if rotary_cls is None:
            stock_kwargs = remat_kwargs = {}
        else:
            rotary = rotary_cls(config).to(device)
            layer_type = ("full_attention",) if rotary_cls is Gemma3RotaryEmbedding else ()
            rope = rotary(x, positions, *layer_type)
            stock_kwargs = remat_kwargs = {"position_embeddings": rope}
        if config._attn_implementation == "eager":  # eager needs the (sliding) causal mask as an additive bias
            offset = positions[0][:, None] - positions[0][None, :]
            allowed = (offset >= 0) & (offset < window)
            mask = torch.zeros(tokens, tokens, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))
            stock_kwargs = dict(stock_kwargs, attention_mask=mask[None, None])
        rows.extend(_policy_rows(block, shape, stock, remat_cls, x, stock_kwargs, remat_kwargs, device, quick, tags))
    return rows


def same_columns(rows):
    """Rows of different blocks carry different columns (the LoRA rows: rank, lora_dropout; the
    family rows: experts, window, softcap; no peak memory outside the Llama rows); every row gets
    every column ("" where it has none), so one CSV (benchmarks.common.write_csv takes the first
    row's columns) and one table hold them all."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key, "") for key in columns} for row in rows]


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_rows(device, quick, tags):
    """LoRA fine-tuning of Llama decoder layers (PEFT LoRA, rank 16, alpha 32, lora_dropout 0 and
    0.05, on every projection; base weights frozen, as PEFT leaves them): stock layers with PEFT
    ("peft", the baseline), the same under per-layer torch.utils.checkpoint (what Hugging Face's
    gradient_checkpointing=True runs, "peft+checkpoint"), remat.nn.LlamaLayer built from the
    adapted layers with each policy ("remat-<policy>", the adapters inside the fused blocks), and
    the balanced layer with its own gradient checkpointing ("remat-balanced+checkpoint"). Forward,
    backward (to the input and the adapters) and full step per provider, timed in interleaved rounds
    (benchmarks.common.interleaved_timings: "time_vs_eager" is the ratio to "peft",
    "time_vs_checkpoint" to "peft+checkpoint", with 20-80% bands and verdicts); saved-for-backward
    bytes per token per layer."""
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

        steps = {name: autograd_step(model, (x, rope), [x, *adapters], dy) for name, model in models.items()}
        times = interleaved_timings(steps, device, rounds=2 if quick else 12)
        case = f"layers+lora depth {depth} lora_dropout {dropout}"
        saved_by_name = {name: saved_bytes(model, x, rope) for name, model in models.items()}
        for (name, mode), columns in timing_summary(times, {"eager": "peft", "checkpoint": "peft+checkpoint"},
                                                    case).items():
            saved = saved_by_name[name]
            rows.append({"block": "llama_layer_lora", "depth": depth, **shape, "rank": rank, "lora_dropout": dropout,
                         "dtype": str(dtype).replace("torch.", ""), "provider": name, "mode": mode, **columns,
                         "saved_bytes": saved, "saved_bytes_per_token_per_layer": saved / (tokens * depth),
                         "saved_vs_eager": saved / saved_by_name["peft"], **tags})
        progress.step(f"layers+lora depth {depth} lora_dropout {dropout}")
    return rows


summary_columns = ["block", "depth", "tokens", "hidden", "dtype", "provider", "mode", "time_vs_eager",
                   "time_vs_eager_q20", "time_vs_eager_q80", "time_vs_eager_verdict", "time_vs_checkpoint",
                   "median_ms", "saved_bytes_per_token_per_layer", "saved_vs_eager", "peak_mem_bytes", "suspect"]
