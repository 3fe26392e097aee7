"""How a ``[B, N]`` batch's attention runs: dense, or as packed variable-length sequences (padding
masks, packed rows with restarting positions, Hugging Face's ``cu_seq_lens_q/k``), and which
queries attend to nothing (pads). The fused decoder layers (remat.nn.layers), remat's attention
modules and the Hugging Face attention function (remat.hf) read the layout here; of remat this
module imports only remat.checks.
"""

import warnings
import weakref
from typing import NamedTuple

import torch
from torch import nn

from remat.checks import values_unknown

# Set on a model patched with sequence_parallel (remat.replacement): its sequences are sharded over
# ranks, its forward requires position_ids, and remat.estimate passes them. Kept here, below both
# remat.sequence_parallel and remat.planning.estimator (which the former asks whether a step is estimated).
SEQUENCE_PARALLEL_FLAG = "_remat_sequence_parallel"

# Hugging Face's keyword arguments for packed rows (DataCollatorWithFlattening(return_flash_attn_kwargs=True),
# TRL's padding_free): int32 offsets and the longest sequence, as FlashAttention's varlen functions take them.
OFFSET_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class SequenceLayout(NamedTuple):
    """How a ``[B, N]`` batch's attention runs: as packed sequences (one row ``[1, T]``,
    variable-length attention), or dense with pads.

    ``tokens``: int64 ``[T]`` flat indices into the ``B * N`` tokens, in packed order, or None when
    all ``B * N`` tokens run in order. With a padding mask every token is packed, row by row: the
    row's real tokens (one sequence), then its pads (another, possibly empty). ``cu_seqlens``:
    int32 ``[S + 1]`` offsets of the sequences in the packed row, or None when the attention runs
    dense (right padding only, in eager). ``max_seqlen``: the longest sequence (an upper bound),
    None when dense. ``empty``: bool, True at the queries that attend to nothing, in the
    attention's token order (``[1, T]`` packed, ``[B, N]`` dense), or None without pads: pads,
    whose attention output is 0 as PyTorch's SDPA gives a query whose keys are all masked (they
    run attention among themselves, whose result is replaced; no real token sees a pad)."""

    tokens: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int | None
    empty: torch.Tensor | None = None
    # Under sequence parallelism (remat.sequence_parallel): (process group, its size P); the
    # attention then runs over the P ranks' shards, and cu_seqlens are offsets of the whole sequence.
    sequence_parallel: tuple | None = None


def sequence_layout(batch, n, attention_mask=None, position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                    max_length_q=None, max_length_k=None):
    """The :class:`SequenceLayout` of a ``[B, N]`` batch, or None when every row is one causal
    sequence from its first token without pads (the dense path). In order of precedence:

    - ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (Hugging Face's packed-row arguments; B must be 1, both
      equal: self-attention, from 0 to N): those sequences. A padding mask with a pad besides them
      raises ValueError (an all-ones mask is accepted).
    - a 2-D ``attention_mask`` ``[B, N]`` with a 0 before a 1 in some row (left padding, holes):
      each row's real tokens (1s) form one sequence; pads are left out of the attention, as
      FlashAttention-2's unpadding does (so a sliding window counts real tokens). ``position_ids``
      only place the rope then. Right padding alone runs dense (``cu_seqlens`` None): under a
      causal mask no real token sees a later pad. Either way ``pads`` marks the pads, whose
      attention output is 0.
    - ``position_ids`` ``[B or 1, N]`` that do not step by one (packed rows, as Hugging Face's
      ``find_packed_sequence_indices``): a sequence starts at each row start and wherever a
      position is not the previous one plus one.

    Finding the layout reads the mask or positions on the host (one sync per model forward: the
    result is reused while the same, unchanged tensors come back, as they do layer after layer).
    Under torch.compile, and on fake tensors (no values), nothing is read on the host (no graph
    break): a padding mask gives a layout
    of fixed shape (two sequences per row: its real tokens, then its pads, whose attention among
    themselves is computed and replaced by 0), and positions are checked in the graph only: packed
    rows under compile need ``cu_seq_lens_q/k`` (a restart without them fails an in-graph
    assertion)."""
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        refuse_offsets_with_padding(attention_mask)
        return _offsets_layout(batch, n, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, n):
            raise ValueError(f"attention_mask must be None or a 2-D [B, N] = [{batch}, {n}] padding mask (1 = real "
                             f"token, 0 = pad), got {getattr(attention_mask, 'shape', type(attention_mask).__name__)};"
                             " 4-D and custom masks (prefix-LM, block masks) are not supported")
        if values_unknown(attention_mask):
            return _padding_layout(attention_mask.to(torch.bool), n)
    elif position_ids is None:
        return None
    elif values_unknown(position_ids):
        torch._assert_async(~_position_restarts(position_ids, batch, n).any(),
                            "packed rows (position_ids restarting) under torch.compile need Hugging Face's "
                            "cu_seq_lens_q/k arguments (DataCollatorWithFlattening(return_flash_attn_kwargs=True))")
        return None
    return _remembered(attention_mask, position_ids, batch, n, padding_or_position_layout)


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


def _position_restarts(position_ids, batch, n):
    positions = position_ids.expand(batch, n) if position_ids.dim() == 2 else position_ids[None].expand(batch, n)
    return positions[:, 1:] != positions[:, :-1] + 1


def padding_or_position_layout(mask, position_ids, batch, n):
    if mask is not None:
        real = mask.to(torch.bool)
        if bool((real[:, 1:] & ~real[:, :-1]).any()):  # a pad before a real token: left padding, holes
            _warn_about_holes(real)
            lengths = real.sum(1)
            return _padding_layout(real, max(int(lengths.max()), n - int(lengths.min()), 1))
        if not bool(real.all()):
            # Right padding only: the dense causal path, where no real token sees a later pad.
            return SequenceLayout(None, None, None, ~real)
    if position_ids is None:
        return None
    restarts = _position_restarts(position_ids, batch, n)
    if not bool(restarts.any()):
        return None
    starts = torch.cat([restarts.new_ones(batch, 1), restarts], 1).flatten()
    cu_seqlens = torch.cat([starts.nonzero().flatten(), starts.new_tensor([batch * n], dtype=torch.long)])
    return SequenceLayout(None, cu_seqlens.to(torch.int32), int(cu_seqlens.diff().max()))


def _padding_layout(real, max_seqlen):
    """The packed layout of a padding mask ``real`` (bool ``[B, N]``), with shapes that do not depend
    on the mask (under torch.compile no host read, no graph break): all B * N tokens, 2 * B
    sequences: each row's real tokens in order (one sequence), then that row's pads (another,
    possibly empty: the pads attend causally to the row's earlier pads only, never to a real token,
    and no real token sees them; ``empty`` marks them, so their attention output is 0). The token
    order is a stable argsort of the pad flag within each row, so T = B * N and the offsets hold
    2B + 1 values: ``b * N``, ``b * N + real tokens of row b``, ... ``B * N``. ``max_seqlen``: an
    upper bound of the sequence lengths (N under torch.compile)."""
    batch, n = real.shape
    row_starts = torch.arange(batch, device=real.device) * n
    tokens = (torch.argsort((~real).to(torch.int8), dim=1, stable=True) + row_starts[:, None]).flatten()
    lengths = real.sum(1)
    offsets = torch.stack([row_starts + lengths, row_starts + n], 1).flatten()
    empty = torch.arange(n, device=real.device)[None] >= lengths[:, None]
    return SequenceLayout(tokens, nn.functional.pad(offsets, (1, 0)).to(torch.int32), max_seqlen,
                          empty.reshape(1, batch * n))


_HOLES_WARNED = []


def _warn_about_holes(real):
    """Warns once per process when a row has a pad between two real tokens (a hole). PyTorch's SDPA
    attends such a pad to the real tokens before it; remat's attention output there is 0, so the
    logit at a hole's last pad (which predicts the real token after the hole) differs from stock's."""
    if _HOLES_WARNED:
        return
    real_before = real.cumsum(1) > 0
    real_after = real.flip(1).cumsum(1).flip(1) > 0
    if bool((~real & real_before & real_after).any()):
        _HOLES_WARNED.append(True)
        warnings.warn("attention_mask has a pad between real tokens (a hole): remat gives that pad's attention "
                      "output 0, where stock's SDPA attends it to the real tokens before it, so the logit at the "
                      "hole's last pad differs from stock's; label the token after a hole -100 (the pads' own "
                      "labels are -100 already) for stock's loss", stacklevel=2)


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


def varlen_arguments(layout):
    """remat.norm_attention's keyword arguments for a layer input laid out by ``layout`` (a
    :class:`SequenceLayout` or None): ``cu_seqlens`` and ``max_seqlen`` when it is packed,
    ``empty_queries`` when it has pads."""
    if layout is None:
        return {}
    given = {} if layout.cu_seqlens is None else {"cu_seqlens": layout.cu_seqlens, "max_seqlen": layout.max_seqlen}
    if layout.sequence_parallel is not None:
        given["sequence_parallel"] = layout.sequence_parallel[0]
    return given if layout.empty is None else {**given, "empty_queries": layout.empty}


def refuse_offsets_with_padding(attention_mask):
    """Hugging Face's ``cu_seq_lens_q/k`` describe a packed row without pads: given with a 2-D
    padding mask that has a pad (a 0), raises ValueError (in eager; under torch.compile an
    in-graph assertion, as the mask cannot be read on the host). An all-ones mask is accepted."""
    if attention_mask is None:
        return
    message = ("cu_seq_lens_q/k (packed rows) cannot be combined with an attention_mask that has padding: pass "
               "the packed row without pads and without a mask (or an all-ones mask)")
    if torch.compiler.is_compiling():
        torch._assert_async(attention_mask.to(torch.bool).all(), message)
    elif not bool(attention_mask.to(torch.bool).all()):
        raise ValueError(message)


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


def unpack_sequences(y, layout, batch, n):
    """The packed row y ``[1, T, ...]`` in ``[B, N, ...]`` places (the inverse of
    :func:`pack_sequences`; a padding layout holds every token, so every place is written)."""
    if layout.tokens is None:
        return y.view(batch, n, *y.shape[2:])
    rows = y.new_zeros(batch * n, *y.shape[2:])
    return rows.index_copy(0, layout.tokens, y[0]).view(batch, n, *y.shape[2:])
