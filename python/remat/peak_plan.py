"""A plan that bounds the device peak of a training step: ``remat.patch(model, policy="auto",
budget_bytes=B, seq_len=N)``.

The candidates are whole-model configurations in the order of their expected step time, the
cheapest first, and the plan is the first whose peak, predicted by ``remat.estimate`` for a step
of ``batch_size`` sequences of ``seq_len`` tokens (parameters, trainable gradients, what is kept,
the largest backward working set, the loss), is within the budget:

1. ``speed``: no GEMM recomputed;
2. ``balanced``: the MLP's gate/up GEMMs recomputed;
3. ``memory``: the q/k/v projections too;
4. ``memory`` with the gated MLP and the attention sub-block tiled along the sequence (no FLOPs
   added: the attention backward runs per query tile, each tile recomputing its own q);
5. the same with what each layer keeps offloaded to host memory (copies that a GPU overlaps with
   compute: not measured yet);
6. the same with each layer checkpointed (it keeps its input, offloaded, and re-runs its forward
   in backward: one more forward's FLOPs);
7. the same without prefetch: a layer's input comes back when its backward starts, not one layer
   ahead (one layer's input on the device instead of two; compute waits for that copy).

Every layer gets the same configuration: a per-layer mix (some layers offloaded or checkpointed,
others not) is not searched yet. A budget below the last candidate's peak raises ValueError naming
that floor.
"""

import dataclasses

from remat.estimator import estimate
from remat.replacement import replace_modules, set_layer_options, unpatch

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
# Tokens per tile: [8192, 14336] bf16 MLP temporaries are 224 MiB each, GEMMs that still fill a GPU,
# and a query tile of 8192 keeps the attention backward's calls large.
DEFAULT_TILE_TOKENS = 8192


@dataclasses.dataclass
class PeakPlan:
    """The configuration chosen and what was predicted.

    Attributes:
        choice: the candidate's name (see the module docstring).
        policy, tile_tokens, offload, checkpointing, prefetch: what it sets on the layers.
        peak_bytes, host_bytes: the estimate of the chosen configuration's step.
        budget_bytes: the device budget; host_budget_bytes: the host budget (None: any).
        tried: (name, peak_bytes, host_bytes) of every candidate estimated, in order.
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

    def explain(self):
        """The plan in words: the predicted device peak and host bytes per candidate and why this
        one (the cheapest that fits)."""
        gib = 2**30
        shards = "" if self.ranks == 1 else f" over {self.ranks} ranks (per-rank peaks)"
        lines = [f"remat peak plan for {self.batch_size} x {self.seq_len} tokens{shards}, device budget "
                 f"{self.budget_bytes / gib:.2f} GiB: {self.choice} (the cheapest candidate within it)"]
        for name, peak, host in self.tried:
            over = peak > self.budget_bytes or (self.host_budget_bytes is not None and host > self.host_budget_bytes)
            mark = "<- chosen" if name == self.choice else ("over budget" if over else "")
            lines.append(f"  {name:<48} device peak {peak / gib:8.2f} GiB  host {host / gib:8.2f} GiB  {mark}")
        lines.append("  cost order: recompute grows down the list (speed: none; balanced: MLP gate/up GEMMs; memory: "
                     "+ q/k/v; checkpointed: + the layer's forward); tiling adds none; offload adds host copies "
                     "(overlapped on a GPU, not measured; without prefetch compute waits for each layer's copy)")
        return "\n".join(lines)


def configure(model, candidate, modules, backend, tile_tokens, sequence_parallel=None):
    """Patches ``model`` with one of :data:`CANDIDATES` (and ``sequence_parallel``, a
    remat.sequence_parallel.SequenceGroup, or None); returns the PatchReport."""
    _, policy, tiled, offload, checkpointing, prefetch = candidate
    tile = tile_tokens if tiled else None

    def finish(report):
        set_layer_options(model, report, offload=offload, tile_tokens=tile, checkpointing=checkpointing,
                          prefetch=prefetch, sequence_parallel=sequence_parallel)

    return replace_modules(model, policy, modules, backend, finish=finish)


def plan_peak(model, *, seq_len, batch_size=1, budget_bytes, modules, backend=None, tile_tokens=None,
              optimizer=None, host_budget_bytes=None, sequence_parallel=None):
    """Estimates the candidates on ``model`` (patched and unpatched in turn; left unpatched) and
    returns the :class:`PeakPlan` of the first within ``budget_bytes``.

    Args:
        model: the model to patch (real weights on the CPU, or fake tensors: remat.estimator).
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
    for candidate in CANDIDATES:
        configure(model, candidate, modules, backend, tile, sequence_parallel)
        try:
            result = estimate(model, seq_len=shard, batch_size=batch_size, optimizer=optimizer)
        finally:
            unpatch(model)
        tried.append((candidate[0], result.peak_bytes, result.host_bytes))
        if result.peak_bytes <= budget_bytes and (host_budget_bytes is None or result.host_bytes <= host_budget_bytes):
            name, policy, tiled, offload, checkpointing, prefetch = candidate
            return PeakPlan(name, policy, tile if tiled else None, offload, checkpointing, prefetch,
                            result.peak_bytes, result.host_bytes, budget_bytes, seq_len, batch_size, tried,
                            host_budget_bytes, ranks)
    floor = min(peak for _, peak, _ in tried)
    host = "" if host_budget_bytes is None else f" and {host_budget_bytes} host bytes"
    raise ValueError(f"no configuration fits {budget_bytes} bytes{host} for {batch_size} x {seq_len} tokens: the "
                     f"smallest predicted peak is {floor} bytes ({tried[-1][0]}, {tried[-1][2]} host bytes); raise "
                     "the budget to at least that or shorten the sequence")


def install(model, plan, modules, backend, sequence_parallel=None):
    """Patches ``model`` with the plan's configuration (and ``sequence_parallel``, as planned);
    returns the PatchReport (plan on ``report.plan``)."""
    candidate = next(c for c in CANDIDATES if c[0] == plan.choice)
    report = configure(model, candidate, modules, backend, plan.tile_tokens, sequence_parallel)
    report.plan = plan
    return report
