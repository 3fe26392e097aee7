"""Timing, environment tags, CSV and plot output shared by the benchmarks (DESIGN.md section 8)."""

import csv
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from remat import backend as backend_mod

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def environment_tags():
    """Device name, versions, commit, date and the 1-minute load average now (``load_1min_start``;
    call at the start of a benchmark, and ``with_end_load`` at its end) that tag every CSV row."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(RESULTS_DIR), check=True).stdout.strip()
        # Result files written by this run do not make the code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                ":(top,exclude)benchmarks/results"], capture_output=True, text=True,
                               cwd=os.path.dirname(RESULTS_DIR)).stdout.strip()
        commit += "-dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        # The vector ISA and whether oneDNN has native bf16 GEMMs: CPUs of one name differ in both,
        # and 16-bit CPU times (and remat's CPU attention default) depend on them.
        bf16 = "native bf16 GEMM" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no native bf16 GEMM"
        device = (f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads, "
                  f"{torch.backends.cpu.get_cpu_capability()}, {bf16})")
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "",
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load_1min_start": load_average(),
    }


def load_average():
    """The 1-minute load average of the machine (os.getloadavg; "" where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return ""


def with_end_load(rows):
    """Adds ``load_1min_end`` (the 1-minute load average now, at the end of the benchmark) to every
    row and returns them; with ``load_1min_start`` from environment_tags a reader sees whether
    the machine was busy while the rows were measured."""
    end = load_average()
    for row in rows:
        row["load_1min_end"] = end
    return rows


def remat_backends(device, attention=False):
    """The remat backends that run ``device``'s tensors in a benchmark: each of BACKENDS that is
    available there, without Triton on the CPU (only its interpreter runs there, far too slow to
    time) and without the PyTorch attention cores ("aten", "cudnn") unless ``attention`` (they have
    attention operators only)."""
    return [name for name in backend_mod.BACKENDS
            if backend_mod.unavailable_reason(name, device) is None
            and not (name == "triton" and device.type == "cpu")
            and (attention or name not in ("aten", "cudnn"))]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Step(NamedTuple):
    """One provider's step, in the parts the harness times (``interleaved_timings``).

    forward(): the forward pass that builds the autograd graph; returns what ``backward`` needs.
    backward(state): the rest of the step after the forward (the backward pass, and for a training
        step whatever follows it: clipping, the optimizer).
    inference(): the forward pass alone without a graph (under torch.no_grad), or None where the
        benchmark has no forward-only mode.
    """

    forward: Callable[[], Any]
    backward: Callable[[Any], Any]
    inference: Callable[[], Any] | None = None


def autograd_step(fn, args, leaves, output_grad):
    """The Step of an operator or layer call ``fn(*args)``: forward calls it with the autograd
    graph and returns its output(s); backward is ``torch.autograd.grad`` of the output(s) (every
    element of a tuple output) to ``leaves``, each output's gradient ``output_grad`` (same shape);
    inference calls it under torch.no_grad."""

    def forward():
        return fn(*args)

    def backward(out):
        outs = tuple(out) if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(outs, leaves, [output_grad] * len(outs))

    def inference():
        with torch.no_grad():
            return fn(*args)

    return Step(forward, backward, inference)


def loss_step(model, inputs):
    """The Step of one training step of ``model(**inputs)``, a model that returns ``.loss`` (a
    Hugging Face model given labels): forward zeroes the gradients (set to None) and returns the
    loss, backward runs ``loss.backward()``; inference is the forward under torch.no_grad."""

    def forward():
        model.zero_grad(set_to_none=True)
        return model(**inputs).loss

    def inference():
        with torch.no_grad():
            return model(**inputs).loss

    return Step(forward, torch.Tensor.backward, inference)


def _timed(device, fn, *args):
    """(milliseconds, host milliseconds, result) of one ``fn(*args)``, the device synchronized
    before and after: the host time runs until ``fn`` returned, before the final synchronize (on a
    GPU the time to enqueue the work; on the CPU, which runs it synchronously, the whole time)."""
    _sync(device)
    start = time.perf_counter()
    result = fn(*args)
    returned = time.perf_counter()
    _sync(device)
    return (time.perf_counter() - start) * 1e3, (returned - start) * 1e3, result


def run_step(step):
    """One whole step of ``step`` (a Step): its backward on its forward's result."""
    return step.backward(step.forward())


def _time_step(step, device, out, split_first):
    """Appends one round's times of ``step`` (a Step) to ``out`` (mode -> list of ms); on a GPU
    also "backward_host", the host time of the backward timed apart (``_timed``)."""
    if step.inference is not None:
        out.setdefault("forward", []).append(_timed(device, step.inference)[0])
    for part in ("split", "full") if split_first else ("full", "split"):
        if part == "full":
            out.setdefault("full", []).append(_timed(device, run_step, step)[0])
        else:
            forward_ms, _, state = _timed(device, step.forward)
            backward_ms, backward_host_ms, _ = _timed(device, step.backward, state)
            del state
            out.setdefault("forward_graph", []).append(forward_ms)
            out.setdefault("backward", []).append(backward_ms)
            if device.type == "cuda":
                out.setdefault("backward_host", []).append(backward_host_ms)


def interleaved_timings(steps, device, *, rounds, warmup=1, after_round=None):
    """Times every provider of ``steps`` (name -> Step, or a plain callable that runs one full
    step) side by side in interleaved rounds (DESIGN.md section 8); returns name -> mode -> list of
    times in milliseconds, one per round.

    First ``warmup`` untimed calls of every provider (inference and full step: compiles and
    allocator growth happen here; the benchmarks have run each step once before, to measure its
    memory, so one is enough). Then each of ``rounds`` rounds times every provider once, the
    order rotated by one place every round (A B C, B C A, C A B, ...); for a provider it times:
      "forward"        its inference() (Steps with one only),
      "forward_graph"  its forward() and "backward" its backward(state), as two timed calls,
      "full"           backward(forward()) as one timed call (a plain callable: this mode only),
      "backward_host"  on a GPU, the host time of the backward timed apart (``_timed``),
    the split step and the whole step alternating which goes first (an even number of rounds gives
    each order equally often: the first after another provider's step may find colder caches). Load
    that drifts over seconds
    thus falls on every provider and mode of a round alike, and the per-round ratios
    (``timing_summary``) compare times taken seconds apart. Wall-clock time (perf_counter), the
    device synchronized around each call, so a GPU time includes its launches. ``after_round(k)``,
    if given, runs untimed after round k (progress output).
    """
    if not steps:
        raise ValueError("interleaved_timings needs at least one provider")
    if rounds < 2:
        raise ValueError(f"rounds must be at least 2 for a spread, got {rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for name, step in steps.items():
        if not isinstance(step, Step) and not callable(step):
            raise TypeError(f"provider {name!r} is neither a Step nor callable: {type(step).__name__}")
    for _ in range(warmup):
        for step in steps.values():
            if not isinstance(step, Step):
                step()
                continue
            if step.inference is not None:
                step.inference()
            run_step(step)
    _sync(device)
    times = {name: {} for name in steps}
    names = list(steps)
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            if isinstance(steps[name], Step):
                _time_step(steps[name], device, times[name], split_first=k % 2 == 0)
            else:
                times[name].setdefault("full", []).append(_timed(device, steps[name])[0])
        if after_round is not None:
            after_round(k)
    return times


# A full step timed as one call may measure up to this fraction under its forward and backward
# timed apart without being flagged: the split pays an extra timer read and synchronize between
# the halves, and keeps the graph alive across them.
FULL_STEP_TOLERANCE = 0.05


def median_band(values):
    """(median, 20% quantile, 80% quantile) of at least two values."""
    if len(values) < 2:
        raise ValueError(f"a spread needs at least two values, got {len(values)}")
    q = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), q[1], q[7]


def _round_ratios(numerators, denominators):
    """Per-round ratios of two equally long lists of per-round times."""
    return [n / d for n, d in zip(numerators, denominators, strict=True)]


def _full_vs_parts(modes):
    """Per round: the whole step's time over its forward plus backward timed apart."""
    return _round_ratios(modes["full"], [g + b for g, b in zip(modes["forward_graph"], modes["backward"], strict=True)])


def _overlap_floor(modes):
    """Per round: the lowest full / (forward + backward timed apart) that launch overlap alone
    explains on a GPU, 1 - min(backward host time, forward time) / (forward + backward).

    Why: timed apart, the backward starts on an idle, synchronized GPU, which waits while the host
    enqueues the backward (autograd, remat's Functions, the launches); in the whole step the host
    enqueues the backward while the GPU still runs the forward, so up to the backward's host time,
    and at most the forward's length, is hidden. A full step above this floor is explained by that
    overlap; one below it is not."""
    return [1.0 - min(h, g) / (g + b)
            for h, g, b in zip(modes["backward_host"], modes["forward_graph"], modes["backward"], strict=True)]


def verdict(q20, q80):
    """What a time ratio's 20-80% band claims: "faster" (entirely below 1), "slower" (entirely
    above 1) or "inconclusive" (it contains 1: the effect is not resolved by the measurement)."""
    if q80 < 1.0:
        return "faster"
    if q20 > 1.0:
        return "slower"
    return "inconclusive"


def suspect_reasons(modes, tolerance=FULL_STEP_TOLERANCE):
    """Why one provider's times (mode -> per-round ms, as ``interleaved_timings`` returns) cannot
    be right, "" if nothing is wrong: its full step measured faster than its own forward alone
    (the 20-80% band of the per-round ratio full / forward entirely below 1), or faster than its
    forward plus backward timed apart beyond ``tolerance`` (band of full / (forward_graph +
    backward) entirely below 1 - tolerance)."""
    reasons = []
    if "full" in modes and "forward" in modes:
        median, q20, q80 = median_band(_round_ratios(modes["full"], modes["forward"]))
        if q80 < 1.0:
            reasons.append(f"full step faster than its forward alone (full/forward {median:.3f} "
                           f"[{q20:.3f}, {q80:.3f}])")
    if "full" in modes and "backward" in modes:
        median, q20, q80 = median_band(_full_vs_parts(modes))
        if q80 < 1.0 - tolerance:
            reason = (f"full step faster than its forward plus backward timed apart "
                      f"(full/(forward+backward) {median:.3f} [{q20:.3f}, {q80:.3f}])")
            if "backward_host" in modes:
                floor, floor_q20, floor_q80 = median_band(_overlap_floor(modes))
                within = "within" if median >= floor - tolerance else "beyond"
                reason += (f", {within} what the backward's host time overlapping the forward explains "
                           f"(overlap floor {floor:.3f} [{floor_q20:.3f}, {floor_q80:.3f}])")
            reasons.append(reason)
    return "; ".join(reasons)


REPORTED_MODES = ("forward", "backward", "full")

# The baselines of an operator benchmark (label -> provider): its time_vs_<label> columns divide a
# provider's time by that provider's in the same round; one not in the run leaves its columns "".
OPERATOR_BASELINES = {"eager": "torch", "checkpoint": "torch+checkpoint", "compile": "torch.compile",
                      "liger": "liger"}


def timing_summary(times, baselines, case=""):
    """The CSV columns of every provider and mode measured by ``interleaved_timings``: returns
    (name, mode) -> columns, for the modes "forward", "backward" and "full" each provider has.

    Columns: ``rounds``; ``time_vs_<label>`` for each ``label -> baseline provider`` of
    ``baselines`` (the median over rounds of this provider's time divided by the baseline's time in
    the same round), with ``time_vs_<label>_q20`` / ``_q80`` (the 20% / 80% quantiles of those
    ratios) and ``time_vs_<label>_verdict`` ("faster", "slower", "inconclusive" where the band
    contains 1, "baseline" on the baseline's own rows; every column "" where the baseline was not
    measured); ``full_vs_parts`` (median, ``_q20``, ``_q80``: full step / (forward + backward
    timed apart), "full" rows only); ``full_vs_parts_overlap_floor`` (on a GPU, "full" rows: the
    median of ``_overlap_floor``, the lowest full_vs_parts that the backward's launches overlapping
    the forward explain; "" on the CPU, which runs synchronously); ``suspect`` (``suspect_reasons``,
    on every row of a provider whose times cannot be right: a warning naming ``case`` goes to
    stderr); the absolute times
    ``median_ms``, ``q20_ms``, ``q80_ms``, secondary (they move with the machine's load, the
    ratios much less)."""
    out = {}
    for name, modes in times.items():
        suspect = suspect_reasons(modes)
        if suspect:
            rounds = len(next(iter(modes.values())))
            print(f"WARNING: {case} {name}: suspect measurement over {rounds} rounds: {suspect}", file=sys.stderr,
                  flush=True)
        for mode in REPORTED_MODES:
            if mode not in modes:
                continue
            columns = {"rounds": len(modes[mode])}
            for label, baseline in baselines.items():
                key = f"time_vs_{label}"
                if baseline not in times or mode not in times[baseline]:
                    columns.update({key: "", f"{key}_q20": "", f"{key}_q80": "", f"{key}_verdict": ""})
                    continue
                median, q20, q80 = median_band(_round_ratios(modes[mode], times[baseline][mode]))
                columns.update({key: median, f"{key}_q20": q20, f"{key}_q80": q80,
                                f"{key}_verdict": "baseline" if name == baseline else verdict(q20, q80)})
            ratio = median_band(_full_vs_parts(modes)) if mode == "full" and "backward" in modes else ("", "", "")
            columns.update(zip(("full_vs_parts", "full_vs_parts_q20", "full_vs_parts_q80"), ratio))
            columns["full_vs_parts_overlap_floor"] = (
                statistics.median(_overlap_floor(modes)) if mode == "full" and "backward_host" in modes else "")
            columns["suspect"] = suspect
            columns.update(zip(("median_ms", "q20_ms", "q80_ms"), median_band(modes[mode])))
            out[name, mode] = columns
    return out


def peak_memory_bytes(fn, device):
    """Peak device memory allocated while ``fn()`` runs, above what was allocated before (GPU
    only; "" on the CPU, where remat.memory.PeakSavedBytes measures saved bytes instead)."""
    if device.type != "cuda":
        return ""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def transient_peak_bytes(fn, device):
    """Peak bytes that ``fn()`` allocates and frees again before it returns, counting every
    allocation of ``device``'s allocator made while it runs: for a training step what autograd
    saves, the temporaries, and what a backward recomputes inside a kernel or a compiled graph
    (inductor's buffers come from the same allocator); what ``fn`` leaves allocated (a step's
    parameter gradients, caches it fills) is not counted at any time. ``fn`` runs once under
    torch.profiler with profile_memory (every allocation and free, with its address and size, in
    time order; slower: measure, never time, this way)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"transient_peak_bytes measures the CPU or a CUDA device, got {device}")
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
        _sync(device)
    device_index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    events, pending = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while pending:  # depth first, children in the order they ran
        event = pending.pop()
        pending.extend(reversed(event.children))
        fields = event.extra_fields if event.tag == _EventType.Allocation else None
        if fields is None or fields.device.type != device.type:
            continue
        if device_index is None or fields.device.index == device_index:
            events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
    events.sort(key=lambda e: e[0])  # stable: events of one nanosecond keep the order they ran in
    # An allocation still live at the end (its address not freed after it) is left by fn: skipped.
    live = {}
    for index, (_, ptr, size) in enumerate(events):
        if size > 0:
            live[ptr] = index
        else:
            live.pop(ptr, None)
    left = set(live.values())
    counted, current, peak = set(), 0, 0
    for index, (_, ptr, size) in enumerate(events):
        if size > 0 and index not in left:
            counted.add(ptr)
            current += size
            peak = max(peak, current)
        elif size < 0 and ptr in counted:  # a free of a block allocated before fn is not counted
            counted.discard(ptr)
            current += size
    return peak


def copy_bandwidth_gbps(device, nbytes=256 * 2**20):
    """Measured device-memory copy bandwidth (bytes read + written per second), the ceiling a
    memory-bound kernel is compared with."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times = interleaved_timings({"copy": lambda: dst.copy_(src)}, device, rounds=10)
    return 2 * nbytes / (statistics.median(times["copy"]["full"]) * 1e-3) / 1e9


class Progress:
    """One line per finished step on stderr, with the count and elapsed time."""

    def __init__(self, total, label):
        self.total, self.label, self.done, self.start = total, label, 0, time.perf_counter()

    def step(self, what):
        self.done += 1
        elapsed = time.perf_counter() - self.start
        print(f"[{self.label} {self.done}/{self.total} {elapsed:6.1f}s] {what}", file=sys.stderr, flush=True)


def write_csv(rows, name, out_dir=None):
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fields = list(rows[0].keys())
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def print_table(rows, columns):
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r[c]).ljust(widths[c]) for c in columns))


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def pyplot_or_none():
    """matplotlib.pyplot on the non-interactive Agg backend, or None (with a note on stderr) when
    matplotlib is not installed: the plots are optional, the CSVs are not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; no plot", file=sys.stderr)
        return None
    return plt
