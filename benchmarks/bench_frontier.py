"""The memory/time frontier of one training step of a Llama (one batch shape): for each way of
trading memory for compute, two memory measures and the step time as a ratio to the stock model,
timed side by side in interleaved rounds (benchmarks.common.interleaved_timings):
``time_vs_stock`` is the median of the per-round ratios, with its 20-80% band
(``time_vs_stock_q20`` / ``_q80``) and verdict.

Memory: ``step_peak_bytes``, the peak of the bytes the step allocates and frees again
(benchmarks.common.transient_peak_bytes, from the allocator's events: what it keeps for backward,
its temporaries, and what its backward recomputes, in a kernel or inside a compiled graph; the
parameters' gradients it leaves are not counted, nor the parameters), the memory a step needs
beyond its parameters and gradients; and ``peak_saved_bytes``, the peak of what autograd's
saved-tensor hooks see kept from forward to backward, which misses what a backward recomputes
inside a kernel or a compiled graph and so understates compile's low budgets (at the GEMM shape
on the CPU, budget 0.05 saves 6 MiB and peaks at 99 MiB).

Shapes (``SHAPES``): "gemm", where, as on a GPU at scale, the GEMMs dominate the step (on the CPU
a 4-layer Llama with hidden 1024, intermediate 2816, GQA 16/4 heads, 2 x 256 tokens; on a GPU two
layers of Llama-3-8B's shape in bf16 at 1 x 4096 tokens); and "small" (hidden 128, 6 layers,
2 x 128 tokens), where per-op overhead and the many small pointwise ops dominate, which
torch.compile's fusion removes.

Providers: the stock Hugging Face model (SDPA attention); torch.utils.checkpoint on every layer
and on every k-th (Hugging Face's activation_checkpointing_enable, reentrant so that the hooks
see the inputs it keeps and what it recomputes in backward); torch.compile (inductor) of the stock
model with ``activation_memory_budget`` swept; remat's three uniform policies and ``policy="auto"``
at budgets from 0.8 of the way from its floor to the unpatched model's saved bytes down to the
floor (a plan that keeps Hugging Face's layers and loss is skipped: that is stock), each eager
("remat ...") and compiled ("remat+compile ...": the patched model under torch.compile, default
memory budget).

``dominated_by`` (on the torch.compile rows): the remat or remat+compile providers whose step
peaks at no more bytes (5% slack) at no more time (0.03 of stock's step, or within the two
providers' 20-80% bands), "none" where no remat point does; ``dominated_by_saved`` the same by
peak saved bytes.
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
    pyplot_or_none,
    run_step,
    timing_summary,
    transient_peak_bytes,
    with_end_load,
)
from remat.memory import PeakSavedBytes
from remat.planning import model_plan

# name -> (config overrides, batch, length, dtype) per device type.
SHAPES = {
    "gemm": {"cpu": (dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                          num_key_value_heads=4, vocab_size=4096), 2, 256, torch.float32),
             "cuda": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=32768), 1, 4096, torch.bfloat16)},
    "small": {"cpu": (dict(hidden_size=128, intermediate_size=341, num_hidden_layers=6, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=2048), 2, 128, torch.float32)},
}
SHAPE_NOTES = {"gemm": "GEMM-dominated", "small": "overhead-dominated"}


def make_model(device, shape, quick):
    """The stock Llama of ``shape`` (a SHAPES key) on ``device``, in training mode, and its batch."""
    import transformers

    overrides, batch, length, dtype = SHAPES[shape][device.type]
    if quick:
        overrides = {**overrides, "num_hidden_layers": 2}
        length = min(length, 128)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**overrides, max_position_embeddings=max(1024, length), use_cache=False,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=g).to(device)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def providers(base, inputs, quick, shape):
    """(label, family, model or step function[, plan]) for every provider."""
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
        out.append((f"remat+compile {policy}", "remat+compile", _CompiledStep(model, 1.0, f"{shape}_remat_{policy}")))
    costs = model_plan.measure_model_costs(copy.deepcopy(base), inputs)
    # Budgets between the floor and the unpatched model's saved bytes (every layer stock, Hugging
    # Face's loss), where the plan is the unpatched model (stock and compile budget 1.0 already).
    all_stock = [model_plan.Taped(i, "stock") for i in range(layers)]
    variants = [costs.with_loss(choice) for choice in costs.loss_choices] if costs.loss_choices else [costs]
    stock_peak = max(model_plan.peak_and_cost(variant, all_stock)[0] for variant in variants)
    floor = model_plan.smallest_feasible_budget(costs)
    fractions = (0.6, 0.3, 0.1, 0.0) if quick else (0.8, 0.6, 0.4, 0.2, 0.1, 0.05, 0.0)
    for fraction in fractions:
        budget = int(floor + fraction * (stock_peak - floor))
        model = copy.deepcopy(base)
        report = remat.patch(model, policy="auto", budget_bytes=budget, example_inputs=inputs)
        if report.plan.loss == "stock" and set(report.plan.layer_policies().values()) == {"stock"}:
            continue  # Hugging Face's layers and loss (remat's final norm aside): not a remat point
        label = f"auto {budget / 2**20:.2f} MiB"
        out.append((f"remat {label}", "remat auto", model, report.plan))
        compiled = _CompiledStep(model, 1.0, f"{shape}_remat_auto_{fraction}")
        out.append((f"remat+compile {label}", "remat+compile", compiled, report.plan))
    for memory_budget in (0.1, 1.0) if quick else (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0):
        out.append((f"compile budget {memory_budget}", "torch.compile",
                    _CompiledStep(copy.deepcopy(base), memory_budget, f"{shape}_stock")))
    return out


def _forward(model, inputs):
    return model(**inputs)


class _CompiledStep:
    """``model`` under torch.compile (inductor), every call run with this activation_memory_budget
    (the partitioner's knob: what the compiled backward recomputes), compiled on the first call.
    Dynamo caches graphs per code object and, with parameters as graph inputs, would hand every
    provider the first one's graph (compiled with the first budget, or for another patched model
    until its recompile limit sends the rest to eager): each provider compiles its own copy of
    ``_forward``'s code, named for the provider and shape (dynamo's automatic dynamic shapes key on
    the name: a second shape under the same name would compile with symbolic sizes)."""

    def __init__(self, model, memory_budget, name):
        self.model = model
        tag = f"{name}_{memory_budget}".replace(".", "_").replace("-", "_")
        code = _forward.__code__.replace(co_name=f"_forward_{tag}")
        # fullgraph: a graph break would leave part of the step eager (and shared frames past the
        # break would meet dynamo's recompile limit across providers); it raises instead.
        self.compiled = torch.compile(types.FunctionType(code, _forward.__globals__), fullgraph=True)
        self.memory_budget = memory_budget

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def __call__(self, **inputs):
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.memory_budget):
            return self.compiled(self.model, inputs)


def run(device, quick=False, shapes=None):
    """The rows of every provider at every shape of ``shapes`` (default: those SHAPES defines for
    ``device``'s type, "gemm" first)."""
    shapes = shapes or [name for name, per_device in SHAPES.items() if device.type in per_device]
    rows = []
    for shape in shapes:
        rows.extend(_run_shape(device, shape, quick))
    return with_end_load(rows)


def _run_shape(device, shape, quick):
    base, inputs = make_model(device, shape, quick)
    tags = environment_tags()
    entries = providers(base, inputs, quick, shape)
    progress = Progress(len(entries) + 1, f"frontier {shape}")
    measured, steps = {}, {}
    for entry in entries:
        label, model = entry[0], entry[2]
        steps[label] = step = loss_step(model, inputs)
        run_step(step)  # warm-up (and compile)
        with PeakSavedBytes() as peak:
            run_step(step)
        # The step's forward sets the gradients to None (loss_step); the ones it leaves are not counted.
        measured[label] = (peak.peak, transient_peak_bytes(functools.partial(run_step, step), device))
        progress.step(f"{label}: peak saved {peak.peak} bytes, step peak {measured[label][1]} bytes")
    # Whole steps only (the operator benchmarks time the parts and flag impossible splits): three
    # timed calls per provider and round would triple the 30 providers' time on the CPU.
    full_steps = {label: functools.partial(run_step, step) for label, step in steps.items()}
    timings = timing_summary(interleaved_timings(full_steps, device, rounds=2 if quick else 10), {"stock": "stock"},
                             f"frontier {shape}")
    progress.step("interleaved timing")
    rows = []
    config, ids = base.config, inputs["input_ids"]
    for entry in entries:
        label, family = entry[0], entry[1]
        plan = entry[3] if len(entry) > 3 else None
        rows.append({
            **tags, "shape": f"{shape} ({SHAPE_NOTES[shape]})",
            "model": (f"llama h={config.hidden_size} i={config.intermediate_size} L={config.num_hidden_layers} "
                      f"heads={config.num_attention_heads}/{config.num_key_value_heads} V={config.vocab_size} "
                      f"{str(base.dtype).removeprefix('torch.')}"),
            "batch": f"{ids.shape[0]}x{ids.shape[1]}", "provider": label, "family": family,
            "step_peak_bytes": measured[label][1], "peak_saved_bytes": measured[label][0],
            "budget_bytes": plan.budget_bytes if plan else "",
            "predicted_peak_bytes": plan.predicted_peak_bytes if plan else "",
            "plan": _describe(plan) if plan else "",
            **timings[label, "full"],
        })
    for row in rows:
        compiled = row["family"] == "torch.compile"
        for column, key in (("dominated_by", "step_peak_bytes"), ("dominated_by_saved", "peak_saved_bytes")):
            row[column] = ("; ".join(dominated_by(row, rows, key)) or "none") if compiled else ""
    return rows


# A remat point dominates a compile point when it keeps at most this much more (relative) ...
BYTES_SLACK = 0.05
# ... and its median step is at most this much slower (in units of stock's step), or the two
# providers' 20-80% bands overlap.
TIME_SLACK = 0.03


def dominated_by(row, rows, key="step_peak_bytes"):
    """The remat and remat+compile providers of ``rows`` whose ``key`` column (bytes) is no more
    than ``row``'s (BYTES_SLACK) at no more time (TIME_SLACK of stock's step, or within the
    spread)."""
    out = []
    for other in rows:
        if other["family"] not in ("remat policy", "remat auto", "remat+compile"):
            continue
        if other[key] > row[key] * (1 + BYTES_SLACK):
            continue
        if (other["time_vs_stock"] <= row["time_vs_stock"] + TIME_SLACK
                or other["time_vs_stock_q20"] <= row["time_vs_stock_q80"]):
            out.append(other["provider"])
    return out


def _describe(plan):
    """The plan in a few words: the count of each choice and the spans."""
    policies = plan.layer_policies()
    spans = plan.spans()
    counts = {c: sum(1 for p in policies.values() if p == c) for c in dict.fromkeys(policies.values())}
    text = " ".join(f"{n}x{c}" for c, n in counts.items())
    return text + (f" spans {spans}" if spans else "") + (f" loss {plan.loss}" if plan.loss else "")


summary_columns = ["shape", "provider", "step_peak_bytes", "peak_saved_bytes", "predicted_peak_bytes", "time_vs_stock",
                   "time_vs_stock_q20", "time_vs_stock_q80", "time_vs_stock_verdict", "suspect", "dominated_by",
                   "dominated_by_saved", "plan"]


def plot(rows, path):
    """Step time ratio (y) against bytes (x) per provider family, one column of panels per shape:
    the step's peak (top) and the peak saved bytes (bottom); remat auto, remat+compile and
    torch.compile as lines."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    measures = (("step_peak_bytes", "step peak: bytes allocated and freed over the step (MiB, log)"),
                ("peak_saved_bytes", "peak saved bytes (saved-tensor hooks; MiB, log)"))
    fig, axes = plt.subplots(len(measures), len(shapes), figsize=(8 * len(shapes), 5.5 * len(measures)),
                             squeeze=False)
    markers = {"stock": "*", "torch.utils.checkpoint": "s", "torch.compile": "^", "remat policy": "o",
               "remat auto": "D", "remat+compile": "v"}
    lines = ("remat auto", "remat+compile", "torch.compile")
    for (key, xlabel), panels in zip(measures, axes):
        for ax, shape in zip(panels, shapes):
            shape_rows = [r for r in rows if r["shape"] == shape]
            for family, marker in markers.items():
                points = sorted((r[key] / 2**20, r["time_vs_stock"], r["time_vs_stock_q20"], r["time_vs_stock_q80"],
                                 r["provider"]) for r in shape_rows if r["family"] == family)
                if not points:
                    continue
                xs, ys = [p[0] for p in points], [p[1] for p in points]
                errors = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
                ax.errorbar(xs, ys, yerr=errors, fmt=marker + ("-" if family in lines else ""), label=family,
                            capsize=3, markersize=6)
                for x, y, *_, label in points:
                    short = (label.replace("remat+compile ", "").replace("remat ", "").replace("checkpoint ", "ckpt ")
                             .replace("compile budget ", ""))
                    ax.annotate(short, (x, y), fontsize=6, xytext=(4, 4), textcoords="offset points")
            ax.axhline(1.0, color="k", lw=0.6)
            ax.set_xscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("step time / stock step time (median, 20-80% bars)")
            first = shape_rows[0]
            ax.set_title(f"{first['shape']}: {first['model']}, batch {first['batch']}\n{first['device']}, "
                         f"commit {first['commit']}", fontsize=8)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
