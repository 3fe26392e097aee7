"""The output block: loss + backward of lm_head + cross-entropy, remat.linear_cross_entropy (each
backend that runs here) against eager ``F.cross_entropy(F.linear(x, w).float(), t)``,
torch.compile of the same, and Liger-Kernel's fused linear cross-entropy where installed (it is
Triton: GPUs only).

Timing (DESIGN.md section 8): the providers run side by side in interleaved rounds
(benchmarks.common.interleaved_timings: A, B, C, then B, C, A, ...) after a warm-up; each round times
a provider's forward alone, its forward and backward apart, and the whole step, and divides each by
eager's (and torch.compile's, Liger's) time in the same round. Reported: the median of the per-round
ratios (``time_vs_eager``) with its 20% / 80% quantiles (``time_vs_eager_q20`` / ``_q80``) and
``time_vs_eager_verdict`` ("inconclusive" where the band contains 1); ``suspect`` names a full step
that measured faster than its parts. Memory: peak bytes allocated above the start during one step
(``torch.cuda`` on a GPU; on the CPU the profiler's allocation events, which see inside the C++ and
Triton operators), and bytes saved for backward per token (saved-tensor hooks, everywhere). TFLOP/s
by the FlashAttention convention: the model's FLOPs (2 T V H forward, 4 T V H backward), recompute
not counted, so a faster step scores higher.

Shapes: on a GPU H = 4096 with V = 32K / 128K / 256K at 2K and 8K tokens (bf16). On the CPU (2 cores)
scaled down to H = 512 with 1024 tokens at V = 32K and 128K, 256 tokens at V = 256K (bf16), and
V = 32K in fp32: T >= H, so that, as at the GPU shapes, the [T, V] logits outweigh the [V, H] weight
(and its gradient) that every provider holds anyway.
"""

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import remat
from benchmarks.common import (
    Progress,
    autograd_step,
    environment_tags,
    interleaved_timings,
    remat_backends,
    timing_summary,
    with_end_load,
)
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
    for name in remat_backends(device):
        if name not in OPS:
            continue
        out.append((f"remat-{name}", lambda x, w, t, n=name: remat.linear_cross_entropy(x, w, t, backend=n)))
    liger = _liger() if device.type == "cuda" else None
    if liger is not None:
        out.append(("liger", liger))
    return out


# time_vs_<label> columns: the provider's time over the named provider's in the same round.
BASELINES = {"eager": "torch", "compile": "torch.compile", "liger": "liger"}


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


def run(device, quick=False):
    """Every provider's forward, backward and full step per case, timed in interleaved rounds;
    returns the CSV rows (see the module docstring)."""
    if device.type == "cuda":
        hidden, dtype_cases = 4096, [(tokens, vocab, torch.bfloat16) for vocab in (32768, 131072, 262144)
                                     for tokens in (2048, 8192)]
        if quick:
            dtype_cases = [(4096, 131072, torch.bfloat16)]
        rounds, warmup = (4, 1) if quick else (10, 2)
    else:
        hidden = 512
        dtype_cases = [(1024, 32768, torch.bfloat16), (1024, 131072, torch.bfloat16), (256, 262144, torch.bfloat16),
                       (1024, 32768, torch.float32)]
        if quick:
            dtype_cases = [(256, 32768, torch.bfloat16)]
        # Each round runs about 2.3 steps per provider (forward alone, the step in parts, the
        # whole step): six rounds of the four CPU cases take about twelve minutes on two cores.
        rounds, warmup = (2, 1) if quick else (6, 1)
    tags = environment_tags()
    rows = []
    progress = Progress(len(dtype_cases), "cross_entropy")
    for tokens, vocab, dtype in dtype_cases:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype).requires_grad_()
        w = torch.nn.Parameter((torch.randn(vocab, hidden, generator=g, device=device) / hidden**0.5).to(dtype))
        t = torch.randint(0, vocab, (tokens,), generator=g, device=device)
        loss_grad = torch.ones((), device=device)
        fns = dict(providers(device))
        steps = {name: autograd_step(fn, (x, w, t), (x, w), loss_grad) for name, fn in fns.items()}
        times = interleaved_timings(steps, device, rounds=rounds, warmup=warmup)
        memory = {name: (saved_bytes(fn, x, w, t), peak_bytes(fn, x, w, t, device)) for name, fn in fns.items()}
        model_flops = {"forward": 2 * tokens * vocab * hidden, "backward": 4 * tokens * vocab * hidden,
                       "full": 6 * tokens * vocab * hidden}
        case = f"cross_entropy T={tokens} V={vocab} H={hidden} {dtype}"
        for (name, mode), columns in timing_summary(times, BASELINES, case).items():
            saved, peak = memory[name]
            rows.append({
                "block": "linear_cross_entropy", "tokens": tokens, "hidden": hidden, "vocab": vocab,
                "dtype": str(dtype).replace("torch.", ""), "provider": name, "mode": mode, **columns,
                "tflops": model_flops[mode] / (columns["median_ms"] * 1e-3) / 1e12,
                "peak_bytes": peak, "saved_bytes": saved,
                "saved_bytes_per_token": saved / tokens, "logits_fp32_bytes": 4 * tokens * vocab, **tags,
            })
        progress.step(case)
    return with_end_load(rows)


summary_columns = ["tokens", "vocab", "dtype", "provider", "mode", "time_vs_eager", "time_vs_eager_q20",
                   "time_vs_eager_q80", "time_vs_eager_verdict", "time_vs_compile", "median_ms", "tflops", "peak_bytes",
                   "saved_bytes_per_token", "suspect"]
