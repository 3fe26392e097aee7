"""Drop-in modules with the constructor arguments and state_dict keys of their stock
counterparts, so ``load_state_dict`` from a stock module works, and ``from_module`` converts one.

Mixed precision: when the input's dtype differs from the parameters' (say bf16 activations with
fp32 parameters under autocast), the parameters are cast to the input's dtype inside autograd
(the cast is differentiable, so gradients reach the fp32 parameters), and the norm runs in the
input's dtype with fp32 statistics.
"""

import numbers

import torch
from torch import nn

from remat import functional
from remat.autograd.mlp import RECOMPUTE_MODES
from remat.backend import resolve_backend
from remat.ops.mlp import ACTIVATIONS


def _normalized_shape_tuple(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def _flatten_hidden(x, normalized_shape):
    """[..., *normalized_shape] -> [..., prod(normalized_shape)], checking the trailing dims."""
    k = len(normalized_shape)
    if tuple(x.shape[x.dim() - k:]) != normalized_shape or x.dim() < k:
        raise ValueError(f"input's trailing dimensions must be {normalized_shape}, got shape {tuple(x.shape)}")
    return x.reshape(*x.shape[: x.dim() - k], -1)


def is_hf_rms_norm(module):
    """A Hugging Face RMSNorm: a 1-D ``weight`` and ``variance_epsilon`` (LlamaRMSNorm and kin)."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 1 and hasattr(module, "variance_epsilon")


def refuse_kv_cache(kwargs):
    """remat's layers are for training: a KV cache among Hugging Face's call arguments raises."""
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        raise ValueError("remat's layers are for training: a KV cache (use_cache, past_key_values) is not "
                         "supported; call remat.unpatch(model) before generating")


def _check_hidden_states(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"hidden_states must be [B, N, hidden], got shape {tuple(x.shape)}")


def _cast_like(p, x):
    """p in x's dtype (a differentiable cast when they differ), or None."""
    if p is None:
        return None
    return p if p.dtype == x.dtype else p.to(x.dtype)


def _param_as(p, x):
    """A norm parameter as a [hidden] vector in x's dtype, or None."""
    if p is None:
        return None
    return _cast_like(p if p.dim() == 1 else p.reshape(-1), x)


class RMSNorm(nn.Module):
    """Drop-in for ``torch.nn.RMSNorm``: same arguments, parameter ``weight``.

    Args:
        normalized_shape: int or tuple, the trailing dimensions normalized over.
        eps: None (default) uses ``torch.finfo(x.dtype).eps`` at call time, as torch does.
        elementwise_affine: learn ``weight`` (initialised to ones).
        backend: remat backend name, or None for the default choice.

    ``forward(x, residual=None)`` returns y, or ``(y, x + residual)`` when a residual is given.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None, *, backend=None):
        super().__init__()
        if eps is not None:
            functional._check_eps(eps)
        self.normalized_shape = _normalized_shape_tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.backend = backend
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @classmethod
    def from_module(cls, stock, *, backend=None):
        """A remat RMSNorm sharing ``stock``'s parameter (no copy) and settings: a
        ``torch.nn.RMSNorm``, or a Hugging Face RMSNorm (a 1-D ``weight`` and ``variance_epsilon``,
        as LlamaRMSNorm, MistralRMSNorm and Qwen2RMSNorm have)."""
        if isinstance(stock, nn.RMSNorm):
            module = cls(stock.normalized_shape, stock.eps, stock.elementwise_affine, device="meta", backend=backend)
        elif is_hf_rms_norm(stock):
            module = cls(stock.weight.shape[0], float(stock.variance_epsilon), device="meta", backend=backend)
        else:
            raise TypeError(f"from_module expects torch.nn.RMSNorm or a Hugging Face RMSNorm, got {type(stock).__name__}")
        module.weight = stock.weight
        return module

    def forward(self, x, residual=None):
        functional._check_input(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        flat = _flatten_hidden(x, self.normalized_shape)
        flat_residual = _flatten_hidden(residual, self.normalized_shape) if residual is not None else None
        out = functional.rms_norm(flat, _param_as(self.weight, x), eps, residual=flat_residual, backend=self.backend)
        if residual is None:
            return out.view(x.shape)
        return out[0].view(x.shape), out[1].view(x.shape)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm``: same arguments, parameters ``weight`` and ``bias``.

    Args:
        normalized_shape: int or tuple, the trailing dimensions normalized over.
        eps: default 1e-5.
        elementwise_affine: learn ``weight`` (ones) and, if ``bias``, ``bias`` (zeros).
        bias: learn a bias (default True).
        backend: remat backend name, or None for the default choice.

    ``forward(x, residual=None)`` returns y, or ``(y, x + residual)`` when a residual is given.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None, *, backend=None):
        super().__init__()
        functional._check_eps(eps)
        self.normalized_shape = _normalized_shape_tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.backend = backend
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    @classmethod
    def from_module(cls, stock, *, backend=None):
        """A remat LayerNorm sharing ``stock``'s parameters (no copy) and settings."""
        if not isinstance(stock, nn.LayerNorm):
            raise TypeError(f"from_module expects torch.nn.LayerNorm, got {type(stock).__name__}")
        module = cls(stock.normalized_shape, stock.eps, stock.elementwise_affine, bias=stock.bias is not None,
                     device="meta", backend=backend)
        module.weight = stock.weight
        module.bias = stock.bias
        return module

    def forward(self, x, residual=None):
        flat = _flatten_hidden(x, self.normalized_shape)
        flat_residual = _flatten_hidden(residual, self.normalized_shape) if residual is not None else None
        out = functional.layer_norm(flat, _param_as(self.weight, x), _param_as(self.bias, x), self.eps,
                                    residual=flat_residual, backend=self.backend)
        if residual is None:
            return out.view(x.shape)
        return out[0].view(x.shape), out[1].view(x.shape)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


def _activation_of(module):
    """remat's activation name for a stock activation module (SiLU, GELU)."""
    if isinstance(module, nn.SiLU):
        return "silu"
    if isinstance(module, nn.GELU):
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    name = type(module).__name__
    if name == "SiLUActivation":
        return "silu"
    if name in ("GELUActivation",):
        return "gelu"
    if name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh"):
        return "gelu_tanh"
    raise TypeError(f"unsupported activation module {name}; remat's MLPs take SiLU and GELU (erf or tanh)")


class SwiGLUMLP(nn.Module):
    """Gated MLP with the parameter names of Hugging Face's ``LlamaMLP``: ``gate_proj``,
    ``up_proj`` (``[intermediate, hidden]``) and ``down_proj`` (``[hidden, intermediate]``).

    Args:
        hidden, intermediate: sizes.
        bias: biases on the three projections (Llama's ``mlp_bias``), default False.
        activation: ``"silu"`` (SwiGLU, default), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU).
        recompute: ``"block"`` (default), ``"activation"`` or ``"none"``; see remat.swiglu_mlp.
        backend: remat backend name or None.
    """

    def __init__(self, hidden, intermediate, bias=False, *, activation="silu", recompute="block", backend=None,
                 device=None, dtype=None):
        super().__init__()
        functional._check_choice(activation, "activation", ACTIVATIONS)
        functional._check_choice(recompute, "recompute", RECOMPUTE_MODES)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias, device=device, dtype=dtype)
        self.activation, self.recompute, self.backend = activation, recompute, backend

    @classmethod
    def from_module(cls, stock, *, recompute="block", backend=None):
        """A SwiGLUMLP sharing the projections (no copy) of a module with ``gate_proj``,
        ``up_proj``, ``down_proj`` (nn.Linear) and ``act_fn`` (SiLU or GELU), e.g. LlamaMLP."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(stock, name, None), nn.Linear):
                raise TypeError(f"from_module expects a module with nn.Linear {name}, got {type(stock).__name__}")
        activation = _activation_of(stock.act_fn) if hasattr(stock, "act_fn") else "silu"
        module = cls(stock.gate_proj.in_features, stock.gate_proj.out_features, bias=False, activation=activation,
                     recompute=recompute, backend=backend, device="meta")
        module.gate_proj, module.up_proj, module.down_proj = stock.gate_proj, stock.up_proj, stock.down_proj
        return module

    def forward(self, x):
        w = [_cast_like(p, x) for p in (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)]
        b = [_cast_like(p, x) for p in (self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias)]
        return functional._gated_mlp(x, *w, *b, self.activation, self.recompute, self.backend)


class GELUMLP(nn.Module):
    """GPT-2's MLP written with nn.Linear: ``c_fc`` (``[intermediate, hidden]``), GELU,
    ``c_proj`` (``[hidden, intermediate]``), with biases.

    Args:
        hidden, intermediate: sizes.
        bias: biases on both projections (default True, as GPT-2).
        approximate: ``"none"`` (erf) or ``"tanh"`` (GPT-2's ``gelu_new``).
        recompute, backend: as for SwiGLUMLP.
    """

    def __init__(self, hidden, intermediate, bias=True, *, approximate="none", recompute="block", backend=None,
                 device=None, dtype=None):
        super().__init__()
        functional._check_choice(approximate, "approximate", ("none", "tanh"))
        functional._check_choice(recompute, "recompute", RECOMPUTE_MODES)
        self.c_fc = nn.Linear(hidden, intermediate, bias=bias, device=device, dtype=dtype)
        self.c_proj = nn.Linear(intermediate, hidden, bias=bias, device=device, dtype=dtype)
        self.approximate, self.recompute, self.backend = approximate, recompute, backend

    @classmethod
    def from_module(cls, stock, *, recompute="block", backend=None):
        """A GELUMLP sharing ``c_fc`` and ``c_proj`` (nn.Linear; Hugging Face's GPT-2 uses
        transposed Conv1D layers, which this does not take) and the GELU flavour of ``act``."""
        for name in ("c_fc", "c_proj"):
            if not isinstance(getattr(stock, name, None), nn.Linear):
                raise TypeError(f"from_module expects a module with nn.Linear {name}, got {type(stock).__name__}")
        activation = _activation_of(stock.act) if hasattr(stock, "act") else "gelu"
        if activation == "silu":
            raise TypeError("GELUMLP takes a GELU activation, got SiLU")
        module = cls(stock.c_fc.in_features, stock.c_fc.out_features, bias=False,
                     approximate="none" if activation == "gelu" else "tanh", recompute=recompute, backend=backend,
                     device="meta")
        module.c_fc, module.c_proj = stock.c_fc, stock.c_proj
        return module

    def forward(self, x):
        return functional.gelu_mlp(x, _cast_like(self.c_fc.weight, x), _cast_like(self.c_fc.bias, x),
                                   _cast_like(self.c_proj.weight, x), _cast_like(self.c_proj.bias, x),
                                   approximate=self.approximate, recompute=self.recompute, backend=self.backend)


def _rope_type(config):
    """"default" for plain rotary embedding, else the config's rope_type (llama3, yarn, ...)."""
    for source in (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)):
        if isinstance(source, dict) and source.get("rope_type", source.get("type", "default")) != "default":
            return source.get("rope_type", source.get("type"))
    return "default"


def _sliding_window(stock, config):
    """(window - 1, None) for a Hugging Face attention whose layer uses sliding-window attention
    (Mistral: keys within the last ``sliding_window`` positions), else None."""
    window = getattr(config, "sliding_window", None) if config is not None else None
    if window is None or not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(stock, "layer_idx", None)
    if layer_types is not None and layer_idx is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return (int(window) - 1, None)


class Attention(nn.Module):
    """Self-attention with the parameter names of Hugging Face's ``LlamaAttention``: ``q_proj``
    (``[Hq * D, hidden]``), ``k_proj``, ``v_proj`` (``[Hkv * D, hidden]``) and ``o_proj``
    (``[hidden, Hq * D]``), running :func:`remat.attention` (flash attention; the probabilities are
    recomputed in backward, never stored).

    Args:
        hidden: model width.
        num_heads: query heads Hq.
        num_kv_heads: key/value heads Hkv (GQA; default Hq). Hq must be a multiple.
        head_dim: D, default ``hidden // num_heads``.
        bias: biases on q/k/v projections (Llama's ``attention_bias``, Qwen2's True), default False.
        rope_theta: base of the default rotary embedding (Llama: 10000 or 500000), or None for no
            rotary embedding unless ``position_embeddings`` is passed to forward.
        dropout: attention-probability dropout, applied in training mode only.
        causal: causal masking (default True).
        o_bias: bias on ``o_proj``; default: same as ``bias``.
        window: ``(left, right)`` sliding window (see remat.attention), default None.
        softcap: logit softcap, default None. scale: default ``1 / sqrt(D)``.
        backend: remat backend name or None.

    ``forward(x, position_ids=None, position_embeddings=None)``: x ``[B, N, hidden]``;
    ``position_ids`` ``[B, N]`` or ``[N]`` (default ``0 .. N - 1``) for the built-in rotary
    tables; ``position_embeddings=(cos, sin)`` (e.g. from a Hugging Face rotary module) overrides
    them. Returns ``[B, N, hidden]``.
    """

    def __init__(self, hidden, num_heads, num_kv_heads=None, head_dim=None, bias=False, rope_theta=None, dropout=0.0,
                 causal=True, *, o_bias=None, window=None, softcap=None, scale=None, backend=None, device=None,
                 dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = hidden // num_heads if head_dim is None else head_dim
        for name, value in (("hidden", hidden), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if rope_theta is not None and (not rope_theta > 0 or head_dim % 2):
            raise ValueError(f"rope_theta must be positive and head_dim even, got {rope_theta!r}, {head_dim}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta, self.dropout, self.causal = rope_theta, float(dropout), causal
        self.window, self.softcap, self.scale, self.backend = window, softcap, scale, backend
        self.rope_type = "default"
        o_bias = bias if o_bias is None else o_bias
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias, device=device, dtype=dtype)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, stock, *, num_heads=None, num_kv_heads=None, rope_theta=None, causal=True, dropout=None,
                    backend=None):
        """An Attention sharing the four projections (no copy) of a module with nn.Linear
        ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, e.g. Hugging Face's LlamaAttention, whose
        ``config`` supplies the head counts, dropout and rope theta when not given here."""
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(stock, name, None), nn.Linear):
                raise TypeError(f"from_module expects a module with nn.Linear {name}, got {type(stock).__name__}")
        extra = [name for name in ("q_norm", "k_norm") if getattr(stock, name, None) is not None]
        if extra:
            raise ValueError(f"{type(stock).__name__} normalizes q/k ({', '.join(extra)}), which remat's Attention "
                             "does not compute")
        config = getattr(stock, "config", None)
        num_heads = num_heads or getattr(config, "num_attention_heads", None)
        if num_heads is None:
            raise ValueError("from_module needs num_heads (the module has no config.num_attention_heads)")
        num_kv_heads = num_kv_heads or getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(stock, "head_dim", None) or stock.q_proj.out_features // num_heads
        rope_type = _rope_type(config)
        if rope_theta is None and config is not None and rope_type == "default":
            rope_theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
                "rope_theta")
        if dropout is None:
            dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        module = cls(stock.q_proj.in_features, num_heads, num_kv_heads, head_dim, rope_theta=rope_theta,
                     dropout=dropout, causal=causal and getattr(stock, "is_causal", True),
                     window=_sliding_window(stock, config), scale=getattr(stock, "scaling", None), backend=backend,
                     device="meta")
        module.q_proj, module.k_proj, module.v_proj, module.o_proj = (stock.q_proj, stock.k_proj, stock.v_proj,
                                                                      stock.o_proj)
        module.rope_type = rope_type
        module.train(stock.training)
        return module

    def rope_for(self, n, device, position_ids=None, position_embeddings=None):
        """The (cos, sin) to use for N tokens: ``position_embeddings`` if given, else the built-in
        tables at ``position_ids`` (default 0 .. N - 1), else None (no rope)."""
        if position_embeddings is not None:
            return position_embeddings
        if self.rope_type != "default":
            raise ValueError(f"this attention uses rope_type {self.rope_type!r}, which remat does not compute; pass "
                             "position_embeddings=(cos, sin) from the model's rotary module")
        if self.rope_theta is None:
            return None
        positions = position_ids if position_ids is not None else torch.arange(n, device=device)
        return self.rope_tables(positions, device)

    def rope_tables(self, position_ids, device):
        """fp32 (cos, sin) ``[B or 1, N, D/2]`` of the default rotary embedding at ``position_ids``:
        angle = position / rope_theta ** (2d / D) for d < D/2, as Llama computes it."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        positions = position_ids.to(device=device, dtype=torch.float32)
        if positions.dim() == 1:
            positions = positions[None]
        angles = positions[..., None] * inv_freq
        return angles.cos(), angles.sin()

    def forward(self, x, position_ids=None, position_embeddings=None):
        _check_hidden_states(x)
        batch, n, _ = x.shape
        q = nn.functional.linear(x, _cast_like(self.q_proj.weight, x), _cast_like(self.q_proj.bias, x))
        k = nn.functional.linear(x, _cast_like(self.k_proj.weight, x), _cast_like(self.k_proj.bias, x))
        v = nn.functional.linear(x, _cast_like(self.v_proj.weight, x), _cast_like(self.v_proj.bias, x))
        rope = self.rope_for(n, x.device, position_ids, position_embeddings)
        o = functional.attention(
            q.view(batch, n, self.num_heads, self.head_dim), k.view(batch, n, self.num_kv_heads, self.head_dim),
            v.view(batch, n, self.num_kv_heads, self.head_dim), causal=self.causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0, rope=rope, window=self.window, softcap=self.softcap,
            backend=self.backend)
        o = o.reshape(batch, n, self.num_heads * self.head_dim)
        return nn.functional.linear(o, _cast_like(self.o_proj.weight, o), _cast_like(self.o_proj.bias, o))


LAYER_POLICIES = ("speed", "balanced", "memory")


class LlamaLayer(nn.Module):
    """A Llama decoder layer (also Mistral and Qwen2, which differ only in configuration: q/k/v
    biases, sliding windows) built from remat's fused blocks, with Hugging Face's
    ``LlamaDecoderLayer`` parameter names: ``input_layernorm``, ``self_attn`` (q/k/v/o_proj),
    ``post_attention_layernorm``, ``mlp`` (gate/up/down_proj).

    ``x -> h = x + o_proj(attention(rmsnorm(x))) -> h + mlp(rmsnorm(h))``, with rope and causal
    GQA attention. ``policy`` chooses what the layer keeps for backward (per token, bf16, h hidden,
    I intermediate, Hq / Hkv heads of dim D, with Hq*D = h; 16 more bytes per call with dropout):

    - ``"speed"``: no matmul is recomputed. Keeps x, q, k, v, o, the second residual h, gate and
      up, and fp32 statistics: ``2(4h + 2 Hkv D + 2I) + 4 Hq + 8`` bytes.
    - ``"balanced"`` (default): the MLP keeps only its input h (its gate/up GEMMs are recomputed):
      ``2(4h + 2 Hkv D) + 4 Hq + 8``.
    - ``"memory"``: the q/k/v projections are recomputed from x too: ``2(3h) + 4 Hq + 8`` (x, o,
      h, lse and two fp32 rstd).

    Norms, rope, the attention probabilities and the MLP activation are always recomputed.

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
        functional._check_choice(policy, "policy", LAYER_POLICIES)
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
        functional._check_choice(policy, "policy", LAYER_POLICIES)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.self_attn = Attention.from_module(stock.self_attn, backend=backend)
        module.mlp = SwiGLUMLP.from_module(stock.mlp, backend=backend)
        module.input_layernorm = RMSNorm.from_module(stock.input_layernorm, backend=backend)
        module.post_attention_layernorm = RMSNorm.from_module(stock.post_attention_layernorm, backend=backend)
        module.policy, module.backend = policy, backend
        module.train(stock.training)
        return module

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        x = hidden_states
        if attention_mask is not None:
            raise ValueError("LlamaLayer does causal attention and takes no attention_mask; for Hugging Face models "
                             "use remat.patch, which checks the model's padding mask")
        _check_hidden_states(x)
        refuse_kv_cache(kwargs)
        attn = self.self_attn
        batch, n, hidden = x.shape
        rope = attn.rope_for(n, x.device, position_ids, position_embeddings)
        o = attention_block(x, self.input_layernorm, attn, rope, keep_qkv=self.policy != "memory")
        h = x + nn.functional.linear(o.reshape(batch, n, -1), _cast_like(attn.o_proj.weight, x),
                                     _cast_like(attn.o_proj.bias, x))
        mlp = self.mlp
        norm = self.post_attention_layernorm
        mlp_out = functional.norm_mlp(
            h, _param_as(norm.weight, h), _cast_like(mlp.gate_proj.weight, h), _cast_like(mlp.up_proj.weight, h),
            _cast_like(mlp.down_proj.weight, h), norm="rms", eps=_norm_eps(norm, h), activation=mlp.activation,
            b_gate=_cast_like(mlp.gate_proj.bias, h), b_up=_cast_like(mlp.up_proj.bias, h),
            b_down=_cast_like(mlp.down_proj.bias, h), recompute="activation" if self.policy == "speed" else "block",
            backend=self.backend)
        return h + mlp_out


def _norm_eps(norm, x):
    return norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps


def attention_block(x, norm, attn, rope, keep_qkv):
    """o = attention(rope(q), rope(k), v) of the pre-norm sub-block, through NormAttentionFunction
    (see remat.autograd.layer for what it saves). x [B, N, hidden]; returns o [B, N, Hq, D]."""
    from remat.autograd.layer import NormAttentionFunction

    functional._check_input(x)
    batch, n, hidden = x.shape
    if hidden != attn.q_proj.in_features:
        raise ValueError(f"hidden_states' last dim must be {attn.q_proj.in_features}, got {hidden}")
    for name, p in (("norm weight", norm.weight), ("q_proj weight", attn.q_proj.weight)):
        if p is not None and p.device != x.device:
            raise ValueError(f"the layer's {name} is on {p.device}, hidden_states on {x.device}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    shape = (batch, n, attn.num_heads, attn.num_kv_heads, attn.head_dim)
    functional._check_rope_tables(rope, batch, n, n, attn.head_dim, x.device)
    backend = resolve_backend(attn.backend, x)
    left, right = functional._window_bounds(attn.window, attn.causal)
    scale = attn.scale if attn.scale is not None else attn.head_dim**-0.5
    cos, sin = rope if rope is not None else (None, None)
    params = [_param_as(norm.weight, x)] + [_cast_like(getattr(attn, f"{p}_proj").weight, x) for p in "qkv"]
    biases = [_cast_like(getattr(attn, f"{p}_proj").bias, x) for p in "qkv"]
    eps = float(_norm_eps(norm, x))
    (x, *params), autocast_off = functional._autocast_cast(x, *params, *biases)
    functional.check_attention_dtype(backend, x.dtype)
    weights, biases = params[:4], params[4:]
    with autocast_off:
        return NormAttentionFunction.apply(
            x, weights[0], None, weights[1], weights[2], weights[3], *biases, cos, sin, shape, "rms", eps, float(scale), float(attn.softcap or 0.0), left, right,
            attn.dropout if attn.training else 0.0, True, keep_qkv, backend)


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


class GPT2Layer(nn.Module):
    """A GPT-2 block built from remat's fused blocks, with Hugging Face's ``GPT2Block`` parameter
    names and layouts: ``ln_1``, ``attn.c_attn`` ([h, 3h] Conv1D), ``attn.c_proj``, ``ln_2``,
    ``mlp.c_fc`` ([h, I]), ``mlp.c_proj``. Pre-LayerNorm causal attention with biases, GELU (tanh)
    MLP, residual dropout after each (Philox, never a stored mask).

    ``policy`` as for LlamaLayer. Bytes kept per token (element size s, Hq heads, I inner size,
    plus 16 bytes per call for each dropout in use):

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
        functional._check_choice(policy, "policy", LAYER_POLICIES)
        functional._check_choice(approximate, "approximate", ("none", "tanh"))
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
        functional._check_choice(policy, "policy", LAYER_POLICIES)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.ln_1 = LayerNorm.from_module(stock.ln_1, backend=backend)
        module.ln_2 = LayerNorm.from_module(stock.ln_2, backend=backend)
        module.attn = nn.Module()
        module.attn.c_attn, module.attn.c_proj = stock.attn.c_attn, stock.attn.c_proj
        module.mlp = nn.Module()
        module.mlp.c_fc, module.mlp.c_proj = stock.mlp.c_fc, stock.mlp.c_proj
        module.num_heads = config.num_attention_heads
        module.attention_dropout, module.resid_dropout = float(config.attn_pdrop), float(config.resid_pdrop)
        module.approximate = "none" if activation == "gelu" else "tanh"
        module.policy, module.backend = policy, backend
        module.train(stock.training)
        return module

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        from remat.autograd.layer import NormAttentionFunction

        x = hidden_states
        if attention_mask is not None:
            raise ValueError("GPT2Layer does causal attention and takes no attention_mask; for Hugging Face models "
                             "use remat.patch, which checks the model's padding mask")
        _check_hidden_states(x)
        functional._check_input(x)
        refuse_kv_cache(kwargs)
        batch, n, hidden = x.shape
        if hidden != self.attn.c_attn.weight.shape[0]:
            raise ValueError(f"hidden_states' last dim must be {self.attn.c_attn.weight.shape[0]}, got {hidden}")
        head_dim = hidden // self.num_heads
        backend = resolve_backend(self.backend, x)
        c_attn, c_proj = self.attn.c_attn, self.attn.c_proj
        w_qkv, b_qkv = _cast_like(c_attn.weight, x), _cast_like(c_attn.bias, x)
        weights = [w_qkv[:, i * hidden : (i + 1) * hidden].t() for i in range(3)]
        biases = [b_qkv[i * hidden : (i + 1) * hidden] for i in range(3)]
        norm = [_param_as(self.ln_1.weight, x), _param_as(self.ln_1.bias, x)]
        # Under autocast the attention sub-block runs in the autocast dtype; the residual stream x
        # keeps its own dtype, as in the stock block.
        (x_cast, *params), autocast_off = functional._autocast_cast(x.contiguous(), *norm, *weights, *biases)
        functional.check_attention_dtype(backend, x_cast.dtype)
        with autocast_off:
            o = NormAttentionFunction.apply(
                x_cast, *params, None, None, (batch, n, self.num_heads, self.num_heads, head_dim), "layer",
                float(self.ln_1.eps), head_dim**-0.5, 0.0, -1, 0, self.attention_dropout if self.training else 0.0,
                True, self.policy != "memory", backend)
        attn_out = nn.functional.linear(o.reshape(batch, n, hidden), _cast_like(c_proj.weight, o).t(),
                                        _cast_like(c_proj.bias, o))
        h = x + functional.dropout(attn_out, self.resid_dropout, self.training, backend=self.backend)
        c_fc, c_proj = self.mlp.c_fc, self.mlp.c_proj
        mlp_out = functional.norm_gelu_mlp(
            h, _param_as(self.ln_2.weight, h), _param_as(self.ln_2.bias, h), _cast_like(c_fc.weight, h).t(),
            _cast_like(c_fc.bias, h), _cast_like(c_proj.weight, h).t(), _cast_like(c_proj.bias, h), norm="layer",
            eps=self.ln_2.eps, approximate=self.approximate,
            recompute="activation" if self.policy == "speed" else "block", backend=self.backend)
        return h + functional.dropout(mlp_out, self.resid_dropout, self.training, backend=self.backend)
