"""remat's attention tuner (kernels/attention/tuning.py): the cache key (lengths bucketed, group,
window classes, device), shared-memory pruning, no timing inside CUDA graph capture,
REMAT_ATTENTION_AUTOTUNE=0, zeroing of the atomic dq accumulator, candidates that set tiles only
(the forward's RoPE rotation halves are the launch's: launch.ROPE_SPLIT_HALVES, read from
REMAT_ATTENTION_ROPE_SPLIT_HALVES at import), backward launches without RoPE fields (their
kernels take q and k rotated). The CPU cases drive the tuner with
fake kernels, limits and clocks; the gpu cases run the real compiled path."""

import os
import subprocess
import sys
import types

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

import remat
from remat.kernels.attention import launch, tuning
from remat.kernels.attention.tuning import LaunchShape, Tuner, tuning_key

KIB = 1024
LIMIT_SM86 = 99 * KIB
FWD_FLAGS = dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_H=64, ROPE=False, SOFTCAP=False, DROPOUT=False, VARLEN=False)


def shape(n=100, m=100, group=1, window_left=-1, window_right=-1, device_index=0):
    return LaunchShape(n, m, group, window_left, window_right, device_index)


def key_of(**overrides):
    return tuning_key("fwd", torch.float16, FWD_FLAGS, shape(**overrides))


def config(block_m, block_n):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=4, num_stages=2)


BIG, MEDIUM, SMALL = config(128, 128), config(64, 64), config(32, 32)
SHARED = {BIG: 160 * KIB, MEDIUM: 64 * KIB, SMALL: 24 * KIB}
MILLISECONDS = {BIG: 1.0, MEDIUM: 3.0, SMALL: 2.0}


class FakeDevice:
    """A device with LIMIT_SM86 bytes of shared memory per block, a launch log, a compile log
    and a fake timer (each candidate costs MILLISECONDS[config])."""

    def __init__(self, capturing=False, autotune=True):
        self.runs, self.compiled, self.timed = [], [], []
        self.capture = capturing
        self.tuner = Tuner(autotune, shared_memory_limit=lambda index: LIMIT_SM86,
                           capturing=lambda: self.capture, time_candidate=self.time)

    def shared_memory_of(self, candidate):
        self.compiled.append(candidate)
        return SHARED[candidate]

    def run(self, candidate):
        self.runs.append(candidate)

    def time(self, run, reset):
        self.timed.append(run.args[0])
        return MILLISECONDS[run.args[0]]

    def launch(self, key, candidates=(BIG, MEDIUM, SMALL), reset=None):
        return self.tuner.launch(key, list(candidates), self.shared_memory_of, self.run, reset)


def test_key_buckets_lengths_and_separates_group_window_device_dtype():
    assert key_of(n=100, m=100) == key_of(n=120, m=127)
    assert key_of(n=1, m=1) == key_of(n=64, m=64)
    assert key_of(n=1 << 20, m=1 << 20) == key_of(n=1 << 17, m=1 << 17)
    base = key_of()
    for other in (key_of(n=300), key_of(m=300), key_of(group=4), key_of(window_right=0),
                  key_of(window_left=32, window_right=0), key_of(device_index=1)):
        assert other != base
    assert key_of(window_left=100, window_right=0) == key_of(window_left=120, window_right=0)
    assert key_of(window_left=100, window_right=0) != key_of(window_left=1000, window_right=0)
    assert tuning_key("fwd", torch.bfloat16, FWD_FLAGS, shape()) != key_of()
    assert tuning_key("fwd", torch.float16, dict(FWD_FLAGS, SOFTCAP=True), shape()) != key_of()
    assert tuning_key("dq", torch.float16, FWD_FLAGS, shape()) != key_of()


def test_miss_times_fitting_candidates_and_caches_fastest_per_bucket():
    device = FakeDevice()
    assert device.launch(key_of(n=100)) is SMALL
    # BIG (160 KiB > 99 KiB) is never timed nor launched; SMALL (2 ms) beats MEDIUM (3 ms).
    assert device.timed == [MEDIUM, SMALL]
    assert device.runs == [SMALL]
    assert device.tuner.choices == {key_of(n=100): SMALL}
    # Same bucket: the cached choice, no compile, no timing.
    assert device.launch(key_of(n=120)) is SMALL
    assert device.timed == [MEDIUM, SMALL] and device.runs == [SMALL, SMALL] and len(device.compiled) == 3
    # Another bucket, group size, causal flag or device: tuned again.
    for other in (key_of(n=300), key_of(group=2), key_of(window_right=0), key_of(device_index=1)):
        device.timed.clear()
        device.launch(other)
        assert device.timed == [MEDIUM, SMALL]
    assert len(device.tuner.choices) == 5


def test_candidate_failing_to_launch_is_dropped_and_none_fitting_raises():
    device = FakeDevice()

    def time(run, reset):
        if run.args[0] is SMALL:
            raise OutOfResources(2048, 1024, "threads")
        return MILLISECONDS[run.args[0]]

    device.tuner.time_candidate = time
    assert device.launch(key_of()) is MEDIUM
    with pytest.raises(RuntimeError, match="shared memory"):
        device.launch(key_of(n=5000), candidates=(BIG,))
    assert device.runs == [MEDIUM]



def test_errors_name_the_kernels_whose_tiles_ran_out():
    """The GEMM kernels share the Tuner: its errors say which kernels found no tile."""
    from remat.kernels import matmul

    assert matmul._ACT_TUNER.name.startswith("remat GEMM")
    tuner = Tuner(False, shared_memory_limit=lambda index: 0, name="remat GEMM (test)")
    with pytest.raises(RuntimeError, match=r"^remat GEMM \(test\): no tile configuration fits"):
        tuner.launch(key_of(), (SMALL,), lambda config: 1, lambda config: None)
    with pytest.raises(RuntimeError, match="^remat attention: no tile configuration fits"):
        Tuner(False, shared_memory_limit=lambda index: 0).launch(key_of(), (SMALL,), lambda config: 1,
                                                                 lambda config: None)

def test_capture_miss_launches_first_fitting_untimed_and_uncached():
    device = FakeDevice(capturing=True)
    assert device.launch(key_of()) is MEDIUM
    assert device.timed == [] and device.runs == [MEDIUM] and device.tuner.choices == {}
    # Tuned outside capture, the cached choice is used inside it.
    device.capture = False
    assert device.launch(key_of()) is SMALL
    device.capture = True
    device.timed.clear()
    assert device.launch(key_of()) is SMALL
    assert device.timed == [] and device.runs == [MEDIUM, SMALL, SMALL]


def test_autotune_off_takes_first_candidate_that_fits_without_timing():
    device = FakeDevice(autotune=False)
    assert device.launch(key_of()) is MEDIUM
    assert device.timed == [] and device.runs == [MEDIUM]
    # Compiled only up to the first fit; cached, so the next call compiles nothing.
    assert device.compiled == [BIG, MEDIUM]
    assert device.launch(key_of()) is MEDIUM and device.compiled == [BIG, MEDIUM]


class FakeEvent:
    def __init__(self, clock):
        self.clock = clock

    def record(self):
        self.at = self.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


def test_event_timer_zeroes_accumulator_before_every_run_and_the_real_launch():
    """The atomic dK/dV kernel adds into its fp32 dq: every run, timed or real, must start from 0,
    and the zeroing must not fall inside the timed span."""
    clock = [0.0]
    accumulator = torch.zeros(4)
    seen_before_run = []

    def run(candidate):
        seen_before_run.append(accumulator.clone())
        accumulator.add_(1.0)
        clock[0] += MILLISECONDS[candidate]

    def reset():
        clock[0] += 100.0
        accumulator.zero_()

    def time(run, reset):
        return tuning._time_with_events(run, reset, make_event=lambda: FakeEvent(clock))

    tuner = Tuner(True, shared_memory_limit=lambda index: LIMIT_SM86, capturing=lambda: False, time_candidate=time)
    assert tuner.launch(key_of(), [MEDIUM, SMALL], SHARED.__getitem__, run, reset) is SMALL
    runs = 2 * (1 + tuning._TIMED_RUNS) + 1
    assert len(seen_before_run) == runs
    assert all(torch.equal(before, torch.zeros(4)) for before in seen_before_run)
    assert torch.equal(accumulator, torch.ones(4))
    # The zeroing (100 fake ms) stays outside the timed span.
    assert time(lambda: run(MEDIUM), reset) == MILLISECONDS[MEDIUM]


class FakeKernel:
    """Stands in for a JITFunction: warmup reports shared memory by tile, launches are logged."""

    def __init__(self):
        self.launches = []

    def warmup(self, *args, grid, **options):
        size = options["BLOCK_M"] * options["BLOCK_N"] * 16
        return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=size))

    def __getitem__(self, grid):
        def launch_(*args, **options):
            self.launches.append((grid, args, options))
        return launch_


def test_launch_passes_tiles_grid_and_zeroes_accumulator(monkeypatch):
    """`_launch`'s compiled path: the chosen config's tile, warps and stages reach the kernel,
    the grid is computed from its tile, the fast-mode dK/dV kernel is keyed apart, and its
    accumulator is zeroed before the real launch after timing."""
    monkeypatch.setattr(tuning, "_INTERPRETED", False)
    first_of = {name: tuning._configs_for(name, dict(FWD_FLAGS, ATOMIC_DQ=True), torch.float16)[0]
                for name in ("fwd", "dkdv")}
    fitting_limit = max(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * 16 for c in first_of.values())
    tuner = Tuner(True, shared_memory_limit=lambda index: fitting_limit, capturing=lambda: False,
                  time_candidate=lambda run, reset: (reset and reset(), run(), 1.0)[-1])
    monkeypatch.setattr(tuning, "_TUNER", tuner)
    kernel = FakeKernel()
    accumulator = torch.ones(3)
    tuning._launch(kernel, "dkdv", lambda block_m, block_n: (1000 // block_n, 2, 1), ("arg",),
                   dict(FWD_FLAGS, ATOMIC_DQ=True), torch.float16, shape(), accumulator=accumulator)
    (key, chosen), = tuner.choices.items()
    assert key[0] == "dkdv_atomic"
    grid, args, options = kernel.launches[-1]
    assert grid == (1000 // chosen.kwargs["BLOCK_N"], 2, 1) and args == ("arg",)
    assert (options["BLOCK_M"], options["BLOCK_N"], options["num_warps"], options["num_stages"]) == (
        chosen.kwargs["BLOCK_M"], chosen.kwargs["BLOCK_N"], chosen.num_warps, chosen.num_stages)
    assert options["INTERPRETED"] is False and options["ATOMIC_DQ"] is True
    assert torch.equal(accumulator, torch.zeros(3))


def test_launchers_pass_lengths_group_windows_and_device(monkeypatch):
    """Every `_launch` call site of launch.py gives the tuner the launch's N, M (packed: the
    maxima), group size and window sides."""
    recorded = []
    monkeypatch.setattr(launch, "_launch", lambda kernel, name, grid_of, args, constexprs, dtype, launch_shape,
                        accumulator=None: recorded.append((name, launch_shape, accumulator is not None)))
    q = torch.randn(1, 5, 4, 16)
    k = torch.randn(1, 7, 2, 16)
    o, lse = torch.zeros_like(q), torch.zeros(1, 4, 5)
    launch.attention_fwd(q, k, k, None, None, None, 0.25, 0.0, -1, 0, 0.0)
    for deterministic in (True, False):
        launch.attention_bwd(q, q, k, k, o, lse, None, None, None, 0.25, 0.0, -1, 0, 0.0, deterministic)
    dense = LaunchShape(5, 7, 2, -1, 0, -1)
    assert recorded == [("fwd", dense, False), ("dkdv", dense, False), ("dq", dense, False), ("dkdv", dense, True)]
    recorded.clear()
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    launch.attention_varlen_fwd(q[0], k[0], k[0], cu_q, cu_k, 3, 4, None, None, None, 0.25, 0.0, 8, 3, 0.0)
    launch.attention_varlen_bwd(q[0], q[0], k[0], k[0], o[0], lse[0], cu_q, cu_k, 3, 4, None, None, None, 0.25,
                                0.0, 8, 3, 0.0, False)
    packed = LaunchShape(3, 4, 2, 8, 3, -1)
    assert recorded == [("fwd", packed, False), ("dkdv", packed, True)]


def rope_constexprs(head_dim, split_halves, **extra):
    """The forward launcher's constexprs of a bf16 RoPE launch at head_dim (launch._head_dim_parts)."""
    block_d, block_h, block_d2, block_h2 = launch._head_dim_parts(head_dim, True, split_halves)
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_D2=block_d2, BLOCK_H2=block_h2,
                ROPE=True, SOFTCAP=False, DROPOUT=False, VARLEN=False, **extra)


@pytest.mark.parametrize("head_dim,padded_half,split", [(80, 64, (32, 16)), (96, 64, (32, 16)),
                                                        (192, 128, (64, 32))])
def test_forward_candidates_set_tiles_only_in_either_rotation_halves_layout(head_dim, padded_half, split):
    """With RoPE at a head dim whose rotation halves split, the forward's candidates are its plain
    heavy tile list of the head dim's class, the same for padded and split halves: no candidate sets
    BLOCK_H or BLOCK_H2. The two layouts are keyed apart (another compiled variant)."""
    padded = rope_constexprs(head_dim, False)
    split_halves = rope_constexprs(head_dim, True)
    assert (padded["BLOCK_H"], padded["BLOCK_H2"]) == (padded_half, 0)
    assert (split_halves["BLOCK_H"], split_halves["BLOCK_H2"]) == split
    tiles = tuning._CONFIGS[("fwd", 128 if head_dim < 128 else 256, "16bit", True)]
    for constexprs in (padded, split_halves):
        candidates = tuning._configs_for("fwd", constexprs, torch.bfloat16)
        assert candidates is tiles
        assert all(set(c.kwargs) == {"BLOCK_M", "BLOCK_N"} for c in candidates)
    keys = {tuning_key("fwd", torch.bfloat16, constexprs, shape()) for constexprs in (padded, split_halves)}
    assert len(keys) == 2


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_backward_launches_have_no_rope_fields(dropout, monkeypatch):
    """The backward launchers (dense and packed, both modes) give the dK/dV and dQ kernels no ROPE,
    BLOCK_H or BLOCK_H2, so neither their tuning keys nor their candidates depend on RoPE: the
    candidates are the heavy list with dropout and the plain one without (D = 80: class 128)."""
    recorded = []
    monkeypatch.setattr(launch, "_launch", lambda kernel, name, grid_of, args, constexprs, dtype, launch_shape,
                        accumulator=None: recorded.append((name, dict(constexprs), dtype, launch_shape)))
    q = torch.randn(1, 5, 4, 80, dtype=torch.bfloat16)
    k = torch.randn(1, 7, 2, 80, dtype=torch.bfloat16)
    o, lse = torch.zeros_like(q), torch.zeros(1, 4, 5)
    rng = torch.tensor([1, 2]) if dropout else None
    p = 0.2 if dropout else 0.0
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    for deterministic in (True, False):
        launch.attention_bwd(q, q, k, k, o, lse, None, None, rng, 0.25, 5.0, -1, 0, p, deterministic)
        launch.attention_varlen_bwd(q[0], q[0], k[0], k[0], o[0], lse[0], cu_q, cu_k, 3, 4, None, None, rng, 0.25,
                                    5.0, -1, 0, p, deterministic)
    assert sorted({name for name, *_ in recorded}) == ["dkdv", "dq"]
    for name, constexprs, dtype, launch_shape in recorded:
        assert not {"ROPE", "BLOCK_H", "BLOCK_H2"} & set(constexprs)
        assert (constexprs["BLOCK_D"], constexprs["BLOCK_D2"], constexprs["DROPOUT"]) == (64, 16, dropout)
        kernel = "dkdv_atomic" if constexprs.get("ATOMIC_DQ") else name
        assert tuning._configs_for(name, constexprs, dtype) is tuning._CONFIGS[(kernel, 128, "16bit", dropout)]
        flags = dict(tuning_key(kernel, dtype, constexprs, launch_shape)[3])
        assert not {"ROPE", "BLOCK_H", "BLOCK_H2"} & set(flags) and flags["DROPOUT"] is dropout


def test_rope_split_halves_option_read_at_import():
    """launch.ROPE_SPLIT_HALVES is REMAT_ATTENTION_ROPE_SPLIT_HALVES == "1" at import: off here when
    the variable is unset or another value, on in a process started with it set to 1 (one
    subprocess: an import of torch and remat, a few seconds)."""
    assert launch.ROPE_SPLIT_HALVES is (os.environ.get("REMAT_ATTENTION_ROPE_SPLIT_HALVES", "0") == "1")
    code = "from remat.kernels.attention import launch; print(launch.ROPE_SPLIT_HALVES)"
    env = dict(os.environ, REMAT_ATTENTION_ROPE_SPLIT_HALVES="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"


@pytest.mark.parametrize("split_halves,halves", [(False, (64, 0)), (True, (32, 16))], ids=["padded", "split"])
def test_features_take_the_layout_of_the_option(split_halves, halves, monkeypatch):
    """`_features` holds the forward's RoPE halves at D = 80 as the option says (its rope
    constexprs); every kernel's constexprs carry the v-side parts only; without RoPE the option
    changes nothing."""
    monkeypatch.setattr(launch, "ROPE_SPLIT_HALVES", split_halves)
    q = torch.zeros(1, 1, 1, 80)
    cos = torch.zeros(1, 1, 40)
    features = launch._features(q, 80, cos, cos, None, 0.1, 0.0, 0.0)
    assert features.rope_constexprs == dict(ROPE=True, BLOCK_H=halves[0], BLOCK_H2=halves[1])
    assert features.rope_tables == (cos, cos)
    assert (features.constexprs["BLOCK_D"], features.constexprs["BLOCK_D2"]) == (64, 16)
    assert not {"ROPE", "BLOCK_H", "BLOCK_H2"} & set(features.constexprs)
    plain = launch._features(q, 80, None, None, None, 0.1, 0.0, 0.0)
    assert plain.rope_constexprs == dict(ROPE=False, BLOCK_H=64, BLOCK_H2=0)
    assert (plain.constexprs["BLOCK_D"], plain.constexprs["BLOCK_D2"]) == (64, 16)


def test_launch_passes_the_launch_rotation_halves_whatever_the_timing(monkeypatch):
    """`_launch` compiled: the launch's BLOCK_H, BLOCK_H2 (padded or split) reach the forward kernel
    unchanged whichever tile the tuner picks (untimed or timed); under the interpreter the one
    candidate sets nothing (the tile is INTERPRETER_TILE)."""
    monkeypatch.setattr(tuning, "_INTERPRETED", False)
    for split_halves, halves in ((False, (64, 0)), (True, (32, 16))):
        constexprs = rope_constexprs(80, split_halves)
        for autotune in (False, True):
            tuner = Tuner(autotune, shared_memory_limit=lambda index: LIMIT_SM86, capturing=lambda: False,
                          time_candidate=lambda run, reset: 1.0 / run.args[0].kwargs["BLOCK_M"])
            monkeypatch.setattr(tuning, "_TUNER", tuner)
            kernel = FakeKernel()
            chosen = tuning._launch(kernel, "fwd", lambda block_m, block_n: (1, 1, 1), ("arg",), constexprs,
                                    torch.bfloat16, shape())
            (_, _, options), = kernel.launches
            assert set(chosen.kwargs) == {"BLOCK_M", "BLOCK_N"}
            assert (options["BLOCK_H"], options["BLOCK_H2"], options["BLOCK_D"], options["BLOCK_D2"]) == (
                *halves, 64, 16)
    assert [c.kwargs for c in tuning._INTERPRETER_CANDIDATES] == [{}]


# --- gpu: the real compiled path ---------------------------------------------------------------


def fresh_tuner(monkeypatch, **options):
    tuner = Tuner(True, **options)
    monkeypatch.setattr(tuning, "_TUNER", tuner)
    return tuner


def qkv(n, d=64, hq=4, hkv=2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, n, hq, d, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(2, n, hkv, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    return q, k, v


def sdpa(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    q32, k32, v32 = (t.float().transpose(1, 2) for t in (q, k, v))
    k32, v32 = (t.repeat_interleave(group, dim=1) for t in (k32, v32))
    return torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=causal).transpose(1, 2)


@pytest.mark.gpu
def test_gpu_lengths_in_other_buckets_are_tuned_separately(monkeypatch):
    tuner = fresh_tuner(monkeypatch)
    for n in (100, 120, 1000):
        q, k, v = qkv(n)
        out = remat.attention(q, k, v, causal=True, backend="triton")
        torch.testing.assert_close(out.float(), sdpa(q, k, v, True), atol=2e-2, rtol=0)
    forward_buckets = sorted(key[-1] for key in tuner.choices if key[0] == "fwd")
    assert forward_buckets == [128, 1024]


@pytest.mark.gpu
def test_gpu_shared_memory_limit_prunes_candidates(monkeypatch):
    """With a 99 KiB limit (sm_86/89/120) on any GPU, every chosen tile's compiled kernel fits it."""
    measured = {}

    class RecordingTuner(Tuner):
        def launch(self, key, candidates, shared_memory_of, run, reset=None):
            def recording(candidate):
                measured[(key, str(candidate))] = shared_memory_of(candidate)
                return measured[(key, str(candidate))]
            return super().launch(key, candidates, recording, run, reset)

    tuner = RecordingTuner(True, shared_memory_limit=lambda index: LIMIT_SM86)
    monkeypatch.setattr(tuning, "_TUNER", tuner)
    q, k, v = (t.requires_grad_() for t in qkv(300, d=128))
    for deterministic in (True, False):
        out = remat.attention(q, k, v, causal=True, backend="triton", deterministic=deterministic)
        out.float().square().sum().backward()
    assert {key[0] for key in tuner.choices} == {"fwd", "dkdv", "dq", "dkdv_atomic"}
    for key, chosen in tuner.choices.items():
        assert measured[(key, str(chosen))] <= LIMIT_SM86


@pytest.mark.gpu
def test_gpu_cuda_graph_of_forward_and_backward_after_warmup(monkeypatch):
    tuner = fresh_tuner(monkeypatch)
    static = [t.requires_grad_() for t in qkv(256)]

    def step():
        for t in static:
            t.grad = None
        out = remat.attention(*static, causal=True, backend="triton")
        out.float().square().sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    choices = dict(tuner.choices)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    assert tuner.choices == choices
    fresh = qkv(256, seed=1)
    with torch.no_grad():
        for t, new in zip(static, fresh):
            t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    graph_grads = [t.grad.clone() for t in static]
    eager_out = step()
    assert torch.equal(graph_out, eager_out)
    for graph_grad, t in zip(graph_grads, static):
        assert torch.equal(graph_grad, t.grad)


@pytest.mark.gpu
def test_gpu_capture_miss_times_nothing_and_caches_nothing(monkeypatch):
    timed = []

    def time(run, reset):
        timed.append(run)
        return tuning._time_with_events(run, reset)

    tuner = fresh_tuner(monkeypatch, time_candidate=time)
    q, k, v = qkv(1024)
    remat.attention(q, k, v, causal=True, backend="triton")  # compiles the candidates outside capture
    timed.clear()
    choices = dict(tuner.choices)
    q, k, v = qkv(2048)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = remat.attention(q, k, v, causal=True, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert timed == [] and tuner.choices == choices
    torch.testing.assert_close(out.float(), sdpa(q, k, v, True), atol=2e-2, rtol=0)
