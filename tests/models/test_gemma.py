"""The Gemma 2 / Gemma 3 family (remat.models.gemma): Gemma's (1 + w) RMSNorm against Hugging Face's
module (bf16/fp16 bitwise up to one unit in the last place) and a float64 reference; the fused
sub-blocks with norm="gemma" (attention with softcap, scale, window and Gemma 3's per-head q/k
norms; the gated GELU-tanh MLP) against float64 on every CPU backend; GemmaLayer's policies as
measured byte formulas; patched tiny Gemma 2 and Gemma 3 models built from configs (no downloads;
sliding-window layers with a window shorter than the sequence, softcap on): logits, loss and every
parameter gradient under the 2x rule against a float64 copy of the stock model, fp32 and bf16,
every policy, backends cpp and torch."""

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.memory import retained_bytes, saved_bytes
from remat.models.gemma import GemmaLayer, GemmaRMSNorm
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
    compiled_and_eager_steps,
    cpu_backends,
    logits_and_grads,
    random_rope_tables,
    real_shaped_per_token,
)

transformers = pytest.importorskip("transformers")
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # noqa: E402


def gemma_norm(x, weight, eps=1e-6):
    """Hugging Face's Gemma RMSNorm, in fp32 (float64 for a float64 x), rounded once to x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    u = x.to(compute)
    return (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.to(compute))).to(x.dtype)


def ordered_bits(t):
    """A 16-bit float tensor's bit patterns as integers ordered like the values, so that adjacent
    representable numbers (subnormals and across zero too) differ by 1."""
    bits = t.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


# Gemma's norm.

@pytest.mark.parametrize("stock_class", [Gemma2RMSNorm, Gemma3RMSNorm], ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", cpu_backends())
def test_gemma_norm_is_hugging_faces_to_the_last_bit(backend, dtype, stock_class):
    """The (1 + w) weight is formed in fp32 and the product rounded once, as Hugging Face does, so
    bf16/fp16 outputs and gradients equal its module's but for the order of fp32 sums: at most
    one unit in the last place apart, and almost all bitwise equal."""
    g = torch.Generator().manual_seed(0)
    stock = stock_class(200, eps=1e-6)
    with torch.no_grad():
        stock.weight.copy_(0.5 * torch.randn(200, generator=g))
    stock = stock.to(dtype)
    mine = GemmaRMSNorm.from_module(stock, backend=backend)
    assert mine.weight is stock.weight
    x = (3 * torch.randn(37, 200, generator=g)).to(dtype)
    dy = torch.randn(37, 200, generator=g).to(dtype)
    results = []
    for module in (stock, mine):
        leaf = x.clone().requires_grad_()
        y = module(leaf)
        results.append([y.detach(), *torch.autograd.grad(y, [leaf, stock.weight], dy)])
    for name, want, got in zip(("y", "dx", "dw"), *results):
        assert got.dtype == want.dtype == dtype, name
        assert (ordered_bits(got) - ordered_bits(want)).abs().max().item() <= 1, name
        assert (got == want).float().mean().item() >= 0.999, name


@pytest.mark.parametrize("backend", cpu_backends())
def test_gemma_norm_fp32_within_2x_of_stock(backend):
    g = torch.Generator().manual_seed(1)
    tensors = [3 * torch.randn(2, 7, 99, generator=g), 0.5 * torch.randn(99, generator=g)]
    dy = torch.randn(2, 7, 99, generator=g)

    def mine(x, weight):
        module = GemmaRMSNorm(99, backend=backend)
        module.weight = torch.nn.Parameter(weight)
        y = module(x)
        return y, torch.autograd.grad(y, [x, module.weight], dy)

    def eager(x, weight):
        y = gemma_norm(x, weight)
        return y, torch.autograd.grad(y, [x, weight], dy.to(x.dtype))

    results = []
    for fn, dtype in ((mine, torch.float32), (eager, torch.float32), (eager, torch.float64)):
        y, grads = fn(*(t.to(dtype).requires_grad_() for t in tensors))
        results.append([y.detach(), *grads])
    for name, value, stock_value, ref in zip(("y", "dx", "dw"), *results):
        assert_within_2x_of_stock(name, value, stock_value, ref, torch.float32)


# The fused sub-blocks with Gemma's norm.

def eager_gemma_attention(x, norm_w, w_q, w_k, w_v, q_w, k_w, *, heads, kv_heads, rope, window, softcap, scale,
                          qk_norm, eps):
    """Gemma's attention sub-block in x's dtype, unfused, as Hugging Face computes it."""
    batch_size, n, _ = x.shape
    normed = gemma_norm(x, norm_w, eps)
    q = F.linear(normed, w_q).view(batch_size, n, heads, -1)
    k = F.linear(normed, w_k).view(batch_size, n, kv_heads, -1)
    v = F.linear(normed, w_v).view(batch_size, n, kv_heads, -1)
    if qk_norm:
        q, k = gemma_norm(q, q_w, eps), gemma_norm(k, k_w, eps)
    return attention_reference(q, k, v, causal=True, rope=rope, window=window, softcap=softcap, scale=scale)


ATTENTION_CASES = [
    pytest.param(dict(b=2, n=9, h=48, hq=4, hkv=2, d=12, window=(3, None), softcap=5.0, scale=0.2, qk_norm=False),
                 id="gemma2-b2-n9-gqa2-d12-window3-softcap5"),
    pytest.param(dict(b=1, n=13, h=40, hq=2, hkv=1, d=16, window=None, softcap=None, scale=0.3, qk_norm=True),
                 id="gemma3-b1-n13-mqa-d16-qknorm"),
    pytest.param(dict(b=2, n=7, h=32, hq=2, hkv=2, d=8, window=(2, None), softcap=None, scale=None, qk_norm=True),
                 id="gemma3-b2-n7-mha-d8-window2-qknorm"),
]


@pytest.mark.parametrize("keep_qkv", [True, False], ids=["keep_qkv", "recompute_qkv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("spec", ATTENTION_CASES)
def test_gemma_norm_attention_matches_float64_reference(spec, backend, dtype, keep_qkv):
    g = torch.Generator().manual_seed(0)
    b, n, h, hq, hkv, d = (spec[k] for k in ("b", "n", "h", "hq", "hkv", "d"))
    tensors = dict(x=torch.randn(b, n, h, generator=g), norm_w=0.3 * torch.randn(h, generator=g),
                   w_q=torch.randn(hq * d, h, generator=g) * h**-0.5,
                   w_k=torch.randn(hkv * d, h, generator=g) * h**-0.5,
                   w_v=torch.randn(hkv * d, h, generator=g) * h**-0.5, q_w=0.5 * torch.randn(d, generator=g),
                   k_w=0.5 * torch.randn(d, generator=g))
    rope = random_rope_tables(b, n, d, "shared", g)
    dout = torch.randn(b, n, hq, d, generator=g)
    options = dict(window=spec["window"], softcap=spec["softcap"], scale=spec["scale"])
    qk = spec["qk_norm"]
    names = ["x", "norm_w", "w_q", "w_k", "w_v"] + (["q_w", "k_w"] if qk else [])

    def fused(x, norm_w, w_q, w_k, w_v, q_w=None, k_w=None):
        extra = dict(qk_norm="gemma", q_norm_weight=q_w, k_norm_weight=k_w) if qk else {}
        return remat.norm_attention(x, norm_w, w_q, w_k, w_v, num_heads=hq, num_kv_heads=hkv, norm="gemma",
                                    rope=rope, keep_qkv=keep_qkv, backend=backend, **extra, **options)

    def eager(dtype_rope):
        def run(x, norm_w, w_q, w_k, w_v, q_w=None, k_w=None):
            return eager_gemma_attention(x, norm_w, w_q, w_k, w_v, q_w, k_w, heads=hq, kv_heads=hkv, rope=dtype_rope,
                                         qk_norm=qk, eps=1e-6, **options)
        return run

    def run(fn, run_dtype):
        leaves = {k: tensors[k].to(run_dtype).requires_grad_() for k in names}
        out = fn(**leaves)
        return [out.detach(), *torch.autograd.grad(out, list(leaves.values()), dout.to(run_dtype))]

    got = run(fused, dtype)
    stock = run(eager(rope), dtype)
    reference = run(eager(tuple(r.double() for r in rope)), torch.float64)
    for name, value, stock_value, ref in zip(["o"] + [f"d{k}" for k in names], got, stock, reference):
        assert value.dtype == dtype, name
        assert_within_2x_of_stock(name, value, stock_value, ref, dtype)


@pytest.mark.parametrize("recompute", ["block", "activation"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", cpu_backends())
def test_gemma_norm_mlp_matches_float64_reference(backend, dtype, recompute):
    """remat.norm_mlp with norm="gemma" (on Triton too, whose fused GEMM prologue computes only
    "rms"/"layer" norms and is bypassed for it)."""
    g = torch.Generator().manual_seed(2)
    h, inter = 40, 72
    tensors = [torch.randn(2, 7, h, generator=g), 0.4 * torch.randn(h, generator=g),
               torch.randn(inter, h, generator=g) * h**-0.5, torch.randn(inter, h, generator=g) * h**-0.5,
               torch.randn(h, inter, generator=g) * inter**-0.5]
    dy = torch.randn(2, 7, h, generator=g)

    def fused(x, nw, wg, wu, wd):
        return remat.norm_mlp(x, nw, wg, wu, wd, norm="gemma", activation="gelu_tanh", recompute=recompute,
                              backend=backend)

    def eager(x, nw, wg, wu, wd):
        normed = gemma_norm(x, nw)
        return F.linear(F.gelu(F.linear(normed, wg), approximate="tanh") * F.linear(normed, wu), wd)

    def run(fn, run_dtype):
        leaves = [t.to(run_dtype).requires_grad_() for t in tensors]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, dy.to(run_dtype))]

    for name, value, stock_value, ref in zip(("y", "dx", "dnorm_w", "dw_gate", "dw_up", "dw_down"), run(fused, dtype),
                                             run(eager, dtype), run(eager, torch.float64)):
        assert_within_2x_of_stock(name, value, stock_value, ref, dtype)


# The layer and the patched model.

QUERY_PRE_ATTN_SCALAR, WINDOW, SOFTCAP = 24, 4, 5.0


def gemma_model(kind, dtype=torch.float32, seed=0, **overrides):
    """A tiny Gemma2ForCausalLM / Gemma3ForCausalLM from a config: 2 layers, layer 0 sliding (window
    of 4 keys, fewer than the sequence), layer 1 global; logits scaled by 24^-0.5 (not the head
    dim's); attention softcap 5 (Gemma 3's config carries it, and Hugging Face's Gemma 3 never
    applies it); random norm weights (stock initialises them to zeros)."""
    torch.manual_seed(seed)
    options = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                   max_position_embeddings=64, query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR, sliding_window=WINDOW,
                   attn_logit_softcapping=SOFTCAP, layer_types=["sliding_attention", "full_attention"],
                   use_cache=False, attn_implementation="eager")
    options.update(overrides)
    if kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**options))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def per_token_formula(policy, element):
    """Bytes per token a GemmaLayer keeps (see its docstring), for these sizes."""
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    memory = element * (2 * HIDDEN + q_width) + 4 * HEADS + 16
    balanced = memory + element * (2 * HIDDEN + q_width + 2 * kv_width)
    return {"memory": memory, "balanced": balanced, "speed": balanced + 2 * element * INTER}[policy]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_gemma_layer_saves_the_documented_bytes(policy, dtype, qk_norm):
    layer = GemmaLayer(HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, softcap=None if qk_norm else SOFTCAP,
                       sliding_window=WINDOW, qk_norm=qk_norm, policy=policy, dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    rope_tables = 2 * LENGTH * (HEAD_DIM // 2) * 4  # the layer's fp32 cos/sin [1, N, D/2]
    assert layer.saved_bytes_per_token(x.element_size()) == per_token_formula(policy, x.element_size())
    assert saved_bytes(layer, x) == BATCH * LENGTH * per_token_formula(policy, x.element_size()) + rope_tables


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_policies_against_the_stock_layer(kind):
    """The stock layer keeps the probabilities and every intermediate; each policy keeps less, in
    order, and the patched layer's bytes with the model's rope tables are the formula."""
    model = gemma_model(kind, torch.bfloat16)
    stock = model.model.layers[1]
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(LENGTH)[None].expand(BATCH, LENGTH)
    rotary = model.model.rotary_emb
    rope = rotary(x, positions) if kind == "gemma2" else rotary(x, positions, "full_attention")
    mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1).to(torch.bfloat16)[None, None]
    eager = saved_bytes(stock, x, attention_mask=mask, position_embeddings=rope, position_ids=positions)
    saved = {p: saved_bytes(GemmaLayer.from_module(stock, policy=p), x, position_embeddings=rope)
             for p in ("speed", "balanced", "memory")}
    assert eager > saved["speed"] > saved["balanced"] > saved["memory"]
    tables = 2 * rope[0].numel() * rope[0].element_size()
    for policy, value in saved.items():
        assert value == BATCH * LENGTH * per_token_formula(policy, 2) + tables, policy


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_from_module_shares_every_parameter_and_reads_the_config(kind):
    model = gemma_model(kind)
    for index, stock in enumerate(model.model.layers):
        layer = GemmaLayer.from_module(stock)
        assert list(layer.state_dict()) == list(stock.state_dict())
        for (name, p), (_, q) in zip(stock.named_parameters(), layer.named_parameters()):
            assert p is q, name
        attn = layer.self_attn
        assert attn.scale == QUERY_PRE_ATTN_SCALAR**-0.5
        assert attn.window == ((WINDOW - 1, None) if index == 0 else None)
        # Gemma 2 caps the logits; Hugging Face's Gemma 3 attention never passes its softcap on.
        assert attn.softcap == (SOFTCAP if kind == "gemma2" else None)
        assert getattr(attn, "qk_norm", None) == (None if kind == "gemma2" else "gemma")
        if kind == "gemma3":
            # Gemma 3's rope theta per layer type: local 10^4 for sliding layers, global 10^6.
            assert attn.rope_theta == (1e4 if index == 0 else 1e6)


@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_patched_gemma_matches_stock(kind, dtype, policy, backend):
    reference, stock, patched = (gemma_model(kind, d) for d in (torch.float64, dtype, dtype))
    report = remat.patch(patched, policy=policy, backend=backend)
    prefix = "Gemma2" if kind == "gemma2" else "Gemma3"
    mine = [entry for entry in report.replaced if entry[0].startswith("model.")]
    assert mine == [("model.layers.0", f"{prefix}DecoderLayer", "HFGemmaLayer"),
                    ("model.layers.1", f"{prefix}DecoderLayer", "HFGemmaLayer"),
                    ("model.norm", f"{prefix}RMSNorm", "GemmaRMSNorm")]
    assert not report.left_alone
    assert {patched.model.layers[0].backend, patched.model.norm.backend} == {backend}
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (logits_and_grads(m, ids, mask, labels) for m in (reference, stock, patched))
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    assert_within_2x_of_stock("loss", got[1].reshape(1), base[1].reshape(1), want[1].reshape(1), dtype)
    assert set(got[2]) == set(want[2])
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)


def test_gemma_parts_alone():
    """Gemma's attention is replaced only inside a whole layer (left alone, with the reason); its
    MLPs and norms (the per-head q/k norms too) are replaced one by one."""
    model = gemma_model("gemma3")
    ids, mask, _ = batch()
    want = model(input_ids=ids, attention_mask=mask).logits
    report = remat.patch(model, modules=("attention", "mlp"))
    assert {name for name, _, _ in report.left_alone} == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all("whole decoder layer" in why for _, _, why in report.left_alone)
    assert [name for name, _, new in report.replaced if new == "SwiGLUMLP"] == ["model.layers.0.mlp",
                                                                                 "model.layers.1.mlp"]
    remat.unpatch(model)
    report = remat.patch(model, modules=("norm",))
    norms = [name for name, old, new in report.replaced if new == "GemmaRMSNorm"]
    assert "model.layers.0.self_attn.q_norm" in norms and len(norms) == 2 * 6 + 1
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, want, rtol=1e-4, atol=1e-4)


def test_bidirectional_gemma3_is_left_alone():
    model = gemma_model("gemma3", use_bidirectional_attention=True)
    report = remat.patch(model)
    reasons = {name: why for name, _, why in report.left_alone}
    assert set(reasons) >= {"model.layers.0", "model.layers.1"}
    assert "bidirectional" in reasons["model.layers.0"]


@pytest.mark.parametrize("policy", ["balanced", "memory"])
def test_compile_fullgraph_on_patched_gemma(policy):
    """The Gemma-specific Functions (norm, post-norm projection, sandwich MLP) trace into one graph."""
    model = gemma_model("gemma3")
    remat.patch(model, policy=policy)
    model.eval()  # the logits path (in training with labels the loss may be computed fused)
    ids, mask, labels = batch()
    frames, out, eager, compiled_grads, eager_grads = compiled_and_eager_steps(model, ids, mask, labels)
    assert frames == 1
    # Every position: a pad's attention output is 0 in both (eager runs right padding dense, the
    # compiled graph runs each row's pads as a sequence of their own).
    torch.testing.assert_close(out.logits, eager.logits)
    for name in eager_grads:
        torch.testing.assert_close(compiled_grads[name], eager_grads[name], msg=name)


@pytest.mark.parametrize("policy", ["balanced", "memory"])
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_autocast_bf16_matches_stock_autocast(kind, policy):
    ids, mask, labels = batch()
    reference, stock, patched = gemma_model(kind, torch.float64), gemma_model(kind), gemma_model(kind)
    remat.patch(patched, policy=policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        base = logits_and_grads(stock, ids, mask, labels)
        got = logits_and_grads(patched, ids, mask, labels)
    want = logits_and_grads(reference, ids, mask, labels)
    real = mask.bool()
    assert_within_2x_of_stock("logits", got[0][real].float(), base[0][real].float(), want[0][real], torch.bfloat16)
    for name in want[2]:
        assert got[2][name].dtype == torch.float32
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], torch.bfloat16)


@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
@pytest.mark.parametrize("kind,sizes,expected", [
    ("gemma2", dict(hidden=2304, intermediate=9216, softcap=50.0, sliding_window=4096),
     dict(speed=67632, balanced=30768, memory=13360)),
    ("gemma3", dict(hidden=2560, intermediate=10240, qk_norm=True, sliding_window=1024),
     dict(speed=73776, balanced=32816, memory=14384)),
])
def test_real_shaped_layer_keeps_the_readme_bytes(kind, sizes, expected, policy):
    """README's table: Gemma-2-2B- and Gemma-3-4B-shaped layers (8/4 heads of 256), bf16."""
    with torch.device("meta"):
        layer = GemmaLayer(num_heads=8, num_kv_heads=4, head_dim=256, query_pre_attn_scalar=256, policy=policy,
                           backend="torch", dtype=torch.bfloat16, **sizes)
    assert real_shaped_per_token(layer, 256) == layer.saved_bytes_per_token(2) == expected[policy]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["gemma2", "gemma3"])
@pytest.mark.parametrize("backend", [b for b in cpu_backends() if b != "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_layer_retains_what_it_saves(policy, dtype, backend, qk_norm):
    """What a forward keeps alive (remat.memory.retained_bytes) is what it saves for backward, less
    the caller's input: no temporary (fp32 norm copies, post-norm recompute) outlives the forward."""
    layer = GemmaLayer(HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, qk_norm=qk_norm, softcap=None if qk_norm else SOFTCAP,
                       sliding_window=WINDOW, policy=policy, backend=backend, dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    assert retained_bytes(layer, x) == saved_bytes(layer, x) - x.numel() * x.element_size() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_patched_gemma3_on_the_default_backend(dtype):
    """No backend named: on the CPU the global layer's attention runs PyTorch's flash kernel (aten)
    with the per-head q/k norms around it, the sliding layer remat's C++ kernel."""
    reference, stock, patched = (gemma_model("gemma3", d) for d in (torch.float64, dtype, dtype))
    remat.patch(patched)
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (logits_and_grads(m, ids, mask, labels) for m in (reference, stock, patched))
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_memory_policy_sandwich_mlp_runs_tiled(kind, dtype, monkeypatch):
    # Under "memory" Gemma's MLP with both sandwich norms is one Function; with tile_tokens it runs
    # over token tiles in both passes (22 rows, tiles of 4: five of 4 and one of 2), so does every
    # layer's attention (the sliding-window one too), and the step equals the float64 stock model
    # under the 2x rule, keeping the same bytes.
    from remat.autograd import norm_attention_tiled
    from remat.models import gemma

    rows_seen, attention_tiled = [], []
    original = gemma._sandwich_rows_backward
    monkeypatch.setattr(gemma, "_sandwich_rows_backward",
                        lambda ctx, h, *a: rows_seen.append(h.shape[0]) or original(ctx, h, *a))
    tiled_attention = norm_attention_tiled.backward_tiled
    monkeypatch.setattr(norm_attention_tiled, "backward_tiled",
                        lambda *a, **k: attention_tiled.append(1) or tiled_attention(*a, **k))
    reference, stock, patched = (gemma_model(kind, d) for d in (torch.float64, dtype, dtype))
    remat.patch(patched, policy="memory", tile_tokens=4)
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (logits_and_grads(m, ids, mask, labels) for m in (reference, stock, patched))
    assert sorted(rows_seen) == sorted(([4] * 5 + [2]) * 2)  # two layers
    assert len(attention_tiled) == 2  # the sliding-window layer's attention too
    assert_within_2x_of_stock("loss", got[1].reshape(1), base[1].reshape(1), want[1].reshape(1), dtype)
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)
    layer = GemmaLayer(HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, qk_norm=kind == "gemma3", policy="memory", dtype=dtype)
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    untiled = saved_bytes(layer, x)
    layer.tile_tokens = 4
    assert saved_bytes(layer, x) == untiled


def test_tiled_sandwich_mlp_makes_no_intermediate_beyond_a_tile():
    from test_tiling import LargestTensor

    from remat.models.gemma import _SandwichMLPFunction

    rows, tile = 64, 8
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(rows, HIDDEN, generator=gen, requires_grad=True)
    pre, post = (torch.zeros(HIDDEN, requires_grad=True) for _ in range(2))
    w_gate, w_up = (torch.randn(INTER, HIDDEN, generator=gen, requires_grad=True) for _ in range(2))
    w_down = torch.randn(HIDDEN, INTER, generator=gen, requires_grad=True)
    sizes, results = {}, {}
    for tiled in (0, tile):
        with LargestTensor() as forward:
            y = _SandwichMLPFunction.apply(h, pre, w_gate, w_up, w_down, post, 1e-6, "gelu_tanh", "torch", tiled)
        with LargestTensor() as backward:
            results[tiled] = torch.autograd.grad(y, (h, pre, w_gate, w_up, w_down, post), torch.ones_like(y))
        sizes[tiled] = (forward.largest, backward.largest)
    bound = max(rows * HIDDEN, tile * INTER, INTER * HIDDEN)
    assert min(sizes[0]) >= rows * INTER and max(sizes[tile]) <= bound
    for got, want in zip(results[tile], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
