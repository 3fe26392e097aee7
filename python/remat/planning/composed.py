"""The step's memory in seconds: ``remat.estimate`` composed from a few layers.

The full simulation (:func:`remat.planning.estimator.estimate`, ``remat.estimate(..., exact=True)``) runs
every layer of the model over every tile of the sequence on fake tensors: exact, and for
Llama-3.1-8B at a million tokens a quarter of an hour on this project's 2-core machine. Two facts
make most of that work a repetition:

1. **Tiles repeat.** Every tiled loop (the MLP, the attention sub-block, the fused loss) allocates
   its whole-sequence tensors before its first tile and holds a per-tile working set that is the
   same in every tile or grows with the tile's place (the causal attention's keys), so the most
   bytes alive are reached in a loop's first or last tiles. Under
   :func:`remat.autograd.common.sparse_tiles` a loop runs those alone: the same peak, the same host
   bytes, in a time that does not grow with the sequence.
2. **Layers repeat.** Decoder layers of the same configuration (class, options, parameter shapes,
   attention type: :func:`layer_signature`) hold the same bytes at the same moments of their forward
   and backward. Every quantity of the step (each phase's peak, the host peak, the bytes after the
   forward) is then affine in the number of layers of each repeated run: the composed estimate
   simulates the model cut to 3 repetitions of each run (a *view*: the same layer objects, fewer of
   them, the config's layer count and layer types cut to match, offload indices renumbered), once
   more with each run at 4, and extrapolates each quantity to the model's counts. A last
   simulation, every run at 5, checks the extrapolation: where any quantity misses it by more than
   :data:`TOLERANCE`, the estimate falls back to simulating every layer (and says so in
   :attr:`Estimate.method`).

Runs may be periodic (Gemma 2's alternating sliding and global layers repeat a pattern of 2; a
per-layer plan's offloaded first layers and kept last layers are two runs). A model whose decoder
layers are not one ``nn.ModuleList`` (or that takes ``inputs`` of its own) is simulated whole,
with sparse tiles.
"""

import contextlib
import dataclasses

import torch

from remat.autograd.common import sparse_tiles
from remat.planning.estimator import Estimate, _check_estimate_arguments
from remat.planning.estimator import estimate as simulate

# Repetitions of each run in the base view; one more in each run's step view; two more to check.
# Three, so that a run's first unit, its last and the units next to them are its own (the first
# layer of a run fetches no earlier offloaded layer; the last follows the loss's backward): the
# units between them change by the same bytes one to the next.
BASE_REPEATS = 3
# Longest repeating pattern of layer configurations looked for (Gemma 3: 5 local + 1 global).
MAX_PERIOD = 8
# The largest miss, as a share of the checked quantity, of the extrapolation at the check view
# (the composition is exact where its premise holds: every miss seen was 0 bytes or a regime change).
TOLERANCE = 1e-4
# Attributes that only number a layer (its place), not configure it.
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_index", "_offload_index", "layer_id"})


def estimate(model, *, seq_len, batch_size=1, optimizer=None, inputs=None, walk=None, cuda_capability=(9, 0),
             optimizer_shards=1, exact=False):
    """Predicts the device (and host) memory of one training step of ``model`` in seconds:
    composed from a few repeated layers and the first and last tiles of each tiled loop (module
    docstring); with ``exact=True``, the full simulation of every layer and tile
    (:func:`remat.planning.estimator.estimate`, the reference the composed estimate is tested
    against; minutes at long context).

    Args:
        model: an ``nn.Module`` on one device: a Hugging Face causal LM (patched or not) with real
            weights on the CPU, or built on fake tensors (``on_fake_device``, fake CUDA for a GPU).
        seq_len, batch_size: the step's ``[batch_size, seq_len]`` token ids (ints >= 1; default
            batch 1); one rank's shard under sequence parallelism.
        optimizer, optimizer_shards: None (default) or ``"adam"``: fp32 Adam states of the trainable
            parameters, partitioned over ``optimizer_shards`` ranks (default 1).
        inputs: the forward's keyword arguments instead of the default ones (then the whole model
            is simulated, with sparse tiles).
        walk, cuda_capability: as for :func:`remat.planning.estimator.estimate`.
        exact: False (default): composed; True: every layer and tile simulated.

    Returns:
        :class:`remat.planning.estimator.Estimate`; its ``method`` says how it was reached ("composed from
        3, 4 of 32 layers ..., checked at 5 layers", "simulated whole: ...").
    """
    _check_estimate_arguments(model, seq_len, batch_size, optimizer, inputs, optimizer_shards)
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
    kwargs = dict(seq_len=seq_len, batch_size=batch_size, optimizer=optimizer, inputs=inputs, walk=walk,
                  cuda_capability=cuda_capability, optimizer_shards=optimizer_shards)
    if exact:
        result = simulate(model, **kwargs)
        result.method = "simulated whole (exact)"
        return result
    with sparse_tiles():
        if inputs is not None:
            return _whole(model, kwargs, "simulated whole: the step's inputs are the caller's")
        return Composer(model).estimate(**kwargs)


def _whole(model, kwargs, why):
    result = simulate(model, **kwargs)
    result.method = why
    return result


def layer_signature(layer):
    """A hashable description of a decoder layer's configuration: per submodule its class, its
    plain attributes (numbers, strings, flags; any other object by its class name), the shapes,
    dtypes and ``requires_grad`` of its parameters, its buffers and its hook counts. Attributes that
    only number the layer (``layer_idx``, the offload index) are left out, so layers that differ
    only in their place compare equal."""
    parts = []
    for name, module in layer.named_modules():
        attributes = []
        for key, value in vars(module).items():
            if key in _INDEX_ATTRIBUTES or key in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(value, dict) and key.endswith("hooks"):
                attributes.append((key, len(value)))
            else:
                attributes.append((key, _plain(value)))
        params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                       for n, p in module._parameters.items() if p is not None)
        buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module._buffers.items() if b is not None)
        parts.append((name, type(module).__qualname__, tuple(sorted(attributes, key=lambda a: a[0])), params, buffers))
    return tuple(parts)


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and len(value) <= 16:
        return tuple(_plain(v) for v in value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return type(value).__qualname__


def segments(keys, max_period=MAX_PERIOD):
    """The layer sequence ``keys`` as runs: [(start, period, repeats)], each a pattern of
    ``period`` consecutive layers repeated ``repeats`` times from ``start``, covering the sequence
    in order. Greedy: at each place the pattern covering the most layers (the shortest on a tie)."""
    runs, start = [], 0
    while start < len(keys):
        best = (1, 1)
        for period in range(1, min(max_period, len(keys) - start) + 1):
            pattern = keys[start:start + period]
            repeats = 1
            while keys[start + repeats * period:start + (repeats + 1) * period] == pattern:
                repeats += 1
            if repeats > 1 and period * repeats > best[0] * best[1]:
                best = (period, repeats)
        runs.append((start, *best))
        start += best[0] * best[1]
    return runs


@dataclasses.dataclass
class _Layers:
    """Where the decoder layers live: ``owner._modules[attribute]`` is their ModuleList."""

    owner: torch.nn.Module
    attribute: str
    layers: torch.nn.ModuleList


def _layer_count_keys(config):
    """The attribute names under which ``config`` holds its number of decoder layers
    (``num_hidden_layers``, or what its ``attribute_map`` maps it to: GPT-2's ``n_layer``)."""
    mapped = getattr(config, "attribute_map", {}).get("num_hidden_layers")
    return {"num_hidden_layers", *([mapped] if mapped else [])}


def _configs(model):
    """{id: config} of the Hugging Face configs the model's modules hold."""
    return {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
            and hasattr(c, "num_hidden_layers")}


def _find_layers(model):
    """The one ``nn.ModuleList`` holding every decoder layer: those remat's family table knows
    (stock or fused), else a list as long as the model config's layer count (a family remat does
    not patch); None when there is no such list."""
    from remat.nn.layers import PreNormDecoderLayer
    from remat.planning.model_plan import decoder_layers

    named = dict(model.named_modules())
    found = {id(m) for _, m in decoder_layers(model)}
    found |= {id(m) for m in named.values() if isinstance(m, PreNormDecoderLayer)}
    counts = {c.num_hidden_layers for c in _configs(model).values()}
    for name, module in named.items():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if ({id(m) for m in module} == found) if found else (len(module) in counts):
            owner_name, _, attribute = name.rpartition(".")
            return _Layers(named[owner_name], attribute, module)
    return None


class Composer:
    """The composed estimate of one model (module docstring); holds the model's runs of alike
    layers and the views' simulations, so that repeated estimates (a search over lengths, a checked
    estimate after an unchecked one at the same length) find them once. The model must not change
    while a Composer is in use."""

    def __init__(self, model):
        self.model = model
        self.where = _find_layers(model)
        self._simulations = {}  # (run counts, estimate arguments) -> Estimate of that view
        self.runs = None
        if self.where is not None:
            keys = [layer_signature(layer) for layer in self.where.layers]
            index = {}
            self.runs = segments([index.setdefault(key, len(index)) for key in keys])

    @property
    def layers(self):
        return 0 if self.where is None else len(self.where.layers)

    def estimate(self, *, check=True, **kwargs):
        """The composed :class:`Estimate` of a step (``kwargs`` as :func:`estimate`'s, ``inputs``
        None); with ``check=False`` the check view is not simulated (a search's inner probes; the
        caller checks the answer it keeps)."""
        with sparse_tiles():
            return self._estimate(check, kwargs)

    def _estimate(self, check, kwargs):
        if self.where is None:
            return _whole(self.model, kwargs, "simulated whole: no single list of decoder layers to compose")
        repeated = [j for j, (_, _, repeats) in enumerate(self.runs) if repeats > BASE_REPEATS + 2]
        counts = [min(repeats, BASE_REPEATS) if j in repeated else repeats for j, (_, _, repeats) in
                  enumerate(self.runs)]
        check_counts = [c + 2 if j in repeated else c for j, c in enumerate(counts)]
        if not repeated or self._size(check_counts) >= self.layers:
            return _whole(self.model, kwargs, f"simulated whole: no run of alike layers repeats often enough "
                                              f"to shorten ({len(self.runs)} run(s) in {self.layers} layers)")
        base = self._simulate(counts, kwargs)
        steps = {}
        for j in repeated:
            bumped = list(counts)
            bumped[j] += 1
            steps[j] = self._simulate(bumped, kwargs)
        full = [repeats for _, _, repeats in self.runs]
        result = _combine(base, steps, counts, full)
        sizes = sorted({self._size(counts), *(self._size(counts) + self.runs[j][1] for j in repeated)})
        result.method = (f"composed from {', '.join(map(str, sizes))} of {self.layers} layers "
                         f"({len(repeated)} repeated run{'s' if len(repeated) > 1 else ''}), first and last tiles")
        if check:
            checked = self._simulate(check_counts, kwargs)
            predicted = _combine(base, steps, counts, check_counts)
            miss = _miss(predicted, checked)
            if miss is not None:
                whole = _whole(self.model, kwargs, f"simulated whole: the composition missed the check view "
                                                   f"({miss})")
                return whole
            result.method += f", checked at {self._size(check_counts)} layers"
        return result

    def _size(self, counts):
        return sum(period * count for (_, period, _), count in zip(self.runs, counts, strict=True))

    def _indices(self, counts):
        indices = []
        for (start, period, _), count in zip(self.runs, counts, strict=True):
            indices.extend(range(start, start + period * count))
        return indices

    def _simulate(self, counts, kwargs):
        key = (tuple(counts), tuple(sorted(kwargs.items())))
        if key not in self._simulations:
            with _view(self.model, self.where, self._indices(counts)):
                layers = list(self.where.owner._modules[self.where.attribute])
                result = simulate(self.model, segments=layers, **kwargs)
            result.classes = self._classes(result, counts)
            self._simulations[key] = result
        return self._simulations[key]

    def _classes(self, result, counts):
        """{class: the most bytes alive in it} of a view's simulation at run ``counts``: per phase
        "before" and "after" the layers, and per run the units (one repetition of its pattern) whose
        level is not the affine interpolation of others: a repeated run's first two and last two
        units (between them the bytes alive change by the same amount from one unit to the next, so
        the most are at one of those ends), every unit of a run kept whole. None when the segments do not
        account for a phase's peak (then the composition extrapolates the phase peaks alone)."""
        peaks = result.segment_peaks
        if not peaks:
            return None
        classes, place = {}, 0
        for j, ((_, period, repeats), count) in enumerate(zip(self.runs, counts, strict=True)):
            repeated = repeats > BASE_REPEATS + 2
            for unit in range(count):
                if repeated:  # the first two and the last two units (one unit may be both)
                    labels = [label for label, at in (("first", 0), ("second", 1), ("second to last", count - 2),
                                                      ("last", count - 1)) if at == unit]
                else:
                    labels = [unit]
                for phase in result.phases:
                    level = max(peaks.get((phase, p), 0) for p in range(place, place + period))
                    for label in labels:
                        classes[(phase, j, label)] = level
                place += period
        for phase in result.phases:
            for side in ("before", "after"):
                classes[(phase, side)] = peaks.get((phase, side), 0)
        segmented = {phase: max(v for (p, *_), v in peaks.items() if p == phase) for phase in result.phases
                     if any(p == phase for p, *_ in peaks)}
        if segmented != result.phases:
            return None
        return classes


@contextlib.contextmanager
def _view(model, where, indices):
    """The model with only the decoder layers ``indices`` (in order) for the block: their list,
    every config's ``num_hidden_layers`` and per-layer lists (``layer_types``) cut to match, and
    the offload indices of fused layers renumbered in forward order; all put back after."""
    full = where.layers
    count = len(full)
    restore = []
    configs = _configs(model)
    try:
        where.owner._modules[where.attribute] = torch.nn.ModuleList([full[i] for i in indices])
        restore.append(lambda: where.owner._modules.__setitem__(where.attribute, full))
        for config in configs.values():
            count_keys = _layer_count_keys(config)
            for key, value in list(vars(config).items()):
                if key in count_keys and value == count:
                    restore.append(lambda c=config, k=key, v=value: setattr(c, k, v))
                    setattr(config, key, len(indices))
                elif isinstance(value, list) and len(value) == count and key.startswith("layer_"):
                    restore.append(lambda c=config, k=key, v=value: setattr(c, k, v))
                    setattr(config, key, [value[i] for i in indices])
        position = 0
        for i in indices:
            layer = full[i]
            if "_offload" in vars(layer):
                old_index = vars(layer).get("_offload_index")
                restore.append(lambda m=layer, v=old_index: _set_index(m, v))
                layer._offload_index = position
                position += 1
        yield
    finally:
        for undo in reversed(restore):
            undo()


def _set_index(layer, value):
    if value is None:
        vars(layer).pop("_offload_index", None)
    else:
        layer._offload_index = value


def _extrapolated(base, steps, counts, target, read):
    value = read(base)
    for j, step in steps.items():
        value += (target[j] - counts[j]) * (read(step) - read(base))
    return value


def _combine(base, steps, counts, target):
    """The Estimate at run counts ``target``: each quantity of ``base`` (at ``counts``) plus, per
    repeated run j, (target - count) times its change in ``steps[j]`` (run j one repetition
    longer). A phase's peak is the most of its classes' so extrapolated (Composer._classes: the
    bytes alive where the peak may fall, each affine in the run counts, while their maximum need
    not be: a per-layer mix's peak moves between runs as they lengthen), or, where the simulations
    have no classes, the phase peak extrapolated itself."""
    sims = [base, *steps.values()]
    if all(getattr(e, "classes", None) for e in sims) and all(e.classes.keys() == base.classes.keys() for e in sims):
        levels = {key: _extrapolated(base, steps, counts, target, lambda e, k=key: e.classes[k])
                  for key in base.classes}
        phases = {phase: max(v for (p, *_), v in levels.items() if p == phase) for phase in base.phases}
    else:
        phases = {phase: _extrapolated(base, steps, counts, target, lambda e, p=phase: e.phases.get(p, 0))
                  for phase in base.phases}
    peak_phase = max(phases, key=phases.get)
    peak = max(phases.values())
    breakdown = {kind: _extrapolated(base, steps, counts, target, lambda e, k=kind: e.breakdown.get(k, 0))
                 for kind in base.breakdown}
    return Estimate(peak_bytes=peak, host_bytes=_extrapolated(base, steps, counts, target, lambda e: e.host_bytes),
                    phases=phases, breakdown=breakdown, peak_phase=peak_phase, device=base.device, tokens=base.tokens,
                    after_forward_bytes=_extrapolated(base, steps, counts, target, lambda e: e.after_forward_bytes),
                    assumptions=tuple(sorted(set(base.assumptions).union(*(s.assumptions for s in steps.values())))))


def _miss(predicted, checked):
    """None when the prediction matches the simulation within TOLERANCE on every quantity, else
    what missed."""
    pairs = [("peak", predicted.peak_bytes, checked.peak_bytes), ("host", predicted.host_bytes, checked.host_bytes),
             ("after forward", predicted.after_forward_bytes, checked.after_forward_bytes)]
    pairs += [(f"{phase} peak", predicted.phases.get(phase, 0), value) for phase, value in checked.phases.items()]
    for name, guess, truth in pairs:
        if abs(guess - truth) > TOLERANCE * max(abs(truth), 1):
            return f"{name}: {guess} predicted, {truth} simulated"
    return None
