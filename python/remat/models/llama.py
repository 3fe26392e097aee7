"""The Llama family: Hugging Face Llama, Mistral and Qwen2 decoder layers (they differ only in
configuration: Qwen2's q/k/v biases, Mistral's sliding window) as :class:`LlamaLayer`, and their
attention, MLP and RMSNorm modules one by one.

Only these classes are taken: look-alikes whose computation differs (Qwen3's q/k norms, Cohere's
mean-centred norm, non-causal vision attention) are other families.
"""

from remat import checks, functional
from remat.hf import given_cache, is_hf_rms_norm, refuse_static_cache, run_stock_layer
from remat.models.registry import Family, Part
from remat.nn import adapters
from remat.nn.attention import Attention
from remat.nn.layers import LAYER_POLICIES, PreNormDecoderLayer
from remat.nn.mlp import SwiGLUMLP
from remat.nn.norm import RMSNorm
from remat.sequences import OFFSET_ARGUMENTS, pack_sequences, sequence_layout, unpack_sequences, varlen_arguments

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

    Adapters: the projections are read at every forward (remat.nn.adapters), so PEFT LoRA works
    whether ``get_peft_model`` runs before or after remat.patch. LoRA branches
    ``scaling * B(A(dropout(x)))`` join their projections inside the fused sub-blocks (o_proj's in
    remat.lora_linear) and follow the policy: q/k/v and gate/up with their branches are kept or
    recomputed as above; the rank-r intermediates and the dropout masks are never kept (the masks
    are Philox streams, 16 bytes per adapter per call: :meth:`saved_bytes_per_call`), so the
    formulas above hold unchanged. Frozen base weights get no weight-gradient GEMM. A projection
    of another linear type (an nn.Linear subclass with its own forward, a quantized linear, DoRA)
    makes its sub-block run through the modules' own forwards under torch.utils.checkpoint: it
    keeps only the sub-block's input and re-runs it in backward, whatever the policy.

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
    ``hidden_states`` [B, N, hidden]. ``attention_mask``: None or a 2-D [B, N] padding mask (pads
    anywhere); restarting ``position_ids`` or ``cu_seq_lens_q/k`` split packed rows into
    documents (see PreNormDecoderLayer.forward). ``position_embeddings`` (cos, sin) from a Hugging
    Face rotary module override the built-in rope tables.
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

    def saved_bytes_per_call(self):
        """The per-call extras of one training forward, now: 16 bytes of Philox state with attention
        dropout and per active LoRA adapter with dropout (remat.nn.adapters); the rope tables not
        included."""
        attention_dropout = 16 if self.training and self.self_attn.dropout > 0 else 0
        projections = [getattr(self.self_attn, f"{p}_proj") for p in "qkvo"]
        projections += [getattr(self.mlp, f"{p}_proj") for p in ("gate", "up", "down")]
        return attention_dropout + adapters.lora_bytes_per_call(projections)

    def attention_output(self, x, position_ids, position_embeddings, layout=None, out_projection=None):
        attn, norm = self.self_attn, self.input_layernorm
        rope = attn.rope_for(x.shape[1], x.device, position_ids, position_embeddings)
        projections = [adapters.read_projection(getattr(attn, f"{p}_proj")) for p in "qkv"]
        if any(p.generic for p in projections):
            qk_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
            o = adapters.checkpointed(lambda t: adapters.unfused_attention(norm, attn, t, rope, qk_norms, layout), x)
            # Unfused here, so the projection a fused call would have made runs after it.
            return o if out_projection is None else self.out_proj(o.reshape(*o.shape[:2], -1))
        fused = {}
        if out_projection is not None:  # o_proj fused (fused_out_projection): its weights and adapters
            projections.append(out_projection)
            fused = {"w_o": checks.cast_like(out_projection.weight, x), "b_o": checks.cast_like(out_projection.bias, x)}
        weights, biases = adapters.weights_like(projections[:3], x)
        return functional.norm_attention(
            x, checks.vector_like(norm.weight, x), *weights, b_q=biases[0], b_k=biases[1], b_v=biases[2],
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, norm="rms", eps=norm.eps_for(x),
            causal=attn.causal, scale=attn.scale, rope=rope, window=attn.window, softcap=attn.softcap,
            dropout_p=attn.dropout if attn.training else 0.0, keep_qkv=self.keeps_qkv,
            lora=adapters.lora_argument(projections), backend=attn.backend, **self.extra_attention_arguments(x),
            **varlen_arguments(layout), **fused,
            **self.attention_tile_arguments(layout, attn.causal, attn.window, attn.dropout if attn.training else 0.0))

    def fused_out_projection(self, layout):
        """o_proj, fused into the attention sub-block's call under sequence parallelism with policy
        "memory" (the gradient of o is then made one head chunk at a time, never whole: see
        functional.norm_attention's ``w_o``) when o_proj is a plain or PEFT LoRA linear layer and
        this family's out_proj is o_proj alone; None otherwise."""
        if (layout is None or layout.sequence_parallel is None or self.keeps_qkv
                or type(self).out_proj is not LlamaLayer.out_proj):
            return None
        projection = adapters.read_projection(self.self_attn.o_proj)
        return None if projection.generic else projection

    def extra_attention_arguments(self, x):
        """Further keyword arguments of functional.norm_attention for input x (none here; Qwen3 adds
        its per-head q/k norms)."""
        return {}

    def out_proj(self, o):
        return adapters.linear_projection(adapters.read_projection(self.self_attn.o_proj), o, self.backend)

    def mlp_block(self, h):
        mlp, norm = self.mlp, self.post_attention_layernorm
        projections = [adapters.read_projection(getattr(mlp, f"{p}_proj")) for p in ("gate", "up", "down")]
        if any(p.generic for p in projections):
            return adapters.checkpointed(lambda t: adapters.unfused_gated_mlp(norm, mlp, t), h)
        (w_gate, w_up, w_down), (b_gate, b_up, b_down) = adapters.weights_like(projections, h)
        return functional.norm_mlp(
            h, checks.vector_like(norm.weight, h), w_gate, w_up, w_down, norm="rms", eps=norm.eps_for(h),
            activation=mlp.activation, b_gate=b_gate, b_up=b_up, b_down=b_down, recompute=self.mlp_recompute,
            lora=adapters.lora_argument(projections), backend=self.backend, tile_tokens=self.tile_tokens)


class HFLlamaLayer(LlamaLayer):
    """remat.nn.LlamaLayer in a Hugging Face model: the same forward, which takes the decoder layer's
    arguments (the 2-D padding mask a patched model builds, position embeddings, packed-row
    offsets) and, with a KV cache, runs the replaced stock layer (see PreNormDecoderLayer.forward)."""


class HFAttention(Attention):
    """remat.nn.Attention with Hugging Face's attention calling convention:
    ``forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs) ->
    (output, None)``. ``attention_mask``: None or the 2-D padding mask a patched model builds
    (rows' real tokens then run packed, as do rows whose ``position_ids`` restart, or Hugging
    Face's ``cu_seq_lens_q/k``; a pad's attention output is 0, as in
    remat.nn.PreNormDecoderLayer). With a KV cache (``cache``) the replaced
    stock attention runs instead, attending through remat's attention (generation)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        cache = given_cache(kwargs)
        if cache is not None:
            refuse_static_cache(cache)
            return run_stock_layer(self, hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, **kwargs)
        position_ids = kwargs.get("position_ids")
        batch, n = hidden_states.shape[:2]
        layout = sequence_layout(batch, n, attention_mask, position_ids, **{k: kwargs.get(k) for k in OFFSET_ARGUMENTS})
        if layout is None or layout.cu_seqlens is None:
            return super().forward(hidden_states, position_ids, position_embeddings, layout), None
        x, position_ids, position_embeddings = pack_sequences(hidden_states, position_ids, position_embeddings, layout)
        return unpack_sequences(super().forward(x, position_ids, position_embeddings, layout), layout, batch, n), None


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
