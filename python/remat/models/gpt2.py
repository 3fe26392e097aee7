"""The GPT-2 family: Hugging Face ``GPT2Block`` as :class:`GPT2Layer` (pre-LayerNorm causal
attention with biases, GELU-tanh MLP, residual dropout), with its Conv1D ``[in, out]`` weights used
as they are (transposed views, no copies). GPT-2's attention and MLP are replaced only as part of
a whole block. A projection that is not a plain Conv1D (a PEFT LoRA layer, another module) makes
its sub-block run through the modules' own forwards under checkpoint (the generic path of
remat.nn.adapters: the sub-block keeps only its input and re-runs in backward)."""

import torch
from torch import nn

from remat import checks, functional
from remat.models.registry import Family
from remat.nn import adapters
from remat.nn.layers import LAYER_POLICIES, PreNormDecoderLayer
from remat.nn.norm import LayerNorm
from remat.sequences import varlen_arguments


class Conv1D(nn.Module):
    """GPT-2's projection layout (as Hugging Face's Conv1D): ``weight`` [in, out], ``bias`` [out],
    ``y = x @ weight + bias``. Holds parameters for GPT2Layer, which reads them directly."""

    def __init__(self, in_features, out_features, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        return nn.functional.linear(x, self.weight.t(), self.bias)


class GPT2Layer(PreNormDecoderLayer):
    """A GPT-2 block built from remat's fused blocks, with Hugging Face's ``GPT2Block`` parameter
    names and layouts: ``ln_1``, ``attn.c_attn`` ([h, 3h] Conv1D), ``attn.c_proj``, ``ln_2``,
    ``mlp.c_fc`` ([h, I]), ``mlp.c_proj``. Pre-LayerNorm causal attention with biases, GELU (tanh)
    MLP, residual dropout after each (Philox, never a stored mask).

    ``policy`` as for LlamaLayer. Bytes kept per token (element size s, Hq heads, I inner size,
    plus 16 bytes per call for each dropout in use; :meth:`saved_bytes_per_token`):

    - ``"memory"``: x, o, h (the second residual), two fp32 (mean, rstd) pairs and lse:
      ``3sh + 4 Hq + 16``.
    - ``"balanced"`` (default): also q, k, v: ``6sh + 4 Hq + 16``.
    - ``"speed"``: also the MLP pre-activation: ``6sh + sI + 4 Hq + 16``.

    Args:
        hidden, num_heads: sizes; intermediate: default 4 * hidden. eps: LayerNorm epsilon (1e-5).
        attention_dropout, resid_dropout: probabilities, applied in training mode.
        approximate: GELU flavour, ``"tanh"`` (GPT-2's gelu_new, default) or ``"none"``.
        policy, backend: as for LlamaLayer.
    """

    def __init__(self, hidden, num_heads, intermediate=None, *, eps=1e-5, attention_dropout=0.0, resid_dropout=0.0,
                 approximate="tanh", policy="balanced", backend=None, device=None, dtype=None):
        super().__init__()
        checks.check_choice(policy, "policy", LAYER_POLICIES)
        checks.check_choice(approximate, "approximate", checks.GELU_APPROXIMATIONS)
        if hidden % num_heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of num_heads ({num_heads})")
        intermediate = 4 * hidden if intermediate is None else intermediate
        self.ln_1 = LayerNorm(hidden, eps, device=device, dtype=dtype, backend=backend)
        self.attn = nn.Module()
        self.attn.c_attn = Conv1D(hidden, 3 * hidden, device=device, dtype=dtype)
        self.attn.c_proj = Conv1D(hidden, hidden, device=device, dtype=dtype)
        self.ln_2 = LayerNorm(hidden, eps, device=device, dtype=dtype, backend=backend)
        self.mlp = nn.Module()
        self.mlp.c_fc = Conv1D(hidden, intermediate, device=device, dtype=dtype)
        self.mlp.c_proj = Conv1D(intermediate, hidden, device=device, dtype=dtype)
        self.num_heads, self.attention_dropout, self.resid_dropout = num_heads, attention_dropout, resid_dropout
        self.approximate, self.policy, self.backend = approximate, policy, backend

    @classmethod
    def from_module(cls, stock, *, policy="balanced", backend=None):
        """A GPT2Layer sharing every parameter (no copy) of a Hugging Face ``GPT2Block``; heads,
        dropouts and the GELU flavour from its config."""
        for name in ("ln_1", "attn", "ln_2", "mlp"):
            if not hasattr(stock, name):
                raise TypeError(f"from_module expects a GPT2Block with {name}, got {type(stock).__name__}")
        if hasattr(stock, "crossattention"):
            raise ValueError("GPT2Layer has no cross-attention; this block has one")
        config = stock.attn.config
        if getattr(config, "scale_attn_by_inverse_layer_idx", False) or not getattr(config, "scale_attn_weights", True):
            raise ValueError("GPT2Layer scales logits by 1/sqrt(head_dim) only (scale_attn_weights=True, "
                             "scale_attn_by_inverse_layer_idx=False)")
        activation = getattr(config, "activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"GPT2Layer takes a GELU activation, got {activation!r}")
        module = cls._empty(policy, backend)
        module.ln_1 = LayerNorm.from_module(stock.ln_1, backend=backend)
        module.ln_2 = LayerNorm.from_module(stock.ln_2, backend=backend)
        module.attn = nn.Module()
        module.attn.c_attn, module.attn.c_proj = stock.attn.c_attn, stock.attn.c_proj
        module.mlp = nn.Module()
        module.mlp.c_fc, module.mlp.c_proj = stock.mlp.c_fc, stock.mlp.c_proj
        module.num_heads = config.num_attention_heads
        module.attention_dropout, module.resid_dropout = float(config.attn_pdrop), float(config.resid_pdrop)
        module.approximate = "none" if activation == "gelu" else "tanh"
        module.train(stock.training)
        return module

    @property
    def head_dim(self):
        """The attention's head dim: hidden // num_heads (c_attn's q, k and v split into heads)."""
        return self.attn.c_attn.weight.shape[0] // self.num_heads

    def saved_bytes_per_token(self, element_size):
        """Bytes this layer keeps for backward per token under its policy (the formulas above),
        for activations of ``element_size`` bytes; without the 16 bytes per call of each dropout."""
        hidden, intermediate = self.attn.c_attn.weight.shape[0], self.mlp.c_fc.weight.shape[1]
        stats = 4 * self.num_heads + 16  # fp32 lse per head, two fp32 (mean, rstd) pairs
        memory = 3 * element_size * hidden + stats
        balanced = memory + 3 * element_size * hidden
        speed = balanced + element_size * intermediate
        return {"memory": memory, "balanced": balanced, "speed": speed}[self.policy]

    def attention_output(self, x, position_ids, position_embeddings, layout=None):
        if not _is_plain_conv1d(self.attn.c_attn):
            return adapters.checkpointed(lambda t: self._unfused_attention_output(t, layout), x)
        hidden = x.shape[-1]
        c_attn = self.attn.c_attn
        if hidden != c_attn.weight.shape[0]:
            raise ValueError(f"hidden_states' last dim must be {c_attn.weight.shape[0]}, got {hidden}")
        w_qkv, b_qkv = checks.cast_like(c_attn.weight, x), checks.cast_like(c_attn.bias, x)
        # Conv1D [in, 3h] -> three [h, h] nn.Linear-layout views; under autocast the sub-block runs
        # in the autocast dtype while the residual stream x keeps its own, as in the stock block.
        weights = [w_qkv[:, i * hidden : (i + 1) * hidden].t() for i in range(3)]
        biases = [b_qkv[i * hidden : (i + 1) * hidden] for i in range(3)]
        return functional.norm_attention(
            x, checks.vector_like(self.ln_1.weight, x), *weights, norm_bias=checks.vector_like(self.ln_1.bias, x),
            b_q=biases[0], b_k=biases[1], b_v=biases[2], num_heads=self.num_heads, norm="layer",
            eps=float(self.ln_1.eps), causal=True, dropout_p=self.attention_dropout if self.training else 0.0,
            keep_qkv=self.keeps_qkv, backend=self.backend, **varlen_arguments(layout),
            **self.attention_tile_arguments(layout, True, None, self.attention_dropout if self.training else 0.0))

    def _unfused_attention_output(self, x, layout):
        """The attention sub-block through the modules' own forwards (a c_attn with LoRA or another
        module: the generic path of remat.nn.adapters, run under checkpoint)."""
        batch, n, hidden = x.shape
        head_dim = hidden // self.num_heads
        q, k, v = (t.reshape(batch, n, self.num_heads, head_dim) for t in self.attn.c_attn(self.ln_1(x)).split(
            hidden, dim=-1))
        return adapters.attend(q, k, v, layout, causal=True,
                               dropout_p=self.attention_dropout if self.training else 0.0, backend=self.backend)

    def out_proj(self, o):
        c_proj = self.attn.c_proj
        if not _is_plain_conv1d(c_proj):
            return adapters.checkpointed(c_proj, o)
        return nn.functional.linear(o, checks.cast_like(c_proj.weight, o).t(), checks.cast_like(c_proj.bias, o))

    def mlp_block(self, h):
        c_fc, c_proj = self.mlp.c_fc, self.mlp.c_proj
        if not (_is_plain_conv1d(c_fc) and _is_plain_conv1d(c_proj)):
            # Adapters or other modules: the generic path of remat.nn.adapters.
            approximate = "none" if self.approximate == "none" else "tanh"
            return adapters.checkpointed(
                lambda t: c_proj(nn.functional.gelu(c_fc(self.ln_2(t)), approximate=approximate)), h)
        return functional.norm_gelu_mlp(
            h, checks.vector_like(self.ln_2.weight, h), checks.vector_like(self.ln_2.bias, h),
            checks.cast_like(c_fc.weight, h).t(), checks.cast_like(c_fc.bias, h),
            checks.cast_like(c_proj.weight, h).t(), checks.cast_like(c_proj.bias, h), norm="layer", eps=self.ln_2.eps,
            approximate=self.approximate, recompute=self.mlp_recompute, backend=self.backend,
            tile_tokens=self.tile_tokens)


def _is_plain_conv1d(module):
    """A GPT-2 Conv1D (``x @ weight + bias``, Hugging Face's or remat's) run as is: no PEFT wrapper,
    no instance forward, no hooks."""
    return (type(module).__name__ == "Conv1D" and "forward" not in module.__dict__ and not module._forward_hooks
            and not module._forward_pre_hooks and isinstance(getattr(module, "weight", None), torch.Tensor))


class HFGPT2Layer(GPT2Layer):
    """remat.nn.GPT2Layer taking a Hugging Face GPT2Block's arguments: the 2-D padding mask a patched
    model builds, ``position_ids`` (packed rows), packed-row offsets; with a KV cache it runs the
    replaced stock block (see PreNormDecoderLayer.forward)."""

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("remat's GPT2Layer has no cross-attention (encoder_hidden_states)")
        return super().forward(hidden_states, attention_mask=attention_mask, cache=cache, **kwargs)


FAMILY = Family(
    name="gpt2",
    layer_classes=("GPT2Block",),
    causal_lms=("GPT2LMHeadModel",),
    build_layer=HFGPT2Layer.from_module,
    whole_only=("GPT2Attention", "GPT2MLP"),
    whole_only_reason=("GPT-2's attention and MLP are replaced only as whole blocks: pass all of "
                       "modules=('norm', 'mlp', 'attention')"),
)
