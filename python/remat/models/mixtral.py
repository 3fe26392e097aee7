"""The Mixtral family: Hugging Face ``MixtralDecoderLayer`` as :class:`MixtralLayer`, a Mistral
attention sub-block (optional sliding window) followed by a sparse mixture-of-experts block:
router ``mlp.gate.weight [E, H]``, fp32 softmax, top-k, the top-k probabilities always
renormalized and kept fp32; experts ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj
[E, H, I]`` (3-D Parameters, shared as they are). The post-attention RMSNorm is fused into the
router and the experts (remat.nn.moe). The router runs as a module of a subclass of
``MixtralTopKRouter``, so Hugging Face's router-logit hooks record it and ``output_router_logits``
/ the load-balancing loss work as stock.

Left alone (with the reason in the patch report): router jitter noise (``router_jitter_noise > 0``).

The causal LM's training loss is fused (remat.models.causal_lm), with the load-balancing loss
added as stock adds it under ``output_router_logits`` (remat.models.router_loss). The
per-expert row counts are read on the host (one sync per layer call), so ``torch.compile`` breaks
the graph there.
"""

from torch import nn

from remat import checks
from remat.hf import is_hf_rms_norm
from remat.models.llama import HFAttention, LlamaLayer, _rms_norm
from remat.models.qwen3 import attention_from_hf
from remat.models.registry import Family, Part
from remat.nn.attention import Attention
from remat.nn.layers import LAYER_POLICIES
from remat.nn.moe import MoELayerMixin, SparseMoE


def _sparse_moe(stock, *, backend, recompute="block"):
    """remat's SparseMoE sharing a ``MixtralSparseMoeBlock``'s Parameters (Mixtral's routing:
    always renormalized, fp32 weights)."""
    return SparseMoE.from_module(stock, renormalize=True, fp32_weights=True, recompute=recompute, backend=backend)


class MixtralLayer(MoELayerMixin, LlamaLayer):
    """A Mixtral decoder layer built from remat's fused blocks, with Hugging Face's
    ``MixtralDecoderLayer`` parameter names: ``input_layernorm``, ``self_attn`` (q/k/v/o_proj),
    ``post_attention_layernorm``, ``mlp`` (``gate.weight``, ``experts.gate_up_proj``,
    ``experts.down_proj``).

    ``x -> h = x + o_proj(attention(rmsnorm(x))) -> h + moe(rmsnorm(h))``. Bytes kept per token
    (:meth:`saved_bytes_per_token`; element size s, h hidden, I expert intermediate, k experts
    per token, Hq / Hkv heads of dim D; the routing weights are fp32):

    - ``"memory"``: ``s(2h + Hq D) + 4 Hq + 8 + 12k``;
    - ``"balanced"`` (default): ``s(2h + 2 Hq D + 2 Hkv D) + 4 Hq + 8 + 12k``;
    - ``"speed"``: balanced ``+ 2 I k s``.

    Args:
        hidden, intermediate (per expert), num_experts, top_k, num_heads, num_kv_heads, head_dim: sizes.
        eps, rope_theta (default 1e6, Mixtral's), sliding_window, attention_dropout, policy, backend:
            as remat.nn.LlamaLayer.
    """

    def __init__(self, hidden, intermediate, num_experts, top_k, num_heads, num_kv_heads=None, head_dim=None, *,
                 eps=1e-5, rope_theta=1e6, sliding_window=None, attention_dropout=0.0, policy="balanced",
                 backend=None, device=None, dtype=None):
        nn.Module.__init__(self)  # not LlamaLayer's, which builds a dense MLP
        checks.check_choice(policy, "policy", LAYER_POLICIES)
        window = None if sliding_window is None else (int(sliding_window) - 1, None)
        self.self_attn = Attention(hidden, num_heads, num_kv_heads, head_dim, bias=False, o_bias=False,
                                   rope_theta=rope_theta, dropout=attention_dropout, causal=True, window=window,
                                   backend=backend, device=device, dtype=dtype)
        self._build_moe_parts(hidden, intermediate, num_experts, top_k, eps, renormalize=True, fp32_weights=True,
                              policy=policy, backend=backend, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, stock, *, policy="balanced", backend=None):
        """A MixtralLayer sharing every Parameter (no copy) of a Hugging Face ``MixtralDecoderLayer``;
        sizes, eps, rope, dropout and window from its config."""
        return cls._from_hf_parts(stock, attention=attention_from_hf, sparse_moe=_sparse_moe, rms_norm=_rms_norm,
                                  policy=policy, backend=backend)


class HFMixtralLayer(MixtralLayer):
    """MixtralLayer in a Hugging Face model: the same forward, which takes a
    ``MixtralDecoderLayer``'s arguments (see remat.nn.PreNormDecoderLayer.forward)."""


FAMILY = Family(
    name="mixtral",
    layer_classes=("MixtralDecoderLayer",),
    build_layer=HFMixtralLayer.from_module,
    parts=(
        Part("mlp", ("MixtralSparseMoeBlock",), _sparse_moe),
        Part("attention", ("MixtralAttention",), HFAttention.from_module),
        Part("norm", ("MixtralRMSNorm",), _rms_norm, accepts=is_hf_rms_norm),
    ),
    causal_lms=("MixtralForCausalLM",),
    router_loss=True,
)
