"""The Qwen3-MoE family: Hugging Face ``Qwen3MoeDecoderLayer`` as :class:`Qwen3MoeLayer`, Qwen3's
attention sub-block (per-head q/k RMSNorms fused into it, remat.models.qwen3) followed by a sparse
mixture-of-experts block: router ``mlp.gate.weight [E, H]``, fp32 softmax, top-k, renormalized
only with ``config.norm_topk_prob``, the weights cast to the logits' dtype; experts
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (3-D Parameters, shared as
they are). The post-attention RMSNorm is fused into the router and the experts (remat.nn.moe).
The router runs as a module of a subclass of ``Qwen3MoeTopKRouter``, so Hugging Face's
router-logit hooks record it.

Dense layers (``config.mlp_only_layers``, or layers that ``decoder_sparse_step`` skips) hold a
plain ``Qwen3MoeMLP`` (gate/up/down_proj): they are Qwen3 layers and become
remat.models.qwen3.HFQwen3Layer.

The causal LM's training loss is fused (remat.models.causal_lm), with the load-balancing loss
added as stock adds it under ``output_router_logits`` (remat.models.router_loss). The
per-expert row counts are read on the host (one sync per layer call), so ``torch.compile`` breaks
the graph there.
"""

from functools import partial

from torch import nn

from remat import checks
from remat.hf import is_hf_rms_norm
from remat.models.llama import _rms_norm
from remat.models.qwen3 import HFQwen3Layer, QKNormAttention, Qwen3Layer, attention_from_hf
from remat.models.registry import Family, Part
from remat.nn.layers import LAYER_POLICIES
from remat.nn.mlp import SwiGLUMLP
from remat.nn.moe import MoELayerMixin, SparseMoE


def _sparse_moe(stock, *, backend, recompute="block"):
    """remat's SparseMoE sharing a ``Qwen3MoeSparseMoeBlock``'s Parameters (Qwen3-MoE's routing:
    renormalized iff the router's ``norm_topk_prob``, weights in the logits' dtype)."""
    gate = getattr(stock, "gate", None)
    if not hasattr(gate, "norm_topk_prob"):
        raise TypeError(f"expected a Qwen3-MoE sparse block whose gate has norm_topk_prob, got {type(stock).__name__}")
    return SparseMoE.from_module(stock, renormalize=bool(gate.norm_topk_prob), fp32_weights=False,
                                 recompute=recompute, backend=backend)


class Qwen3MoeLayer(MoELayerMixin, Qwen3Layer):
    """A Qwen3-MoE (sparse) decoder layer built from remat's fused blocks, with Hugging Face's
    ``Qwen3MoeDecoderLayer`` parameter names: ``input_layernorm``, ``self_attn`` (q/k/v/o_proj,
    ``q_norm``, ``k_norm``), ``post_attention_layernorm``, ``mlp`` (``experts.gate_up_proj``,
    ``experts.down_proj``, ``gate.weight``).

    Bytes kept per token (:meth:`saved_bytes_per_token`; element size s, h hidden, I expert
    intermediate, k experts per token, Hq / Hkv heads of dim D; routing weights in s):

    - ``"memory"``: ``s(2h + Hq D) + 4 Hq + 8 + k(8 + s)``;
    - ``"balanced"`` (default): ``s(2h + 2 Hq D + 2 Hkv D) + 4 Hq + 8 + k(8 + s)``;
    - ``"speed"``: balanced ``+ 2 I k s``.

    Args:
        hidden, intermediate (per expert), num_experts, top_k, num_heads, num_kv_heads, head_dim: sizes.
        norm_topk_prob: renormalize the top-k probabilities (default False, Qwen3-MoE's).
        eps, rope_theta, sliding_window, attention_dropout, policy, backend: as remat.nn.Qwen3Layer.
    """

    def __init__(self, hidden, intermediate, num_experts, top_k, num_heads, num_kv_heads=None, head_dim=None, *,
                 norm_topk_prob=False, eps=1e-6, rope_theta=1e6, sliding_window=None, attention_dropout=0.0,
                 policy="balanced", backend=None, device=None, dtype=None):
        nn.Module.__init__(self)  # not Qwen3Layer's, which builds a dense MLP
        checks.check_choice(policy, "policy", LAYER_POLICIES)
        window = None if sliding_window is None else (int(sliding_window) - 1, None)
        self.self_attn = QKNormAttention(hidden, num_heads, num_kv_heads, head_dim, bias=False, o_bias=False,
                                         rope_theta=rope_theta, dropout=attention_dropout, causal=True, window=window,
                                         qk_norm="rms", qk_eps=eps, backend=backend, device=device, dtype=dtype)
        self._build_moe_parts(hidden, intermediate, num_experts, top_k, eps, renormalize=norm_topk_prob,
                              fp32_weights=False, policy=policy, backend=backend, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, stock, *, policy="balanced", backend=None):
        """A Qwen3MoeLayer sharing every Parameter (no copy) of a Hugging Face sparse
        ``Qwen3MoeDecoderLayer``; sizes, epsilons, rope, dropout and window from its config."""
        return cls._from_hf_parts(stock, attention=partial(attention_from_hf, qk_norm="rms"), sparse_moe=_sparse_moe,
                                  rms_norm=_rms_norm, policy=policy, backend=backend)


class HFQwen3MoeLayer(Qwen3MoeLayer):
    """Qwen3MoeLayer in a Hugging Face model: the same forward, which takes a
    ``Qwen3MoeDecoderLayer``'s arguments (see remat.nn.PreNormDecoderLayer.forward)."""


def build_layer(stock, *, policy="balanced", backend=None):
    """The remat layer for a ``Qwen3MoeDecoderLayer``: :class:`HFQwen3MoeLayer` for a sparse layer
    (``mlp.experts``), remat.models.qwen3.HFQwen3Layer for a dense one (``mlp.gate_proj``)."""
    if hasattr(getattr(stock, "mlp", None), "experts"):
        return HFQwen3MoeLayer.from_module(stock, policy=policy, backend=backend)
    return HFQwen3Layer.from_module(stock, policy=policy, backend=backend)


FAMILY = Family(
    name="qwen3_moe",
    layer_classes=("Qwen3MoeDecoderLayer",),
    build_layer=build_layer,
    parts=(
        Part("mlp", ("Qwen3MoeSparseMoeBlock",), _sparse_moe),
        Part("mlp", ("Qwen3MoeMLP",), SwiGLUMLP.from_module),
        Part("norm", ("Qwen3MoeRMSNorm",), _rms_norm, accepts=is_hf_rms_norm),
    ),
    causal_lms=("Qwen3MoeForCausalLM",),
    router_loss=True,
    whole_only=("Qwen3MoeAttention",),
    whole_only_reason=("Qwen3-MoE's attention (per-head q/k norms fused into the attention sub-block) is replaced "
                       "only as part of a whole decoder layer: pass all of modules=('norm', 'mlp', 'attention')"),
)
