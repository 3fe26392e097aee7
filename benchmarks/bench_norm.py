"""RMSNorm and LayerNorm (alone and fused with the residual add): remat's backends against stock
PyTorch eager, torch.compile, torch.utils.checkpoint and Liger-Kernel where installed.

Byte counts (the GB/s column) are the minimum traffic of the fused contract, the same formula for
every provider, so GB/s is effective bandwidth and the ratios between providers are time ratios:
  forward:  read x (and residual), write y (and h), read weight/bias, write fp32 stats;
  backward: read dy (and dh), read the saved input (x or h), write dx, read weight and stats;
            the weight-gradient partials (fp32, a few rows of [*, hidden]) are not counted.
"""

import functools

import torch
import torch.utils.checkpoint

import remat
from benchmarks.common import (
    OPERATOR_BASELINES,
    Progress,
    autograd_step,
    copy_bandwidth_gbps,
    environment_tags,
    interleaved_timings,
    peak_memory_bytes,
    remat_backends,
    run_step,
    timing_summary,
    with_end_load,
)
from remat.memory import saved_bytes


def _stock(kind, with_residual):
    def fn(x, weight, bias, residual):
        h = x + residual if with_residual else x
        if kind == "rms":
            y = torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, 1e-6)
        else:
            y = torch.nn.functional.layer_norm(h, (h.shape[-1],), weight, bias, 1e-5)
        return (y, h) if with_residual else y

    return fn


def _remat(kind, with_residual, name):
    def fn(x, weight, bias, residual):
        r = residual if with_residual else None
        if kind == "rms":
            return remat.rms_norm(x, weight, 1e-6, residual=r, backend=name)
        return remat.layer_norm(x, weight, bias, 1e-5, residual=r, backend=name)

    return fn


def _liger(kind, with_residual):
    """Liger-Kernel's norm functions on the step's own weight (and bias), if the package is
    installed (None otherwise). RMSNorm with in_place=False: Liger's default writes dX into the
    incoming gradient, which would change the benchmark's shared output gradient between rounds."""
    try:
        from liger_kernel.transformers.functional import liger_layer_norm, liger_rms_norm
    except ImportError:
        return None

    def fn(x, weight, bias, residual):
        h = x + residual if with_residual else x
        if kind == "rms":
            y = liger_rms_norm(h, weight, 1e-6, in_place=False)
        else:
            y = liger_layer_norm(h, weight, bias, 1e-5)
        return (y, h) if with_residual else y

    return fn


def providers(kind, with_residual, hidden, dtype, device):
    """(name, fn) for every provider that runs on this device."""
    out = [(f"remat-{name}", _remat(kind, with_residual, name)) for name in remat_backends(device)]
    stock = _stock(kind, with_residual)
    out.append(("torch", stock))
    out.append(("torch.compile", torch.compile(stock, dynamic=False)))

    def checkpointed(*args):
        return torch.utils.checkpoint.checkpoint(stock, *args, use_reentrant=False)

    out.append(("torch+checkpoint", checkpointed))
    liger = _liger(kind, with_residual)
    if liger is not None:
        out.append(("liger", liger))
    return out


def traffic_bytes(rows, hidden, dtype, kind, with_residual):
    e = rows * hidden * torch.tensor([], dtype=dtype).element_size()
    params = hidden * torch.tensor([], dtype=dtype).element_size() * (1 if kind == "rms" else 2)
    stats = rows * 4 * (1 if kind == "rms" else 2)
    fwd = (4 if with_residual else 2) * e + params + stats
    bwd = (4 if with_residual else 3) * e + params + stats
    return {"forward": fwd, "backward": bwd, "full": fwd + bwd}


def _inputs(rows, hidden, dtype, device, kind, with_residual):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, hidden, generator=g, device=device).to(dtype).requires_grad_()
    w = torch.randn(hidden, generator=g, device=device).to(dtype).requires_grad_()
    b = torch.randn(hidden, generator=g, device=device).to(dtype).requires_grad_() if kind == "layer" else None
    r = torch.randn(rows, hidden, generator=g, device=device).to(dtype).requires_grad_() if with_residual else None
    dy = torch.randn(rows, hidden, generator=g, device=device).to(dtype)
    return (x, w, b, r), dy


def bench_case(kind, with_residual, rows, hidden, dtype, device, rounds, progress, copy_gbps):
    """The rows of one norm case: every provider's forward, backward and full step timed in
    interleaved rounds (benchmarks.common.interleaved_timings), their time ratios to each of
    OPERATOR_BASELINES with spreads, GB/s from the absolute median, saved and peak bytes."""
    args, dy = _inputs(rows, hidden, dtype, device, kind, with_residual)
    leaves = [a for a in args if a is not None]
    traffic = traffic_bytes(rows, hidden, dtype, kind, with_residual)
    case = f"{kind} {'+residual ' if with_residual else ''}{rows}x{hidden} {dtype}"
    steps, memory = {}, {}
    for name, fn in providers(kind, with_residual, hidden, dtype, device):
        steps[name] = step = autograd_step(fn, args, leaves, dy)
        run_step(step)  # compiles where needed, before the peak is measured
        memory[name] = (saved_bytes(fn, *args), peak_memory_bytes(functools.partial(run_step, step), device))
    timings = timing_summary(interleaved_timings(steps, device, rounds=rounds), OPERATOR_BASELINES, case)
    results = []
    for (name, mode), columns in timings.items():
        gbps = traffic[mode] / (columns["median_ms"] * 1e-3) / 1e9
        results.append({
            "block": f"{'add+' if with_residual else ''}{kind}_norm",
            "rows": rows,
            "hidden": hidden,
            "dtype": str(dtype).replace("torch.", ""),
            "provider": name,
            "mode": mode,
            **columns,
            "bytes": traffic[mode],
            "gbps": gbps,
            "copy_bw_fraction": gbps / copy_gbps,
            "saved_bytes": memory[name][0],
            "peak_mem_bytes": memory[name][1],
        })
    progress.step(case)
    return results


def run(device, quick=False):
    """All norm cases for this device; returns the CSV rows (tagged with the environment)."""
    if device.type == "cuda":
        shapes = [(16384, 4096)] if quick else [(16384, 1024), (16384, 4096), (16384, 8192), (4096, 65536)]
        dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float32]
        rounds = 4 if quick else 30
    else:
        shapes = [(1024, 4096)] if not quick else [(256, 4096)]
        dtypes = [torch.float32, torch.bfloat16]
        rounds = 2 if quick else 20
    cases = [(k, res, rows, hidden, dt) for (rows, hidden) in shapes for dt in dtypes
             for k in ("rms", "layer") for res in (False, True)]
    progress = Progress(len(cases), "norm")
    copy_gbps = copy_bandwidth_gbps(device)
    tags = environment_tags()
    rows_out = []
    for kind, res, rows, hidden, dt in cases:
        for r in bench_case(kind, res, rows, hidden, dt, device, rounds, progress, copy_gbps):
            rows_out.append({**r, "copy_gbps": copy_gbps, **tags})
    return with_end_load(rows_out)


summary_columns = ["block", "rows", "hidden", "dtype", "provider", "mode", "time_vs_eager", "time_vs_eager_q20",
                   "time_vs_eager_q80", "time_vs_eager_verdict", "time_vs_compile", "median_ms", "gbps",
                   "copy_bw_fraction", "saved_bytes", "peak_mem_bytes", "suspect"]
