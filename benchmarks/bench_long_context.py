"""The longest sequence that fits one GPU, per setup, for 8B models (README "Long context").

Estimated, not run: ``remat.planning.fit`` builds each model from its Hugging Face config
(``benchmarks/configs``) on fake CUDA tensors and searches the longest batch-1 sequence whose
estimated device peak fits the GPU's memory as the device reports it (``remat.planning.fit.GPUS``) less a 3
GiB reserve: the composed estimate (``remat.planning.composed``), each answer fitting and its next step up
(1/64, at most 1,024 tokens) shown not to. The numbers are the same on any machine (they depend on
the code, not on the device running the estimate); no GPU has checked them against
``torch.cuda.max_memory_allocated`` yet.

Each case runs twice for ``remat:auto``: with any host memory, and with the host memory one GPU of a
DGX H100 has (2 TiB for 8 GPUs: :data:`HOST_PER_GPU`), offloaded tensors counted as the pinned blocks
PyTorch's caching host allocator rounds them to. Each row records the seconds its case's search took
here (the build machine: 2 cores).
"""

import json
import os
import time

import transformers

from benchmarks.common import environment_tags
from remat.planning import fit as fit_module

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
GIB = 2**30
# A DGX H100's 2 TiB of host memory shared by its 8 GPUs.
HOST_PER_GPU = 256 * GIB

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# (model, config file, training, LoRA rank, LoRA targets, Adam states, GPU); quick runs the first.
# The MoE model's LoRA is on its attention: PEFT's all-linear also wraps its router and 3-D expert
# weights, which remat's MoE layers leave stock.
CASES = [
    ("Llama-3.1-8B", "llama-3.1-8b.json", "LoRA r=32", 32, "all-linear", False, "H100-80GB"),
    ("Llama-3.1-8B", "llama-3.1-8b.json", "LoRA r=32", 32, "all-linear", False, "H200"),
    ("Llama-3.1-8B", "llama-3.1-8b.json", "full, fp32 Adam", 0, "all-linear", True, "H100-80GB"),
    ("Llama-3.1-8B", "llama-3.1-8b.json", "full, fp32 Adam", 0, "all-linear", True, "H200"),
    ("Qwen3-8B", "qwen3-8b.json", "LoRA r=32", 32, "all-linear", False, "H100-80GB"),
    ("Qwen3-30B-A3B", "qwen3-30b-a3b.json", "LoRA r=32 on attention", 32, ATTENTION, False, "H100-80GB"),
]
QUICK_SETUPS = ("stock", "stock+checkpointing", "remat:memory")


def run(device=None, quick=False):
    """Rows per (case, setup); ``device`` is ignored (the estimate targets a CUDA GPU)."""
    env = environment_tags()
    rows = []
    for model, file, training, rank, targets, adam, gpu in CASES[:1] if quick else CASES:
        with open(os.path.join(CONFIG_DIR, file)) as handle:
            config = transformers.AutoConfig.for_model(**json.load(handle))
        gpu_memory = fit_module.GPUS[gpu]
        searches = [(QUICK_SETUPS if quick else fit_module.SETUPS, None)]
        if not quick:
            searches.append((("remat:auto",), HOST_PER_GPU))
        for setups, host_memory in searches:
            started = time.monotonic()
            found = fit_module.fit(config, gpu_memory=gpu_memory, lora_rank=rank, setups=setups,
                                   optimizer="adam" if adam else None, lora_targets=targets, host_memory=host_memory)
            seconds = round(time.monotonic() - started, 1)
            for row in found:
                rows.append({
                    "model": model, "training": training, "gpu": gpu, "gpu_memory_gib": round(gpu_memory / GIB, 2),
                    "host_limit_gib": host_memory // GIB if host_memory else "any", "setup": row.setup,
                    "max_seq_len": row.max_seq_len or 0,
                    "peak_gib": round(row.peak_bytes / GIB, 2) if row.peak_bytes else 0.0,
                    "host_gib": round(row.host_bytes / GIB, 2) if row.host_bytes else 0.0,
                    "search_seconds": seconds, "plan": row.note,
                    "device": "estimate for a CUDA GPU (sm_90), no GPU used", "commit": env["commit"],
                    "date": env["date"],
                })
    return rows


summary_columns = ["model", "training", "gpu", "host_limit_gib", "setup", "max_seq_len", "peak_gib", "host_gib",
                   "search_seconds", "plan"]
