"""The Qwen3 family: Hugging Face ``Qwen3DecoderLayer`` as :class:`Qwen3Layer`, a Llama layer whose
attention normalizes each head of q and k (RMSNorm over the head dim, weights ``q_norm`` /
``k_norm`` ``[D]``) after the projections and before rope. The per-head norms run inside the fused
attention sub-block (remat.norm_attention with ``qk_norm="rms"``) and are recomputed in backward
with the projections' outputs, never saved. The attention module with those per-head norms
(remat.nn.attention.QKNormAttention) is shared with Gemma 3.
"""

from remat import checks
from remat.hf import is_hf_rms_norm
from remat.models.llama import LlamaLayer, _rms_norm
from remat.models.registry import Family, Part
from remat.nn.attention import QKNormAttention, attention_from_hf
from remat.nn.mlp import SwiGLUMLP
from remat.nn.norm import RMSNorm


class Qwen3Layer(LlamaLayer):
    """A Qwen3 decoder layer built from remat's fused blocks, with Hugging Face's
    ``Qwen3DecoderLayer`` parameter names: ``input_layernorm``, ``self_attn`` (q/k/v/o_proj,
    ``q_norm``, ``k_norm``), ``post_attention_layernorm``, ``mlp`` (gate/up/down_proj).

    ``x -> h = x + o_proj(attention(rope(qn(q)), rope(kn(k)), v)) -> h + mlp(rmsnorm(h))`` with
    ``q, k, v`` the projections of ``rmsnorm(x)`` and ``qn``, ``kn`` RMSNorms of each head over its
    D features (weights ``[D]``). Everything else is :class:`remat.nn.LlamaLayer`'s.

    Bytes kept per token: LlamaLayer's formulas, unchanged (element size s, h hidden, I
    intermediate, Hq / Hkv heads of dim D; :meth:`saved_bytes_per_token`):

    - ``"speed"``: ``s(2h + 2 Hq D + 2 Hkv D + 2I) + 4 Hq + 8``;
    - ``"balanced"`` (default): ``s(2h + 2 Hq D + 2 Hkv D) + 4 Hq + 8``;
    - ``"memory"``: ``s(2h + Hq D) + 4 Hq + 8``.

    The q and k kept under "speed" and "balanced" are the projections before the per-head norms;
    the normalized heads and their statistics are recomputed from them in backward (the same norm
    kernel, so bitwise the forward's values), costing no bytes.

    Args: as LlamaLayer (rope_theta default 1e6, Qwen3's), plus qk_eps: the per-head norms'
    epsilon (default: eps).
    """

    def __init__(self, hidden, intermediate, num_heads, num_kv_heads=None, head_dim=None, *, eps=1e-6,
                 rope_theta=1e6, qk_eps=None, attention_bias=False, sliding_window=None, attention_dropout=0.0,
                 policy="balanced", backend=None, device=None, dtype=None):
        super().__init__(hidden, intermediate, num_heads, num_kv_heads, head_dim, eps=eps, rope_theta=rope_theta,
                         attention_bias=attention_bias, sliding_window=sliding_window,
                         attention_dropout=attention_dropout, policy=policy, backend=backend, device=device,
                         dtype=dtype)
        window = None if sliding_window is None else (int(sliding_window) - 1, None)
        self.self_attn = QKNormAttention(hidden, num_heads, num_kv_heads, head_dim, bias=attention_bias, o_bias=False,
                                         rope_theta=rope_theta, dropout=attention_dropout, causal=True, window=window,
                                         qk_norm="rms", qk_eps=eps if qk_eps is None else qk_eps, backend=backend,
                                         device=device, dtype=dtype)

    @classmethod
    def from_module(cls, stock, *, policy="balanced", backend=None):
        """A Qwen3Layer sharing every parameter (no copy) of a Hugging Face ``Qwen3DecoderLayer``;
        sizes, epsilons, rope, dropout and this layer's sliding window from its config."""
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(stock, name):
                raise TypeError(f"from_module expects a decoder layer with {name}, got {type(stock).__name__}")
        module = cls._empty(policy, backend)
        module.self_attn = attention_from_hf(stock.self_attn, qk_norm="rms", backend=backend)
        module.mlp = SwiGLUMLP.from_module(stock.mlp, backend=backend)
        module.input_layernorm = RMSNorm.from_module(stock.input_layernorm, backend=backend)
        module.post_attention_layernorm = RMSNorm.from_module(stock.post_attention_layernorm, backend=backend)
        module.train(stock.training)
        return module

    def extra_attention_arguments(self, x):
        """The per-head q/k norms, fused into the attention sub-block (recomputed in backward)."""
        attn = self.self_attn
        return dict(qk_norm=attn.qk_norm, q_norm_weight=checks.vector_like(attn.q_norm.weight, x),
                    k_norm_weight=checks.vector_like(attn.k_norm.weight, x), qk_eps=attn.qk_eps_for(x))


class HFQwen3Layer(Qwen3Layer):
    """remat.nn.Qwen3Layer in a Hugging Face model: the same forward, which takes a
    ``Qwen3DecoderLayer``'s arguments (the 2-D padding mask a patched model builds, packed-row
    offsets) and, with a KV cache, runs the replaced stock layer (see PreNormDecoderLayer.forward)."""


FAMILY = Family(
    name="qwen3",
    layer_classes=("Qwen3DecoderLayer",),
    causal_lms=("Qwen3ForCausalLM",),
    build_layer=HFQwen3Layer.from_module,
    parts=(
        Part("mlp", ("Qwen3MLP",), SwiGLUMLP.from_module),
        Part("norm", ("Qwen3RMSNorm",), _rms_norm, accepts=is_hf_rms_norm),
    ),
    whole_only=("Qwen3Attention",),
    whole_only_reason=("Qwen3's attention (per-head q/k norms fused into the attention sub-block) is replaced only "
                       "as part of a whole decoder layer: pass all of modules=('norm', 'mlp', 'attention')"),
)
