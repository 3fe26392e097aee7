"""The Llama family: Hugging Face Llama, Mistral and Qwen2 decoder layers (they differ only in
configuration: Qwen2's q/k/v biases, Mistral's sliding window) as :class:`LlamaLayer`, and their
attention, MLP and RMSNorm modules one by one.

Only these classes are taken: look-alikes whose computation differs (Qwen3's q/k norms, Cohere's
mean-centred norm, non-causal vision attention) are other families.
"""

from torch import nn

from remat import checks, functional
from remat.models.hf import is_hf_rms_norm, refuse_kv_cache
from remat.models.registry import Family, Part
from remat.nn.attention import Attention
from remat.nn.layers import LAYER_POLICIES, PreNormDecoderLayer
from remat.nn.mlp import SwiGLUMLP
from remat.nn.norm import RMSNorm

_PREFIXES = ("Llama", "Mistral", "Qwen2")


class LlamaLayer(PreNormDecoderLayer):
    """A Llama decoder layer (also Mistral and Qwen2) built from remat's fused blocks, with Hugging
    Face's ``LlamaDecoderLayer`` parameter names: ``input_layernorm``, ``self_attn`` (q/k/v/o_proj),
    ``post_attention_layernorm``, ``mlp`` (gate/up/down_proj).

    ``x -> h = x + o_proj(attention(rmsnorm(x))) -> h + mlp(rmsnorm(h))``, with rope and causal
    GQA attention. ``policy`` chooses what the layer keeps for backward; per token, with element
    size s, h hidden, I intermediate, Hq / Hkv heads of dim D (:meth:`saved_bytes_per_token`; 16
    more bytes per call with attention dropout, plus the rope tables the caller passes):

    - ``"speed"``: no matmul is recomputed. Keeps x, q, k, v, o, the second residual h, gate and
      up, and fp32 statistics: ``s(2h + 2 Hq D + 2 Hkv D + 2I) + 4 Hq + 8`` bytes.
    - ``"balanced"`` (default): the MLP keeps only its input h (its gate/up GEMMs are recomputed):
      ``s(2h + 2 Hq D + 2 Hkv D) + 4 Hq + 8``.
    - ``"memory"``: the q/k/v projections are recomputed from x too: ``s(2h + Hq D) + 4 Hq + 8``
      (x, o, h, lse and two fp32 rstd).

    In bf16 with Hq D = h these are ``2(4h + 2 Hkv D + 2I)``, ``2(4h + 2 Hkv D)`` and ``2(3h)``,
    plus ``4 Hq + 8``. Norms, rope, the attention probabilities and the MLP activation are always
    recomputed.

    Args:
        hidden, intermediate, num_heads, num_kv_heads, head_dim: sizes (num_kv_heads default
            num_heads; head_dim default hidden // num_heads).
        eps: RMSNorm epsilon (default 1e-6). rope_theta: default 10000.
        attention_bias: q/k/v biases (Qwen2: True); mlp_bias: MLP biases.
        sliding_window: Mistral's window (keys within the last ``sliding_window`` positions), or None.
        attention_dropout: dropout on the attention probabilities in training (Philox; recomputed,
            never stored).
        policy, backend: as above; backend as for remat.attention.

    ``forward(hidden_states, attention_mask=None, position_ids=None, position_embeddings=None)``:
    ``hidden_states`` [B, N, hidden]. ``attention_mask`` must be None (causal attention; remat.patch
    checks a Hugging Face model's padding mask, see there). ``position_embeddings``
    (cos, sin) from a Hugging Face rotary module override the built-in rope tables.
    """

    def __init__(self, hidden, intermediate, num_heads, num_kv_heads=None, head_dim=None, *, eps=1e-6,
                 rope_theta=10000.0, attention_bias=False, mlp_bias=False, sliding_window=None,
                 attention_dropout=0.0, policy="balanced", backend=None, device=None, dtype=None):
        super().__init__()
        checks.check_choice(policy, "policy", LAYER_POLICIES)
        window = None if sliding_window is None else (int(sliding_window) - 1, None)
        self.self_attn = Attention(hidden, num_heads, num_kv_heads, head_dim, bias=attention_bias, o_bias=False,
                                   rope_theta=rope_theta, dropout=attention_dropout, causal=True, window=window,
                                   backend=backend, device=device, dtype=dtype)
        self.mlp = SwiGLUMLP(hidden, intermediate, bias=mlp_bias, backend=backend, device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype, backend=backend)
        self.post_attention_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype, backend=backend)
        self.policy, self.backend = policy, backend

    @classmethod
    def from_module(cls, stock, *, policy="balanced", backend=None):
        """A LlamaLayer sharing every parameter (no copy) of a Hugging Face Llama, Mistral or
        Qwen2 decoder layer (``self_attn``, ``mlp``, ``input_layernorm``,
        ``post_attention_layernorm``); sizes, eps, rope theta, dropout and window from its config."""
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(stock, name):
                raise TypeError(f"from_module expects a decoder layer with {name}, got {type(stock).__name__}")
        module = cls._empty(policy, backend)
        module.self_attn = Attention.from_module(stock.self_attn, backend=backend)
        module.mlp = SwiGLUMLP.from_module(stock.mlp, backend=backend)
        module.input_layernorm = RMSNorm.from_module(stock.input_layernorm, backend=backend)
        module.post_attention_layernorm = RMSNorm.from_module(stock.post_attention_layernorm, backend=backend)
        module.train(stock.training)
        return module

    def saved_bytes_per_token(self, element_size):
        """Bytes this layer keeps for backward per token under its policy (the formulas above),
        for activations of ``element_size`` bytes; without the per-call extras (16 bytes of RNG
        state with attention dropout, the rope tables)."""
        attn = self.self_attn
        hidden = attn.q_proj.in_features
        q_width, kv_width = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        stats = 4 * attn.num_heads + 8  # fp32 lse per query head, two fp32 rstd
        memory = element_size * (2 * hidden + q_width) + stats
        balanced = memory + element_size * (q_width + 2 * kv_width)
        speed = balanced + 2 * element_size * self.mlp.gate_proj.out_features
        return {"memory": memory, "balanced": balanced, "speed": speed}[self.policy]

    def attention_output(self, x, position_ids, position_embeddings):
        attn, norm = self.self_attn, self.input_layernorm
        rope = attn.rope_for(x.shape[1], x.device, position_ids, position_embeddings)
        projections = [getattr(attn, f"{p}_proj") for p in "qkv"]
        weights = [checks.cast_like(p.weight, x) for p in projections]
        biases = [checks.cast_like(p.bias, x) for p in projections]
        return functional.norm_attention(
            x, checks.vector_like(norm.weight, x), *weights, b_q=biases[0], b_k=biases[1], b_v=biases[2],
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, norm="rms", eps=norm.eps_for(x),
            causal=attn.causal, scale=attn.scale, rope=rope, window=attn.window, softcap=attn.softcap,
            dropout_p=attn.dropout if attn.training else 0.0, keep_qkv=self.keeps_qkv, backend=attn.backend,
            **self.extra_attention_arguments(x))

    def extra_attention_arguments(self, x):
        """Further keyword arguments of functional.norm_attention for input x (none here; Qwen3 adds
        its per-head q/k norms)."""
        return {}

    def out_proj(self, o):
        o_proj = self.self_attn.o_proj
        return nn.functional.linear(o, checks.cast_like(o_proj.weight, o), checks.cast_like(o_proj.bias, o))

    def mlp_block(self, h):
        mlp, norm = self.mlp, self.post_attention_layernorm
        return functional.norm_mlp(
            h, checks.vector_like(norm.weight, h), checks.cast_like(mlp.gate_proj.weight, h),
            checks.cast_like(mlp.up_proj.weight, h), checks.cast_like(mlp.down_proj.weight, h), norm="rms",
            eps=norm.eps_for(h), activation=mlp.activation, b_gate=checks.cast_like(mlp.gate_proj.bias, h),
            b_up=checks.cast_like(mlp.up_proj.bias, h), b_down=checks.cast_like(mlp.down_proj.bias, h),
            recompute=self.mlp_recompute, backend=self.backend)


class HFLlamaLayer(LlamaLayer):
    """remat.nn.LlamaLayer taking a Hugging Face decoder layer's arguments; the 4-D mask the model
    builds is not read (remat.patch has checked the model's 2-D mask)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        refuse_kv_cache(kwargs)
        return super().forward(hidden_states, position_ids=position_ids, position_embeddings=position_embeddings)


class HFAttention(Attention):
    """remat.nn.Attention with Hugging Face's attention calling convention:
    ``forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs) ->
    (output, None)``. The mask is checked at the model (see remat.patch)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        refuse_kv_cache(kwargs)
        return super().forward(hidden_states, position_embeddings=position_embeddings), None


def _rms_norm(stock, *, backend):
    if not is_hf_rms_norm(stock):
        raise TypeError(f"{type(stock).__name__} is not a Hugging Face RMSNorm (a 1-D weight and variance_epsilon)")
    return RMSNorm.from_module(stock, backend=backend)


FAMILY = Family(
    name="llama",
    layer_classes=tuple(f"{prefix}DecoderLayer" for prefix in _PREFIXES),
    causal_lms=tuple(f"{prefix}ForCausalLM" for prefix in _PREFIXES),
    build_layer=HFLlamaLayer.from_module,
    parts=(
        Part("attention", tuple(f"{prefix}Attention" for prefix in _PREFIXES), HFAttention.from_module),
        Part("mlp", tuple(f"{prefix}MLP" for prefix in _PREFIXES), SwiGLUMLP.from_module),
        Part("norm", tuple(f"{prefix}RMSNorm" for prefix in _PREFIXES), _rms_norm, accepts=is_hf_rms_norm),
    ),
)
