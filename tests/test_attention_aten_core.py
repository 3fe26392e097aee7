"""The aten attention core on CUDA (PyTorch's FlashAttention-2 through aten::_flash_attention_forward
/ _flash_attention_backward) and attention's per-op default backend.

Without a GPU: which calls FlashAttention-2 takes on which GPU (capabilities substituted), the
default order on CUDA tensors (stand-ins with a CUDA device), that remat's window maps onto
FlashAttention-2's documented band, and that the forward and backward calls, dense and packed,
trace with the right shapes on fake CUDA tensors (PyTorch's meta kernels of the two ops). The
numerics run only on a GPU (marked gpu).
"""

import importlib
import types

import pytest
import torch
from test_varlen_attention import CASES as VARLEN_CASES
from test_varlen_attention import check_against_float64
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import remat
import remat.ops.attention as attention_ops
import remat.ops.attention_core as attention_core
import remat.ops.attention_cudnn as attention_cudnn
from remat.options import AttentionOptions

from _checks import assert_within_2x_of_stock
from helpers import (
    DTYPES,
    OpCalls,
    attention_eager,
    case,
    deterministic_mode,
    make_inputs,
    mask_from_output,
    run_and_check,
)

# The module (remat.functional re-exports its function `attention` under the same name).
functional_attention = importlib.import_module("remat.functional.attention")
CUDA0 = torch.device("cuda", 0)


def reason(capability, monkeypatch, *, dtype=torch.bfloat16, head_dim=64, deterministic=False, n=7, m=11,
           **options):
    monkeypatch.setattr(attention_ops, "device_capability", lambda index: capability)
    opts = AttentionOptions(0.125, deterministic=deterministic, **options)
    return attention_ops.aten_unsupported_reason(n, m, 4, 2, head_dim, dtype, CUDA0, opts)


def test_flashattention_limits_on_each_gpu(monkeypatch):
    """FlashAttention-2 takes GQA, windows and causal with N != M (bottom-right, as remat) and
    dropout (its own mask) on sm_8x/90/10x/120/121, fp16/bf16, head dims multiples of 8 up to 256
    (192 but on sm_80/sm_90); not softcap; nor other GPUs."""
    for capability in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)):
        assert reason(capability, monkeypatch) is None
        assert reason(capability, monkeypatch, window_left=5, window_right=0) is None
        assert reason(capability, monkeypatch, window_left=3, window_right=2) is None
        # Dense (the default): a right side past the last key, N = 7 < M + 2, keeps its band.
        assert reason(capability, monkeypatch, window_left=1, window_right=12) is None
        assert reason(capability, monkeypatch, dtype=torch.float16, head_dim=192) is None
        assert reason(capability, monkeypatch, dropout_p=0.1, window_left=5, window_right=0) is None
    for capability in ((7, 5), (9, 4), (11, 0), (13, 0)):
        assert "sm_8x, sm_90" in reason(capability, monkeypatch)
    assert "float16/bfloat16" in reason((9, 0), monkeypatch, dtype=torch.float32)
    assert "multiples of 8" in reason((9, 0), monkeypatch, head_dim=100)
    assert "multiples of 8" in reason((9, 0), monkeypatch, head_dim=264)
    assert reason((9, 0), monkeypatch, head_dim=256) is None and reason((8, 0), monkeypatch, head_dim=200) is None
    for capability in ((8, 6), (8, 9), (10, 0), (12, 0)):
        assert "above 192" in reason(capability, monkeypatch, head_dim=200)
    assert "softcap" in reason((9, 0), monkeypatch, softcap=30.0)
    assert "softcap" in reason((9, 0), monkeypatch, softcap=0.5)
    assert "softcap" in reason((9, 0), monkeypatch, softcap=30.0, dropout_p=0.1)
    cpu_options = AttentionOptions(0.125, dropout_p=0.1, deterministic=False)
    assert "no dropout" in attention_ops.aten_unsupported_reason(7, 7, 4, 2, 64, torch.float32, torch.device("cpu"),
                                                                 cpu_options)
    assert "N >= M + 2" in reason((9, 0), monkeypatch, n=10, m=4, window_right=5)
    monkeypatch.setattr(attention_ops, "_flash_built", lambda: False)
    assert "ROCm" in reason((9, 0), monkeypatch)


def test_flashattention_is_deterministic_only_under_pytorchs_mode(monkeypatch):
    """A deterministic backward is FlashAttention-2's only under use_deterministic_algorithms(True)
    without warn_only (the suite runs with it on: tests/conftest.py)."""
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True)
        assert reason((9, 0), monkeypatch, deterministic=True) is None
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert "atomics" in reason((9, 0), monkeypatch, deterministic=True)
        torch.use_deterministic_algorithms(False)
        assert "atomics" in reason((9, 0), monkeypatch, deterministic=True)
        assert reason((9, 0), monkeypatch, deterministic=False) is None
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_deterministic_none_follows_pytorchs_mode():
    """deterministic=None (the default) resolves to PyTorch's deterministic mode."""
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        for enabled in (True, False):
            torch.use_deterministic_algorithms(enabled)
            options = functional_attention._attention_options(16, True, None, None, None, 0.0, None)
            assert options.deterministic is enabled
            assert functional_attention._attention_options(16, True, None, None, None, 0.0, True).deterministic
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    with pytest.raises(TypeError, match="deterministic"):
        remat.attention(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), deterministic=1)


def test_each_call_asks_for_its_core_once_and_gets_a_reason(monkeypatch):
    """remat.attention (dense and packed) and remat.norm_attention ask remat.ops.attention_core once
    per call; the choice says why: a core asked for by name, or the default and why it is."""
    asked = []
    real = attention_core.choose_core
    monkeypatch.setattr(functional_attention, "choose_core", lambda *a, **kw: asked.append(a[0]) or real(*a, **kw))
    q, k, v = (torch.randn(1, 6, 2, 8) for _ in range(3))
    offsets = torch.tensor([0, 2, 6], dtype=torch.int32)
    remat.attention(q, k, v, causal=True)
    remat.attention(q[0], k[0], v[0], causal=True, cu_seqlens_q=offsets, cu_seqlens_k=offsets, backend="torch")
    weights = [torch.ones(8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(16, 8)]
    remat.norm_attention(torch.randn(1, 6, 8), *weights, num_heads=2, backend="cpp")
    assert asked == [None, "torch", "cpp"]
    plain = AttentionOptions(0.25, window_right=0)
    chosen = real("torch", q, 1, (6, 6, 2, 2, 8), plain)
    assert (chosen.name, chosen.reason) == ("torch", "asked for by name ('torch')")
    packed = real(None, q, 1, (6, 6, 2, 2, 8), plain, varlen=True)
    assert packed.name != "aten" and "packed calls" in packed.reason
    with pytest.raises(remat.BackendUnavailableError, match="packed .cu_seqlens. attention on CUDA only"):
        real("aten", q, 1, (6, 6, 2, 2, 8), plain, varlen=True)


@pytest.mark.parametrize("capability", [(9, 0), (7, 5)])
def test_cuda_default_order_is_flashattention_then_triton_then_cuda(monkeypatch, capability):
    """On a CUDA tensor attention defaults to the aten core when it takes the call, else to remat's
    Triton kernels, else (no Triton) the device default (remat's CUDA kernels where built)."""
    for module in (attention_ops, attention_cudnn):
        monkeypatch.setattr(module, "device_capability", lambda index: capability)
    monkeypatch.setattr(attention_core, "default_backend", lambda device: "cuda")
    t = types.SimpleNamespace(device=CUDA0, dtype=torch.bfloat16)
    sizes = (100, 300, 8, 2, 128)
    # A window: the cudnn core (tests/test_attention_cudnn_core.py) takes none.
    plain = AttentionOptions(0.1, window_left=64, window_right=0, deterministic=False)
    expected = "aten" if capability == (9, 0) else "triton"
    assert choose(t, 2, sizes, plain) == expected
    assert choose(t, 1, sizes, plain, varlen=True) == expected
    dropout = plain._replace(dropout_p=0.1)
    assert choose(t, 2, sizes, dropout) == expected
    capped = plain._replace(softcap=30.0)
    assert choose(t, 2, sizes, capped) == "triton"
    monkeypatch.setattr(attention_core, "unavailable_reason", lambda name, device: "Triton is not installed")
    assert choose(t, 2, sizes, capped) == "cuda"


def choose(t, batch, sizes, options, varlen=False):
    """The default attention core's name (remat.ops.attention_core's choice without a backend asked
    for)."""
    return attention_core._default_core(t, batch, sizes, options, varlen)[0]


def flash_band(n, m, causal, left, right):
    """The keys FlashAttention-2 lets query i see (bool [N, M]), from its entry code (flash_api.cpp
    mha_fwd / set_params_fprop): a side of >= seqlen_k keys becomes unbounded (-1); one query is
    never causal; causal sets right = 0; an unbounded side beside a bounded one becomes seqlen_k;
    then key j is visible iff i + M - N - left <= j <= i + M - N + right."""
    left = -1 if left is None or left >= m else left
    right = -1 if right is None or right >= m else right
    causal = causal and n > 1
    if causal:
        right = 0
    if left < 0 and right >= 0 and not causal:
        left = m
    if left >= 0 and right < 0:
        right = m
    position = torch.arange(n)[:, None] + (m - n)
    key = torch.arange(m)[None, :]
    band = torch.ones(n, m, dtype=torch.bool)
    if left >= 0:
        band &= key >= position - left
    if right >= 0:
        band &= key <= position + right
    return band


WINDOWS = [(-1, -1), (-1, 0), (2, 0), (3, 2), (-1, 1), (0, 0), (0, -1), (4, -1), (-1, 6), (1, 9), (8, -1), (12, 3)]


def test_flashattention_band_is_remats_where_the_core_takes_the_call():
    """For every N, M in 1..8 and window: where _flash_window_differs lets the call through,
    FlashAttention-2's band (its entry code's rewrites, flash_band) under _flash_window's
    arguments is exactly remat's (remat.ops.attention._visible); the refused cases include ones
    where the bands really differ, and dense calls are refused only where some query sits two or
    more positions before the first key (N >= M + 2), as documented."""
    refused_and_different = 0
    for n in range(1, 9):
        for m in range(1, 9):
            for window in WINDOWS:
                remat_band = attention_ops._visible(0, n, n, m, *window, torch.device("cpu"))
                flash = flash_band(n, m, *attention_ops._flash_window(*window))
                if attention_ops._flash_window_differs(n, m, *window, varlen=False):
                    # Causal windows (right side 0) keep their band in FlashAttention-2 for any N, M.
                    assert n >= m + 2 and window[1] != 0, (n, m, window)
                    refused_and_different += not torch.equal(flash, remat_band)
                else:
                    assert torch.equal(flash, remat_band), (n, m, window)
    assert refused_and_different > 0
    assert attention_ops._flash_window_differs(3, 3, -1, 3, varlen=True)  # packed: by max_seqlen_k alone


def test_only_the_triton_training_path_rotates_rope_once_outside_its_kernels():
    """rope_rotated_once: the Triton backend with tables and a backward to come rotates q and k
    once per pass outside its kernels; every other backend, call without tables or forward-only
    Triton call keeps the rotation where the backend has it (the PyTorch cores always rotate
    outside: their ops are rotated_once already)."""
    import remat.backend as backend_module

    for backend in backend_module.BACKENDS:
        for rope in (False, True):
            for needs_grad in (False, True):
                expected = backend == "triton" and rope and needs_grad
                assert attention_ops.rope_rotated_once(backend, rope, needs_grad) is expected, (backend, rope,
                                                                                               needs_grad)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("torch_deterministic", [True, False], ids=["deterministic-mode", "nondeterministic"])
def test_dense_and_packed_calls_trace_on_fake_cuda_tensors(monkeypatch, rope, torch_deterministic):
    """The aten core's CUDA forward and backward, dense (GQA, causal window, N != M) and packed,
    run through PyTorch's meta kernels of _flash_attention_forward/_backward: o like q (contiguous),
    lse fp32 [B, Hq, N] ([Hq, total_q] packed), gradients in the inputs' shapes and dtype. In and
    outside PyTorch's deterministic mode (outside, the backward is asked for the atomic one: the
    forward, which has no deterministic variant, must not refuse either way)."""
    monkeypatch.setattr(attention_ops, "device_capability", lambda index: (9, 0))
    deterministic = torch_deterministic
    with deterministic_mode(torch_deterministic), FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 5, 4, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 9, 2, 64, device="cuda", dtype=torch.bfloat16)
        cos = sin = torch.empty(1, 9, 32, device="cuda") if rope else None
        o, lse = attention_ops.aten_attention_fwd(q, k, k, cos, sin, None, 0.125, 0.0, 3, 0, 0.0)
        assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
        assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
        grads = attention_ops.aten_attention_bwd(o, q, k, k, o, lse, cos, sin, None, 0.125, 0.0, 3, 0, 0.0,
                                                 deterministic)
        assert [(g.shape, g.dtype) for g in grads] == [(q.shape, q.dtype), (k.shape, k.dtype), (k.shape, k.dtype)]
        qp = torch.empty(11, 4, 32, device="cuda", dtype=torch.float16)
        kp = torch.empty(13, 1, 32, device="cuda", dtype=torch.float16)
        cu_q = torch.tensor([0, 4, 11], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 6, 13], dtype=torch.int32, device="cuda")
        cos = sin = torch.empty(8, 16, device="cuda") if rope else None
        o, lse = attention_ops.aten_attention_varlen_fwd(qp, kp, kp, cu_q, cu_k, 7, 7, cos, sin, None, 0.2, 0.0, -1,
                                                         0, 0.0)
        assert o.shape == qp.shape and o.is_contiguous() and lse.shape == (4, 11) and lse.dtype == torch.float32
        grads = attention_ops.aten_attention_varlen_bwd(o, qp, kp, kp, o, lse, cu_q, cu_k, 7, 7, cos, sin, None, 0.2,
                                                        0.0, -1, 0, 0.0, deterministic)
        assert [g.shape for g in grads] == [qp.shape, kp.shape, kp.shape]


class _FlashCalls(TorchDispatchMode):
    """Records the FlashAttention-2 forward and backward calls, the copies made between them and
    any random draw, with their arguments and outputs."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.flash_kwargs = []  # the keyword arguments of each FlashAttention-2 call, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flash = func in (torch.ops.aten._flash_attention_forward.default,
                         torch.ops.aten._flash_attention_backward.default)
        if flash or func is torch.ops.aten.copy_.default or func.overloadpacket is torch.ops.aten.randint:
            self.calls.append((func, args, out))
        if flash:
            self.flash_kwargs.append(kwargs or {})
        return out


def _storage(t):
    return t.untyped_storage()._cdata


def test_dense_flashattention_calls_get_the_calls_sizes_and_window(monkeypatch):
    """A dense call on fake CUDA tensors with a window whose right side reaches past the last key
    (3 left, 12 right; N = 5 < M + 2, which FlashAttention-2's rewrite leaves the same band):
    taken, and FlashAttention-2 gets the very q, k, v, no offsets, max_q = N and max_k = M, no
    dropout, no debug mask, not causal, the window and the scale; its backward gets a stride-1
    output gradient when the caller's is strided, the same sizes, window and scale."""
    monkeypatch.setattr(attention_ops, "device_capability", lambda index: (9, 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 5, 4, 64, device=CUDA0, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(2, 9, 2, 64, device=CUDA0, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        douts = _strided_output_gradients((2, 5, 4, 64))
        with _FlashCalls() as spy:
            o = remat.attention(q, k, v, window=(3, 12), scale=0.3, backend="aten")
            o.grad_fn.apply(douts[0])
            # The core's entry called directly (the Function may have made the gradient contiguous).
            lse = torch.empty(2, 4, 5, device=CUDA0)
            for dout in douts:
                attention_ops.aten_attention_bwd(dout, q, k, v, o, lse, None, None, None, 0.3, 0.0, 3, 12, 0.0, True)
    flash_ops = (torch.ops.aten._flash_attention_forward.default, torch.ops.aten._flash_attention_backward.default)
    (forward, forward_args), *backwards = ((f, a) for f, a, _ in spy.calls if f in flash_ops)
    assert forward is torch.ops.aten._flash_attention_forward.default
    assert [_storage(t) for t in forward_args[:3]] == [_storage(t) for t in (q, k, v)]
    assert forward_args[3:10] == (None, None, 5, 9, 0.0, False, False)
    assert len(backwards) == 1 + len(douts)
    for (backward, backward_args), dout in zip(backwards, douts[:1] + douts):
        assert backward is torch.ops.aten._flash_attention_backward.default
        assert backward_args[0].stride(-1) == 1 and dout.stride(-1) != 1
        assert backward_args[8:12] == (5, 9, 0.0, False)
    assert len(spy.flash_kwargs) == 2 + len(douts)
    assert all(c["scale"] == 0.3 and c["window_size_left"] == 3 and c["window_size_right"] == 12
               for c in spy.flash_kwargs)


def _strided_output_gradients(shape):
    """Fake CUDA output gradients of ``shape`` whose last dim is not unit-stride, three ways: every
    other element, the last two dims transposed, and the second dim innermost."""
    *lead, last = shape
    every_other = torch.empty(*lead, 2 * last, device=CUDA0, dtype=torch.bfloat16)[..., ::2]
    transposed = torch.empty(*lead[:-1], last, lead[-1], device=CUDA0, dtype=torch.bfloat16).transpose(-1, -2)
    order = list(range(len(shape)))
    inner = order[:1] + order[2:] + order[1:2]  # dim 1 stored innermost
    second_inner = torch.empty(*(shape[i] for i in inner), device=CUDA0, dtype=torch.bfloat16).permute(
        *(inner.index(i) for i in order))
    douts = [every_other, transposed, second_inner]
    assert all(tuple(t.shape) == tuple(shape) and t.stride(-1) != 1 for t in douts)
    return douts


def test_packed_flashattention_calls_get_the_offsets_and_sizes(monkeypatch):
    """A packed call on fake CUDA tensors: FlashAttention-2's variable-length forward gets the
    offsets, max_seqlen_q / max_seqlen_k, no dropout, the causal flag and no debug mask; its
    backward a stride-1 output gradient for strided ones, and the same offsets and sizes."""
    monkeypatch.setattr(attention_ops, "device_capability", lambda index: (9, 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        qp = torch.empty(11, 4, 32, device=CUDA0, dtype=torch.bfloat16)
        kp = torch.empty(13, 1, 32, device=CUDA0, dtype=torch.bfloat16)
        cu_q = torch.tensor([0, 4, 11], dtype=torch.int32, device=CUDA0)
        cu_k = torch.tensor([0, 6, 13], dtype=torch.int32, device=CUDA0)
        douts = _strided_output_gradients((11, 4, 32))
        with _FlashCalls() as spy:
            o, lse = attention_ops.aten_attention_varlen_fwd(qp, kp, kp, cu_q, cu_k, 7, 7, None, None, None, 0.2, 0.0,
                                                             -1, 0, 0.0)
            for dout in douts:
                attention_ops.aten_attention_varlen_bwd(dout, qp, kp, kp, o, lse, cu_q, cu_k, 7, 7, None, None, None,
                                                        0.2, 0.0, -1, 0, 0.0, True)
    (forward, forward_args, _), *backwards = spy.calls
    assert forward is torch.ops.aten._flash_attention_forward.default
    assert forward_args[3] is cu_q and forward_args[4] is cu_k and forward_args[5:10] == (7, 7, 0.0, True, False)
    assert len(backwards) == len(douts)
    for (backward, backward_args, _), dout in zip(backwards, douts):
        assert backward is torch.ops.aten._flash_attention_backward.default
        assert backward_args[0].stride(-1) == 1 and dout.stride(-1) != 1
        assert backward_args[6] is cu_q and backward_args[7] is cu_k and backward_args[8:12] == (7, 7, 0.0, True)


def test_packed_flashattention_core_checks_its_call_itself(monkeypatch):
    """Called directly, the packed entry refuses what FlashAttention-2 cannot run (a head dim
    over 256), before the kernel sees it."""
    monkeypatch.setattr(attention_ops, "device_capability", lambda index: (9, 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        qp = torch.empty(11, 2, 264, device=CUDA0, dtype=torch.bfloat16)
        cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=CUDA0)
        with _FlashCalls() as spy, pytest.raises(ValueError, match="up to 256"):
            attention_ops._aten_core_varlen_fwd(qp, qp, qp, cu, cu, 7, 7, None, None, None, 0.2, 0.0, -1, 0, 0.0)
        assert spy.calls == []


def test_cpu_flash_calls_get_no_dropout_the_causal_flag_and_the_scale():
    """The CPU flash kernel's forward and backward get dropout 0, the causal flag and the scale,
    on [B, H, N, D] views of remat's tensors."""
    q, k, v = (torch.randn(1, 6, 2, 16, requires_grad=True) for _ in range(3))
    with _cpu_flash_calls() as spy:
        o = remat.attention(q, k, v, causal=True, scale=0.3, backend="aten")
        o.backward(torch.randn_like(o))
    (forward, forward_args, forward_kwargs, _), (backward, backward_args, backward_kwargs, _) = spy.calls
    assert forward is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert [tuple(t.shape) for t in forward_args[:3]] == [(1, 2, 6, 16)] * 3
    assert forward_args[3:5] + (0.0, False)[len(forward_args[3:5]):] == (0.0, True)
    assert backward is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert backward_args[6:8] == (0.0, True)
    assert forward_kwargs["scale"] == backward_kwargs["scale"] == 0.3


def _cpu_flash_calls():
    """Records the CPU flash kernel's forward and backward calls with their arguments and outputs."""
    return OpCalls((torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default))


def test_flashattention_core_refuses_a_dropout_call_without_its_buffer(monkeypatch):
    """The aten core's CUDA forward with dropout needs the int64 [2] buffer for FlashAttention-2's
    seed and offset; without it (or with a wrong one) it says so instead of dropping them."""
    monkeypatch.setattr(attention_ops, "device_capability", lambda index: (9, 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 4, 2, 32, device=CUDA0, dtype=torch.float16)
        for rng in (None, torch.empty(2, dtype=torch.int32, device=CUDA0), torch.empty(3, dtype=torch.int64,
                                                                                    device=CUDA0)):
            with pytest.raises(ValueError, match="int64 \\[2\\] buffer"):
                attention_ops.aten_attention_fwd(q, q, q, None, None, rng, 0.2, 0.0, -1, 0, 0.1)


def test_flashattention_cores_take_no_rope_tables():
    """The PyTorch cores' entries (rope is rotated around them by rotated_once) refuse tables,
    forward and backward, dense and packed, aten and cudnn, instead of ignoring them."""
    q = torch.randn(7, 2, 16)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    tables = torch.randn(7, 8)
    with pytest.raises(ValueError, match="takes q and k rotated"):
        attention_ops._aten_core_varlen_fwd(q, q, q, cu, cu, 4, 4, tables, tables, None, 0.25, 0.0, -1, 0, 0.0)
    with pytest.raises(ValueError, match="takes q and k rotated"):
        attention_ops._aten_core_fwd(q[None], q[None], q[None], tables, tables, None, 0.25, 0.0, -1, 0, 0.0)
    o, lse = attention_ops._aten_core_fwd(q[None], q[None], q[None], None, None, None, 0.25, 0.0, -1, 0, 0.0)
    with pytest.raises(ValueError, match="takes q and k rotated"):
        attention_ops._aten_core_bwd(o, q[None], q[None], q[None], o, lse, tables, tables, None, 0.25, 0.0, -1, 0,
                                     0.0, True)
    with pytest.raises(ValueError, match="takes q and k rotated"):
        attention_ops._aten_core_varlen_bwd(q, q, q, q, q, lse[0], cu, cu, 4, 4, tables, tables, None, 0.25, 0.0, -1,
                                            0, 0.0, True)
    with pytest.raises(ValueError, match="takes q and k rotated"):
        attention_cudnn._cudnn_core_fwd(q[None], q[None], q[None], tables, tables, None, 0.25, 0.0, -1, 0, 0.0)
    with pytest.raises(ValueError, match="takes q and k rotated"):
        attention_cudnn._cudnn_core_bwd(o, q[None], q[None], q[None], o, lse, tables, tables, None, 0.25, 0.0, -1, 0,
                                        0.0, False)


def _check_flash_dropout_calls(calls, saved, p):
    """The forward ran with dropout p, its rng_state was copied into the one 16-byte int64 buffer
    that was saved, and the backward ran with p and that buffer (as uint64); nothing else drew from
    the generator (which would move FlashAttention-2's seed off SDPA's)."""
    (forward, forward_args, forward_out), (copy, copy_args, _), (backward, backward_args, _) = calls
    assert forward is torch.ops.aten._flash_attention_forward.default and forward_args[7] == p
    assert copy is torch.ops.aten.copy_.default and _storage(copy_args[1]) == _storage(forward_out[2])
    buffers = [t for t in saved if t.dtype == torch.int64]
    assert len(buffers) == 1 and buffers[0].shape == (2,) and _storage(buffers[0]) == _storage(copy_args[0])
    assert backward is torch.ops.aten._flash_attention_backward.default and backward_args[10] == p
    assert backward_args[12].dtype == torch.uint64 and _storage(backward_args[12]) == _storage(buffers[0])


@pytest.mark.parametrize("rope", [False, True])
def test_dropout_on_flashattention_saves_its_own_seed_and_offset(monkeypatch, rope):
    """Dropout on the aten core (fake CUDA tensors through PyTorch's meta kernels): FlashAttention-2
    draws its own seed and offset; remat saves them (16 bytes, as remat's own (seed, offset)) and
    hands them to the backward, dense and packed, with rope around the core."""
    from remat.autograd.attention import VarlenAttentionFunction

    monkeypatch.setattr(attention_ops, "device_capability", lambda index: (9, 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 5, 4, 64, device=CUDA0, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(2, 9, 2, 64, device=CUDA0, dtype=torch.bfloat16, requires_grad=True)
        rope_tables = (torch.empty(9, 32, device=CUDA0), torch.empty(9, 32, device=CUDA0)) if rope else None
        saved = []
        with _FlashCalls() as spy:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                o = remat.attention(q, k, k, causal=True, dropout_p=0.25, rope=rope_tables, backend="aten")
            # The autograd engine needs a real CUDA context; the Function's backward is called directly.
            grads = o.grad_fn.apply(torch.empty_like(o))
        _check_flash_dropout_calls(spy.calls, saved, 0.25)
        # q, k, v (k again), o, fp32 lse [2, 4, 5], the 16-byte RNG state, the caller's tables.
        assert sum(t.nbytes for t in saved) == 2 * q.nbytes + 2 * k.nbytes + 2 * 4 * 5 * 4 + 16 + \
            (2 * 9 * 32 * 4 if rope else 0)
        assert [g.shape for g in grads[:3]] == [q.shape, k.shape, k.shape]

        qp = torch.empty(11, 4, 32, device=CUDA0, dtype=torch.float16, requires_grad=True)
        kp = torch.empty(13, 1, 32, device=CUDA0, dtype=torch.float16, requires_grad=True)
        cu_q = torch.tensor([0, 4, 11], dtype=torch.int32, device=CUDA0)
        cu_k = torch.tensor([0, 6, 13], dtype=torch.int32, device=CUDA0)
        cos = sin = torch.empty(8, 16, device=CUDA0) if rope else None
        options = AttentionOptions(0.2, window_right=0, dropout_p=0.1, deterministic=False)
        saved = []
        with _FlashCalls() as spy:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                o = VarlenAttentionFunction.apply(qp, kp, kp, cu_q, cu_k, 7, 7, cos, sin, options, "aten", False)
            grads = o.grad_fn.apply(torch.empty_like(o))
        _check_flash_dropout_calls(spy.calls, saved, 0.1)
        assert [g.shape for g in grads[:3]] == [qp.shape, kp.shape, kp.shape]


@pytest.mark.parametrize("keep_qkv", [True, False], ids=["keep-qkv", "recompute-qkv"])
def test_fused_attention_sub_block_takes_flashattentions_dropout(monkeypatch, keep_qkv):
    """The fused layers' attention sub-block (NormAttentionFunction, both policies) with dropout on
    the aten core, on fake CUDA tensors: the same plumbing as remat.attention (one forward, the
    copy into the saved buffer, one backward reading it); recomputing q, k, v in backward does not
    rerun the attention forward."""
    from remat.autograd.norm_attention import NormAttentionFunction
    from remat.options import NormAttentionOptions

    monkeypatch.setattr(attention_ops, "device_capability", lambda index: (9, 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        b, n, hidden, hq, hkv, d = 2, 6, 32, 4, 2, 16
        x, norm_weight, w_q, w_k, w_v = (torch.empty(*shape, device=CUDA0, dtype=torch.bfloat16, requires_grad=True)
                                         for shape in ((b, n, hidden), (hidden,), (hq * d, hidden), (hkv * d, hidden),
                                                       (hkv * d, hidden)))
        options = NormAttentionOptions((b, n, hq, hkv, d), "rms", 1e-6,
                                       AttentionOptions(0.25, window_right=0, dropout_p=0.1, deterministic=False),
                                       keep_qkv, "torch")
        saved = []
        with _FlashCalls() as spy:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                o = NormAttentionFunction.apply(x, norm_weight, None, w_q, w_k, w_v, *([None] * 9), options, "aten",
                                                False, ())
            grads = o.grad_fn.apply(torch.empty_like(o))
        _check_flash_dropout_calls(spy.calls, saved, 0.1)
        assert grads[0].shape == x.shape and grads[3].shape == w_q.shape


def test_packed_aten_on_cpu_is_refused():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q = torch.randn(7, 2, 16)
    with pytest.raises(remat.BackendUnavailableError, match="CUDA only"):
        remat.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="aten")


# On a GPU (not run here): FlashAttention-2 inside remat's Function against float64.
FLASH_CASES = [
    case("b2-n1024-d128-gqa4-causal", 2, 1024, 1024, 8, 2, 128, causal=True),
    case("n257-m100-d80-causal-emptyrows", 1, 257, 100, 4, 2, 80, causal=True),
    case("n100-m257-d64-causal-window-rope", 2, 100, 257, 4, 1, 64, causal=True, window=(50, None), rope="per_batch"),
    case("n129-d256-window-both", 1, 129, 129, 2, 2, 256, window=(17, 9)),
    case("n333-d192-bhnd", 1, 333, 333, 2, 1, 192, layout="bhnd"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
@pytest.mark.parametrize("spec", FLASH_CASES)
def test_gpu_flashattention_core_matches_float64_reference(spec, dtype):
    """Under the suite's deterministic mode, so FlashAttention-2 runs its deterministic backward."""
    run_and_check(spec, dtype, "aten", device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [c for c in VARLEN_CASES if not (c.values[0].get("softcap") or
                                                                   c.values[0].get("dropout"))])
def test_gpu_flashattention_packed_matches_float64_reference(spec):
    check_against_float64("aten", spec, torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,m,d,causal", [(1024, 1024, 128, True), (300, 511, 64, False)], ids=["causal", "n300-m511"])
def test_gpu_flashattention_dropout_is_sdpa_flashs(n, m, d, causal, dtype):
    """With dropout the aten core runs what torch's SDPA runs on its flash backend: the same kernel
    with the seed and offset it draws from the same generator state, so o and the gradients are
    bitwise SDPA's (both under the suite's deterministic mode: FlashAttention-2's deterministic
    backward); and dropout was applied."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, length, 4, d, generator=g).to("cuda", dtype) for length in (n, m, m, n))
    results = {}
    for run, p in (("remat", 0.2), ("sdpa", 0.2), ("remat", 0.0)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(7)
        if run == "remat":
            o = remat.attention(*leaves, causal=causal, dropout_p=p, backend="aten")
        else:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), dropout_p=p,
                                                   is_causal=causal).transpose(1, 2)
        o.backward(dout)
        results[run, p] = [o.detach()] + [t.grad for t in leaves]
    for name, mine, stock in zip(("o", "dq", "dk", "dv"), results["remat", 0.2], results["sdpa", 0.2]):
        assert torch.equal(mine, stock), name
    assert not torch.equal(results["remat", 0.2][0], results["remat", 0.0][0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_flashattention_dropout_matches_float64_reference_with_its_mask(dtype):
    """FlashAttention-2's dropout mask, read back from its output (q = 0, v = I with M = D:
    helpers.mask_from_output) for the same shapes, generator state and kernel: keeps about 1 - p,
    and with it remat's aten core on random inputs meets the 2x rule against float64 (o, dq, dk,
    dv), so forward and backward apply that one mask."""
    spec = dict(b=2, n=70, m=64, hq=4, hkv=1, d=64, dropout=0.25)
    keep = mask_from_output("aten", 2, 4, 70, 64, 0.25, seed=11, device="cuda", dtype=dtype)
    assert abs(keep.float().mean().item() - 0.75) < 0.02
    q, k, v, dout, _ = make_inputs(spec, dtype, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11)
    o = remat.attention(*leaves, dropout_p=0.25, backend="aten")
    o.backward(dout)
    reference = attention_eager(q, k, v, dout, None, spec, keep, torch.float64)
    stock = attention_eager(q, k, v, dout, None, spec, keep, dtype)
    for name, value, stock_value, ref in zip(("o", "dq", "dk", "dv"), [o] + [t.grad for t in leaves], stock,
                                             reference):
        assert_within_2x_of_stock(name, value.detach().cpu(), stock_value, ref, dtype)


@pytest.mark.gpu
def test_gpu_default_is_flashattention_and_saves_what_triton_saves():
    """The default on a CUDA bf16 call under the suite's deterministic mode is the aten core
    (FlashAttention-2's deterministic backward; the cudnn core, the default outside that mode on
    sm_90/sm_10x, has none); it saves the same bytes as remat's Triton kernels (q, k, v, o, lse)
    and agrees with them within the 2x rule."""
    import remat.autograd.attention as attention_function

    spec = case("b1-n300-d64-gqa-causal", 1, 300, 300, 4, 2, 64, causal=True)
    q, k, v, dout, _ = make_inputs(spec, torch.bfloat16, device="cuda")
    used, saved = [], {}
    real = attention_function.ops_for
    attention_function.ops_for = lambda block, name: used.append(name) or real(block, name)
    try:
        for backend in (None, "triton"):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            sizes = []

            def pack(t, sizes=sizes):
                sizes.append(t.nbytes)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                o = remat.attention(*leaves, causal=True, backend=backend)
            o.backward(dout)
            saved[backend] = sum(sizes)
    finally:
        attention_function.ops_for = real
    assert used[0] == "aten"
    assert saved[None] == saved["triton"]
    reference = attention_eager(q, k, v, dout, None, spec, None, torch.float64)
    stock = attention_eager(q, k, v, dout, None, spec, None, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = remat.attention(*leaves, causal=True)
    o.backward(dout)
    for name, value, stock_value, ref in zip(("o", "dq", "dk", "dv"), [o] + [t.grad for t in leaves], stock,
                                             reference):
        assert_within_2x_of_stock(name, value.detach().cpu(), stock_value, ref, torch.bfloat16)
