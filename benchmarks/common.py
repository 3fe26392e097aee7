"""Timing, environment tags, CSV and plot output shared by the benchmarks (DESIGN.md section 8)."""

import csv
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def environment_tags():
    """Device name and versions that tag every CSV row."""
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
        device = f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "",
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device, *, warmup=3, min_reps=10, max_reps=200, budget_s=1.0, setup=None):
    """Times ``fn()`` and returns (median, q20, q80) in milliseconds.

    ``setup()``, if given, runs before each call and is not timed (it rebuilds the autograd graph
    for backward-only timing). On a GPU each call is timed with CUDA events; on the CPU with
    perf_counter. Repeats until ``budget_s`` is spent, within [min_reps, max_reps].
    """
    for _ in range(warmup):
        state = setup() if setup else None
        fn(state) if setup else fn()
    _sync(device)
    times = []
    start_all = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start_all < budget_s):
        state = setup() if setup else None
        _sync(device)
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn(state) if setup else fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(state) if setup else fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = statistics.quantiles(times, n=10, method="inclusive")
    return statistics.median(times), q[1], q[7]


def interleaved_ratios(fns, baseline, device, *, rounds=15, warmup=2):
    """Time ratios to ``baseline`` measured side by side (DESIGN.md section 8): after ``warmup``
    calls of each, every round times each function of ``fns`` (name -> fn()) once, in turn (A, B,
    C, A, B, C, ...), and divides its time by the baseline's time in the same round, so load that
    drifts over seconds affects both sides of a ratio alike. Returns name -> (median, q20, q80) of
    the per-round ratios; a row whose 20-80% band is wider than its distance from 1 claims nothing."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    per_round = {name: [] for name in fns}
    for _ in range(rounds):
        times = {}
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name] = time.perf_counter() - t0
        for name in fns:
            per_round[name].append(times[name] / times[baseline])
    out = {}
    for name, ratios in per_round.items():
        q = statistics.quantiles(sorted(ratios), n=10, method="inclusive")
        out[name] = (statistics.median(ratios), q[1], q[7])
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


def copy_bandwidth_gbps(device, nbytes=256 * 2**20):
    """Measured device-memory copy bandwidth (bytes read + written per second), the ceiling a
    memory-bound kernel is compared with."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    median, _, _ = measure(lambda: dst.copy_(src), device, budget_s=0.5)
    return 2 * nbytes / (median * 1e-3) / 1e9


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
