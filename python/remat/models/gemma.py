"""The Gemma 2 and Gemma 3 family: Hugging Face ``Gemma2DecoderLayer`` and ``Gemma3DecoderLayer``
(text) as :class:`GemmaLayer`, and their RMSNorm (remat.nn.norm.GemmaRMSNorm) and MLP modules one
by one.

Their computation is shared: Gemma's RMSNorm ``norm(x.float()) * (1 + w.float())`` rounded once
to x's dtype (remat's ``norm="gemma"``), "sandwich" norms (a post-norm on each sub-block's output
before its residual add, and the MLP's own pre-norm ``pre_feedforward_layernorm``), a GELU-tanh
gated MLP, logits scaled by ``query_pre_attn_scalar ** -0.5``, sliding-window layers where
``config.layer_types`` says so. Gemma 2 caps the attention logits (``attn_logit_softcapping``,
``softcap * tanh(s / softcap)``); Gemma 3 normalizes each head of q and k (``q_norm``, ``k_norm``,
Gemma norms over the head dim) before rope instead, and Hugging Face's Gemma 3 attention never
passes ``attn_logit_softcapping`` to the attention function, so remat does not cap there either.
The final logit softcap, the embedding scale and the per-layer-type rope tables are the model's,
outside the layers.
"""

import torch
import torch.nn.functional as F

from remat import checks, functional
from remat.autograd.common import (
    into_rows,
    linear_grads,
    refuse_double_backward,
    sequence_tiles,
    tiled_rows_backward,
)
from remat.autograd.norm import norm_backward, norm_forward
from remat.backend import resolve_backend
from remat.hf import rope_type_of
from remat.models.registry import Family, Part
from remat.nn import adapters
from remat.nn.attention import Attention, QKNormAttention, attention_from_hf
from remat.nn.layers import LAYER_POLICIES, PreNormDecoderLayer
from remat.nn.mlp import SwiGLUMLP
from remat.nn.norm import GemmaRMSNorm, is_gemma_rms_norm
from remat.ops import ops_for
from remat.sequences import varlen_arguments
from remat.tiles import resolve_tile_tokens


class _PostNormLinearFunction(torch.autograd.Function):
    """y = gemma_norm(o W^T + b): a projection and the sandwich post-norm after it, keeping o (the
    attention output, which the attention sub-block keeps anyway: the same storage counts once)
    and the fp32 rstd; backward recomputes the projection's output (one GEMM) for the norm
    backward. o rows [R, K]; y [R, H] in o's dtype."""

    @staticmethod
    def forward(ctx, o, weight, bias, norm_weight, eps, backend):
        a = F.linear(o, weight, bias)
        y, _, rstd = norm_forward(a, norm_weight, None, "gemma", eps, backend)
        ctx.save_for_backward(o, weight, bias, norm_weight, rstd)
        ctx.eps, ctx.backend = eps, backend
        return y

    @staticmethod
    @refuse_double_backward("remat's Gemma projection + post-norm")
    def backward(ctx, dy):
        o, weight, bias, norm_weight, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        a = F.linear(o, weight, bias)
        da, d_norm_weight, _ = norm_backward(dy.contiguous(), a, norm_weight, None, rstd, "gemma", False, ctx.backend)
        del a
        do, dw, db = linear_grads(da, o, weight, need[0], need[1], need[2] and bias is not None)
        return do, dw, db, d_norm_weight if need[3] else None, None, None


class _SandwichMLPFunction(torch.autograd.Function):
    """y = gemma_norm_post(down(act(gate(n)) * up(n))) with n = gemma_norm_pre(h): Gemma's MLP
    sub-block between its two norms, keeping only h and the two fp32 rstd; backward recomputes
    the pre-norm, the gate/up GEMMs, the activation and the down GEMM (for the post-norm's
    backward), then every gradient. h rows [R, H]; no biases (Gemma has none).

    Sequence tiling (``tile`` rows, 0 = none), as remat.norm_mlp's: forward and backward run over
    tiles of rows, so no [rows, intermediate] tensor exists beyond one tile; the rstd are written
    per tile into whole-size tensors; weight gradients are summed over the tiles in fp32."""

    @staticmethod
    def forward(ctx, h, pre_weight, w_gate, w_up, w_down, post_weight, eps, activation, backend, tile=0):
        ops = ops_for("mlp", backend)
        params = (pre_weight, w_gate, w_up, w_down, post_weight, eps, activation, backend)
        rows = h.shape[0]
        tiles = sequence_tiles(rows, tile)
        if len(tiles) == 1:
            y, rstd_pre, rstd_post = _sandwich_rows(ops, h, *params)
        else:
            y = rstd_pre = rstd_post = None
            for start, end in tiles:
                y_t, rstd_pre_t, rstd_post_t = _sandwich_rows(ops, h[start:end], *params)
                y, rstd_pre, rstd_post = (into_rows(whole, part, start, rows) for whole, part in
                                          ((y, y_t), (rstd_pre, rstd_pre_t), (rstd_post, rstd_post_t)))
                del y_t
        ctx.save_for_backward(h, pre_weight, w_gate, w_up, w_down, post_weight, rstd_pre, rstd_post)
        ctx.eps, ctx.activation, ctx.backend, ctx.tile = eps, activation, backend, tile
        ctx.grad_dtypes = (pre_weight.dtype, w_gate.dtype, w_up.dtype, w_down.dtype, post_weight.dtype,
                           None, None, None, None)
        return y

    @staticmethod
    @refuse_double_backward("remat's Gemma MLP sub-block")
    def backward(ctx, dy):
        h, pre_weight, w_gate, w_up, w_down, post_weight, rstd_pre, rstd_post = ctx.saved_tensors
        params = (pre_weight, w_gate, w_up, w_down, post_weight)
        dy = dy.contiguous()
        tiles = sequence_tiles(h.shape[0], ctx.tile)
        if len(tiles) == 1:
            return _sandwich_rows_backward(ctx, h, *params, rstd_pre, rstd_post, dy)
        return tiled_rows_backward(
            h, tiles, ctx.needs_input_grad[0], ctx.grad_dtypes,
            lambda start, end: _sandwich_rows_backward(ctx, h[start:end], *params, rstd_pre[start:end],
                                                       rstd_post[start:end], dy[start:end]))


def _sandwich_rows(ops, h, pre_weight, w_gate, w_up, w_down, post_weight, eps, activation, backend):
    """_SandwichMLPFunction's forward of rows h: (y, rstd_pre, rstd_post)."""
    normed, _, rstd_pre = norm_forward(h, pre_weight, None, "gemma", eps, backend)
    gate, up = F.linear(normed, w_gate), F.linear(normed, w_up)
    del normed
    m = F.linear(ops.glu_fwd(gate, up, activation), w_down)
    del gate, up
    y, _, rstd_post = norm_forward(m, post_weight, None, "gemma", eps, backend)
    return y, rstd_pre, rstd_post


def _sandwich_rows_backward(ctx, h, pre_weight, w_gate, w_up, w_down, post_weight, rstd_pre, rstd_post, dy):
    """_SandwichMLPFunction's gradient tuple for rows h (with those rows of the rstd and dy)."""
    need = ctx.needs_input_grad
    ops = ops_for("mlp", ctx.backend)
    normed, _, _ = norm_forward(h, pre_weight, None, "gemma", ctx.eps, ctx.backend)
    gate, up = F.linear(normed, w_gate), F.linear(normed, w_up)
    act = ops.glu_fwd(gate, up, ctx.activation)
    m = F.linear(act, w_down)
    dm, d_post, _ = norm_backward(dy, m, post_weight, None, rstd_post, "gemma", False, ctx.backend)
    del m
    d_act, d_w_down, _ = linear_grads(dm, act, w_down, True, need[4], False)
    del act, dm
    dgate, dup, _ = ops.glu_bwd(d_act.contiguous(), gate, up, ctx.activation, False)
    del gate, up, d_act
    d_normed, d_w_gate, _ = linear_grads(dgate, normed, w_gate, True, need[2], False)
    d_normed_up, d_w_up, _ = linear_grads(dup, normed, w_up, True, need[3], False)
    del normed, dgate, dup
    dh, d_pre, _ = norm_backward((d_normed + d_normed_up).contiguous(), h, pre_weight, None, rstd_pre, "gemma",
                                 False, ctx.backend)
    return (dh, d_pre if need[1] else None, d_w_gate, d_w_up, d_w_down, d_post if need[5] else None, None, None,
            None, None)


# Hugging Face's Gemma decoder layers: whether the attention has per-head q/k norms, and whether
# the attention function is given the config's attn_logit_softcapping (Gemma 3's is not).
_VARIANTS = {"Gemma2DecoderLayer": dict(qk_norm=None, softcap=True),
             "Gemma3DecoderLayer": dict(qk_norm="gemma", softcap=False)}


class GemmaLayer(PreNormDecoderLayer):
    """A Gemma 2 / Gemma 3 decoder layer built from remat's fused blocks, with Hugging Face's
    parameter names: ``input_layernorm``, ``self_attn`` (q/k/v/o_proj; Gemma 3: ``q_norm``,
    ``k_norm``), ``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``mlp``
    (gate/up/down_proj), ``post_feedforward_layernorm``; every norm is a :class:`GemmaRMSNorm`.

    ``h = x + gn_pa(o_proj(attention(gn_in(x))))``, ``y = h + gn_pf(mlp(gn_ff(h)))`` with gn the
    Gemma norms; attention: causal GQA with rope, logits scaled by ``query_pre_attn_scalar**-0.5``,
    an optional logit softcap (Gemma 2) and sliding window, optional per-head Gemma norms of q and k
    before rope (Gemma 3; fused into the attention sub-block and recomputed, never saved); MLP:
    ``down(gelu_tanh(gate) * up)``.

    ``policy`` as for remat.nn.LlamaLayer; the sandwich post-norms need their inputs (o_proj's and
    down_proj's outputs, which no fused sub-block has) for backward. Bytes kept per token (element
    size s, h hidden, I intermediate, Hq / Hkv heads of dim D; :meth:`saved_bytes_per_token`):

    - ``"speed"``: no GEMM is recomputed. Keeps x, q, k, v (before the q/k norms), o, the
      post-norms' inputs, h, gate and up, lse and four fp32 rstd:
      ``s(4h + 2 Hq D + 2 Hkv D + 2I) + 4 Hq + 16``.
    - ``"balanced"`` (default): the MLP's gate/up GEMMs are recomputed:
      ``s(4h + 2 Hq D + 2 Hkv D) + 4 Hq + 16``.
    - ``"memory"``: the q/k/v projections are recomputed, and so are the post-norms' inputs:
      o_proj's output from o (kept anyway, one GEMM) and the MLP's output with the rest of the MLP
      (its whole forward, between its two norms, is one Function keeping h): ``s(2h + Hq D) +
      4 Hq + 16``, LlamaLayer's memory bytes plus two fp32 rstd.

    In bf16 with Hq D = h these are ``2(6h + 2 Hkv D + 2I)``, ``2(6h + 2 Hkv D)`` and ``2(3h)``,
    plus ``4 Hq + 16``.

    PEFT LoRA adapters (remat.nn.adapters) join the fused sub-blocks and add no bytes per token,
    except under "memory": LoRA on o_proj, or on any MLP projection, makes that sub-block's
    post-norm keep its input, ``s h`` more each. Each adapter with dropout keeps 16 bytes per
    call. A projection of another linear type runs its sub-block unfused under checkpoint
    (keeping the sub-block's input). Norms, rope, the attention probabilities and the MLP activation are always
    recomputed.

    Args:
        hidden, intermediate, num_heads, num_kv_heads, head_dim: sizes (num_kv_heads default
            num_heads; head_dim default hidden // num_heads).
        eps: the norms' epsilon (1e-6). rope_theta: default 10000 (Gemma 3's global layers: 1e6).
        query_pre_attn_scalar: logits are scaled by its inverse square root (default head_dim).
        softcap: attention logit cap (Gemma 2: 50.0) or None. sliding_window: keys within the last
            ``sliding_window`` positions, or None. qk_norm: per-head Gemma norms of q and k (Gemma 3).
        attention_dropout: probability, in training. policy, backend: as for LlamaLayer.

    ``forward(hidden_states, attention_mask=None, position_ids=None, position_embeddings=None)``
    as LlamaLayer's.
    """

    def __init__(self, hidden, intermediate, num_heads, num_kv_heads=None, head_dim=None, *, eps=1e-6,
                 rope_theta=10000.0, query_pre_attn_scalar=None, softcap=None, sliding_window=None, qk_norm=False,
                 attention_dropout=0.0, policy="balanced", backend=None, device=None, dtype=None):
        super().__init__()
        checks.check_choice(policy, "policy", LAYER_POLICIES)
        head_dim = hidden // num_heads if head_dim is None else head_dim
        scale = float(query_pre_attn_scalar if query_pre_attn_scalar is not None else head_dim) ** -0.5
        window = None if sliding_window is None else (int(sliding_window) - 1, None)
        attention = dict(bias=False, rope_theta=rope_theta, dropout=attention_dropout, causal=True, window=window,
                         softcap=softcap, scale=scale, backend=backend, device=device, dtype=dtype)
        if qk_norm:
            self.self_attn = QKNormAttention(hidden, num_heads, num_kv_heads, head_dim, qk_norm="gemma", qk_eps=eps,
                                             **attention)
        else:
            self.self_attn = Attention(hidden, num_heads, num_kv_heads, head_dim, **attention)
        self.mlp = SwiGLUMLP(hidden, intermediate, activation="gelu_tanh", backend=backend, device=device, dtype=dtype)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(hidden, eps, device=device, dtype=dtype, backend=backend))
        self.policy, self.backend = policy, backend

    @classmethod
    def from_module(cls, stock, *, policy="balanced", backend=None):
        """A GemmaLayer sharing every parameter (no copy) of a Hugging Face ``Gemma2DecoderLayer``
        or ``Gemma3DecoderLayer``; sizes, epsilons, scale, softcap, this layer's sliding window and
        rope from its config. A bidirectional Gemma (``use_bidirectional_attention``) raises."""
        variant = _VARIANTS.get(type(stock).__name__)
        if variant is None:
            raise TypeError(f"from_module expects a Gemma2DecoderLayer or Gemma3DecoderLayer, got "
                            f"{type(stock).__name__}")
        attn = stock.self_attn
        config = attn.config
        rope_theta, rope_type = None, None
        layer_type = (getattr(config, "layer_types", None) or [None] * (attn.layer_idx + 1))[attn.layer_idx]
        per_type = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
        if isinstance(per_type, dict):
            # Gemma 3: rope parameters per layer type (global and sliding layers differ).
            rope_type = per_type.get("rope_type", "default")
            rope_theta = per_type.get("rope_theta") if rope_type == "default" else None
        elif per_type is None:
            rope_type = rope_type_of(config)
        softcap = getattr(config, "attn_logit_softcapping", None) if variant["softcap"] else None
        module = cls._empty(policy, backend)
        module.self_attn = attention_from_hf(attn, qk_norm=variant["qk_norm"], rope_theta=rope_theta,
                                             rope_type=rope_type, softcap=softcap, backend=backend)
        module.mlp = SwiGLUMLP.from_module(stock.mlp, backend=backend)
        if module.mlp.activation != "gelu_tanh":
            raise ValueError(f"GemmaLayer takes Gemma's GELU-tanh MLP, got activation {module.mlp.activation!r}")
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(module, name, GemmaRMSNorm.from_module(getattr(stock, name), backend=backend))
        module.train(stock.training)
        return module

    def saved_bytes_per_token(self, element_size):
        """Bytes this layer keeps for backward per token under its policy (the formulas above),
        for activations of ``element_size`` bytes; without the per-call extras (16 bytes of RNG
        state with attention dropout, the rope tables)."""
        attn = self.self_attn
        hidden = attn.q_proj.in_features
        q_width, kv_width = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        stats = 4 * attn.num_heads + 16  # fp32 lse per query head, four fp32 rstd
        memory = element_size * (2 * hidden + q_width) + stats
        balanced = memory + element_size * (2 * hidden + q_width + 2 * kv_width)  # + q, k, v, post-norm inputs
        speed = balanced + 2 * element_size * self.mlp.gate_proj.out_features
        if self.policy == "memory":
            # LoRA on o_proj, or on the MLP: that post-norm keeps its input (remat.nn.adapters).
            mlp = [getattr(self.mlp, f"{p}_proj") for p in ("gate", "up", "down")]
            memory += element_size * hidden * sum(any(adapters.read_projection(m).adapters for m in modules)
                                                  for modules in ([attn.o_proj], mlp))
        return {"memory": memory, "balanced": balanced, "speed": speed}[self.policy]

    def attention_output(self, x, position_ids, position_embeddings, layout=None):
        attn, norm = self.self_attn, self.input_layernorm
        rope = attn.rope_for(x.shape[1], x.device, position_ids, position_embeddings)
        projections = [adapters.read_projection(getattr(attn, f"{p}_proj")) for p in "qkv"]
        if any(p.generic for p in projections):
            qk_norms = (attn.q_norm, attn.k_norm) if isinstance(attn, QKNormAttention) else None
            return adapters.checkpointed(
                lambda t: adapters.unfused_attention(norm, attn, t, rope, qk_norms, layout), x)
        weights, biases = adapters.weights_like(projections, x)
        qk = {}
        if isinstance(attn, QKNormAttention):
            qk = dict(qk_norm=attn.qk_norm, q_norm_weight=checks.vector_like(attn.q_norm.weight, x),
                      k_norm_weight=checks.vector_like(attn.k_norm.weight, x), qk_eps=attn.qk_eps_for(x))
        return functional.norm_attention(
            x, checks.vector_like(norm.weight, x), *weights, b_q=biases[0], b_k=biases[1], b_v=biases[2],
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, norm="gemma", eps=norm.eps, **qk,
            causal=attn.causal, scale=attn.scale, rope=rope, window=attn.window, softcap=attn.softcap,
            dropout_p=attn.dropout if attn.training else 0.0, keep_qkv=self.keeps_qkv,
            lora=adapters.lora_argument(projections), backend=attn.backend, **varlen_arguments(layout),
            **self.attention_tile_arguments(layout, attn.causal, attn.window, attn.dropout if attn.training else 0.0))

    def out_proj(self, o):
        """o_proj, then the sandwich post-norm ``post_attention_layernorm`` (before the residual
        add); under the memory policy one Function that recomputes o_proj's output in backward."""
        o_proj, norm = adapters.read_projection(self.self_attn.o_proj), self.post_attention_layernorm
        if self.policy != "memory" or o_proj.generic or o_proj.adapters:
            # With adapters or another linear module, the post-norm keeps its input (one [h] per token).
            return norm(adapters.linear_projection(o_proj, o, self.backend))
        rows = checks.as_rows(o)
        name = resolve_backend(self.backend, o)
        (rows, *params), autocast_off = checks.autocast_cast(rows, o_proj.weight, o_proj.bias,
                                                            checks.vector_like(norm.weight, o))
        params = [checks.cast_like(p, rows) for p in params]
        with autocast_off:
            y = _PostNormLinearFunction.apply(rows, *params, norm.eps, name)
        return y.view(*o.shape[:-1], y.shape[-1])

    def mlp_block(self, h):
        """pre_feedforward_layernorm and the GELU-tanh gated MLP (one fused sub-block), then the
        sandwich post-norm ``post_feedforward_layernorm``; under the memory policy all of it is one
        Function keeping h and two fp32 rstd."""
        mlp, norm, post = self.mlp, self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        projections = [adapters.read_projection(getattr(mlp, f"{p}_proj")) for p in ("gate", "up", "down")]
        if any(p.generic for p in projections):
            return adapters.checkpointed(lambda t: post(adapters.unfused_gated_mlp(norm, mlp, t)), h)
        weights, _ = adapters.weights_like(projections, h)
        biases = [p.bias for p in projections]
        lora = adapters.lora_argument(projections)
        if self.policy == "memory" and all(b is None for b in biases) and lora is None:
            checks.check_input(h)
            name = resolve_backend(self.backend, h)
            (rows, *params), autocast_off = checks.autocast_cast(
                checks.as_rows(h), checks.vector_like(norm.weight, h), *weights, checks.vector_like(post.weight, h))
            # A tile's working set: gate, up, the activation and their gradients, [tile, I] each.
            tile = resolve_tile_tokens(checks.check_tile_tokens(self.tile_tokens), rows.shape[0],
                                       6 * params[1].shape[0] * rows.element_size(), rows.device)
            with autocast_off:
                y = _SandwichMLPFunction.apply(rows, *params, norm.eps, mlp.activation, name, tile)
            return y.view(*h.shape[:-1], y.shape[-1])
        m = functional.norm_mlp(
            h, checks.vector_like(norm.weight, h), *weights, norm="gemma", eps=norm.eps, activation=mlp.activation,
            b_gate=checks.cast_like(biases[0], h), b_up=checks.cast_like(biases[1], h),
            b_down=checks.cast_like(biases[2], h), recompute=self.mlp_recompute, lora=lora, backend=self.backend,
            tile_tokens=self.tile_tokens)
        # With adapters under the memory policy, the post-norm keeps its input (one [h] per token).
        return post(m)


class HFGemmaLayer(GemmaLayer):
    """remat.nn.GemmaLayer in a Hugging Face model: the same forward, which takes a Gemma 2 / Gemma 3
    decoder layer's arguments (the 2-D padding mask a patched model builds, packed-row offsets)
    and, with a KV cache, runs the replaced stock layer (see PreNormDecoderLayer.forward)."""


FAMILY = Family(
    name="gemma",
    layer_classes=tuple(_VARIANTS),
    # Their forwards apply config.final_logit_softcapping, which the fused loss takes as its cap.
    causal_lms=("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
    build_layer=HFGemmaLayer.from_module,
    parts=(
        Part("mlp", ("Gemma2MLP", "Gemma3MLP"), SwiGLUMLP.from_module),
        Part("norm", ("Gemma2RMSNorm", "Gemma3RMSNorm"), GemmaRMSNorm.from_module, accepts=is_gemma_rms_norm),
    ),
    whole_only=("Gemma2Attention", "Gemma3Attention"),
    whole_only_reason=("Gemma's attention (softcap or per-head q/k norms, and the sandwich norms around it) is "
                       "replaced only as part of a whole decoder layer: pass all of modules=('norm', 'mlp', "
                       "'attention')"),
)
