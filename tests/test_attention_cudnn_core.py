"""The cudnn attention core (cuDNN's fused attention through aten::_scaled_dot_product_cudnn_attention
and its backward) and its place in attention's default order on CUDA.

Without a GPU: when stock PyTorch tries cuDNN first (capabilities, cuDNN versions and the
environment substituted), which calls the core takes, the default order, and that the forward and
backward calls trace on fake CUDA tensors through PyTorch's meta kernels with the layouts and
arguments cuDNN needs (a dispatch spy records them). The numerics run only on a GPU (marked gpu).
The suite runs under torch.use_deterministic_algorithms(True), under which cuDNN's
nondeterministic backward is refused, so the tests of the core turn it off.
"""

import types
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import remat
import remat.ops.attention as attention_ops
import remat.ops.attention_core as attention_core
import remat.ops.attention_cudnn as attention_cudnn
import remat.ops.rope as rope_ops
from remat.memory import saved_bytes
from remat.options import AttentionOptions

from _checks import assert_within_2x_of_stock
from helpers import (
    CompileCounter,
    OpCalls,
    batch,
    case,
    causal_lm,
    deterministic_mode,
    llama_config,
    logits_and_grads,
    make_inputs,
    run_and_check,
)

CUDA0 = torch.device("cuda", 0)
PLAIN = AttentionOptions(0.125, window_right=0, deterministic=False)


def on_gpu(monkeypatch, capability, cudnn_version=92400, cuda="13.0"):
    """Pretend a GPU of ``capability`` with cuDNN ``cudnn_version`` under CUDA ``cuda``."""
    for module in (attention_ops, attention_cudnn):
        monkeypatch.setattr(module, "device_capability", lambda index: capability)
    monkeypatch.setattr(attention_cudnn, "_cudnn_version", lambda: cudnn_version)
    monkeypatch.setattr(torch.version, "cuda", cuda)


def reason(batch=2, n=64, m=64, hq=8, hkv=2, head_dim=128, dtype=torch.bfloat16, device=CUDA0, options=PLAIN,
           **kwargs):
    with deterministic_mode(False):
        return attention_cudnn.cudnn_unsupported_reason(batch, n, m, hq, hkv, head_dim, dtype, device, options,
                                                        **kwargs)


def test_cudnn_is_preferred_where_pytorch_tries_it_first(monkeypatch):
    """torch 2.14's rule (sdp_utils.cpp check_prefer_cudnn_attention): cuDNN newer than 9.15 on
    sm_9x/sm_10x (before CUDA 13: minors 0 and 3 only), unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1."""
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    for capability, expected in (((9, 0), True), ((10, 0), True), ((10, 3), True), ((10, 1), True), ((8, 0), False),
                                 ((8, 9), False), ((12, 0), False), ((11, 0), False)):
        on_gpu(monkeypatch, capability)
        assert attention_cudnn.cudnn_preferred(CUDA0) is expected, capability
    on_gpu(monkeypatch, (10, 1), cuda="12.8")
    assert not attention_cudnn.cudnn_preferred(CUDA0)
    on_gpu(monkeypatch, (10, 3), cuda="12.8")
    assert attention_cudnn.cudnn_preferred(CUDA0)
    for version in (91500, 91400, None):
        on_gpu(monkeypatch, (9, 0), cudnn_version=version)
        assert not attention_cudnn.cudnn_preferred(CUDA0)
    on_gpu(monkeypatch, (9, 0), cudnn_version=91501)
    assert attention_cudnn.cudnn_preferred(CUDA0)
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0")
    assert attention_cudnn.cudnn_preferred(CUDA0)
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert not attention_cudnn.cudnn_preferred(CUDA0)


def test_what_the_cudnn_core_takes(monkeypatch):
    """GQA/MQA, causal with N == M or no mask with any N, M, fp16/bf16, head dims multiples of 8
    up to 128, at least two queries and keys, a nondeterministic backward; nothing else, each
    refusal saying why."""
    on_gpu(monkeypatch, (9, 0))
    assert reason() is None
    assert reason(n=300, m=511, options=PLAIN._replace(window_right=-1)) is None
    assert reason(hkv=1, head_dim=8, dtype=torch.float16) is None
    assert reason(batch=65535, hq=65535, hkv=65535) is None
    refusals = [
        (dict(options=PLAIN._replace(softcap=30.0)), "softcap"),
        (dict(options=PLAIN._replace(softcap=0.5)), "softcap"),
        (dict(options=PLAIN._replace(dropout_p=0.1)), "dropout"),
        (dict(options=PLAIN._replace(window_left=16)), "sliding window"),
        (dict(options=PLAIN._replace(window_left=0)), "sliding window"),  # the diagonal alone
        (dict(options=PLAIN._replace(window_right=4)), "sliding window"),
        (dict(n=63), "top-left"),
        (dict(varlen=True), "packed"),
        (dict(device=torch.device("cpu")), "CUDA tensors"),
        (dict(dtype=torch.float32), "float16/bfloat16"),
        (dict(head_dim=100), "multiples of 8"),
        (dict(head_dim=136), "up to 128"),
        (dict(head_dim=256), "up to 128"),
        (dict(batch=65536), "65535"),
        (dict(hq=65536, hkv=1), "65535"),
        (dict(n=1, m=1), "decoding"),
        (dict(n=2, m=1, options=PLAIN._replace(window_right=-1)), "one key"),
        (dict(options=PLAIN._replace(deterministic=True)), "not deterministic"),
    ]
    for kwargs, match in refusals:
        assert match in (reason(**kwargs) or ""), (kwargs, match)
    torch.use_deterministic_algorithms(True)  # the suite's setting, restored by the next reason()
    assert "not deterministic" in attention_cudnn.cudnn_unsupported_reason(2, 64, 64, 8, 2, 128, torch.bfloat16,
                                                                           CUDA0, PLAIN)
    for capability in ((7, 5), (12, 2), (13, 0)):
        on_gpu(monkeypatch, capability)
        assert "sm_80 to sm_121" in reason()
    for capability in ((8, 0), (12, 1)):  # both ends of PyTorch's range
        on_gpu(monkeypatch, capability)
        assert reason() is None, capability
    on_gpu(monkeypatch, (9, 0))
    assert reason(n=2, m=2) is None  # the fewest queries and keys cuDNN takes
    on_gpu(monkeypatch, (9, 0))
    try:
        torch.backends.cuda.enable_cudnn_sdp(False)
        assert "disabled" in reason()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    on_gpu(monkeypatch, (9, 0), cudnn_version=91500)
    assert "older than 9.15.1" in reason()
    on_gpu(monkeypatch, (9, 0), cudnn_version=None)
    assert "no cuDNN" in reason()
    on_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "no cuDNN" in reason()


def test_cuda_default_order_puts_cudnn_first_where_pytorch_does(monkeypatch):
    """On an H200-like GPU a plain call defaults to the cudnn core; what it does not take goes to
    the aten core (FlashAttention-2: bottom-right causal with N != M, windows, dropout, packed
    calls); on an A100-like GPU, or with TORCH_CUDNN_SDPA_DEPRIORITIZED=1, FlashAttention-2 first."""
    t = types.SimpleNamespace(device=CUDA0, dtype=torch.bfloat16)

    def choose(t, batch, sizes, options, varlen=False):
        return attention_core._default_core(t, batch, sizes, options, varlen)[0]

    on_gpu(monkeypatch, (9, 0))
    with deterministic_mode(False):
        assert choose(t, 2, (64, 64, 8, 2, 128), PLAIN) == "cudnn"
        assert choose(t, 2, (63, 64, 8, 2, 128), PLAIN) == "aten"
        assert choose(t, 2, (64, 64, 8, 2, 128), PLAIN._replace(window_left=8)) == "aten"
        assert choose(t, 2, (64, 64, 8, 2, 128), PLAIN._replace(dropout_p=0.1)) == "aten"
        assert choose(t, 1, (64, 64, 8, 2, 128), PLAIN, varlen=True) == "aten"
        assert choose(t, 2, (64, 64, 8, 2, 256), PLAIN) == "aten"
        monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
        assert choose(t, 2, (64, 64, 8, 2, 128), PLAIN) == "aten"
        monkeypatch.undo()
        on_gpu(monkeypatch, (8, 0))
        assert choose(t, 2, (64, 64, 8, 2, 128), PLAIN) == "aten"
    # The suite's deterministic mode: neither cuDNN nor FlashAttention-2's atomic backward.
    on_gpu(monkeypatch, (9, 0))
    assert choose(t, 2, (64, 64, 8, 2, 128), PLAIN._replace(deterministic=True)) == "aten"


def test_cudnn_backend_is_refused_where_it_cannot_run():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(remat.BackendUnavailableError, match="CUDA tensors"):
        remat.attention(q, q, q, backend="cudnn")
    with pytest.raises(remat.BackendUnavailableError, match="CUDA tensors"):
        remat.rms_norm(torch.randn(2, 8), None, backend="cudnn")
    with pytest.raises(remat.BackendUnavailableError, match="fused attention cores, for attention only"):
        remat.ops.ops_for("norm", "cudnn")
    assert remat.ops.ops_for("attention", "cudnn").attention_varlen_fwd is None


def test_cudnn_core_checks_its_call_itself(monkeypatch):
    """Called directly (not through remat.attention, which checks first), the core refuses what
    cuDNN cannot run, by the call's own sizes, before cuDNN sees it: here a batch over 65535 with
    few queries (fake CUDA tensors of an H200-like GPU)."""
    on_gpu(monkeypatch, (9, 0))
    with deterministic_mode(False), FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(65536, 8, 2, 64, device=CUDA0, dtype=torch.bfloat16)
        with _cudnn_calls() as spy, pytest.raises(ValueError, match="65535"):
            attention_cudnn.cudnn_attention_fwd(q, q, q, None, None, None, 0.125, 0.0, -1, 0, 0.0)
        assert spy.calls == []


CUDNN_OPS = (torch.ops.aten._scaled_dot_product_cudnn_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default)


def _cudnn_calls():
    """Records the cuDNN attention forward and backward calls with their arguments and outputs."""
    return OpCalls(CUDNN_OPS)


def _storage(t):
    return t.untyped_storage()._cdata


@pytest.mark.parametrize("rope,causal,m", [(False, True, 7), (True, True, 7), (False, False, 9)],
                         ids=["causal", "causal-rope", "n7-m9"])
def test_calls_trace_on_fake_cuda_tensors(monkeypatch, rope, causal, m):
    """remat.attention(backend="cudnn") on fake CUDA tensors (GQA; causal with N == M, also with
    rope around the core, or no mask with N != M): cuDNN gets [B, H, N, D] views of remat's
    [B, N, H, D] q, k, v (the very tensors, in that order), the causal flag and the scale; its
    [B, Hq, N, 1] statistics are saved as the [B, Hq, N] view and handed back to the backward as
    [B, Hq, N, 1] with the lengths N, M; dq, dk, dv are the backward's outputs in that order,
    contiguous [B, N, H, D] like o; saved: q, k, v, o, lse (no RNG state) and the caller's tables."""
    on_gpu(monkeypatch, (9, 0))
    n = 7
    with deterministic_mode(False), FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, n, 4, 64, device=CUDA0, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(2, m, 2, 64, device=CUDA0, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(2, m, 2, 64, device=CUDA0, dtype=torch.bfloat16, requires_grad=True)
        tables = (torch.empty(m, 32, device=CUDA0), torch.empty(m, 32, device=CUDA0)) if rope else None
        saved = []
        with _cudnn_calls() as spy:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                o = remat.attention(q, k, v, causal=causal, scale=0.2, rope=tables, backend="cudnn")
            # The autograd engine needs a real CUDA context; the Function's backward is called directly.
            grads = o.grad_fn.apply(torch.empty_like(o))
        (forward, forward_args, forward_kwargs, forward_out), (backward, backward_args, backward_kwargs,
                                                               backward_out) = spy.calls
        assert forward is CUDNN_OPS[0] and backward is CUDNN_OPS[1]
        assert [tuple(t.shape) for t in forward_args[:3]] == [(2, 4, n, 64), (2, 2, m, 64), (2, 2, m, 64)]
        if not rope:  # with rope q and k are the rotated copies
            assert [_storage(t) for t in forward_args[:3]] == [_storage(t) for t in (q, k, v)]
        # The dispatcher drops trailing arguments at their defaults (dropout_p=0.0, is_causal=False).
        assert (forward_args[3:7] + (0.0, False)[len(forward_args[5:7]):]) == (None, True, 0.0, causal)
        assert forward_kwargs["scale"] == 0.2
        lse = forward_out[1]
        assert lse.shape == (2, 4, n, 1) and lse.dtype == torch.float32
        assert tuple(backward_args[5].shape) == (2, 4, n, 1)
        assert backward_args[11:15] == (n, m, 0.0, causal) and backward_kwargs["scale"] == 0.2
        assert [tuple(t.shape) for t in backward_args[:5]] == [(2, 4, n, 64), (2, 4, n, 64), (2, 2, m, 64),
                                                              (2, 2, m, 64), (2, 4, n, 64)]
        assert _storage(backward_args[3]) == _storage(v) and _storage(backward_args[4]) == _storage(o)
        assert o.shape == q.shape and o.is_contiguous()
        assert [(g.shape, g.dtype, g.is_contiguous()) for g in grads[:3]] == \
            [(t.shape, t.dtype, True) for t in (q, k, v)]
        if not rope:  # with rope dq and dk are rotated back into new tensors
            assert [_storage(g) for g in grads[:3]] == [_storage(g) for g in backward_out]
        assert _storage(grads[2]) == _storage(backward_out[2])
        # q, k, v, o, fp32 lse [2, 4, 7], the caller's tables; no RNG state.
        assert sum(t.nbytes for t in saved) == 2 * q.nbytes + 2 * k.nbytes + 2 * 4 * n * 4 + \
            (2 * m * 32 * 4 if rope else 0)
        assert not any(t.dtype == torch.int64 for t in saved)


def _cudnn_can_read(t):
    """16-byte aligned storage offset and strides (of dimensions longer than 1), last stride 1."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.storage_offset() * size % 16 == 0 and \
        all(s * size % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def test_cudnn_aligned_copies_only_what_cudnn_cannot_read():
    """cuDNN's graphs assume 16-byte aligned pointers and strides, and PyTorch's operator passes
    tensors through as they are: the core hands cuDNN a contiguous copy of an operand at an odd
    element offset, of heads cut from a wider row, or with a strided last dimension, and the
    operand itself otherwise (contiguous heads, a fused-qkv slice at a multiple of D, fp32 rows
    whose stride is a multiple of 16 bytes)."""
    aligned = attention_cudnn.cudnn_aligned
    base = torch.randn(2, 7, 3 * 4 * 64).to(torch.bfloat16)
    for t in (torch.randn(2, 7, 4, 64).to(torch.bfloat16), base[..., 256:512].view(2, 7, 4, 64),
              torch.randn(2, 7, 4, 68)[..., :64], torch.randn(2, 1, 4, 64).to(torch.bfloat16).expand(2, 1, 4, 64)):
        assert aligned(t) is t and _cudnn_can_read(t)
    odd_offset = torch.randn(1 + 2 * 7 * 4 * 64).to(torch.bfloat16)[1:].view(2, 7, 4, 64)
    wide_rows = torch.randn(2, 7, 4, 68).to(torch.float16)[..., :64]
    strided_last = torch.randn(2, 7, 64, 4).to(torch.bfloat16).transpose(-1, -2)
    for t in (odd_offset, wide_rows, strided_last):
        assert not _cudnn_can_read(t)
        copy = aligned(t)
        assert copy.is_contiguous() and _cudnn_can_read(copy) and copy.dtype == t.dtype
        assert torch.equal(copy, t) and copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_cudnn_gets_aligned_operands_from_misaligned_inputs(monkeypatch):
    """remat.attention(backend="cudnn") on fake CUDA tensors with q at an odd element offset and k's
    heads cut from wider rows: cuDNN's forward and backward get aligned copies of those (same
    shapes), v and the output gradient as they are, and the gradients come back in the inputs'
    shapes; the inputs themselves are left alone."""
    on_gpu(monkeypatch, (9, 0))
    with deterministic_mode(False), FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1 + 2 * 7 * 4 * 64, device=CUDA0, dtype=torch.bfloat16)[1:].view(2, 7, 4, 64)
        k = torch.empty(2, 7, 2, 68, device=CUDA0, dtype=torch.bfloat16)[..., :64]
        v = torch.empty(2, 7, 2, 64, device=CUDA0, dtype=torch.bfloat16)
        for t in (q, k, v):
            t.requires_grad_()
        with _cudnn_calls() as spy:
            o = remat.attention(q, k, v, causal=True, backend="cudnn")
            dout = torch.empty_like(o)
            grads = o.grad_fn.apply(dout)
        (_, forward_args, _, _), (_, backward_args, _, _) = spy.calls
        assert all(_cudnn_can_read(t) for t in forward_args[:3] + backward_args[:5])
        assert [tuple(t.shape) for t in forward_args[:3]] == [(2, 4, 7, 64), (2, 2, 7, 64), (2, 2, 7, 64)]
        assert _storage(forward_args[0]) != _storage(q) and _storage(forward_args[1]) != _storage(k)
        assert _storage(forward_args[2]) == _storage(v) and _storage(backward_args[0]) == _storage(dout)
        assert q.storage_offset() == 1 and k.stride(2) == 68
        assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("backend", ["cudnn", None], ids=["asked", "default"])
def test_fused_attention_sub_block_runs_on_cudnn(monkeypatch, backend):
    """remat.norm_attention (the fused layers' attention sub-block) on fake CUDA tensors of an
    H200-like GPU: asked for, and by default outside deterministic mode, its attention runs
    through both cuDNN calls while its norms take the device's default backend (cudnn has no norm
    operators)."""
    import remat.backend as backend_module

    on_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(backend_module, "device_capability", lambda index: (9, 0))
    with deterministic_mode(False), FakeTensorMode(allow_non_fake_inputs=True):
        b, n, hidden, hq, hkv, d = 2, 6, 32, 4, 2, 16
        x, norm_weight, w_q, w_k, w_v = (torch.empty(*shape, device=CUDA0, dtype=torch.bfloat16, requires_grad=True)
                                         for shape in ((b, n, hidden), (hidden,), (hq * d, hidden), (hkv * d, hidden),
                                                       (hkv * d, hidden)))
        with _cudnn_calls() as spy:
            o = remat.norm_attention(x, norm_weight, w_q, w_k, w_v, num_heads=hq, num_kv_heads=hkv, backend=backend)
            grads = o.grad_fn.apply(torch.empty_like(o))
        assert [call[0] for call in spy.calls] == list(CUDNN_OPS)
        assert grads[0].shape == x.shape


def _aten_ops_of_bodies(gm):
    """The aten and remat operators of the autograd Function bodies dynamo traced into ``gm``
    (name -> list of operator names), forward and backward."""
    return {name: [str(node.target) for node in getattr(gm, name).graph.nodes
                   if node.op == "call_function" and str(node.target).startswith(("aten.", "remat"))]
            for name in sorted(dir(gm)) if name.startswith(("fwd_body", "bwd_body"))}


@pytest.mark.parametrize("backend,rope,dropout_p,core", [
    ("cudnn", True, 0.0, "cudnn"), (None, False, 0.0, "cudnn"), ("aten", True, 0.0, "flash"),
    ("aten", False, 0.1, "flash")], ids=["cudnn-rope", "default", "aten-rope", "aten-dropout"])
def test_cuda_cores_compile_as_one_graph(monkeypatch, backend, rope, dropout_p, core):
    """torch.compile(fullgraph=True) of remat.attention on fake CUDA tensors of an H200-like GPU:
    dynamo traces the call as one graph, without a warning, with the core's forward op in the
    Function's forward body and its backward op (rope rotated around it by remat's rope operator)
    in the backward body. The CPU paths' compile tests cannot reach these branches."""
    on_gpu(monkeypatch, (9, 0))
    # An H200 compiles Triton kernels; `make test` sets TRITON_INTERPRET=1, under which CUDA rope
    # would be rotated by PyTorch ops instead of remat's Triton operator.
    monkeypatch.setattr(rope_ops, "triton_interpreted", lambda: False)
    counter = CompileCounter()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return counter(gm, example_inputs)

    torch._dynamo.reset()
    with deterministic_mode(False), FakeTensorMode(allow_non_fake_inputs=True), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = torch.empty(2, 8, 4, 64, device=CUDA0, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(2, 8, 2, 64, device=CUDA0, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        tables = (torch.empty(8, 32, device=CUDA0), torch.empty(8, 32, device=CUDA0)) if rope else None
        compiled = torch.compile(lambda q, k, v: remat.attention(q, k, v, causal=True, rope=tables, dropout_p=dropout_p,
                                                                 backend=backend), backend=record, fullgraph=True)
        o = compiled(q, k, v)
    torch._dynamo.reset()
    assert o.shape == q.shape and counter.frames == 1
    assert [str(w.message) for w in caught] == []
    forward_op, backward_op = {"cudnn": ("aten._scaled_dot_product_cudnn_attention",
                                         "aten._scaled_dot_product_cudnn_attention_backward"),
                               "flash": ("aten._flash_attention_forward", "aten._flash_attention_backward")}[core]
    rotate = ["remat_triton.rope_rotate.default"] * 2 if rope else []
    assert _aten_ops_of_bodies(graphs[0]) == {"bwd_body_0": rotate + [backward_op] + rotate,
                                               "fwd_body_0": rotate + [forward_op]}


def test_patched_llama_compiles_as_one_graph_on_the_cudnn_core(monkeypatch):
    """A Hugging Face Llama (sdpa attention) built on fake CUDA tensors of an H200-like GPU,
    patched by remat, in training mode with labels (the fused loss): torch.compile(fullgraph=True)
    traces its forward as one graph without a warning, and every layer's attention runs on the
    cudnn core, forward and backward (the default there outside deterministic mode)."""
    import transformers

    import remat.autograd.cross_entropy as cross_entropy
    import remat.backend as backend_module

    on_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(backend_module, "device_capability", lambda index: (9, 0))
    # The loss's chunk rule asks the device for its free memory, which fake tensors have none of.
    monkeypatch.setattr(cross_entropy, "free_memory_bytes",
                        torch.compiler.assume_constant_result(lambda device_type, index: 80 * 2**30))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    default_dtype = torch.get_default_dtype()
    with deterministic_mode(False), FakeTensorMode(allow_non_fake_inputs=True), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(CUDA0):
                model = transformers.LlamaForCausalLM(llama_config("llama", attn_implementation="sdpa"))
        finally:
            torch.set_default_dtype(default_dtype)
        model.train()
        remat.patch(model)
        ids = torch.randint(0, 96, (2, 16), device=CUDA0)
        loss = torch.compile(model, backend=record, fullgraph=True)(input_ids=ids, labels=ids).loss
    torch._dynamo.reset()
    assert loss.shape == () and len(graphs) == 1
    assert [str(w.message) for w in caught] == []
    ops = [str(node.target) for sub in graphs[0].modules() if isinstance(sub, torch.fx.GraphModule)
           for node in sub.graph.nodes if node.op == "call_function"]
    layers = model.config.num_hidden_layers
    assert ops.count("aten._scaled_dot_product_cudnn_attention") == layers
    assert ops.count("aten._scaled_dot_product_cudnn_attention_backward") == layers
    assert not any("flash_attention" in op for op in ops)


# On a GPU (not run here).
CUDNN_CASES = [
    case("b2-n1024-d128-gqa4-causal", 2, 1024, 1024, 8, 2, 128, causal=True),
    case("n300-m511-d64-mqa", 1, 300, 511, 4, 1, 64),
    case("n257-d80-causal-rope", 2, 257, 257, 4, 2, 80, causal=True, rope="per_batch"),
    case("n333-d128-bhnd", 1, 333, 333, 2, 2, 128, layout="bhnd"),
    case("n77-d16", 2, 77, 77, 2, 1, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", CUDNN_CASES)
def test_gpu_cudnn_core_matches_float64_reference(spec, dtype):
    """The 2x rule against float64 (o, dq, dk, dv), outside deterministic mode (cuDNN's backward
    is not deterministic)."""
    run_and_check(spec, dtype, "cudnn", deterministic=False, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cudnn_core_forward_is_sdpas(causal):
    """The core's o is bitwise what scaled_dot_product_attention computes on its cuDNN backend for
    the same [B, H, N, D] views (GQA through enable_gqa); it saves q, k, v, o and lse only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec = dict(b=2, n=512, m=512, hq=8, hkv=2, d=128)
    # Inputs that require grad, so both calls ask cuDNN for the softmax statistics (one graph).
    q, k, v = (t.requires_grad_() for t in make_inputs(spec, torch.bfloat16, device="cuda")[:3])
    with deterministic_mode(False):
        o = remat.attention(q, k, v, causal=causal, backend="cudnn")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            stock = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal, enable_gqa=True).transpose(1, 2)
        assert torch.equal(o, stock)
        contract = (2 * q.numel() + k.numel() + v.numel()) * 2 + 2 * 8 * 512 * 4
        assert saved_bytes(remat.attention, q, k, v, causal=causal, backend="cudnn") == contract


@pytest.mark.gpu
def test_gpu_cudnn_core_on_misaligned_inputs_equals_aligned():
    """q at an odd element offset and k's heads cut from wider rows (operands cuDNN cannot read as
    they are; the core copies them): o is bitwise the one of contiguous copies of the same
    values, and the gradients (cuDNN's backward is not deterministic) agree within 2x the
    aligned call's own run-to-run spread or one bf16 ulp of their scale."""
    torch.manual_seed(0)
    b, n, hq, hkv, d = 2, 130, 8, 2, 64
    q_buffer = torch.randn(1 + b * n * hq * d, device="cuda", dtype=torch.bfloat16)
    q_odd = q_buffer[1:].view(b, n, hq, d)
    k_wide = torch.randn(b, n, hkv, d + 4, device="cuda", dtype=torch.bfloat16)[..., :d]
    v = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)

    def run(q, k):
        q, k, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        with deterministic_mode(False):
            o = remat.attention(q, k, v_, causal=True, backend="cudnn")
        o.backward(dout)
        return o.detach(), q.grad, k.grad, v_.grad

    misaligned = run(q_odd, k_wide)
    aligned, again = (run(q_odd.contiguous().clone(), k_wide.contiguous()) for _ in range(2))
    assert torch.equal(misaligned[0], aligned[0])
    for got, want, repeat in zip(misaligned[1:], aligned[1:], again[1:]):
        spread = (repeat.float() - want.float()).abs().max().item()
        ulp = want.float().abs().max().item() * 2 ** -8
        assert (got.float() - want.float()).abs().max().item() <= max(2 * spread, ulp)


@pytest.mark.gpu
def test_gpu_default_takes_cudnn_exactly_where_pytorch_does():
    """remat's rule (cudnn_preferred, cudnn_unsupported_reason) against PyTorch's own selection on
    this GPU (torch._fused_sdp_choice: 3 is cuDNN): on calls the cudnn core takes by its own
    limits, the default is "cudnn" exactly when stock SDPA picks cuDNN."""
    import remat.autograd.attention as attention_function

    used = []
    real = attention_function.ops_for
    attention_function.ops_for = lambda block, name: used.append(name) or real(block, name)
    try:
        with deterministic_mode(False):
            for n, hq, hkv, d, causal in ((256, 8, 8, 64, True), (256, 8, 2, 128, False), (100, 4, 1, 32, True)):
                q = torch.randn(1, n, hq, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(1, n, hkv, d, device="cuda", dtype=torch.bfloat16)
                stock = torch._fused_sdp_choice(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                                                is_causal=causal, enable_gqa=hq != hkv)
                used.clear()
                remat.attention(q, k, k, causal=causal)
                assert (used[0] == "cudnn") == (stock == 3), (n, hq, hkv, d, causal, stock, used)
    finally:
        attention_function.ops_for = real


@pytest.mark.gpu
def test_gpu_patched_llama_runs_the_default_core_and_matches_stock():
    """A patched Hugging Face Llama on the GPU, outside deterministic mode, on an unpadded batch
    (its layers run dense attention): the attention runs on the cudnn core exactly where PyTorch
    prefers cuDNN (else on aten), and the logits, the loss and every gradient meet the 2x rule
    against the float64 model, with the stock bf16 model (SDPA) as the stock."""
    import remat.autograd.attention as attention_function

    ids, mask, _ = batch()
    ids, mask = ids.cuda(), torch.ones_like(mask).cuda()
    labels = ids.clone()
    reference = causal_lm("llama", torch.float64).cuda()
    stock = causal_lm("llama", torch.bfloat16, attn_implementation="sdpa").cuda()
    patched = causal_lm("llama", torch.bfloat16).cuda()
    remat.patch(patched)
    used = []
    real = attention_function.ops_for
    attention_function.ops_for = lambda block, name: used.append(name) or real(block, name)
    try:
        with deterministic_mode(False):
            want = logits_and_grads(reference, ids, mask, labels)
            base = logits_and_grads(stock, ids, mask, labels)
            got = logits_and_grads(patched, ids, mask, labels)
    finally:
        attention_function.ops_for = real
    expected = "cudnn" if attention_cudnn.cudnn_preferred(torch.device("cuda", torch.cuda.current_device())) else "aten"
    assert used and set(used) == {expected}, used
    assert_within_2x_of_stock("logits", got[0].cpu(), base[0].cpu(), want[0].cpu(), torch.bfloat16)
    assert_within_2x_of_stock("loss", got[1].reshape(1).cpu(), base[1].reshape(1).cpu(), want[1].reshape(1).cpu(),
                              torch.bfloat16)
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name].cpu(), base[2][name].cpu(), want[2][name].cpu(), torch.bfloat16)
