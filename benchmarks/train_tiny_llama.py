"""End-to-end example: train a tiny Hugging Face Llama with and without ``remat.patch``.

A Llama-shaped model (``transformers.LlamaForCausalLM`` built from a config, no downloads: hidden
128, 4 layers, 4 query heads and 2 key/value heads, intermediate 344, context 128) learns a
character-level language model of a synthetic corpus generated here from a small probabilistic
grammar (sentences about animals and places, additions and multiplications with their results),
so the loss visibly falls within a few hundred steps.

The same initial weights are trained on the same batches, with AdamW (learning rate 1e-3 after
a 20-step linear warmup, gradients clipped to norm 1), several times:

- ``stock``: the eager Hugging Face model;
- ``stock, batch rows reversed``: the same on each batch with its rows in reverse order, the same
  loss up to the order of floating-point sums: a rounding control. Training amplifies rounding
  differences (AdamW divides each gradient by its running magnitude), so two runs that differ
  only by rounding drift apart by orders of magnitude over a few hundred steps; this run shows
  how far, to judge the remat runs' distance to stock by;
- ``stock + torch checkpoint``: the same with per-layer ``torch.utils.checkpoint``
  (``activation_checkpointing_enable``, non-reentrant), the usual way to save activation memory;
- ``remat <policy>``: after ``remat.patch(model, policy=...)``, which swaps each decoder layer for
  ``remat.nn.LlamaLayer`` sharing its parameters (policies "speed", "balanced", "memory"; see
  that class's docstring for what each keeps for backward).

It shows that the patched model trains the same (its loss curve tracks the stock one, up to
rounding), and what it saves for backward and costs in step time. Per run it records the loss of
every step, the bytes one training step's forward keeps for backward
(``remat.memory.saved_bytes``; for the checkpointed run, plus the layer inputs the checkpoint
holds), the step time (forward, backward and optimizer step) as a ratio to stock's with its
spread (``time_vs_stock``, median of per-round ratios, ``_q20`` / ``_q80``, ``_verdict``; see
``run``) and in milliseconds (``median_ms``), and, on CUDA, the peak memory one training step
allocates above the resident parameters and optimizer state (``torch.cuda.max_memory_allocated``).
The runs train in lockstep, timed in interleaved rounds, so that changes in machine load fall on
all of them alike. It writes
``train_tiny_llama-<cpu|gpu>.png`` (the loss curves, and each run's distance to the stock curve)
and ``train_tiny_llama-<cpu|gpu>.csv`` (one row per run) under ``--out``, and prints the same
table as markdown.

    python -m benchmarks.train_tiny_llama [--steps N] [--out DIR] [--device cpu|cuda]
        [--policies memory balanced] [--no-torch-checkpoint] [--no-rounding-control] [--batch B]
        [--bf16] [--threads T]

(``--bf16`` writes ``train_tiny_llama-<cpu|gpu>-bf16.{png,csv}``.)

The defaults (200 steps of batch 16, five runs) take about two minutes on an idle 2-core
CPU; with other work on the cores, ``--threads 1`` is several times faster than two threads.
"""

import argparse
import copy
import math
import os
import random
import statistics
import sys
import time

import torch
import transformers

import remat
from benchmarks.common import (
    RESULTS_DIR,
    Progress,
    Step,
    environment_tags,
    interleaved_timings,
    run_step,
    timing_summary,
    with_end_load,
    write_csv,
)
from remat.backend import default_backend, requested_backend
from remat.memory import saved_bytes

CONTEXT = 128
MODEL_SIZES = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2)
LEARNING_RATE = 1e-3
LR_WARMUP_STEPS = 20  # linear learning-rate warmup; without it the loss jumps back up near step 8
MAX_GRAD_NORM = 1.0  # gradient clipping, as Hugging Face's Trainer does by default
LAST = 20  # steps averaged for the "last steps" loss
UNTIMED_STEPS = 5  # warm-up steps left out of the timing (first calls, optimizer state allocation)
SEED = 0
ROUNDING_CONTROL = "stock, batch rows reversed"

_ANIMALS = ["cat", "dog", "bird", "fox", "horse", "mouse", "rabbit", "goat"]
_ADJECTIVES = ["small", "old", "red", "quiet", "happy", "brown", "young", "lazy"]
_VERBS = ["sees", "follows", "likes", "chases", "finds", "watches"]
_PLACES = ["in the garden", "near the river", "under the tree", "on the hill", "at home", "in the barn"]


def _noun_phrase(rng):
    """An article, sometimes an adjective, and an animal."""
    article = rng.choice(["the", "a"])
    if rng.random() < 0.5:
        return f"{article} {rng.choice(_ADJECTIVES)} {rng.choice(_ANIMALS)}"
    return f"{article} {rng.choice(_ANIMALS)}"


def _sentence(rng):
    """One sentence of the grammar: a clause about animals, an addition or a multiplication."""
    kind = rng.random()
    if kind < 0.5:
        text = f"{_noun_phrase(rng)} {rng.choice(_VERBS)} {_noun_phrase(rng)}"
        if rng.random() < 0.5:
            text += f" {rng.choice(_PLACES)}"
        return text + "."
    if kind < 0.8:
        a, b = rng.randrange(50), rng.randrange(50)
        return f"{a} plus {b} is {a + b}."
    a, b = rng.randrange(13), rng.randrange(13)
    return f"{a} times {b} is {a * b}."


def synthetic_corpus(chars=300_000, seed=SEED):
    """A deterministic text of about ``chars`` characters: sentences of the grammar above, several
    to a line."""
    rng = random.Random(seed)
    lines, total = [], 0
    while total < chars:
        line = " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines) + "\n"


def make_batches(corpus, vocab, steps, batch, seed=SEED):
    """``steps`` batches of ``batch`` random windows of CONTEXT characters, as token ids [B, N]
    (the same list for every run; Hugging Face shifts the labels inside the model)."""
    index = {ch: i for i, ch in enumerate(vocab)}
    tokens = torch.tensor([index[ch] for ch in corpus], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - CONTEXT, (steps, batch), generator=g)
    offsets = torch.arange(CONTEXT)
    return [tokens[s[:, None] + offsets] for s in starts]


def build_model(vocab_size):
    """The tiny Llama, initialized from SEED (float32 parameters, eager attention)."""
    config = transformers.LlamaConfig(vocab_size=vocab_size, max_position_embeddings=CONTEXT, use_cache=False,
                                      attn_implementation="eager", tie_word_embeddings=False, **MODEL_SIZES)
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(config)


def _loss(model, ids, bf16):
    """The language-model loss of ``ids`` (float32, or under bf16 autocast)."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        return model(input_ids=ids, labels=ids).loss


def step_saved_bytes(model, ids, bf16, checkpointed):
    """Bytes one training step's forward keeps for backward: what autograd saves
    (remat.memory.saved_bytes; parameters excluded), plus, for a model under
    torch.utils.checkpoint, the layer inputs the checkpoint holds for recomputation, which it keeps
    in its own closure where saved-tensor hooks do not see them."""
    held = {}

    def record_inputs(module, args, kwargs):
        for value in [*args, *kwargs.values()]:
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    # Keyed by storage: the mask and rope tables every layer gets count once.
                    held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    hooks = []
    if checkpointed:
        hooks = [layer.register_forward_pre_hook(record_inputs, with_kwargs=True) for layer in model.model.layers]
    try:
        autograd_bytes = saved_bytes(lambda: _loss(model, ids, bf16))
    finally:
        for hook in hooks:
            hook.remove()
    return autograd_bytes + sum(held.values())


class Run:
    """One training configuration: a fresh copy of the initial model, prepared (``how``: None for
    stock, "reversed" for stock on every batch with its rows in reverse order, "checkpoint" for
    per-layer torch.utils.checkpoint, else a remat.patch policy), its AdamW optimizer, and what
    was measured."""

    def __init__(self, name, policy, how, initial, batches, device, bf16):
        self.name, self.policy, self.how, self.device, self.bf16 = name, policy, how, device, bf16
        self.batches = batches
        self.model = copy.deepcopy(initial).to(device)
        if how == "checkpoint":
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif how not in (None, "reversed"):
            remat.patch(self.model, policy=how)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                          lambda k: min(1.0, (k + 1) / LR_WARMUP_STEPS))
        self.losses = []

    def _ids(self):
        """The batch of the next training step (rows reversed for the rounding control: the loss
        is a mean over the same tokens; only the order of floating-point sums changes)."""
        ids = self.batches[len(self.losses)]
        return ids.flip(0) if self.how == "reversed" else ids

    def _forward_on(self, ids):
        """Zeroes the gradients, returns the loss tensor of ``ids``."""
        self.optimizer.zero_grad(set_to_none=True)
        return _loss(self.model, ids, self.bf16)

    def _update(self, loss):
        """Backward, gradient clipping, the AdamW step and the learning-rate schedule."""
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.schedule.step()

    def forward(self):
        """The next training step's forward: returns its loss tensor."""
        return self._forward_on(self._ids())

    def backward(self, loss):
        """The rest of the next training step (see _update); records its loss."""
        self._update(loss)
        self.losses.append(loss.item())

    def inference(self):
        """The next step's loss without a graph (torch.no_grad); trains nothing."""
        with torch.no_grad():
            return _loss(self.model, self._ids(), self.bf16)

    def step(self):
        """The parts the harness times (benchmarks.common.interleaved_timings)."""
        return Step(self.forward, self.backward, self.inference)

    def saved_bytes(self, ids):
        """Bytes one training step on ``ids`` keeps for backward (see step_saved_bytes)."""
        return step_saved_bytes(self.model, ids, self.bf16, checkpointed=self.how == "checkpoint")

    def peak_step_memory(self, ids):
        """CUDA memory one more training step allocates at its peak (torch.cuda.max_memory_allocated)
        above what is resident before it (parameters, optimizer state, the other runs' models):
        activations, gradients and temporaries. "" on the CPU. Run after training, since it steps
        the optimizer."""
        if self.device.type != "cuda":
            return ""
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        resident = torch.cuda.memory_allocated(self.device)
        self._update(self._forward_on(ids))
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - resident


def run_configurations(policies, torch_checkpoint, rounding_control):
    """(run name, policy column, how to prepare the model): stock first, the baseline of the ratios."""
    runs = [("stock", "", None)]
    if rounding_control:
        runs.append((ROUNDING_CONTROL, "rounding control", "reversed"))
    if torch_checkpoint:
        runs.append(("stock + torch checkpoint", "per-layer checkpoint", "checkpoint"))
    runs += [(f"remat {policy}", policy, policy) for policy in policies]
    return runs


def _ratio(value, baseline):
    """value / baseline, or "" where either is missing (peak memory on the CPU)."""
    return value / baseline if value != "" and baseline != "" else ""


def timed_rounds(steps):
    """Rounds of interleaved timing in a run of ``steps`` training steps: UNTIMED_STEPS warm-up
    steps, then two steps per round (one timed in parts, one whole), an even number of rounds (each
    of the two goes first equally often); the remainder trains untimed."""
    return (steps - UNTIMED_STEPS) // 4 * 2


def run(device, steps, batch, policies, torch_checkpoint, rounding_control, bf16):
    """Trains every configuration from the same weights on the same batches; returns the CSV rows
    and the loss curves by run name.

    The runs train in lockstep through benchmarks.common.interleaved_timings: UNTIMED_STEPS
    warm-up steps, then rounds in which each run, in an order rotated every round, has its next
    forward timed alone without a graph, one training step timed as forward and rest-of-step apart,
    and one timed whole; a change in machine load thus falls on all runs of a round alike, and the
    step-time ratios to stock are medians of per-round ratios with their 20-80% bands. Steps left
    over after the last round train untimed."""
    if timed_rounds(steps) < 2:
        raise ValueError(f"steps must be at least {UNTIMED_STEPS + 4} (warm-up and two timed rounds), got {steps}")
    corpus = synthetic_corpus()
    vocab = sorted(set(corpus))
    batches = [ids.to(device) for ids in make_batches(corpus, vocab, steps, batch)]
    initial = build_model(len(vocab))
    tags = environment_tags()
    backend = requested_backend() or default_backend(device)
    runs = [Run(name, policy, how, initial, batches, device, bf16)
            for name, policy, how in run_configurations(policies, torch_checkpoint, rounding_control)]
    saved = [r.saved_bytes(batches[0]) for r in runs]
    rounds = timed_rounds(steps)
    report_every = max(1, rounds // 10)
    progress = Progress(-(-rounds // report_every), "train_tiny_llama")

    def report(k):
        if (k + 1) % report_every == 0 or k + 1 == rounds:
            progress.step(f"step {len(runs[0].losses)}: " + ", ".join(f"{r.name} {r.losses[-1]:.4f}" for r in runs))

    times = interleaved_timings({r.name: r.step() for r in runs}, device, rounds=rounds, warmup=UNTIMED_STEPS,
                                after_round=report)
    while len(runs[0].losses) < steps:
        for r in runs:
            run_step(r.step())
    baselines = {"stock": runs[0].name}
    if torch_checkpoint:
        baselines["checkpoint"] = "stock + torch checkpoint"
    timings = timing_summary(times, baselines, "train_tiny_llama")
    peaks = [r.peak_step_memory(batches[0]) for r in runs]
    rows = []
    stock = runs[0]
    for r, saved_r, peak in zip(runs, saved, peaks):
        rows.append({
            "run": r.name,
            "policy": r.policy,
            "final_loss": r.losses[-1],
            f"mean_loss_last_{LAST}": statistics.fmean(r.losses[-LAST:]),
            "max_abs_loss_diff_vs_stock": max(abs(a - b) for a, b in zip(r.losses, stock.losses)),
            "saved_bytes_per_step": saved_r,
            "saved_vs_stock": _ratio(saved_r, saved[0]),
            **timings[r.name, "full"],
            "forward_ms": timings[r.name, "forward"]["median_ms"],
            "backward_ms": timings[r.name, "backward"]["median_ms"],
            "peak_step_memory_bytes": peak,
            "peak_step_memory_vs_stock": _ratio(peak, peaks[0]),
            "steps": steps,
            "batch": batch,
            "context": CONTEXT,
            "vocab": len(vocab),
            "dtype": "bf16 autocast" if bf16 else "float32",
            "remat_backend": backend if r.how not in (None, "reversed", "checkpoint") else "",
            **tags,
        })
    return with_end_load(rows), {r.name: r.losses for r in runs}


def plot(curves, rows, path):
    """Loss per step for every run (top) and each run's absolute loss difference to stock (bottom,
    log scale); returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; no plot", file=sys.stderr)
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    styles = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]
    for k, (name, losses) in enumerate(curves.items()):
        steps = range(1, len(losses) + 1)
        color = "0.55" if name == ROUNDING_CONTROL else f"C{k}"
        style = styles[k % len(styles)]
        top.plot(steps, losses, linestyle=style, lw=2.2 if k == 0 else 1.3, color=color, label=name)
        if name != "stock":
            # Steps where the losses are bitwise equal have no point on the log scale; markers
            # keep isolated nonzero steps visible.
            diff = [abs(a - b) or float("nan") for a, b in zip(losses, curves["stock"])]
            label = f"{name} (equal to stock at every step)" if all(map(math.isnan, diff)) else name
            bottom.semilogy(steps, diff, linestyle=style, lw=1.0, marker=".", ms=3, color=color, label=label)
    top.set_ylabel("training loss (nats per character)")
    top.legend()
    top.grid(alpha=0.3)
    bottom.set_xlabel("step")
    bottom.set_ylabel("|loss - stock loss|")
    bottom.grid(alpha=0.3, which="both")
    if bottom.lines:
        bottom.legend(fontsize=8, loc="upper left")
    first = rows[0]
    top.set_title(f"tiny Llama ({first['dtype']}, batch {first['batch']}x{first['context']}) on {first['device']}\n"
                  f"commit {first['commit']}, torch {first['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mib(nbytes):
    return f"{nbytes / 2**20:.1f} MiB" if nbytes != "" else "n/a"


def markdown_table(rows):
    """The per-run results as a markdown table (bytes in MiB)."""
    header = ["run", "final loss", f"mean loss, last {LAST}", "max abs loss diff vs stock",
              "saved for backward / step", "vs stock", "median step", "step time vs stock [20%, 80%]",
              "peak step memory", "vs stock", "suspect"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for r in rows:
        peak_ratio = r["peak_step_memory_vs_stock"]
        cells = [r["run"], f"{r['final_loss']:.4f}", f"{r[f'mean_loss_last_{LAST}']:.4f}",
                 f"{r['max_abs_loss_diff_vs_stock']:.2g}", _mib(r["saved_bytes_per_step"]),
                 f"{r['saved_vs_stock']:.2f}x", f"{r['median_ms']:.1f} ms",
                 f"{r['time_vs_stock']:.2f}x [{r['time_vs_stock_q20']:.2f}, {r['time_vs_stock_q80']:.2f}] "
                 f"{r['time_vs_stock_verdict']}",
                 _mib(r["peak_step_memory_bytes"]), f"{peak_ratio:.2f}x" if peak_ratio != "" else "n/a",
                 r["suspect"] or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    parser.add_argument("--batch", type=int, default=16,
                        help=f"sequences of {CONTEXT} characters per step (default 16)")
    parser.add_argument("--out", default=None, help=f"output folder (default {RESULTS_DIR})")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    parser.add_argument("--policies", nargs="+", choices=list(remat.nn.LAYER_POLICIES), default=["memory", "balanced"],
                        help="remat.patch policies to train with (default: memory balanced)")
    parser.add_argument("--no-torch-checkpoint", action="store_true",
                        help="leave out the stock run under per-layer torch.utils.checkpoint")
    parser.add_argument("--no-rounding-control", action="store_true",
                        help=f"leave out the '{ROUNDING_CONTROL}' run")
    parser.add_argument("--bf16", action="store_true", help="forward under bf16 autocast (float32 parameters)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for PyTorch (default: PyTorch's choice; 1 is faster on a CPU shared "
                             "with other work)")
    args = parser.parse_args(argv)
    if args.steps < UNTIMED_STEPS + 4 or args.batch < 1:
        parser.error(f"--steps must be at least {UNTIMED_STEPS + 4} and --batch at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tag = ("gpu" if device.type == "cuda" else "cpu") + ("-bf16" if args.bf16 else "")
    start = time.perf_counter()
    rows, curves = run(device, args.steps, args.batch, args.policies, not args.no_torch_checkpoint,
                       not args.no_rounding_control, args.bf16)
    csv_path = write_csv(rows, f"train_tiny_llama-{tag}.csv", args.out)
    png_path = plot(curves, rows, os.path.join(args.out or RESULTS_DIR, f"train_tiny_llama-{tag}.png"))
    first = rows[0]
    print(f"tiny Llama, {args.steps} steps of {args.batch}x{CONTEXT} characters, {first['dtype']}, "
          f"on {first['device']}, commit {first['commit']}, remat backend {rows[-1]['remat_backend'] or 'n/a'}\n")
    print(markdown_table(rows))
    if ROUNDING_CONTROL in curves:
        print(f"\n'{ROUNDING_CONTROL}' trains the stock model on each batch with its rows in reverse order: the "
              "same loss up to the order of floating-point sums, so its distance to stock is what rounding alone "
              "grows to over training.")
    print(f"\nwrote {csv_path}" + (f" and {png_path}" if png_path else "") +
          f" in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
