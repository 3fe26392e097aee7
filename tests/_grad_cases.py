"""Every differentiable public entry of remat as a small gradient case, shared by
tests/test_double_backward.py and tests/test_grad_aliasing.py.

A case builds its computation twice from the same seeded values: remat's (float32) and the stock
PyTorch composite it replaces (float64, differentiable any number of times). ``build(stock)``
returns ``(run, leaves)``: ``run()`` computes the outputs (a tensor or a tuple; outputs that do
not require grad are ignored) from ``leaves``, the leaf tensors that require grad (inputs and
parameters); :func:`objective` reduces the outputs to a scalar. Shapes are tiny: the Triton
kernels run interpreted on the CPU.
"""

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.nn.moe import moe_block
from remat.nn.norm import GemmaRMSNorm
from remat.reference import attention_reference, attention_varlen_reference, layer_norm_reference, rms_norm_reference

from helpers import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, batch, cpu_backends

# remat's refusal (remat.autograd.common.refuse_double_backward) names the op first.
REFUSAL = "does not support double backward"

BACKENDS = cpu_backends()


class Case(NamedTuple):
    """``op``: the op name remat's refusal must give (None: any remat op, as in a whole model).
    ``stock_error``: for an entry that runs PyTorch's own autograd node, the error stock PyTorch
    raises for its double backward. ``penalized``: how many leading leaves have their gradient
    penalized (None: all). ``exact``: only remat's backward passes run, so first-order gradients
    under create_graph=True are bitwise those without."""

    name: str
    build: Callable
    op: str | None = None
    stock_error: str | None = None
    penalized: int | None = None
    exact: bool = True


def objective(outputs):
    """A scalar of a case's outputs (those that require grad) with fixed random cotangents, the
    same for remat and stock."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    g = torch.Generator().manual_seed(99)
    return sum((o * torch.randn(o.shape, generator=g).to(o.dtype)).sum()
               for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad)


def _values(seed, *shapes, scale=1.0):
    """Seeded float32 normal values, one tensor per shape (a scalar scale or one per shape)."""
    g = torch.Generator().manual_seed(seed)
    scales = scale if isinstance(scale, tuple) else (scale,) * len(shapes)
    return [torch.randn(*s, generator=g) * c for s, c in zip(shapes, scales)]


def _leaves(stock, values):
    """values as leaves requiring grad: float64 copies for the stock composite, float32 for remat."""
    return [v.to(torch.float64 if stock else torch.float32).requires_grad_(True) for v in values]


def _swiglu(x, w_gate, w_up, w_down, biases=(None, None, None)):
    """The stock SwiGLU MLP."""
    return F.linear(F.silu(F.linear(x, w_gate, biases[0])) * F.linear(x, w_up, biases[1]), w_down, biases[2])


# Norms.

def rms_norm(backend, residual):
    def build(stock):
        x, w, r = _leaves(stock, _values(1, (5, 24), (24,), (5, 24)))
        leaves = [x, w, r][:2 + residual]
        if stock:
            return (lambda: rms_norm_reference(x, w, 1e-6, r if residual else None)), leaves
        return (lambda: remat.rms_norm(x, w, residual=r if residual else None, backend=backend)), leaves
    return Case(f"rms_norm-{backend}{'-residual' * residual}", build, "remat.rms_norm")


def layer_norm(backend, residual):
    def build(stock):
        x, w, b, r = _leaves(stock, _values(2, (5, 24), (24,), (24,), (5, 24)))
        leaves = [x, w, b, r][:3 + residual]
        if stock:
            return (lambda: layer_norm_reference(x, w, b, 1e-5, r if residual else None)), leaves
        return (lambda: remat.layer_norm(x, w, b, residual=r if residual else None, backend=backend)), leaves
    return Case(f"layer_norm-{backend}{'-residual' * residual}", build, "remat.layer_norm")


def rms_norm_module(backend):
    """remat.nn.RMSNorm called with (x, residual)."""
    def build(stock):
        x, r = _leaves(stock, _values(3, (2, 3, 24), (2, 3, 24)))
        if stock:
            norm = torch.nn.RMSNorm(24, eps=1e-6, dtype=torch.float64)
            return (lambda: (norm(x + r), x + r)), [x, r, norm.weight]
        norm = remat.nn.RMSNorm(24, eps=1e-6, backend=backend)
        return (lambda: norm(x, r)), [x, r, norm.weight]
    return Case(f"nn.RMSNorm-{backend}-residual", build, "remat.rms_norm")


def gemma_rms_norm(backend):
    def build(stock):
        x, w = _leaves(stock, _values(4, (5, 24), (24,), scale=(1.0, 0.3)))
        if stock:
            return (lambda: rms_norm_reference(x, 1 + w, 1e-6)), [x, w]
        norm = GemmaRMSNorm(24, backend=backend)
        norm.weight = torch.nn.Parameter(w)
        return (lambda: norm(x)), [x, norm.weight]
    return Case(f"GemmaRMSNorm-{backend}", build, "remat's Gemma RMSNorm")


# MLPs.

def gated_mlp(backend, recompute, biases):
    def build(stock):
        x, wg, wu, wd, bg, bu, bd = _leaves(stock, _values(5, (6, 16), (24, 16), (24, 16), (16, 24), (24,), (24,),
                                                           (16,), scale=(1, .3, .3, .3, .1, .1, .1)))
        b = (bg, bu, bd) if biases else (None, None, None)
        leaves = [x, wg, wu, wd] + ([bg, bu, bd] if biases else [])
        if stock:
            return (lambda: _swiglu(x, wg, wu, wd, b)), leaves
        return (lambda: remat.gated_mlp(x, wg, wu, wd, b_gate=b[0], b_up=b[1], b_down=b[2], recompute=recompute,
                                        backend=backend)), leaves
    return Case(f"gated_mlp-{backend}-{recompute}{'-biases' * biases}", build, "remat.gated_mlp")


def gelu_mlp(backend, recompute):
    def build(stock):
        x, wf, bf, wp, bp = _leaves(stock, _values(6, (6, 16), (24, 16), (24,), (16, 24), (16,),
                                                   scale=(1, .3, .1, .3, .1)))
        if stock:
            return (lambda: F.linear(F.gelu(F.linear(x, wf, bf)), wp, bp)), [x, wf, bf, wp, bp]
        return (lambda: remat.gelu_mlp(x, wf, bf, wp, bp, recompute=recompute, backend=backend)), [x, wf, bf, wp, bp]
    return Case(f"gelu_mlp-{backend}-{recompute}", build, "remat.gelu_mlp")


def norm_mlp(backend, recompute, with_lora, tile_tokens=None):
    def build(stock):
        x, nw, wg, wu, wd, a, b = _leaves(stock, _values(7, (6, 16), (16,), (24, 16), (24, 16), (16, 24), (2, 16),
                                                         (24, 2), scale=(1, 1, .3, .3, .3, .3, .3)))
        leaves = [x, nw, wg, wu, wd] + ([a, b] if with_lora else [])
        if stock:
            def run():
                normed = rms_norm_reference(x, nw, 1e-6)
                up = F.linear(normed, wu) + (0.5 * F.linear(F.linear(normed, a), b) if with_lora else 0)
                return F.linear(F.silu(F.linear(normed, wg)) * up, wd)
            return run, leaves
        lora = (None, [remat.LoRAAdapter(a, b, None, 0.5)], None) if with_lora else None
        return (lambda: remat.norm_mlp(x, nw, wg, wu, wd, eps=1e-6, recompute=recompute, lora=lora,
                                       backend=backend, tile_tokens=tile_tokens)), leaves
    tiled = f"-tile={tile_tokens}" if tile_tokens else ""
    return Case(f"norm_mlp-{backend}-{recompute}{'-lora' * with_lora}{tiled}", build, "remat.norm_mlp")


def norm_gelu_mlp(backend, tile_tokens=None):
    def build(stock):
        x, nw, nb, wf, bf, wp, bp = _leaves(stock, _values(8, (6, 16), (16,), (16,), (24, 16), (24,), (16, 24), (16,),
                                                           scale=(1, 1, .1, .3, .1, .3, .1)))
        leaves = [x, nw, nb, wf, bf, wp, bp]
        if stock:
            return (lambda: F.linear(F.gelu(F.linear(layer_norm_reference(x, nw, nb, 1e-5), wf, bf)), wp, bp)), leaves
        return (lambda: remat.norm_gelu_mlp(x, nw, nb, wf, bf, wp, bp, backend=backend,
                                            tile_tokens=tile_tokens)), leaves
    tiled = f"-tile={tile_tokens}" if tile_tokens else ""
    return Case(f"norm_gelu_mlp-{backend}{tiled}", build, "remat.norm_gelu_mlp")


def moe(backend):
    """remat.nn.moe.moe_block (the Mixtral / Qwen3-MoE block): RMSNorm, router, top-2 of 3 experts."""
    def build(stock):
        x, nw, wr, gate_up, down = _leaves(stock, _values(9, (6, 16), (16,), (3, 16), (3, 48, 16), (3, 16, 24),
                                                          scale=(1, 1, .5, .3, .3)))
        leaves = [x, nw, wr, gate_up, down]
        if stock:
            def run():
                normed = rms_norm_reference(x, nw, 1e-6)
                logits = F.linear(normed, wr)
                top, indices = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
                weights = top / top.sum(dim=-1, keepdim=True)
                out = torch.zeros_like(x)
                for e in range(3):
                    y_e = _swiglu(normed, gate_up[e, :24], gate_up[e, 24:], down[e])
                    out = out + y_e * (weights * (indices == e)).sum(dim=-1, keepdim=True)
                return out, logits
            return run, leaves
        return (lambda: moe_block(x, wr, gate_up, down, 2, renormalize=True, fp32_weights=True, norm_weight=nw,
                                  eps=1e-6, backend=backend)[:2]), leaves
    return Case(f"moe_block-{backend}", build, "remat's mixture-of-experts block")


# Attention.

def _rope_tables(length, head_dim):
    angles = torch.arange(length, dtype=torch.float64)[:, None] * 0.3 ** torch.arange(head_dim // 2)
    return angles.cos(), angles.sin()


def attention(backend, rope=False):
    def build(stock):
        # N < M (bottom-right causal alignment), except on the aten core, which aligns top-left.
        n = 7 if backend == "aten" else 5
        q, k, v = _leaves(stock, _values(10, (1, n, 2, 8), (1, 7, 1, 8), (1, 7, 1, 8)))
        tables = tuple(t.to(q.dtype) for t in _rope_tables(7, 8)) if rope else None
        if stock:
            return (lambda: attention_reference(q, k, v, causal=True, rope=tables)), [q, k, v]
        return (lambda: remat.attention(q, k, v, causal=True, rope=tables, backend=backend)), [q, k, v]
    # On the CPU the aten core without rope runs PyTorch's flash kernel through PyTorch's own
    # autograd node (remat.ops.attention.cpu_flash_attention): stock's double backward error.
    stock_error = "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"
    return Case(f"attention-{backend}{'-rope' * rope}", build, "remat.attention",
                stock_error if backend == "aten" and not rope else None)


def varlen_attention(backend):
    def build(stock):
        q, k, v = _leaves(stock, _values(11, (7, 2, 8), (7, 1, 8), (7, 1, 8)))
        offsets = torch.tensor([0, 3, 7], dtype=torch.int32)
        if stock:
            return (lambda: attention_varlen_reference(q, k, v, offsets, offsets, causal=True)), [q, k, v]
        return (lambda: remat.attention(q, k, v, causal=True, cu_seqlens_q=offsets, cu_seqlens_k=offsets,
                                        backend=backend)), [q, k, v]
    return Case(f"varlen_attention-{backend}", build, "remat.attention (packed sequences)")


def norm_attention(backend, keep_qkv, qk_norm, tile_tokens=None):
    def build(stock):
        x, nw, wq, wk, wv, qn, kn = _leaves(stock, _values(12, (1, 5, 16), (16,), (16, 16), (8, 16), (8, 16), (8,),
                                                           (8,), scale=(1, 1, .3, .3, .3, 1, 1)))
        leaves = [x, nw, wq, wk, wv] + ([qn, kn] if qk_norm else [])
        if stock:
            def run():
                normed = rms_norm_reference(x, nw, 1e-6)
                q, k, v = (F.linear(normed, w).view(1, 5, -1, 8) for w in (wq, wk, wv))
                if qk_norm:
                    q, k = rms_norm_reference(q, qn, 1e-6), rms_norm_reference(k, kn, 1e-6)
                return attention_reference(q, k, v, causal=True)
            return run, leaves
        qk = dict(qk_norm="rms", q_norm_weight=qn, k_norm_weight=kn) if qk_norm else {}
        return (lambda: remat.norm_attention(x, nw, wq, wk, wv, num_heads=2, num_kv_heads=1, eps=1e-6,
                                             keep_qkv=keep_qkv, backend=backend, tile_tokens=tile_tokens,
                                             **qk)), leaves
    tiled = f"-tile={tile_tokens}" if tile_tokens else ""
    return Case(f"norm_attention-{backend}-keep_qkv={keep_qkv}{'-qk_norm' * qk_norm}{tiled}", build,
                "remat.norm_attention")


# Projections, loss, dropout.

def lora_linear(backend):
    def build(stock):
        x, w, b, a, bb = _leaves(stock, _values(13, (6, 16), (12, 16), (12,), (2, 16), (12, 2),
                                                scale=(1, .3, .1, .3, .3)))
        leaves = [x, w, b, a, bb]
        if stock:
            return (lambda: F.linear(x, w, b) + 0.5 * F.linear(F.linear(x, a), bb)), leaves
        return (lambda: remat.lora_linear(x, w, b, [remat.LoRAAdapter(a, bb, None, 0.5)], backend=backend)), leaves
    return Case(f"lora_linear-{backend}", build, "remat.lora_linear")


def linear_cross_entropy(backend, tile_tokens=None):
    def build(stock):
        x, w, b = _leaves(stock, _values(14, (6, 16), (40, 16), (40,), scale=(1, .3, .1)))
        target = torch.tensor([3, 0, 39, -100, 7, 7])
        if stock:
            return (lambda: F.cross_entropy(F.linear(x, w, b), target)), [x, w, b]
        return (lambda: remat.linear_cross_entropy(x, w, target, b, tile_tokens=tile_tokens, backend=backend)), [
            x, w, b]
    tiled = f"-tile={tile_tokens}" if tile_tokens else ""
    return Case(f"linear_cross_entropy-{backend}{tiled}", build, "remat.linear_cross_entropy")


def dropout(backend):
    """remat.dropout against x * keep / (1 - p), keep read off remat's own output (the same seed)."""
    def build(stock):
        (x,) = _leaves(stock, _values(15, (5, 12)))
        torch.manual_seed(0)
        keep = remat.dropout(x.detach().float(), 0.5, backend=backend) != 0
        if stock:
            return (lambda: x * keep / 0.5), [x]

        def run():
            torch.manual_seed(0)
            return remat.dropout(x, 0.5, backend=backend)
        return run, [x]
    return Case(f"dropout-{backend}", build, "remat.dropout")


# The chain executor and whole patched models.

def checkpoint_sequential():
    """remat.checkpoint_sequential over four stock blocks, two checkpointed segments."""
    def build(stock):
        torch.manual_seed(16)
        blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.Tanh())
                                       for _ in range(4)])
        (x,) = _leaves(stock, _values(16, (3, 12)))
        if stock:
            blocks.double()
            return (lambda: blocks(x)), [x, *blocks.parameters()]
        return (lambda: remat.checkpoint_sequential(blocks, x, strategy="uniform", segments=2)), \
            [x, *blocks.parameters()]
    return Case("checkpoint_sequential", build, "remat's checkpointed chain")


def patched_model(kind, policy, layers=2):
    """A tiny Hugging Face causal LM patched with ``policy`` (the stock side: not patched, in
    float64), its training loss from inputs_embeds; the first leaf is inputs_embeds, the only
    gradient penalized (loss + ||dL/d inputs_embeds||^2), the others its parameters.
    ``policy="auto"`` plans at the smallest feasible budget, which with 6 layers re-runs a span of
    two layers through the chain executor (remat.checkpoint.executor)."""
    def build(stock):
        transformers = pytest.importorskip("transformers")
        from remat.planning import model_plan

        torch.manual_seed(0)
        common = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=64, use_cache=False, attn_implementation="eager")
        if kind == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
        else:
            model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, query_pre_attn_scalar=16))
        ids, mask, labels = batch()
        with torch.no_grad():
            embeds = model.get_input_embeddings()(ids)
        inputs = dict(inputs_embeds=embeds, attention_mask=mask, labels=labels)
        if stock:
            model.double()
            inputs["inputs_embeds"] = embeds = embeds.double()
        elif policy == "auto":
            floor = model_plan.smallest_feasible_budget(model_plan.measure_model_costs(model, inputs))
            plan = remat.patch(model, policy="auto", budget_bytes=floor, example_inputs=inputs).plan
            assert any(end - start > 1 for start, end in plan.spans()), plan.explain()
        else:
            remat.patch(model, policy=policy)
        model.train()
        embeds.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
        return (lambda: model(**inputs).loss), [embeds, *params]
    name = policy if isinstance(policy, str) else "per-layer"
    # With stock layers left in the model, their double-differentiable backward formulas round
    # differently under create_graph=True.
    return Case(f"patched-{kind}-{name}", build, None, penalized=1, exact=isinstance(policy, str))


def under_checkpoint(case):
    """``case`` with remat's side run under remat.checkpoint (PyTorch's non-reentrant checkpoint,
    whose unpack hooks allow each saved tensor one unpack in backward, recomputing the forward)."""
    def build(stock):
        run, leaves = case.build(stock)
        return (run if stock else lambda: remat.checkpoint(run)), leaves
    return case._replace(name=f"checkpoint-{case.name}", build=build)


def entry_cases():
    """One case per public entry, backend and option that changes which Function or kernel runs."""
    cases = []
    for backend in BACKENDS:
        cases += [rms_norm(backend, False), rms_norm(backend, True), layer_norm(backend, False),
                  layer_norm(backend, True), rms_norm_module(backend), gemma_rms_norm(backend),
                  gelu_mlp(backend, "block"), norm_mlp(backend, "block", False), norm_gelu_mlp(backend),
                  attention(backend), attention(backend, rope=True), varlen_attention(backend),
                  norm_attention(backend, True, False), lora_linear(backend), linear_cross_entropy(backend),
                  dropout(backend), moe(backend)]
        cases += [gated_mlp(backend, recompute, biases=False) for recompute in ("none", "activation", "block")]
    cases += [gated_mlp("torch", "none", biases=True), gelu_mlp("torch", "activation"),
              norm_mlp("torch", "activation", True), norm_attention("torch", False, True),
              norm_attention("cpp" if "cpp" in BACKENDS else "torch", False, True, tile_tokens=2),
              linear_cross_entropy("cpp" if "cpp" in BACKENDS else "torch", tile_tokens=4),
              norm_mlp("torch", "block", True, tile_tokens=4), norm_gelu_mlp("torch", tile_tokens=4), attention("aten"),
              attention("aten", rope=True), under_checkpoint(norm_mlp("torch", "activation", True)),
              under_checkpoint(rms_norm("cpp", True)),
              checkpoint_sequential()]
    return cases
