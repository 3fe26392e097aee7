"""The pre-norm decoder layer that remat's model families share:

    o = norm_attention(x)                    (norm, q/k/v projections, rope, flash attention)
    h = x + dropout(out_proj(o))
    y = h + dropout(mlp_block(h))            (a fused pre-norm MLP sub-block)

A family (remat.models.<family>) subclasses :class:`PreNormDecoderLayer` with its parameter
layout: what the attention sub-block is given (:meth:`attention_output`), the output projection
(:meth:`out_proj`) and the MLP sub-block (:meth:`mlp_block`). The policy decides what the two
fused sub-blocks keep for backward, the same way for every family.

``out_proj`` and ``mlp_block`` return what is added to the residual stream, so a family whose
sub-blocks end in a norm before the residual add (Gemma's "sandwich" post-norms) applies it there:
``h = x + dropout(post_norm(out_proj(o)))``.
"""

import functools
import warnings

import torch
import torch.utils.checkpoint
from torch import nn

from remat import checks, functional
from remat.functional.attention import attention_tile_unsupported_reason
from remat.hf import given_cache, refuse_static_cache, run_stock_layer
from remat.offload import offload_scope
from remat.options import AttentionOptions
from remat.sequence_parallel import sequence_parallel_layout
from remat.sequences import OFFSET_ARGUMENTS, pack_sequences, sequence_layout, unpack_sequences

LAYER_POLICIES = ("speed", "balanced", "memory")


def check_runnable(module):
    """Raises ValueError when remat's kernels cannot run ``module`` (a fused layer or part built by a
    family's ``from_module``, sharing the stock module's Parameters), which would otherwise fail at
    its first forward: a floating-point Parameter of a dtype the kernels do not take (float64;
    remat.checks.SUPPORTED_DTYPES, as remat.checks.check_input checks inputs), or an attention head
    dim (a ``head_dim`` attribute of the module or a submodule) outside 1..remat.checks.MAX_HEAD_DIM,
    the range remat's attention checks at call time. remat.patch calls it on every module it builds,
    leaving the stock module in place with the reason."""
    for name, parameter in module.named_parameters():
        if parameter.is_floating_point() and parameter.dtype not in checks.SUPPORTED_DTYPES:
            raise ValueError(f"parameter {name} is {parameter.dtype}; remat's kernels run float32, float16 and "
                             "bfloat16")
    for name, submodule in module.named_modules():
        head_dim = getattr(submodule, "head_dim", None)
        if isinstance(head_dim, int) and not 1 <= head_dim <= checks.MAX_HEAD_DIM:
            raise ValueError(f"{name or type(module).__name__} has head dim {head_dim}; remat's attention takes head "
                             f"dims 1..{checks.MAX_HEAD_DIM}")


# The reasons a tiled layer's attention ran untiled that have been warned about (once each).
_UNTILED_ATTENTION_WARNED = set()


class PreNormDecoderLayer(nn.Module):
    """Base of the fused decoder layers. Subclasses set ``policy`` (one of :data:`LAYER_POLICIES`),
    ``backend`` and ``resid_dropout`` (a probability applied in training, default 0) and implement
    the three hooks below.

    Policies (what the fused sub-blocks keep; the norms, rope, the attention probabilities and the
    MLP activation are always recomputed):

    - ``"speed"``: q, k, v and the MLP's pre-activations: no GEMM is recomputed.
    - ``"balanced"``: q, k, v; the MLP's first GEMM(s) are recomputed from its input.
    - ``"memory"``: neither; the q/k/v projections are recomputed too.

    Gradient checkpointing of the whole layer: set ``layer.gradient_checkpointing = True`` (what
    Hugging Face's ``model.gradient_checkpointing_enable()`` does on a patched model, and what
    remat's planner does per layer). Then, in training mode with grad enabled, the layer keeps only
    its input hidden states (plus the position ids or rope tables the caller passes) and re-runs its
    fused forward in backward, under ``layer._gradient_checkpointing_func`` (default
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, which restores the RNG state, so
    dropout masks and gradients are bitwise those of the run without it). Hugging Face's
    ``every_n_layers`` counts remat's layers once remat.patch has replaced them (see there).

    Host offload: ``remat.patch(model, offload=True)`` sets ``_offload`` (a shared
    remat.offload.HostOffload) and ``_offload_index`` (the layer's place in forward order); the
    layer's forward then saves to host memory (see remat.offload).

    Sequence parallelism: ``remat.patch(model, sequence_parallel=group)`` sets
    ``sequence_parallel`` (a remat.sequence_parallel.SequenceGroup); the layer then takes this rank's shard of the
    sequence (with its ``position_ids``, required) and its attention runs over the group's shards
    (remat.sequence_parallel).
    """

    _offload = None
    sequence_parallel = None
    _offload_index = 0
    # remat.patch(tile_tokens=T): the MLP sub-block runs over tiles of T tokens (remat.norm_mlp, norm_gelu_mlp),
    # and so does the attention sub-block where it can (attention_tile_arguments).
    tile_tokens = None

    resid_dropout = 0.0
    # Gradient checkpointing of the whole layer (Hugging Face's attribute names, so that
    # model.gradient_checkpointing_enable() / _disable() and TrainingArguments(gradient_checkpointing=True)
    # reach it; remat's planner sets the flag per layer too). When True, in training mode with grad
    # enabled, the layer runs under _gradient_checkpointing_func: it keeps only its input and re-runs
    # the fused forward in backward (once: the layer handles the flag itself and is no
    # GradientCheckpointingLayer, whose forward wrapper would checkpoint a second time).
    gradient_checkpointing = False
    _gradient_checkpointing_func = staticmethod(functools.partial(torch.utils.checkpoint.checkpoint,
                                                                  use_reentrant=False))

    @classmethod
    def _empty(cls, policy, backend):
        """An instance without submodules, for ``from_module`` to fill with the stock layer's (shared)
        modules and parameters."""
        checks.check_choice(policy, "policy", LAYER_POLICIES)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.policy, module.backend = policy, backend
        return module

    @property
    def keeps_qkv(self):
        """Whether the attention sub-block keeps q, k, v (policies speed and balanced)."""
        return self.policy != "memory"

    @property
    def mlp_recompute(self):
        """The MLP sub-block's recompute mode: "activation" (speed) or "block"."""
        return "activation" if self.policy == "speed" else "block"

    def attention_output(self, x, position_ids, position_embeddings, layout=None):
        """o ``[B, N, Hq, D]`` of the attention sub-block (through functional.norm_attention with
        ``keep_qkv=self.keeps_qkv``). ``layout``: None, or x's remat.sequences.SequenceLayout (x is
        then one packed row ``[1, T, hidden]``, or ``[B, N, hidden]`` with pads); pass it on as
        norm_attention's keyword arguments, remat.sequences.varlen_arguments(layout)."""
        raise NotImplementedError

    def attention_tile_arguments(self, layout, causal, window, dropout_p):
        """functional.norm_attention's ``tile_tokens`` keyword for this call: ``{"tile_tokens": T}``
        when the layer is tiled and the call can run over query tiles (causal, a sliding window
        too, dense rows, or packed rows outside torch.compile, no attention dropout), else ``{}``;
        a tiled layer whose attention cannot be tiled warns once per reason (its MLP stays
        tiled)."""
        if not self.tile_tokens:
            return {}
        left, right = checks.window_bounds(window, causal)
        reason = attention_tile_unsupported_reason(AttentionOptions(1.0, 0.0, left, right, float(dropout_p)),
                                                   layout is not None and layout.cu_seqlens is not None)
        if layout is not None and layout.sequence_parallel is not None:
            reason = "sequence parallelism does not tile it"
        if reason is None:
            return {"tile_tokens": self.tile_tokens}
        if reason not in _UNTILED_ATTENTION_WARNED:
            _UNTILED_ATTENTION_WARNED.add(reason)
            warnings.warn(f"remat: tile_tokens={self.tile_tokens}: the attention sub-block of {type(self).__name__} "
                          f"runs untiled ({reason}); its MLP is tiled", stacklevel=3)
        return {}

    def out_proj(self, o):
        """The attention output projection of o ``[B, N, Hq * D]``: what is added to the residual
        stream (a family's post-norm included)."""
        raise NotImplementedError

    def fused_out_projection(self, layout):
        """The output projection (remat.nn.adapters.Projection) that :meth:`attention_output`
        fuses into its call for ``layout`` (it then takes ``out_projection=`` and returns what
        :meth:`out_proj` would), or None: :meth:`out_proj` runs after it. A family fuses where
        functional.norm_attention takes ``w_o`` (sequence parallelism, policy "memory") and its
        out_proj is the projection alone; none does by default."""
        return None

    def mlp_block(self, h):
        """The MLP sub-block's output for the residual stream h (pre-norm included, and a family's
        post-norm; through functional.norm_mlp or norm_gelu_mlp with
        ``recompute=self.mlp_recompute``)."""
        raise NotImplementedError

    def _dropout(self, t):
        if self.resid_dropout == 0:
            return t
        return functional.dropout(t, self.resid_dropout, self.training, backend=self.backend)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        """hidden_states ``[B, N, hidden]`` -> ``[B, N, hidden]``, causal (and the family's sliding
        window).

        Args:
            attention_mask: None, or a 2-D ``[B, N]`` padding mask (1 real token, 0 pad, anywhere in
                a row): the real tokens of each row then attend as one sequence (see
                :func:`sequence_layout`) and no real token sees a pad. A pad's attention output is
                0, the rest of the layer runs on it as on a real token: stock's SDPA output at a pad
                before a row's first real token (left padding), so every position matches stock
                there. A pad after a real token (right padding, holes), which SDPA attends to the
                real tokens before it, differs from stock at that position only. Other masks raise
                ValueError.
            position_ids: ``[B or 1, N]`` positions for the built-in rope tables; positions that
                restart (packed rows) split a row into sequences that attend only within
                themselves.
            position_embeddings: ``(cos, sin)`` from a Hugging Face rotary module, overriding the
                built-in tables.
            kwargs: Hugging Face's ``cu_seq_lens_q/k``, ``max_length_q/k`` (packed rows, B = 1); a
                KV cache (``cache`` / ``past_key_values``): the layer then runs the Hugging Face
                module remat.patch replaced (hf.run_stock_layer), which appends to the cache and
                attends through remat's attention (generation); in training mode with grad enabled a
                cache raises ValueError (pass ``use_cache=False``). Other Hugging Face arguments
                (``use_cache``, ...) are ignored.
        """
        cache = given_cache(kwargs)
        if cache is not None:
            if self.sequence_parallel is not None:
                # The stock layer would attend within this rank's shard only: wrong, silently.
                raise ValueError("a layer patched with sequence_parallel takes no KV cache (generation attends "
                                 "within each rank's shard): pass use_cache=False, or unpatch the model "
                                 "(remat.unpatch) to generate")
            refuse_static_cache(cache)
            given = dict(attention_mask=attention_mask, position_ids=position_ids,
                         position_embeddings=position_embeddings)
            return run_stock_layer(self, hidden_states, **{k: v for k, v in given.items() if v is not None}, **kwargs)
        x = hidden_states
        checks.check_hidden_states(x)
        checks.check_input(x)
        batch, n, hidden = x.shape
        offsets = {k: kwargs.get(k) for k in OFFSET_ARGUMENTS}
        if self.sequence_parallel is None:
            layout = sequence_layout(batch, n, attention_mask, position_ids, **offsets)
        else:  # the whole sequence's layout, gathered from the group's shards
            layout = sequence_parallel_layout(batch, n, attention_mask, position_ids, self.sequence_parallel, offsets)
        # With host offload (remat.patch(offload=True)) what the layer saves, its input alone under
        # checkpointing (saved outside the checkpointed function), goes to host memory.
        with offload_scope(self._offload, self._offload_index):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # Positional arguments only: a reentrant checkpoint function sees only those as inputs.
                return self._gradient_checkpointing_func(self._fused_forward, x, position_ids, position_embeddings,
                                                         layout)
            return self._fused_forward(x, position_ids, position_embeddings, layout)

    def _fused_forward(self, x, position_ids, position_embeddings, layout=None):
        """x ``[B, N, hidden]`` -> ``[B, N, hidden]``: the attention sub-block over ``layout`` (packed
        when it has offsets), then the residual adds and the MLP over the ``[B, N]`` tokens, pads
        included (their attention output is 0, their output projection out_proj(0), as stock's)."""
        batch, n, _ = x.shape
        fused = self.fused_out_projection(layout)
        fused_argument = {} if fused is None else {"out_projection": fused}
        if layout is None or layout.cu_seqlens is None:
            o = self.attention_output(x, position_ids, position_embeddings, layout, **fused_argument)
            attended = o if fused is not None else self.out_proj(o.reshape(batch, n, -1))
        else:
            packed, position_ids, position_embeddings = pack_sequences(x, position_ids, position_embeddings, layout)
            o = self.attention_output(packed, position_ids, position_embeddings, layout, **fused_argument)
            # The projection runs in packed order (it keeps the attention's own o for backward);
            # its output, which nothing keeps, goes back to the [B, N] places.
            attended = unpack_sequences(o if fused is not None else self.out_proj(o.reshape(1, packed.shape[1], -1)),
                                        layout, batch, n)
        h = x + self._dropout(attended)
        # What the projection returned dies before the MLP runs (o lives on only where it is saved).
        del o, attended
        return h + self._dropout(self.mlp_block(h))
