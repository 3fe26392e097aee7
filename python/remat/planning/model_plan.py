"""One memory budget for a whole model: per decoder layer, a choice among keeping the stock Hugging
Face layer, remat's fused layer under one of its policies, or checkpointing a span of consecutive
fused layers (one input kept per span, the span re-run in backward); the plan is the cheapest
combination whose predicted peak of saved bytes fits the budget.

The memory model (bytes saved for backward, as saved-tensor hooks count them; parameters excluded):

- measured on the example batch with one forward per uniform configuration (stock, speed,
  balanced, memory), building no KV cache (as a training step), each saved storage attributed to
  the region that saved it: before the decoder layers (``pre``: embeddings), one decoder layer,
  after them (``post``: final norm, loss), or ``shared`` when several layers save it (Hugging
  Face's rope tables). ``kept[i][c]``: layer i's bytes under choice c.
- taped layer i with choice c keeps ``kept[i][c]`` from its forward to its backward.
- a checkpointed span [a, b) keeps only its input (``input_bytes[a]``) through the forward; in
  backward it re-runs its layers, which then keep the sum of their ``kept`` while the span's
  gradient is computed, on top of what the layers before it still keep.
- peak = max(pre + shared + post + sum of what the layers keep after the forward,
  max over spans (pre + shared + what the layers before the span keep + the span's re-run bytes)).
  ``post`` is released before the layers' backward (autograd frees a node's saved tensors once it
  has run). ``shared`` is counted in every peak, so the prediction is an upper bound when no taped
  layer saves the shared storage.

Recompute cost (``cost="flops"``, from the layer shapes, per the whole example batch of T = B N
tokens, hidden h, q width Hq D, kv width Hkv D, MLP width I with g up GEMMs (2 gated, 1 GELU),
attention over the causal half):

- stock: 0 (the Hugging Face layer keeps every intermediate, the attention probabilities too).
- speed: one Q K^T product, ``B Hq D N (N + 1)``: flash attention's backward recomputes the
  probabilities.
- balanced: speed + the MLP's up GEMM(s), ``2 T h I g``.
- memory: balanced + the q/k/v projections, ``2 T h (Hq D + 2 Hkv D)``.
- MoE layers (Mixtral, Qwen3-MoE; E experts, top-k, expert width I): the router GEMM ``2 T h E``
  under every policy (remat.autograd.moe re-runs it), and under balanced and memory the routed
  tokens' expert gate/up GEMMs ``4 T k h I`` in place of the dense MLP's up GEMMs.
- a layer in a checkpointed span: its policy's cost + its whole forward
  (q/k/v, attention, o_proj, MLP).

Spans: a span runs every member with its first layer's call arguments, so it only joins layers
the decoder loop called with the same ones on the example (checked again at run time); layers
from which Hugging Face records outputs besides hidden states (router logits) are never in a
span (its first forward runs without autograd). Under FSDP2 with ``fully_shard`` on each layer a
span may hold one layer only (the first layer calls the others' forward past their fully_shard
hooks): a longer one raises at run time; plan with ``max_span=1``.

The loss (``cost="flops"``, a fixed budget in bytes, "loss" among the modules and a model whose
loss remat fuses): fused (remat.linear_cross_entropy: keeps no logits, recomputes them in backward,
one more ``2 T h V`` GEMM for vocabulary V) or stock (Hugging Face's: keeps the logits and their
log-softmax in ``post``, recomputes nothing). Both are measured (``post`` bytes with each, and the
all-stock plan with each); the plan is the cheaper of the best plans under either. Where the
logits are small next to what the layers keep (a vocabulary small next to the layers' widths and
count), a budget that holds them buys back the GEMM; the measured example needs labels and a
model in training mode (else no fused loss runs), and under per-token budgets and ``cost="time"``
the loss stays fused. The budget counts saved bytes: Hugging Face's loss also allocates the
logits' gradient (fp32 and the logits' dtype) in backward, which it does not count.

Per-token budgets: the example is measured again at twice its length, and a longer batch (up to
2N) is re-planned at run time on costs interpolated between the two (:func:`predicted_costs`).

With ``cost="time"`` each choice's cost is the measured median seconds of the layer's forward
plus backward on its inputs of the example batch (a span's layers: plus one forward), so the plan
minimises predicted step time instead.
"""

import bisect
import dataclasses
import inspect
import itertools
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from remat.checkpoint.executor import run_chain
from remat.checkpoint.schedule import Segment
from remat.memory import _span, _storage_key, _union_bytes
from remat.models import registry
from remat.nn.layers import LAYER_POLICIES, PreNormDecoderLayer
from remat.nn.moe import SparseMoE
from remat.replacement import MODULE_KINDS, STOCK, replace_modules, unpatch

COSTS = ("flops", "time")
_PLANNED = "_remat_model_plan"


@dataclass(frozen=True)
class LayerCosts:
    """Measured costs of one decoder layer on the example batch.

    Attributes:
        name: the layer's qualified name in the model.
        kept: {choice: bytes it saves for backward}, for the choices it can take (``"stock"``, and
            the fused policies when remat's family table takes the layer). "stock" is the stock
            layer inside a patched model (where some layer is fused), which may differ from an
            unpatched one: remat.patch can route the model's attention through remat's.
        cost: {choice: recompute cost when taped with that choice}.
        span_cost: {policy: cost when re-run inside a checkpointed span under that policy}.
        input_bytes: bytes of the layer's input hidden states (what a span starting here keeps).
        may_span: False when Hugging Face records an output from inside the layer beyond its
            hidden states (MoE router logits): a span's first forward runs without autograd, so
            such a recording would carry no gradient (the load-balancing loss would not train the
            router); the layer is then never put in a span.
        same_arguments_as_previous: whether the decoder loop passed this layer the same arguments
            (the same objects: rope tables, masks) as the layer before it; a span runs every member
            with its first layer's arguments, so it only continues across layers where this holds
            (Gemma 3's sliding and full layers get different rope tables and masks).
    """

    name: str
    kept: dict
    cost: dict
    span_cost: dict
    input_bytes: int
    may_span: bool = True
    same_arguments_as_previous: bool = True

    @property
    def fusable(self):
        return bool(self.span_cost)

    @property
    def spannable(self):
        return self.fusable and self.may_span


@dataclass(frozen=True)
class LossChoice:
    """One way to run the model's loss, measured: ``name`` ("fused" or "stock"), the bytes saved
    after the decoder layers with it (``post_bytes``), its recompute ``cost`` and the all-stock
    plan's (pre, shared, post) bytes with it (``all_stock_outside``, or None)."""

    name: str
    post_bytes: int
    cost: float
    all_stock_outside: tuple = None


@dataclass(frozen=True)
class ModelCosts:
    """Costs of a whole model on the example batch: per-layer :class:`LayerCosts` and the bytes
    outside the decoder layers (see the module docstring), the example's ``shape`` (batch, length)
    and the cost unit ``"flops"`` or ``"time"``. ``all_stock`` describes the plan that keeps every
    layer stock, measured as its own configuration: (per-layer bytes, per-layer costs,
    (pre, shared, post) bytes), or None when it is the plain sum of the layers' "stock" entries.
    ``loss_choices``: the :class:`LossChoice` s a plan picks from, or None when the loss is not
    planned (``post_bytes`` and ``all_stock`` then hold as they are). With choices, ``post_bytes``
    and ``all_stock`` are the fused loss's: :func:`peak_and_cost` prices that loss; the planning
    functions pick among the choices, and :meth:`with_loss` gives the costs under one."""

    layers: tuple
    pre_bytes: int
    shared_bytes: int
    post_bytes: int
    shape: tuple
    unit: str
    all_stock: tuple = None
    loss_choices: tuple = None

    def with_loss(self, choice):
        """These costs with ``choice`` (a :class:`LossChoice`) as the loss: its post bytes and
        all-stock plan, no choice left."""
        all_stock = self.all_stock
        if all_stock is not None and choice.all_stock_outside is not None:
            all_stock = (*all_stock[:2], choice.all_stock_outside)
        return dataclasses.replace(self, post_bytes=choice.post_bytes, all_stock=all_stock, loss_choices=None)

    @property
    def tokens(self):
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class Taped:
    """Layer ``index`` runs with ``choice`` ("stock" or a fused policy), keeping what it saves."""

    index: int
    choice: str


@dataclass(frozen=True)
class Span:
    """Layers [start, end) are checkpointed together: the forward keeps the input of ``start``;
    backward re-runs them, layer ``start + i`` as a fused layer with ``policies[i]``."""

    start: int
    end: int
    policies: tuple


def peak_and_cost(costs, decisions):
    """(predicted peak saved bytes, predicted recompute cost) of ``decisions`` (a sequence of
    :class:`Taped` and :class:`Span` covering the layers in order) under ``costs``."""
    if costs.all_stock is not None and all(isinstance(d, Taped) and d.choice == STOCK for d in decisions):
        kept, cost, (pre, shared, post) = costs.all_stock
        return pre + shared + post + sum(kept), float(sum(cost))
    base = costs.pre_bytes + costs.shared_bytes
    held, peak, total = 0, 0, 0.0
    for item in decisions:
        if isinstance(item, Taped):
            layer = costs.layers[item.index]
            held += layer.kept[item.choice]
            total += layer.cost[item.choice]
        else:
            layers = costs.layers[item.start:item.end]
            rerun = sum(layer.kept[p] for layer, p in zip(layers, item.policies, strict=True))
            peak = max(peak, base + held + rerun)
            held += layers[0].input_bytes
            total += sum(layer.span_cost[p] for layer, p in zip(layers, item.policies, strict=True))
    return max(peak, base + costs.post_bytes + held), total


@dataclass
class ModelPlan:
    """A plan for a whole model: what each decoder layer does, with its predictions.

    Attributes:
        costs: the measured :class:`ModelCosts`.
        decisions: tuple of :class:`Taped` / :class:`Span` covering the layers in order.
        budget_bytes: the budget it was planned for.
        predicted_peak_bytes: the memory model's peak of saved bytes over forward and backward.
        predicted_cost: total recompute cost (FLOPs, or seconds with cost="time").
        budget_bytes_per_token: the budget per token when it was given so, else None; longer
            batches are then re-planned (see :func:`predicted_costs`).
        doubled_costs: with a per-token budget, the :class:`ModelCosts` measured on the example
            lengthened to twice its length.
        loss: "fused" or "stock" when the plan chose the loss (``costs`` then hold that loss's
            bytes), None when it was not planned (then remat.patch fuses it where its modules hold
            "loss" and the model's loss can be fused: a plain ``nn.Linear`` lm_head, labels,
            training mode).
        loss_cost: the chosen loss's recompute cost; ``predicted_cost`` includes it, so costs of a
            plan with the loss planned and one without are not comparable.
        max_span: the span limit the plan was made under (run-time re-plans keep it).
    """

    costs: ModelCosts
    decisions: tuple
    budget_bytes: int
    budget_bytes_per_token: float = None
    doubled_costs: ModelCosts = field(default=None, repr=False)
    loss: str = None
    loss_cost: float = 0.0
    max_span: int = None
    predicted_peak_bytes: int = field(init=False)
    predicted_cost: float = field(init=False)

    def __post_init__(self):
        self.predicted_peak_bytes, layers_cost = peak_and_cost(self.costs, self.decisions)
        self.predicted_cost = layers_cost + self.loss_cost

    def layer_policies(self):
        """{layer index: "stock" or the fused policy it runs with}."""
        out = {}
        for item in self.decisions:
            if isinstance(item, Taped):
                out[item.index] = item.choice
            else:
                out.update(zip(range(item.start, item.end), item.policies, strict=True))
        return out

    def spans(self):
        """The checkpointed spans, as (start, end) pairs."""
        return [(s.start, s.end) for s in self.decisions if isinstance(s, Span)]

    def explain(self):
        """A table: per layer its choice, the bytes it keeps through the forward and its
        recompute cost; then the predicted peak against the budget and the total cost."""
        unit = "FLOPs" if self.costs.unit == "flops" else "seconds"
        lines = [f"{'layer':<28} {'choice':<34} {'saved bytes':>12} {'recompute ' + unit:>18}"]
        c = self.costs
        all_stock = c.all_stock is not None and self.decisions == tuple(_all_stock(c))
        for item in self.decisions:
            if isinstance(item, Taped):
                layer = c.layers[item.index]
                kept, cost = layer.kept[item.choice], layer.cost[item.choice]
                if all_stock:  # nothing fused: the stock layers as measured in the unpatched model
                    kept, cost = c.all_stock[0][item.index], c.all_stock[1][item.index]
                lines.append(f"{layer.name:<28} {item.choice:<34} {kept:>12} {cost:>18.4g}")
                continue
            for i, policy in zip(range(item.start, item.end), item.policies, strict=True):
                layer = self.costs.layers[i]
                where = f"layers {item.start}-{item.end - 1}" if item.end - item.start > 1 else "its input"
                choice = f"{policy}, re-run from {where}"
                kept = layer.input_bytes if i == item.start else 0
                lines.append(f"{layer.name:<28} {choice:<34} {kept:>12} {layer.span_cost[policy]:>18.4g}")
        lines.append(f"outside the layers: {c.pre_bytes} bytes before, {c.post_bytes} after, {c.shared_bytes} shared "
                     f"by layers; example shape {c.shape}")
        if self.loss == "fused":
            lines.append(f"loss: fused (keeps no logits; recomputes them in backward: {self.loss_cost:.4g} {unit})")
        elif self.loss == "stock":
            lines.append("loss: stock (keeps the logits and their log-softmax; recomputes nothing)")
        lines.append(f"predicted peak saved bytes {self.predicted_peak_bytes} <= budget {self.budget_bytes}; "
                     f"predicted recompute {self.predicted_cost:.4g} {unit}")
        return "\n".join(lines)

    def __str__(self):
        return self.explain()


def _pareto(points):
    """Points (held, cost, payload) not dominated by one with held <= and cost <=, sorted by held
    (their costs then strictly decrease)."""
    points.sort(key=lambda p: (p[0], p[1]))
    out, best = [], float("inf")
    for p in points:
        if p[1] < best:
            out.append(p)
            best = p[1]
    return out


def _span_options(costs):
    """For every span [a, b) of fusable layers: the Pareto set of (re-run bytes, cost, policies)
    over the inner policies, sorted by bytes."""
    n = len(costs.layers)
    options = {}
    for a in range(n):
        current = [(0, 0.0, ())]
        for b in range(a + 1, n + 1):
            layer = costs.layers[b - 1]
            if not _continues_span(costs, a, b - 1):
                break
            current = _pareto([(s + layer.kept[p], r + layer.span_cost[p], chosen + (p,))
                               for s, r, chosen in current for p in layer.span_cost])
            options[a, b] = current
    return options


def _continues_span(costs, start, index):
    """Whether a span starting at layer ``start`` may hold layer ``index`` (>= start)."""
    layer = costs.layers[index]
    return layer.spannable and (index == start or layer.same_arguments_as_previous)


def _all_stock(costs):
    return [Taped(i, STOCK) for i in range(len(costs.layers))]


def smallest_feasible_budget(costs, *, max_span=None):
    """The smallest budget any plan over these choices fits (the floor), in bytes; with spans of
    at most ``max_span`` layers (default: any)."""
    if costs.loss_choices is not None:
        return min(smallest_feasible_budget(costs.with_loss(choice), max_span=max_span)
                   for choice in costs.loss_choices)
    n, base = len(costs.layers), costs.pre_bytes + costs.shared_bytes
    # Least held bytes after the forward and least span peak, per prefix and per "some layer is
    # fused yet" (plans with none are the all-stock plan, priced on its own): a span [a, b) is
    # cheapest in bytes with every layer at its smallest choice. A Pareto DP minimises both.
    states = [{False: [], True: []} for _ in range(n + 1)]
    states[0][False] = [(0, 0, None)]
    least = {(a, b): sum(min(layer.kept[p] for p in layer.span_cost) for layer in costs.layers[a:b])
             for a in range(n) for b in range(a + 1, n + 1)
             if (max_span is None or b - a <= max_span) and all(_continues_span(costs, a, i) for i in range(a, b))}
    for i in range(n):
        layer = costs.layers[i]
        for fused, points in states[i].items():
            for held, peak, _ in _pareto(points):
                for choice, kept in layer.kept.items():
                    states[i + 1][fused or choice != STOCK].append((held + kept, peak, None))
                for b in range(i + 1, n + 1):
                    if (i, b) not in least:
                        break
                    states[b][True].append((held + layer.input_bytes, max(peak, base + held + least[i, b]), None))
    peaks = [max(peak, base + costs.post_bytes + held) for held, peak, _ in states[n][True]]
    if all(STOCK in layer.kept for layer in costs.layers):
        peaks.append(peak_and_cost(costs, _all_stock(costs))[0])
    return min(peaks)


def plan_for_costs(costs, budget_bytes, *, max_span=None):
    """The least-cost :class:`ModelPlan` for measured ``costs`` whose predicted peak is at most
    ``budget_bytes``: exact (a dynamic program over the layers keeping the Pareto set of (bytes
    kept so far, cost) at each layer boundary, which is exact because every later constraint
    only tightens with more bytes kept). Spans hold at most ``max_span`` layers (default: any).
    Raises ValueError naming the smallest feasible budget when none fits. With
    ``costs.loss_choices`` the cheaper (then smaller) of the best plans under each loss."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be non-negative, got {budget_bytes}")
    if costs.loss_choices is not None:
        plans = []
        for choice in costs.loss_choices:
            try:
                plan = plan_for_costs(costs.with_loss(choice), budget_bytes, max_span=max_span)
            except ValueError:
                continue
            plans.append(dataclasses.replace(plan, loss=choice.name, loss_cost=choice.cost))
        if not plans:
            _refuse_infeasible(costs, budget_bytes, max_span)
        return min(plans, key=lambda plan: (plan.predicted_cost, plan.predicted_peak_bytes))
    n, base = len(costs.layers), costs.pre_bytes + costs.shared_bytes
    span_options = _span_options(costs)
    span_bytes = {key: [s for s, _, _ in options] for key, options in span_options.items()}
    max_span = n if max_span is None else max_span
    # Per layer boundary and per "some layer is fused yet": the Pareto set of (bytes held, cost).
    # Plans with no fused layer are the all-stock plan, priced on its own below.
    states = [{False: [], True: []} for _ in range(n + 1)]
    states[0][False] = [(0, 0.0, ())]
    for i in range(n):
        layer = costs.layers[i]
        for fused, points in states[i].items():
            for held, cost, chosen in _pareto(points):
                for choice, kept in layer.kept.items():
                    states[i + 1][fused or choice != STOCK].append(
                        (held + kept, cost + layer.cost[choice], chosen + (Taped(i, choice),)))
                for b in range(i + 1, min(n, i + max_span) + 1):
                    options = span_options.get((i, b))
                    if options is None:
                        break
                    # The cheapest inner policies whose re-run fits on top of what is held now.
                    fit = bisect.bisect_right(span_bytes[i, b], budget_bytes - base - held) - 1
                    if fit < 0:
                        continue
                    _, span_cost, policies = options[fit]
                    states[b][True].append(
                        (held + layer.input_bytes, cost + span_cost, chosen + (Span(i, b, policies),)))
    final = [(cost, held, chosen) for held, cost, chosen in states[n][True]
             if base + costs.post_bytes + held <= budget_bytes]
    if all(STOCK in layer.kept for layer in costs.layers):
        stock_peak, stock_cost = peak_and_cost(costs, _all_stock(costs))
        if stock_peak <= budget_bytes:
            final.append((stock_cost, stock_peak, tuple(_all_stock(costs))))
    if not final:
        _refuse_infeasible(costs, budget_bytes, max_span)
    best = min(final, key=lambda s: (s[0], s[1]))
    return ModelPlan(costs, best[2], budget_bytes, max_span=None if max_span == n else max_span)


def _refuse_infeasible(costs, budget_bytes, max_span):
    floor = smallest_feasible_budget(costs, max_span=max_span)
    raise ValueError(f"budget_bytes={budget_bytes} is infeasible for this model at shape {costs.shape}: "
                     f"the smallest feasible budget is {floor} bytes")


# --- measuring -------------------------------------------------------------------------------


def decoder_layers(model):
    """(qualified name, module) of the modules remat's family table lists as whole decoder
    layers, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if (found := registry.match(m)) is not None and found.kind == "layer"]


class _SavedByRegion:
    """The saved-tensor pack hook of a :class:`_RegionLog`: records the byte spans of every saved
    storage (parameters excluded) and the regions that saved it.

    Autograd keeps a pack hook alive as long as the graph whose tensors it packed, and the measured
    forward's graph is never consumed by a backward. So the hook holds no tensor (the layer inputs
    live on the log: a hook holding them, whose ``grad_fn`` reaches the graph, is a reference cycle
    through autograd's C++ graph that gc cannot collect), and it hands autograd ``t.detach()``,
    never ``t`` (see remat.memory)."""

    def __init__(self):
        self.region = "pre"
        self.spans, self.regions = {}, {}

    def __call__(self, t):
        span = _span(t)
        if span is not None and not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            key = _storage_key(t)
            self.spans.setdefault(key, []).append(span)
            self.regions.setdefault(key, set()).add(self.region)
        return t.detach()


class _RegionLog:
    """Attributes every storage saved for backward to the region (``"pre"``, a layer index,
    ``"post"``) that saved it; storages saved in several regions are ``"shared"``. Records the
    order of the layers' calls and each layer's call arguments, its hidden states detached (the
    measured forward's graph is freed when its output is)."""

    def __init__(self, layers):
        self.saved = _SavedByRegion()
        self.calls, self.inputs = [], {}
        self.handles = []
        for index, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._enter(index), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._leave))

    def _enter(self, index):
        def hook(module, args, kwargs):
            self.saved.region = index
            self.calls.append(index)
            self.inputs[index] = ((args[0].detach(), *args[1:]), kwargs)

        return hook

    def _leave(self, module, args, output):
        self.saved.region = "post"

    def run(self, model, example_inputs):
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.saved, lambda t: t):
                model(**example_inputs)
        finally:
            for handle in self.handles:
                handle.remove()
        totals = {}
        for key, spans in self.saved.spans.items():
            regions = self.saved.regions[key]
            region = next(iter(regions)) if len(regions) == 1 else "shared"
            totals[region] = totals.get(region, 0) + _union_bytes(spans)
        return totals


def _measure_saved(model, layers, example_inputs):
    log = _RegionLog(layers)
    devices = [d for d in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        totals = log.run(model, example_inputs)
    if log.calls != list(range(len(layers))):
        raise ValueError("policy='auto' needs each decoder layer called once per forward, in module order; "
                         f"the example's forward called them as {log.calls}")
    return totals, log.inputs


def _mlp_flops(layer, tokens):
    """(forward FLOPs, {policy: recompute FLOPs}) of fused ``layer``'s MLP block on ``tokens``.

    Dense (gated: 2 up GEMMs; GPT-2: 1): up ``2 T h I g``, down ``2 T I h``; "balanced" and
    "memory" recompute the up GEMM(s). Sparse MoE (remat.nn.SparseMoE; top-k of E experts, each a
    gated MLP of width I): router ``2 T h E``, per routed token-expert pair up ``4 h I`` and down
    ``2 I h``; every policy recomputes the router (remat.autograd.moe), "balanced" and "memory"
    (expert recompute "block") also the experts' gate/up GEMMs, ``4 T k h I``."""
    if hasattr(layer, "ln_1"):  # GPT2Layer: Conv1D [in, out] weights
        hidden, intermediate, up_gemms = layer.attn.c_attn.weight.shape[0], layer.mlp.c_fc.weight.shape[1], 1
    else:
        mlp, hidden = layer.mlp, layer.input_layernorm.weight.shape[0]
        if isinstance(mlp, SparseMoE):
            experts, top_k = mlp.gate.num_experts, mlp.gate.top_k
            intermediate = mlp.experts.down_proj.shape[2]
            router, up = 2 * tokens * hidden * experts, 4 * tokens * top_k * hidden * intermediate
            forward = router + up + 2 * tokens * top_k * intermediate * hidden
            return forward, {"speed": router, "balanced": router + up, "memory": router + up}
        if hasattr(mlp, "gate_proj"):
            intermediate = mlp.gate_proj.out_features
        elif hasattr(mlp, "intermediate"):
            intermediate = mlp.intermediate
        else:
            raise ValueError(f"no FLOP formula for {type(layer).__name__}'s MLP ({type(mlp).__name__}); "
                             "use cost='time'")
        up_gemms = 2
    up = 2 * tokens * hidden * intermediate * up_gemms
    return up + 2 * tokens * intermediate * hidden, {"speed": 0, "balanced": up, "memory": up}


def _attention_shapes(layer):
    """(hidden, q width, kv width, heads, head dim) of a fused layer's attention."""
    if hasattr(layer, "ln_1"):  # GPT2Layer
        hidden = layer.attn.c_attn.weight.shape[0]
        return hidden, hidden, hidden, layer.num_heads, hidden // layer.num_heads
    attn = layer.self_attn
    hidden = layer.input_layernorm.weight.shape[0]
    return hidden, attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim, attn.num_heads, attn.head_dim


def layer_flops(layer, batch, length):
    """(forward FLOPs, {policy: recompute FLOPs}) of fused ``layer`` on [batch, length] (the
    formulas of the module docstring)."""
    hidden, q_width, kv_width, heads, head_dim = _attention_shapes(layer)
    tokens = batch * length
    scores = batch * heads * head_dim * length * (length + 1)  # one causal Q K^T
    qkv = 2 * tokens * hidden * (q_width + 2 * kv_width)
    mlp_forward, mlp_recompute = _mlp_flops(layer, tokens)
    forward = qkv + 2 * scores + 2 * tokens * q_width * hidden + mlp_forward
    recompute = {"speed": scores + mlp_recompute["speed"], "balanced": scores + mlp_recompute["balanced"],
                 "memory": scores + mlp_recompute["memory"] + qkv}
    return forward, recompute


def _median_seconds(fn, repeats=3):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _step_seconds(layer, args, kwargs, *, backward=True):
    """Median seconds of ``layer``'s forward (and backward, through torch.autograd.grad so that no
    parameter's .grad changes) on a copy of its recorded input."""
    x = args[0].detach().requires_grad_(True)
    rest = args[1:]
    params = [p for p in layer.parameters() if p.requires_grad]

    def step():
        if backward:
            torch.autograd.grad(layer(x, *rest, **kwargs).sum(), [x, *params])
        else:
            with torch.no_grad():
                layer(x, *rest, **kwargs)

    step()  # warm-up
    return _median_seconds(step)


def _output_recorders(model):
    """The (output key, class or None, class-name suffix or None) of every output Hugging Face's
    ``_can_record_outputs`` records in ``model`` besides the hidden states."""
    found = []
    for module in model.modules():
        for key, specs in (getattr(type(module), "_can_record_outputs", None) or {}).items():
            if key == "hidden_states":
                continue
            for spec in specs if isinstance(specs, list) else [specs]:
                if isinstance(spec, str):
                    found.append((key, None, spec))
                elif isinstance(spec, type):
                    found.append((key, spec, None))
                else:  # an OutputRecorder
                    found.append((key, spec.target_class, spec.class_name))
    return found


def _recorded_inside(layer, recorders):
    """The output keys (router_logits, ...) Hugging Face would record from modules inside ``layer``."""
    keys = set()
    for name, module in layer.named_modules():
        for key, target, suffix in recorders:
            if (target is not None and isinstance(module, target)) or (suffix and name.endswith(suffix)):
                keys.add(key)
    return frozenset(keys)


def _same_arguments(first, second):
    """Whether two layers' call arguments ``(args, kwargs)`` (the hidden states excluded) are the
    same: tensors the same objects, other values equal."""
    (args_a, kwargs_a), (args_b, kwargs_b) = first, second
    return (_same_value(args_a[1:], args_b[1:]) and kwargs_a.keys() == kwargs_b.keys()
            and all(_same_value(kwargs_a[k], kwargs_b[k]) for k in kwargs_a))


def _same_value(a, b):
    if a is b:
        return True
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool | int | float | str) and type(a) is type(b):
        return a == b
    return False


class _Configuration:
    """One measured configuration of the model: remat.patch applied with ``policy`` (a fused
    policy, or a dict of per-layer choices), one forward on the example with saved bytes
    attributed per region, the layers' recorded inputs, and (``time_layers``) the median step
    seconds of those layers, all while patched; then unpatched."""

    def __init__(self, model, names, policy, example_inputs, modules, backend, time_layers=()):
        report = replace_modules(model, policy, modules, backend)
        try:
            replaced = {name for name, _, _ in report.replaced}
            self.loss_fused = any(kind.endswith(" loss") for _, kind, _ in report.replaced)
            self.fused = [name in replaced for name in names]
            named = dict(model.named_modules())
            self.layers = [named[name] for name in names]
            self.attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
            self.totals, self.inputs = _measure_saved(model, self.layers, example_inputs)
            recorders = _output_recorders(model)
            self.recorded = [_recorded_inside(layer, recorders) for layer in self.layers]
            self.seconds = {i: (_step_seconds(self.layers[i], *self.inputs[i]),
                                _step_seconds(self.layers[i], *self.inputs[i], backward=False)) for i in time_layers}
        finally:
            if getattr(model, "_remat_patched", False):
                unpatch(model)

    def outside(self):
        return self.totals.get("pre", 0), self.totals.get("shared", 0), self.totals.get("post", 0)


def measure_model_costs(model, example_inputs, *, cost="flops", backend=None, modules=None, plan_loss=True):
    """The :class:`ModelCosts` of ``model`` (unpatched) on ``example_inputs`` (a dict of keyword
    arguments of its forward), measured in the configurations a plan can produce, each through
    remat.patch with ``modules`` and ``backend`` and one forward: every layer stock; every layer
    fused under each policy; and (two forwards) one layer fused, the others stock, which gives the
    stock layers' bytes inside a patched model. Where the loss is planned (``plan_loss``, and see
    the module docstring), two more: every layer fused, and every layer stock, with Hugging Face's
    loss. The forwards build no
    KV cache, as a training step (see :func:`_training_inputs`). The RNG state is left untouched and
    no parameter's ``.grad`` changes."""
    names = [name for name, _ in decoder_layers(model)]
    if not names:
        raise ValueError("policy='auto' found no decoder layer that remat's model families take in this model")
    example_inputs = _training_inputs(model, example_inputs, cost)
    modules = MODULE_KINDS if modules is None else tuple(modules)
    timed = range(len(names)) if cost == "time" else ()

    def measure(policy, time_layers=timed):
        return _Configuration(model, names, policy, example_inputs, modules, backend, time_layers)

    alone = measure(dict.fromkeys(names, STOCK))
    fused = {p: measure(p) for p in LAYER_POLICIES}
    fusable = fused["memory"].fused
    # The stock layers inside a patched model: one fused layer (the first or second fusable one)
    # makes it a patched model; each stock layer is measured where another one is fused.
    mixed = {}
    for host in [i for i, f in enumerate(fusable) if f][:2]:
        others = [i for i in range(len(names)) if i != host and i not in mixed]
        config = measure({**dict.fromkeys(names, STOCK), names[host]: "memory"},
                         others if cost == "time" else ())
        mixed.update(dict.fromkeys(others, config))
    # Stock layers left in a patched model still run Hugging Face's code, but their attention may
    # go through remat's (remat.patch switches the model's attention implementation); flash
    # attention then recomputes the probabilities in backward.
    shape = tuple(alone.inputs[0][0][0].shape[:2])
    per_layer = []
    for index, name in enumerate(names):
        x = alone.inputs[index][0][0]
        in_patched = mixed.get(index, alone)
        kept, taped_cost, span_cost = {STOCK: in_patched.totals.get(index, 0)}, {STOCK: 0.0}, {}
        if fusable[index]:
            kept.update({p: fused[p].totals.get(index, 0) for p in LAYER_POLICIES})
            if cost == "flops":
                forward, recompute = layer_flops(fused["memory"].layers[index], *shape)
                taped_cost.update(recompute)
                span_cost = {p: forward + recompute[p] for p in LAYER_POLICIES}
                if in_patched.attention != alone.attention:
                    taped_cost[STOCK] = recompute["speed"]
            else:
                taped_cost.update({p: fused[p].seconds[index][0] for p in LAYER_POLICIES})
                span_cost = {p: sum(fused[p].seconds[index]) for p in LAYER_POLICIES}
        if cost == "time":
            taped_cost[STOCK] = in_patched.seconds[index][0]
        same_arguments = index > 0 and _same_arguments(fused["memory"].inputs[index - 1], fused["memory"].inputs[index])
        per_layer.append(LayerCosts(name, kept, taped_cost, span_cost, x.numel() * x.element_size(),
                                    may_span=not fused["memory"].recorded[index],
                                    same_arguments_as_previous=same_arguments))
    all_stock = None
    if any(fusable):
        all_stock = (tuple(alone.totals.get(i, 0) for i in range(len(names))),
                     tuple(alone.seconds[i][0] if cost == "time" else 0.0 for i in range(len(names))),
                     alone.outside())
    outside = fused["memory"].outside() if any(fusable) else alone.outside()
    shared = max([outside[1], *(c.outside()[1] for c in mixed.values())])
    loss_choices = None
    # Only where the fused loss runs in the measured forward: a training model given labels (without
    # them, or in eval mode, both losses measure the lm_head alone and the choice would be empty).
    runs_fused_loss = fused["memory"].loss_fused and model.training and example_inputs.get("labels") is not None
    if plan_loss and cost == "flops" and any(fusable) and runs_fused_loss:
        without_loss = tuple(kind for kind in modules if kind != "loss")
        stock_loss = _Configuration(model, names, "memory", example_inputs, without_loss, backend)
        alone_stock_loss = _Configuration(model, names, dict.fromkeys(names, STOCK), example_inputs, without_loss,
                                          backend)
        loss_choices = (LossChoice("fused", outside[2], _logits_flops(model, shape), all_stock[2]),
                        LossChoice("stock", stock_loss.outside()[2], 0.0, alone_stock_loss.outside()))
    return ModelCosts(tuple(per_layer), outside[0], shared, outside[2], shape, cost, all_stock, loss_choices)


def _logits_flops(model, shape):
    """FLOPs of the lm_head GEMM over the example's B x N tokens (what the fused loss recomputes in
    backward): 2 T h V from the output embedding's [V, h] weight."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        vocab, hidden = weight.shape
    else:
        vocab, hidden = model.config.vocab_size, model.config.hidden_size
    return 2.0 * shape[0] * shape[1] * hidden * vocab


# The keyword arguments by which Hugging Face forwards take a KV cache ("cache" from transformers 5.x).
_CACHE_ARGUMENTS = ("past_key_values", "cache")


def _builds_cache(model):
    """Whether a Hugging Face config that ``model``'s modules hold asks for a KV cache in every
    forward (``use_cache=True``, Hugging Face's default)."""
    return any(getattr(module.__dict__.get("config"), "use_cache", False) for module in model.modules())


def _training_inputs(model, example_inputs, cost):
    """``example_inputs`` as the forward of a training step takes them: with ``use_cache=False``
    added where a config of ``model`` asks for a KV cache.

    A training step builds no cache: Hugging Face turns it off under gradient checkpointing, and
    remat.patch on the config copy of a model with fused layers. The planner measures some
    configurations with no layer fused, where the stock forward would build one; timing
    (``cost="time"``) then re-ran each layer with the cache among its recorded arguments, which
    grew by the example's keys on every run and led the backward into an earlier run's freed graph
    ("Trying to backward through the graph a second time").

    Raises ValueError for an example that holds a cache or asks for one (``use_cache=True``), and,
    with ``cost="time"``, for a model whose config asks for a cache and whose forward takes no
    ``use_cache`` argument (set ``use_cache`` False on its config first)."""
    if any(example_inputs.get(key) is not None for key in _CACHE_ARGUMENTS) or example_inputs.get("use_cache"):
        raise ValueError("example_inputs holds a KV cache or use_cache=True; policy='auto' measures training "
                         "forwards, which build and read no cache: give one training batch (input_ids, "
                         "attention_mask, labels, ...)")
    if "use_cache" in example_inputs or not _builds_cache(model):
        return example_inputs
    parameters = inspect.signature(model.forward).parameters.values()
    if any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in parameters):
        return {**example_inputs, "use_cache": False}
    if cost == "time":
        raise ValueError(f"{type(model).__name__}'s config asks for a KV cache (use_cache=True) and its forward "
                         "takes no use_cache argument to turn it off; cost='time' times each layer on its recorded "
                         "arguments, which a cache would change between runs: set config.use_cache = False")
    return example_inputs


def _check_example(example_inputs):
    if not isinstance(example_inputs, dict) or not example_inputs:
        raise TypeError("example_inputs must be a non-empty dict of the model's forward keyword arguments "
                        f"(input_ids, attention_mask, labels, ...), got {type(example_inputs).__name__}")


def resolve_budget(budget_bytes, budget_bytes_per_token, tokens):
    """The budget in bytes: ``budget_bytes``, or ``budget_bytes_per_token`` times the example's
    tokens; exactly one must be given."""
    if (budget_bytes is None) == (budget_bytes_per_token is None):
        raise ValueError("give exactly one of budget_bytes and budget_bytes_per_token")
    if budget_bytes is not None:
        return budget_bytes
    if isinstance(budget_bytes_per_token, bool) or not isinstance(budget_bytes_per_token, int | float):
        raise TypeError(f"budget_bytes_per_token must be a number, got {type(budget_bytes_per_token).__name__}")
    if budget_bytes_per_token < 0:
        raise ValueError(f"budget_bytes_per_token must be non-negative, got {budget_bytes_per_token}")
    return int(budget_bytes_per_token * tokens)


def plan_model(model, example_inputs, *, budget_bytes=None, budget_bytes_per_token=None, cost="flops",
               backend=None, modules=None, max_span=None):
    """Plans, without patching, what each decoder layer of ``model`` keeps so that one training
    step on batches shaped like ``example_inputs`` keeps at most the budget in saved bytes, at the
    least recompute (see the module docstring for the choices, the memory model and the costs).

    Args:
        model: an unpatched ``nn.Module`` with decoder layers remat's families take (Hugging Face
            Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, GPT-2, Mixtral, Qwen3-MoE), in training
            mode as it will train.
        example_inputs: dict of forward keyword arguments of one training batch (``input_ids``,
            ``attention_mask``, ``labels``...), its shape the one the plan holds for; no KV cache
            (``past_key_values``, ``use_cache=True``): the measured forwards build none, as a
            training step (``use_cache=False`` is passed where the model's config asks for one).
        budget_bytes: cap on the peak of saved bytes over forward and backward (parameters excluded).
        budget_bytes_per_token: or the cap per token (``input_ids``' B x N); the model is then also
            measured on the example lengthened to 2N, and batches up to that length are re-planned
            when first seen (see :func:`predicted_costs`).
        cost: ``"flops"`` (default: recompute FLOPs from the layer shapes) or ``"time"`` (measured
            seconds of each layer's step under each choice).
        backend: remat backend of the fused layers. modules: as for remat.patch (whole layers
            need "norm", "mlp" and "attention").
        max_span: the most layers one checkpointed span may hold (default: any). Under FSDP2 with
            ``fully_shard`` on each decoder layer a span must hold one layer (``max_span=1``): a
            span's first layer calls the others' forward directly, past their fully_shard hooks,
            so a running plan with a longer span raises ValueError at its first forward. The budget
            is then per rank: plan (or patch, before fully_shard) on the rank's local batch.

    Returns:
        a :class:`ModelPlan`. Raises ValueError naming the smallest feasible budget when the
        budget cannot be met.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, "_remat_patched", False):
        raise ValueError("model is already patched; plan the unpatched model (remat.unpatch(model) first)")
    _check_example(example_inputs)
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")
    if max_span is not None and (isinstance(max_span, bool) or not isinstance(max_span, int) or max_span < 1):
        raise ValueError(f"max_span must be a positive int or None, got {max_span!r}")
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
    resolve_budget(budget_bytes, budget_bytes_per_token, 1)  # argument checks before measuring
    # Per-token plans are re-planned per length at run time, where the loss is installed once: fused.
    per_token = budget_bytes_per_token is not None
    costs = measure_model_costs(model, example_inputs, cost=cost, backend=backend, modules=modules,
                                plan_loss=not per_token)
    budget = resolve_budget(budget_bytes, budget_bytes_per_token, costs.tokens)
    plan = plan_for_costs(costs, budget, max_span=max_span)
    if budget_bytes_per_token is not None:
        plan.budget_bytes_per_token = budget_bytes_per_token
        plan.doubled_costs = measure_model_costs(model, lengthened_example(example_inputs), cost=cost,
                                                 backend=backend, modules=modules, plan_loss=False)
    return plan


def lengthened_example(example_inputs):
    """The example batch at twice its length N: every row gets N more real tokens (its own ids
    again, attention mask 1, labelled), before its tokens, or after them when the batch is left
    padded, so each row's padding stays where it was and its size is unchanged. Takes the
    ``input_ids`` / ``attention_mask`` / ``labels`` of a [B, N] example; other [B, N] tensors are
    refused."""
    ids = example_inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("budget_bytes_per_token needs example_inputs with input_ids of shape [batch, length]")
    mask = example_inputs.get("attention_mask")
    left_padded = isinstance(mask, torch.Tensor) and bool((mask[:, 0] == 0).any())
    added = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids) if mask is None else
             torch.ones_like(mask)}
    out = {}
    for key, value in example_inputs.items():
        if isinstance(value, torch.Tensor) and value.shape[:2] == ids.shape:
            if key not in added:
                raise ValueError(f"budget_bytes_per_token lengthens the example to re-plan longer batches and cannot "
                                 f"lengthen its {key!r}; give input_ids, attention_mask and labels only")
            out[key] = torch.cat([value, added[key]] if left_padded else [added[key], value], dim=1)
        else:
            out[key] = value
    return out


# --- running a plan --------------------------------------------------------------------------


class _BoundLayer(nn.Module):
    """One layer of a span with the decoder loop's call arguments, as a one-tensor block for
    remat's chain executor (an nn.Module, so the executor differentiates its parameters)."""

    def __init__(self, layer, args, kwargs):
        super().__init__()
        self.layer, self.args, self.kwargs = layer, args, kwargs

    def forward(self, x):
        return type(self.layer).forward(self.layer, x, *self.args, **self.kwargs)


def _hidden_states_requested():
    """Whether Hugging Face is recording per-layer hidden states in this forward (its output
    capture hooks would record a passed-through layer's input as its output)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    collected = _active_collector.get()
    return collected is not None and "hidden_states" in collected


def _refuse_gradient_checkpointing(layer):
    if getattr(layer, "gradient_checkpointing", False):
        raise ValueError("this model runs a remat plan (policy='auto'), which decides what is re-run; Hugging Face "
                         "gradient checkpointing on top would re-run layers again: call "
                         "model.gradient_checkpointing_disable() or patch with a fixed policy")


def _roles(decisions):
    """{layer index: ("taped", policy) | ("span", end, policies) | ("member", start)} of a plan's
    decisions (fused layers only)."""
    roles = {}
    for item in decisions:
        if isinstance(item, Taped):
            roles[item.index] = ("taped", item.choice)
        else:
            roles[item.start] = ("span", item.end, item.policies)
            roles.update({i: ("member", item.start) for i in range(item.start + 1, item.end)})
    return roles


def _interpolate(at_example, at_double, fraction):
    """``at_example + fraction (at_double - at_example)``, rounded up for bytes (ints)."""
    value = at_example + fraction * (at_double - at_example)
    return -int(-value // 1) if isinstance(at_example, int) else value


def predicted_costs(plan, length, layer_kinds):
    """The :class:`ModelCosts` of the planned model on batches of the example's rows and ``length``
    (between the example's length N and 2N), for a per-token plan (``plan.doubled_costs`` measured
    on the example lengthened to 2N): every entry on the chord between its values at N and 2N. A
    byte count that is a sum of terms linear and quadratic in the length (activations, attention
    probabilities, masks) is convex in it, so the chord is an upper bound on [N, 2N], exact for the
    linear terms. Each layer keeps only the choices of its kind in the patched model
    (``layer_kinds[i]``: "stock" or "fused"): a re-plan changes the fused layers' policies and the
    spans, not which layers are fused."""
    base, double = plan.costs, plan.doubled_costs
    fraction = (length - base.shape[1]) / base.shape[1]

    def chord(a, b):
        return {key: _interpolate(a[key], b[key], fraction) for key in a}

    layers = []
    for layer, doubled, kind in zip(base.layers, double.layers, layer_kinds, strict=True):
        choices = [STOCK] if kind == STOCK else list(layer.span_cost)
        kept = chord({c: layer.kept[c] for c in choices}, doubled.kept)
        cost = chord({c: layer.cost[c] for c in choices}, doubled.cost)
        span_cost = chord(layer.span_cost, doubled.span_cost) if kind != STOCK else {}
        layers.append(dataclasses.replace(layer, kept=kept, cost=cost, span_cost=span_cost,
                                          input_bytes=_interpolate(layer.input_bytes, doubled.input_bytes, fraction)))
    outside = [_interpolate(getattr(base, f), getattr(double, f), fraction)
               for f in ("pre_bytes", "shared_bytes", "post_bytes")]
    return ModelCosts(tuple(layers), *outside, (base.shape[0], length), base.unit)


class _PlanRuntime:
    """What the planned fused layers of one model share: the plan, the layers, the roles per batch
    shape (re-planned and cached per length for per-token budgets), and the span in progress."""

    def __init__(self, plan, layer_modules):
        self.plan, self.layers = plan, layer_modules
        self.kinds = [STOCK if choice == STOCK else "fused" for _, choice in sorted(plan.layer_policies().items())]
        self.planned_roles = _roles(plan.decisions)
        self.replanned = {}  # length -> roles
        self.pending, self.bound = 0, None

    def roles(self, shape):
        planned = self.plan.costs.shape
        batch, length = shape
        if batch <= planned[0] and length <= planned[1]:
            return self.planned_roles
        per_token = self.plan.budget_bytes_per_token
        if per_token is None:
            raise ValueError(f"this model's remat plan was made for batches of shape {planned}; a [{batch}, {length}] "
                             "batch may not fit its budget: re-plan (remat.unpatch(model), then remat.patch(model, "
                             "policy='auto', example_inputs=<a batch of this shape>, ...)) or give the budget per "
                             "token (budget_bytes_per_token=)")
        if batch > planned[0] or length > 2 * planned[1]:
            raise ValueError(f"this model's per-token remat plan was measured on batches of {planned[0]} rows and "
                             f"lengths {planned[1]} and {2 * planned[1]}; a [{batch}, {length}] batch is outside "
                             "that range: re-plan with an example of at least this many rows and half this length")
        if length not in self.replanned:
            costs = predicted_costs(self.plan, length, self.kinds)
            budget = int(per_token * planned[0] * length)
            try:
                plan = plan_for_costs(costs, budget, max_span=self.plan.max_span)
            except ValueError as error:
                raise ValueError(f"budget_bytes_per_token={per_token} cannot hold a [{planned[0]}, {length}] batch "
                                 f"with this model's layers fused as planned ({error}); re-plan on an example of "
                                 "this length") from None
            self.replanned[length] = _roles(plan.decisions)
        return self.replanned[length]


def _set_policy(layer, policy):
    if layer.policy != policy:
        layer.policy = policy


class _PlannedForward:
    """A planned fused layer's forward (:func:`install`): runs its role in the plan. An object of a
    module-level class holding the layer, not a method bound with ``types.MethodType`` (which pickle
    saves by name and cannot load), so a model patched with ``policy="auto"`` survives
    ``torch.save(model)``, pickle and deepcopy."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, hidden_states, *args, **kwargs):
        return _planned_forward(self.layer, hidden_states, *args, **kwargs)


def _planned_forward(self, hidden_states, *args, **kwargs):
    index = self.__dict__[_PLANNED]["index"]
    runtime = self.__dict__[_PLANNED]["runtime"]
    _refuse_gradient_checkpointing(self)
    role = runtime.roles(tuple(hidden_states.shape[:2]))[index]
    if role[0] == "taped":
        _set_policy(self, role[1])
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if role[0] == "member":
        return _pass_through(self, runtime, hidden_states, args, kwargs)
    _, end, policies = role
    members = runtime.layers[index:end]
    for value in itertools.chain(args, kwargs.values()):
        for t in value if isinstance(value, tuple | list) else (value,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError("a checkpointed span passes the decoder loop's arguments to every layer and "
                                 "differentiates only the hidden states and parameters; an argument requires grad")
    if any(_fully_sharded(layer) for layer in members[1:]):
        raise ValueError("under FSDP2 a checkpointed span holds one layer only: this plan's span of layers "
                         f"{index}-{end - 1} runs its later layers from the first one's forward, past their "
                         "fully_shard hooks, so their parameters would stay sharded; re-plan (remat.unpatch(model) "
                         "before fully_shard) with max_span=1: remat.patch(model, policy='auto', ..., max_span=1) or "
                         "remat.plan_model(..., max_span=1)")
    if len(members) > 1 and _hidden_states_requested():
        raise ValueError("a remat plan with multi-layer checkpointed spans cannot return per-layer hidden states "
                         "(output_hidden_states=True); plan with max_span=1")
    for layer, policy in zip(members, policies, strict=True):
        _set_policy(layer, policy)
    if torch.compiler.is_compiling():
        # remat's chain executor (an autograd Function that holds the layers and their RNG states)
        # does not trace; compiled, the span is a torch.utils.checkpoint region, whose operations
        # AOT autograd's partitioner recomputes in backward: the same plan (the span's input kept,
        # its layers re-run, RNG and autocast restored by checkpoint).
        out = torch.utils.checkpoint.checkpoint(_run_span, members, hidden_states, args, kwargs, use_reentrant=False)
    else:
        blocks = [_BoundLayer(layer, args, kwargs) for layer in members]
        out = run_chain(blocks, hidden_states, Segment(0, len(blocks), recompute=True))
    runtime.pending = len(members) - 1
    runtime.bound = (args, kwargs) if len(members) > 1 else None
    return out


def _run_span(layers, hidden_states, args, kwargs):
    """The layers of a span one after another on ``hidden_states``, each with the decoder loop's
    arguments (the compiled span's body)."""
    for layer in layers:
        hidden_states = type(layer).forward(layer, hidden_states, *args, **kwargs)
    return hidden_states


def _fully_sharded(module):
    """Whether FSDP2's ``fully_shard`` was applied to ``module`` itself (its parameters are then
    unsharded only by the hooks around its own call)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _pass_through(layer, runtime, hidden_states, args, kwargs):
    if runtime.pending <= 0:
        raise ValueError(f"{type(layer).__name__} runs inside a checkpointed span started by an earlier layer and "
                         "cannot run on its own; call the whole model (or remat.unpatch it)")
    runtime.pending -= 1
    bound_args, bound_kwargs = runtime.bound
    if runtime.pending == 0:
        runtime.bound = None  # the span's arguments are not kept alive past the forward
    if not _same_arguments(((None, *bound_args), bound_kwargs), ((hidden_states, *args), kwargs)):
        raise ValueError(f"{type(layer).__name__} ran inside a checkpointed span with the span's first layer's "
                         "arguments, but the decoder loop passes it different ones (rope tables, masks): the "
                         "span's output is wrong for it; plan with max_span=1 or patch with a fixed policy")
    return hidden_states


def install(plan, layer_modules):
    """Makes the patched ``layer_modules`` (one per planned layer, in order) run ``plan``: a
    span's first layer runs the whole span under remat's chain executor (its input kept, the span
    re-run in backward; under torch.compile a torch.utils.checkpoint region), the span's other
    layers pass the hidden states through; every fused layer checks the batch shape against the
    plan's (a per-token plan re-plans longer batches, see :class:`_PlanRuntime`)."""
    runtime = _PlanRuntime(plan, list(layer_modules))
    for index, layer in enumerate(layer_modules):
        if isinstance(layer, PreNormDecoderLayer):
            object.__setattr__(layer, _PLANNED, {"index": index, "runtime": runtime})
            layer.forward = _PlannedForward(layer)
