"""The Qwen3 family: Hugging Face ``Qwen3DecoderLayer`` as :class:`Qwen3Layer`, a Llama layer whose
attention normalizes each head of q and k (RMSNorm over the head dim, weights ``q_norm`` /
``k_norm`` ``[D]``) after the projections and before rope. The per-head norms run inside the fused
attention sub-block (remat.norm_attention with ``qk_norm="rms"``) and are recomputed in backward
with the projections' outputs, never saved.

Also here: :class:`QKNormAttention`, the attention module with those per-head norms (Qwen3's, and
Gemma 3's with ``(1 + w)`` weights), and :func:`attention_from_hf`, which builds it from a Hugging
Face attention module, sharing its parameters.
"""

from torch import nn

from remat import checks, functional
from remat.models.hf import is_hf_rms_norm, rope_type_of, sliding_window_of
from remat.models.llama import LlamaLayer, _rms_norm
from remat.models.registry import Family, Part
from remat.nn import adapters
from remat.nn.attention import Attention
from remat.nn.mlp import SwiGLUMLP
from remat.nn.norm import RMSNorm


class QKNormAttention(Attention):
    """remat.nn.Attention with per-head norms of q and k (``q_norm``, ``k_norm``: modules with a
    ``[D]`` weight) after the projections and before rope, as Qwen3 (``qk_norm="rms"``, RMSNorm)
    and Gemma 3 (``qk_norm="gemma"``, RMSNorm with weight ``1 + w``) compute them.

    ``forward`` runs the norms as separate modules and then remat.attention (a standalone
    attention); inside a decoder layer the norms are fused into the attention sub-block
    (remat.norm_attention), which is where they are never saved. Other arguments as for Attention.
    """

    def __init__(self, *args, qk_norm="rms", qk_eps=1e-6, **kwargs):
        super().__init__(*args, **kwargs)
        checks.check_choice(qk_norm, "qk_norm", ("rms", "gemma"))
        self.qk_norm = qk_norm
        dtype, device = self.q_proj.weight.dtype, self.q_proj.weight.device
        norm_class = RMSNorm if qk_norm == "rms" else _gemma_norm_class()
        self.q_norm = norm_class(self.head_dim, qk_eps, device=device, dtype=dtype, backend=self.backend)
        self.k_norm = norm_class(self.head_dim, qk_eps, device=device, dtype=dtype, backend=self.backend)

    def qk_eps_for(self, x):
        """The per-head norms' epsilon (q_norm's and k_norm's are one: from_module checks)."""
        return self.q_norm.eps_for(x)

    def forward(self, x, position_ids=None, position_embeddings=None):
        checks.check_hidden_states(x)
        batch, n, _ = x.shape
        q, k, v = (adapters.linear_projection(adapters.read_projection(p), x, self.backend)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q = self.q_norm(q.view(batch, n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(batch, n, self.num_kv_heads, self.head_dim))
        rope = self.rope_for(n, x.device, position_ids, position_embeddings)
        o = functional.attention(
            q, k, v.view(batch, n, self.num_kv_heads, self.head_dim), causal=self.causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0, rope=rope, window=self.window, softcap=self.softcap,
            backend=self.backend)
        o = o.reshape(batch, n, self.num_heads * self.head_dim)
        return adapters.linear_projection(adapters.read_projection(self.o_proj), o, self.backend)


def _gemma_norm_class():
    from remat.models.gemma import GemmaRMSNorm  # gemma.py builds on this module

    return GemmaRMSNorm


def attention_from_hf(stock, *, qk_norm=None, rope_theta=None, rope_type=None, softcap=None, backend=None):
    """A remat attention module sharing the projections (and q/k norms) of a Hugging Face attention
    module with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (nn.Linear, PEFT LoRA layers or other
    linear modules: see remat.nn.adapters) and a ``config``:
    :class:`QKNormAttention` with ``qk_norm`` ("rms" or "gemma"; the module's ``q_norm`` and
    ``k_norm`` then share their weights), else remat.nn.Attention. Heads, head dim, the scale
    (``stock.scaling``), dropout, causality and the sliding window of this layer (from
    ``config.layer_types``) are read from the module; rope_theta / rope_type default to the
    config's (``rope_parameters``)."""
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        adapters.projection_features(getattr(stock, name, None), name, stock)
    config = getattr(stock, "config", None)
    if config is None:
        raise TypeError(f"expected a Hugging Face attention module with a config, got {type(stock).__name__}")
    if not getattr(stock, "is_causal", True):
        raise ValueError(f"{type(stock).__name__} is bidirectional (use_bidirectional_attention); remat's decoder "
                         "layers do causal attention")
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(stock, "head_dim", None) or stock.q_proj.out_features // num_heads
    if rope_type is None:
        rope_type = rope_type_of(config)
    if rope_theta is None and rope_type == "default":
        rope_theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
            "rope_theta")
    kwargs = dict(rope_theta=rope_theta, dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0), causal=True,
                  window=sliding_window_of(stock, config), softcap=softcap, scale=getattr(stock, "scaling", None),
                  backend=backend, device="meta")
    sizes = (stock.q_proj.in_features, num_heads, num_kv_heads, head_dim)
    if qk_norm is None:
        module = Attention(*sizes, **kwargs)
    else:
        module = QKNormAttention(*sizes, qk_norm=qk_norm, **kwargs)
        module.q_norm, module.k_norm = _qk_norm_modules(stock, qk_norm, head_dim, backend)
    module.q_proj, module.k_proj, module.v_proj, module.o_proj = stock.q_proj, stock.k_proj, stock.v_proj, stock.o_proj
    module.rope_type = rope_type
    module.train(stock.training)
    return module


def _qk_norm_modules(stock, qk_norm, head_dim, backend):
    """remat norm modules sharing the weights of ``stock.q_norm`` and ``stock.k_norm``."""
    norms = []
    for name in ("q_norm", "k_norm"):
        norm = getattr(stock, name, None)
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, nn.Parameter) or tuple(weight.shape) != (head_dim,):
            raise TypeError(f"{type(stock).__name__}.{name} must be a norm with a [{head_dim}] weight")
        if qk_norm == "rms":
            if not is_hf_rms_norm(norm):
                raise TypeError(f"{type(stock).__name__}.{name} is not a Hugging Face RMSNorm")
            norms.append(RMSNorm.from_module(norm, backend=backend))
        else:
            norms.append(_gemma_norm_class().from_module(norm, backend=backend))
    if norms[0].eps != norms[1].eps:
        raise ValueError(f"q_norm and k_norm have different epsilons ({norms[0].eps}, {norms[1].eps}); remat's fused "
                         "attention takes one")
    return norms


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
