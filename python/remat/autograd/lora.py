"""LoRA branches inside the fused Functions: ``y = base(x) + sum_a scale_a * B_a(A_a(drop_a(x)))``,
with PEFT's arithmetic (peft 0.21 ``lora.Linear.forward``): x is cast to each adapter's dtype, each
branch is computed in that dtype, the branches are added to the base output (type promotion: an
fp32 adapter on a bf16 model adds in fp32) and the sum is rounded once to the base output's dtype.
One difference: PEFT reassigns x to each adapter's cast in its loop, so with several active
adapters of different dtypes on one projection a later adapter sees x already rounded by an
earlier, lower-precision one; here each adapter casts the original x (the same or more accurate).

Recompute contract (DESIGN.md section 2, "projection with LoRA"): a branch keeps nothing per token.
Its rank-r intermediate ``A(drop(x))`` is recomputed in backward from x (which the enclosing
Function keeps or recomputes anyway) and its dropout mask from a 16-byte Philox (seed, offset)
pair drawn per adapter per call; neither is ever stored.

The adapters of one fused block are passed to its Function as a flat tuple of tensors (A ``[r,
in]``, B ``[out, r]``, B's bias ``[out]`` or None, per adapter) after a static layout, a tuple of
:class:`LoRASlot` (which projection each adapter belongs to, its scale and dropout probability),
so autograd returns their gradients like any other input.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from remat.autograd.common import draw_rng_state, loop_starts, refuse_double_backward
from remat.ops import ops_for

TENSORS_PER_ADAPTER = 3


class LoRAAdapter(NamedTuple):
    """One LoRA adapter of a projection, as the public fused functions take it: ``a`` ``[r, in]``,
    ``b`` ``[out, r]`` (nn.Linear layout), ``bias`` ``[out]`` or None (PEFT's ``lora_bias``),
    ``scaling`` (alpha / r, or alpha / sqrt(r) with rsLoRA) and ``dropout_p`` (0 when not
    training)."""

    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None
    scaling: float
    dropout_p: float = 0.0


class LoRASlot(NamedTuple):
    """The static part of one adapter inside a fused Function: ``target`` indexes the block's
    projections (attention: 0 q, 1 k, 2 v; MLP: 0 gate, 1 up, 2 down)."""

    target: int
    scaling: float
    dropout_p: float


def flatten(adapters_per_target):
    """``[[LoRAAdapter, ...] per projection]`` -> (layout: tuple of LoRASlot, flat tensors)."""
    layout, tensors = [], []
    for target, adapters in enumerate(adapters_per_target):
        for adapter in adapters or ():
            layout.append(LoRASlot(target, float(adapter.scaling), float(adapter.dropout_p)))
            tensors.extend((adapter.a, adapter.b, adapter.bias))
    return tuple(layout), tuple(tensors)


def draw_rngs(layout, device):
    """One (seed, offset) pair per adapter with dropout (None for the others)."""
    return [draw_rng_state(device) if slot.dropout_p > 0 else None for slot in layout]


def _adapter(tensors, index):
    return tensors[TENSORS_PER_ADAPTER * index: TENSORS_PER_ADAPTER * (index + 1)]


# The branches run over row chunks whose fp32 temporaries (x cast to the adapter's dtype, the
# scaled gradient of the output, the input gradient before its cast) take at most this many bytes
# each: PEFT's arithmetic makes [rows, features] fp32 copies for fp32 adapters on a bf16 model,
# 6 GiB per projection at 400K tokens and hidden 4096. Rows are independent, so the results are
# the same; weight gradients are summed over the chunks in fp32.
CHUNK_BYTES = 256 * 2**20


def _row_chunks(rows, width):
    """[(start, end)] row chunks of a [rows, width] fp32 temporary of at most CHUNK_BYTES, a
    multiple of 4 rows each (Philox draws four elements per call: a chunk's mask starts on a
    call)."""
    chunk = max(4, CHUNK_BYTES // (4 * max(width, 1)) // 4 * 4)
    if rows <= chunk:
        return [(0, rows)]
    return [(start, min(start + chunk, rows)) for start in loop_starts(range(0, rows, chunk))]


def _shifted(rng, elements):
    """The Philox state of the element ``elements`` places into a mask: counter + elements / 4."""
    if rng is None or elements == 0:
        return rng
    if elements % 4:
        raise ValueError(f"a LoRA dropout mask can be split only on a multiple of 4 elements, got {elements}")
    return rng + torch.tensor([0, elements // 4], dtype=rng.dtype, device=rng.device)


def _dropped(x, slot, rng, backend, row_offset=0):
    """x (rows ``row_offset`` on of the projection's input) cast to the adapter's dtype, dropped out
    with the adapter's Philox mask."""
    if rng is None:
        return x
    rng = _shifted(rng, row_offset * x.shape[1])
    return ops_for("dropout", backend).philox_dropout(x.contiguous(), rng, slot.dropout_p)


def _targets(layout, target):
    return [index for index, slot in enumerate(layout) if slot.target == target]


def add_branches(base, x, target, layout, tensors, rngs, backend, row_offset=0):
    """base ``[rows, out]`` + the branches of the adapters of projection ``target`` on x ``[rows,
    in]``, rounded once to base's dtype (PEFT's order of operations); base itself without any.
    ``row_offset``: where x's rows start in the call's rows (for the dropout masks of a tile)."""
    indices = _targets(layout, target)
    if not indices:
        return base
    rows = x.shape[0]
    chunks = _row_chunks(rows, max(x.shape[1], base.shape[1]))
    out = base if len(chunks) == 1 else torch.empty_like(base)
    for start, end in chunks:
        result = base[start:end]
        for index in indices:
            a, b, bias = _adapter(tensors, index)
            dropped = _dropped(x[start:end].to(a.dtype), layout[index], rngs[index], backend, row_offset + start)
            result = result + F.linear(F.linear(dropped, a), b, bias) * layout[index].scaling
        if len(chunks) == 1:
            return result.to(base.dtype)
        out[start:end] = result
    return out


def branch_input_grad(grad, x_dtype, target, layout, tensors, rngs, backend, row_offset=0):
    """The part of the branches' backward that needs no input: grad ``[rows, out]`` (of the rounded
    sum, in base's dtype) -> (d x summed over the adapters of projection ``target``, in
    ``x_dtype``, or None without adapters; {adapter index: d intermediate} for
    :func:`branch_weight_grads`)."""
    indices = _targets(layout, target)
    if not indices:
        return None, {}
    width = max(grad.shape[1], _adapter(tensors, indices[0])[0].shape[1])
    d_intermediates = intermediate_grads(grad, target, layout, tensors, width)
    chunks = _row_chunks(grad.shape[0], width)
    d_x = None
    for start, end in chunks:
        d_x_chunk = None
        for index, d_intermediate in d_intermediates.items():
            slot, a = layout[index], _adapter(tensors, index)[0]
            d_dropped = d_intermediate[start:end] @ a
            if rngs[index] is not None:
                rng = _shifted(rngs[index], (row_offset + start) * a.shape[1])
                d_dropped = ops_for("dropout", backend).philox_dropout(d_dropped.contiguous(), rng, slot.dropout_p)
            d_dropped = d_dropped.to(x_dtype)
            d_x_chunk = d_dropped if d_x_chunk is None else d_x_chunk + d_dropped
            del d_dropped
        if len(chunks) == 1:
            return d_x_chunk, d_intermediates
        if d_x is None:
            d_x = d_x_chunk.new_empty(grad.shape[0], d_x_chunk.shape[1])
        d_x[start:end] = d_x_chunk
    return d_x, d_intermediates


def branch_weight_grads(grad, x, d_intermediates, layout, tensors, rngs, needs, backend, row_offset=0):
    """The adapters' gradients {flat tensor index: gradient} for the adapters in
    ``d_intermediates`` (from :func:`branch_input_grad`), x ``[rows, in]`` their projection's input
    (kept or recomputed by the caller). The dropped input and the rank-r intermediate are
    recomputed here; ``needs`` holds the needs_input_grad flags of the flat tensors."""
    grads = {}
    if not d_intermediates:
        return grads
    chunks = _row_chunks(x.shape[0], max(x.shape[1], grad.shape[1]))
    for start, end in chunks:
        for index, d_intermediate in d_intermediates.items():
            slot = layout[index]
            a, b, bias = _adapter(tensors, index)
            first = TENSORS_PER_ADAPTER * index
            dropped = _dropped(x[start:end].to(a.dtype), slot, rngs[index], backend, row_offset + start)
            d_branch = grad[start:end].to(b.dtype) * slot.scaling
            parts = {}
            if needs[first]:
                parts[first] = d_intermediate[start:end].t() @ dropped
            if needs[first + 1]:
                parts[first + 1] = d_branch.t() @ F.linear(dropped, a)
            if bias is not None and needs[first + 2]:
                parts[first + 2] = d_branch.sum(0)
            del dropped, d_branch
            for key, part in parts.items():
                if len(chunks) == 1:
                    grads[key] = part
                elif key in grads:
                    grads[key] += part.float()
                else:
                    grads[key] = part.float()
    if len(chunks) > 1:
        dtypes = {TENSORS_PER_ADAPTER * i + j: t.dtype for i in d_intermediates for j, t in
                  enumerate(_adapter(tensors, i)) if t is not None}
        grads = {key: grad_.to(dtypes[key]) for key, grad_ in grads.items()}
    return grads


def branch_grads(grad, x, target, layout, tensors, rngs, needs, backend, row_offset=0):
    """Both parts of the backward of projection ``target``'s branches: (d x or None, {flat tensor
    index: gradient})."""
    d_x, d_intermediates = branch_input_grad(grad, x.dtype, target, layout, tensors, rngs, backend, row_offset)
    return d_x, branch_weight_grads(grad, x, d_intermediates, layout, tensors, rngs, needs, backend, row_offset)


def output_slice(layout, tensors, target, rows):
    """The flat tensors with the B and bias of projection ``target``'s adapters cut to the output
    features ``rows`` (a slice of B's rows): the branches of that slice of the projection's output,
    for :func:`add_branches` and :func:`branch_grads` (A and the rank-r intermediate are whole)."""
    sliced = list(tensors)
    for index in _targets(layout, target):
        first = TENSORS_PER_ADAPTER * index
        sliced[first + 1] = tensors[first + 1][rows]
        if tensors[first + 2] is not None:
            sliced[first + 2] = tensors[first + 2][rows]
    return tuple(sliced)


def intermediate_grads(grad, target, layout, tensors, chunk_width=None):
    """{adapter index: the gradient of its rank-r intermediate ``[rows, r]`` (in B's dtype)} for the
    adapters of projection ``target`` from the gradient of its output grad ``[rows, out]``, over row
    chunks of ``[rows, chunk_width]`` fp32 temporaries (default: the gradient's width), the first
    half of :func:`branch_input_grad`."""
    d_intermediates = {}
    for index in _targets(layout, target):
        slot, b = layout[index], _adapter(tensors, index)[1]
        chunks = _row_chunks(grad.shape[0], chunk_width or max(grad.shape[1], b.shape[1]))
        if len(chunks) == 1:
            d_intermediates[index] = (grad.to(b.dtype) * slot.scaling) @ b
            continue
        whole = d_intermediates[index] = grad.new_empty(grad.shape[0], b.shape[1], dtype=b.dtype)
        for start, end in chunks:
            whole[start:end] = (grad[start:end].to(b.dtype) * slot.scaling) @ b
    return d_intermediates


def add_input_grad_columns(into, d_intermediates, columns, layout, tensors, rngs, backend):
    """Adds the input features ``columns`` (a slice) of the branches' input gradient into ``into``
    ``[rows, width of columns]``, in place: ``d_intermediate @ A[:, columns]``, through the dropout
    mask of those features (made for whole rows of a row chunk at a time: a mask element's Philox
    counter follows its place in the row-major input), summed over the adapters in
    ``d_intermediates`` (from :func:`intermediate_grads`)."""
    for index, d_intermediate in d_intermediates.items():
        slot, a = layout[index], _adapter(tensors, index)[0]
        for start, end in _row_chunks(into.shape[0], a.shape[1]):
            if rngs[index] is None:
                part = d_intermediate[start:end] @ a[:, columns]
            else:
                rng = _shifted(rngs[index], start * a.shape[1])
                part = ops_for("dropout", backend).philox_dropout((d_intermediate[start:end] @ a).contiguous(), rng,
                                                                  slot.dropout_p)[:, columns]
            into[start:end] += part.to(into.dtype)


class SlicedBranchGrads:
    """The backward of the LoRA branches of projections whose output gradient arrives in slices of
    output features, one at a time (the head chunks of sequence-parallel attention,
    remat.autograd.norm_attention_parallel): the rank-r intermediate ``A(drop(x))`` of each adapter is made
    once from x (the same for every slice), each slice's gradient gives its rows of B's and the
    bias's gradients and adds into the gradient of the intermediate (fp32, ``[rows, r]``), and
    :meth:`finish` makes A's gradient and the input gradient once, from x again. So x (the
    normalized input, ``[rows, in]``) is needed twice per call, never while slices arrive, and no
    ``[rows, in]`` input-gradient term is made per slice. ``targets``: the projections (of the
    layout) that read x. Row chunks as :func:`branch_grads`'s."""

    def __init__(self, x, layout, tensors, rngs, needs, backend, targets):
        self.layout, self.tensors, self.rngs, self.needs, self.backend = layout, tensors, rngs, needs, backend
        self.intermediates, self.d_intermediates, self.grads = {}, {}, {}
        self.chunks = _row_chunks(x.shape[0], x.shape[1])
        for index in (i for target in targets for i in _targets(layout, target)):
            slot, a = layout[index], _adapter(tensors, index)[0]
            h = x.new_empty(x.shape[0], a.shape[0], dtype=a.dtype)
            for start, end in self.chunks:
                h[start:end] = F.linear(_dropped(x[start:end].to(a.dtype), slot, rngs[index], backend, start), a)
            self.intermediates[index] = h

    def __bool__(self):
        return bool(self.intermediates)

    def _add(self, key, rows, part):
        if key not in self.grads:
            self.grads[key] = torch.zeros(self.tensors[key].shape, dtype=torch.float32, device=part.device)
        self.grads[key][rows] += part

    def add_slice(self, grad, target, rows):
        """grad ``[rows, features]``: the gradient of projection ``target``'s output features
        ``rows`` (a slice)."""
        for index in _targets(self.layout, target):
            slot, first = self.layout[index], TENSORS_PER_ADAPTER * index
            _, b, bias = _adapter(self.tensors, index)
            b_rows = b[rows]
            d_intermediate = self.d_intermediates.get(index)
            if d_intermediate is None:
                d_intermediate = self.d_intermediates[index] = grad.new_zeros(grad.shape[0], b.shape[1],
                                                                              dtype=torch.float32)
            for start, end in _row_chunks(grad.shape[0], max(grad.shape[1], b.shape[1])):
                d_branch = grad[start:end].to(b.dtype) * slot.scaling
                d_intermediate[start:end] += d_branch @ b_rows
                if self.needs[first + 1]:
                    self._add(first + 1, rows, d_branch.t() @ self.intermediates[index][start:end])
                if bias is not None and self.needs[first + 2]:
                    self._add(first + 2, rows, d_branch.sum(0))

    def finish(self, x, d_x):
        """Adds the branches' input gradient into ``d_x`` ``[rows, in]`` (in place, row chunk by
        row chunk) and returns {flat tensor index: gradient} in the tensors' dtypes; x as given to
        the constructor (recomputed by the caller)."""
        for index, d_intermediate in self.d_intermediates.items():
            slot, first = self.layout[index], TENSORS_PER_ADAPTER * index
            a = _adapter(self.tensors, index)[0]
            for start, end in self.chunks:
                d_int = d_intermediate[start:end].to(a.dtype)
                if self.needs[first]:
                    dropped = _dropped(x[start:end].to(a.dtype), slot, self.rngs[index], self.backend, start)
                    self._add(first, slice(None), d_int.t() @ dropped)
                    del dropped
                d_dropped = d_int @ a
                if self.rngs[index] is not None:
                    rng = _shifted(self.rngs[index], start * a.shape[1])
                    d_dropped = ops_for("dropout", self.backend).philox_dropout(d_dropped.contiguous(), rng,
                                                                                slot.dropout_p)
                d_x[start:end] += d_dropped.to(d_x.dtype)
        return {key: grad.to(self.tensors[key].dtype) for key, grad in self.grads.items()}


def grads_tuple(grads, count):
    """The flat tensors' gradients in input order (None where not computed)."""
    return tuple(grads.get(i) for i in range(count))


class LoRALinearFunction(torch.autograd.Function):
    """y = x W^T + b + LoRA branches: a projection with adapters on its own (o_proj). Saves x (the
    attention output, which the attention sub-block keeps anyway: the same storage counts once)
    and 16 bytes of RNG state per adapter with dropout; backward recomputes each rank-r
    intermediate. x rows [R, in]; a frozen W (requires_grad False) gets no weight-gradient GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, layout, backend, *tensors):
        rngs = draw_rngs(layout, x.device)
        y = add_branches(F.linear(x, weight, bias), x, 0, layout, tensors, rngs, backend)
        ctx.save_for_backward(x, weight, bias, *tensors, *rngs)
        ctx.layout, ctx.backend = layout, backend
        return y

    @staticmethod
    @refuse_double_backward("remat.lora_linear")
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        x, weight, bias = saved[:3]
        count = TENSORS_PER_ADAPTER * len(ctx.layout)
        tensors, rngs = saved[3:3 + count], saved[3 + count:]
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        d_x_lora, grads = branch_grads(dy, x, 0, ctx.layout, tensors, rngs, need[5:], ctx.backend)
        dx = dy @ weight if need[0] else None
        if need[0] and d_x_lora is not None:
            dx = dx + d_x_lora
        dw = dy.t() @ x if need[1] else None
        db = dy.sum(0) if bias is not None and need[2] else None
        return (dx, dw, db, None, None, *grads_tuple(grads, count))
