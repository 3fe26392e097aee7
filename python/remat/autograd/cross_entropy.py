"""The output block: linear (lm_head) + cross-entropy as one autograd Function that never stores
the logits.

Recompute contract (DESIGN.md section 2), asserted byte for byte in tests/test_cross_entropy.py:

- saved: x [T, H] (the caller's rows, in x's dtype: s*H bytes per token), the caller's int64
  target [T] (8 bytes per token) and one fp32 logsumexp per token (4 bytes); weight and bias are
  saved too but are parameters and live anyway. Saved bytes = T * (s*H + 12).
- recomputed in backward: the logits, one vocabulary chunk [T, C] at a time (the same GEMM in x's
  dtype as the forward, so the same rounding), their softmax from the saved lse, and the chunk's
  logit gradient; from it the chunk's rows of dW and db and its term of dx. Neither pass ever
  holds a [T, V] tensor: no temporary is larger than one chunk of logits in fp32 ([T, C], 4TC
  bytes; measured in tests/test_cross_entropy.py), other than [T, H]-shaped ones (dx's fp32
  accumulator; on a GPU with 16-bit inputs also one chunk's fp32 dx term) and the gradients.
- the forward computes no gradient (design (b), dx and dW in the forward as Liger does, would
  save dx and keep dW; it is not offered): the backward's extra cost is one more GEMM of logits,
  4 GEMMs of T*V*H against eager's 3.

Chunk size: :func:`chunk_size` (the rule is stated there), fixed at the forward and reused by the
backward.

Token tiles (``tile``, remat.patch(tile_tokens=T)): both passes run the op on rows [a, a + T) at a
time, so the in-op working set (a chunk of logits, the fp32 dx accumulator and product, all
[tile, *]) is bounded by the tile instead of the sequence; loss and lse rows are written into the
[T] outputs and dx rows into one [T, H] gradient. dW and db, which every tile adds to, are summed
over the tiles in fp32 (an fp32 [V, H] buffer while the lm_head trains; none under LoRA) and
rounded once, after each tile's own rounding in the op. Saved tensors are unchanged.

Inputs are already 2-D: x [T, H] with unit column stride, target [T] (remat.functional reshapes).
"""

import math
import os

import torch

from remat.autograd.common import refuse_double_backward, sequence_tiles
from remat.backend import simulated_capability
from remat.ops import ops_for

REDUCTIONS = ("mean", "sum", "none")

# Bytes one chunk of fp32 logits [T, C] may take, before the free-memory limit: large enough that
# each chunk's GEMMs are large (T x C x H), small next to the [T, V] logits it replaces.
CHUNK_BYTES = {"cuda": 256 * 2**20, "cpu": 64 * 2**20}
# Never more than this fraction of the free device memory.
FREE_MEMORY_FRACTION = 8
# Chunks hold at least this many vocabulary columns (GEMM efficiency; for T past
# CHUNK_BYTES / (4 * 256) tokens a chunk is then larger than CHUNK_BYTES) and are rounded up to a
# multiple of COLUMN_ALIGN.
MIN_CHUNK_COLUMNS = 256
COLUMN_ALIGN = 128


@torch.compiler.assume_constant_result
def free_memory_bytes(device_type, index):
    """Free memory of the device now: cudaMemGetInfo's free bytes on a GPU (no stream sync), the
    kernel's MemAvailable on the CPU; None where unknown (a simulated GPU: remat.estimate).
    torch.compile evaluates it once, when it traces the call."""
    if device_type == "cuda":
        if simulated_capability() is not None:
            return None
        return torch.cuda.mem_get_info(index)[0]
    if device_type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


def chunk_size(tokens, vocab, device, budget_bytes=None):
    """Vocabulary columns per chunk, C, for T = ``tokens`` rows and V = ``vocab`` classes.

    Rule: a chunk of fp32 logits [T, C] may take ``budget_bytes``, by default
    min(CHUNK_BYTES[device type] (256 MiB on a GPU, 64 MiB on the CPU), free memory / 8); so
    C = budget / (4 T), at least MIN_CHUNK_COLUMNS (256) and at most V. The chunks are then
    balanced: with n = ceil(V / C) chunks, C = ceil(V / n) rounded up to a multiple of 128 (at most
    V), so that the last chunk is not a sliver. E.g. on a GPU with T = 8192: C = 8192, and
    V = 128256 takes 16 chunks of 8064 columns (the last 7296).
    """
    device = torch.device(device)
    if budget_bytes is None:
        budget_bytes = CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"])
        free = free_memory_bytes(device.type, device.index if device.index is not None else 0)
        if free:
            budget_bytes = min(budget_bytes, free // FREE_MEMORY_FRACTION)
    columns = max(MIN_CHUNK_COLUMNS, int(budget_bytes) // (4 * max(int(tokens), 1)))
    if columns >= vocab:
        return int(vocab)
    n_chunks = math.ceil(vocab / columns)
    columns = math.ceil(vocab / n_chunks)
    columns = math.ceil(columns / COLUMN_ALIGN) * COLUMN_ALIGN
    return int(min(columns, vocab))


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(loss, lse) of cross_entropy(x W^T + b) with label smoothing, softcap and z-loss.

    loss is reduced by ``reduction`` ("mean" over the non-ignored tokens, "sum", or "none": fp32
    [T], 0 for ignored tokens); lse is fp32 [T]. Gradients reach x, weight and bias, from the loss
    and from lse (when the caller uses it).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, z_loss, chunk,
                backend, tile=None):
        ops = ops_for("cross_entropy", backend)
        tiles = sequence_tiles(x.shape[0], tile)
        if len(tiles) == 1:
            loss, lse = ops.linear_cross_entropy_fwd(x, weight, bias, target, ignore_index, label_smoothing, softcap,
                                                     z_loss, chunk)
        else:
            loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
            lse = torch.empty_like(loss)
            for start, end in tiles:
                loss[start:end], lse[start:end] = ops.linear_cross_entropy_fwd(
                    x[start:end], weight, bias, target[start:end], ignore_index, label_smoothing, softcap, z_loss,
                    chunk)
        if reduction == "sum":
            loss = loss.sum()
        elif reduction == "mean":
            # 0 / 0 = nan when every target is ignored, as F.cross_entropy.
            loss = loss.sum() / (target != ignore_index).sum()
        ctx.save_for_backward(x, weight, bias, target, lse)
        ctx.set_materialize_grads(False)
        ctx.options = (ignore_index, reduction, label_smoothing, softcap, z_loss, chunk, backend, tile)
        return loss, lse

    @staticmethod
    @refuse_double_backward("remat.linear_cross_entropy")
    def backward(ctx, grad_loss, grad_lse):
        x, weight, bias, target, lse = ctx.saved_tensors
        ignore_index, reduction, label_smoothing, softcap, z_loss, chunk, backend, tile = ctx.options
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], (
            bias is not None and ctx.needs_input_grad[2])
        if grad_loss is None and grad_lse is None or not (need_dx or need_dw or need_db):
            return (None,) * 12
        tokens = x.shape[0]
        if grad_loss is None:
            per_token = lse.new_zeros(tokens)
        elif reduction == "none":
            per_token = grad_loss.float().contiguous()
        elif reduction == "sum":
            per_token = grad_loss.float().expand(tokens).contiguous()
        else:
            # Ignored tokens never read their entry, so the inf of a batch with no target is unused.
            per_token = (grad_loss.float() / (target != ignore_index).sum()).expand(tokens).contiguous()
        if grad_lse is not None:
            grad_lse = grad_lse.float().contiguous()
        ops = ops_for("cross_entropy", backend)
        options = (ignore_index, label_smoothing, softcap, z_loss, chunk, need_dx, need_dw, need_db)
        tiles = sequence_tiles(tokens, tile)
        if len(tiles) == 1:
            dx, dw, db = ops.linear_cross_entropy_bwd(x, weight, bias, target, lse, per_token, grad_lse, *options)
        else:
            dx, dw, db = _tiled_backward(ops, tiles, x, weight, bias, target, lse, per_token, grad_lse, options)
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None) + (None,) * 9


def _tiled_backward(ops, tiles, x, weight, bias, target, lse, per_token, grad_lse, options):
    """(dx, dW, db) with the op run on each token tile: dx rows written in place, dW and db summed in
    fp32 over the tiles and rounded once (see the module docstring)."""
    need_dx, need_dw, need_db = options[-3:]
    dx = torch.empty_like(x) if need_dx else None
    dw_sum = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_dw else None
    db_sum = torch.zeros(bias.shape, dtype=torch.float32, device=x.device) if need_db else None
    for start, end in tiles:
        rows = slice(start, end)
        dx_tile, dw_tile, db_tile = ops.linear_cross_entropy_bwd(
            x[rows], weight, bias, target[rows], lse[rows], per_token[rows],
            grad_lse[rows] if grad_lse is not None else None, *options)
        if need_dx:
            dx[rows] = dx_tile
        if need_dw:
            dw_sum += dw_tile
        if need_db:
            db_sum += db_tile
        del dx_tile, dw_tile, db_tile
    return (dx, dw_sum.to(weight.dtype) if need_dw else None, db_sum.to(bias.dtype) if need_db else None)
