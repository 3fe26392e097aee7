"""Checkpoint placement on a stack of L small MLP blocks: for each strategy (and budget), the
peak of saved bytes alive over forward and backward (measured by saved-tensor hooks on the CPU;
device memory, torch.cuda.max_memory_allocated, on a GPU) and the training-step time relative to
no checkpointing, measured side by side in one run."""

import torch
from torch import nn

import remat
from benchmarks.common import Progress, environment_tags, measure, peak_memory_bytes
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
    out = remat.checkpoint_sequential(chain, x, plan=plan)
    out.mean().backward()  # mean saves nothing, so the peak is the chain's own


def run(device, quick=False):
    lengths = (8, 32) if quick else (8, 32, 128)
    width, hidden, batch = (256, 1024, 64) if device.type == "cpu" else (1024, 4096, 4096)
    tags = environment_tags()
    rows = []
    progress = Progress(len(lengths), "checkpoint")
    for length in lengths:
        torch.manual_seed(0)
        chain = nn.Sequential(*[MLPBlock(width, hidden) for _ in range(length)]).to(device)
        x = torch.randn(batch, width, device=device, requires_grad=True)
        plan_none = remat.plan(chain, x, strategy="none")
        results = []
        for label, strategy, kwargs in configurations(plan_none, length):
            try:
                plan = remat.plan(chain, x, strategy=strategy, **kwargs)
            except ValueError as error:
                print(f"skip {label} at L={length}: {error}")
                continue
            if device.type == "cuda":
                _step(chain, x, plan)  # the parameters' .grad exist before the peak is measured
                measured = peak_memory_bytes(lambda: _step(chain, x, plan), device)
            else:
                with PeakSavedBytes() as tracker:
                    _step(chain, x, plan)
                measured = tracker.peak
            median, q20, q80 = measure(lambda: _step(chain, x, plan), device, budget_s=0.5, min_reps=5, max_reps=50)
            results.append({
                "blocks": length,
                "strategy": label,
                "budget_bytes": plan.budget_bytes if plan.budget_bytes is not None else "",
                "predicted_peak_bytes": plan.peak_saved_bytes,
                "measured_peak_bytes": measured,
                "memory_measure": "cuda max_memory_allocated" if device.type == "cuda" else "saved-tensor hooks",
                "predicted_extra_forward": plan.extra_forward_fraction,
                "block_forward_calls": plan.block_forward_calls,
                "median_ms": median,
                "q20_ms": q20,
                "q80_ms": q80,
            })
            chain.zero_grad(set_to_none=False)
            x.grad = None
        base_ms = next(r["median_ms"] for r in results if r["strategy"] == "none")
        base_mem = next(r["measured_peak_bytes"] for r in results if r["strategy"] == "none")
        for r in results:
            r["time_vs_none"] = r["median_ms"] / base_ms
            r["memory_vs_none"] = r["measured_peak_bytes"] / base_mem
            rows.append({**r, "width": width, "hidden": hidden, "batch": batch, **tags})
        progress.step(f"L={length}")
    return rows


summary_columns = ["blocks", "strategy", "budget_bytes", "predicted_peak_bytes", "measured_peak_bytes",
                   "memory_vs_none", "predicted_extra_forward", "time_vs_none", "median_ms", "q20_ms", "q80_ms"]


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
