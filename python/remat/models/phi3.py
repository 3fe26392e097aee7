"""The Phi-3 family: Hugging Face ``Phi3DecoderLayer`` as :class:`Phi3Layer`, a Llama-style layer
whose q/k/v projections are one ``qkv_proj`` (rows ``[q: Hq D | k: Hkv D | v: Hkv D]``) and whose
gate/up projections are one ``gate_up_proj`` (rows ``[gate: I | up: I]``), used as they are: the
fused sub-blocks take row slices of those weights (views, no copies; ``state_dict`` unchanged).
Residual dropout (``resid_pdrop``) after each sub-block, as Phi-3 has, with Philox masks.

PEFT LoRA on ``qkv_proj`` / ``gate_up_proj`` joins the fused sub-blocks as row slices of B (one
shared A, whose rank-r intermediate is recomputed per slice); with ``lora_dropout > 0`` there (one
mask shared by the slices) or with another linear type, the sub-block runs through the modules'
own forwards under checkpoint (the generic path of remat.nn.adapters: it keeps only its input and
re-runs in backward, whatever the policy). ``o_proj`` and ``down_proj`` take LoRA as Llama's.

Partial rotary embedding (``partial_rotary_factor < 1``: only the first ``r`` features of a head
rotate, in pairs ``(i, i + r/2)``) is refused: remat's rope kernels rotate the whole head (pairs
``(i, i + D/2)``). Phi-3's attention and MLP are replaced only as part of a whole layer.
"""

from torch import nn

from remat import checks, functional
from remat.hf import is_hf_rms_norm, rope_type_of, sliding_window_of
from remat.models.llama import _rms_norm
from remat.models.registry import Family, Part
from remat.nn import adapters
from remat.nn.attention import Attention
from remat.nn.layers import LAYER_POLICIES, PreNormDecoderLayer
from remat.nn.mlp import activation_of
from remat.nn.norm import RMSNorm
from remat.ops.mlp import ACTIVATIONS
from remat.sequences import varlen_arguments


class FusedQKVAttention(nn.Module):
    """Self-attention with Hugging Face's ``Phi3Attention`` parameters: ``qkv_proj`` (nn.Linear
    ``[hidden] -> [(Hq + 2 Hkv) D]``, rows q, then k, then v) and ``o_proj``. Holds the parameters
    and attention settings for :class:`Phi3Layer`; ``forward(x, position_ids=None,
    position_embeddings=None)`` runs it alone (remat.attention), as remat.nn.Attention does."""

    rope_for = Attention.rope_for
    rope_tables = Attention.rope_tables

    def __init__(self, hidden, num_heads, num_kv_heads=None, head_dim=None, *, rope_theta=10000.0, dropout=0.0,
                 window=None, backend=None, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = hidden // num_heads if head_dim is None else head_dim
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta, self.rope_type, self.dropout = rope_theta, "default", float(dropout)
        self.causal, self.window, self.softcap, self.scale, self.backend = True, window, None, None, backend
        # Registered in Phi3Attention's order, so state_dict keys come in the same order.
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False, device=device, dtype=dtype)
        self.qkv_proj = nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=False, device=device,
                                  dtype=dtype)

    def qkv_weights(self, x):
        """The q, k, v weights ``[Hq D, hidden]``, ``[Hkv D, hidden]`` x2 as row slices (views) of
        ``qkv_proj.weight`` in x's dtype, and the matching bias slices (or None)."""
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bounds = ((0, q_width), (q_width, q_width + kv_width), (q_width + kv_width, q_width + 2 * kv_width))
        weight, bias = checks.cast_like(self.qkv_proj.weight, x), checks.cast_like(self.qkv_proj.bias, x)
        weights = [weight[start:end] for start, end in bounds]
        biases = [None if bias is None else bias[start:end] for start, end in bounds]
        return weights, biases

    def forward(self, x, position_ids=None, position_embeddings=None):
        checks.check_hidden_states(x)
        batch, n, _ = x.shape
        weights, biases = self.qkv_weights(x)
        q, k, v = (nn.functional.linear(x, w, b).view(batch, n, -1, self.head_dim) for w, b in zip(weights, biases))
        rope = self.rope_for(n, x.device, position_ids, position_embeddings)
        o = functional.attention(q, k, v, causal=True, scale=self.scale, rope=rope,
                                 dropout_p=self.dropout if self.training else 0.0, window=self.window,
                                 backend=self.backend)
        o = o.reshape(batch, n, -1)
        return nn.functional.linear(o, checks.cast_like(self.o_proj.weight, o), checks.cast_like(self.o_proj.bias, o))


class FusedGateUpMLP(nn.Module):
    """Gated MLP with Hugging Face's ``Phi3MLP`` parameters: ``gate_up_proj`` (nn.Linear
    ``[hidden] -> [2I]``, rows gate then up) and ``down_proj``: ``down(up * act(gate))``. Holds the
    parameters for :class:`Phi3Layer`; ``forward`` runs it alone (remat.gated_mlp)."""

    def __init__(self, hidden, intermediate, *, activation="silu", backend=None, device=None, dtype=None):
        super().__init__()
        checks.check_choice(activation, "activation", ACTIVATIONS)
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device, dtype=dtype)
        self.activation, self.backend = activation, backend

    @property
    def intermediate(self):
        return self.down_proj.in_features

    def gate_up_weights(self, x):
        """(w_gate, w_up, b_gate, b_up): row slices (views) of gate_up_proj in x's dtype."""
        inter = self.intermediate
        weight, bias = checks.cast_like(self.gate_up_proj.weight, x), checks.cast_like(self.gate_up_proj.bias, x)
        return (weight[:inter], weight[inter:], None if bias is None else bias[:inter],
                None if bias is None else bias[inter:])

    def forward(self, x):
        w_gate, w_up, b_gate, b_up = self.gate_up_weights(x)
        return functional.gated_mlp(x, w_gate, w_up, checks.cast_like(self.down_proj.weight, x), b_gate=b_gate,
                                    b_up=b_up, b_down=checks.cast_like(self.down_proj.bias, x),
                                    activation=self.activation, backend=self.backend)


class Phi3Layer(PreNormDecoderLayer):
    """A Phi-3 decoder layer built from remat's fused blocks, with Hugging Face's ``Phi3DecoderLayer``
    parameter names: ``input_layernorm``, ``self_attn`` (``qkv_proj``, ``o_proj``),
    ``post_attention_layernorm``, ``mlp`` (``gate_up_proj``, ``down_proj``).

    ``h = x + dropout(o_proj(attention(rmsnorm(x))))``, ``y = h + dropout(mlp(rmsnorm(h)))``:
    remat.nn.LlamaLayer's computation with the q/k/v and gate/up weights read as row slices of the
    fused matrices, and residual dropout (``resid_dropout``, in training; Philox, never a stored
    mask: 16 bytes of RNG state per call).

    ``policy`` as for LlamaLayer, with its byte formulas per token (element size s, h hidden, I
    intermediate, Hq / Hkv heads of dim D; :meth:`saved_bytes_per_token`; plus 16 bytes per call
    for each dropout in use):

    - ``"speed"``: ``s(2h + 2 Hq D + 2 Hkv D + 2I) + 4 Hq + 8``;
    - ``"balanced"`` (default): ``s(2h + 2 Hq D + 2 Hkv D) + 4 Hq + 8``;
    - ``"memory"``: ``s(2h + Hq D) + 4 Hq + 8``.

    Args:
        hidden, intermediate, num_heads, num_kv_heads, head_dim: sizes.
        eps: RMSNorm epsilon (Phi-3: 1e-5). rope_theta: default 10000.
        sliding_window: keys within the last ``sliding_window`` positions (every layer), or None.
        attention_dropout, resid_dropout: probabilities, in training. activation: "silu" (Phi-3).
        policy, backend: as for LlamaLayer.
    """

    def __init__(self, hidden, intermediate, num_heads, num_kv_heads=None, head_dim=None, *, eps=1e-5,
                 rope_theta=10000.0, sliding_window=None, attention_dropout=0.0, resid_dropout=0.0, activation="silu",
                 policy="balanced", backend=None, device=None, dtype=None):
        super().__init__()
        checks.check_choice(policy, "policy", LAYER_POLICIES)
        checks.check_probability(resid_dropout, "resid_dropout")
        window = None if sliding_window is None else (int(sliding_window) - 1, None)
        self.self_attn = FusedQKVAttention(hidden, num_heads, num_kv_heads, head_dim, rope_theta=rope_theta,
                                           dropout=attention_dropout, window=window, backend=backend, device=device,
                                           dtype=dtype)
        self.mlp = FusedGateUpMLP(hidden, intermediate, activation=activation, backend=backend, device=device,
                                  dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype, backend=backend)
        self.post_attention_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype, backend=backend)
        self.resid_dropout = float(resid_dropout)
        self.policy, self.backend = policy, backend

    @classmethod
    def from_module(cls, stock, *, policy="balanced", backend=None):
        """A Phi3Layer sharing every parameter (no copy) of a Hugging Face ``Phi3DecoderLayer``;
        sizes, eps, rope, dropouts and sliding window from its config. Partial rotary embedding
        (``partial_rotary_factor`` below 1) raises ValueError: remat's rope rotates whole heads."""
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(stock, name):
                raise TypeError(f"from_module expects a decoder layer with {name}, got {type(stock).__name__}")
        attn, mlp = stock.self_attn, stock.mlp
        for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            adapters.projection_features(getattr(owner, name, None), name, owner)
        config = attn.config
        rope = getattr(config, "rope_parameters", None) or {}
        partial = float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0:
            raise ValueError(f"partial rotary embedding (partial_rotary_factor={partial}) rotates only the first "
                             f"{partial:g} of each head's features, in pairs (i, i + r/2); remat's rope kernels rotate "
                             "whole heads (pairs (i, i + D/2)), so this layer stays Hugging Face's")
        num_heads = config.num_attention_heads
        num_kv_heads = config.num_key_value_heads or num_heads
        head_dim = attn.head_dim
        if attn.qkv_proj.out_features != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv_proj has {attn.qkv_proj.out_features} rows, expected (Hq + 2 Hkv) D = "
                             f"{(num_heads + 2 * num_kv_heads) * head_dim}")
        if mlp.gate_up_proj.out_features != 2 * mlp.down_proj.in_features:
            raise ValueError("gate_up_proj must have twice down_proj's input features (gate rows, then up rows)")
        rope_type = rope_type_of(config)
        module = cls._empty(policy, backend)
        module.self_attn = FusedQKVAttention(attn.qkv_proj.in_features, num_heads, num_kv_heads, head_dim,
                                             rope_theta=rope.get("rope_theta", 10000.0),
                                             dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
                                             window=sliding_window_of(attn, config), backend=backend, device="meta")
        module.self_attn.qkv_proj, module.self_attn.o_proj = attn.qkv_proj, attn.o_proj
        module.self_attn.rope_type = rope_type
        module.self_attn.scale = getattr(attn, "scaling", None)
        activation = activation_of(mlp.activation_fn) if hasattr(mlp, "activation_fn") else "silu"
        module.mlp = FusedGateUpMLP(mlp.gate_up_proj.in_features, mlp.down_proj.in_features, activation=activation,
                                    backend=backend, device="meta")
        module.mlp.gate_up_proj, module.mlp.down_proj = mlp.gate_up_proj, mlp.down_proj
        module.input_layernorm = RMSNorm.from_module(stock.input_layernorm, backend=backend)
        module.post_attention_layernorm = RMSNorm.from_module(stock.post_attention_layernorm, backend=backend)
        module.resid_dropout = float(getattr(config, "resid_pdrop", 0.0) or 0.0)
        module.train(stock.training)
        return module

    def saved_bytes_per_token(self, element_size):
        """Bytes this layer keeps for backward per token under its policy (the formulas above),
        for activations of ``element_size`` bytes; without the per-call extras (16 bytes of RNG
        state per dropout, the rope tables)."""
        attn = self.self_attn
        hidden = attn.qkv_proj.in_features
        q_width, kv_width = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        stats = 4 * attn.num_heads + 8  # fp32 lse per query head, two fp32 rstd
        memory = element_size * (2 * hidden + q_width) + stats
        balanced = memory + element_size * (q_width + 2 * kv_width)
        speed = balanced + 2 * element_size * self.mlp.intermediate
        return {"memory": memory, "balanced": balanced, "speed": speed}[self.policy]

    def attention_output(self, x, position_ids, position_embeddings, layout=None):
        attn, norm = self.self_attn, self.input_layernorm
        rope = attn.rope_for(x.shape[1], x.device, position_ids, position_embeddings)
        qkv = adapters.read_projection(attn.qkv_proj)
        if not adapters.fusable_split(qkv):
            return adapters.checkpointed(lambda t: _unfused_attention(norm, attn, t, rope, layout), x)
        weights, biases = attn.qkv_weights(x)
        q_width, kv_width = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        lora = adapters.split_adapters(qkv.adapters, (q_width, kv_width, kv_width))
        return functional.norm_attention(
            x, checks.vector_like(norm.weight, x), *weights, b_q=biases[0], b_k=biases[1], b_v=biases[2],
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, norm="rms", eps=norm.eps_for(x), causal=True,
            scale=attn.scale, rope=rope, window=attn.window, dropout_p=attn.dropout if attn.training else 0.0,
            keep_qkv=self.keeps_qkv, lora=lora, backend=attn.backend, **varlen_arguments(layout),
            **self.attention_tile_arguments(layout, True, attn.window, attn.dropout if attn.training else 0.0))

    def out_proj(self, o):
        return adapters.linear_projection(adapters.read_projection(self.self_attn.o_proj), o, self.backend)

    def mlp_block(self, h):
        mlp, norm = self.mlp, self.post_attention_layernorm
        gate_up, down = adapters.read_projection(mlp.gate_up_proj), adapters.read_projection(mlp.down_proj)
        if not adapters.fusable_split(gate_up) or down.generic:
            return adapters.checkpointed(lambda t: _unfused_mlp(norm, mlp, t), h)
        w_gate, w_up, b_gate, b_up = mlp.gate_up_weights(h)
        lora = adapters.split_adapters(gate_up.adapters, (mlp.intermediate, mlp.intermediate))
        if lora is not None or down.adapters:
            lora = (*(lora or ((), ())), down.adapters)
        return functional.norm_mlp(
            h, checks.vector_like(norm.weight, h), w_gate, w_up, checks.cast_like(down.weight, h), norm="rms",
            eps=norm.eps_for(h), activation=mlp.activation, b_gate=b_gate, b_up=b_up,
            b_down=checks.cast_like(down.bias, h), recompute=self.mlp_recompute, lora=lora, backend=self.backend,
            tile_tokens=self.tile_tokens)


def _unfused_attention(norm, attn, x, rope, layout):
    """The attention sub-block through the modules' own forwards (a qkv_proj with LoRA or another
    linear module; the generic path of remat.nn.adapters, run under checkpoint)."""
    batch, n, _ = x.shape
    q_width, kv_width = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q, k, v = attn.qkv_proj(norm(x)).split((q_width, kv_width, kv_width), dim=-1)
    q = q.reshape(batch, n, attn.num_heads, attn.head_dim)
    k, v = (t.reshape(batch, n, attn.num_kv_heads, attn.head_dim) for t in (k, v))
    return adapters.attend(q, k, v, layout, causal=True, scale=attn.scale, rope=rope,
                           dropout_p=attn.dropout if attn.training else 0.0, window=attn.window, backend=attn.backend)


def _unfused_mlp(norm, mlp, h):
    """The MLP sub-block through the modules' own forwards (the generic path)."""
    gate, up = mlp.gate_up_proj(norm(h)).chunk(2, dim=-1)
    return mlp.down_proj(adapters.ACTIVATION_FUNCTIONS[mlp.activation](gate) * up)


class HFPhi3Layer(Phi3Layer):
    """remat.nn.Phi3Layer in a Hugging Face model: the same forward, which takes a
    ``Phi3DecoderLayer``'s arguments (the 2-D padding mask a patched model builds, packed-row
    offsets) and, with a KV cache, runs the replaced stock layer (see PreNormDecoderLayer.forward)."""


FAMILY = Family(
    name="phi3",
    layer_classes=("Phi3DecoderLayer",),
    causal_lms=("Phi3ForCausalLM",),
    build_layer=HFPhi3Layer.from_module,
    parts=(Part("norm", ("Phi3RMSNorm",), _rms_norm, accepts=is_hf_rms_norm),),
    whole_only=("Phi3Attention", "Phi3MLP"),
    whole_only_reason=("Phi-3's attention and MLP (fused qkv_proj / gate_up_proj) are replaced only as part of a "
                       "whole decoder layer: pass all of modules=('norm', 'mlp', 'attention')"),
)
