"""One rank's estimated step for Llama-3.1-8B under sequence parallelism (README "Sequence
parallelism, estimated"; issue 30).

Estimated, not run: the model is built from its Hugging Face config (``benchmarks/configs``) on
fake CUDA tensors, patched as remat.planning.peak_plan's most frugal candidate ("memory" layers, checkpointed,
their inputs offloaded to the host without prefetch, MLP and loss tiled by 8,192 tokens; attention
untiled, which sequence parallelism does not tile, but its projections and o_proj run one head
group at a time: remat.autograd.norm_attention_parallel), with its attention split over P ranks of
PyTorch's fake process group (remat.planning.fit.simulated_group), and ``remat.estimate`` runs one rank's
step on its shard of N / P tokens. Each row is one estimate at the length given, not a search: a
LoRA estimate at a million tokens per rank takes about seven to thirteen minutes here (the LoRA backward's row
chunks), so the lengths below were picked from the peaks' linear growth in the length and each
confirmed by its own estimate. No GPU has checked these peaks.

    python -m benchmarks.estimate_sequence_parallel [--out DIR] [--rows INDEX ...]

writes ``sequence-parallel-estimates.csv`` under ``--out`` (default benchmarks/results).
"""

import argparse
import csv
import json
import os
import time

import transformers

import remat
from benchmarks.common import environment_tags
from remat.planning import peak_plan
from remat.planning.fit import build_model, simulated_group
from remat.replacement import MODULE_KINDS
from remat.sequence_parallel import SequenceGroup

CONFIG = os.path.join(os.path.dirname(__file__), "configs", "llama-3.1-8b.json")
GIB = 2**30
# (training, ranks P, tokens per rank n): the longest whole sequences N = P n that fit 80 GB less the
# 3 GiB reserve (77 GiB), found from the linear growth of the peak and confirmed here, and a million
# tokens per rank on 8 ranks for LoRA (N = 8,388,608: issue 30's target).
ROWS = [
    ("lora", 8, 1_146_880),
    ("lora", 8, 1_048_576),
    ("full", 8, 770_048),
    ("lora", 32, 557_056),
    ("full", 32, 425_984),
]
LORA_RANK = 32


def estimate_row(config, training, ranks, tokens_per_rank):
    """One rank's estimate: a dict with the whole sequence's length, the per-rank device peak and
    host bytes (GiB) and the peak's breakdown. ``training``: ``"lora"`` (PEFT LoRA r=32 on every
    linear layer, no optimizer states counted: the adapters' are a few MiB) or ``"full"`` (every
    parameter trained, fp32 Adam states partitioned over the P ranks, ZeRO-1/2 style; parameters and
    gradients whole on every rank)."""
    if training not in ("lora", "full"):
        raise ValueError(f"training must be 'lora' or 'full', got {training!r}")
    start = time.perf_counter()
    candidate = peak_plan.CANDIDATES[-1]
    with simulated_group(ranks) as group:
        model = build_model(config, lora_rank=LORA_RANK if training == "lora" else 0)
        peak_plan.configure(model, candidate, MODULE_KINDS, None, peak_plan.DEFAULT_TILE_TOKENS,
                            SequenceGroup(group))
        options = {"optimizer": "adam", "optimizer_shards": ranks} if training == "full" else {}
        result = remat.estimate(model, seq_len=tokens_per_rank, batch_size=1, **options)
    return {
        "model": "Llama-3.1-8B", "training": "LoRA r=32" if training == "lora" else "full, fp32 Adam over P ranks",
        "ranks": ranks, "tokens_per_rank": tokens_per_rank, "sequence_length": ranks * tokens_per_rank,
        "peak_gib": round(result.peak_bytes / GIB, 2), "host_gib_per_rank": round(result.host_bytes / GIB, 2),
        "fits_77_gib": result.peak_bytes <= 77 * GIB,
        "breakdown_gib": json.dumps({kind: round(value / GIB, 2) for kind, value in result.breakdown.items()}),
        "plan": candidate[0], "seconds": round(time.perf_counter() - start),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--rows", type=int, nargs="*", help="indices into ROWS (default: all)")
    args = parser.parse_args(argv)
    with open(CONFIG) as handle:
        config = transformers.AutoConfig.for_model(**json.load(handle))
    env = environment_tags()
    rows = []
    for index in args.rows if args.rows else range(len(ROWS)):
        row = estimate_row(config, *ROWS[index])
        row.update(device="estimate for a CUDA GPU (sm_90), no GPU used", commit=env["commit"], date=env["date"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sequence-parallel-estimates.csv")
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(path)


if __name__ == "__main__":
    main()
