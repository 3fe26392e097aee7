"""Checkpoint placement on a stack of L small MLP blocks: for each strategy (and budget), the
peak of saved bytes alive over forward and backward (measured by saved-tensor hooks on the CPU;
device memory, torch.cuda.max_memory_allocated, on a GPU) and the training-step time relative to
no checkpointing: every strategy of one stack length timed side by side in interleaved rounds
(benchmarks.common.interleaved_timings), ``time_vs_none`` the median of the per-round ratios to
"none" with its 20-80% band (``time_vs_none_q20`` / ``_q80``) and verdict."""

import functools

import torch
from torch import nn

import remat
from benchmarks.common import (
    Progress,
    Step,
    environment_tags,
    interleaved_timings,
    peak_memory_bytes,
    run_step,
    timing_summary,
    with_end_load,
)
from remat.checkpoint.schedule import minimal_peak
from remat.memory import PeakSavedBytes


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block (RMSNorm, up projection, GELU, down projection)."""

    def __init__(self, width, hidden):
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def configurations(plan_none, length):
    """(label, strategy, kwargs): the strategies, and budgets at fractions of storing everything."""
    full = plan_none.peak_saved_bytes
    floor = minimal_peak(plan_none.costs)
    configs = [("none", "none", {}), ("sqrt", "sqrt", {}),
               ("uniform L/4", "uniform", {"segments": max(1, length // 4)})]
    for fraction in (0.5, 0.25):
        budget = max(int(full * fraction), floor)
        configs.append((f"heuristic {fraction:.0%}", "heuristic", {"budget_bytes": budget}))
        configs.append((f"optimal {fraction:.0%}", "optimal", {"budget_bytes": budget}))
    configs.append(("revolve s=2", "revolve", {"slots": 2}))
    configs.append(("revolve s=4", "revolve", {"slots": 4}))
    return configs


def _step(chain, x, plan):
    """One training step under ``plan``: forward, then backward from the mean of the output (the
    mean saves nothing, so the peak is the chain's own)."""

    def forward():
        return remat.checkpoint_sequential(chain, x, plan=plan).mean()

    def inference():
        with torch.no_grad():
            return remat.checkpoint_sequential(chain, x, plan=plan)

    return Step(forward, torch.Tensor.backward, inference)


def run(device, quick=False):
    lengths = (4, 8) if quick else (8, 32, 128)
    width, hidden, batch = (256, 1024, 64) if device.type == "cpu" else (1024, 4096, 4096)
    tags = environment_tags()
    rows = []
    progress = Progress(len(lengths), "checkpoint")
    for length in lengths:
        torch.manual_seed(0)
        chain = nn.Sequential(*[MLPBlock(width, hidden) for _ in range(length)]).to(device)
        x = torch.randn(batch, width, device=device, requires_grad=True)
        plan_none = remat.plan(chain, x, strategy="none")
        results, steps = [], {}
        for label, strategy, kwargs in configurations(plan_none, length):
            try:
                plan = remat.plan(chain, x, strategy=strategy, **kwargs)
            except ValueError as error:
                print(f"skip {label} at L={length}: {error}")
                continue
            steps[label] = step = _step(chain, x, plan)
            if device.type == "cuda":
                run_step(step)  # the parameters' .grad exist before the peak is measured
                measured = peak_memory_bytes(functools.partial(run_step, step), device)
            else:
                with PeakSavedBytes() as tracker:
                    run_step(step)
                measured = tracker.peak
            results.append({
                "blocks": length,
                "strategy": label,
                "budget_bytes": plan.budget_bytes if plan.budget_bytes is not None else "",
                "predicted_peak_bytes": plan.peak_saved_bytes,
                "measured_peak_bytes": measured,
                "memory_measure": "cuda max_memory_allocated" if device.type == "cuda" else "saved-tensor hooks",
                "predicted_extra_forward": plan.extra_forward_fraction,
                "block_forward_calls": plan.block_forward_calls,
            })
        timings = timing_summary(interleaved_timings(steps, device, rounds=2 if quick else 6), {"none": "none"},
                                 f"checkpoint L={length}")
        base_mem = next(r["measured_peak_bytes"] for r in results if r["strategy"] == "none")
        for r in results:
            r.update(timings[r["strategy"], "full"])
            r["memory_vs_none"] = r["measured_peak_bytes"] / base_mem
            rows.append({**r, "width": width, "hidden": hidden, "batch": batch, **tags})
        progress.step(f"L={length}")
    return with_end_load(rows)


summary_columns = ["blocks", "strategy", "budget_bytes", "predicted_peak_bytes", "measured_peak_bytes",
                   "memory_vs_none", "predicted_extra_forward", "time_vs_none", "time_vs_none_q20", "time_vs_none_q80",
                   "time_vs_none_verdict", "median_ms", "suspect"]


def plot(rows, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed; no plot")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["blocks"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4.2), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for r in (r for r in rows if r["blocks"] == length):
            ax.scatter(r["time_vs_none"], r["memory_vs_none"])
            ax.annotate(r["strategy"], (r["time_vs_none"], r["memory_vs_none"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("step time vs no checkpointing (x)")
        ax.set_ylabel("peak saved memory vs no checkpointing (x)")
        ax.set_title(f"{length} MLP blocks")
        ax.grid(alpha=0.3)
    fig.suptitle(f"checkpoint strategies on {rows[0]['device']}, commit {rows[0]['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
