"""Mixture-of-experts modules with Hugging Face's parameter layout (transformers 5.x, Mixtral and
Qwen3-MoE): the top-k router ``gate.weight [E, H]``, the experts as 3-D Parameters
``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj [E, H, I]``,
and the sparse block ``mlp`` holding both. The block runs remat.autograd.moe's Function (the
recompute contract is there) through :func:`moe_block`; with ``norm`` given, the pre-norm (the
decoder layer's ``post_attention_layernorm``) is fused in, so the normalized input is never kept.

Hugging Face records router logits with a forward hook on its router class (the model's
``_can_record_outputs``): the block runs inside the router's call, and
:meth:`MoERouter.from_module` builds the router as a subclass of the stock router's class, so
those hooks catch it (output index 0: the logits).
"""

import torch
from torch import nn

from remat import checks
from remat.autograd.moe import EXPERT_RECOMPUTE_MODES, MoEFunction, expert_groups
from remat.backend import resolve_backend
from remat.nn.mlp import activation_of
from remat.nn.norm import RMSNorm
from remat.ops.mlp import ACTIVATIONS, activate
from remat.tiles import resolve_tile_tokens


def _check_norm(norm_weight, eps, x):
    if eps is None:
        if norm_weight is not None:
            raise ValueError("norm_weight is given without eps: pass eps to fuse the RMSNorm")
        return None
    checks.check_vector(norm_weight, "norm_weight", x)
    checks.check_eps(eps)
    return float(eps)


def moe_block(x, w_router, gate_up, down, top_k, *, renormalize, fp32_weights, norm_weight=None, eps=None,
              activation="silu", recompute="block", backend=None, tile_tokens=None):
    """A sparse mixture-of-experts block: router, top-k and experts, with an optional RMSNorm in front.

    ``normed = rmsnorm(x)`` (no norm when eps is None); ``logits = normed Wr^T``; fp32 softmax;
    top-k; the top-k probabilities renormalized to sum 1 when ``renormalize``, kept fp32
    (``fp32_weights``, Mixtral) or cast to x's dtype (Qwen3-MoE); ``out[t] = sum_j weights[t, j]
    * expert_{indices[t, j]}(normed[t])`` with ``expert_e(z) = (act(z Wg^T) * (z Wu^T)) Wd^T``,
    ``Wg = gate_up[e, :I]``, ``Wu = gate_up[e, I:]`` (views), ``Wd = down[e]``. One GEMM per expert
    on its gathered rows; experts that receive no token are skipped.

    Args:
        x: ``[T, H]`` float32, float16 or bfloat16 (any row stride, unit column stride or one copy).
        w_router: ``[E, H]``; gate_up: ``[E, 2I, H]``; down: ``[E, H, I]``; x's dtype and device.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize, fp32_weights: as above (keyword-only, no default: they differ by family).
        norm_weight, eps: the fused RMSNorm's weight ``[H]`` (or None) and epsilon; eps None
            (default) means no norm.
        activation: "silu" (default), "gelu" or "gelu_tanh".
        recompute: "block" (default; keeps x, the fp32 rstd, the indices and weights; backward
            recomputes each expert's gate/up GEMMs) or "activation" (also keeps gate and up of
            every routed row). See remat.autograd.moe for the byte contract.
        backend: remat backend for the norm and activation kernels (the GEMMs are PyTorch's).
        tile_tokens: None (default), an int >= 1 or ``"auto"`` (remat.tiles): both passes run
            over tiles of that many tokens (the normalized rows, each expert's rows and the fp32
            sums one tile at a time; weight gradients summed over the tiles in fp32); with
            ``"activation"`` the kept gate and up of every routed row stay whole (written tile by
            tile).

    Returns:
        (out ``[T, H]`` in x's dtype (weighted products summed in fp32, rounded once), logits
        ``[T, E]`` in x's dtype (differentiable), weights ``[T, top_k]``, indices ``[T, top_k]``
        int64).
    """
    checks.check_input(x)
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    checks.check_choice(recompute, "recompute", EXPERT_RECOMPUTE_MODES)
    checks.check_choice(activation, "activation", ACTIVATIONS)
    checks.check_matrix(w_router, "w_router")
    num_experts, hidden = w_router.shape[0], x.shape[1]
    checks.check_weight(w_router, "w_router", (num_experts, hidden), x)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be a [E, 2I, H] tensor, got {getattr(gate_up, 'shape', type(gate_up))}")
    inter = gate_up.shape[1] // 2
    checks.check_weight(gate_up, "gate_up", (num_experts, 2 * inter, hidden), x)
    checks.check_weight(down, "down", (num_experts, hidden, inter), x)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in 1..{num_experts} (the number of experts), got {top_k!r}")
    eps = _check_norm(norm_weight, eps, x)
    # A tile's working set: per routed row (k per token) the gathered input, gate, up, h and their
    # gradients ((H + 6 I) s), and the fp32 output / input-gradient sums and normalized rows (10 H).
    tile_bytes = top_k * (hidden + 6 * inter) * x.element_size() + 10 * hidden
    tile = resolve_tile_tokens(checks.check_tile_tokens(tile_tokens), x.shape[0], tile_bytes, x.device)
    name = resolve_backend(backend, x)
    return MoEFunction.apply(checks.as_rows(x), norm_weight, w_router, gate_up, down, eps, top_k, bool(renormalize),
                             bool(fp32_weights), activation, recompute, name, tile)


def route(x, w_router, top_k, *, renormalize, fp32_weights):
    """The router alone, in PyTorch: (logits ``[T, E]``, weights ``[T, k]``, indices ``[T, k]``) of
    x ``[T, H]``, as :func:`moe_block` routes (and Hugging Face's TopKRouter)."""
    logits = nn.functional.linear(x, w_router)
    top, indices = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top if fp32_weights else top.to(logits.dtype), indices


class MoERouter(nn.Module):
    """Top-k router with Hugging Face's ``TopKRouter`` parameter ``weight [E, H]``.

    Args:
        hidden, num_experts, top_k: sizes.
        renormalize: rescale the top-k probabilities to sum 1 (Mixtral always; Qwen3-MoE with
            ``norm_topk_prob``).
        fp32_weights: keep the routing weights fp32 (Mixtral) instead of casting them to the
            logits' dtype (Qwen3-MoE).

    ``forward(hidden_states, norm=None, experts=None, recompute=None)``: hidden_states ``[..., H]``
    -> (logits ``[T, E]``, weights ``[T, k]``, indices ``[T, k]``) as Hugging Face's router returns
    them (:func:`route`). With ``experts`` (a :class:`MoEExperts`) the call runs the whole block
    (:func:`moe_block`, one autograd Function) and returns (logits, weights, indices, out ``[T, H]``);
    ``norm`` (a remat RMSNorm module; with experts only) is then fused in front, hidden_states being
    its input. The block runs inside the router's call because Hugging
    Face records router logits with a forward hook on its router class (output index 0), and one
    Function for router and experts lets the norm's backward run once, on their summed gradient.
    """

    def __init__(self, hidden, num_experts, top_k, *, renormalize, fp32_weights, backend=None, device=None,
                 dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype))
        self._configure(num_experts, top_k, renormalize, fp32_weights, backend)

    def _configure(self, num_experts, top_k, renormalize, fp32_weights, backend):
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.renormalize, self.fp32_weights, self.backend = bool(renormalize), bool(fp32_weights), backend

    @classmethod
    def from_module(cls, stock, *, renormalize, fp32_weights, backend=None):
        """A router sharing ``stock.weight`` (a Hugging Face ``TopKRouter``: ``weight [E, H]``,
        ``top_k``). The instance's class is a subclass of both this class and ``type(stock)``, so
        the hooks Hugging Face installs on its router class (``_can_record_outputs``) record this
        router's logits."""
        weight = getattr(stock, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or not hasattr(stock, "top_k"):
            raise TypeError(f"expected a top-k router with a [E, H] weight and top_k, got {type(stock).__name__}")
        recordable = _recordable_class(cls, type(stock))
        module = recordable.__new__(recordable)
        nn.Module.__init__(module)
        module.weight = weight
        module._configure(weight.shape[0], stock.top_k, renormalize, fp32_weights, backend)
        module.train(stock.training)
        return module

    def forward(self, hidden_states, norm=None, experts=None, recompute=None, tile_tokens=None):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        w_router = checks.cast_like(self.weight, x)
        if experts is None:
            if norm is not None:
                raise ValueError("the router fuses a norm only when it runs the experts too (experts=...)")
            return route(x, w_router, self.top_k, renormalize=self.renormalize, fp32_weights=self.fp32_weights)
        norm_weight, eps = (None, None) if norm is None else (checks.vector_like(norm.weight, x), norm.eps_for(x))
        out, logits, weights, indices = moe_block(
            x, w_router, checks.cast_like(experts.gate_up_proj, x), checks.cast_like(experts.down_proj, x),
            self.top_k, renormalize=self.renormalize, fp32_weights=self.fp32_weights, norm_weight=norm_weight,
            eps=eps, activation=experts.activation, recompute=experts.recompute if recompute is None else recompute,
            backend=self.backend, tile_tokens=tile_tokens)
        return logits, weights, indices, out

    def extra_repr(self):
        return (f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
                f"fp32_weights={self.fp32_weights}")

    def __reduce_ex__(self, protocol):
        # A router made by from_module is of a class made at run time (_recordable_class), which
        # pickle cannot find by name: it is saved as the pair of classes it is made from, and loaded
        # as an instance of that pair's class (made again in a new process).
        pair = _RECORDABLE_PAIRS.get(type(self))
        if pair is None:
            return super().__reduce_ex__(protocol)
        return _new_recordable, pair, self.__getstate__()


# (remat class, stock class) -> the class made from them, and back.
_RECORDABLE = {}
_RECORDABLE_PAIRS = {}


def _recordable_class(cls, stock_class):
    """The class ``Remat<stock class name>(cls, stock_class)``, made once per pair: ``cls``'s
    methods first; ``stock_class`` only for isinstance checks (its __init__ is never called)."""
    key = (cls, stock_class)
    if key not in _RECORDABLE:
        made = type(f"Remat{stock_class.__name__}", (cls, stock_class), {"__module__": __name__})
        _RECORDABLE[key], _RECORDABLE_PAIRS[made] = made, key
    return _RECORDABLE[key]


def _new_recordable(cls, stock_class):
    """An empty instance of ``_recordable_class(cls, stock_class)`` (its state is set by pickle)."""
    made = _recordable_class(cls, stock_class)
    return made.__new__(made)


class MoEExperts(nn.Module):
    """The experts of a sparse MoE block with Hugging Face's 3-D Parameters ``gate_up_proj
    [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``.

    Inside :class:`SparseMoE` the experts run fused with the router (:func:`moe_block`, with the
    recompute mode ``recompute``: "block" or "activation"). Alone, ``forward(hidden_states,
    top_k_index, top_k_weights)`` computes Hugging Face's experts forward in PyTorch (hidden_states
    ``[T, H]`` -> ``[T, H]``; one GEMM per expert on its rows, gate/up as views of
    ``gate_up_proj[e]``; the weighted outputs summed in fp32).
    """

    def __init__(self, hidden, intermediate, num_experts, *, activation="silu", recompute="block", backend=None,
                 device=None, dtype=None):
        super().__init__()
        checks.check_choice(activation, "activation", ACTIVATIONS)
        checks.check_choice(recompute, "recompute", EXPERT_RECOMPUTE_MODES)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, device=device,
                                                     dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, device=device, dtype=dtype))
        self.num_experts, self.activation, self.recompute, self.backend = num_experts, activation, recompute, backend

    @classmethod
    def from_module(cls, stock, *, recompute="block", backend=None):
        """Experts sharing ``stock.gate_up_proj`` and ``stock.down_proj`` (no copies, no splits) of a
        Hugging Face experts module (concatenated gate/up layout, not transposed, no biases)."""
        gate_up, down = getattr(stock, "gate_up_proj", None), getattr(stock, "down_proj", None)
        if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter) or gate_up.dim() != 3:
            raise TypeError(f"expected experts with 3-D gate_up_proj and down_proj Parameters, got "
                            f"{type(stock).__name__}")
        for flag, want in (("is_transposed", False), ("has_bias", False), ("is_concatenated", True),
                           ("has_gate", True), ("has_post_expert_norm", False), ("_is_expert_parallel", False)):
            if getattr(stock, flag, want) != want:
                raise ValueError(f"{type(stock).__name__} has {flag}={not want}; remat's experts take the "
                                 "concatenated [E, 2I, H] gate/up layout without biases or post-expert norm, all "
                                 "experts local")
        num_experts, two_inter, hidden = gate_up.shape
        if tuple(down.shape) != (num_experts, hidden, two_inter // 2):
            raise ValueError(f"down_proj must be [E, H, I] = {(num_experts, hidden, two_inter // 2)}, got "
                             f"{tuple(down.shape)}")
        module = cls(hidden, two_inter // 2, num_experts, activation=activation_of(stock.act_fn),
                     recompute=recompute, backend=backend, device="meta")
        module.gate_up_proj, module.down_proj = gate_up, down
        module.train(stock.training)
        return module

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = hidden_states
        gate_up, down = checks.cast_like(self.gate_up_proj, x), checks.cast_like(self.down_proj, x)
        inter, top_k = down.shape[2], top_k_index.shape[1]
        positions, counts = expert_groups(top_k_index, self.num_experts)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            pairs = positions[start:start + count]
            start += count
            if count == 0:
                continue
            rows = pairs // top_k
            gate = nn.functional.linear(x[rows], gate_up[expert, :inter]).float()
            up = nn.functional.linear(x[rows], gate_up[expert, inter:]).float()
            y_e = nn.functional.linear((activate(gate, self.activation) * up).to(x.dtype), down[expert])
            out = out.index_add(0, rows, y_e.float() * top_k_weights.reshape(-1)[pairs, None].float())
        return out.to(x.dtype)


class SparseMoE(nn.Module):
    """A sparse MoE block (Hugging Face's ``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``):
    ``gate`` (:class:`MoERouter`) and ``experts`` (:class:`MoEExperts`), registered in the stock
    block's order so ``state_dict`` keys match.

    ``forward(hidden_states, norm=None, recompute=None)``: ``[B, N, H]`` -> ``[B, N, H]``; with
    ``norm`` hidden_states is that RMSNorm's input (a decoder layer's residual stream), fused into
    the router and the experts. The
    block runs inside the router module's call, so Hugging Face's router-logit hooks fire.
    """

    def __init__(self, hidden, intermediate, num_experts, top_k, *, renormalize, fp32_weights, activation="silu",
                 recompute="block", backend=None, device=None, dtype=None):
        super().__init__()
        self.gate = MoERouter(hidden, num_experts, top_k, renormalize=renormalize, fp32_weights=fp32_weights,
                              backend=backend, device=device, dtype=dtype)
        self.experts = MoEExperts(hidden, intermediate, num_experts, activation=activation, recompute=recompute,
                                  backend=backend, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, stock, *, renormalize, fp32_weights, recompute="block", backend=None):
        """A SparseMoE sharing the router and expert Parameters of a Hugging Face sparse MoE block
        (``gate``, ``experts``). Router jitter noise (Mixtral's ``router_jitter_noise > 0`` in
        training) is refused: it multiplies the input by fresh uniform noise, in place."""
        if getattr(stock, "jitter_noise", 0) and stock.jitter_noise > 0:
            raise ValueError(f"{type(stock).__name__} has router jitter noise ({stock.jitter_noise}), which remat's "
                             "MoE block does not compute")
        for name in ("gate", "experts"):
            if not hasattr(stock, name):
                raise TypeError(f"expected a sparse MoE block with {name}, got {type(stock).__name__}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        for name, _ in stock.named_children():
            if name == "gate":
                module.gate = MoERouter.from_module(stock.gate, renormalize=renormalize, fp32_weights=fp32_weights,
                                                    backend=backend)
            elif name == "experts":
                module.experts = MoEExperts.from_module(stock.experts, recompute=recompute, backend=backend)
        if module.gate.num_experts != module.experts.num_experts:
            raise ValueError(f"the router has {module.gate.num_experts} experts, the experts module "
                             f"{module.experts.num_experts}")
        module.train(stock.training)
        return module

    def forward(self, hidden_states, norm=None, recompute=None, tile_tokens=None):
        checks.check_hidden_states(hidden_states)
        if type(self.experts) is not MoEExperts:
            # A wrapper added after patching (PEFT's target_parameters LoRA: a ParamWrapper) would
            # change the expert weights in ways the fused block does not compute.
            raise ValueError(f"the experts module is a {type(self.experts).__name__}, not remat's MoEExperts (an "
                             "adapter added after remat.patch?); call remat.unpatch(model), add the adapter, and "
                             "patch again (such layers are then left stock)")
        *_, out = self.gate(hidden_states, norm=norm, experts=self.experts, recompute=recompute,
                            tile_tokens=tile_tokens)
        return out.view(hidden_states.shape)

    def saved_bytes_per_token(self, element_size, recompute="block"):
        """Bytes the block keeps per token with a fused norm (remat.autograd.moe's contract):
        ``sH + 4 + k(8 + w)``, plus ``2 I k s`` with ``recompute="activation"``; s the activation
        element size, w the routing weights' (4 when fp32, else s)."""
        hidden = self.gate.weight.shape[1]
        top_k, inter = self.gate.top_k, self.experts.down_proj.shape[2]
        weight_size = 4 if self.gate.fp32_weights else element_size
        block = element_size * hidden + 4 + top_k * (8 + weight_size)
        return block + (2 * inter * top_k * element_size if recompute == "activation" else 0)


class MoELayerMixin:
    """The MoE half of a remat decoder layer (mixed in before a :class:`remat.nn.PreNormDecoderLayer`
    subclass whose ``mlp`` is a :class:`SparseMoE`): ``mlp_block(h) = mlp(h, norm=post_attention_layernorm)``
    with the layer policy's recompute mode for the experts ("activation" under "speed", else "block").

    Bytes kept per token (element size s, h hidden, I expert intermediate, k experts per token, w
    the routing weights' element size, Hq / Hkv heads of dim D): the attention sub-block's, as in
    remat.nn.LlamaLayer (x, o, lse, rstd; q, k, v unless "memory"), plus the MoE block's
    ``sh + 4 + k(8 + w)`` (its input h, the fp32 rstd, int64 indices, weights):

    - ``"memory"``: ``s(2h + Hq D) + 4 Hq + 8 + k(8 + w)``;
    - ``"balanced"``: ``s(2h + 2 Hq D + 2 Hkv D) + 4 Hq + 8 + k(8 + w)``;
    - ``"speed"``: balanced ``+ 2 I k s`` (every routed row's gate and up).
    """

    def _build_moe_parts(self, hidden, intermediate, num_experts, top_k, eps, *, renormalize, fp32_weights, policy,
                         backend, device, dtype):
        """Sets ``mlp`` (a :class:`SparseMoE` with the family's routing), the two RMSNorms, policy and
        backend; the layer's ``__init__`` builds ``self_attn`` first (the submodules' order)."""
        self.mlp = SparseMoE(hidden, intermediate, num_experts, top_k, renormalize=renormalize,
                             fp32_weights=fp32_weights, backend=backend, device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype, backend=backend)
        self.post_attention_layernorm = RMSNorm(hidden, eps, device=device, dtype=dtype, backend=backend)
        self.policy, self.backend = policy, backend

    @classmethod
    def _from_hf_parts(cls, stock, *, attention, sparse_moe, rms_norm, policy, backend):
        """A layer sharing every Parameter (no copy) of the Hugging Face decoder layer ``stock``:
        each of its sub-modules converted by the family's builder (``attention``, ``sparse_moe``,
        ``rms_norm``; each called as ``builder(stock_part, backend=backend)``)."""
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(stock, name):
                raise TypeError(f"from_module expects a decoder layer with {name}, got {type(stock).__name__}")
        module = cls._empty(policy, backend)
        module.self_attn = attention(stock.self_attn, backend=backend)
        module.mlp = sparse_moe(stock.mlp, backend=backend)
        module.input_layernorm = rms_norm(stock.input_layernorm, backend=backend)
        module.post_attention_layernorm = rms_norm(stock.post_attention_layernorm, backend=backend)
        module.train(stock.training)
        return module

    def mlp_block(self, h):
        return self.mlp(h, norm=self.post_attention_layernorm, recompute=self.mlp_recompute,
                        tile_tokens=self.tile_tokens)

    def saved_bytes_per_token(self, element_size):
        """Bytes this layer keeps for backward per token under its policy (the formulas above);
        without the per-call extras (16 bytes of RNG state with attention dropout, the rope tables)."""
        attn = self.self_attn
        hidden = attn.q_proj.in_features
        q_width, kv_width = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        attention = element_size * (hidden + q_width) + 4 * attn.num_heads + 4  # x, o, lse, rstd
        if self.policy != "memory":
            attention += element_size * (q_width + 2 * kv_width)
        return attention + self.mlp.saved_bytes_per_token(element_size, self.mlp_recompute)
