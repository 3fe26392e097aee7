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

import remat
import remat.ops.attention as attention_ops
from remat.options import AttentionOptions

from _checks import assert_within_2x_of_stock
from helpers import DTYPES, attention_eager, case, make_inputs, run_and_check

# The module (remat.functional re-exports its function `attention` under the same name).
functional_attention = importlib.import_module("remat.functional.attention")
CUDA0 = torch.device("cuda", 0)


def reason(capability, monkeypatch, *, dtype=torch.bfloat16, head_dim=64, deterministic=False, n=7, m=11,
           **options):
    monkeypatch.setattr(attention_ops, "device_capability", lambda index: capability)
    opts = AttentionOptions(0.125, deterministic=deterministic, **options)
    return attention_ops.aten_unsupported_reason(n, m, 4, 2, head_dim, dtype, CUDA0, opts)


def test_flashattention_limits_on_each_gpu(monkeypatch):
    """FlashAttention-2 takes GQA, windows and causal with N != M (bottom-right, as remat) on
    sm_8x/90/10x/120/121, fp16/bf16, head dims multiples of 8 up to 256 (192 but on sm_80/sm_90);
    not softcap or remat's dropout stream; nor other GPUs."""
    for capability in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)):
        assert reason(capability, monkeypatch) is None
        assert reason(capability, monkeypatch, window_left=5, window_right=0) is None
        assert reason(capability, monkeypatch, window_left=3, window_right=2) is None
        assert reason(capability, monkeypatch, dtype=torch.float16, head_dim=192) is None
    for capability in ((7, 5), (9, 4), (11, 0), (13, 0)):
        assert "sm_8x, sm_90" in reason(capability, monkeypatch)
    assert "float16/bfloat16" in reason((9, 0), monkeypatch, dtype=torch.float32)
    assert "multiples of 8" in reason((9, 0), monkeypatch, head_dim=100)
    assert "multiples of 8" in reason((9, 0), monkeypatch, head_dim=264)
    assert reason((9, 0), monkeypatch, head_dim=256) is None and reason((8, 0), monkeypatch, head_dim=200) is None
    for capability in ((8, 6), (8, 9), (10, 0), (12, 0)):
        assert "above 192" in reason(capability, monkeypatch, head_dim=200)
    assert "softcap" in reason((9, 0), monkeypatch, softcap=30.0)
    assert "Philox" in reason((9, 0), monkeypatch, dropout_p=0.1)
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


@pytest.mark.parametrize("capability", [(9, 0), (7, 5)])
def test_cuda_default_order_is_flashattention_then_triton_then_cuda(monkeypatch, capability):
    """On a CUDA tensor attention defaults to the aten core when it takes the call, else to remat's
    Triton kernels, else (no Triton) the device default (remat's CUDA kernels where built)."""
    monkeypatch.setattr(attention_ops, "device_capability", lambda index: capability)
    monkeypatch.setattr(functional_attention, "default_backend", lambda device: "cuda")
    t = types.SimpleNamespace(device=CUDA0, dtype=torch.bfloat16)
    sizes = (100, 300, 8, 2, 128)
    plain = AttentionOptions(0.1, window_left=64, window_right=0, deterministic=False)
    expected = "aten" if capability == (9, 0) else "triton"
    assert functional_attention._default_attention_backend(t, sizes, plain) == expected
    assert functional_attention._default_attention_backend(t, sizes, plain, varlen=True) == expected
    capped = plain._replace(softcap=30.0)
    assert functional_attention._default_attention_backend(t, sizes, capped) == "triton"
    monkeypatch.setattr(functional_attention, "unavailable_reason", lambda name, device: "Triton is not installed")
    assert functional_attention._default_attention_backend(t, sizes, capped) == "cuda"


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


WINDOWS = [(-1, -1), (-1, 0), (2, 0), (3, 2), (-1, 1), (0, 0), (4, -1), (-1, 6), (1, 9), (8, -1), (12, 3)]


def test_flashattention_band_is_remats_where_the_core_takes_the_call():
    """For every N, M in 1..8 and window: where _flash_window_differs lets the call through,
    FlashAttention-2's band (its entry code's rewrites, flash_band) under _flash_window's
    arguments is exactly remat's (remat.ops.attention._visible); the refused cases include ones
    where the bands really differ."""
    refused_and_different = 0
    for n in range(1, 9):
        for m in range(1, 9):
            for window in WINDOWS:
                remat_band = attention_ops._visible(0, n, n, m, *window, torch.device("cpu"))
                flash = flash_band(n, m, *attention_ops._flash_window(*window))
                if attention_ops._flash_window_differs(n, m, *window, varlen=False):
                    refused_and_different += not torch.equal(flash, remat_band)
                else:
                    assert torch.equal(flash, remat_band), (n, m, window)
    assert refused_and_different > 0
    assert attention_ops._flash_window_differs(3, 3, -1, 3, varlen=True)  # packed: by max_seqlen_k alone


@pytest.mark.parametrize("rope", [False, True])
def test_dense_and_packed_calls_trace_on_fake_cuda_tensors(monkeypatch, rope):
    """The aten core's CUDA forward and backward, dense (GQA, causal window, N != M) and packed,
    run through PyTorch's meta kernels of _flash_attention_forward/_backward: o like q (contiguous),
    lse fp32 [B, Hq, N] ([Hq, total_q] packed), gradients in the inputs' shapes and dtype."""
    monkeypatch.setattr(attention_ops, "device_capability", lambda index: (9, 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 5, 4, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 9, 2, 64, device="cuda", dtype=torch.bfloat16)
        cos = sin = torch.empty(1, 9, 32, device="cuda") if rope else None
        o, lse = attention_ops.aten_attention_fwd(q, k, k, cos, sin, None, 0.125, 0.0, 3, 0, 0.0)
        assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
        assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
        grads = attention_ops.aten_attention_bwd(o, q, k, k, o, lse, cos, sin, None, 0.125, 0.0, 3, 0, 0.0, True)
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
                                                        0.0, -1, 0, 0.0, True)
        assert [g.shape for g in grads] == [qp.shape, kp.shape, kp.shape]


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
def test_gpu_default_is_flashattention_and_saves_what_triton_saves():
    """The default on a CUDA bf16 call is the aten core; it saves the same bytes as remat's
    Triton kernels (q, k, v, o, lse) and agrees with them within the 2x rule."""
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
