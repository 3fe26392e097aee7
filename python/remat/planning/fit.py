"""``python -m remat fit CONFIG.json --gpu-memory 80GB``: the longest sequence (or the largest
batch) whose training step fits a GPU, per setup, estimated on this machine without a GPU.

The model is built from a Hugging Face config on the meta device, given LoRA adapters with PEFT if
asked, moved onto fake CUDA tensors (``remat.planning.estimator.on_fake_device``), set up (stock, Hugging
Face gradient checkpointing, or ``remat.patch`` with a policy) and estimated with the composed
estimate (``remat.planning.composed``: a few layers and the first and last tiles, seconds at any length;
``--exact``: the full simulation) at lengths a search places (:class:`_Search`): each row's answer
fits and the next step up (1/64 of it, at most 1,024 tokens) is shown not to fit. Rows are searched
in two processes where there are two CPUs.
"""

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import pickle
import re
import selectors
import subprocess
import sys
import tempfile
import time

import torch

from remat.planning import peak_plan
from remat.planning.composed import Composer, estimate
from remat.planning.estimator import format_bytes, on_fake_device
from remat.replacement import MODULE_KINDS
from remat.sequence_parallel import SequenceGroup

SETUPS = ("stock", "stock+checkpointing", "remat:speed", "remat:balanced", "remat:memory", "remat:auto")
# What a GPU's memory holds besides the tensors the estimate counts: the CUDA context (~0.5 GiB),
# cuBLAS/cuDNN workspaces, the caching allocator's fragmentation.
DEFAULT_RESERVE = 3 * 2**30
# Device memory as the devices report it (torch.cuda.get_device_properties(d).total_memory, the
# MiB nvidia-smi prints): an "80GB" H100 holds 81,559 MiB = 79.6 GiB, not 80 GiB.
GPUS = {
    "H100-80GB": 81_559 * 2**20,
    "H200": 143_771 * 2**20,
    "A100-80GB": 81_920 * 2**20,
    "A100-40GB": 40_960 * 2**20,
    "L40S": 46_068 * 2**20,
    "RTX4090": 24_564 * 2**20,
    "L4": 23_034 * 2**20,
}
# Keys a config must give: without them transformers silently takes its class's defaults (a
# Llama-2-7B's shapes for a LlamaConfig), and the answer would be for another model.
REQUIRED_CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
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


def attention_implementation(config):
    """The attention Hugging Face's stock model of ``config`` runs in the estimate: ``"sdpa"``
    (the flash or memory-efficient kernel on a GPU), or ``"eager"`` for a family without an SDPA
    path (Gemma 2: its logit soft-capping; eager keeps the [B, H, N, N] probabilities, so its stock
    rows are short). FlashAttention-2 (``flash_attn``) is not installed here to be estimated."""
    import transformers

    try:
        model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return "sdpa"  # not a causal LM transformers maps: building it fails with its own message
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", False) else "eager"


def build_model(config, *, lora_rank=0, dtype=torch.bfloat16, lora_targets="all-linear"):
    """A causal LM from a Hugging Face config on fake CUDA tensors (no GPU needed), with PEFT LoRA
    adapters of rank ``lora_rank`` (alpha = rank, no dropout) when > 0, on ``lora_targets``: PEFT's
    ``target_modules``, default ``"all-linear"`` (on a mixture-of-experts model PEFT then also wraps
    the router and the 3-D expert weights, which remat's MoE layers do not take: name the attention
    projections instead, e.g. ``["q_proj", "k_proj", "v_proj", "o_proj"]``)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                              attn_implementation=attention_implementation(config))
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


def step_of(n):
    """The search's resolution at length (or batch) n: 1/64 of it, at most 1,024 tokens, at least 1."""
    return max(1, min(n // 64, 1024))


class _Search:
    """The largest n in [1, limit] whose step fits (``evaluate(n, check)`` returns an Estimate,
    ``fits(estimate)`` says whether it is within the limits; fitting is monotone: a larger n holds
    no fewer bytes), found as a real search: the answer fits, and ``answer + step_of(answer)`` is
    shown not to fit (or is past ``limit``).

    A step's peak is a convex, piecewise-affine function of the length (the most bytes alive over
    moments whose bytes each grow linearly with it), so the chord through two probes crosses the
    limit at or before the true crossing and the line through the last two probes beyond them at or
    after it: each probe is placed where the line through its neighbours meets the limit (regula
    falsi), which lands on the answer in a few probes wherever the peak is affine near it. Inner
    probes run without the composed estimate's check view; the answer and its next step are
    estimated with it (a miss there simulates whole and the search goes on)."""

    def __init__(self, evaluate, margin, limit, start):
        """``margin(estimate)`` returns the bytes left under each limit (a tuple)."""
        self.evaluate, self.margin, self.limit, self.start = evaluate, margin, limit, start
        self.probes = 0
        self.beyond = None  # the estimate one step past the answer (None: past the limit)

    def _at(self, n, check=False):
        """(the Estimate at n, its margins: a tuple, each >= 0 where n fits that limit)."""
        self.probes += 1
        result = self.evaluate(n, check)
        return result, tuple(self.margin(result))

    def run(self):
        """(n, its Estimate), or (0, None) when not even 1 fits."""
        low = high = None  # (n, estimate, margin): the longest that fits, the shortest that does not
        n, previous = min(self.start, self.limit), None
        for _ in range(64):  # a bracket: down while nothing fits, up while everything does
            result, margins = self._at(n)
            margin = min(margins)
            point = (n, result, margin, margins)
            if margin >= 0:
                low = point
                if high is not None:
                    break
                if n >= self.limit:
                    return self._confirm(low, None)
                guess = self._toward(previous, point)
                n = min(self.limit, max(guess or 8 * n, n + step_of(n)))
            else:
                high = point
                if low is not None:
                    break
                if n == 1:
                    return 0, None
                n = max(1, min(n // 4, self._toward(previous, point) or n // 4))
            previous = point
        else:
            raise RuntimeError("the fit search found no bracket in 64 probes")
        for _ in range(64):  # inside the bracket: where the chord meets the limit, and its next step
            if high[0] - low[0] <= step_of(low[0]):
                return self._confirm(low, high)
            n = min(max(self._toward(low, high), low[0] + 1), high[0] - 1)
            for candidate in (n, n + step_of(n)):
                if not low[0] < candidate < high[0]:
                    continue
                result, margins = self._at(candidate)
                if min(margins) >= 0:
                    low = (candidate, result, min(margins), margins)
                else:
                    high = (candidate, result, min(margins), margins)
                    break
        raise RuntimeError("the fit search did not converge in 64 probes")

    @staticmethod
    def _toward(a, b):
        """Where the line through probes a and b (n, _, margins) first meets margin 0: each
        margin (the device's, the host's) is close to affine in n on its own, their minimum is not,
        so each is followed on its own line and the nearest positive crossing taken; None when no
        line crosses."""
        if a is None or a[0] == b[0]:
            return None
        # Only a margin that shrinks with n meets 0 ahead (a growing one never limits).
        crossings = [a[0] + (b[0] - a[0]) * ma / (ma - mb) for ma, mb in zip(a[3], b[3], strict=True)
                     if (mb - ma) * (b[0] - a[0]) < 0]
        crossings = [c for c in crossings if c > 0]
        return int(min(crossings)) if crossings else None

    def _confirm(self, low, high):
        """The answer re-estimated with the check view, and its next step (or the shorter length
        ``high`` found not to fit) shown not to fit with the check view too."""
        n = low[0]
        while True:
            result, margins = self._at(n, check=True)
            if min(margins) < 0:  # the checked estimate says it does not fit after all: come down
                n = max(0, n - step_of(n))
                if n == 0:
                    return 0, None
                continue
            following = n + step_of(n)
            if high is not None and n < high[0] < following:
                following = high[0]
            if following > self.limit:
                self.beyond = None
                return n, result
            self.beyond, after_margins = self._at(following, check=True)
            if min(after_margins) < 0:
                return n, result
            n = following


def fit(config, *, gpu_memory, reserve=DEFAULT_RESERVE, lora_rank=0, batch_size=1, seq_len=None,
        setups=SETUPS, max_tokens=2**25, optimizer=None, offload=False, tile_tokens=None, host_memory=None,
        lora_targets="all-linear", sequence_parallel=1, optimizer_shards=1, exact=False, progress=None,
        workers=None):
    """For each setup, the longest sequence (or, with ``seq_len`` given, the largest batch) whose
    training step's estimated device peak fits ``gpu_memory - reserve`` bytes (and its host bytes
    ``host_memory``): a search (:class:`_Search`) over the composed estimate (remat.planning.composed: seconds
    per estimate at any length), or over the full simulation with ``exact``.

    Args:
        config: a Hugging Face ``PretrainedConfig`` of a causal LM.
        gpu_memory: the GPU's total memory in bytes (:data:`GPUS` has what devices report).
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
        host_memory: None (default: any), or the host bytes a step may hold (offloaded tensors,
            pinned blocks as the allocator rounds them): a length whose host peak exceeds it does
            not fit.
        sequence_parallel: the number of GPUs P sharing one sequence (Ulysses; default 1):
            remat's setups are patched with ``sequence_parallel`` over a simulated group
            (:func:`simulated_group`) and one rank's step (a shard of N / P tokens) is estimated;
            ``gpu_memory`` and ``host_memory`` are per rank, and each row's length is the whole
            sequence N. Parameters, gradients and optimizer states are counted whole on every
            rank (no ZeRO sharding). The stock setups are not estimated then (a row says so).
        exact: search over the full simulation (``remat.estimate(..., exact=True)``; minutes per
            estimate at long context) instead of the composed estimate. Default False.
        progress: None, or a callable taking one line of text per finished row (the command prints
            them on stderr).
        workers: processes the rows are searched in (fresh Python processes; default min(2, CPUs));
            1 searches them here, one after another. Rows under sequence parallelism run here.

    Returns:
        a list of :class:`FitRow`, one per setup.
    """
    usable = gpu_memory - reserve
    if host_memory is not None and host_memory < 0:
        raise ValueError(f"host_memory must be None or >= 0, got {host_memory}")
    host_limit = float("inf") if host_memory is None else host_memory
    if usable <= 0:
        raise ValueError(f"gpu_memory ({gpu_memory}) must exceed the reserve ({reserve})")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise ValueError(f"unknown setups {unknown}; choose from {list(SETUPS)}")
    for name, value in (("sequence_parallel", sequence_parallel), ("batch_size", batch_size),
                        ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"seq_len must be None or an int >= 1, got {seq_len!r}")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an int >= 0, got {lora_rank!r}")
    if seq_len is not None and seq_len % sequence_parallel:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of sequence_parallel ({sequence_parallel})")
    if workers is None:
        workers = min(2, os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be None or an int >= 1, got {workers!r}")
    # The simulated process group of sequence parallelism lives in one process: its rows run here.
    if workers > 1 and len(setups) > 1 and sequence_parallel == 1:
        kwargs = dict(gpu_memory=gpu_memory, reserve=reserve, lora_rank=lora_rank, batch_size=batch_size,
                      seq_len=seq_len, max_tokens=max_tokens, optimizer=optimizer, offload=offload,
                      tile_tokens=tile_tokens, host_memory=host_memory, lora_targets=lora_targets,
                      optimizer_shards=optimizer_shards, exact=exact)
        return _rows_in_workers(dict(kwargs, config=config), list(setups), min(workers, len(setups)),
                                progress or (lambda line: None))
    ranks = sequence_parallel
    shard_len = None if seq_len is None else seq_len // ranks  # one rank's tokens per sequence
    limit = max(max_tokens // ranks // (shard_len if shard_len is not None else batch_size), 1)

    def margin(result):
        """The bytes left under each limit (device; host, with a host limit): negative over it."""
        device = usable - result.peak_bytes
        return (device,) if host_memory is None else (device, host_limit - result.host_bytes)

    def search(model):
        composer = None if exact else Composer(model)

        def evaluate(n, check):
            shape = (n, shard_len) if seq_len is not None else (batch_size, n)
            kwargs = dict(batch_size=shape[0], seq_len=shape[1], optimizer=optimizer,
                          optimizer_shards=optimizer_shards)
            if exact:
                return estimate(model, exact=True, **kwargs)
            return composer.estimate(check=check, **kwargs)

        finder = _Search(evaluate, margin, limit, 1 if seq_len is not None else 8192)
        n, result = finder.run()
        return n, result, finder.probes, _limited_by(finder.beyond, usable)

    def probe(model, n):
        """An estimate at n that only decides whether a search is worth running (not checked)."""
        shape = (n, shard_len) if seq_len is not None else (batch_size, n)
        kwargs = dict(batch_size=shape[0], seq_len=shape[1], optimizer=optimizer, optimizer_shards=optimizer_shards)
        if exact:
            return estimate(model, exact=True, **kwargs)
        return Composer(model).estimate(check=False, **kwargs)

    with simulated_group(ranks) as group:
        return _fit_rows(config, setups, lora_rank, lora_targets, offload, tile_tokens, group, ranks, seq_len,
                         batch_size, limit, margin, search, probe, progress or (lambda line: None), usable)


def _fit_rows(config, setups, lora_rank, lora_targets, offload, tile_tokens, group, ranks, seq_len, batch_size,
              limit, margin, search, probe, progress, usable):
    """:func:`fit`'s rows, per setup, in this process (its search runs inside the simulated group,
    if any)."""
    source = None if group is None else SequenceGroup(group)

    def row_for(setup):
        """(the setup's FitRow, a progress line)."""
        started = time.monotonic()
        note, probes, limited = "", 0, ""
        if group is not None and not setup.startswith("remat:"):
            return (FitRow(setup, None, None, None, None, "not estimated under sequence parallelism: stock attention "
                           "runs through DeepSpeed's Ulysses wrapper, which the estimate does not simulate"),
                    f"{setup}: not estimated under sequence parallelism")
        try:
            attention = attention_implementation(config)
            if attention != "sdpa" and not setup.startswith("remat:"):
                note = f"Hugging Face's {attention} attention ({type(config).__name__} has no SDPA path)"
            if setup == "remat:auto":
                n, result, probes, limited, note = _search_auto(config, lora_rank, lora_targets, source, limit,
                                                                margin, search, probe, usable)
            else:
                model = build_model(config, lora_rank=lora_rank, lora_targets=lora_targets)
                set_up(model, setup, offload, tile_tokens, group)
                if setup.startswith("remat:") and not _fused_any(model):
                    note = "left unchanged: stock (remat fuses no layer of this family)"
                n, result, probes, limited = search(model)
        except Exception as error:  # a setup that cannot be built or estimated is reported as failed
            return (FitRow(setup, None, None, None, None, f"failed: {type(error).__name__}: {error}"),
                    f"{setup}: failed ({type(error).__name__}: {error})")
        if result is not None:
            note = "; ".join(filter(None, (note, result.method, *(f"assumed {text}" for text in result.assumptions))))
            note = "; ".join(filter(None, (note, limited)))
        peak = result.peak_bytes if result is not None else None
        host = result.host_bytes if result is not None else None
        if ranks > 1 and result is not None:
            note = "; ".join(filter(None, (f"per rank of {ranks}", note)))
        if seq_len is not None:
            row = FitRow(setup, seq_len if n else None, n, peak, host, note)
        else:  # the whole sequence: each of the ranks holds n tokens of it
            row = FitRow(setup, n * ranks, batch_size if n else None, peak, host, note)
        line = (f"{setup}: {n * (1 if seq_len is not None else ranks):,} {'sequences' if seq_len else 'tokens'} "
                f"({probes} estimates, {time.monotonic() - started:.1f} s)")
        return row, line

    rows = []
    for setup in setups:
        row, line = row_for(setup)
        rows.append(row)
        progress(line)
    return rows


def _rows_in_workers(kwargs, setups, workers, progress):
    """:func:`fit`'s rows searched in ``workers`` fresh Python processes (``fit(**kwargs,
    setups=group, workers=1)`` each), ``progress`` called here as each row arrives. Fresh
    interpreters, not forks: a process forked from one whose threads run (OpenMP's, after any
    parallel PyTorch op) can deadlock, as a benchmark run did here; and not multiprocessing's spawn,
    which re-runs the caller's main module. The remat:auto row (the most estimates) gets a process
    of its own, the others share the rest."""
    rest = [s for s in setups if s != "remat:auto"]
    groups = [["remat:auto"]] if "remat:auto" in setups else []
    slots = max(workers - len(groups), 1)
    groups += [g for g in (rest[i::slots] for i in range(slots)) if g]
    processes = []
    for group in groups:
        log = tempfile.TemporaryFile()
        process = subprocess.Popen([sys.executable, "-c", "from remat.planning.fit import _worker; _worker()"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        process.stdin.write(pickle.dumps((kwargs, group)))
        process.stdin.close()
        processes.append((process, log))
    rows = {}
    with selectors.DefaultSelector() as selector:
        for process, _ in processes:
            selector.register(process.stdout, selectors.EVENT_READ)
        open_streams = len(processes)
        while open_streams:
            for key, _ in selector.select():
                line = key.fileobj.readline()
                if not line:
                    selector.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                setup, row, text = pickle.loads(base64.b64decode(line))
                rows[setup] = row
                progress(text)
    for process, log in processes:
        if process.wait() != 0:
            log.seek(0)
            raise RuntimeError(f"a fit worker failed (exit {process.returncode}):\n{log.read().decode()[-4000:]}")
        log.close()
    return [rows[setup] for setup in setups]


def _worker():
    """A fit worker (:func:`_rows_in_workers`): reads (fit's keyword arguments, setups) pickled on
    stdin and writes one base64 pickled (setup, FitRow, progress line) line per row on stdout."""
    kwargs, group = pickle.loads(sys.stdin.buffer.read())
    out = sys.stdout.buffer
    for setup in group:
        lines = []
        row = fit(**kwargs, setups=(setup,), workers=1, progress=lines.append)[0]
        out.write(base64.b64encode(pickle.dumps((setup, row, lines[0]))) + b"\n")
        out.flush()


def _limited_by(beyond, usable):
    """What the next step up exceeds: the device's usable bytes or the host limit; or that the
    search stopped at its largest length (``beyond`` None)."""
    if beyond is None:
        return "stopped at max_tokens"
    return "limited by the device" if beyond.peak_bytes > usable else "limited by the host memory"


def _fused_any(model):
    from remat.nn.layers import PreNormDecoderLayer

    return any(isinstance(m, PreNormDecoderLayer) for m in model.modules())


def _search_auto(config, lora_rank, lora_targets, source, limit, margin, search, probe, usable):
    """The remat:auto row: ``policy="auto"`` with seq_len takes the cheapest of
    remat.planning.peak_plan's candidates that fits, so the longest step it can plan is the longest any
    candidate fits. The most frugal candidate (the last) is searched first; the one before it is
    searched only if it fits one step past that length (a peak grows with the length), and the
    walk stops at the first that exceeds the device there (each candidate keeps no less on the
    device than the one after it; only a host limit can favour an earlier one).
    Returns (n, Estimate, probes, what limits it, note)."""
    n, result, probes, limited, note = 0, None, 0, "", ""
    for candidate in reversed(peak_plan.CANDIDATES):
        model = build_model(config, lora_rank=lora_rank, lora_targets=lora_targets)
        peak_plan.configure(model, candidate, MODULE_KINDS, None, peak_plan.DEFAULT_TILE_TOKENS, source)
        if n:
            beyond = min(n + step_of(n), limit)
            if beyond == n:
                break
            probes += 1
            result_beyond = probe(model, beyond)
            if result_beyond.peak_bytes > usable:
                # The candidates are in the order of their device bytes, the most first: one that
                # does not fit the device one step past n leaves none before it that would.
                break
            if min(margin(result_beyond)) < 0:  # over the host limit only: an earlier one may offload less
                continue
        found, found_result, found_probes, found_limited = search(model)
        probes += found_probes
        if found > n:
            n, result, limited, note = found, found_result, found_limited, f"reached with {candidate[0]}"
    return n, result, probes, limited, note


def _table(rows, gpu_memory, reserve, searching_batch, host_memory=None):
    gib = 2**30
    host = "any host memory" if host_memory is None else f"host memory {format_bytes(host_memory, 1)} per GPU"
    lines = [f"GPU memory {format_bytes(gpu_memory, 2)}, reserve {format_bytes(reserve, 1)} kept free "
             f"(CUDA context, workspaces, fragmentation): {format_bytes(gpu_memory - reserve, 2)} usable; {host}",
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


def gpu_memory_of(name):
    """The total memory of GPU ``name`` as it reports it (:data:`GPUS`, case and separators
    ignored); ValueError naming the known ones."""
    wanted = re.sub(r"[\s_-]", "", str(name)).upper()
    for known, nbytes in GPUS.items():
        if re.sub(r"[\s_-]", "", known).upper() == wanted:
            return nbytes
    raise ValueError(f"unknown GPU {name!r}: choose from {', '.join(GPUS)} or give --gpu-memory in bytes")


def read_config(path):
    """The Hugging Face config in the JSON file ``path``; ValueError, naming the file, when it
    cannot be read, is not a JSON object, names no model type transformers knows, or lacks one of
    :data:`REQUIRED_CONFIG_KEYS` (a text config nested as ``text_config`` counts)."""
    import transformers

    try:
        with open(path) as file:
            data = json.load(file)
    except OSError as error:
        raise ValueError(f"cannot read the config {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object of config keys")
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in data and key not in text]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: transformers would take its defaults for them, "
                         "and the answer would be for another model")
    try:
        return transformers.AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: transformers cannot make a config of it: {error}") from None


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _not_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main(argv):
    """The ``fit`` command (see the module docstring); returns the exit status: 0 when every row
    was estimated, 1 when a row failed (its note says why), 2 for bad arguments."""
    parser = argparse.ArgumentParser(prog="python -m remat fit",
                                     description="Longest sequence (or largest batch) whose training step fits a GPU, "
                                                 "per setup, estimated without a GPU. Progress on stderr, the table "
                                                 "(or JSON) on stdout.")
    parser.add_argument("config", help="a Hugging Face config.json of a causal LM")
    device = parser.add_mutually_exclusive_group(required=True)
    device.add_argument("--gpu", help="a GPU by name, its memory as it reports it: " + ", ".join(GPUS))
    device.add_argument("--gpu-memory", help="the GPU's total memory, e.g. 80GB (binary units: 80 GiB; an H100 "
                                             "80GB reports 79.6 GiB: prefer --gpu H100-80GB)")
    parser.add_argument("--reserve", default="3GiB",
                        help="memory kept free for what the estimate does not count: the CUDA context (~0.5 GiB), "
                             "cuBLAS/cuDNN workspaces, the caching allocator's fragmentation (default 3GiB)")
    parser.add_argument("--lora-rank", type=_not_negative, default=0,
                        help="PEFT LoRA rank on all linear layers (0: full)")
    parser.add_argument("--lora-targets", default="all-linear",
                        help="comma-separated module names given LoRA (default all-linear), e.g. "
                             "q_proj,k_proj,v_proj,o_proj for a mixture-of-experts model")
    parser.add_argument("--batch-size", type=_positive, default=1)
    parser.add_argument("--seq-len", type=_positive, default=None, help="fix the length and search the batch size")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, from " + ", ".join(SETUPS))
    parser.add_argument("--adam", action="store_true", help="count fp32 Adam states of the trainable parameters")
    parser.add_argument("--optimizer-shards", type=_positive, default=1, metavar="R",
                        help="Adam's states partitioned over R ranks (ZeRO-1/2), default 1")
    parser.add_argument("--offload", action="store_true", help="remat's layers offload what they keep to the host")
    parser.add_argument("--tile-tokens", type=_positive, default=None,
                        help="remat's MLPs and attention run over tiles of this many tokens")
    parser.add_argument("--host-memory", default=None,
                        help="the host memory one GPU's step may hold for offloaded tensors, pinned blocks as "
                             "PyTorch rounds them, e.g. 256GB (a DGX H100: 2 TiB for 8 GPUs); default: any")
    parser.add_argument("--sequence-parallel", type=_positive, default=1, metavar="P",
                        help="GPUs sharing one sequence (Ulysses): per-rank peaks, whole-sequence lengths")
    parser.add_argument("--exact", action="store_true",
                        help="search over the full simulation of every layer and tile (minutes per estimate at "
                             "long context) instead of the composed estimate")
    parser.add_argument("--workers", type=_positive, default=None,
                        help="processes the rows are searched in (default: 2, or 1 on one CPU)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        config = read_config(args.config)
        gpu_memory = gpu_memory_of(args.gpu) if args.gpu is not None else parse_bytes(args.gpu_memory)
        reserve = parse_bytes(args.reserve)
        host_memory = parse_bytes(args.host_memory) if args.host_memory is not None else None
        setups = [s.strip() for s in args.setups.split(",") if s.strip()]

        def progress(line):
            print(f"[{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

        rows = fit(config, gpu_memory=gpu_memory, reserve=reserve, lora_rank=args.lora_rank,
                   batch_size=args.batch_size, seq_len=args.seq_len, setups=setups,
                   optimizer="adam" if args.adam else None, offload=args.offload, tile_tokens=args.tile_tokens,
                   host_memory=host_memory, lora_targets=_lora_targets(args.lora_targets),
                   sequence_parallel=args.sequence_parallel, optimizer_shards=args.optimizer_shards,
                   exact=args.exact, progress=progress, workers=args.workers)
    except ValueError as error:
        print(f"python -m remat fit: {error}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    if args.json:
        print(json.dumps([{"setup": r.setup, "max_seq_len": r.max_seq_len, "max_batch_size": r.max_batch_size,
                           "peak_bytes": r.peak_bytes, "host_bytes": r.host_bytes, "note": r.note} for r in rows]))
    else:
        print(_table(rows, gpu_memory, reserve, args.seq_len is not None, host_memory))
        print(f"{len(rows)} rows in {elapsed:.0f} s")
    failed = [row.setup for row in rows if row.note.startswith("failed:")]
    if failed:
        print(f"python -m remat fit: {len(failed)} of {len(rows)} rows failed ({', '.join(failed)}); see their notes",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
