"""SwiGLU MLP (Llama) forward / backward / full: remat (each backend and recompute mode) against
eager PyTorch, eager under torch.utils.checkpoint, torch.compile and Liger-Kernel's fused SiLU*mul
where installed.

FLOPs (the TFLOP/s column) count the work each provider does, recompute included: 2*T*H*I per
GEMM; forward 3 GEMMs, backward 6; recompute="block" re-runs the gate and up GEMMs (2 more),
torch.utils.checkpoint the whole forward (3 more)."""

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import remat
from benchmarks.common import Progress, environment_tags, measure, peak_memory_bytes
from remat import backend as backend_mod
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
    for name in backend_mod.BACKENDS:
        if backend_mod.unavailable_reason(name, device) is not None or (name == "triton" and device.type == "cpu"):
            continue
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
    if device.type == "cuda":
        shapes = [(8192, 4096, 14336)]
        dtypes = [torch.bfloat16]
        budget = 0.5
    else:
        shapes = [(256, 1024, 2816)] if quick else [(512, 1024, 2816)]
        dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
        budget = 0.5
    tags = environment_tags()
    rows = []
    cases = [(s, d) for s in shapes for d in dtypes]
    progress = Progress(len(cases) * len(providers(device)), "mlp")
    for (tokens, hidden, inter), dtype in cases:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype).requires_grad_()
        wg = (torch.randn(inter, hidden, generator=g, device=device) / hidden**0.5).to(dtype)
        wu = (torch.randn(inter, hidden, generator=g, device=device) / hidden**0.5).to(dtype)
        wd = (torch.randn(hidden, inter, generator=g, device=device) / inter**0.5).to(dtype)
        weights = [torch.nn.Parameter(w) for w in (wg, wu, wd)]
        dy = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        gemm = 2 * tokens * hidden * inter
        results = []
        for name, fn, recompute_gemms in providers(device):
            args = (x, *weights)
            leaves = [x, *weights]

            def forward():
                with torch.no_grad():
                    fn(*args)

            def setup_backward():
                return fn(*args)

            def backward(out):
                torch.autograd.grad(out, leaves, dy)

            def full():
                torch.autograd.grad(fn(*args), leaves, dy)

            full()
            saved = saved_bytes(fn, *args)
            peak = peak_memory_bytes(full, device)
            flops = {"forward": 3 * gemm, "backward": (6 + recompute_gemms) * gemm,
                     "full": (9 + recompute_gemms) * gemm}
            timings = {"forward": measure(forward, device, budget_s=budget),
                       "backward": measure(backward, device, budget_s=budget, setup=setup_backward),
                       "full": measure(full, device, budget_s=budget)}
            for mode, (median, q20, q80) in timings.items():
                results.append({"block": "swiglu_mlp", "tokens": tokens, "hidden": hidden, "intermediate": inter,
                                "dtype": str(dtype).replace("torch.", ""), "provider": name, "mode": mode,
                                "median_ms": median, "q20_ms": q20, "q80_ms": q80, "flops": flops[mode],
                                "tflops": flops[mode] / (median * 1e-3) / 1e12, "saved_bytes": saved,
                                "saved_bytes_per_token": saved / tokens, "peak_mem_bytes": peak})
            progress.step(f"mlp {tokens}x{hidden}x{inter} {dtype} {name}")
        eager = {r["mode"]: r["median_ms"] for r in results if r["provider"] == "torch"}
        ckpt = {r["mode"]: r["median_ms"] for r in results if r["provider"] == "torch+checkpoint"}
        for r in results:
            r["time_vs_eager"] = r["median_ms"] / eager[r["mode"]]
            r["time_vs_checkpoint"] = r["median_ms"] / ckpt[r["mode"]]
            rows.append({**r, **tags})
    return rows


summary_columns = ["tokens", "hidden", "intermediate", "dtype", "provider", "mode", "median_ms", "q20_ms", "q80_ms",
                   "tflops", "time_vs_eager", "time_vs_checkpoint", "saved_bytes_per_token", "peak_mem_bytes"]
