"""The memory/time frontier of one training step of a small Llama (one batch shape): for each way
of trading memory for compute, the peak of saved bytes (saved-tensor hooks over forward and
backward; device memory on a GPU as well) and the step time as a ratio to the stock model, timed
side by side in interleaved rounds (benchmarks.common.interleaved_timings): ``time_vs_stock`` is the
median of the per-round ratios, with its 20-80% band (``time_vs_stock_q20`` / ``_q80``) and verdict.

Providers: the stock Hugging Face model (SDPA attention); torch.utils.checkpoint on every layer
and on every k-th (Hugging Face's activation_checkpointing_enable, reentrant so that the hooks
see the inputs it keeps and what it recomputes in backward); torch.compile (inductor) with
``activation_memory_budget`` swept; remat's three uniform policies; remat's ``policy="auto"`` at
budgets from the stock model's peak down to its floor.
"""

import copy
import functools
import types

import torch

import remat
from benchmarks.common import (
    Progress,
    environment_tags,
    interleaved_timings,
    loss_step,
    peak_memory_bytes,
    pyplot_or_none,
    run_step,
    timing_summary,
    with_end_load,
)
from remat import model_plan
from remat.memory import PeakSavedBytes


def make_model(device, quick):
    import transformers

    torch.manual_seed(0)
    hidden, layers = 128, (4 if quick else 6)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 32,
                                      num_key_value_heads=hidden // 64, max_position_embeddings=1024,
                                      use_cache=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).to(device).train()


def make_batch(device):
    batch, length = 2, 128
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (batch, length), generator=g).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def providers(base, inputs, quick):
    """(label, family, model or step function) for every provider."""
    out = [("stock", "stock", copy.deepcopy(base))]
    layers = base.config.num_hidden_layers
    for every in (1, 2) if quick else (1, 2, 3):
        model = copy.deepcopy(base)
        model.activation_checkpointing_enable({"use_reentrant": True}, every_n_layers=every)
        out.append((f"checkpoint every {every}", "torch.utils.checkpoint", model))
    for policy in remat.nn.layers.LAYER_POLICIES:
        model = copy.deepcopy(base)
        remat.patch(model, policy=policy)
        out.append((f"remat {policy}", "remat policy", model))
    costs = model_plan.measure_model_costs(copy.deepcopy(base), inputs)
    stock_peak = model_plan.peak_and_cost(costs, [model_plan.Taped(i, "stock") for i in range(layers)])[0]
    floor = model_plan.smallest_feasible_budget(costs)
    fractions = (1.0, 0.3, 0.1, 0.0) if quick else (1.0, 0.4, 0.2, 0.1, 0.05, 0.0)
    for fraction in fractions:
        budget = int(floor + fraction * (stock_peak - floor))
        model = copy.deepcopy(base)
        report = remat.patch(model, policy="auto", budget_bytes=budget, example_inputs=inputs)
        out.append((f"remat auto {budget / 2**20:.2f} MiB", "remat auto", model, report.plan))
    for memory_budget in (0.1, 1.0) if quick else (0.1, 0.5, 1.0):
        out.append((f"compile budget {memory_budget}", "torch.compile", _CompiledStep(base, memory_budget)))
    return out


def _forward(model, inputs):
    return model(**inputs)


class _CompiledStep:
    """A compiled copy of the stock model whose every call runs with this activation_memory_budget
    (the partitioner's knob: what the compiled backward recomputes), compiled on the first call.
    Dynamo caches graphs per code object and, with parameters as graph inputs, would hand every
    copy the first copy's graph (compiled with the first budget): each copy compiles its own
    copy of ``_forward``'s code."""

    def __init__(self, base, memory_budget):
        self.model = copy.deepcopy(base)
        code = _forward.__code__.replace(co_name=f"_forward_budget_{str(memory_budget).replace('.', '_')}")
        self.compiled = torch.compile(types.FunctionType(code, _forward.__globals__))
        self.memory_budget = memory_budget

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def __call__(self, **inputs):
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.memory_budget):
            return self.compiled(self.model, inputs)


def run(device, quick=False):
    base = make_model(device, quick)
    inputs = make_batch(device)
    tags = environment_tags()
    entries = providers(base, inputs, quick)
    progress = Progress(len(entries) + 1, "frontier")
    measured, steps = {}, {}
    for entry in entries:
        label, model = entry[0], entry[2]
        steps[label] = step = loss_step(model, inputs)
        run_step(step)  # warm-up (and compile)
        with PeakSavedBytes() as peak:
            run_step(step)
        measured[label] = (peak.peak, peak_memory_bytes(functools.partial(run_step, step), device))
        progress.step(f"{label}: peak saved {peak.peak} bytes")
    timings = timing_summary(interleaved_timings(steps, device, rounds=2 if quick else 10), {"stock": "stock"},
                             "frontier")
    progress.step("interleaved timing")
    rows = []
    shape = tuple(inputs["input_ids"].shape)
    for entry in entries:
        label, family = entry[0], entry[1]
        plan = entry[3] if len(entry) > 3 else None
        rows.append({
            **tags, "model": f"llama h={base.config.hidden_size} L={base.config.num_hidden_layers}",
            "batch": f"{shape[0]}x{shape[1]}", "provider": label, "family": family,
            "peak_saved_bytes": measured[label][0], "peak_device_bytes": measured[label][1],
            "budget_bytes": plan.budget_bytes if plan else "",
            "predicted_peak_bytes": plan.predicted_peak_bytes if plan else "",
            "plan": _describe(plan) if plan else "",
            **timings[label, "full"],
        })
    return with_end_load(rows)


def _describe(plan):
    """The plan in a few words: the count of each choice and the spans."""
    policies = plan.layer_policies()
    spans = plan.spans()
    counts = {c: sum(1 for p in policies.values() if p == c) for c in dict.fromkeys(policies.values())}
    text = " ".join(f"{n}x{c}" for c, n in counts.items())
    return text + (f" spans {spans}" if spans else "")


summary_columns = ["provider", "peak_saved_bytes", "predicted_peak_bytes", "time_vs_stock", "time_vs_stock_q20",
                   "time_vs_stock_q80", "time_vs_stock_verdict", "suspect", "plan"]


def plot(rows, path):
    """Step time ratio (y) against peak saved bytes (x) per provider family; remat auto as a line."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = {"stock": "*", "torch.utils.checkpoint": "s", "torch.compile": "^", "remat policy": "o",
               "remat auto": "D"}
    for family, marker in markers.items():
        points = sorted((r["peak_saved_bytes"] / 2**20, r["time_vs_stock"], r["time_vs_stock_q20"],
                         r["time_vs_stock_q80"], r["provider"]) for r in rows if r["family"] == family)
        if not points:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        errors = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
        ax.errorbar(xs, ys, yerr=errors, fmt=marker + ("-" if family == "remat auto" else ""), label=family,
                    capsize=3, markersize=7)
        if family != "remat auto":
            for x, y, *_, label in points:
                ax.annotate(label.replace("remat ", "").replace("checkpoint ", "ckpt "), (x, y), fontsize=7,
                            xytext=(4, 4), textcoords="offset points")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("peak saved bytes over the step (MiB, log)")
    ax.set_ylabel("step time / stock step time (median, 20-80% bars)")
    first = rows[0]
    ax.set_title(f"{first['model']}, batch {first['batch']}, {first['device']}, commit {first['commit']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
