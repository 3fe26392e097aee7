"""A plan that bounds the device peak of a training step: ``remat.patch(model, policy="auto",
budget_bytes=B, seq_len=N)``.

The candidates are whole-model configurations in the order of their expected step time, the
cheapest first, and the plan is the first whose peak, predicted by ``remat.estimate`` for a step
of ``batch_size`` sequences of ``seq_len`` tokens (parameters, trainable gradients, what is kept,
the largest backward working set, the loss), is within the budget:

1. ``speed``: no GEMM recomputed;
2. ``balanced``: the MLP's gate/up GEMMs recomputed;
3. ``memory``: the q/k/v projections too;
4. ``memory`` with the MLP and the attention sub-block tiled along the sequence (no FLOPs
   added: the attention backward runs per query tile, each tile recomputing its own q);
5. the same with what each layer keeps offloaded to host memory (copies that a GPU overlaps with
   compute: not measured yet);
6. the same with each layer checkpointed (it keeps its input, offloaded, and re-runs its forward
   in backward: one more forward's FLOPs);
7. the same without prefetch: a layer's input comes back when its backward starts, not one layer
   ahead (one layer's input on the device instead of two; compute waits for that copy).

When candidate k is the first that fits and candidate k - 1 does not, the plan then searches a
per-layer mix of the two: m layers take k, the other layers k - 1, for the smallest m whose step
fits (each probe is an estimate of the whole step; the plan is always one that was estimated to
fit, m = every layer when no mix does). Layers cost alike, so fewer layers on k is a faster step.
Which m layers: where k keeps less than k - 1 (a policy that recomputes more, offload,
checkpointing), the first m in forward order: a layer's kept tensors are held from its forward to
its backward, and at every moment of the step the layers before the running one hold theirs, so
the earliest layers' bytes are held for the most of the step (the last layer's are held for no
other layer's backward, and a checkpointed last layer re-makes at once what it did not keep). Where
k only shrinks the working set (tiling), the last m: the backward working set counts on top of the
kept tensors of every earlier layer, so it matters most in the layers whose backward runs first.
Candidates 6 and 7 differ only in prefetch, which the layers share (remat.offload.HostOffload): no
mix of those. Under a mix of offloaded and kept layers, the first offloaded layer backward reaches
is fetched when its backward starts (prefetch is layer i's backward fetching layer i - 1's, and
the layer after it keeps its tensors): compute waits for that one copy per step. A budget below
the last candidate's peak raises ValueError naming that floor.
"""

import dataclasses
import math

from remat.autograd.common import sparse_tiles
from remat.nn.layers import PreNormDecoderLayer
from remat.planning.composed import Composer, estimate
from remat.planning.estimator import format_bytes
from remat.planning.model_plan import decoder_layers, layer_flops
from remat.replacement import fused_layers, replace_modules, set_layer_options, unpatch

# (name, policy, tile the MLP and attention, offload, checkpoint, prefetch), cheapest first.
CANDIDATES = (
    ("speed", "speed", False, False, False, True),
    ("balanced", "balanced", False, False, False, True),
    ("memory", "memory", False, False, False, True),
    ("memory+tiled", "memory", True, False, False, True),
    ("memory+tiled+offload", "memory", True, True, False, True),
    ("memory+tiled+offload+checkpointed", "memory", True, True, True, True),
    ("memory+tiled+offload+checkpointed, no prefetch", "memory", True, True, True, False),
)
# Interpolated probes of a mix search before it bisects. A step's peak is close to linear in the
# number of layers on the more frugal candidate, so the interpolation lands on the answer or next to
# it: Llama-3.1-8B LoRA at 131,072 tokens in 77 GiB probed 15, 14 (fit), then 13 (did not) for 14 of
# 32 layers offloaded; bisection after two interpolations spent four more probes there.
INTERPOLATED_PROBES = 4
# A candidate whose unchecked composed estimate is more than this share over the budgets is rejected
# on it; any nearer (or fitting) is estimated again with the composition's check (remat.planning.composed).
CHECK_MARGIN = 0.05
# Tokens per tile: [8192, 14336] bf16 MLP temporaries are 224 MiB each, GEMMs that still fill a GPU,
# and a query tile of 8192 keeps the attention backward's calls large.
DEFAULT_TILE_TOKENS = 8192


@dataclasses.dataclass
class PeakPlan:
    """The configuration chosen and what was predicted.

    Attributes:
        choice: the candidate's name (see the module docstring).
        policy, tile_tokens, offload, checkpointing, prefetch: what ``choice`` sets on its layers
            (every layer, or the ``mixed_layers`` of a mix).
        peak_bytes, host_bytes: the estimate of the chosen configuration's step.
        budget_bytes: the device budget; host_budget_bytes: the host budget (None: any).
        tried: (name, peak_bytes, host_bytes, recompute) of every candidate and mix estimated, in
            order; recompute: (FLOPs the step recomputes, FLOPs of the layers' forward) per rank
            (remat.planning.model_plan.layer_flops), or None for a layer without a FLOP formula.
        base: None when every layer runs ``choice``; else the candidate the other layers run (the
            one before ``choice``), and ``mixed_layers`` layers run ``choice``: the first ones in
            forward order (``mixed_from == "first"``) or the last ones (``"last"``).
    """

    choice: str
    policy: str
    tile_tokens: int | None
    offload: bool
    checkpointing: bool
    prefetch: bool
    peak_bytes: int
    host_bytes: int
    budget_bytes: int
    seq_len: int
    batch_size: int
    tried: list
    host_budget_bytes: int | None = None
    # Under sequence parallelism: the ranks sharing the sequence; each keeps seq_len / ranks tokens.
    ranks: int = 1
    base: str | None = None
    mixed_layers: int | None = None
    mixed_from: str = "first"
    # The model's decoder layers (remat.planning.model_plan.decoder_layers).
    layers: int = 0

    @property
    def label(self):
        """The plan's name in :meth:`explain`: the candidate, or the mix ("memory+tiled+offload on
        the first 12 of 32 layers, memory+tiled on the rest")."""
        return self.choice if self.base is None else mix_label(self.choice, self.base, self.mixed_layers,
                                                               self.layers, self.mixed_from)

    def explain(self):
        """The plan in words: the predicted device peak and host bytes per candidate and why this
        one (the cheapest that fits)."""
        shards = "" if self.ranks == 1 else f" over {self.ranks} ranks (per-rank peaks)"
        label = self.label
        lines = [f"remat peak plan for {self.batch_size} x {self.seq_len} tokens{shards}, device budget "
                 f"{format_bytes(self.budget_bytes)}: {label} (the cheapest within it)"]
        width = max(48, *(len(entry[0]) for entry in self.tried))
        for name, peak, host, recompute in self.tried:
            over = peak > self.budget_bytes or (self.host_budget_bytes is not None and host > self.host_budget_bytes)
            mark = "<- chosen" if name == label else ("over budget" if over else "")
            sizes = f"device peak {format_bytes(peak):>11}  host {format_bytes(host):>11}"
            cost = "recompute n/a" if recompute is None else (
                f"recompute {recompute[0] / 1e12:10.4g} TFLOP ({recompute[0] / recompute[1]:.2f} of a forward)")
            lines.append(f"  {name:<{width}} {sizes}  {cost}  {mark}")
        lines.append("  recompute: the layers' FLOPs a step runs again (attention probabilities under every policy; "
                     "balanced: + MLP gate/up GEMMs; memory: + q/k/v; checkpointed: + the layer's forward); tiling "
                     "adds none; offload copies the host bytes there and back (overlapped with compute on a GPU, not "
                     "measured; without prefetch compute waits for each layer's copy)")
        return "\n".join(lines)


def mix_label(choice, base, mixed_layers, layers, mixed_from):
    """The name of a per-layer mix: ``mixed_layers`` of ``layers`` decoder layers (the first or the
    last, ``mixed_from``) run candidate ``choice``, the rest ``base``."""
    return f"{choice} on the {mixed_from} {mixed_layers} of {layers} layers, {base} on the rest"


def configure(model, candidate, modules, backend, tile_tokens, sequence_parallel=None, *, base=None,
              mixed_layers=None, mixed_from="first"):
    """Patches ``model`` with one of :data:`CANDIDATES` (and ``sequence_parallel``, a
    remat.sequence_parallel.SequenceGroup, or None); returns the PatchReport.

    With ``base`` (another candidate of the same prefetch) a per-layer mix: ``mixed_layers``
    decoder layers, the first or the last in forward order (``mixed_from``), run ``candidate``,
    the others ``base``. The fused loss is tiled when either is."""
    if base is None:
        layer_configs = None
        policy = candidate[1]
    else:
        if base[5] != candidate[5]:
            raise ValueError(f"{candidate[0]!r} and {base[0]!r} prefetch differently: the layers share one "
                             "HostOffload, so they cannot be mixed")
        if mixed_from not in ("first", "last"):
            raise ValueError(f"mixed_from must be 'first' or 'last', got {mixed_from!r}")
        names = [name for name, _ in decoder_layers(model)]
        if not (isinstance(mixed_layers, int) and 0 <= mixed_layers <= len(names)):
            raise ValueError(f"mixed_layers must be an int in [0, {len(names)}], got {mixed_layers!r}")
        chosen = range(mixed_layers) if mixed_from == "first" else range(len(names) - mixed_layers, len(names))
        layer_configs = {name: candidate if index in chosen else base for index, name in enumerate(names)}
        policy = {name: config[1] for name, config in layer_configs.items()}
    configs = [candidate] if layer_configs is None else layer_configs.values()
    offload = any(config[3] for config in configs)
    tile = tile_tokens if any(config[2] for config in configs) else None

    def finish(report):
        set_layer_options(model, report, offload=offload, tile_tokens=tile, prefetch=candidate[5],
                          sequence_parallel=sequence_parallel)
        for name, layer in fused_layers(model, report):
            _, _, tiled, offloaded, checkpointing, _ = candidate if layer_configs is None else layer_configs[name]
            layer.tile_tokens = tile_tokens if tiled else None
            if not offloaded:
                layer.__dict__.pop("_offload", None)  # the class default: no offload
            if checkpointing:
                layer.gradient_checkpointing = True

    return replace_modules(model, policy, modules, backend, finish=finish)


def plan_peak(model, *, seq_len, batch_size=1, budget_bytes, modules, backend=None, tile_tokens=None,
              optimizer=None, host_budget_bytes=None, sequence_parallel=None):
    """Estimates the candidates on ``model`` (patched and unpatched in turn; left unpatched) and
    returns the :class:`PeakPlan` of the first within ``budget_bytes``.

    Args:
        model: the model to patch (real weights on the CPU, or fake tensors: remat.planning.estimator).
        seq_len, batch_size: the step's shape (ints >= 1).
        budget_bytes: the device budget (int > 0).
        modules, backend: as for remat.patch.
        tile_tokens: the tile of the tiled candidates (default :data:`DEFAULT_TILE_TOKENS`, at most
            the step's tokens).
        optimizer: passed to remat.estimate (None or "adam").
        host_budget_bytes: None (any), or the most host bytes a candidate may hold (its estimated
            host peak); a candidate over it does not fit.
        sequence_parallel: None, or a remat.sequence_parallel.SequenceGroup of P ranks: the
            candidates are patched with it and each rank's step (seq_len / P tokens, a multiple
            of P required) is estimated; the budgets are per rank.

    Returns:
        :class:`PeakPlan`; ValueError when no candidate fits, naming the smallest peak (the floor).
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("budget_bytes", budget_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if host_budget_bytes is not None and (isinstance(host_budget_bytes, bool) or not isinstance(host_budget_bytes, int)
                                          or host_budget_bytes < 0):
        raise ValueError(f"host_budget_bytes must be None or an int >= 0, got {host_budget_bytes!r}")
    ranks = 1 if sequence_parallel is None else sequence_parallel.resolve()[1]
    if seq_len % ranks:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of the {ranks} ranks sharing it")
    shard = seq_len // ranks
    tile = min(tile_tokens or DEFAULT_TILE_TOKENS, shard * batch_size)
    tried = []

    def probe(candidate, **mix):
        """(the step's Estimate, its recompute FLOPs) under ``candidate`` (or a mix): the composed
        estimate, checked (remat.planning.composed) wherever the unchecked one fits or comes within
        :data:`CHECK_MARGIN` of a budget; a candidate far over them is rejected on the unchecked one."""
        configure(model, candidate, modules, backend, tile, sequence_parallel, **mix)
        try:
            kwargs = dict(seq_len=shard, batch_size=batch_size, optimizer=optimizer)
            with sparse_tiles():
                result = Composer(model).estimate(check=False, **kwargs)
            if fits(result, 1 + CHECK_MARGIN):
                result = estimate(model, **kwargs)
            flops = recompute_flops(model, batch_size, seq_len, ranks)
        finally:
            unpatch(model)
        return result, flops

    def fits(result, slack=1):
        host_fits = host_budget_bytes is None or result.host_bytes <= host_budget_bytes * slack
        return result.peak_bytes <= budget_bytes * slack and host_fits

    layers = len(decoder_layers(model))
    previous = None
    for candidate in CANDIDATES:
        result, flops = probe(candidate)
        tried.append((candidate[0], result.peak_bytes, result.host_bytes, flops))
        if fits(result):
            name, policy, tiled, offload, checkpointing, prefetch = candidate
            plan = PeakPlan(name, policy, tile if tiled else None, offload, checkpointing, prefetch,
                            result.peak_bytes, result.host_bytes, budget_bytes, seq_len, batch_size, tried,
                            host_budget_bytes, ranks, layers=layers)
            if previous is not None and previous[0][5] == prefetch and layers > 1:
                _search_mix(plan, candidate, previous, probe, fits)
            return plan
        previous = candidate, result
    floor = min(entry[1] for entry in tried)
    host = "" if host_budget_bytes is None else f" and {host_budget_bytes} host bytes"
    raise ValueError(f"no configuration fits {budget_bytes} bytes{host} for {batch_size} x {seq_len} tokens: the "
                     f"smallest predicted peak is {floor} bytes ({tried[-1][0]}, {tried[-1][2]} host bytes); raise "
                     "the budget to at least that or shorten the sequence")


def _search_mix(plan, candidate, previous, probe, fits):
    """Finds the fewest layers on ``candidate`` (the rest on ``previous``'s candidate, which did
    not fit) whose step fits, by probes (``probe(candidate, base=, mixed_layers=, mixed_from=)``
    returns an Estimate and the recompute FLOPs, ``fits`` says whether the Estimate is within the
    budgets); records every probe in
    ``plan.tried`` and, if a mix fits, sets it on ``plan``. Interpolates the peak between the
    bracket's ends for :data:`INTERPOLATED_PROBES` probes, then bisects."""
    base, base_result = previous
    layers = plan.layers
    mixed_from = "last" if candidate[1:] == (base[1], True, *base[3:]) and not base[2] else "first"
    low, low_peak = 0, base_result.peak_bytes  # does not fit
    high, high_peak, found = layers, plan.peak_bytes, None  # fits
    probes = 0
    while high - low > 1:
        # Interpolated on the device peak only where the bracket's low end is over the device
        # budget (it may fail the host budget alone, where the line says nothing).
        if probes < INTERPOLATED_PROBES and low_peak > plan.budget_bytes and low_peak > high_peak:
            # The smallest m on the line through the bracket's ends whose peak is within the budget.
            share = (low_peak - plan.budget_bytes) / (low_peak - high_peak)
            m = min(max(low + math.ceil((high - low) * share), low + 1), high - 1)
        else:
            m = (low + high) // 2
        probes += 1
        result, flops = probe(candidate, base=base, mixed_layers=m, mixed_from=mixed_from)
        plan.tried.append((mix_label(candidate[0], base[0], m, layers, mixed_from), result.peak_bytes,
                           result.host_bytes, flops))
        if fits(result):
            high, high_peak, found = m, result.peak_bytes, result
        else:
            low, low_peak = m, result.peak_bytes
    if found is not None:
        plan.base, plan.mixed_layers, plan.mixed_from = base[0], high, mixed_from
        plan.peak_bytes, plan.host_bytes = found.peak_bytes, found.host_bytes


def recompute_flops(model, batch_size, seq_len, ranks=1):
    """(FLOPs one training step of the patched ``model`` recomputes, FLOPs of its decoder layers'
    forward) per rank of ``ranks`` sharing ``batch_size`` sequences of ``seq_len`` tokens: per
    fused decoder layer, its policy's recompute (remat.planning.model_plan.layer_flops) plus its whole
    forward when it is checkpointed; None when a layer has no FLOP formula."""
    recomputed = forward_total = 0
    for layer in model.modules():
        if isinstance(layer, PreNormDecoderLayer):
            try:
                forward, recompute = layer_flops(layer, batch_size, seq_len)
            except ValueError:
                return None
            recomputed += recompute[layer.policy] + (forward if layer.gradient_checkpointing else 0)
            forward_total += forward
    # Under sequence parallelism each rank runs 1/P of the tokens' GEMMs and 1/P of the heads over
    # the whole sequence: 1/P of every term.
    return (recomputed / ranks, forward_total / ranks) if forward_total else None


def install(model, plan, modules, backend, sequence_parallel=None):
    """Patches ``model`` with the plan's configuration (and ``sequence_parallel``, as planned);
    returns the PatchReport (plan on ``report.plan``)."""
    candidate = next(c for c in CANDIDATES if c[0] == plan.choice)
    mix = {}
    if plan.base is not None:
        mix = dict(base=next(c for c in CANDIDATES if c[0] == plan.base), mixed_layers=plan.mixed_layers,
                   mixed_from=plan.mixed_from)
    report = configure(model, candidate, modules, backend, plan.tile_tokens, sequence_parallel, **mix)
    report.plan = plan
    return report
