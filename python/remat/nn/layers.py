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
import weakref
from typing import NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn

from remat import checks, functional
from remat.models.hf import given_cache, refuse_offsets_with_padding, refuse_static_cache, run_stock_layer

LAYER_POLICIES = ("speed", "balanced", "memory")
# Hugging Face's keyword arguments for packed rows (DataCollatorWithFlattening(return_flash_attn_kwargs=True),
# TRL's padding_free): int32 offsets and the longest sequence, as FlashAttention's varlen functions take them.
OFFSET_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class SequenceLayout(NamedTuple):
    """How a ``[B, N]`` batch runs as packed sequences (one row ``[1, T]``, variable-length attention).

    ``tokens``: int64 ``[T]`` flat indices into the ``B * N`` tokens, in packed order (the real
    tokens, row by row; under torch.compile each row's real tokens then its pads), or None when all ``B * N``
    tokens run in order. ``cu_seqlens``: int32
    ``[S + 1]`` offsets of the sequences in the packed row. ``max_seqlen``: the longest sequence
    (an upper bound)."""

    tokens: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_seqlen: int


def sequence_layout(batch, n, attention_mask=None, position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                    max_length_q=None, max_length_k=None):
    """The :class:`SequenceLayout` of a ``[B, N]`` batch, or None when every row is one causal
    sequence from its first token (the dense path). In order of precedence:

    - ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (Hugging Face's packed-row arguments; B must be 1, both
      equal: self-attention, from 0 to N): those sequences. A padding mask with a pad besides them
      raises ValueError (an all-ones mask is accepted).
    - a 2-D ``attention_mask`` ``[B, N]`` with a 0 before a 1 in some row (left padding, holes):
      each row's real tokens (1s) form one sequence; pads are left out, as FlashAttention-2's
      unpadding does (so a sliding window counts real tokens). ``position_ids`` only place the
      rope then. Right padding alone runs dense (None): under a causal mask no real token sees a
      later pad.
    - ``position_ids`` ``[B or 1, N]`` that do not step by one (packed rows, as Hugging Face's
      ``find_packed_sequence_indices``): a sequence starts at each row start and wherever a
      position is not the previous one plus one.

    Finding the layout reads the mask or positions on the host (one sync per model forward: the
    result is reused while the same, unchanged tensors come back, as they do layer after layer).
    Under torch.compile nothing is read on the host (no graph break): a padding mask gives a layout
    of fixed shape (two sequences per row: its real tokens, then its pads, which attend only to the
    row's pads; their outputs are computed and returned at the pad positions, see
    :meth:`PreNormDecoderLayer.forward`), and
    positions are checked in the graph only: packed rows under compile need ``cu_seq_lens_q/k``
    (a restart without them fails an in-graph assertion)."""
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        refuse_offsets_with_padding(attention_mask)
        return _offsets_layout(batch, n, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, n):
            raise ValueError(f"attention_mask must be None or a 2-D [B, N] = [{batch}, {n}] padding mask (1 = real "
                             f"token, 0 = pad), got {getattr(attention_mask, 'shape', type(attention_mask).__name__)};"
                             " 4-D and custom masks (prefix-LM, block masks) are not supported")
        if torch.compiler.is_compiling():
            return _padding_layout_static(attention_mask.to(torch.bool))
    elif position_ids is None:
        return None
    elif torch.compiler.is_compiling():
        torch._assert_async(~_position_restarts(position_ids, batch, n).any(),
                            "packed rows (position_ids restarting) under torch.compile need Hugging Face's "
                            "cu_seq_lens_q/k arguments (DataCollatorWithFlattening(return_flash_attn_kwargs=True))")
        return None
    return _remembered(attention_mask, position_ids, batch, n, _padding_or_position_layout)


_LAST_LAYOUT = {}


def _remembered(mask, position_ids, batch, n, compute):
    """compute(mask, position_ids, batch, n), reused while the same tensors (same version) return."""
    if any(t is not None and t.is_inference() for t in (mask, position_ids)):
        return compute(mask, position_ids, batch, n)  # inference tensors have no version counter
    key = [(batch, n)]
    for t in (mask, position_ids):
        key.append(None if t is None else (id(t), t._version))
    key = tuple(key)
    last = _LAST_LAYOUT.get("entry")
    if last is not None and last[0] == key and all(r is None or r() is t for r, t in
                                                   zip(last[1], (mask, position_ids), strict=True)):
        return last[2]
    layout = compute(mask, position_ids, batch, n)
    refs = tuple(None if t is None else weakref.ref(t) for t in (mask, position_ids))
    _LAST_LAYOUT["entry"] = (key, refs, layout)
    return layout


def _offsets(lengths):
    return nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def _position_restarts(position_ids, batch, n):
    positions = position_ids.expand(batch, n) if position_ids.dim() == 2 else position_ids[None].expand(batch, n)
    return positions[:, 1:] != positions[:, :-1] + 1


def _padding_or_position_layout(mask, position_ids, batch, n):
    if mask is not None:
        real = mask.to(torch.bool)
        if bool((real[:, 1:] & ~real[:, :-1]).any()):  # a pad before a real token: left padding, holes
            return _padding_layout(real)
        if not bool(real.all()):
            # Right padding only: the dense causal path, where no real token sees a later pad (the
            # pads' own outputs, which nothing reads, differ from the packed path's).
            return None
    if position_ids is None:
        return None
    restarts = _position_restarts(position_ids, batch, n)
    if not bool(restarts.any()):
        return None
    starts = torch.cat([restarts.new_ones(batch, 1), restarts], 1).flatten()
    cu_seqlens = torch.cat([starts.nonzero().flatten(), starts.new_tensor([batch * n], dtype=torch.long)])
    return SequenceLayout(None, cu_seqlens.to(torch.int32), int(cu_seqlens.diff().max()))


def _padding_layout(real):
    lengths = real.sum(1)
    return SequenceLayout(real.flatten().nonzero().flatten(), _offsets(lengths), max(int(lengths.max()), 1))


def _padding_layout_static(real):
    """The padding layout with shapes that do not depend on the mask (for torch.compile: no host
    read, no graph break): all B * N tokens, 2 * B sequences: each row's real tokens in order (one
    sequence), then that row's pads (another, possibly empty: the pads attend causally to the
    row's earlier pads only, never to a real token, and no real token sees them). The token order
    is a stable argsort of the pad flag within each row, so T = B * N and the offsets hold 2B + 1
    values: ``b * N``, ``b * N + real tokens of row b``, ... ``B * N``."""
    batch, n = real.shape
    row_starts = torch.arange(batch, device=real.device) * n
    tokens = (torch.argsort((~real).to(torch.int8), dim=1, stable=True) + row_starts[:, None]).flatten()
    real_ends = row_starts + real.sum(1)
    offsets = torch.stack([real_ends, row_starts + n], 1).flatten()
    return SequenceLayout(tokens, nn.functional.pad(offsets, (1, 0)).to(torch.int32), n)


def _offsets_layout(batch, n, cu_q, cu_k, max_q, max_k):
    if cu_q is None or cu_k is None:
        raise ValueError("packed rows need both cu_seq_lens_q and cu_seq_lens_k")
    if batch != 1:
        raise ValueError(f"cu_seq_lens_q/k describe one packed row: hidden_states must be [1, T, hidden], got "
                         f"B={batch}")
    if cu_q.shape != cu_k.shape:
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be equal (self-attention over packed rows), got shapes "
                         f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    if cu_q.dim() != 1 or cu_q.numel() < 2:
        raise ValueError(f"cu_seq_lens_q/k must be 1-D offsets [S + 1] with S >= 1, got shape {tuple(cu_q.shape)}")
    # Checked before anything indexes with them (positions from the offsets use N as output size).
    spans = f"cu_seq_lens_q/k must run from 0 to the row length N = {n}"
    if torch.compiler.is_compiling():
        torch._assert_async((cu_q == cu_k).all(), "cu_seq_lens_q and cu_seq_lens_k must be equal")
        torch._assert_async((cu_q[0] == 0) & (cu_q[-1] == n), spans)
    elif not torch.equal(cu_q, cu_k):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be equal (self-attention over packed rows)")
    elif int(cu_q[0]) != 0 or int(cu_q[-1]) != n:
        raise ValueError(f"{spans}, got {int(cu_q[0])} to {int(cu_q[-1])}")
    longest = max_q if max_q is not None else max_k
    longest = n if longest is None else int(longest)
    return SequenceLayout(None, cu_q.to(torch.int32), longest)


def varlen_arguments(sequences):
    """functional.norm_attention's keyword arguments for ``sequences`` (see
    PreNormDecoderLayer.attention_output): none, or ``cu_seqlens`` and ``max_seqlen``."""
    if sequences is None:
        return {}
    return {"cu_seqlens": sequences[0], "max_seqlen": sequences[1]}


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
    """

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

    def attention_output(self, x, position_ids, position_embeddings, sequences=None):
        """o ``[B, N, Hq, D]`` of the attention sub-block (through functional.norm_attention with
        ``keep_qkv=self.keeps_qkv``). ``sequences``: None, or ``(cu_seqlens, max_seqlen)`` when x is
        one packed row ``[1, T, hidden]`` (pass them as norm_attention's ``cu_seqlens`` /
        ``max_seqlen``: :func:`varlen_arguments`)."""
        raise NotImplementedError

    def out_proj(self, o):
        """The attention output projection of o ``[B, N, Hq * D]``: what is added to the residual
        stream (a family's post-norm included)."""
        raise NotImplementedError

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
                a row): the real tokens of each row then run as one packed sequence (see
                :func:`sequence_layout`). What pad positions return (nothing real reads them, and
                their outputs reach no loss): in eager, their input unchanged when the row has a
                pad before a real token (left padding, holes), and the dense causal layer's output
                with right padding only; under torch.compile, the layer's output over the row's
                pads attending only to the row's pads. Other masks raise ValueError.
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
            refuse_static_cache(cache)
            given = dict(attention_mask=attention_mask, position_ids=position_ids,
                         position_embeddings=position_embeddings)
            return run_stock_layer(self, hidden_states, **{k: v for k, v in given.items() if v is not None}, **kwargs)
        x = hidden_states
        checks.check_hidden_states(x)
        checks.check_input(x)
        batch, n, hidden = x.shape
        layout = sequence_layout(batch, n, attention_mask, position_ids, **{k: kwargs.get(k) for k in OFFSET_ARGUMENTS})
        sequences = None
        if layout is not None:
            x, position_ids, position_embeddings = pack_sequences(x, position_ids, position_embeddings, layout)
            sequences = (layout.cu_seqlens, layout.max_seqlen)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # Positional arguments only: a reentrant checkpoint function sees only those as inputs.
            y = self._gradient_checkpointing_func(self._fused_forward, x, position_ids, position_embeddings, sequences)
        else:
            y = self._fused_forward(x, position_ids, position_embeddings, sequences)
        # Pads left out of the layout (eager) keep their input; under compile the layout holds them
        # (as sequences of pads) and they take those outputs. No real token reads them either way.
        return y if layout is None else unpack_sequences(y, layout, hidden_states)

    def _fused_forward(self, x, position_ids, position_embeddings, sequences=None):
        batch, n, _ = x.shape
        o = self.attention_output(x, position_ids, position_embeddings, sequences)
        h = x + self._dropout(self.out_proj(o.reshape(batch, n, -1)))
        return h + self._dropout(self.mlp_block(h))


def pack_sequences(x, position_ids, position_embeddings, layout):
    """x ``[B, N, h]``, its positions and rope tables as one packed row ``[1, T, ...]`` in the
    layout's token order: per-token positions (``[1, T]``) and per-token rope tables
    (``[1, T, D or D/2]``)."""
    batch, n, hidden = x.shape

    def packed(t):
        t = t.reshape(batch * n, *t.shape[2:])
        return (t if layout.tokens is None else t[layout.tokens])[None]

    if position_ids is None and position_embeddings is None:
        if layout.tokens is None:  # offsets without positions: positions restart in every sequence
            lengths = layout.cu_seqlens.diff().long()
            starts = layout.cu_seqlens[:-1].long().repeat_interleave(lengths, output_size=batch * n)
            position_ids = (torch.arange(batch * n, device=x.device) - starts)[None]
        else:  # Hugging Face's training positions: 0 .. N - 1 in every row, pads included
            position_ids = torch.arange(n, device=x.device)[None]
    if position_ids is not None:
        position_ids = position_ids if position_ids.dim() == 2 else position_ids[None]
        position_ids = packed(position_ids.expand(batch, n))
    if position_embeddings is not None:
        position_embeddings = tuple(packed(t.expand(batch, n, t.shape[-1])) for t in position_embeddings)
    return packed(x), position_ids, position_embeddings


def unpack_sequences(y, layout, like):
    """The packed row y ``[1, T, h]`` back in ``like``'s ``[B, N, ...]`` places (the inverse of
    :func:`pack_sequences`); tokens left out of the layout (pads) take ``like``'s values there."""
    batch, n = like.shape[:2]
    if layout.tokens is None:
        return y.view(batch, n, *y.shape[2:])
    rows = like.reshape(batch * n, *like.shape[2:])
    return rows.index_copy(0, layout.tokens, y[0].to(rows.dtype)).view(batch, n, *y.shape[2:])
