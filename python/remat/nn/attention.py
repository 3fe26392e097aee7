"""Self-attention with Hugging Face's LlamaAttention parameter names, running flash attention
(remat.attention): the probabilities are recomputed in backward, never stored. Also here:
:class:`QKNormAttention`, the attention with per-head q/k norms (Qwen3's RMSNorm, Gemma 3's
``(1 + w)`` norm), and :func:`attention_from_hf`, which builds either from a Hugging Face attention
module, sharing its parameters (the families Qwen3 and Gemma import them from here)."""

import torch
from torch import nn

from remat import checks, functional
from remat.hf import is_hf_rms_norm, rope_type_of, sliding_window_of
from remat.nn.adapters import attend, linear_projection, projection_features, read_projection
from remat.nn.norm import GemmaRMSNorm, RMSNorm


class Attention(nn.Module):
    """Self-attention with the parameter names of Hugging Face's ``LlamaAttention``: ``q_proj``
    (``[Hq * D, hidden]``), ``k_proj``, ``v_proj`` (``[Hkv * D, hidden]``) and ``o_proj``
    (``[hidden, Hq * D]``), running :func:`remat.attention` (flash attention; the probabilities are
    recomputed in backward, never stored). The projections are read at each call (remat.nn.adapters):
    PEFT LoRA layers add their branches (remat.lora_linear), other linear modules run their own
    forward under checkpoint.

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

    ``forward(x, position_ids=None, position_embeddings=None, layout=None)``: x ``[B, N, hidden]``;
    ``position_ids`` ``[B, N]`` or ``[N]`` (default ``0 .. N - 1``) for the built-in rotary
    tables; ``position_embeddings=(cos, sin)`` (e.g. from a Hugging Face rotary module) overrides
    them. ``layout``: None, or x's remat.sequences.SequenceLayout: x is then one packed row
    ``[1, T, hidden]`` of sequences that attend only within themselves (rope tables then per
    token, ``[1, T, ...]``), or ``[B, N, hidden]`` with pads; the layout's empty queries (pads)
    get attention output 0. Returns ``[B, N, hidden]``.
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
        """An Attention sharing the four projections (no copy) of a module with ``q_proj``,
        ``k_proj``, ``v_proj``, ``o_proj`` (nn.Linear, PEFT LoRA layers or other linear modules:
        see remat.nn.adapters), e.g. Hugging Face's LlamaAttention, whose ``config`` supplies the
        head counts, dropout and rope theta when not given here."""
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            projection_features(getattr(stock, name, None), name, stock)
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
        rope_type = rope_type_of(config)
        if rope_theta is None and config is not None and rope_type == "default":
            rope_theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
                "rope_theta")
        if dropout is None:
            dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        module = cls(stock.q_proj.in_features, num_heads, num_kv_heads, head_dim, rope_theta=rope_theta,
                     dropout=dropout, causal=causal and getattr(stock, "is_causal", True),
                     window=sliding_window_of(stock, config), scale=getattr(stock, "scaling", None), backend=backend,
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

    def forward(self, x, position_ids=None, position_embeddings=None, layout=None):
        checks.check_hidden_states(x)
        batch, n, _ = x.shape
        q, k, v = (linear_projection(read_projection(p), x, self.backend) for p in (self.q_proj, self.k_proj,
                                                                                     self.v_proj))
        rope = self.rope_for(n, x.device, position_ids, position_embeddings)
        o = attend(q.view(batch, n, self.num_heads, self.head_dim), k.view(batch, n, self.num_kv_heads, self.head_dim),
                   v.view(batch, n, self.num_kv_heads, self.head_dim), layout, causal=self.causal, scale=self.scale,
                   dropout_p=self.dropout if self.training else 0.0, rope=rope, window=self.window,
                   softcap=self.softcap, backend=self.backend)
        return self.project_output(o.reshape(batch, n, self.num_heads * self.head_dim))

    def project_output(self, o):
        """The output projection ``o_proj`` of an attention output o ``[..., Hq * D]``."""
        return linear_projection(read_projection(self.o_proj), o, self.backend)


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
        norm_class = RMSNorm if qk_norm == "rms" else GemmaRMSNorm
        self.q_norm = norm_class(self.head_dim, qk_eps, device=device, dtype=dtype, backend=self.backend)
        self.k_norm = norm_class(self.head_dim, qk_eps, device=device, dtype=dtype, backend=self.backend)

    def qk_eps_for(self, x):
        """The per-head norms' epsilon (q_norm's and k_norm's are one: from_module checks)."""
        return self.q_norm.eps_for(x)

    def forward(self, x, position_ids=None, position_embeddings=None):
        checks.check_hidden_states(x)
        batch, n, _ = x.shape
        q, k, v = (linear_projection(read_projection(p), x, self.backend)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q = self.q_norm(q.view(batch, n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(batch, n, self.num_kv_heads, self.head_dim))
        rope = self.rope_for(n, x.device, position_ids, position_embeddings)
        o = functional.attention(
            q, k, v.view(batch, n, self.num_kv_heads, self.head_dim), causal=self.causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0, rope=rope, window=self.window, softcap=self.softcap,
            backend=self.backend)
        o = o.reshape(batch, n, self.num_heads * self.head_dim)
        return linear_projection(read_projection(self.o_proj), o, self.backend)


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
        projection_features(getattr(stock, name, None), name, stock)
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
            norms.append(GemmaRMSNorm.from_module(norm, backend=backend))
    if norms[0].eps != norms[1].eps:
        raise ValueError(f"q_norm and k_norm have different epsilons ({norms[0].eps}, {norms[1].eps}); remat's fused "
                         "attention takes one")
    return norms
