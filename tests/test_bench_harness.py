"""The benchmark harness (benchmarks/common.py): interleaved rounds, per-round ratios with their
spreads, and the flags for impossible or unresolved measurements. Logic only: no test here
asserts a timing (the synthetic times below are chosen, not measured)."""

import pytest
import torch

from benchmarks.common import (
    Step,
    autograd_step,
    interleaved_timings,
    loss_step,
    median_band,
    suspect_reasons,
    timing_summary,
    verdict,
)

CPU = torch.device("cpu")


def _recording_step(name, calls):
    """A Step whose parts append (name, part) to ``calls``."""

    def forward():
        calls.append((name, "forward"))
        return name

    def backward(state):
        assert state == name, "backward must get its own forward's result"
        calls.append((name, "backward"))

    def inference():
        calls.append((name, "inference"))

    return Step(forward, backward, inference)


def test_rounds_interleave_and_rotate():
    calls = []
    steps = {name: _recording_step(name, calls) for name in "ABC"}
    times = interleaved_timings(steps, CPU, rounds=4, warmup=1)
    # Warm-up: every provider's inference and one whole step, in order.
    warm = calls[:9]
    assert warm == [(n, p) for n in "ABC" for p in ("inference", "forward", "backward")]
    timed = calls[9:]
    # Each round: per provider inference, then split + whole (5 calls); the order rotates by one.
    per_round = [timed[k * 15:(k + 1) * 15] for k in range(4)]
    firsts = [[c[0] for c in r[::5]] for r in per_round]
    assert firsts == [list("ABC"), list("BCA"), list("CAB"), list("ABC")]
    for r in per_round:
        for n in "ABC":
            assert [p for name, p in r if name == n] == ["inference", "forward", "backward", "forward", "backward"]
    for n in "ABC":
        assert set(times[n]) == {"forward", "forward_graph", "backward", "full"}
        assert all(len(v) == 4 and all(t >= 0 for t in v) for v in times[n].values())


def test_plain_callables_time_the_full_step_only():
    counts = {"a": 0, "b": 0}

    def make(name):
        def step():
            counts[name] += 1

        return step

    times = interleaved_timings({"a": make("a"), "b": make("b")}, CPU, rounds=3, warmup=2)
    assert counts == {"a": 5, "b": 5}
    assert {name: set(modes) for name, modes in times.items()} == {"a": {"full"}, "b": {"full"}}
    summary = timing_summary(times, {"eager": "a"})
    assert set(summary) == {("a", "full"), ("b", "full")}
    assert summary["a", "full"]["time_vs_eager_verdict"] == "baseline"
    assert summary["a", "full"]["time_vs_eager"] == 1.0
    assert summary["b", "full"]["full_vs_parts"] == ""


def test_harness_on_real_autograd_steps_gives_every_column():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    dy = torch.randn(64, 32)
    steps = {"matmul": autograd_step(torch.matmul, (x, w), (x, w), dy),
             "tanh-matmul": autograd_step(lambda a, b: torch.tanh(a @ b), (x, w), (x, w), dy)}
    summary = timing_summary(interleaved_timings(steps, CPU, rounds=3, warmup=1),
                             {"eager": "matmul", "liger": "liger"}, "test")
    assert set(summary) == {(n, m) for n in steps for m in ("forward", "backward", "full")}
    expected = {"rounds", "time_vs_eager", "time_vs_eager_q20", "time_vs_eager_q80", "time_vs_eager_verdict",
                "time_vs_liger", "time_vs_liger_q20", "time_vs_liger_q80", "time_vs_liger_verdict",
                "full_vs_parts", "full_vs_parts_q20", "full_vs_parts_q80", "full_vs_parts_overlap_floor", "suspect",
                "median_ms", "q20_ms", "q80_ms"}
    for (name, mode), columns in summary.items():
        assert set(columns) == expected
        assert columns["rounds"] == 3
        assert columns["q20_ms"] <= columns["median_ms"] <= columns["q80_ms"]
        # A baseline that was not measured (no Liger here) leaves its columns empty, not missing.
        assert columns["time_vs_liger"] == columns["time_vs_liger_verdict"] == ""
        assert columns["time_vs_eager_verdict"] in (("baseline",) if name == "matmul" else
                                                    ("faster", "slower", "inconclusive"))
        assert (columns["full_vs_parts"] == "") == (mode != "full")
        assert columns["full_vs_parts_overlap_floor"] == ""  # the CPU runs synchronously: no launch overlap
    # The steps computed real gradients (autograd.grad, nothing accumulated into .grad).
    assert x.grad is None and w.grad is None


def test_loss_step_zeroes_gradients_and_backpropagates():
    model = torch.nn.Linear(4, 1)

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return type("Out", (), {"loss": self.inner(x).square().mean()})()

    wrapped = WithLoss()
    x = torch.randn(8, 4)
    step = loss_step(wrapped, {"x": x})
    step.backward(step.forward())
    first = model.weight.grad.clone()
    step.backward(step.forward())  # zeroed before the forward: equal, not doubled
    torch.testing.assert_close(model.weight.grad, first)
    assert step.inference().requires_grad is False


def test_verdict_reads_the_band():
    assert verdict(0.8, 0.95) == "faster"
    assert verdict(1.02, 1.3) == "slower"
    assert verdict(0.9, 1.1) == "inconclusive"
    assert verdict(1.0, 1.2) == "inconclusive"


def test_median_band_needs_two_values():
    assert median_band([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, pytest.approx(1.8), pytest.approx(4.2))
    with pytest.raises(ValueError, match="two values"):
        median_band([1.0])


def _modes(forward, forward_graph, backward, full):
    return {"forward": forward, "forward_graph": forward_graph, "backward": backward, "full": full}


def test_suspect_flags_a_full_step_faster_than_its_forward():
    reasons = suspect_reasons(_modes(forward=[10.0] * 5, forward_graph=[3.0] * 5, backward=[4.0] * 5,
                                     full=[6.0, 7.0, 6.5, 6.0, 7.5]))
    assert "faster than its forward alone" in reasons


def test_suspect_flags_a_full_step_faster_than_its_parts_beyond_the_tolerance():
    modes = _modes(forward=[1.0] * 5, forward_graph=[5.0] * 5, backward=[5.0] * 5, full=[8.0, 8.5, 8.2, 7.9, 8.1])
    reasons = suspect_reasons(modes)
    assert "forward plus backward timed apart" in reasons and "forward alone" not in reasons
    # Within the tolerance (full 3% under its parts): not flagged.
    assert suspect_reasons(dict(modes, full=[9.7] * 5)) == ""
    # A noisy full step whose band reaches the parts: not flagged either.
    assert suspect_reasons(dict(modes, full=[8.0, 8.5, 10.5, 11.0, 10.0])) == ""


def test_summary_marks_suspect_rows_and_warns(capsys):
    good = _modes(forward=[1.0] * 4, forward_graph=[1.2] * 4, backward=[2.0] * 4, full=[3.3, 3.2, 3.4, 3.3])
    bad = _modes(forward=[1.0] * 4, forward_graph=[1.2] * 4, backward=[2.0] * 4, full=[2.0, 2.1, 1.9, 2.0])
    summary = timing_summary({"stock": good, "remat": bad}, {"eager": "stock"}, "case X")
    assert all(summary["stock", m]["suspect"] == "" for m in ("forward", "backward", "full"))
    assert all("timed apart" in summary["remat", m]["suspect"] for m in ("forward", "backward", "full"))
    assert "WARNING: case X remat: suspect measurement" in capsys.readouterr().err
    full = summary["remat", "full"]
    assert full["full_vs_parts"] == pytest.approx(2.0 / 3.2, rel=0.05)
    assert full["time_vs_eager_verdict"] == "faster"


class _FakeClock:
    """perf_counter for the harness on a simulated GPU: the host advances it by what a call costs
    the host, a synchronize by the device work still queued (chosen numbers, nothing measured)."""

    def __init__(self):
        self.now = 0.0
        self.queued = 0.0

    def perf_counter(self):
        return self.now

    def host(self, ms, device_ms):
        self.now += ms * 1e-3
        self.queued += device_ms * 1e-3

    def sync(self, device):
        self.now += self.queued
        self.queued = 0.0


def test_gpu_split_records_the_backward_host_time_and_the_cpu_does_not(monkeypatch):
    import benchmarks.common as common

    clock = _FakeClock()
    monkeypatch.setattr(common.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(common, "_sync", clock.sync)
    # forward: 0.2 ms of host time enqueues 3 ms of device work; backward: 0.5 ms enqueues 6 ms.
    step = Step(lambda: clock.host(0.2, 3.0), lambda state: clock.host(0.5, 6.0))
    gpu = interleaved_timings({"a": step}, torch.device("cuda"), rounds=2, warmup=0)["a"]
    assert gpu["backward_host"] == pytest.approx([0.5, 0.5])
    assert gpu["backward"] == pytest.approx([6.5, 6.5])
    assert gpu["forward_graph"] == pytest.approx([3.2, 3.2])
    assert "backward_host" not in interleaved_timings({"a": step}, CPU, rounds=2, warmup=0)["a"]


def test_overlap_floor_explains_a_gpu_full_step_under_its_parts_and_no_more():
    # Timed apart: forward 3 ms, backward 6 ms of which the host spends 1.5 ms enqueueing before
    # the device runs it; the whole step can hide up to those 1.5 ms: floor 1 - 1.5 / 9.
    base = dict(_modes(forward=[2.5] * 5, forward_graph=[3.0] * 5, backward=[6.0] * 5, full=[7.6] * 5),
                backward_host=[1.5] * 5)
    floor = 1 - 1.5 / 9.0
    within = suspect_reasons(base)
    assert "timed apart" in within and "within what the backward's host time" in within
    assert f"overlap floor {floor:.3f}" in within
    beyond = suspect_reasons(dict(base, full=[6.0] * 5))
    assert "beyond what the backward's host time" in beyond
    # The overlap is capped by the forward's length: a backward that blocks on the host for all of
    # its 6 ms hides at most the 3 ms forward.
    capped = suspect_reasons(dict(base, backward_host=[6.0] * 5, full=[5.5] * 5))
    assert f"overlap floor {1 - 3.0 / 9.0:.3f}" in capped and "beyond" in capped
    summary = timing_summary({"a": base}, {"eager": "a"})
    assert summary["a", "full"]["full_vs_parts_overlap_floor"] == pytest.approx(floor)
    assert summary["a", "backward"]["full_vs_parts_overlap_floor"] == ""
    cpu = timing_summary({"a": _modes(forward=[2.5] * 5, forward_graph=[3.0] * 5, backward=[6.0] * 5,
                                      full=[9.0] * 5)}, {"eager": "a"})
    assert cpu["a", "full"]["full_vs_parts_overlap_floor"] == "" and cpu["a", "full"]["suspect"] == ""


def test_summary_ratios_are_per_round_and_inconclusive_across_one():
    # The baseline's time drifts 4x over the rounds (load), the other provider's with it: the
    # per-round ratio stays 0.5 although the absolute times overlap.
    stock = {"full": [2.0, 4.0, 8.0, 4.0, 2.0]}
    half = {"full": [1.0, 2.0, 4.0, 2.0, 1.0]}
    noisy = {"full": [1.6, 4.4, 7.0, 4.8, 2.1]}
    summary = timing_summary({"stock": stock, "half": half, "noisy": noisy}, {"eager": "stock"})
    assert summary["half", "full"]["time_vs_eager"] == pytest.approx(0.5)
    assert summary["half", "full"]["time_vs_eager_verdict"] == "faster"
    assert summary["noisy", "full"]["time_vs_eager_verdict"] == "inconclusive"
    assert summary["noisy", "full"]["time_vs_eager_q20"] < 1 < summary["noisy", "full"]["time_vs_eager_q80"]


def test_harness_refuses_bad_arguments():
    with pytest.raises(ValueError, match="at least 2"):
        interleaved_timings({"a": lambda: None}, CPU, rounds=1)
    with pytest.raises(ValueError, match="at least one provider"):
        interleaved_timings({}, CPU, rounds=3)
    with pytest.raises(TypeError, match="neither a Step nor callable"):
        interleaved_timings({"a": 3}, CPU, rounds=3)


def _ratio_row(provider, median, q20, q80, verdict_text):
    return {"block": "rms_norm", "provider": provider, "mode": "full", "time_vs_eager": str(median),
            "time_vs_eager_q20": str(q20), "time_vs_eager_q80": str(q80), "time_vs_eager_verdict": verdict_text,
            "median_ms": "1.0", "date": "today"}


def test_compare_runs_lists_disjoint_bands_and_contradicting_verdicts():
    from benchmarks.compare_runs import disagreements

    first = [_ratio_row("torch", 1, 1, 1, "baseline"), _ratio_row("remat-cpp", 0.5, 0.45, 0.55, "faster"),
             _ratio_row("remat-torch", 1.2, 1.1, 1.3, "slower"), _ratio_row("liger", 0.9, 0.8, 1.05, "inconclusive")]
    second = [_ratio_row("torch", 1, 1, 1, "baseline"), _ratio_row("remat-cpp", 0.7, 0.6, 0.8, "faster"),
              _ratio_row("remat-torch", 1.25, 1.15, 1.35, "slower"), _ratio_row("liger", 1.0, 0.9, 1.1, "inconclusive")]
    found = disagreements(first, second)
    assert [(key["provider"], column, why) for key, column, _, _, why in found] == [
        ("remat-cpp", "time_vs_eager", "bands disjoint")]
    # Overlapping bands whose verdicts contradict (only possible with inconsistent files) are listed too.
    second[2] = _ratio_row("remat-torch", 1.2, 1.1, 1.3, "faster")
    assert [key["provider"] for key, *_ in disagreements(first, second)] == ["remat-cpp", "remat-torch"]


def test_compare_runs_refuses_different_benchmarks():
    from benchmarks.compare_runs import disagreements

    rows = [_ratio_row("torch", 1, 1, 1, "baseline")]
    with pytest.raises(ValueError, match="different rows"):
        disagreements(rows, [_ratio_row("remat-cpp", 1, 1, 1, "baseline")])
    with pytest.raises(ValueError, match="different columns"):
        disagreements(rows, [dict(rows[0], extra="1")])
    with pytest.raises(ValueError, match="not unique"):
        disagreements(rows * 2, rows * 2)


def _causal_step_in_bnhd(fn, layout, q, k, v, dout):
    """(o, dq, dk, dv, saved bytes) of one causal step of a bench_attention provider ``fn`` taking
    ``layout`` ("bhnd": contiguous [B, H, N, D] copies of the [B, N, H, D] q, k, v), in [B, N, H, D]."""
    from remat.memory import saved_bytes

    leaves = [(t.transpose(1, 2).contiguous() if layout == "bhnd" else t.clone()).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, True)
    grads = torch.autograd.grad(out, leaves, dout.transpose(1, 2) if layout == "bhnd" else dout)
    if layout == "bhnd":
        out, grads = out.transpose(1, 2), [grad.transpose(1, 2) for grad in grads]
    return (out.detach(), *grads, saved_bytes(fn, *leaves, True))


def test_rope_providers_compute_the_rope_attention():
    """bench_attention's rope rows time one computation: each provider (the stock rotation + SDPA
    flash in [B, H, N, D]; the aten core, which rotates q and k once per pass outside the kernel)
    gives the torch backend's rope output and gradients (to fp32 rounding order), and remat's keep
    the torch backend's saved bytes."""
    import remat
    from benchmarks.bench_attention import rope_providers, rope_tables

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 24, 2, 16, generator=g) for _ in range(4))
    cos, sin = rope_tables(24, 16, CPU)

    def stock(q, k, v, causal):
        return remat.attention(q, k, v, causal=causal, rope=(cos, sin), backend="torch")

    results = {}
    providers = rope_providers(CPU, cos, sin)
    assert [name for name, *_ in providers] == ["sdpa-flash+rope", "remat-aten-rope"]
    for name, fn, layout in providers + [("torch", stock, "bnhd")]:
        results[name] = _causal_step_in_bnhd(fn, layout, q, k, v, dout)
    for name, _, _ in providers:
        for a, b in zip(results[name][:4], results["torch"][:4]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert results["remat-aten-rope"][4] == results["torch"][4] > 0


def test_sdpa_providers_on_either_layout_compute_the_same_attention():
    """bench_attention's two SDPA flash baselines time one computation on different storage:
    "sdpa-flash" on contiguous [B, H, N, D] copies, "sdpa-flash-bnhd" on [B, H, N, D] views of the
    [B, N, H, D] tensors remat gets (as a Hugging Face model calls SDPA). Same output and
    gradients; the view provider takes and returns [B, N, H, D]."""
    from benchmarks.bench_attention import providers

    by_name = {name: (fn, layout) for name, fn, layout in providers(CPU)}
    assert by_name["sdpa-flash"][1] == "bhnd" and by_name["sdpa-flash-bnhd"][1] == "bnhd"
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 24, 2, 16, generator=g) for _ in range(4))
    results = {}
    for name in ("sdpa-flash", "sdpa-flash-bnhd"):
        out, *grads, _ = _causal_step_in_bnhd(*by_name[name], q, k, v, dout)
        assert out.shape == q.shape
        results[name] = (out, *grads)
    for a, b in zip(results["sdpa-flash"], results["sdpa-flash-bnhd"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not __import__("remat").backend.triton_interpreted(),
                    reason="runs remat's Triton kernels (the interpreter on the CPU)")
def test_triton_rope_rotated_once_provider_computes_the_rope_attention(monkeypatch):
    """The GPU-only "remat-triton-rope-once" provider: forward-only (no_grad) it goes through
    remat.attention with q and k rotated once (two rotations; the plain "remat-triton-rope" call
    rotates none outside its kernel) and the module's choice restored after; it gives the torch
    backend's rope attention; with grad it is remat.attention's Triton call (the same gradients)."""
    import importlib

    import remat
    from benchmarks.bench_attention import _triton_rope_rotated_once, rope_tables
    from remat.ops import attention as attention_ops

    core = importlib.import_module("remat.ops.attention_core")
    chosen = core.rope_rotated_once
    rotations = []
    real_rotate = attention_ops.rope_rotate

    def counting_rotate(*args, **kwargs):
        rotations.append(kwargs.get("inverse", False))
        return real_rotate(*args, **kwargs)

    monkeypatch.setattr(attention_ops, "rope_rotate", counting_rotate)
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 20, 2, 16, generator=g) for _ in range(4))
    cos, sin = rope_tables(20, 16, CPU)
    run = _triton_rope_rotated_once(cos, sin)
    expected = remat.attention(q, k, v, causal=True, rope=(cos, sin), backend="torch")
    with torch.no_grad():
        remat.attention(q, k, v, causal=True, rope=(cos, sin), backend="triton")
        assert rotations == []
        torch.testing.assert_close(run(q, k, v, True), expected, rtol=1e-5, atol=1e-5)
    assert rotations == [False, False]
    assert core.rope_rotated_once is chosen
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(run(*leaves, True), leaves, dout)
    expected_grads = torch.autograd.grad(remat.attention(*reference, causal=True, rope=(cos, sin), backend="torch"),
                                         reference, dout)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _frontier_row(provider, family, saved, time, q20=None, q80=None, step_peak=None):
    return {"provider": provider, "family": family, "peak_saved_bytes": saved, "time_vs_stock": time,
            "time_vs_stock_q20": time if q20 is None else q20, "time_vs_stock_q80": time if q80 is None else q80,
            "step_peak_bytes": saved if step_peak is None else step_peak}


def test_frontier_dominance_needs_no_more_bytes_and_no_more_time():
    from benchmarks.bench_frontier import dominated_by

    compile_point = _frontier_row("compile budget 0.1", "torch.compile", 1000, 1.20, 1.15, 1.25)
    rows = [compile_point,
            _frontier_row("remat memory", "remat policy", 1040, 1.22),           # 4% more bytes, 0.02 slower
            _frontier_row("remat balanced", "remat policy", 1060, 1.00),         # 6% more bytes: out
            _frontier_row("remat+compile auto", "remat+compile", 900, 1.30, 1.24, 1.35),  # bands overlap
            _frontier_row("remat auto", "remat auto", 900, 1.40, 1.30, 1.50),    # slower beyond the band
            _frontier_row("checkpoint every 1", "torch.utils.checkpoint", 500, 1.0)]  # not remat
    assert dominated_by(compile_point, rows) == ["remat memory", "remat+compile auto"]


def test_frontier_dominance_reads_the_column_it_is_given():
    from benchmarks.bench_frontier import dominated_by

    # Saves little but peaks high (a compiled backward's recomputation is not saved, it is allocated).
    compile_point = _frontier_row("compile budget 0.05", "torch.compile", 100, 1.2, step_peak=1000)
    rows = [compile_point, _frontier_row("remat auto", "remat auto", 300, 1.2, step_peak=500)]
    assert dominated_by(compile_point, rows, "step_peak_bytes") == ["remat auto"]
    assert dominated_by(compile_point, rows, "peak_saved_bytes") == []


def _allocate_and_free(keep):
    """Allocates 4 MB and 8 MB (both live), frees the 4 MB, allocates 2 MB that ``keep`` keeps,
    frees the pre-existing tensor in ``keep``, and a 1 MB temporary."""
    first = torch.empty(1_000_000)
    second = torch.empty(2_000_000)
    del first
    keep["left"] = torch.empty(500_000)
    keep.pop("before")
    torch.empty(250_000).add_(1)
    del second


def test_transient_peak_counts_what_is_allocated_and_freed_inside_only():
    from benchmarks.common import transient_peak_bytes

    keep = {"before": torch.empty(4_000_000)}
    # 4 + 8 MB at once; the 2 MB left allocated never counts; the 16 MB allocated before is not
    # subtracted when freed (its release does not lower what was counted).
    assert transient_peak_bytes(lambda: _allocate_and_free(keep), torch.device("cpu")) == 12_000_000
    assert keep["left"].numel() == 500_000

    def grows():
        x = torch.zeros(1000)
        for _ in range(3):
            x = torch.cat([x, x])  # 4 + 8 kB live at once, then 8 + 16 kB, then 16 + 32 kB

    assert transient_peak_bytes(grows, torch.device("cpu")) == 48_000
    with pytest.raises(ValueError, match="CPU or a CUDA"):
        transient_peak_bytes(lambda: None, torch.device("meta"))


@pytest.mark.gpu
def test_transient_peak_counts_cuda_allocations():
    from benchmarks.common import transient_peak_bytes

    device = torch.device("cuda")
    keep = {"before": torch.empty(4_000_000, device=device)}

    def fn():
        first = torch.empty(1_000_000, device=device)
        second = torch.empty(2_000_000, device=device)
        del first, second
        keep["left"] = torch.empty(500_000, device=device)
        keep.pop("before")

    # The caching allocator hands out (and reports) rounded blocks, which its own statistics count
    # too: here the largest allocation above the start is the first two blocks at once.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    peak = transient_peak_bytes(fn, device)
    assert peak == torch.cuda.max_memory_allocated() - base
    assert 12_000_000 <= peak < 12_000_000 + 2 * 2**20
