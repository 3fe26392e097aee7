"""SwiGLU MLP (Llama) forward / backward / full: remat (each backend and recompute mode) against
eager PyTorch, eager under torch.utils.checkpoint, torch.compile and Liger-Kernel's fused SiLU*mul
where installed.

FLOPs (the TFLOP/s column) count the work each provider does, recompute included: 2*T*H*I per
GEMM; forward 3 GEMMs, backward 6; recompute="block" re-runs the gate and up GEMMs (2 more),
torch.utils.checkpoint the whole forward (3 more)."""

import functools

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import remat
from benchmarks.common import (
    OPERATOR_BASELINES,
    Progress,
    autograd_step,
    environment_tags,
    interleaved_timings,
    peak_memory_bytes,
    remat_backends,
    run_step,
    timing_summary,
    with_end_load,
)
from remat.memory import saved_bytes


def eager_swiglu(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _liger():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return lambda x, wg, wu, wd: F.linear(LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu)), wd)


def providers(device):
    """(name, fn, extra forward GEMMs in backward)."""
    out = []
    for name in remat_backends(device):
        for mode, recompute_gemms in (("block", 2), ("activation", 0), ("none", 0)):
            out.append((f"remat-{name}-{mode}",
                        lambda x, wg, wu, wd, n=name, m=mode: remat.swiglu_mlp(x, wg, wu, wd, recompute=m, backend=n),
                        recompute_gemms))
    out.append(("torch", eager_swiglu, 0))
    out.append(("torch+checkpoint",
                lambda *a: torch.utils.checkpoint.checkpoint(eager_swiglu, *a, use_reentrant=False), 3))
    out.append(("torch.compile", torch.compile(eager_swiglu, dynamic=False), 0))
    liger = _liger()
    if liger is not None:
        out.append(("liger", liger, 0))
    return out


def run(device, quick=False):
    """Every provider's forward, backward and full step timed in interleaved rounds
    (benchmarks.common.interleaved_timings) per case; returns the CSV rows: time ratios to each of
    OPERATOR_BASELINES with their spreads, absolute times, TFLOP/s, saved bytes per token, peak memory."""
    if device.type == "cuda":
        shapes = [(8192, 4096, 14336)]
        dtypes = [torch.bfloat16]
        rounds = 4 if quick else 20
    else:
        shapes = [(256, 1024, 2816)] if quick else [(512, 1024, 2816)]
        dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
        rounds = 2 if quick else 16
    tags = environment_tags()
    rows = []
    cases = [(s, d) for s in shapes for d in dtypes]
    progress = Progress(len(cases), "mlp")
    for (tokens, hidden, inter), dtype in cases:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype).requires_grad_()
        wg = (torch.randn(inter, hidden, generator=g, device=device) / hidden**0.5).to(dtype)
        wu = (torch.randn(inter, hidden, generator=g, device=device) / hidden**0.5).to(dtype)
        wd = (torch.randn(hidden, inter, generator=g, device=device) / inter**0.5).to(dtype)
        weights = [torch.nn.Parameter(w) for w in (wg, wu, wd)]
        dy = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        gemm = 2 * tokens * hidden * inter
        args = (x, *weights)
        steps, memory, flops = {}, {}, {}
        for name, fn, recompute_gemms in providers(device):
            steps[name] = step = autograd_step(fn, args, args, dy)
            run_step(step)  # compiles where needed, before the peak is measured
            memory[name] = (saved_bytes(fn, *args), peak_memory_bytes(functools.partial(run_step, step), device))
            flops[name] = {"forward": 3 * gemm, "backward": (6 + recompute_gemms) * gemm,
                           "full": (9 + recompute_gemms) * gemm}
        case = f"mlp {tokens}x{hidden}x{inter} {dtype}"
        timings = timing_summary(interleaved_timings(steps, device, rounds=rounds), OPERATOR_BASELINES, case)
        for (name, mode), columns in timings.items():
            saved, peak = memory[name]
            rows.append({"block": "swiglu_mlp", "tokens": tokens, "hidden": hidden, "intermediate": inter,
                         "dtype": str(dtype).replace("torch.", ""), "provider": name, "mode": mode, **columns,
                         "flops": flops[name][mode], "tflops": flops[name][mode] / (columns["median_ms"] * 1e-3) / 1e12,
                         "saved_bytes": saved, "saved_bytes_per_token": saved / tokens, "peak_mem_bytes": peak, **tags})
        progress.step(case)
    return with_end_load(rows)


summary_columns = ["tokens", "hidden", "intermediate", "dtype", "provider", "mode", "time_vs_eager",
                   "time_vs_eager_q20", "time_vs_eager_q80", "time_vs_eager_verdict", "time_vs_checkpoint",
                   "time_vs_compile", "median_ms", "tflops", "saved_bytes_per_token", "peak_mem_bytes", "suspect"]
