"""Attention forward / backward / full: remat (each backend) against PyTorch's
scaled_dot_product_attention (its flash and math backends where they run; the flash backend also
on [B, H, N, D] views of [B, N, H, D] tensors, "sdpa-flash-bnhd", the storage remat gets and a
Hugging Face model hands SDPA; and on a GPU also unpinned, "sdpa", as a stock model calls it:
cuDNN's kernel on sm_90/sm_10x), eager math attention
(which keeps the N x M probabilities), eager under torch.utils.checkpoint, torch.compile of the
eager code, and flash_attn where installed.

TFLOP/s follow the FlashAttention convention, so numbers compare with published ones: forward
4*B*H*N*M*D (the QK^T and PV products), halved for causal; backward 2.5x forward; full 3.5x forward.
They do not count recompute: remat's deterministic backward recomputes QK^T in both its dk/dv and
its dq pass, which this convention leaves out (as it leaves out FlashAttention's own recompute)."""

import functools
import importlib

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import remat
from benchmarks.common import (
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
from remat.reference import attention_reference


def _sdpa(kernel):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[kernel]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _sdpa_flash_on_bnhd(q, k, v, causal):
    """SDPA's flash kernel on [B, H, N, D] views of [B, N, H, D] tensors, as a Hugging Face model
    calls it (q_proj(x).view(B, N, H, D).transpose(1, 2)): the same storage remat.attention gets,
    where "sdpa-flash" gets contiguous [B, H, N, D] copies. Returns [B, N, H, D]."""
    return _sdpa("flash")(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal).transpose(1, 2)


def _sdpa_default(q, k, v, causal):
    """scaled_dot_product_attention as a stock model calls it: PyTorch picks the kernel (on an
    sm_90/sm_10x GPU with a recent cuDNN that is cuDNN's, elsewhere FlashAttention-2's)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _eager(q, k, v, causal):
    return attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal).transpose(1, 2)


def _flash_attn():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)


# time_vs_<label> columns: the provider's time over the named provider's in the same round.
BASELINES = {"eager": "torch", "sdpa_flash": "sdpa-flash", "sdpa_flash_bnhd": "sdpa-flash-bnhd", "sdpa": "sdpa",
             "checkpoint": "torch+checkpoint",
             "compile": "torch.compile", "flash_attn": "flash_attn", "rope_triton": "remat-triton-rope",
             "sdpa_rope": "sdpa-flash+rope"}


def rope_tables(length, head_dim, device):
    """fp32 rotate-half tables [length, D/2] (Llama's, theta 10000)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def _stock_rope_sdpa(cos, sin):
    """What a Hugging Face model runs: its apply_rotary_pos_emb on [B, H, N, D] q and k with the
    rotary module's full-width tables in the activations' dtype, then SDPA (its flash kernel)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    full = {}
    sdpa = _sdpa("flash")

    def run(q, k, v, causal):
        # The tables in the activations' dtype, made once per dtype (a model makes them once per
        # forward, for all its layers), outside the timed work.
        if q.dtype not in full:
            full[q.dtype] = tuple(torch.cat([t, t], dim=-1)[None].to(q.dtype) for t in (cos, sin))
        q, k = apply_rotary_pos_emb(q, k, *full[q.dtype])
        return sdpa(q, k, v, causal)

    return run


def _triton_rope_rotated_once(cos, sin):
    """remat.attention on the Triton backend with rope rotated once outside its kernels in every
    mode. In training that is what remat.attention does anyway (so this provider's backward and
    full rows repeat "remat-triton-rope"'s); forward-only ("forward" rows, under no_grad), where
    remat.attention keeps the rotation inside the forward kernel, the call goes through the same
    front end with remat.ops.attention_core's choice (rope_rotated_once) swapped for "always once"
    for its duration. So the two providers' "forward" rows differ only in where the rotation
    happens: they time the open choice for forward-only calls."""
    core = importlib.import_module("remat.ops.attention_core")
    chosen = core.rope_rotated_once

    def always_once(backend, rope, needs_grad):
        return backend == "triton" and rope

    def run(q, k, v, causal):
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return remat.attention(q, k, v, causal=causal, rope=(cos, sin), backend="triton")
        core.rope_rotated_once = always_once
        try:
            return remat.attention(q, k, v, causal=causal, rope=(cos, sin), backend="triton")
        finally:
            core.rope_rotated_once = chosen

    return run


def rope_providers(device, cos, sin):
    """Attention with rope: the stock path ("sdpa-flash+rope", Hugging Face's rotation then SDPA
    flash), the aten core where it runs and the Triton backend on a GPU (remat_backends), also
    with rope rotated once in its forward-only calls ("remat-triton-rope-once"). In training both
    remat paths rotate q and k once per pass outside the attention kernels
    (remat.ops.attention.rotated_once, with remat.ops.rope's kernel; the Triton backend chose that
    over its in-kernel rotation by this benchmark on an H200); forward-only, the aten core rotates
    once and the Triton backend inside its forward kernel."""
    backends = remat_backends(device, attention=True)
    out = [("sdpa-flash+rope", _stock_rope_sdpa(cos, sin), "bhnd")]
    for name in ("aten", "cudnn"):
        if name in backends:
            out.append((f"remat-{name}-rope", lambda q, k, v, causal, n=name: remat.attention(
                q, k, v, causal=causal, rope=(cos, sin), backend=n), "bnhd"))
    if "triton" in backends:
        out.append(("remat-triton-rope",
                    lambda q, k, v, causal: remat.attention(q, k, v, causal=causal, rope=(cos, sin), backend="triton"),
                    "bnhd"))
        out.append(("remat-triton-rope-once", _triton_rope_rotated_once(cos, sin), "bnhd"))
    return out


# The dropout case (GPU only: PyTorch's CPU flash kernel and remat's aten core there take no
# dropout): SDPA flash with dropout (FlashAttention-2 drawing its own mask) against remat's aten
# core, which runs that kernel inside remat's Function, and remat's Triton kernels (remat's Philox
# stream), the default for dropout before the aten core took it.
DROPOUT_P = 0.1


def _sdpa_flash_dropout(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT_P, is_causal=causal)


def dropout_providers(device):
    """Attention with dropout DROPOUT_P: "sdpa-flash" (the stock baseline, under its usual name so
    the rows' time_vs_sdpa_flash columns compare against it) and remat's aten and Triton backends
    where they run."""
    out = [("sdpa-flash", _sdpa_flash_dropout, "bhnd")]
    for name in remat_backends(device, attention=True):
        if name in ("aten", "triton"):
            out.append((f"remat-{name}", lambda q, k, v, causal, n=name: remat.attention(
                q, k, v, causal=causal, dropout_p=DROPOUT_P, backend=n), "bnhd"))
    return out


def providers(device):
    """(name, fn(q, k, v, causal), layout): layout "bnhd" takes [B, N, H, D], "bhnd" [B, H, N, D]."""
    out = []
    for name in remat_backends(device, attention=True):
        out.append((f"remat-{name}", lambda q, k, v, causal, n=name: remat.attention(q, k, v, causal=causal, backend=n),
                    "bnhd"))
    out.append(("sdpa-flash", _sdpa("flash"), "bhnd"))
    out.append(("sdpa-flash-bnhd", _sdpa_flash_on_bnhd, "bnhd"))
    if device.type == "cuda":
        # On the CPU PyTorch picks its flash kernel: the same as "sdpa-flash".
        out.append(("sdpa", _sdpa_default, "bhnd"))
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
    """Every provider's forward, backward and full step per case, timed in interleaved rounds
    (benchmarks.common.interleaved_timings); returns the CSV rows: time ratios to each of BASELINES
    with their spreads, absolute times, TFLOP/s, saved bytes per token, peak memory."""
    if device.type == "cuda":
        # (batch, heads, length, head dim): the aim shape, N = 8K at head dim 128.
        shapes = [(2, 16, 8192, 128)] if not quick else [(1, 16, 4096, 128)]
        dtypes = [torch.bfloat16]
        causals = [False, True]
        rounds = 4 if quick else 20
    else:
        shapes = [(1, 8, 256, 64)] if quick else [(1, 8, 512, 64)]
        dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
        causals = [True] if quick else [False, True]
        # 40 rounds (about 90 s in all): with 12, two runs in a row on a 2-core Xeon (2026-12-02)
        # disagreed on 42-112 of their 552 ratios (bands disjoint); with 40, on 21.
        rounds = 2 if quick else 40
    tags = environment_tags()
    rows = []
    # (shape, dtype, causal, variant): variant None (plain), "rope" (rope_providers: the stock
    # rotation + SDPA against remat's aten core and, on a GPU, its Triton backend, causal) or
    # "dropout" (dropout_providers, causal, GPU only).
    cases = [(s, d, c, None) for s in shapes for d in dtypes for c in causals]
    cases += [(s, d, True, "rope") for s in shapes for d in dtypes]
    if device.type == "cuda":
        cases += [(s, d, True, "dropout") for s in shapes for d in dtypes]

    def case_providers(variant, length, head_dim):
        if variant == "rope":
            return rope_providers(device, *rope_tables(length, head_dim, device))
        return dropout_providers(device) if variant == "dropout" else providers(device)

    progress = Progress(sum(len(case_providers(variant, 2, 2)) for *_, variant in cases), "attention")
    for (batch, heads, length, head_dim), dtype, causal, variant in cases:
        rope = variant == "rope"
        dropout_p = DROPOUT_P if variant == "dropout" else 0.0
        g = torch.Generator(device=device).manual_seed(0)
        bnhd = [torch.randn(batch, length, heads, head_dim, generator=g, device=device).to(dtype) for _ in range(3)]
        dout_bnhd = torch.randn(batch, length, heads, head_dim, generator=g, device=device).to(dtype)
        forward_flops = 4 * batch * heads * length * length * head_dim // (2 if causal else 1)
        flops = {"forward": forward_flops, "backward": 2.5 * forward_flops, "full": 3.5 * forward_flops}
        steps, memory = {}, {}
        for name, fn, layout in case_providers(variant, length, head_dim):
            if layout == "bhnd":
                leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in bnhd]
                dout = dout_bnhd.transpose(1, 2).contiguous()
            else:
                leaves = [t.clone().requires_grad_() for t in bnhd]
                dout = dout_bnhd
            step = autograd_step(fn, (*leaves, causal), leaves, dout)
            try:
                run_step(step)
            except RuntimeError as error:
                # An SDPA kernel that does not take this device/dtype says so; record nothing.
                progress.step(f"attention {name}: skipped ({str(error).splitlines()[0][:80]})")
                continue
            steps[name] = step
            memory[name] = (saved_bytes(fn, *leaves, causal),
                            peak_memory_bytes(functools.partial(run_step, step), device))
            progress.step(f"attention B{batch} H{heads} N{length} D{head_dim} {dtype} causal={causal} {name} ready")
        case = (f"attention B{batch} H{heads} N{length} D{head_dim} {dtype} causal={causal} rope={rope} "
                f"dropout={dropout_p}")
        for (name, mode), columns in timing_summary(interleaved_timings(steps, device, rounds=rounds), BASELINES,
                                                    case).items():
            saved, peak = memory[name]
            rows.append({"block": "attention", "batch": batch, "heads": heads, "length": length,
                         "head_dim": head_dim, "causal": causal, "rope": rope, "dropout_p": dropout_p,
                         "dtype": str(dtype).replace("torch.", ""),
                         "provider": name, "mode": mode, **columns, "flops": flops[mode],
                         "tflops": flops[mode] / (columns["median_ms"] * 1e-3) / 1e12, "saved_bytes": saved,
                         "saved_bytes_per_token": saved / (batch * length), "peak_mem_bytes": peak, **tags})
    return with_end_load(rows)


summary_columns = ["length", "head_dim", "causal", "rope", "dropout_p", "dtype", "provider", "mode",
                   "time_vs_sdpa_flash", "time_vs_sdpa_flash_q20", "time_vs_sdpa_flash_q80",
                   "time_vs_sdpa_flash_verdict", "time_vs_sdpa_flash_bnhd", "time_vs_sdpa_flash_bnhd_q20",
                   "time_vs_sdpa_flash_bnhd_q80", "time_vs_sdpa_flash_bnhd_verdict", "time_vs_sdpa", "time_vs_sdpa_q20",
                   "time_vs_sdpa_q80",
                   "time_vs_sdpa_verdict", "time_vs_eager", "time_vs_eager_verdict", "time_vs_rope_triton",
                   "time_vs_rope_triton_verdict", "time_vs_sdpa_rope", "time_vs_sdpa_rope_q20",
                   "time_vs_sdpa_rope_q80", "time_vs_sdpa_rope_verdict", "median_ms", "tflops",
                   "saved_bytes_per_token", "peak_mem_bytes", "full_vs_parts", "full_vs_parts_overlap_floor", "suspect"]
