"""Attention forward / backward / full: remat (each backend) against PyTorch's
scaled_dot_product_attention (its flash and math backends where they run), eager math attention
(which keeps the N x M probabilities), eager under torch.utils.checkpoint, torch.compile of the
eager code, and flash_attn where installed.

TFLOP/s follow the FlashAttention convention, so numbers compare with published ones: forward
4*B*H*N*M*D (the QK^T and PV products), halved for causal; backward 2.5x forward; full 3.5x forward.
They do not count recompute: remat's deterministic backward recomputes QK^T in both its dk/dv and
its dq pass, which this convention leaves out (as it leaves out FlashAttention's own recompute)."""

import functools

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import remat
from benchmarks.common import Progress, environment_tags, interleaved_ratios, measure, peak_memory_bytes
from remat import backend as backend_mod
from remat.memory import saved_bytes
from remat.reference import attention_reference


def _sdpa(kernel):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[kernel]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _eager(q, k, v, causal):
    return attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal).transpose(1, 2)


def _flash_attn():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)


def _full_step(fn, leaves, causal, dout):
    torch.autograd.grad(fn(*leaves, causal), leaves, dout)


def providers(device):
    """(name, fn(q, k, v, causal), layout): layout "bnhd" takes [B, N, H, D], "bhnd" [B, H, N, D]."""
    out = []
    for name in backend_mod.BACKENDS:
        if backend_mod.unavailable_reason(name, device) is not None or (name == "triton" and device.type == "cpu"):
            continue
        out.append((f"remat-{name}", lambda q, k, v, causal, n=name: remat.attention(q, k, v, causal=causal, backend=n),
                    "bnhd"))
    out.append(("sdpa-flash", _sdpa("flash"), "bhnd"))
    out.append(("sdpa-math", _sdpa("math"), "bhnd"))
    out.append(("torch", _eager, "bhnd"))
    out.append(("torch+checkpoint",
                lambda q, k, v, causal: torch.utils.checkpoint.checkpoint(_eager, q, k, v, causal, use_reentrant=False),
                "bhnd"))
    out.append(("torch.compile", torch.compile(_eager, dynamic=False), "bhnd"))
    flash = _flash_attn()
    if flash is not None and device.type == "cuda":
        out.append(("flash_attn", flash, "bnhd"))
    return out


def run(device, quick=False):
    if device.type == "cuda":
        # (batch, heads, length, head dim): the aim shape, N = 8K at head dim 128.
        shapes = [(2, 16, 8192, 128)] if not quick else [(1, 16, 4096, 128)]
        dtypes = [torch.bfloat16]
        causals = [False, True]
        budget, min_reps = 0.5, 10
    else:
        shapes = [(1, 8, 256, 64)] if quick else [(1, 8, 512, 64)]
        dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
        causals = [True] if quick else [False, True]
        budget, min_reps = 0.3, 3
    tags = environment_tags()
    rows = []
    cases = [(s, d, c) for s in shapes for d in dtypes for c in causals]
    progress = Progress(len(cases) * len(providers(device)), "attention")
    for (batch, heads, length, head_dim), dtype, causal in cases:
        g = torch.Generator(device=device).manual_seed(0)
        bnhd = [torch.randn(batch, length, heads, head_dim, generator=g, device=device).to(dtype) for _ in range(3)]
        dout_bnhd = torch.randn(batch, length, heads, head_dim, generator=g, device=device).to(dtype)
        forward_flops = 4 * batch * heads * length * length * head_dim // (2 if causal else 1)
        flops = {"forward": forward_flops, "backward": 2.5 * forward_flops, "full": 3.5 * forward_flops}
        results = []
        full_steps = {}
        for name, fn, layout in providers(device):
            if layout == "bhnd":
                leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in bnhd]
                dout = dout_bnhd.transpose(1, 2).contiguous()
            else:
                leaves = [t.clone().requires_grad_() for t in bnhd]
                dout = dout_bnhd

            def forward():
                with torch.no_grad():
                    fn(*leaves, causal)

            def setup_backward():
                return fn(*leaves, causal)

            def backward(out):
                torch.autograd.grad(out, leaves, dout)

            def full():
                torch.autograd.grad(fn(*leaves, causal), leaves, dout)

            try:
                full()
            except RuntimeError as error:
                # An SDPA kernel that does not take this device/dtype says so; record nothing.
                progress.step(f"attention {name}: skipped ({str(error).splitlines()[0][:80]})")
                continue
            # Bound now: a closure over the loop variables would time the last provider for every name.
            full_steps[name] = functools.partial(_full_step, fn, leaves, causal, dout)
            saved = saved_bytes(fn, *leaves, causal)
            peak = peak_memory_bytes(full, device)
            timings = {"forward": measure(forward, device, budget_s=budget, min_reps=min_reps),
                       "backward": measure(backward, device, budget_s=budget, min_reps=min_reps,
                                           setup=setup_backward),
                       "full": measure(full, device, budget_s=budget, min_reps=min_reps)}
            for mode, (median, q20, q80) in timings.items():
                results.append({"block": "attention", "batch": batch, "heads": heads, "length": length,
                                "head_dim": head_dim, "causal": causal, "dtype": str(dtype).replace("torch.", ""),
                                "provider": name, "mode": mode, "median_ms": median, "q20_ms": q20, "q80_ms": q80,
                                "flops": flops[mode], "tflops": flops[mode] / (median * 1e-3) / 1e12,
                                "saved_bytes": saved, "saved_bytes_per_token": saved / (batch * length),
                                "peak_mem_bytes": peak})
            progress.step(f"attention B{batch} H{heads} N{length} D{head_dim} {dtype} causal={causal} {name}")
        # The full step's time ratio to SDPA's flash kernel, timed side by side in interleaved rounds.
        ratios = interleaved_ratios(full_steps, "sdpa-flash", device) if "sdpa-flash" in full_steps else {}
        for r in results:
            median, q20, q80 = ratios.get(r["provider"], ("", "", "")) if r["mode"] == "full" else ("", "", "")
            r.update(full_vs_sdpa_flash=median, full_vs_sdpa_flash_q20=q20, full_vs_sdpa_flash_q80=q80)
        reference = {}
        for r in results:
            if r["provider"] in ("sdpa-flash", "torch"):
                reference.setdefault(r["provider"], {})[r["mode"]] = r["median_ms"]
        for r in results:
            flash = reference.get("sdpa-flash", {}).get(r["mode"])
            r["time_vs_sdpa_flash"] = r["median_ms"] / flash if flash else ""
            r["time_vs_eager"] = r["median_ms"] / reference["torch"][r["mode"]]
            rows.append({**r, **tags})
    return rows


summary_columns = ["length", "head_dim", "causal", "dtype", "provider", "mode", "median_ms", "q20_ms", "q80_ms",
                   "tflops", "time_vs_sdpa_flash", "full_vs_sdpa_flash", "full_vs_sdpa_flash_q20",
                   "full_vs_sdpa_flash_q80", "time_vs_eager", "saved_bytes_per_token", "peak_mem_bytes"]
