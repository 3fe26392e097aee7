"""The Qwen3 family (remat.models.qwen3): the per-head q/k RMSNorms fused into remat.norm_attention
against a float64 reference on every CPU backend; Qwen3Layer's policies as measured byte formulas;
patched tiny Qwen3 models (with and without sliding-window layers) built from configs (no
downloads): logits, loss and every parameter gradient under the 2x rule against a float64 copy of
the stock model, fp32 and bf16, every policy, backends cpp and torch."""

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.memory import SavedTensorLog, retained_bytes, saved_bytes
from remat.models.qwen3 import Qwen3Layer, attention_from_hf
from remat.reference import attention_reference

from _checks import assert_within_2x_of_stock
from helpers import (
    BATCH,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LENGTH,
    batch,
    cpu_backends,
    logits_and_grads,
    random_rope_tables,
    real_shaped_per_token,
)

transformers = pytest.importorskip("transformers")


# The fused piece: remat.norm_attention with qk_norm="rms" against eager PyTorch.

def eager_qk_norm_attention(x, norm_w, w_q, w_k, w_v, q_w, k_w, *, heads, kv_heads, rope, window, eps):
    """The sub-block in x's dtype, unfused: RMSNorm, projections, per-head RMSNorm of q and k over
    D, rope, eager attention (float64: the reference; bf16/fp32: what stock PyTorch computes)."""
    batch_size, n, _ = x.shape
    normed = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    q = F.linear(normed, w_q).view(batch_size, n, heads, -1)
    k = F.linear(normed, w_k).view(batch_size, n, kv_heads, -1)
    v = F.linear(normed, w_v).view(batch_size, n, kv_heads, -1)
    q = F.rms_norm(q, (q.shape[-1],), q_w, eps)
    k = F.rms_norm(k, (k.shape[-1],), k_w, eps)
    return attention_reference(q, k, v, causal=True, rope=rope, window=window)


QK_CASES = [
    pytest.param(dict(b=2, n=7, h=48, hq=4, hkv=2, d=12, window=None), id="b2-n7-h48-gqa2-d12"),
    pytest.param(dict(b=1, n=19, h=40, hq=2, hkv=1, d=16, window=(4, None)), id="b1-n19-h40-mqa-d16-window4"),
]


def qk_case(spec, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, n, h, hq, hkv, d = (spec[k] for k in ("b", "n", "h", "hq", "hkv", "d"))

    def rnd(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g)).to(dtype)

    tensors = dict(x=rnd(b, n, h), norm_w=rnd(h, scale=0.3, shift=1.0), w_q=rnd(hq * d, h, scale=h**-0.5),
                   w_k=rnd(hkv * d, h, scale=h**-0.5), w_v=rnd(hkv * d, h, scale=h**-0.5),
                   q_w=rnd(d, scale=0.5, shift=1.0), k_w=rnd(d, scale=0.5, shift=1.0))
    rope = random_rope_tables(b, n, d, "shared", g)
    dout = rnd(b, n, hq, d)
    return tensors, rope, dout


def run_qk(fn, tensors, dout, dtype):
    leaves = {name: t.detach().to(dtype).requires_grad_() for name, t in tensors.items()}
    out = fn(**leaves)
    grads = torch.autograd.grad(out, list(leaves.values()), dout.to(dtype))
    return [out.detach()] + list(grads)


@pytest.mark.parametrize("keep_qkv", [True, False], ids=["keep_qkv", "recompute_qkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("spec", QK_CASES)
def test_norm_attention_qk_norm_matches_float64_reference(spec, backend, dtype, keep_qkv):
    """Output and every gradient (x, the norm weight, the three projections, both q/k norm
    weights) of the fused sub-block within 2x of stock PyTorch's error against float64."""
    tensors, rope, dout = qk_case(spec, dtype)
    eps = 1e-6
    sizes = dict(heads=spec["hq"], kv_heads=spec["hkv"], rope=rope, window=spec["window"], eps=eps)

    def fused(x, norm_w, w_q, w_k, w_v, q_w, k_w):
        return remat.norm_attention(x, norm_w, w_q, w_k, w_v, num_heads=spec["hq"], num_kv_heads=spec["hkv"], eps=eps,
                                    qk_norm="rms", q_norm_weight=q_w, k_norm_weight=k_w, qk_eps=eps, rope=rope,
                                    window=spec["window"], keep_qkv=keep_qkv, backend=backend)

    got = run_qk(fused, tensors, dout, dtype)
    stock = run_qk(lambda **t: eager_qk_norm_attention(**t, **sizes), tensors, dout, dtype)
    reference = run_qk(lambda **t: eager_qk_norm_attention(**t, **{**sizes, "rope": tuple(r.double() for r in rope)}),
                       tensors, dout, torch.float64)
    names = ["o", "dx", "dnorm_w", "dw_q", "dw_k", "dw_v", "dq_norm_w", "dk_norm_w"]
    for name, value, stock_value, ref in zip(names, got, stock, reference):
        assert value.dtype == dtype, name
        assert_within_2x_of_stock(name, value, stock_value, ref, dtype)


@pytest.mark.parametrize("keep_qkv", [True, False])
def test_norm_attention_qk_norm_saves_the_pre_norm_projections_only(keep_qkv):
    """With per-head norms the sub-block saves what it saves without them: x, rstd, the
    pre-norm q, k, v (keep_qkv), o, lse; never the normalized heads or their statistics."""
    spec = QK_CASES[0].values[0]
    tensors, rope, _ = qk_case(spec, torch.bfloat16)
    # Weights as Parameters (which saved-byte accounting leaves out, as for a model's).
    leaves = {name: t.requires_grad_() if name == "x" else torch.nn.Parameter(t) for name, t in tensors.items()}
    b, n, hq, hkv, d = (spec[k] for k in ("b", "n", "hq", "hkv", "d"))
    common = dict(num_heads=hq, num_kv_heads=hkv, rope=rope, keep_qkv=keep_qkv, backend="cpp" if "cpp" in
                  cpu_backends() else "torch")
    args = [leaves[k] for k in ("x", "norm_w", "w_q", "w_k", "w_v")]
    with SavedTensorLog() as log:
        o = remat.norm_attention(*args, qk_norm="rms", q_norm_weight=leaves["q_w"], k_norm_weight=leaves["k_w"],
                                 **common)
    plain = saved_bytes(remat.norm_attention, *args, **common)
    rows = b * n
    qkv = 2 * rows * (hq + 2 * hkv) * d if keep_qkv else 0
    contract = 2 * rows * spec["h"] + 4 * rows + qkv + 2 * rows * hq * d + 4 * rows * hq + 2 * rope[0].numel() * 4
    assert log.total_bytes == plain == contract
    # The saved q and k are the projections (before the per-head norms), not the normalized heads.
    if keep_qkv:
        q_saved = [s for s in log.saved if s.shape == (b, n, hq, d)]
        assert len(q_saved) == 2  # q and o
    o.sum().backward()


def test_norm_attention_qk_norm_argument_checks():
    x, w = torch.randn(1, 3, 8), torch.randn(8, 8)
    with pytest.raises(ValueError, match="qk_norm"):
        remat.norm_attention(x, None, w, w, w, num_heads=2, q_norm_weight=torch.ones(4))
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        remat.norm_attention(x, None, w, w, w, num_heads=2, qk_norm="layer")
    with pytest.raises(ValueError, match=r"q_norm_weight must have shape \(4,\)"):
        remat.norm_attention(x, None, w, w, w, num_heads=2, qk_norm="rms", q_norm_weight=torch.ones(8))
    with pytest.raises(TypeError, match="k_norm_weight must have x's dtype"):
        remat.norm_attention(x, None, w, w, w, num_heads=2, qk_norm="rms", k_norm_weight=torch.ones(4).double())


# The layer and the patched model.

def per_token_formula(policy, element):
    """Bytes per token a Qwen3Layer keeps (LlamaLayer's formulas; see its docstring)."""
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    memory = element * (2 * HIDDEN + q_width) + 4 * HEADS + 8
    balanced = memory + element * (q_width + 2 * kv_width)
    return {"memory": memory, "balanced": balanced, "speed": balanced + 2 * element * INTER}[policy]


def qwen3_model(dtype=torch.float32, seed=0, sliding=False, **overrides):
    """A tiny Qwen3ForCausalLM from a config (2 layers; with ``sliding``, layer 1 uses a window of 4
    keys, fewer than the sequence) with random q/k norm weights (stock initialises them to ones)."""
    torch.manual_seed(seed)
    options = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                   max_position_embeddings=64, use_cache=False, attn_implementation="eager")
    if sliding:
        options.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    options.update(overrides)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight")):
                p.normal_(1.0, 0.3)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_qwen3_layer_saves_the_documented_bytes(policy, dtype):
    layer = Qwen3Layer(HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, policy=policy, dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    rope_tables = 2 * LENGTH * (HEAD_DIM // 2) * 4  # the layer's fp32 cos/sin [1, N, D/2]
    assert layer.saved_bytes_per_token(x.element_size()) == per_token_formula(policy, x.element_size())
    assert saved_bytes(layer, x) == BATCH * LENGTH * per_token_formula(policy, x.element_size()) + rope_tables


def test_qwen3_policies_against_the_stock_layer():
    """The stock layer keeps the probabilities and every intermediate (the per-head norms'
    inputs and outputs too); each policy keeps less, in order, and the patched layer's bytes
    with the model's rope tables are the formula."""
    model = qwen3_model(torch.bfloat16)
    stock = model.model.layers[0]
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(LENGTH)[None].expand(BATCH, LENGTH)
    rope = model.model.rotary_emb(x, positions)
    mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1).to(torch.bfloat16)[None, None]
    eager = saved_bytes(stock, x, attention_mask=mask, position_embeddings=rope, position_ids=positions)
    saved = {p: saved_bytes(Qwen3Layer.from_module(stock, policy=p), x, position_embeddings=rope)
             for p in ("speed", "balanced", "memory")}
    assert eager > saved["speed"] > saved["balanced"] > saved["memory"]
    tables = 2 * rope[0].numel() * rope[0].element_size()
    for policy, value in saved.items():
        assert value == BATCH * LENGTH * per_token_formula(policy, 2) + tables, policy


def test_from_module_shares_every_parameter_and_keeps_the_keys():
    model = qwen3_model()
    stock = model.model.layers[1]
    layer = Qwen3Layer.from_module(stock)
    assert list(layer.state_dict()) == list(stock.state_dict())
    for (name, p), (_, q) in zip(stock.named_parameters(), layer.named_parameters()):
        assert p is q, name
    assert layer.self_attn.qk_norm == "rms" and layer.self_attn.window is None


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_patched_qwen3_matches_stock(sliding, dtype, policy, backend):
    reference = qwen3_model(torch.float64, sliding=sliding)
    stock = qwen3_model(dtype, sliding=sliding)
    patched = qwen3_model(dtype, sliding=sliding)
    report = remat.patch(patched, policy=policy, backend=backend)
    mine = [entry for entry in report.replaced if entry[0].startswith("model.")]
    assert mine == [("model.layers.0", "Qwen3DecoderLayer", "HFQwen3Layer"),
                    ("model.layers.1", "Qwen3DecoderLayer", "HFQwen3Layer"), ("model.norm", "Qwen3RMSNorm", "RMSNorm")]
    assert not report.left_alone
    layers = patched.model.layers
    assert [layer.self_attn.window for layer in layers] == [None, (3, None) if sliding else None]
    assert {layers[0].backend, layers[0].policy} == {backend, policy}
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (logits_and_grads(m, ids, mask, labels) for m in (reference, stock, patched))
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    assert_within_2x_of_stock("loss", got[1].reshape(1), base[1].reshape(1), want[1].reshape(1), dtype)
    assert set(got[2]) == set(want[2])
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)


def test_qwen3_attention_alone_is_left_alone_with_the_reason():
    model = qwen3_model()
    report = remat.patch(model, modules=("attention", "mlp"))
    assert {name for name, _, _ in report.left_alone} == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all("whole decoder layer" in why for _, _, why in report.left_alone)
    assert [name for name, _, new in report.replaced if new == "SwiGLUMLP"] == ["model.layers.0.mlp",
                                                                                 "model.layers.1.mlp"]


def test_qk_norm_attention_module_matches_the_stock_attention():
    """The standalone QKNormAttention (norms as modules, then remat.attention) computes the stock
    Qwen3 attention."""
    model = qwen3_model()
    stock = model.model.layers[0].self_attn
    module = attention_from_hf(stock, qk_norm="rms")
    x = torch.randn(BATCH, LENGTH, HIDDEN)
    positions = torch.arange(LENGTH)[None]
    rope = model.model.rotary_emb(x, positions)
    mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1)[None, None]
    want = stock(x, position_embeddings=rope, attention_mask=mask)[0]
    torch.testing.assert_close(module(x, position_embeddings=rope), want, rtol=1e-5, atol=1e-5)
    # The built-in rope tables (the config's theta) give the same result.
    torch.testing.assert_close(module(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy,expected", [("speed", 86152), ("balanced", 37000), ("memory", 24712)])
def test_real_shaped_layer_keeps_the_readme_bytes(policy, expected):
    """README's table: a Qwen3-8B-shaped layer (h 4096, I 12288, 32/8 heads of 128), bf16."""
    with torch.device("meta"):
        layer = Qwen3Layer(4096, 12288, 32, 8, 128, policy=policy, backend="torch", dtype=torch.bfloat16)
    assert real_shaped_per_token(layer, 128) == layer.saved_bytes_per_token(2) == expected


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_layer_retains_what_it_saves(policy, dtype, backend):
    """What a forward keeps alive (remat.memory.retained_bytes) is what it saves for backward, less
    the caller's input: no temporary (q/k norms) outlives the forward."""
    layer = Qwen3Layer(HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, policy=policy, backend=backend, dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    assert retained_bytes(layer, x) == saved_bytes(layer, x) - x.numel() * x.element_size() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_patched_qwen3_on_the_default_backend(dtype):
    """No backend named: on the CPU the attention core is PyTorch's flash kernel (aten) where it
    takes the call, with the per-head q/k norms around it in remat's Function."""
    reference, stock, patched = (qwen3_model(d, sliding=True) for d in (torch.float64, dtype, dtype))
    remat.patch(patched)
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (logits_and_grads(m, ids, mask, labels) for m in (reference, stock, patched))
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)
