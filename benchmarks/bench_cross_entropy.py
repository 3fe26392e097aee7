"""The output block: loss + backward of lm_head + cross-entropy, remat.linear_cross_entropy (each
backend that runs here) against eager ``F.cross_entropy(F.linear(x, w).float(), t)``,
torch.compile of the same, and Liger-Kernel's fused linear cross-entropy where installed (it is
Triton: GPUs only).

Timing (DESIGN.md section 8): the providers run side by side in interleaved rounds (A, B, C, A, B,
C, ...; the order rotates every round) after a warm-up; each step is timed as forward, backward and
their sum, and every round's time is divided by eager's time in the same round. Reported: the median
of the per-round ratios with its 20% / 80% quantiles (``ratio_q20`` / ``ratio_q80``); a row whose
quantile spread is wider than its distance from 1 is flagged (``spread_flag``: the effect is not
resolved). Memory: peak bytes allocated above the start during one step (``torch.cuda`` on a GPU;
on the CPU the profiler's allocation events, which see inside the C++ and Triton operators), and
bytes saved for backward per token (saved-tensor hooks, everywhere). TFLOP/s by the FlashAttention
convention: the model's FLOPs (2 T V H forward, 4 T V H backward), recompute not counted, so a
faster step scores higher.

Shapes: on a GPU H = 4096 with V = 32K / 128K / 256K at 2K and 8K tokens (bf16). On the CPU (2 cores)
scaled down to H = 512 with 1024 tokens at V = 32K and 128K, 256 tokens at V = 256K (bf16), and
V = 32K in fp32: T >= H, so that, as at the GPU shapes, the [T, V] logits outweigh the [V, H] weight
(and its gradient) that every provider holds anyway.
"""

import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import remat
from benchmarks.common import Progress, environment_tags
from remat import backend as backend_mod
from remat.memory import saved_bytes
from remat.ops.cross_entropy import OPS


def eager(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def _liger():
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError:
        return None
    return lambda x, w, t: LigerFusedLinearCrossEntropyFunction.apply(x, w, t)[0]


def providers(device):
    """[(name, fn(x, w, t) -> loss)], eager first (the baseline)."""
    out = [("torch", eager), ("torch.compile", torch.compile(eager, dynamic=False))]
    for name in backend_mod.BACKENDS:
        if (name not in OPS or backend_mod.unavailable_reason(name, device) is not None
                or (name == "triton" and device.type == "cpu")):
            continue
        out.append((f"remat-{name}", lambda x, w, t, n=name: remat.linear_cross_entropy(x, w, t, backend=n)))
    liger = _liger() if device.type == "cuda" else None
    if liger is not None:
        out.append(("liger", liger))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(fn, x, w, t, device):
    """(forward ms, backward ms) of one loss + backward to x and w."""
    _sync(device)
    start = time.perf_counter()
    loss = fn(x, w, t)
    _sync(device)
    middle = time.perf_counter()
    torch.autograd.grad(loss, (x, w))
    _sync(device)
    end = time.perf_counter()
    return (middle - start) * 1e3, (end - middle) * 1e3


def peak_bytes(fn, x, w, t, device):
    """Peak bytes allocated above the start during one step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        torch.autograd.grad(fn(x, w, t), (x, w))
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.autograd.grad(fn(x, w, t), (x, w))
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, n in events:
        current += n
        peak = max(peak, current)
    return peak


def _quantiles(values):
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=10, method="inclusive")
    return q[1], q[7]


def interleaved(cases, device, rounds, warmup):
    """{name: {"forward": [ms...], "backward": [...], "full": [...]}} over ``rounds`` rounds, the
    providers' order rotated every round."""
    times = {name: {"forward": [], "backward": [], "full": []} for name, _, _ in cases}
    for _ in range(warmup):
        for _, fn, args in cases:
            _step(fn, *args, device)
    for r in range(rounds):
        order = cases[r % len(cases):] + cases[:r % len(cases)]
        for name, fn, args in order:
            forward, backward = _step(fn, *args, device)
            times[name]["forward"].append(forward)
            times[name]["backward"].append(backward)
            times[name]["full"].append(forward + backward)
    return times


def run(device, quick=False):
    if device.type == "cuda":
        hidden, dtype_cases = 4096, [(tokens, vocab, torch.bfloat16) for vocab in (32768, 131072, 262144)
                                     for tokens in (2048, 8192)]
        if quick:
            dtype_cases = [(4096, 131072, torch.bfloat16)]
        rounds, warmup = (5, 1) if quick else (10, 2)
    else:
        hidden = 512
        dtype_cases = [(1024, 32768, torch.bfloat16), (1024, 131072, torch.bfloat16), (256, 262144, torch.bfloat16),
                       (1024, 32768, torch.float32)]
        if quick:
            dtype_cases = [(1024, 32768, torch.bfloat16)]
        rounds, warmup = (4, 1) if quick else (6, 1)
    tags = environment_tags()
    rows = []
    progress = Progress(len(dtype_cases), "cross_entropy")
    for tokens, vocab, dtype in dtype_cases:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype).requires_grad_()
        w = torch.nn.Parameter((torch.randn(vocab, hidden, generator=g, device=device) / hidden**0.5).to(dtype))
        t = torch.randint(0, vocab, (tokens,), generator=g, device=device)
        cases = [(name, fn, (x, w, t)) for name, fn in providers(device)]
        times = interleaved(cases, device, rounds, warmup)
        model_flops = {"forward": 2 * tokens * vocab * hidden, "backward": 4 * tokens * vocab * hidden,
                       "full": 6 * tokens * vocab * hidden}
        for name, fn, args in cases:
            saved = saved_bytes(fn, *args)
            peak = peak_bytes(fn, *args, device)
            for mode, values in times[name].items():
                ratios = [v / e for v, e in zip(values, times["torch"][mode])]
                median = statistics.median(values)
                q20, q80 = _quantiles(values)
                ratio = statistics.median(ratios)
                ratio_q20, ratio_q80 = _quantiles(ratios)
                rows.append({
                    "block": "linear_cross_entropy", "tokens": tokens, "hidden": hidden, "vocab": vocab,
                    "dtype": str(dtype).replace("torch.", ""), "provider": name, "mode": mode, "rounds": rounds,
                    "median_ms": median, "q20_ms": q20, "q80_ms": q80,
                    "tflops": model_flops[mode] / (median * 1e-3) / 1e12,
                    "time_vs_eager": ratio, "ratio_q20": ratio_q20, "ratio_q80": ratio_q80,
                    "spread_flag": name != "torch" and (ratio_q80 - ratio_q20) > abs(ratio - 1.0),
                    "peak_bytes": peak, "saved_bytes": saved, "saved_bytes_per_token": saved / tokens,
                    "logits_fp32_bytes": 4 * tokens * vocab, **tags,
                })
        progress.step(f"cross_entropy T={tokens} V={vocab} H={hidden} {dtype}")
    return rows


summary_columns = ["tokens", "vocab", "dtype", "provider", "mode", "median_ms", "time_vs_eager", "ratio_q20",
                   "ratio_q80", "spread_flag", "tflops", "peak_bytes", "saved_bytes_per_token"]
