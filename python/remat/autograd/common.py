"""Pieces the autograd Functions share: the refusal of double backward, linear-layer gradients,
the RNG state for Philox dropout, and the rotary tables in the kernels' layout."""

import contextlib
import functools
import threading

import torch

# Seeds and offsets are drawn below 2^62, so offset + counter never wraps a uint64.
_RNG_BOUND = 2**62


def refuse_double_backward(op_name, graph_inputs=None):
    """Decorates the ``backward`` of a remat autograd Function that is differentiable once only.

    remat's backward passes run fused kernels (and recompute from saved statistics that carry no
    graph), so a graph built through them would give second-order gradients that are missing or
    wrong. As with torch.autograd.function.once_differentiable, the backward runs under no_grad
    and, when grad mode is on at its entry (``create_graph=True``), the gradients it returns are
    handed out through an autograd node that raises a RuntimeError naming ``op_name`` if, and only
    if, a second backward reaches it. First-order gradients are the same with or without
    ``create_graph``.

    Unlike once_differentiable, that node's edges lead to what the gradients depend on: the
    incoming gradients and the saved tensors that require grad (a saved input leads to its
    producer; a saved output to this Function's node and so to every input), plus
    ``graph_inputs(ctx)`` for a Function whose gradients depend on inputs it does not save. So
    ``torch.autograd.grad(penalty, inputs)``, which runs only the nodes on a path to ``inputs``,
    reaches it too (once_differentiable's node hangs off fresh leaves and is skipped there, the
    second-order term silently dropped). Where none of them requires grad, the gradients are
    constants and are returned as they are.

    Traced by torch.compile: dynamo traces an autograd Function's backward with grad mode off, so
    the wrapper there is the plain backward (and AOT autograd refuses double backward itself), run
    on views of the saved tensors that keep the compiler from merging its recomputation into the
    forward (:func:`distinct_from_forward`).
    The decorated backward carries ``double_backward_refused = op_name`` (tests check that every
    Function of the package has it)."""
    message = (
        f"{op_name} does not support double backward (differentiating its gradients, as a gradient "
        "penalty or a Hessian-vector product does): its fused backward gives first-order gradients "
        "only. Run this part of the computation on stock PyTorch for higher-order gradients (the "
        "stock function or module instead of remat's, or remat.unpatch(model) for a patched model)."
    )

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            if torch.compiler.is_compiling():
                return backward(_SavedOnce(ctx, distinct_from_forward(ctx.saved_tensors)), *grad_outputs)
            if not torch.is_grad_enabled():
                return backward(ctx, *grad_outputs)
            ctx = _SavedOnce(ctx)
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            sources = (*grad_outputs, *ctx.saved_tensors, *(graph_inputs(ctx) if graph_inputs else ()))
            return _delay_error(grads, message, [t for t in sources if isinstance(t, torch.Tensor) and t.requires_grad])

        wrapper.double_backward_refused = op_name
        return wrapper

    return decorate


def distinct_from_forward(saved):
    """The saved tensors as a traced backward should read them: each tensor as a view of itself
    (same sizes, strides and offset; no copy), None and non-tensors as they are.

    Under torch.compile the backward is traced into one joint graph with the forward, and AOT
    autograd's common-subexpression pass merges nodes with the same op and inputs before the
    partitioner splits the graph. A backward that recomputes (the norm of the saved x, the gate/up
    GEMMs of it, a rotation, a dropout mask from the saved Philox state) repeats the forward's ops
    on the same inputs, so without this the recomputation is merged into the forward and the
    partitioner keeps its results for backward: the intermediates remat exists not to keep (a
    patched Llama's MLP gate/up and q/k/v, measured). A fresh view is a node of its own that the
    pass cannot merge, so everything computed from it stays in the backward; inductor's no-op
    removal drops alias, clone and same-shape view but not as_strided (torch 2.14).
    tests/test_compile_saved.py checks the compiled step keeps what the eager one does."""
    return tuple([t.as_strided(t.shape, t.stride()) if isinstance(t, torch.Tensor) else t for t in saved])


class _SavedOnce:
    """The ctx a refusing backward runs with: ``saved_tensors`` unpacked once, shared by the backward
    and the wrapper (unpack hooks may allow one unpack: torch.utils.checkpoint's non-reentrant
    hooks raise on a second); every other attribute read from and written to the real ctx.
    ``saved`` replaces the unpacked tensors (a traced backward's views)."""

    def __init__(self, ctx, saved=None):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved_tensors", ctx.saved_tensors if saved is None else saved)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def _delay_error(grads, message, sources):
    """``grads`` (a tensor or a tuple with Nones) with every tensor replaced by an alias whose
    grad_fn raises ``message`` when backpropagated through, and whose edges lead to ``sources``;
    ``grads`` unchanged without sources."""
    single = not isinstance(grads, tuple)
    items = (grads,) if single else grads
    positions = [i for i, g in enumerate(items) if isinstance(g, torch.Tensor)]
    if not positions or not sources:
        return grads
    # One output per input; the outputs of the sources only give the node its edges.
    errors = torch._C._functions.DelayedError(message, len(positions) + len(sources))(
        *[items[i] for i in positions], *sources)
    items = list(items)
    for i, g in zip(positions, errors):
        items[i] = g
    return items[0] if single else tuple(items)


# Tiles a loop keeps at its start and at its end when an estimate runs with sparse tiles
# (sparse_tiles): the first allocates the loop's whole-sequence buffers and accumulators, the second
# holds the first's leftovers (a tile's outputs live until the next tile's replace them); at the end
# the widest tiles (the causal attention's last keys) with a full tile's leftovers, walked either way.
_SPARSE_START, _SPARSE_END = 2, 3
_sparse = threading.local()


@contextlib.contextmanager
def sparse_tiles():
    """For the block's duration (on this thread), :func:`sequence_tiles` (and LoRA's row chunks)
    list only the first :data:`_SPARSE_START` and the last :data:`_SPARSE_END` tiles of a long
    sequence: what remat.planning.composed's estimate runs on fake tensors. Every tiled loop
    allocates its whole-sequence tensors at its first tile and holds per tile a working set that is
    the same for every tile or grows with the tile's place (the causal attention's keys), plus the
    previous tile's leftovers, so the most bytes alive in a loop are reached in those tiles; the
    middle ones repeat them (tested against the whole loops, tests/test_estimate_composed.py).
    Never on real tensors: the skipped tiles are not computed."""
    previous = getattr(_sparse, "on", False)
    _sparse.on = True
    try:
        yield
    finally:
        _sparse.on = previous


def sequence_tiles(rows, tile):
    """[(start, end)] tiles of ``tile`` rows over ``rows`` (the last one shorter): one whole tile
    for tile 0 / None (untiled) or tile >= rows. Under :func:`sparse_tiles` the middle tiles of a
    long list are left out."""
    if not tile or tile >= rows:
        return [(0, rows)]
    return [(start, min(start + tile, rows)) for start in loop_starts(range(0, rows, tile))]


def loop_starts(starts):
    """``starts`` (a range of tile or chunk starts), or under :func:`sparse_tiles` its first
    :data:`_SPARSE_START` and last :data:`_SPARSE_END` alone when it is longer: for every loop over
    row tiles or chunks whose per-iteration bytes are alike."""
    if getattr(_sparse, "on", False) and len(starts) > _SPARSE_START + _SPARSE_END:
        return [*starts[:_SPARSE_START], *starts[-_SPARSE_END:]]
    return starts


def into_rows(whole, part, start, rows):
    """Writes a tile's rows ``part`` (from row ``start``) of a kept tensor into ``whole``, made as
    ``rows`` rows like ``part`` when None (at the first tile); returns ``whole`` (None for a None
    part; an empty part, such as a norm's absent mean, is returned as it is)."""
    if part is None:
        return None
    if whole is None:
        whole = part.new_empty(rows, *part.shape[1:]) if part.numel() else part
    if part.numel():
        whole[start:start + part.shape[0]] = part
    return whole


def tiled_rows_backward(x, tiles, needs_dx, grad_dtypes, rows_backward):
    """A row-wise Function's backward over ``tiles`` (remat.autograd.common.sequence_tiles):
    ``rows_backward(start, end)`` returns the Function's gradient tuple for those rows, the input
    rows' gradient first. That one is written tile by tile into a whole ``[rows, ...]`` tensor like
    ``x`` (when ``needs_dx``); every other gradient is summed over the tiles in fp32 and rounded
    once to its entry of ``grad_dtypes`` (None entries: no gradient)."""
    dx = torch.empty_like(x) if needs_dx else None
    sums = None
    for start, end in tiles:
        grads = rows_backward(start, end)
        if dx is not None:
            dx[start:end] = grads[0]
        tile_sums = [None if g is None else g.float() for g in grads[1:]]
        del grads
        sums = tile_sums if sums is None else [a if b is None else a.add_(b) for a, b in zip(sums, tile_sums,
                                                                                             strict=True)]
        del tile_sums
    return (dx, *(None if grad is None else grad.to(dtype) for grad, dtype in zip(sums, grad_dtypes, strict=True)))


def linear_grads(grad_out, inp, weight, needs_input, needs_weight, needs_bias):
    """Gradients of out = inp W^T + b for 2-D grad_out [rows, out], inp [rows, in], weight
    [out, in]: (d_inp, dW, db), None where not needed."""
    d_inp = grad_out @ weight if needs_input else None
    d_weight = grad_out.t() @ inp if needs_weight else None
    d_bias = grad_out.sum(0) if needs_bias else None
    return d_inp, d_weight, d_bias


def draw_rng_state(device):
    """(seed, offset) as an int64 [2] tensor drawn from PyTorch's generator for ``device``: no host
    sync, reproducible under torch.manual_seed, and replayed by checkpointing's RNG restore."""
    return torch.randint(0, _RNG_BOUND, (2,), dtype=torch.int64, device=device)


def kernel_rope_tables(cos, sin, head_dim):
    """The caller's rotary tables in the layout the attention kernels take: cos/sin as given
    ([S, D/2], [B, S, D/2], or Hugging Face's [.., S, D] with equal halves, of which the first is
    used) -> fp32 contiguous [1 or B, S, D/2]; (None, None) without rope. Made per call (forward
    and backward), never saved: the caller's tables are."""
    if cos is None:
        return None, None
    tables = []
    for table in (cos, sin):
        table = table[..., : head_dim // 2]
        if table.dim() == 2:
            table = table[None]
        tables.append(table.to(torch.float32).contiguous())
    return tables[0], tables[1]


def zero_empty_queries_(o, empty):
    """Sets, in place, the rows of attention output o ``[..., H, D]`` at the queries ``empty`` marks
    (bool, o's leading shape, or None) to 0: queries that attend to nothing (pads), as PyTorch's SDPA
    gives a query whose keys are all masked. Returns o."""
    if empty is not None:
        o.masked_fill_(empty.reshape(*o.shape[:-2], 1, 1), 0)
    return o


def without_empty_queries(dout, empty):
    """The incoming gradient dout of an attention output with the rows of ``empty`` queries set to 0
    (their outputs are the constant 0, so no gradient flows back from them); dout itself when
    ``empty`` is None."""
    return dout if empty is None else dout.masked_fill(empty.reshape(*dout.shape[:-2], 1, 1), 0)
