"""``python -m remat fit CONFIG.json --gpu-memory 80GB``: the longest sequence (or the largest
batch) whose training step fits a GPU, per setup, estimated on this machine without a GPU.

The model is built from a Hugging Face config on the meta device, given LoRA adapters with PEFT if
asked, moved onto fake CUDA tensors (``remat.estimator.on_fake_device``), set up (stock, Hugging
Face gradient checkpointing, or ``remat.patch`` with a policy) and estimated
(``remat.estimator.estimate``) at lengths found by doubling, then bisection.
"""

import argparse
import contextlib
import dataclasses
import json
import re
import sys

import torch

from remat import peak_plan
from remat.estimator import estimate, format_bytes, on_fake_device
from remat.replacement import MODULE_KINDS
from remat.sequence_parallel import SequenceGroup

SETUPS = ("stock", "stock+checkpointing", "remat:speed", "remat:balanced", "remat:memory", "remat:auto")
# What a GPU's memory holds besides the tensors the estimate counts: the CUDA context (~0.5 GiB),
# cuBLAS/cuDNN workspaces, the caching allocator's fragmentation.
DEFAULT_RESERVE = 3 * 2**30
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_bytes(text):
    """Bytes in ``text`` such as ``"80GB"``, ``"141 GiB"``, ``"512MB"`` or ``"1e9"``. GPU memory
    is quoted in binary units (an "80 GB" H100 holds 80 GiB of HBM), so GB and GiB both mean 2**30
    here, MB 2**20 and so on."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read a size from {text!r} (expected e.g. 80GB, 141GiB, 512MB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclasses.dataclass
class FitRow:
    """One setup's answer: the longest ``max_seq_len`` (at ``batch_size``) or, when a sequence
    length was fixed, the largest ``max_batch_size``; the estimate's device peak and host bytes
    there. ``note`` says why a setup could not be built or estimated (then the numbers are None), or
    how the row was reached and what its estimates assumed (:attr:`Estimate.assumptions`)."""

    setup: str
    max_seq_len: int | None
    max_batch_size: int | None
    peak_bytes: int | None
    host_bytes: int | None
    note: str = ""


def build_model(config, *, lora_rank=0, dtype=torch.bfloat16, lora_targets="all-linear"):
    """A causal LM from a Hugging Face config on fake CUDA tensors (no GPU needed), with PEFT LoRA
    adapters of rank ``lora_rank`` (alpha = rank, no dropout) when > 0, on ``lora_targets``: PEFT's
    ``target_modules``, default ``"all-linear"`` (on a mixture-of-experts model PEFT then also wraps
    the router and the 3-D expert weights, which remat's MoE layers do not take: name the attention
    projections instead, e.g. ``["q_proj", "k_proj", "v_proj", "o_proj"]``)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if lora_rank:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0,
                                                           target_modules=lora_targets))
    return on_fake_device(model)


def set_up(model, setup, offload=False, tile_tokens=None, sequence_parallel=None):
    """Applies ``setup`` (one of :data:`SETUPS` but ``remat:auto``, which :func:`fit` searches per
    candidate) to a freshly built model, remat's with host offload of what its layers keep when
    ``offload``, MLPs tiled by ``tile_tokens`` and, with ``sequence_parallel`` (a process group),
    its attention split over the group's ranks; returns the model."""
    import remat

    if sequence_parallel is not None and not setup.startswith("remat:"):
        raise ValueError(f"{setup} is not estimated under sequence parallelism (stock attention runs through "
                         "DeepSpeed's Ulysses wrapper, which the estimate does not simulate)")
    if setup == "stock":
        return model
    if setup == "stock+checkpointing":
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model
    remat.patch(model, policy=setup.removeprefix("remat:"), offload=offload, tile_tokens=tile_tokens,
                sequence_parallel=sequence_parallel)
    return model


@contextlib.contextmanager
def simulated_group(ranks):
    """A ``torch.distributed`` group of ``ranks`` processes for estimating one rank's step on this
    machine alone: PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``;
    this process is rank 0 and collectives return at once), initialised for the block and destroyed
    after. Yields the group; None for ``ranks == 1``. ValueError when torch.distributed is
    initialised already (estimate inside a real run with ``remat.patch(policy="auto", seq_len=...,
    sequence_parallel=group)`` instead)."""
    if ranks == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError("sequence_parallel estimates run outside a distributed run (torch.distributed is "
                         "initialised here)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _largest(fits, start, limit):
    """The largest n in [1, limit] with fits(n) not None (fits is monotone: larger n fit less),
    by halving or doubling from ``start``, then bisection to within 1/64 (at least 1).
    Returns (n, fits(n)), or (0, None) when not even 1 fits."""
    n = min(start, limit)
    result = fits(n)
    if result is None:
        high = n
        while True:
            n //= 2
            if n < 1:
                return 0, None
            result = fits(n)
            if result is not None:
                break
            high = n
        low, low_result = n, result
    else:
        low, low_result, high = n, result, None
        while high is None:
            if low >= limit:
                return low, low_result
            n = min(2 * low, limit)
            result = fits(n)
            if result is None:
                high = n
            else:
                low, low_result = n, result
    while high - low > max(1, low // 64):
        middle = (low + high) // 2
        result = fits(middle)
        if result is None:
            high = middle
        else:
            low, low_result = middle, result
    return low, low_result


def fit(config, *, gpu_memory, reserve=DEFAULT_RESERVE, lora_rank=0, batch_size=1, seq_len=None,
        setups=SETUPS, max_tokens=2**25, optimizer=None, offload=False, tile_tokens=None, host_memory=None,
        lora_targets="all-linear", sequence_parallel=1, optimizer_shards=1):
    """For each setup, the longest sequence (or, with ``seq_len`` given, the largest batch) whose
    training step's estimated device peak fits ``gpu_memory - reserve`` bytes.

    Args:
        config: a Hugging Face ``PretrainedConfig`` of a causal LM.
        gpu_memory: the GPU's total memory in bytes.
        reserve: bytes kept free for what the estimate does not count (default 3 GiB).
        lora_rank: PEFT LoRA rank; 0 (default) trains every parameter.
        lora_targets: the modules given LoRA (:func:`build_model`; default every linear layer).
        batch_size: sequences per step when searching the length (default 1).
        seq_len: fix the length and search the batch size instead (default None).
        setups: names from :data:`SETUPS` (default all).
        max_tokens: the search stops there (default 2**25).
        optimizer, optimizer_shards: passed to ``estimate`` (None or "adam"; the ranks Adam's
            states are partitioned over, ZeRO-1/2, default 1).
        offload: remat's setups offload what their layers keep to host memory
            (``remat.patch(offload=True)``); the rows' ``host_bytes`` are then the host peak.
        tile_tokens: remat's setups run their MLPs and attention sub-blocks over tiles of that
            many tokens (``remat.patch(tile_tokens=...)``); default None.
        host_memory: None (default: any), or the host bytes a step may hold (offloaded tensors):
            a length whose estimated host peak exceeds it does not fit.
        sequence_parallel: the number of GPUs P sharing one sequence (Ulysses; default 1):
            remat's setups are patched with ``sequence_parallel`` over a simulated group
            (:func:`simulated_group`) and one rank's step (a shard of N / P tokens) is estimated;
            ``gpu_memory`` and ``host_memory`` are per rank, and each row's length is the whole
            sequence N. Parameters, gradients and optimizer states are counted whole on every
            rank (no ZeRO sharding). The stock setups are not estimated then (a row says so).

    Returns:
        a list of :class:`FitRow`, one per setup.
    """
    usable = gpu_memory - reserve
    if host_memory is not None and host_memory < 0:
        raise ValueError(f"host_memory must be None or >= 0, got {host_memory}")
    host_limit = float("inf") if host_memory is None else host_memory

    def within(result):
        return result.peak_bytes <= usable and result.host_bytes <= host_limit

    if usable <= 0:
        raise ValueError(f"gpu_memory ({gpu_memory}) must exceed the reserve ({reserve})")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise ValueError(f"unknown setups {unknown}; choose from {list(SETUPS)}")
    if isinstance(sequence_parallel, bool) or not isinstance(sequence_parallel, int) or sequence_parallel < 1:
        raise ValueError(f"sequence_parallel must be an int >= 1, got {sequence_parallel!r}")
    if seq_len is not None and seq_len % sequence_parallel:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of sequence_parallel ({sequence_parallel})")
    ranks = sequence_parallel
    shard_len = None if seq_len is None else seq_len // ranks  # one rank's tokens per sequence
    limit = max(max_tokens // ranks // (shard_len if shard_len is not None else batch_size), 1)
    start = 1 if seq_len is not None else 1024

    def search(model):
        def fits(n):
            shape = (n, shard_len) if seq_len is not None else (batch_size, n)
            result = estimate(model, batch_size=shape[0], seq_len=shape[1], optimizer=optimizer,
                              optimizer_shards=optimizer_shards)
            return result if within(result) else None
        return _largest(fits, start, limit)

    with simulated_group(ranks) as group:
        return _fit_rows(config, setups, lora_rank, lora_targets, offload, tile_tokens, group, ranks, seq_len,
                         batch_size, limit, optimizer, optimizer_shards, within, search)


def _fit_rows(config, setups, lora_rank, lora_targets, offload, tile_tokens, group, ranks, seq_len, batch_size,
              limit, optimizer, optimizer_shards, within, search):
    """:func:`fit`'s rows, per setup (its search runs inside the simulated group, if any)."""
    source = None if group is None else SequenceGroup(group)
    shard_len = None if seq_len is None else seq_len // ranks
    rows = []
    for setup in setups:
        note = ""
        if setup == "remat:auto":
            # policy="auto" with seq_len takes the cheapest of remat.peak_plan's candidates that
            # fits, so the longest step it can plan is the longest any candidate fits. The most
            # frugal candidate (the last) is searched first; another is searched only if it fits
            # one step (1/64) past that length, since a peak grows with the length.
            n, result = 0, None
            for candidate in reversed(peak_plan.CANDIDATES):
                model = build_model(config, lora_rank=lora_rank, lora_targets=lora_targets)
                peak_plan.configure(model, candidate, MODULE_KINDS, None, peak_plan.DEFAULT_TILE_TOKENS, source)
                if n:
                    beyond = min(n + max(1, n // 64), limit)
                    shape = (beyond, shard_len) if seq_len is not None else (batch_size, beyond)
                    if beyond == n or not within(estimate(model, batch_size=shape[0], seq_len=shape[1],
                                                          optimizer=optimizer, optimizer_shards=optimizer_shards)):
                        continue
                found, found_result = search(model)
                if found > n:
                    n, result, note = found, found_result, f"reached with {candidate[0]}"
        else:
            try:
                model = set_up(build_model(config, lora_rank=lora_rank, lora_targets=lora_targets), setup, offload,
                               tile_tokens, group)
                n, result = search(model)
            except Exception as error:  # a setup that cannot be built or estimated is reported, not fatal
                rows.append(FitRow(setup, None, None, None, None, f"{type(error).__name__}: {error}"))
                continue
        if result is not None and result.assumptions:
            note = "; ".join(filter(None, (note, *(f"assumed {text}" for text in result.assumptions))))
        peak = result.peak_bytes if result is not None else None
        host = result.host_bytes if result is not None else None
        if ranks > 1 and result is not None:
            note = "; ".join(filter(None, (f"per rank of {ranks}", note)))
        if seq_len is not None:
            rows.append(FitRow(setup, seq_len if n else None, n, peak, host, note))
        else:  # the whole sequence: each of the ranks holds n tokens of it
            rows.append(FitRow(setup, n * ranks, batch_size if n else None, peak, host, note))
    return rows


def _table(rows, gpu_memory, reserve, searching_batch):
    gib = 2**30
    lines = [f"GPU memory {format_bytes(gpu_memory, 1)}, reserve {format_bytes(reserve, 1)} kept free "
             f"(CUDA context, workspaces, fragmentation): {format_bytes(gpu_memory - reserve, 1)} usable",
             f"{'setup':<22}{'max batch' if searching_batch else 'max seq len':>14}{'peak GiB':>11}{'host GiB':>11}"]
    for row in rows:
        value = row.max_batch_size if searching_batch else row.max_seq_len
        note = f"  {row.note}" if row.note else ""
        if row.peak_bytes is None and row.note:  # the setup could not be estimated
            lines.append(f"{row.setup:<22}{'-':>14}{'':>11}{'':>11}{note}")
        elif not value:
            lines.append(f"{row.setup:<22}{'none fits':>14}{'':>11}{'':>11}{note}")
        else:
            lines.append(f"{row.setup:<22}{value:>14,}{row.peak_bytes / gib:>11.2f}{row.host_bytes / gib:>11.2f}"
                         f"{note}")
    return "\n".join(lines)


def _lora_targets(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("--lora-targets names no module")
    return "all-linear" if names == ["all-linear"] else names


def main(argv):
    """The ``fit`` command (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m remat fit",
                                     description="Longest sequence (or largest batch) whose training step fits a GPU, "
                                                 "per setup, estimated without a GPU.")
    parser.add_argument("config", help="a Hugging Face config.json of a causal LM")
    parser.add_argument("--gpu-memory", required=True, help="the GPU's total memory, e.g. 80GB or 141GB")
    parser.add_argument("--reserve", default="3GiB", help="memory kept free for what is not counted (default 3GiB)")
    parser.add_argument("--lora-rank", type=int, default=0, help="PEFT LoRA rank on all linear layers (0: full)")
    parser.add_argument("--lora-targets", default="all-linear",
                        help="comma-separated module names given LoRA (default all-linear), e.g. "
                             "q_proj,k_proj,v_proj,o_proj for a mixture-of-experts model")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None, help="fix the length and search the batch size")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, from " + ", ".join(SETUPS))
    parser.add_argument("--adam", action="store_true", help="count fp32 Adam states of the trainable parameters")
    parser.add_argument("--optimizer-shards", type=int, default=1, metavar="R",
                        help="Adam's states partitioned over R ranks (ZeRO-1/2), default 1")
    parser.add_argument("--offload", action="store_true", help="remat's layers offload what they keep to the host")
    parser.add_argument("--tile-tokens", type=int, default=None,
                        help="remat's MLPs and attention run over tiles of this many tokens")
    parser.add_argument("--host-memory", default=None,
                        help="the host memory a step may hold for offloaded tensors, e.g. 512GB (default: any)")
    parser.add_argument("--sequence-parallel", type=int, default=1, metavar="P",
                        help="GPUs sharing one sequence (Ulysses): per-rank peaks, whole-sequence lengths")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    args = parser.parse_args(argv)
    import transformers

    with open(args.config) as file:
        config = transformers.AutoConfig.for_model(**json.load(file))
    try:
        gpu_memory, reserve = parse_bytes(args.gpu_memory), parse_bytes(args.reserve)
        host_memory = parse_bytes(args.host_memory) if args.host_memory is not None else None
        rows = fit(config, gpu_memory=gpu_memory, reserve=reserve, lora_rank=args.lora_rank,
                   batch_size=args.batch_size, seq_len=args.seq_len,
                   setups=[s.strip() for s in args.setups.split(",") if s.strip()],
                   optimizer="adam" if args.adam else None, offload=args.offload, tile_tokens=args.tile_tokens,
                   host_memory=host_memory, lora_targets=_lora_targets(args.lora_targets),
                   sequence_parallel=args.sequence_parallel, optimizer_shards=args.optimizer_shards)
    except ValueError as error:
        print(f"python -m remat fit: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"setup": r.setup, "max_seq_len": r.max_seq_len, "max_batch_size": r.max_batch_size,
                           "peak_bytes": r.peak_bytes, "host_bytes": r.host_bytes, "note": r.note} for r in rows]))
    else:
        print(_table(rows, gpu_memory, reserve, args.seq_len is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
