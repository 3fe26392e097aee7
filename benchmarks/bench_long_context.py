"""The longest sequence that fits one GPU, per setup, for 8B models (README "Long context").

Estimated, not run: ``remat.fit`` builds each model from its Hugging Face config
(``benchmarks/configs``) on fake CUDA tensors and searches the longest batch-1 sequence whose
``remat.estimate`` device peak fits the GPU's memory less a 3 GiB reserve. The numbers are the
same on any machine (they depend on the code, not on the device running the estimate); no GPU
has checked them against ``torch.cuda.max_memory_allocated`` yet.

Besides the length and the peak, each row gives the host bytes per token (offloaded kept tensors)
and, for the offloading setups, the bytes copied per token per layer (to the host and back)
beside the layer's training FLOPs per token at that length (forward + backward, plus the
re-run forward when checkpointed: 6 or 8 times the layer's parameters, and 6 or 8 times
N x hidden for causal attention), so that a reader can set the copy against compute on their
GPU's link.
"""

import json
import os

import transformers

from benchmarks.common import environment_tags
from remat import fit as fit_module

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
GIB = 2**30

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# (model, config file, training, LoRA rank, LoRA targets, Adam states, GPU memory in GB); quick runs
# the first. The MoE model's LoRA is on its attention: PEFT's all-linear also wraps its router and
# 3-D expert weights, which remat's MoE layers leave stock.
CASES = [
    ("Llama-3.1-8B", "llama-3.1-8b.json", "LoRA r=32", 32, "all-linear", False, 80),
    ("Llama-3.1-8B", "llama-3.1-8b.json", "LoRA r=32", 32, "all-linear", False, 141),
    ("Llama-3.1-8B", "llama-3.1-8b.json", "full, fp32 Adam", 0, "all-linear", True, 80),
    ("Llama-3.1-8B", "llama-3.1-8b.json", "full, fp32 Adam", 0, "all-linear", True, 141),
    ("Qwen3-8B", "qwen3-8b.json", "LoRA r=32", 32, "all-linear", False, 80),
    ("Qwen3-30B-A3B", "qwen3-30b-a3b.json", "LoRA r=32 on attention", 32, ATTENTION, False, 80),
]
QUICK_SETUPS = ("stock", "stock+checkpointing", "remat:memory")


def _layer_params(config):
    """Parameters a token meets in one layer: the attention projections and the MLP (of a
    mixture-of-experts layer: the router and its k experts)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden
    experts = getattr(config, "num_experts", None)
    if experts:
        return attention + 3 * hidden * config.moe_intermediate_size * config.num_experts_per_tok + hidden * experts
    return attention + 3 * hidden * inter


def run(device=None, quick=False):
    """Rows per (case, setup); ``device`` is ignored (the estimate targets a CUDA GPU)."""
    env = environment_tags()
    rows = []
    for model, file, training, rank, targets, adam, gpu in CASES[:1] if quick else CASES:
        with open(os.path.join(CONFIG_DIR, file)) as handle:
            config = transformers.AutoConfig.for_model(**json.load(handle))
        setups = QUICK_SETUPS if quick else fit_module.SETUPS
        for row in fit_module.fit(config, gpu_memory=gpu * GIB, lora_rank=rank, setups=setups,
                                  optimizer="adam" if adam else None, lora_targets=targets):
            n = row.max_seq_len or 0
            offloads = "offload" in row.note
            checkpointed = row.setup == "stock+checkpointing" or "checkpointed" in row.note
            flops = (8 if checkpointed else 6) * (_layer_params(config) + n * config.hidden_size)
            rows.append({
                "model": model, "training": training, "gpu_memory_gb": gpu, "setup": row.setup,
                "max_seq_len": n, "peak_gib": round(row.peak_bytes / GIB, 2) if row.peak_bytes else 0.0,
                "host_gib": round(row.host_bytes / GIB, 2) if row.host_bytes else 0.0,
                "host_bytes_per_token": round(row.host_bytes / n) if n and row.host_bytes else 0,
                "copied_bytes_per_token_per_layer": (round(2 * row.host_bytes / n / config.num_hidden_layers)
                                                     if offloads and n else 0),
                "layer_flops_per_token": flops if n else 0,
                "plan": row.note, "device": "estimate for a CUDA GPU (sm_90), no GPU used",
                "commit": env["commit"], "date": env["date"],
            })
    return rows


summary_columns = ["model", "training", "gpu_memory_gb", "setup", "max_seq_len", "peak_gib", "host_gib",
                   "copied_bytes_per_token_per_layer", "plan"]
